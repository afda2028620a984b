"""Tiny vision-language models of the zoo (issue 28): the sample inputs follow each vision tower's
input layout, and the per-type overlays make the defaults buildable.

Each case failed before its fix, at the stage named in its comment (docs/coverage.md's
vision-language section had the reason).
"""

from __future__ import annotations

import pytest
import torch

from hfexport.generation.image_prompts import other_image_prompt
from hfexport.testing import tiny_model

TASK = "image-text-to-text"


@pytest.mark.parametrize(
    ("model_type", "pixel_shape", "image_tokens", "wrapped"),
    [
        # eager: 'NoneType' object has no attribute 'device' (no image_grid_thw: GLM-4V names its
        # wrapping ids image_start/end_token_id); then split_with_sizes [8, 12, 12] (mrope overlay)
        ("glm4v", (16, 384), 4, True),
        # eager: the same; its patch embedding is a Conv2d over [patches, 3, 8, 8]
        ("kimi_k25", (16, 3, 8, 8), 4, True),
        # eager: too many values to unpack; its tower adds row separators: 8 tokens for 2x2 merged
        # patches, and the config has no start/end ids
        ("hunyuan_vl", (16, 192), 8, False),
    ],
)
def test_patch_grid_towers_get_their_layout_and_token_count(model_type, pixel_shape, image_tokens, wrapped):
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    config = model.config
    assert tuple(inputs["pixel_values"].shape) == pixel_shape
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    ids = inputs["input_ids"][0]
    assert int((ids == config.image_token_id).sum()) == image_tokens
    first = int((ids == config.image_token_id).nonzero()[0])
    if wrapped:
        start = getattr(config, "vision_start_token_id", None) or config.image_start_token_id
        end = getattr(config, "vision_end_token_id", None) or config.image_end_token_id
        assert int(ids[first - 1]) == start
        assert int(ids[first + image_tokens]) == end
    # the second image prompt of the generation cell: a 1 x 8 x 6 grid, as many tokens as the tower gives
    other = other_image_prompt(model, inputs)
    assert other["image_grid_thw"].tolist() == [[1, 8, 6]]
    assert tuple(other["pixel_values"].shape[1:]) == pixel_shape[1:]
    with torch.no_grad():
        features = model.model.get_image_features(
            pixel_values=other["pixel_values"], image_grid_thw=other["image_grid_thw"]
        ).pooler_output
    rows = sum(t.reshape(-1, t.shape[-1]).shape[0] for t in features)
    assert int((other["input_ids"] == config.image_token_id).sum()) == rows
    with torch.no_grad():
        model(**other)


def test_qwen25_style_vision_windows_hold_merged_patches():
    """shrink: a Qwen2.5-VL vision tower counts its attention window in pixels; the swin rule's 4
    gave 0 merged patches per window (ZeroDivisionError in get_window_index: hyperclovax_vision_v2,
    exaone4_5)."""
    model, inputs = tiny_model("exaone4_5", TASK, check_eager=True)
    vision = model.config.vision_config
    assert vision.window_size == 2 * vision.spatial_merge_size * vision.patch_size == 32
    assert tuple(inputs["pixel_values"].shape) == (16, 384)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        # eager: mat1 and mat2 shapes cannot be multiplied (192x32 and 192x64): a linear patch
        # embedding given [b, 3, 32, 32] images
        ("fuyu", {}),
        # the same, through SigLIP2's NaFlex embedding (pixel_attention_mask and spatial_shapes)
        ("lfm2_vl", {"pixel_attention_mask": (2, 16), "spatial_shapes": (2, 2)}),
    ],
)
def test_linear_patch_towers_get_flattened_patches(model_type, extra):
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    assert tuple(inputs["pixel_values"].shape) == (2, 16, 3 * 8 * 8)
    assert {k: tuple(inputs[k].shape) for k in extra} == extra
    if "spatial_shapes" in extra:
        assert inputs["spatial_shapes"].tolist() == [[4, 4], [4, 4]]
    tokens = (inputs["input_ids"] == model.config.image_token_id).sum(dim=1)
    assert tokens.tolist()[0] == tokens.tolist()[1] > 0


def test_tiled_towers_get_their_tile_mask():
    """granite_docling's get_image_features requires pixel_attention_mask, one flag per tile (eager
    before: 'NoneType' object has no attribute 'sum')."""
    _, inputs = tiny_model("granite_docling", TASK, check_eager=True)
    assert tuple(inputs["pixel_values"].shape) == (2, 1, 3, 32, 32)
    assert inputs["pixel_attention_mask"].dtype == torch.bool
    assert inputs["pixel_attention_mask"].tolist() == [[True], [True]]


