"""Image encoders that filter padding images in Python keep no fixed image batch (issue 28, vlsplit)."""

from __future__ import annotations

import pytest
import torch

from hfexport.capture import capture_patch_key
from hfexport.generation.image_prompts import other_image_prompt
from hfexport.generation.multimodal import _image_features_component, find_multimodal_layout
from hfexport.registry import apply_patches
from hfexport.testing import tiny_model
from hfexport.workarounds import vision_language

TASK = "image-text-to-text"


def _image_features(model_type: str):
    model, inputs = tiny_model(model_type, TASK)
    module, kwargs, _, _ = _image_features_component(model, find_multimodal_layout(model), inputs)
    return module, kwargs


class _Named(torch.nn.Module):
    """The image-features component with named inputs (``torch.export`` keys dynamic shapes by name)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None):
        extra = {} if pixel_attention_mask is None else {"pixel_attention_mask": pixel_attention_mask}
        return self.inner(pixel_values=pixel_values, **extra)


def _other_batch(kwargs: dict, batch: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    out = {"pixel_values": torch.randn(batch, *kwargs["pixel_values"].shape[1:], generator=gen)}
    if "pixel_attention_mask" in kwargs:
        mask = kwargs["pixel_attention_mask"]
        out["pixel_attention_mask"] = torch.ones(batch, *mask.shape[1:], dtype=mask.dtype)
    return out


@pytest.mark.parametrize("model_type", ["smolvlm", "idefics2", "granite_docling"])
def test_image_encoder_serves_another_image_batch(model_type):
    # transformers drops padding images by boolean indexing and splits the features per row with
    # .tolist(): captured as is, the encoder keeps the sample's batch of 2 (Guard failed:
    # pixel_values.size()[0] == 2); the capture patch encodes every image of the batch
    from torch.export import Dim

    module, kwargs = _image_features(model_type)
    key = capture_patch_key(module)
    assert key == vision_language.KEY
    assert int(kwargs["pixel_values"].shape[0]) == 2
    shapes = {name: {0: Dim.AUTO} for name in kwargs}
    with apply_patches(key), torch.no_grad():
        program = torch.export.export(_Named(module), (), dict(kwargs), dynamic_shapes=shapes)
    for batch in (3, 5):
        inputs = _other_batch(kwargs, batch)
        with torch.no_grad():
            expected = module(**inputs)  # the original code, padding filter and all
            got = program.module()(**inputs)
        expected = expected if isinstance(expected, dict) else {"features": expected}
        got = got if isinstance(got, dict) else {"features": got}
        assert got["features"].shape[0] == expected["features"].shape[0] > 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tiled_encoder_returns_its_deepstack_features():
    # Granite-Docling's language model takes one DeepStack feature per tapped vision layer: the
    # image-features component returns them next to the features, concatenated over tiles
    module, kwargs = _image_features("granite_docling")
    with torch.no_grad():
        out = module(**kwargs)
    assert set(out) == {"features", "deepstack_features"}
    rows, hidden = out["features"].shape
    assert len(out["deepstack_features"]) == len(module.config.vision_config.deepstack_visual_indexes)
    assert all(tuple(d.shape) == (rows, hidden) for d in out["deepstack_features"])


def test_naflex_encoder_serves_another_image_count_and_aspect():
    # LFM2-VL drops its padding token slots by boolean indexing and splits per image with
    # .tolist() (Guard failed: spatial_shapes.size()[0] == 2); the patch gathers the same tokens
    # with index arithmetic, for images of any patch grid that fill the padded patch count
    from torch.export import Dim

    model, inputs = tiny_model("lfm2_vl", TASK)
    module = model.model

    class Features(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, pixel_values, spatial_shapes, pixel_attention_mask):
            out = self.inner.get_image_features(pixel_values, spatial_shapes, pixel_attention_mask)
            return torch.cat(list(out.pooler_output))

    wrapped = Features()
    names = ("pixel_values", "spatial_shapes", "pixel_attention_mask")
    kwargs = {name: inputs[name] for name in names}
    assert vision_language.capture_key(wrapped) == vision_language.KEY
    with apply_patches(vision_language.KEY), torch.no_grad():
        program = torch.export.export(
            wrapped, (), kwargs, dynamic_shapes={name: {0: Dim.AUTO} for name in names}
        )
    patches, dim = inputs["pixel_values"].shape[1:]
    gen = torch.Generator().manual_seed(3)
    for grids in ([[4, 4], [2, 8], [8, 2]], [[2, 8]]):  # 16 patches each, three aspects
        count = len(grids)
        other = {
            "pixel_values": torch.randn(count, patches, dim, generator=gen),
            "spatial_shapes": torch.tensor(grids, dtype=torch.int64),
            "pixel_attention_mask": torch.ones(count, patches, dtype=torch.int64),
        }
        with torch.no_grad():
            expected = wrapped(**other)
            got = program.module()(**other)
        factor = model.config.downsample_factor
        assert got.shape[0] == count * patches // factor**2
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_grid_tower_behind_an_unnamed_projector_serves_another_image_size():
    # HyperCLOVAX-Vision-V2: a Qwen2.5-VL tower behind `projector` (no conventional name), so the
    # image features are one component; it gets the tower's precomputed grid inputs (rotary
    # positions, cu_seqlens, window index) and returns the features unsplit (no .tolist())
    from torch.export import Dim

    from hfexport.generation.vision_inputs import vision_grid_inputs

    model, inputs = tiny_model("hyperclovax_vision_v2", TASK)
    module, kwargs, settings, derived = _image_features_component(
        model, find_multimodal_layout(model), inputs
    )
    assert settings is not None and settings["window_index"]
    assert set(derived) == {"position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"}
    assert set(derived.values()) == {"image_grid_thw"}
    names = list(kwargs)

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(
            self, pixel_values, image_grid_thw, position_ids, cu_seqlens, window_index, cu_window_seqlens
        ):
            return self.inner(
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                position_ids=position_ids,
                cu_seqlens=cu_seqlens,
                window_index=window_index,
                cu_window_seqlens=cu_window_seqlens,
            )

    def grid_values(prompt):
        values = {"pixel_values": prompt["pixel_values"], "image_grid_thw": prompt["image_grid_thw"]}
        return {**values, **vision_grid_inputs(prompt["image_grid_thw"], settings)}

    # taller and wider images: more patches and windows (the sample's single window would be
    # specialised by torch.export's 0/1 rule, so the program is captured at the first larger one)
    larger = other_image_prompt(model, inputs)
    largest = other_image_prompt(model, larger)
    captured, checked = grid_values(larger), grid_values(largest)
    assert checked["pixel_values"].shape[0] > captured["pixel_values"].shape[0]
    assert checked["cu_window_seqlens"].shape[0] > captured["cu_window_seqlens"].shape[0] > 2
    shapes = {name: ({0: Dim.AUTO} if name != "image_grid_thw" else None) for name in names}
    with apply_patches(capture_patch_key(module)), torch.no_grad():
        program = torch.export.export(Named(), (), captured, dynamic_shapes=shapes)
    with torch.no_grad():
        expected = module(**checked)
        got = program.module()(**checked)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_row_separated_mrope_positions_match_hunyuan_vl():
    # HunYuan-VL ends each merged row with a separator token and rotates (column, row, image
    # ordinal) over sequence positions; the runner's Qwen2-VL layout refused its image blocks
    # ("an image block of 8 tokens does not match its grid 1x4x4")
    from hfexport.generation.multimodal import _mrope_layout
    from hfexport.generation.vision_inputs import mrope_position_ids, row_separated_mrope_position_ids

    model, inputs = tiny_model("hunyuan_vl", TASK)
    merge = model.config.vision_config.spatial_merge_size
    for prompt in (inputs, other_image_prompt(model, inputs)):
        expected, deltas = model.model.get_rope_index(
            prompt["input_ids"],
            mm_token_type_ids=prompt["mm_token_type_ids"],
            image_grid_thw=prompt["image_grid_thw"],
            attention_mask=prompt["attention_mask"],
        )
        channels = expected.shape[0]
        got, got_deltas = row_separated_mrope_position_ids(
            prompt["input_ids"],
            prompt["mm_token_type_ids"],
            prompt["image_grid_thw"],
            merge,
            prompt["attention_mask"],
            channels,
        )
        assert torch.equal(got, expected) and torch.equal(got_deltas, deltas)
        assert int((got[-1] != torch.arange(got.shape[-1])).sum()) > 0  # the image block is rotated apart
        layout = _mrope_layout(prompt, expected, {"spatial_merge_size": merge, "channels": channels}, {})
        assert layout == "row_separated"
        with pytest.raises(ValueError, match="does not match its grid"):
            mrope_position_ids(
                prompt["input_ids"], prompt["mm_token_type_ids"], prompt["image_grid_thw"], merge
            )


def _apertus_codes():
    model, inputs = tiny_model("apertus1p5", TASK)
    inner = model.model

    class Codes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values, image_sizes):
            return torch.cat(list(self.inner.get_image_features(pixel_values, image_sizes).pooler_output))

    return model, inputs, Codes()


def test_vq_image_tokenizer_patch_keeps_the_codes_and_the_prefill_drops_image_outputs():
    # Apertus 1.5 crops each image to image_sizes (.tolist()) and tokenizes it alone in a Python
    # loop (Eq(u4*u5, 1) in the tokenizer's GroupNorm); the patch tokenizes the batch at once,
    # and the whole-model prefill leaves the per-image encoder outputs out of its output
    from hfexport.generation.parts import WithoutModalityOutputs

    model, inputs, codes = _apertus_codes()
    images, _, height, width = inputs["pixel_values"].shape
    assert images == 2 and torch.equal(inputs["image_sizes"], torch.tensor([[height, width]] * images))
    assert vision_language.capture_key(codes) == vision_language.KEY
    kwargs = {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    with torch.no_grad():
        expected = codes(**kwargs)
        with apply_patches(vision_language.KEY):
            got = codes(**kwargs)
            patched = model.model.get_image_features(**kwargs)
    assert len(patched.pooler_output) == 1
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with torch.no_grad():
        full = model(**inputs)
        pruned = WithoutModalityOutputs(model)(**inputs)
    assert full.image_outputs is not None and "image_outputs" not in pruned
    torch.testing.assert_close(pruned.logits, full.logits)


@pytest.mark.extended  # 40 s on 2 loaded cores: tracing the VQ encoder
def test_vq_image_tokenizer_serves_another_image_count():
    # the captured tokenizer serves 3 images (the sample has 2)
    from torch.export import Dim

    _, inputs, codes = _apertus_codes()
    kwargs = {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    _, _, height, width = kwargs["pixel_values"].shape
    with apply_patches(vision_language.KEY), torch.no_grad():
        program = torch.export.export(codes, (), kwargs, dynamic_shapes={k: {0: Dim.AUTO} for k in kwargs})
    gen = torch.Generator().manual_seed(3)
    other = {
        "pixel_values": torch.rand(3, *kwargs["pixel_values"].shape[1:], generator=gen) * 2 - 1,
        "image_sizes": torch.tensor([[height, width]] * 3),
    }
    with torch.no_grad():
        expected = codes(**other)
        got = program.module()(**other)
    torch.testing.assert_close(got, expected)


def test_grid_inputs_are_left_out_when_the_tower_computes_them_otherwise(monkeypatch):
    # a tower that does not read the precomputed grid inputs the way they are computed here (its
    # features differ with them) gets none: the image-features component then takes the grid only
    from hfexport.generation import vision_inputs

    model, inputs = tiny_model("minimax_m3_vl", TASK)
    computed = vision_inputs.vision_grid_inputs

    def shuffled(grid_thw, settings):
        out = computed(grid_thw, settings)
        out["position_ids"] = out["position_ids"].flip(0)
        return out

    monkeypatch.setattr(vision_inputs, "vision_grid_inputs", shuffled)
    _, kwargs, settings, derived = _image_features_component(model, find_multimodal_layout(model), inputs)
    assert settings is None and derived == {}
    assert set(kwargs) == {"pixel_values", "image_grid_thw"}


def test_minimax_tower_takes_temporal_rotary_ids_and_clip_segments_precomputed():
    # MiniMax-M3-VL's tower reads [patches, 3] rotary ids (a frame column) and one attention segment
    # per clip: computed so, they give its features, and the component takes them precomputed, so
    # its program has no grid read back with .tolist() (ExecuTorch: Could not guard on u91 < 1)
    model, inputs = tiny_model("minimax_m3_vl", TASK)
    module, kwargs, settings, derived = _image_features_component(
        model, find_multimodal_layout(model), inputs
    )
    assert settings is not None and settings["include_temporal"] is True
    assert derived == {"position_ids": "image_grid_thw", "cu_seqlens": "image_grid_thw"}
    patches = kwargs["pixel_values"].shape[0]
    assert tuple(kwargs["position_ids"].shape) == (patches, 3)
    key = capture_patch_key(module)
    with apply_patches(key), torch.no_grad():
        program = torch.export.export(module, (), dict(kwargs), strict=False)
    assert [str(s) for s in program.range_constraints if str(s).startswith("u")] == []
    with torch.no_grad():
        expected = module(**kwargs)
    torch.testing.assert_close(program.module()(**kwargs), expected, atol=1e-5, rtol=1e-5)


def test_step3p7_rotary_grid_is_read_from_the_image_shape_without_unbacked_sizes():
    # Step3p7's tower built grid_thw from pixel_values' shape and read it back with .tolist(): the
    # captured image encoder had unbacked grid sides (ExecuTorch memory planning: Could not guard on
    # data-dependent expression u68 < 1); the capture patch takes the grid from the shape
    module, kwargs = _image_features("step3p7")
    key = capture_patch_key(module)
    assert key == vision_language.KEY
    pixels = kwargs["pixel_values"]
    with apply_patches(key), torch.no_grad():
        program = torch.export.export(_Named(module), (), {"pixel_values": pixels})
    unbacked = [str(s) for s in program.range_constraints if str(s).startswith("u")]
    assert unbacked == []
    other = torch.randn(*pixels.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module(pixel_values=other)
        got = program.module()(pixel_values=other)
    expected = expected if isinstance(expected, dict) else {"features": expected}
    got = got if isinstance(got, dict) else {"features": got}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert vision_language.grid_position_ids(2, 3).tolist() == [
        [0, 0],
        [0, 1],
        [0, 2],
        [1, 0],
        [1, 1],
        [1, 2],
    ]
