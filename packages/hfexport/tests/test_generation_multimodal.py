"""Multimodal decomposition (Qwen2-VL, case C04) and the vision-language input preparers."""

from __future__ import annotations

import pytest
import torch

from hfexport.generation import decompose_for_generation, decompose_multimodal, is_multimodal
from hfexport.generation.multimodal import find_multimodal_layout, link_inputs
from hfexport.generation.vision_inputs import (
    mrope_position_ids,
    prepare_mrope_position_ids,
    prepare_vision_grid_inputs,
    vision_grid_settings,
)
from hfexport.inputs import precompute_export_inputs, registered_export_input_preparers
from hfexport.testing import tiny_model
from hfexport.testing.generation import eager_component_callers


@pytest.fixture(scope="module")
def qwen2_vl():
    return tiny_model("case:C04-qwen2vl-vision-grid")


@pytest.fixture(scope="module")
def qwen_parts(qwen2_vl):
    model, inputs = qwen2_vl
    return decompose_multimodal(model, inputs)


def test_is_multimodal_and_layout(qwen2_vl) -> None:
    model, _ = qwen2_vl
    assert is_multimodal(model)
    layout = find_multimodal_layout(model)
    assert layout.encoders == {"image_encoder": model.model.visual}
    assert layout.projectors == {}  # Qwen2-VL merges patches inside its vision tower
    assert layout.language_model is model.model.language_model
    assert layout.lm_head is model.lm_head
    assert layout.embed_tokens is model.model.language_model.embed_tokens
    for text_only in ("llama", "t5"):
        assert not is_multimodal(tiny_model(text_only)[0])


def test_decompose_multimodal_captures_the_encoder_that_generate_runs_first(qwen2_vl, qwen_parts) -> None:
    model, inputs = qwen2_vl
    parts = qwen_parts
    assert list(parts) == ["image_encoder", "embed_tokens", "language_model", "lm_head"]
    encoder, encoder_kwargs = parts["image_encoder"]
    assert encoder is model.model.visual
    assert torch.equal(encoder_kwargs["hidden_states"], inputs["pixel_values"])
    assert encoder_kwargs["cu_seqlens"].tolist() == [0, 16]
    plan = parts.plan
    assert plan.links["image_encoder"]["hidden_states"] == {"from": "prompt", "key": "pixel_values"}
    assert plan.links["image_encoder"]["cu_seqlens"]["from"] == "vision_grid"
    assert plan.features == {"250": {"component": "image_encoder", "output": "pooler_output"}}
    assert plan.mrope == {"spatial_merge_size": 2, "channels": 4}
    _, lm_kwargs = parts["language_model"]
    assert lm_kwargs["inputs_embeds"].shape == (1, 12, 64)
    assert lm_kwargs["position_ids"].shape == (4, 1, 12)
    full = decompose_for_generation(model, inputs)
    assert list(full)[-1] == "decode" and full["decode"][1]["input_ids"].shape == (1, 1)


def test_decompose_multimodal_refuses_text_only_models() -> None:
    model, inputs = tiny_model("llama")
    with pytest.raises(ValueError, match="no multimodal submodules found in LlamaForCausalLM"):
        decompose_multimodal(model, inputs)


def test_link_inputs_names_an_input_of_unknown_origin() -> None:
    with pytest.raises(ValueError, match="cannot tell where input 'x'"):
        link_inputs("image_encoder", {"x": torch.ones(2)}, {"pixel_values": torch.zeros(2)}, {})


def test_mrope_position_ids_match_get_rope_index(qwen2_vl) -> None:
    model, inputs = qwen2_vl
    merge = model.config.vision_config.spatial_merge_size
    ids = inputs["input_ids"]
    # a batch of two: the sample, and the sample left-padded by 3 (one token dropped)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.int64), ids[:, 3:]], dim=1)
    batch_ids = torch.cat([ids, padded])
    mask = torch.cat([torch.ones(1, 12, dtype=torch.int64), (padded != 0).long()])
    types = (batch_ids == model.config.image_token_id).long()
    grid = inputs["image_grid_thw"].repeat(2, 1)
    ours, deltas = mrope_position_ids(batch_ids, types, grid, merge, mask)
    with torch.no_grad():
        theirs, their_deltas = model.model.get_rope_index(
            batch_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask
        )
    assert torch.equal(ours[1:], theirs)
    assert torch.equal(deltas, their_deltas)
    assert ours[0, 1].tolist() == [0, 0, 0, *range(9)]
    with pytest.raises(ValueError, match="more image blocks"):
        mrope_position_ids(ids, inputs["mm_token_type_ids"], torch.zeros(0, 3, dtype=torch.int64), merge)