def test_configs_the_validators_refused_are_consistent():
    """Configs transformers' validate_architecture refused at the tiny size (StrictDataclass
    ClassValidationError before): glm5_next's NoPE attention keeps no rotary part, dots3_note's
    adapters and inkling2's vision tower output the text width, apertus1p5's code ranges fit the
    vocabulary."""
    from hfexport.testing import shrunk_config

    glm5 = shrunk_config("glm5_next")
    text = glm5.get_text_config()
    assert text.qk_rope_head_dim == 0
    dots = shrunk_config("dots3_note")
    width = dots.get_text_config().hidden_size
    assert dots.vision_config.adapter_out_dim == dots.audio_config.adapter_out_dim == width
    assert dots.vision_config.adapter_in_dim == dots.vision_config.hidden_size
    inkling = shrunk_config("inkling2")
    assert inkling.vision_config.text_hidden_size == inkling.get_text_config().hidden_size
    apertus = shrunk_config("apertus1p5")
    assert apertus.image_token_offset + apertus.vision_config.codebook_size == apertus.audio_token_offset
    assert (
        apertus.audio_token_offset + apertus.audio_config.codebook_size
        <= apertus.get_text_config().vocab_size
    )
    assert apertus.audio_config.codebook_dim == apertus.audio_config.hidden_size


def test_whole_model_prefill_takes_the_raw_images_not_mm_encoder_outputs():
    """Fuyu's image encoder is no submodule the multimodal split finds, so the whole model is the
    prefill; generate() hands it pre-encoded images as mm_encoder_outputs, which no runner can
    supply (the generation cell failed: "component 'prefill' takes input
    'mm_encoder_outputs.image.last_hidden_state'"). The prefill takes pixel_values instead."""
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model("fuyu", TASK)
    parts = decompose_for_generation(model, inputs)
    assert list(parts) == ["prefill", "decode"]
    _, prefill = parts["prefill"]
    _, decode = parts["decode"]
    assert "mm_encoder_outputs" not in prefill and "mm_encoder_outputs" not in decode
    assert torch.equal(prefill["pixel_values"], inputs["pixel_values"])
    with torch.no_grad():
        expected = model(**inputs).logits[:, -1]
        got = model(**{k: v for k, v in prefill.items() if k != "cache"}).logits[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_windowed_vision_encoder_inputs_pass_the_kwarg_check():
    """A Qwen2.5-VL-style windowed vision encoder (exaone4_5) reads the precomputed window_index and
    cu_window_seqlens from **kwargs; the kwarg check refused them as unknown names (decompose
    failed: "the sample inputs give ['window_index', 'cu_window_seqlens'], which
    Exaone4_5_VisionModel.forward does not take")."""
    from hfexport.generation.vision_inputs import vision_grid_inputs, vision_grid_settings
    from hfexport.input_checks import check_forward_kwargs

    model, inputs = tiny_model("exaone4_5", TASK)
    encoder = model.model.visual
    grid = inputs["image_grid_thw"]
    extra = vision_grid_inputs(grid, vision_grid_settings(encoder))
    assert set(extra) == {"position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"}
    kwargs = {"hidden_states": inputs["pixel_values"], "grid_thw": grid, **extra}
    check_forward_kwargs(encoder, kwargs)  # raised UnsupportedInputError
    with pytest.raises(Exception, match=r"window_indexx"):
        check_forward_kwargs(encoder, {**kwargs, "window_indexx": extra["window_index"]})


def test_encoders_of_a_modality_the_prompt_lacks_are_left_out():
    """dots3_note has an audio encoder next to its image encoder; an image prompt never calls it and
    the split refused the model ("generate() never called ['audio_encoder']")."""
    from hfexport.generation.multimodal import MultimodalLayout, _drop_unused_modalities

    modules = {n: torch.nn.Linear(2, 2) for n in ("image", "audio", "proj", "audio_proj", "lm")}
    layout = MultimodalLayout(
        encoders={"image_encoder": modules["image"], "audio_encoder": modules["audio"]},
        projectors={"multi_modal_projector": modules["proj"], "embed_audio": modules["audio_proj"]},
        language_model=modules["lm"],
    )
    parts = layout.modules()
    calls = {"image_encoder": [{}], "multi_modal_projector": [{}], "audio_encoder": [], "embed_audio": []}
    assert _drop_unused_modalities(layout, parts, {**calls, "language_model": [{}]}) == [
        "audio_encoder",
        "embed_audio",
    ]
    assert list(parts) == ["image_encoder", "multi_modal_projector", "language_model"]
    assert list(layout.encoders) == ["image_encoder"]
    # no encoder called at all: nothing dropped, the split reports the prompt instead
    layout = MultimodalLayout(encoders={"image_encoder": modules["image"]}, language_model=modules["lm"])
    parts = layout.modules()
    assert _drop_unused_modalities(layout, parts, {"image_encoder": [], "language_model": [{}]}) == []
    assert "image_encoder" in parts


def test_image_first_and_placeholder_free_models_get_images_and_a_prompt():
    """Under image-text-to-text, InstructBLIP (main input pixel_values; its Q-Former takes an
    instruction, and its config has no image token id: eager failed, "missing ... 'qformer_input_ids'")
    gets images, a prompt with one image token per query and the Q-Former's instruction; GIT (no
    placeholder token: it prepends the image) got a text-only prompt and its vision tower went
    unexported."""
    model, inputs = tiny_model("instructblip", TASK, check_eager=True)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "pixel_values": (2, 3, 32, 32),
        "qformer_input_ids": (2, 8),
        "qformer_attention_mask": (2, 8),
        "input_ids": (2, 12),
        "attention_mask": (2, 12),
    }
    image_token = model.config.image_token_index
    assert (inputs["input_ids"] == image_token).sum(dim=1).tolist() == [4, 4]
    _, inputs = tiny_model("git", TASK, check_eager=True)
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 32, 32)
    assert tuple(inputs["input_ids"].shape) == (2, 8)


