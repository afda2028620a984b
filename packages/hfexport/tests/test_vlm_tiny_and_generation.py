"""Tiny vision-language models of the zoo sweep and their generation plumbing (issue 28, vlmb types)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hfexport.conventions.roles import batch_axis, input_role
from hfexport.generation.image_prompts import other_image_prompt
from hfexport.testing import tiny_model
from hfexport.testing.generation import eager_component_callers
from hfexport.tiny.catalog import shrunk_config

TASK = "image-text-to-text"


def test_windowed_vision_tower_keeps_whole_merged_windows():
    # Qwen2.5-VL: window_size counts pixels (112 = patch 14 x merge 2 x 4); the swin rule alone
    # left 4 pixels, a window of 4 // 2 // 8 = 0 merged patches (ZeroDivisionError)
    vision = shrunk_config("qwen2_5_vl").vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.window_size) == (8, 2, 32)
    assert vision.window_size // vision.spatial_merge_size // vision.patch_size == 2


def test_vision_merger_output_is_the_language_model_width():
    for model_type in ("qwen2_5_vl", "qwen3_vl"):
        config = shrunk_config(model_type)
        assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 64, model_type


def test_anyres_grid_pinpoints_scale_with_the_tiny_vision_tower():
    # LLaVA-NeXT's [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]] over 336-pixel tiles
    config = shrunk_config("llava_next")
    assert config.vision_config.image_size == 32
    assert config.image_grid_pinpoints == [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]


def test_anyres_inputs_tile_each_image_and_count_its_tokens():
    model, inputs = tiny_model("llava_next", TASK, check_eager=True)
    # a 32x32 image on the 32x64 grid resolution: the base tile and 1x2 tiles
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "pixel_values": (2, 3, 3, 32, 32),
        "image_sizes": (2, 2),
        "input_ids": (2, 44),
        "attention_mask": (2, 44),
    }
    assert inputs["image_sizes"].tolist() == [[32, 32], [32, 32]]
    # 16 base-tile features, then the 4x8 tile grid unpadded to the 4x4 image, one newline per row
    image_token = model.config.image_token_id
    assert (inputs["input_ids"] == image_token).sum(dim=1).tolist() == [36, 36]
    second = other_image_prompt(model, inputs)
    assert tuple(second["pixel_values"].shape) == (3, 3, 3, 32, 32)
    assert tuple(second["image_sizes"].shape) == (3, 2)
    with torch.no_grad():
        logits = model(**second).logits
    assert tuple(logits.shape) == (3, 49, 256) and torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "minimax_m3_vl"])
def test_patch_grid_models_build_with_one_image_of_four_tokens(model_type):
    # minimax_m3_vl: its vision config names the channels num_channels (not in_channels)
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    patch_dim = 3 * 2 * 8 * 8  # channels x temporal patch x 8x8 patch
    assert shapes["pixel_values"] == (16, patch_dim) and inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 4
    with torch.no_grad():
        logits = model(**inputs).logits
    assert tuple(logits.shape) == (1, 12, 256) and float(logits.abs().max()) > 0


def test_grid_prompt_without_vision_start_and_end_tokens():
    # Qwen2.5-Omni's thinker marks images by their image tokens alone
    model, inputs = tiny_model("qwen2_5_vl", TASK)

    class NoMarkers:  # the config as the thinker's: no vision start/end token ids
        def __getattr__(self, name):
            if name in ("vision_start_token_id", "vision_end_token_id"):
                return None
            return getattr(model.config, name)

    second = other_image_prompt(SimpleNamespace(config=NoMarkers()), inputs)
    # an 8x6 patch grid: 12 merged image tokens between 5 and 4 text tokens
    assert second["image_grid_thw"].tolist() == [[1, 8, 6]]
    assert tuple(second["input_ids"].shape) == (1, 21)
    assert int((second["input_ids"] == model.config.image_token_id).sum()) == 12


def test_image_sizes_are_per_image_values():
    role = input_role("image_sizes", 2)
    assert role is not None and role.kind == "patch_grid" and role.modality == "image"
    assert batch_axis("image_sizes", 2) == 0


def test_tapped_vision_layers_stay_inside_the_tiny_tower():
    # VipLLaVA taps (-2, -5, -8, -11, 6) of 24 layers; two layers give hidden states -3 .. 2
    config = shrunk_config("vipllava")
    assert config.vision_config.num_hidden_layers == 2
    assert list(config.vision_feature_layers) == [-2, -3, -3, -3, 2]
    model, inputs = tiny_model("vipllava", TASK, check_eager=True)
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 2 * 16


def test_step3p7_has_a_sliding_window_for_its_sliding_mask():
    text = shrunk_config("step3p7").text_config
    assert (text.sliding_window, text.layer_types) == (32, ["sliding_attention", "full_attention"])


def test_deepstack_inputs_are_linked_and_fed_by_the_runner():
    # Qwen3-VL's language model also takes visual_pos_masks and one deepstack_visual_embeds
    # tensor per tapped vision layer; without links the runner could not supply them (KeyError)
    from hfexport.generation import GenerationRunner, compare_with_generate, decompose_for_generation
    from hfexport.generation.plan import GenerationPlan

    model, inputs = tiny_model("qwen3_vl", TASK)
    parts = decompose_for_generation(model, inputs)
    taps = 2  # vision layers 0 and 1 tapped (of [8, 16, 24] by default)
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    assert parts.plan.language_inputs == {
        "visual_pos_masks": {"from": "placeholders"},
        **{
            f"deepstack_visual_embeds.{i}": {
                "from": "component",
                "component": "image_encoder",
                "output": f"deepstack_features.{i}",
                "drop_first": False,
            }
            for i in range(taps)
        },
    }
    plan = GenerationPlan.from_dict(parts.plan.to_dict())
    assert plan.language_inputs == parts.plan.language_inputs
    runner = GenerationRunner(plan, eager_component_callers(parts, model.config))
    for prompt in (inputs, other_image_prompt(model, inputs)):
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=3)
        assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, parity.max_logit_diff


@pytest.mark.extended  # 15-17 s on 2 loaded cores: a tiny model's generate() run
def test_an_encoder_reading_the_image_is_the_encoder_of_an_encoder_decoder():
    # T5Gemma 2's text encoder holds the vision tower (get_encoder(modality="image") returns it):
    # split as a multimodal model, the image and text encoders were one module twice (ValueError)
    from hfexport.generation import decompose_for_generation
    from hfexport.generation.multimodal import find_multimodal_layout, is_multimodal

    model, inputs = tiny_model("t5gemma2", TASK)
    assert model.get_encoder(modality="image") is model.get_encoder()
    assert not is_multimodal(model) and find_multimodal_layout(model).encoders == {}
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["encoder", "prefill", "decode"]
    encoder, kwargs = parts["encoder"]
    assert encoder is model.get_encoder()
    assert torch.equal(kwargs["pixel_values"], inputs["pixel_values"])


@pytest.mark.extended  # 15-17 s on 2 loaded cores: a tiny model's generate() run
def test_omni_thinker_under_an_image_prompt_leaves_its_audio_encoder_out():
    # Qwen3-Omni's thinker: the default config lacks the vision start/end ids get_rope_index reads
    # (overlay), generate() never runs the audio encoder for an image prompt (it was an error), and
    # the language model takes float32 M-RoPE positions, which the runner computes as int64
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model("qwen3_omni_moe_thinker", TASK, check_eager=True)
    assert (model.config.vision_start_token_id, model.config.vision_end_token_id) == (250, 249)
    assert int((inputs["input_ids"] == 250).sum()) == 1 and int((inputs["input_ids"] == 249).sum()) == 1
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["image_encoder", "embed_tokens", "language_model", "lm_head", "decode"]
    positions = parts["language_model"][1]["position_ids"]
    assert positions.dtype == torch.float32 and tuple(positions.shape) == (4, 1, 12)


def test_component_inputs_recorded_as_float_are_cast_from_integers():
    from hfexport.generation.plan import ComponentIO

    io = ComponentIO.from_kwargs(
        {"position_ids": torch.zeros(4, 1, 3), "mask": torch.ones(1, 3, dtype=torch.bool)}, ["out"]
    )
    values = {"position_ids": torch.arange(12).reshape(4, 1, 3), "mask": torch.ones(1, 3, dtype=torch.bool)}
    built = io.build(values.__getitem__)
    assert built["position_ids"].dtype == torch.float32
    assert built["position_ids"].tolist() == values["position_ids"].float().tolist()
    assert built["mask"].dtype == torch.bool


def test_block_diagonal_mask_keeps_rows_in_their_packed_segment():
    from hfexport.workarounds.vision_language import block_diagonal_mask

    mask = block_diagonal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)
    segment = torch.tensor([0, 0, 1, 1, 1])
    assert torch.equal(mask, segment[:, None] == segment[None, :])
    assert bool(block_diagonal_mask(torch.tensor([0, 3], dtype=torch.int32), 3).all())


class _PackedAttention(torch.nn.Module):
    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        from hfexport.workarounds.vision_language import block_diagonal_mask

        return block_diagonal_mask(cu_seqlens, hidden.shape[0]).float() @ hidden


def test_block_diagonal_mask_keeps_a_one_segment_sample_dynamic():
    # captured on one window ([0, length]), the mask once specialised the boundary count to 2:
    # ExecuTorch planned exaone4_5's / hyperclovax_vision_v2's cu_window_seqlens for one window and
    # refused the second prompt's 4 ("dimension 0 is 5, above the upper bound 2")
    from torch.export import Dim

    hidden, cu = torch.randn(16, 3), torch.tensor([0, 16], dtype=torch.int32)
    bound = Dim.AUTO(min=1, max=4096)
    program = torch.export.export(_PackedAttention(), (hidden, cu), dynamic_shapes=({0: bound}, {0: bound}))
    boundaries = [n for n in program.graph.nodes if n.op == "placeholder"][1].meta["val"].shape[0]
    assert isinstance(boundaries, torch.SymInt)
    other, cu_other = torch.randn(10, 3), torch.tensor([0, 4, 6, 10], dtype=torch.int32)
    torch.testing.assert_close(program.module()(other, cu_other), _PackedAttention()(other, cu_other))


def test_windowed_vision_attention_exports_for_any_window_count():
    # Qwen2.5-VL attends per window in a Python loop over torch.split(lengths.tolist()): captured as
    # is, the program keeps the sample's window count (Guard failed: cu_window_seqlens.size()[0] ...)
    from torch.export import Dim

    from hfexport.capture import capture_patch_key
    from hfexport.registry import apply_patches
    from hfexport.workarounds import vision_language

    model, _ = tiny_model("qwen2_5_vl", TASK)
    attention = model.model.visual.blocks[0].attn
    head_dim = attention.head_dim

    def sample(length, bounds, seed):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(length, attention.dim, generator=gen)
        angles = torch.randn(length, head_dim, generator=gen)
        return hidden, torch.tensor(bounds, dtype=torch.int32), (angles.cos(), angles.sin())

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, hidden, cu_seqlens, cos, sin):
            return self.attention(hidden, cu_seqlens, position_embeddings=(cos, sin))

    hidden, bounds, (cos, sin) = sample(8, [0, 2, 5, 8], 0)  # three windows (no 0/1 specialisation)
    # torch.export's own 0/1 rule: the inner boundaries (cuts - 2) stay dynamic from 2 on
    rows, cuts = Dim("rows", min=2), Dim("cuts", min=4)
    shapes = {"hidden": {0: rows}, "cu_seqlens": {0: cuts}, "cos": {0: rows}, "sin": {0: rows}}
    key = capture_patch_key(attention)
    assert key == vision_language.KEY == "capture.vision_language"
    with apply_patches(key), torch.no_grad():
        program = torch.export.export(Wrapped(), (hidden, bounds, cos, sin), dynamic_shapes=shapes)
    for length, cut in (
        (8, [0, 2, 5, 8]),
        (12, [0, 4, 8, 12]),
        (12, [0, 3, 6, 9, 12]),
        (14, [0, 2, 4, 9, 11, 14]),
    ):
        hidden, bounds, (cos, sin) = sample(length, cut, length)
        with torch.no_grad():
            expected = attention(hidden, bounds, position_embeddings=(cos, sin))
            got = program.module()(hidden, bounds, cos, sin)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_packed_attention_patch_matches_every_projection_layout():
    # Qwen2.5-VL projects q, k, v with one fused qkv; Qwen2.5-Omni's vision tower with three;
    # EXAONE 4.5's fused qkv holds fewer key/value heads than query heads (grouped-query)
    from hfexport.registry import apply_patches
    from hfexport.workarounds import vision_language

    omni, _ = tiny_model("qwen2_5_omni_thinker", TASK)
    qwen, _ = tiny_model("qwen2_5_vl", TASK)
    exaone, _ = tiny_model("exaone4_5", TASK)
    grouped = exaone.model.visual.blocks[0].attn
    assert grouped.num_key_value_heads < grouped.num_heads
    for attention in (omni.model.visual.blocks[0].attn, qwen.model.visual.blocks[0].attn, grouped):
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(12, attention.dim, generator=gen)
        angles = torch.randn(12, attention.head_dim, generator=gen)
        bounds = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
        with torch.no_grad():
            expected = attention(hidden, bounds, position_embeddings=(angles.cos(), angles.sin()))
            with apply_patches(vision_language.KEY):
                got = attention(hidden, bounds, position_embeddings=(angles.cos(), angles.sin()))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "model_type",
    # InstructBLIP (its Q-Former instruction a dynamic text axis of the image features): 28 s loaded
    ["blip-2", pytest.param("instructblip", marks=pytest.mark.extended)],
)
def test_inner_language_model_generate_is_split_and_generates_like_generate(model_type):
    # BLIP-2's / InstructBLIP's generate() encodes the image, merges it at the image tokens and calls
    # its language model's generate(), never its own forward (was: "called the top-level forward 0
    # time(s)"); the inner OPTForCausalLM's forward calls are the prefill and decode steps
    from hfexport.generation import GenerationRunner, compare_with_generate, decompose_for_generation

    model, inputs = tiny_model(model_type, TASK)
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["image_encoder", "embed_tokens", "language_model", "lm_head", "decode"]
    assert parts["decode"][0] is model.language_model
    assert parts["language_model"][0] is model.language_model.get_decoder()
    assert list(parts.plan.features) == [str(model.config.image_token_id)]
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    for prompt in (inputs, other_image_prompt(model, inputs)):
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=3)
        assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, parity.max_logit_diff


def test_packed_attention_patch_matches_minimax_m3_vl_and_exports_for_any_image_count():
    # MiniMax-M3-VL attends per image in a loop over torch.split(lengths.tolist()): the capture read
    # each length as an unbacked size, which ExecuTorch's memory planning could not guard on (u223 < 1)
    from torch.export import Dim

    from hfexport.capture import capture_patch_key
    from hfexport.registry import apply_patches
    from hfexport.workarounds import vision_language

    model, _ = tiny_model("minimax_m3_vl", TASK)
    attention = next(m for m in model.modules() if type(m).__name__ == "MiniMaxM3VLVisionAttention")
    assert capture_patch_key(attention) == vision_language.KEY

    def sample(bounds, seed):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(bounds[-1], attention.embed_dim, generator=gen)
        angles = torch.randn(bounds[-1], attention.head_dim, generator=gen)
        return hidden, torch.tensor(bounds, dtype=torch.int32), angles.cos(), angles.sin()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, hidden, cu_seqlens, cos, sin):
            return self.attention(hidden, cu_seqlens, position_embeddings=(cos, sin))[0]

    rows, cuts = Dim("rows", min=2), Dim("cuts", min=4)
    shapes = {"hidden": {0: rows}, "cu_seqlens": {0: cuts}, "cos": {0: rows}, "sin": {0: rows}}
    with apply_patches(vision_language.KEY), torch.no_grad():
        program = torch.export.export(Wrapped(), sample([0, 2, 5, 8], 0), dynamic_shapes=shapes)
    for bounds in ([0, 2, 5, 8], [0, 4, 8, 12], [0, 3, 6, 9, 12]):
        hidden, cu, cos, sin = sample(bounds, len(bounds))
        with torch.no_grad():
            expected = attention(hidden, cu, position_embeddings=(cos, sin))[0]
            got = program.module()(hidden, cu, cos, sin)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_paligemma_language_model_traces_the_mask_eager_sdpa_runs():
    # issue 28: PaliGemma's Gemma attends bidirectionally (use_bidirectional_attention) but builds a
    # causal mask, which eager SDPA drops on an unpadded prompt (every key seen) and a trace keeps:
    # the exported language model was causal where generate() is not (0.63 apart)
    from hfexport.capture import capture_patch_key
    from hfexport.registry import apply_patches
    from hfexport.workarounds import vision_language

    model, _ = tiny_model("paligemma", TASK)
    language_model = model.model.language_model
    assert language_model.config.use_bidirectional_attention
    key = capture_patch_key(language_model)
    assert key == vision_language.KEY

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = language_model

        def forward(self, inputs_embeds, attention_mask):
            return self.language_model(
                inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state

    embeds = torch.randn(2, 6, language_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    unpadded = torch.ones(2, 6, dtype=torch.int64)
    padded = unpadded.clone()
    padded[0, :2] = 0  # left padding: eager applies the causal mask
    with torch.no_grad():
        plain = torch.export.export(Prefill(), (embeds, unpadded))
        with apply_patches(key):
            patched = torch.export.export(Prefill(), (embeds, unpadded))
        for mask in (unpadded, padded):
            expected = Prefill()(embeds, mask)
            torch.testing.assert_close(patched.module()(embeds, mask), expected, atol=1e-5, rtol=1e-5)
        assert (plain.module()(embeds, unpadded) - Prefill()(embeds, unpadded)).abs().max() > 1e-2  # causal


def _parity_on_two_prompts(model, inputs, parts):
    from hfexport.generation import GenerationRunner, compare_with_generate

    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    for prompt in (inputs, other_image_prompt(model, inputs)):
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=3)
        assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, parity.max_logit_diff


def test_cross_attending_text_decoder_is_split_with_the_image_features_as_a_step_input():
    # BLIP: generate() hands the vision tower's output to BlipTextLMHeadModel.generate() as the
    # cross-attention's encoder_hidden_states, an input of every step (was: "the embed_tokens /
    # language_model / lm_head split does not apply"); it drops the prompt's closing [SEP] and
    # writes its BOS into the caller's input_ids in place
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model("blip", TASK)
    given = inputs["input_ids"].clone()
    parts = decompose_for_generation(model, inputs)
    assert torch.equal(inputs["input_ids"], given)  # recorded on copies
    assert list(parts) == ["image_encoder", "prefill", "decode"]
    assert parts["prefill"][0] is model.text_decoder and parts["decode"][0] is model.text_decoder
    plan = parts.plan
    text = model.config.text_config
    assert plan.prompt_edit == {"drop_last": 1, "first_token": text.bos_token_id}
    features = {
        "from": "component",
        "component": "image_encoder",
        "output": "last_hidden_state",
        "drop_first": False,
    }
    assert plan.step_inputs == {
        "prefill": {"encoder_hidden_states": features},
        "decode": {"encoder_hidden_states": features},
    }
    # the all-ones mask over the image features is built by the forward itself: no graph input
    assert "encoder_attention_mask" not in parts["prefill"][1]
    assert plan.token_ids["eos_token_id"] == [text.sep_token_id]
    _parity_on_two_prompts(model, inputs, parts)


@pytest.mark.parametrize(
    "model_type",
    # Kosmos-2 (its generate() calls the text model's generate(), not its own forward) goes the
    # way BLIP goes (covered by default), Kosmos-2.5 through its own forward
    ["kosmos-2.5", pytest.param("kosmos-2", marks=pytest.mark.extended)],
)
def test_text_model_taking_image_embeds_is_split_with_the_image_features_in_its_prefill(model_type):
    # Kosmos-2 / -2.5: the text model places image_embeds (the vision tower's output normalised and
    # projected: the model's get_image_features as one component) at image_embeds_position_mask,
    # in the prefill only; Kosmos-2.5's own forward does it (was: generate() never called
    # ['image_encoder'], then a language_model taking input_ids the runner cannot supply)
    from hfexport.generation import decompose_for_generation
    from hfexport.generation.multimodal import ImageEmbeds

    model, inputs = tiny_model(model_type, TASK)
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["image_encoder", "prefill", "decode"]
    assert isinstance(parts["image_encoder"][0], ImageEmbeds)
    assert parts["decode"][0] is model.text_model
    assert parts.plan.step_inputs == {
        "prefill": {
            "image_embeds": {
                "from": "component",
                "component": "image_encoder",
                "output": "",
                "drop_first": False,
            },
            "image_embeds_position_mask": {"from": "prompt", "key": "image_embeds_position_mask"},
        },
        "decode": {},
    }
    assert parts.plan.prompt_edit == {}
    _parity_on_two_prompts(model, inputs, parts)


def test_flattened_patch_images_and_their_mask_make_an_image_prompt():
    # Pix2Struct: an image-to-text encoder-decoder whose images are flattened patches, each row its
    # 1-based row and column then 16x16x3 pixels (was: eager fails "You have to specify
    # flattened_patches"); its text config turns the cache off, which generate() records with on
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model("pix2struct", TASK, check_eager=True)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "flattened_patches": (2, 16, 770),
        "attention_mask": (2, 16),
        "decoder_input_ids": (2, 8),
    }
    rows, cols = inputs["flattened_patches"][0, :, 0], inputs["flattened_patches"][0, :, 1]
    assert rows.tolist() == [float(r) for r in range(1, 5) for _ in range(4)]
    assert cols.tolist() == [float(c) for _ in range(4) for c in range(1, 5)]
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["encoder", "prefill", "decode"]
    assert parts["decode"][1]["decoder_input_ids"].shape[1] == 1  # a cached step, one token
    _parity_on_two_prompts(model, inputs, parts)


def test_a_prompt_rewrite_the_runner_cannot_repeat_is_refused():
    from hfexport.generation.multimodal import _prompt_edit

    given = torch.tensor([[5, 6, 7, 8], [5, 9, 10, 11]])
    assert _prompt_edit({"input_ids": given}, {"input_ids": given.clone()}) == {}
    assert _prompt_edit({"input_ids": given}, {"input_ids": torch.tensor([[1, 6, 7], [1, 9, 10]])}) == {
        "drop_last": 1,
        "first_token": 1,
    }
    with pytest.raises(ValueError, match="rewrites the prompt in a way the runner cannot repeat"):
        _prompt_edit({"input_ids": given}, {"input_ids": torch.tensor([[5, 7, 6, 8], [5, 9, 10, 11]])})


def test_window_index_is_tied_to_the_patch_count_while_capturing():
    # without the check the permuted patch count was traced as s98*(s47//(s47//4)), which
    # bound_sympy cannot bound: ExecuTorch planned exaone4_5's / hyperclovax_vision_v2's window
    # buffers at the sample's size and the second prompt's image failed (aten::full.out, error 0x12)
    from torch.export import Dim

    from hfexport.capture import capture_patch_key
    from hfexport.registry import apply_patches

    model, _ = tiny_model("qwen2_5_vl", TASK)
    tower = model.model.visual
    unit = tower.spatial_merge_unit

    class Permute(torch.nn.Module):
        def forward(self, hidden: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
            return tower.permute_input_for_window_attn(hidden, window_index, seq_len=hidden.shape[0])

    hidden, window_index = torch.randn(4 * unit, 3), torch.tensor([2, 0, 3, 1])
    bound = Dim.AUTO(min=1, max=4096)
    with apply_patches(capture_patch_key(tower)):
        program = torch.export.export(
            Permute(), (hidden, window_index), dynamic_shapes=({0: bound}, {0: bound})
        )
    rows, windows = (n.meta["val"].shape[0] for n in program.graph.nodes if n.op == "placeholder")
    assert isinstance(windows, torch.SymInt) and rows.node.expr == unit * windows.node.expr
    other, order = torch.randn(6 * unit, 3), torch.tensor([5, 4, 0, 1, 3, 2])
    expected = tower.permute_input_for_window_attn(other, order, seq_len=other.shape[0])
    torch.testing.assert_close(program.module()(other, order), expected)


def test_blip_text_only_prompt_and_new_token_start_after_its_prompt_rewrite():
    # fresh-user trial: a text-only prompt of BLIP (its language model takes the image as an input of
    # its own) raised KeyError('image_encoder'); and generate_from_dir / `hfexport generate` cut the new
    # tokens at the given prompt's length although BLIP's rewrite drops its closing [SEP], so the first
    # new token was lost
    from hfexport.generation import GenerationRunner, decompose_for_generation
    from hfexport.generation.persist import new_tokens_start
    from hfexport.testing.generation import eager_component_callers

    model, inputs = tiny_model("blip", TASK)
    parts = decompose_for_generation(model, inputs)
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    ids = inputs["input_ids"][:1]
    with pytest.raises(
        ValueError, match=r"takes .* from the image_encoder.* no image-free path; pass the image"
    ):
        runner.generate(ids, max_new_tokens=2)
    sequences = runner.generate(ids, max_new_tokens=3, pixel_values=inputs["pixel_values"][:1])
    start = new_tokens_start(parts.plan, ids.shape[1])
    assert parts.plan.prompt_edit.get("drop_last") == 1 and start == ids.shape[1] - 1
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, pixel_values=inputs["pixel_values"][:1], max_new_tokens=3, do_sample=False
        )
    assert sequences[0, start:].tolist() == expected[0, start:].tolist()
    assert sequences.shape[1] - start == expected.shape[1] - start


@pytest.mark.parametrize(("mode", "merge", "side"), [("16x", 4, 8), ("4x", 2, 4)])
def test_canvas_mrope_positions_equal_the_models_own(mode, merge, side):
    # issue 28: MiniCPM-V 4.7 lays its M-RoPE positions out on an image canvas (a thumbnail stretched
    # over the slices tiling the image, markers at the corners, the newline ending a row of slices);
    # was: decompose "MiniCPMV4_7ForConditionalGeneration takes 3-D (M-RoPE) position ids but has no
    # spatial_merge_size". The runner's layout, on a prompt with every marker, slices in two rows, two
    # frames of one group, left padding, equals the model's get_rope_index.
    from hfexport.generation.vision_inputs import canvas_markers, canvas_mrope_position_ids

    model, _ = tiny_model("minicpmv4_7", TASK)
    ss, se, im, ie, nl, tok = 250, 251, 252, 253, 254, 255
    for name, value in zip(
        ("slice_start_id", "slice_end_id", "image_start_id", "image_end_id", "newline_id"),
        (ss, se, im, ie, nl),
        strict=True,
    ):
        setattr(model.model.config, name, value)
    crop = [tok] * 4
    first = [
        5,
        6,
        im,
        *crop,
        ie,
        ss,
        *crop,
        se,
        ss,
        *crop,
        se,
        nl,
        ss,
        *crop,
        se,
        ss,
        *crop,
        se,
        im,
        *crop,
        ie,
        7,
        8,
        9,
    ]
    second = [0] * 9 + [10, im, *crop, ie, 11, 12, im, *crop, ie, 13]
    second = second + [14] * (len(first) - len(second))
    ids = torch.tensor([first, second])
    types = (ids == tok).to(torch.int64)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    sizes = torch.tensor([[side, side]] * 8)  # row 0: thumbnail + 4 slices, thumbnail; row 1: two thumbnails
    markers = canvas_markers(model.config)
    assert markers == {"slice_start": ss, "slice_end": se, "image_start": im, "image_end": ie, "newline": nl}
    expected, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=types, target_sizes=sizes, downsample_mode=mode, attention_mask=mask
    )
    got = canvas_mrope_position_ids(ids, types, sizes, merge, mask, markers)
    assert torch.equal(got[1:], expected)
    assert torch.equal(got[0, 0], torch.arange(ids.shape[1]))  # the text channel
    # the 2x2 thumbnail stretched over the 4x4 canvas of 2x2 slices, from the canvas origin 2
    assert got[2, 0, 3:7].tolist() == [2, 2, 5, 5] and got[3, 0, 3:7].tolist() == [2, 5, 2, 5]
    with pytest.raises(ValueError, match="more image crops than target_sizes rows"):
        canvas_mrope_position_ids(ids, types, sizes[:7], merge, mask, markers)


@pytest.mark.parametrize("model_type", ["idefics", pytest.param("mllama", marks=pytest.mark.extended)])
def test_cross_attending_language_model_is_split_into_the_models_own_steps(model_type):
    # issue 28: the language model takes token ids and cross-attends to the image at every step
    # (IDEFICS: image_encoder_embeddings, the vision tower's output; Mllama: cross_attention_states,
    # the projector's output, at prefill, then its cross-attention K/V from the cache); was:
    # decompose "no multimodal submodules found in IdeficsForVisionText2Text" (its decoder is its base
    # model), generate "component 'language_model' takes input 'input_ids', which the runner cannot
    # supply" (Mllama). The steps are the model's own forward given the image features in place of
    # the image inputs; a decode step takes the last row of the prompt's cross-attention mask.
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model(model_type, TASK)
    parts = decompose_for_generation(model, inputs)
    mask, feature, source = {
        "idefics": ("image_attention_mask", "image_encoder_embeddings", "image_encoder"),
        "mllama": ("cross_attention_mask", "cross_attention_states", "multi_modal_projector"),
    }[model_type]
    assert list(parts)[-2:] == ["prefill", "decode"] and source in parts
    assert parts["prefill"][0] is model and parts["decode"][0] is model
    assert "pixel_values" not in parts["prefill"][1]
    steps = parts.plan.step_inputs
    assert steps["prefill"][feature]["component"] == source

    def without_zeros(source):  # Mllama's record of the zero mask of a text-only turn
        return {k: v for k, v in source.items() if k != "without_image"}

    assert without_zeros(steps["prefill"][mask]) == {"from": "prompt", "key": mask}
    assert without_zeros(steps["decode"][mask]) == {"from": "prompt", "key": mask, "last": True}
    if model_type == "idefics":  # [batch, images, 3, h, w] pixels taken as [batch * images, 3, h, w]
        assert parts.plan.links["image_encoder"]["pixel_values"]["flatten"] is True
    _parity_on_two_prompts(model, inputs, parts)