def test_mrope_preparer_finds_get_rope_index_on_the_inner_model(qwen2_vl, qwen_parts) -> None:
    model, inputs = qwen2_vl
    assert not hasattr(type(model), "get_rope_index")  # it lives on model.model
    names = [p.name for p in registered_export_input_preparers()]
    assert any(n.endswith("prepare_mrope_position_ids") for n in names)
    prepared = prepare_mrope_position_ids(model, dict(inputs))
    # what generate computed at prefill
    assert torch.equal(prepared["position_ids"], qwen_parts["language_model"][1]["position_ids"])
    given = {**inputs, "position_ids": torch.zeros(4, 1, 12, dtype=torch.int64)}
    assert prepare_mrope_position_ids(model, dict(given))["position_ids"].abs().sum() == 0


def test_vision_grid_preparer_gives_the_encoder_the_values_it_would_compute(qwen2_vl) -> None:
    model, inputs = qwen2_vl
    visual = model.model.visual
    settings = vision_grid_settings(visual)
    assert settings is not None and settings["spatial_merge_size"] == 2 and not settings["window_index"]
    assert vision_grid_settings(torch.nn.Linear(2, 2)) is None
    kwargs = {"hidden_states": inputs["pixel_values"], "grid_thw": inputs["image_grid_thw"]}
    prepared = precompute_export_inputs(visual, kwargs)
    assert set(prepared) == {"hidden_states", "grid_thw", "position_ids", "cu_seqlens"}
    assert prepared["position_ids"].shape == (16, 2)
    with torch.no_grad():
        want = visual(**kwargs).pooler_output
        got = visual(**prepared).pooler_output
    assert torch.equal(got, want)
    assert prepare_vision_grid_inputs(torch.nn.Linear(2, 2), dict(kwargs)).keys() == kwargs.keys()


# --- issue 28: LLaVA-style and get_image_features components, second image prompts -------------------


def test_recorder_stores_a_strided_view_input_contiguous() -> None:
    from hfexport.generation.recording import CallRecorder

    linear = torch.nn.Linear(4, 3)
    hidden = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)
    view = hidden[:, 1:]  # LLaVA drops the CLS row before its projector: a strided view
    assert not view.is_contiguous()
    with CallRecorder({"projector": linear}) as recorder:
        linear(view)
    recorded = recorder.calls["projector"][0]["input"]
    assert recorded.is_contiguous() and torch.equal(recorded, view)


def test_a_config_carrying_plain_module_returns_a_named_output() -> None:
    from transformers import PretrainedConfig

    from hfexport.generation.parts import OUTPUT_NAME, ComponentModule, exportable_module

    projector = torch.nn.Linear(4, 3)
    projector.config = PretrainedConfig()
    wrapped = exportable_module(projector, PretrainedConfig())
    assert isinstance(wrapped, ComponentModule) and wrapped.config is projector.config
    out = wrapped(input=torch.ones(2, 4))
    assert list(out) == [OUTPUT_NAME] and tuple(out[OUTPUT_NAME].shape) == (2, 3)


def test_image_feature_rows_concatenates_per_image_features() -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from hfexport.generation.multimodal import image_feature_rows

    per_image = (torch.ones(4, 8), 2 * torch.ones(1, 4, 8))
    rows = image_feature_rows(BaseModelOutputWithPooling(pooler_output=per_image))
    assert tuple(rows.shape) == (8, 8) and rows[:4].eq(1).all() and rows[4:].eq(2).all()
    assert tuple(image_feature_rows(torch.zeros(2, 3, 8)).shape) == (6, 8)
    with pytest.raises(TypeError, match="holds no feature tensor"):
        image_feature_rows({"a": 1})