def test_aria_projector_knows_the_tiny_patch_count():
    """Aria's projector looks the patch count up in projector_patch_to_query_dict (defaults: 1225
    and 4900 patches); the tiny image's 16 patches were missing (eager: KeyError 'Number of patches
    16 not found')."""
    model, inputs = tiny_model("aria", TASK, check_eager=True)
    assert model.config.projector_patch_to_query_dict == {16: 4}
    assert (inputs["input_ids"] == model.config.image_token_index).sum(dim=1).tolist() == [4, 4]


def test_kosmos2_prompt_marks_the_image_positions():
    """Kosmos-2 has no image token id: image_embeds_position_mask marks where its latent queries go
    (eager before: 'You have to specify either input_ids or inputs_embeds', then 'NoneType' has no
    attribute 'to')."""
    model, inputs = tiny_model("kosmos-2", TASK, check_eager=True)
    queries = model.config.latent_query_num
    mask = inputs["image_embeds_position_mask"]
    assert mask.shape == inputs["input_ids"].shape == (2, 8 + queries)
    assert mask.sum(dim=1).tolist() == [queries, queries]
    assert mask[:, 1 : 1 + queries].eq(1).all()


@pytest.mark.parametrize(
    ("model_type", "grid_input", "pixel_shape", "image_tokens"),
    [
        # decompose: generate() never called ['image_encoder'] (no image_token_id in the default
        # config: the forward skipped the image; the sample had 4-D images and no target_sizes)
        ("minicpmv4_6", "target_sizes", (1, 3, 8, 2 * 64 * 8), 4),
        # the same, and the projector's norm refused the tower's features (5120 vs 256 wide)
        ("nemotron_h_omni", "image_grid_hw", (2 * 64, 3 * 8 * 8), 16),
    ],
)
def test_packed_patch_towers_get_their_grids_and_an_image_token(
    model_type, grid_input, pixel_shape, image_tokens
):
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    token = model.config.image_token_id
    assert token == 255  # set by the tiny builder: the config's default is None
    assert tuple(inputs["pixel_values"].shape) == pixel_shape
    assert inputs[grid_input].tolist() == [[8, 8], [8, 8]]
    assert (inputs["input_ids"] == token).sum(-1).tolist() == [image_tokens, image_tokens]
    with torch.no_grad():
        features = model.get_image_features(
            pixel_values=inputs["pixel_values"], **{grid_input: inputs[grid_input]}
        )
    assert [tuple(f.shape) for f in features.pooler_output] == [(image_tokens, 64)] * 2


def test_minicpm_tower_runs_its_window_merger() -> None:
    # the merger after vision layer 6 of 2 never ran while get_image_features halved target_sizes
    # as if it had: the second image's features came from the first image's patches
    model, inputs = tiny_model("minicpmv4_6", TASK)
    pixels, grids = inputs["pixel_values"], inputs["target_sizes"]
    with torch.no_grad():
        both = model.get_image_features(pixels, grids).pooler_output
        second = model.get_image_features(pixels[..., 64 * 8 :], grids[1:]).pooler_output
    assert torch.equal(both[1], second[0])


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        # eager: Both pixel_values and high_res_pixel_values should be specified at the same time
        ("deepseek_vl_hybrid", {"high_res_pixel_values": (2, 3, 32, 32), "pixel_values": (2, 3, 32, 32)}),
        # eager: not enough values to unpack (expected 5, got 4): one 4-frame video per prompt
        ("instructblipvideo", {"pixel_values": (2, 4, 3, 32, 32)}),
        # eager: the same: 16 tubelets of 2 frames per image, channels last
        ("inkling_mm_model", {"pixel_values": (32, 2, 8, 8, 3)}),
        # eager: Exactly 1 of pixel_values, image_encoder_embeddings or perceiver_embeddings has to
        # be not-None (the 4-D images were refused); images grouped per prompt, every token
        # cross-attending to its image
        ("idefics", {"pixel_values": (2, 1, 3, 32, 32), "image_attention_mask": (2, 8, 1)}),
        # eager: `aspect_ratio_ids` must be provided if `pixel_values` is provided; then IndexError
        # (intermediate vision layers and cross-attention layers past the tiny towers: preset)
        (
            "mllama",
            {
                "pixel_values": (2, 1, 4, 3, 32, 32),
                "aspect_ratio_ids": (2, 1),
                "aspect_ratio_mask": (2, 1, 4),
                "cross_attention_mask": (2, 9, 1, 4),
                "input_ids": (2, 9),
            },
        ),
    ],
)
def test_video_and_two_resolution_towers_get_their_inputs(model_type, extra) -> None:
    _, inputs = tiny_model(model_type, TASK, check_eager=True)
    assert {k: tuple(inputs[k].shape) for k in extra} == extra