def test_internvl_image_features_become_one_component() -> None:
    # InternVL pixel-shuffles the vision tower's output before its projector: the projector's input
    # equals no recorded output, so the model's own get_image_features is the image component
    from hfexport.generation.multimodal import ImageFeatures

    model, inputs = tiny_model("internvl", "image-text-to-text")
    parts = decompose_multimodal(model, inputs)
    assert list(parts)[:1] == ["image_encoder"] and "multi_modal_projector" not in parts
    module, kwargs = parts["image_encoder"]
    assert isinstance(module, ImageFeatures) and list(kwargs) == ["pixel_values"]
    assert parts.plan.links["image_encoder"] == {"pixel_values": {"from": "prompt", "key": "pixel_values"}}
    token = str(model.config.image_token_id)
    assert parts.plan.features == {token: {"component": "image_encoder", "output": ""}}
    rows = module(**kwargs)
    assert tuple(rows.shape) == (
        int((inputs["input_ids"] == int(token)).sum()),
        model.config.text_config.hidden_size,
    )


def test_other_image_prompt_changes_image_count_or_size_with_matching_tokens(qwen2_vl) -> None:
    from hfexport.generation.image_prompts import other_image_prompt

    model, inputs = tiny_model("llava")
    other = other_image_prompt(model, inputs)
    token = model.config.image_token_id
    assert tuple(other["pixel_values"].shape) == (3, 3, 32, 32) and tuple(other["input_ids"].shape) == (3, 29)
    assert (other["input_ids"] == token).sum(-1).tolist() == [16, 16, 16]
    qwen, qwen_inputs = qwen2_vl
    other = other_image_prompt(qwen, qwen_inputs)
    assert other["image_grid_thw"].tolist() == [[1, 8, 6]] and tuple(other["pixel_values"].shape) == (
        48,
        1176,
    )
    assert int((other["input_ids"] == qwen.config.image_token_id).sum()) == 12
    assert torch.equal(other["mm_token_type_ids"], (other["input_ids"] == qwen.config.image_token_id).long())
    with pytest.raises(ValueError, match="hold no input_ids"):
        other_image_prompt(model, {"pixel_values": inputs["pixel_values"]})


@pytest.mark.extended  # 16-100 s: the long tail (nox -s integration)
def test_florence2_splits_around_its_text_encoder_and_generates_like_generate() -> None:
    # issue 28: Florence-2's language model is an encoder-decoder (BART): generate() merges the
    # image features into the text encoder's inputs_embeds and never calls the BartModel forward
    from hfexport.generation import GenerationRunner, compare_with_generate

    model, inputs = tiny_model("florence2", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == [
        "image_encoder",
        "multi_modal_projector",
        "embed_tokens",
        "encoder",
        "prefill",
        "decode",
    ]
    assert parts["encoder"][0] is model.get_encoder() and set(parts["encoder"][1]) >= {"inputs_embeds"}
    token = str(model.config.image_token_id)
    assert parts.plan.features == {token: {"component": "multi_modal_projector", "output": ""}}
    assert parts.plan.token_ids["forced_eos_token_id"] == [model.generation_config.forced_eos_token_id]
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    parity = compare_with_generate(runner, model, inputs, max_new_tokens=3)
    # generate() continues the given decoder prompt after the start token and forces EOS last
    assert parity.sequences.shape[1] == 1 + inputs["decoder_input_ids"].shape[1] + 3
    assert parity.sequences[:, -1].tolist() == [model.generation_config.forced_eos_token_id] * 2
    assert parity.tokens_equal, (parity.sequences.tolist(), parity.reference.tolist())
    assert parity.max_logit_diff <= 1e-5


def test_deepseek_vl_aligner_is_its_projector_and_generates_like_generate() -> None:
    # issue 28: DeepSeek-VL's projector is the attribute "aligner"; without it in the layout the
    # merged rows matched no recorded output (decompose failed)
    from hfexport.generation import GenerationRunner, compare_with_generate

    model, inputs = tiny_model("deepseek_vl", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    assert list(parts)[:2] == ["image_encoder", "multi_modal_projector"]
    assert parts["multi_modal_projector"][0] is model.model.aligner
    token = str(model.config.image_token_id)
    assert parts.plan.features == {token: {"component": "multi_modal_projector", "output": ""}}
    parity = compare_with_generate(
        GenerationRunner(parts.plan, eager_component_callers(parts, model.config)),
        model,
        inputs,
        max_new_tokens=4,
    )
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5


@pytest.mark.parametrize(
    ("model_type", "rows_per_image"),
    [("llava_next", 36), pytest.param("mistral3", 4, marks=pytest.mark.extended)],  # 10 s each
)
def test_image_sizes_read_as_values_give_a_per_image_encoder(model_type, rows_per_image) -> None:
    # issue 28: LLaVA-NeXT's anyres picks each image's tile grid and crop from image_sizes, Pixtral
    # (Mistral3) its patch grid; taking them as a graph input failed capture ("Could not guard on
    # data-dependent expression"). The size is a constant of a one-image component instead, which
    # the runner calls per image (so the image count stays free) and which refuses another size.
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.image_prompts import other_image_prompt
    from hfexport.generation.multimodal import SizedImageFeatures

    model, inputs = tiny_model(model_type, "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    module, kwargs = parts["image_encoder"]
    assert isinstance(module, SizedImageFeatures) and list(kwargs) == ["pixel_values"]
    assert tuple(kwargs["pixel_values"].shape) == (1, *inputs["pixel_values"].shape[1:])
    assert parts.plan.per_image == {"image_encoder": {"image_sizes": [32, 32]}}
    program = torch.export.export(module, (), dict(kwargs), strict=False)
    with torch.no_grad():
        assert torch.equal(program.module()(**kwargs), module(**kwargs))
        assert tuple(module(**kwargs).shape) == (rows_per_image, model.config.text_config.hidden_size)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    other = other_image_prompt(model, inputs)  # one more image, a longer prompt
    for prompt in (inputs, other):
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=3)
        assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, prompt["input_ids"].shape
    resized = {**inputs, "image_sizes": torch.tensor([[32, 32], [32, 16]])}
    with pytest.raises(ValueError, match=r"exported for images of size \[32, 32\].* of size \[\[32, 16\]\]"):
        runner.generate(max_new_tokens=1, **resized)
    if inputs["pixel_values"].dim() == 5:  # tiles of another pixel size: eager refuses them too
        pixels = inputs["pixel_values"]
        larger = torch.nn.functional.pad(pixels.flatten(0, 1), (0, 16, 0, 16)).unflatten(0, pixels.shape[:2])
        with pytest.raises(
            ValueError, match=r"exported for tiles of \[32, 32\] pixels .* tiles of \[48, 48\]"
        ):
            runner.generate(max_new_tokens=1, **{**inputs, "pixel_values": larger})


def test_an_image_prompted_encoder_decoder_generates_from_pixel_values_alone() -> None:
    # issue 28: VisionEncoderDecoder's prompt is an image and a decoder prompt, no input_ids;
    # recording refused it ("generation inputs must be a dict with input_ids") and the tiny model
    # had no decoder start for generate() to begin with
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.image_prompts import other_image_prompt

    model, inputs = tiny_model("vision-encoder-decoder", "image-text-to-text")
    assert sorted(inputs) == ["decoder_input_ids", "pixel_values"]
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["encoder", "prefill", "decode"] and "pixel_values" in parts["encoder"][1]
    assert parts.plan.token_ids["decoder_start_token_id"] == 0
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    other = other_image_prompt(model, inputs)
    assert {k: tuple(v.shape) for k, v in other.items()} == {
        "pixel_values": (3, 3, 32, 32),
        "decoder_input_ids": (3, 10),
    }
    parity = compare_with_generate(runner, model, other, max_new_tokens=3)
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5
    assert parity.sequences.shape[1] == other["decoder_input_ids"].shape[1] + 3
    with pytest.raises(ValueError, match="the encoder's own inputs are needed"):
        runner.generate(None, max_new_tokens=1)


@pytest.mark.extended  # 28 s under load (T5Gemma 2's generate records three components)
def test_an_encoder_decoder_prefill_taking_the_images_gets_them_from_the_runner() -> None:
    # issue 28: T5Gemma 2's prefill (the whole model's first decoder step) takes pixel_values next
    # to the encoder outputs, as generate() passes them; the runner fed only the decoder ids and
    # mask (KeyError: "component 'prefill' takes input 'pixel_values'")
    from hfexport.generation import GenerationRunner, compare_with_generate

    model, inputs = tiny_model("t5gemma2", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["encoder", "prefill", "decode"] and "pixel_values" in parts["prefill"][1]
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    parity = compare_with_generate(runner, model, inputs, max_new_tokens=3)
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5


def test_a_text_only_prompt_skips_the_image_components_like_generate() -> None:
    # a text-only turn of a vision-language chat: generate() embeds the text alone; the runner
    # refused it ("the image_encoder needs 'pixel_values'"). Now the encoder and projector are left
    # out, and placeholder tokens without their image still raise, naming the missing input.
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.image_prompts import text_only_prompt

    model, inputs = tiny_model("llava", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    placeholders = [int(t) for t in parts.plan.features]
    text = text_only_prompt(inputs, placeholders)
    assert set(text) == {"input_ids", "attention_mask"}
    assert text["input_ids"].shape == inputs["input_ids"].shape
    assert not torch.isin(text["input_ids"], torch.tensor(placeholders)).any()
    parity = compare_with_generate(runner, model, text, max_new_tokens=4)
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5
    with pytest.raises(
        ValueError, match=r"placeholder tokens .* none of the image inputs \['pixel_values'\]"
    ):
        runner.generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=1)


def test_a_text_only_prompt_refuses_a_language_model_taking_image_features_as_inputs() -> None:
    # Qwen3-VL's language model takes the DeepStack features of the image encoder as inputs of
    # its own: the exported language model has no image-free path, which the error says
    from hfexport.generation import GenerationRunner
    from hfexport.generation.image_prompts import text_only_prompt

    model, inputs = tiny_model("qwen3_vl", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    text = text_only_prompt(inputs, [int(t) for t in parts.plan.features])
    with pytest.raises(ValueError, match=r"takes 'deepstack_visual_embeds.0' from the image_encoder"):
        runner.generate(max_new_tokens=1, **text)
    with pytest.raises(ValueError, match="placeholder tokens only"):
        text_only_prompt({"input_ids": torch.tensor([[7, 7]])}, [7])


@pytest.mark.extended  # 15-30 s: decomposition, export and generation of tiny MiniCPM-V
def test_packed_patch_grids_read_as_values_give_a_per_image_encoder() -> None:
    # issue 28: MiniCPM-V packs every image's patches side by side in one row and reads each
    # image's patch grid (target_sizes) as values (window index, position ids, the merger's split);
    # the grid as a graph input failed capture ("Could not extract specialized integer from
    # data-dependent expression u0"), and a constant grid tensor too (a lifted constant is a fake
    # tensor). The grid is a constant whose derived values are computed outside the trace, the
    # component takes one image's share of the row, and the runner cuts the prompt's row per image.
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.image_prompts import other_image_prompt
    from hfexport.generation.multimodal import GridImageFeatures

    model, inputs = tiny_model("minicpmv4_6", "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    module, kwargs = parts["image_encoder"]
    assert isinstance(module, GridImageFeatures) and list(kwargs) == ["pixel_values"]
    assert tuple(kwargs["pixel_values"].shape) == (1, 3, 8, 64 * 8)  # one 8x8-patch image of the row
    assert parts.plan.per_image == {"image_encoder": {"grid": [8, 8], "grid_input": "target_sizes"}}
    program = torch.export.export(module, (), dict(kwargs), strict=False)
    with torch.no_grad():
        assert torch.equal(program.module()(**kwargs), module(**kwargs))
        assert tuple(module(**kwargs).shape) == (4, model.config.text_config.hidden_size)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    other = other_image_prompt(model, inputs)  # one more image, a longer prompt
    assert other["target_sizes"].shape[0] == 3
    for prompt in (inputs, other):
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=3)
        assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, prompt["input_ids"].shape
    regridded = {**inputs, "target_sizes": torch.tensor([[8, 8], [4, 16]], dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"exported for images of patch grid \[8, 8\] .* \[\[4, 16\]\]"):
        runner.generate(max_new_tokens=1, **regridded)


def test_split_packed_images_cuts_each_layout_by_its_grids() -> None:
    from hfexport.generation.multimodal import split_packed_images

    grids = torch.tensor([[2, 2], [2, 4]])
    flat = torch.arange(12 * 3).reshape(12, 3)  # image_grid_hw: patches one after the other
    pieces = split_packed_images({"pixel_values": flat}, "image_grid_hw", grids)
    assert [p["pixel_values"].tolist() for p in pieces] == [flat[:4].tolist(), flat[4:].tolist()]
    row = torch.arange(2 * 12 * 2).reshape(1, 2, 12 * 2)  # target_sizes: patches 2 wide along the row
    pieces = split_packed_images({"pixel_values": row}, "target_sizes", grids)
    assert [tuple(p["pixel_values"].shape) for p in pieces] == [(1, 2, 8), (1, 2, 16)]
    assert torch.equal(torch.cat([p["pixel_values"] for p in pieces], dim=-1), row)
    with pytest.raises(ValueError, match="not a whole number per patch of the 12 patches"):
        split_packed_images({"pixel_values": flat[:11]}, "image_grid_hw", grids)


def test_grid_values_are_numbers_at_capture() -> None:
    # issue 28: a tower reading its patch grid as values (tolist, boolean indexing by a mask built
    # from it: MiniCPM-V's window index) captured from a constant grid tensor failed with
    # GuardOnDataDependentSymNode; the grid's derived values are computed outside the trace
    from hfexport.generation.multimodal import GridImageFeatures

    class Tower(torch.nn.Module):
        def get_image_features(self, pixel_values, target_sizes):
            (height, width), *_ = target_sizes.tolist()
            index = torch.nn.functional.pad(torch.arange(height * width), (0, 2), value=-100)
            kept = index[index != -100]  # a size only the values tell
            bounds = torch.unique_consecutive(torch.tensor([0, 0, height * width]))  # as its windows
            lengths = (bounds[1:] - bounds[:-1]).tolist()  # as MiniCPM-V's per-image attention split
            (rows,) = torch.split(pixel_values.flatten(1)[:, kept].T, lengths)
            return rows * target_sizes.prod()

    module = GridImageFeatures(Tower(), {}, ["pixel_values"], "target_sizes", (2, 3))
    pixels = torch.randn(1, 1, 6)
    program = torch.export.export(module, (), {"pixel_values": pixels}, strict=False)
    assert torch.equal(program.module()(pixel_values=pixels), pixels.flatten(1).T * 6)


def test_a_causal_lm_inside_the_model_gives_its_base_model_and_head() -> None:
    # issue 28: Nemotron-H Omni's language_model is a causal LM whose decoder is its base model
    # and whose head is not on the multimodal model: the split took the whole causal LM as the
    # language model (logits, no last_hidden_state) and found no lm_head (runner: KeyError)
    from hfexport.generation.multimodal import find_multimodal_layout

    model, _ = tiny_model("nemotron_h_omni", "image-text-to-text")
    layout = find_multimodal_layout(model)
    assert layout.language_model is model.language_model.model
    assert layout.lm_head is model.language_model.lm_head


@pytest.mark.parametrize(
    ("model_type", "getter", "image_inputs"),
    [
        # decompose: cannot tell where input 'pixel_values' (8, 3, 32, 32) of the image_encoder
        # comes from (the frames are flattened before the tower, and there is no get_image_features)
        (
            "instructblipvideo",
            "get_video_features",
            ["pixel_values", "qformer_input_ids", "qformer_attention_mask"],
        ),
        # decompose: the sample inputs give ['high_res_pixel_values'], which ComponentModule.forward
        # does not take (an input without a role)
        pytest.param(
            "deepseek_vl_hybrid",
            "get_image_features",
            ["pixel_values", "high_res_pixel_values"],
            marks=pytest.mark.extended,  # 6-15 s: its SAM tower
        ),
    ],
)
def test_video_and_two_view_image_features_become_one_component(model_type, getter, image_inputs) -> None:
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.multimodal import ImageFeatures

    model, inputs = tiny_model(model_type, "image-text-to-text")
    parts = decompose_for_generation(model, inputs)
    module, kwargs = parts["image_encoder"]
    assert isinstance(module, ImageFeatures) and module.getter == getter
    assert sorted(kwargs) == sorted(image_inputs)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    parity = compare_with_generate(runner, model, inputs, max_new_tokens=3)
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5


def test_head_input_divisor_finds_one_constant_factor_or_refuses() -> None:
    from hfexport.generation.multimodal import head_input_divisor

    hidden = torch.randn(2, 5, 8)
    assert head_input_divisor(hidden, hidden[:, -1:].clone()) is None  # the head reads them as they are
    assert head_input_divisor(hidden, hidden[:, -1:] / 24.0) == 24.0
    assert head_input_divisor(hidden, hidden / 0.5) == 0.5
    with pytest.raises(ValueError, match="other than one constant factor"):
        head_input_divisor(hidden, hidden[:, -1:] + 1.0)


@pytest.fixture(scope="module")
def inkling():
    model, inputs = tiny_model("inkling_mm_model", "image-text-to-text")
    return model, inputs, decompose_for_generation(model, inputs)


def test_a_hidden_state_scale_before_the_head_is_part_of_the_lm_head_component(inkling) -> None:
    # issue 28: Inkling divides the last hidden state by logits_mup_width_multiplier (24 in the
    # tiny model) between its language model and lm_head; the head alone gave the first generated
    # token's logits 24x too large (greedy tokens equal, so the parity of tokens hid it)
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.generation.multimodal import ScaledLMHead

    model, inputs, parts = inkling
    head, _ = parts["lm_head"]
    assert isinstance(head, ScaledLMHead) and head.head is model.lm_head
    assert head.divisor == model.config.text_config.logits_mup_width_multiplier == 24.0
    parity = compare_with_generate(
        GenerationRunner(parts.plan, eager_component_callers(parts, model.config)),
        model,
        inputs,
        max_new_tokens=3,
    )
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, parity.max_logit_diff


def test_hybrid_sliding_layers_are_captured_as_hybrid_full_layers_with_the_same_logits(inkling) -> None:
    # issue 28: Inkling's sliding layers are LinearAttentionAndSlidingWindowAttentionLayer (conv
    # states + a sliding-window key/value cache whose fill level is a Python int); captured as is,
    # the exported decode kept the sample's cache length ("Guard failed: attention_mask.size()[1] <= 25")
    import copy

    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    from hfexport.registry import apply_patches
    from hfexport.workarounds.generation import BACKEND

    model, _, parts = inkling
    text_config = model.config.get_text_config()
    assert "hybrid_sliding" in text_config.layer_types
    _, decode = parts["decode"]
    assert all(type(layer) is LinearAttentionAndFullAttentionLayer for layer in decode["cache"].layers)
    assert all(len(layer.conv_states) == layer.number_of_states for layer in decode["cache"].layers)
    with torch.no_grad():
        got = model(**copy.deepcopy(decode)).logits
        # the same step through the model's own hybrid sliding-window cache, filled by the prefill
        own = DynamicCache(config=text_config)
        _, lm_kwargs = parts["language_model"]
        model.model.language_model(**{**lm_kwargs, "cache": own, "use_cache": True})
        assert type(own.layers[0]).__name__ == "LinearAttentionAndSlidingWindowAttentionLayer"
        want = model(**{**decode, "cache": own}).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with apply_patches(BACKEND):
        layers = DynamicCache(config=text_config).layers
        assert all(type(layer) is LinearAttentionAndFullAttentionLayer for layer in layers)
