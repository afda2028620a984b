"""Mllama's inputs in the input-role table (issue 28): the tiled 6-D ``pixel_values``, the tile
layout (``aspect_ratio_ids`` / ``aspect_ratio_mask``), the token-aligned ``cross_attention_mask`` and
the ``cross_attention_states`` a cross-attending language model reads; what the capture's guard scan
and the second-shape plan make of them."""

from __future__ import annotations

import pytest
import torch

from hfexport.conventions import input_role
from hfexport.program_axes import axes_summary, axis_meaning
from hfexport.verify.second_shape import derive_second_inputs
from hfexport.verify.sizes import plan_second_shape


def _tiled_image_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    """One image of 4 tiles per row, as Mllama's processor gives it (the first tile real)."""
    mask = torch.zeros(batch, 1, 4, dtype=torch.int64)
    mask[:, :, 0] = 1
    return {
        "pixel_values": torch.randn(batch, 1, 4, 3, 8, 8),
        "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.int64),
        "aspect_ratio_mask": mask,
    }


def test_tiled_pixel_values_name_their_image_tile_and_side_axes() -> None:
    # was: the 6-D [batch, images, tiles, channels, height, width] took the 4-D role's axes, so the
    # report read "pixel_values image height: static 4" (the tiles) and "image width: static 3"
    inputs = _tiled_image_inputs()
    pixels = inputs["pixel_values"]
    role = input_role("pixel_values", 6)
    assert role is not None and role.spatial_axes == (4, 5) and role.batch_axis == 0
    meanings = [axis_meaning("pixel_values", pixels, axis, inputs) for axis in range(6)]
    assert meanings == ["batch", "images", "tiles", "image channels", "image height", "image width"]
    entries = [
        {
            "input": "pixel_values",
            "axis": a,
            "meaning": meanings[a],
            "status": "static",
            "min": s,
            "max": s,
            "note": "model-fixed",
        }
        for a, s in ((1, 1), (2, 4), (4, 8), (5, 8))
    ]
    assert axes_summary(entries) == [
        "pixel_values images: static 1 (model-fixed)",
        "pixel_values tiles: static 4 (model-fixed)",
        "pixel_values image height/width: static 8 (model-fixed)",
    ]
    mask = torch.ones(2, 9, 1, 4, dtype=torch.int64)
    assert [axis_meaning("cross_attention_mask", mask, a, {}) for a in range(4)] == [
        "batch",
        "sequence",
        "images",
        "tiles",
    ]


def test_an_image_encoder_of_tiled_images_gets_a_second_shape_along_the_batch() -> None:
    # was: "no rule to derive a second shape for input 'aspect_ratio_ids' (2, 1)"
    inputs = _tiled_image_inputs()
    plan, reason = plan_second_shape(torch.nn.Identity(), inputs)
    assert reason == "" and plan is not None
    assert (plan.group("batch").sample, plan.group("batch").size) == (2, 3)
    second, reason = derive_second_inputs(torch.nn.Identity(), inputs)
    assert second is not None, reason
    assert tuple(second["pixel_values"].shape) == (3, 1, 4, 3, 16, 16)
    # the tile layout is values: the sample's rows repeated, never redrawn
    assert torch.equal(second["aspect_ratio_ids"], torch.ones(3, 1, dtype=torch.int64))
    assert torch.equal(second["aspect_ratio_mask"][2], inputs["aspect_ratio_mask"][0])


def test_a_cross_attending_prefill_gets_a_second_shape_with_its_mask_as_long_as_the_prompt() -> None:
    # was: "no rule to derive a second shape for input 'cross_attention_mask' (2, 9, 1, 4)"
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "cross_attention_mask": torch.ones(2, 9, 1, 4, dtype=torch.int64),
        "cross_attention_states": torch.randn(2, 1, 4, 5, 16),
    }
    second, reason = derive_second_inputs(torch.nn.Identity(), inputs)
    assert second is not None, reason
    length = second["input_ids"].shape[1]
    assert length > 9 and second["input_ids"].shape[0] == 3
    assert tuple(second["cross_attention_mask"].shape) == (3, length, 1, 4)
    assert bool((second["cross_attention_mask"] == 1).all())
    assert tuple(second["cross_attention_states"].shape) == (3, 1, 4, 5, 16)


class _CrossMasked(torch.nn.Module):
    """Mllama's use of its cross-attention mask in small: each token's row of the mask (over the
    image's tiles) scales its embedding, so the mask's text axis and the prompt's are one size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 8)

    def forward(self, input_ids, attention_mask, cross_attention_mask):
        rows = cross_attention_mask.sum(dim=(2, 3)).to(torch.float32)
        return self.emb(input_ids) * (attention_mask * rows)[..., None]


def test_the_guard_scan_moves_the_cross_attention_mask_with_the_prompt() -> None:
    # was: the scan lengthened input_ids / attention_mask alone, the guard tying the mask's text
    # axis to them refused the first longer prompt, and the prompt axis was reported
    # "model-bounded" at the sample's length (tiny Mllama: 2..9; ExecuTorch then planned its
    # prefill at 9 tokens and refused longer prompts, while the dynamo program ran 30)
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.program_axes import guards_accept
    from hfexport.report import ExportReport

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "cross_attention_mask": torch.ones(2, 9, 1, 4, dtype=torch.int64),
    }
    report = ExportReport(export_format="dynamo")
    program = capture(_CrossMasked().eval(), inputs, DynamoConfig(dynamic=True), report)
    shapes = {"input_ids": (2, 30), "attention_mask": (2, 30), "cross_attention_mask": (2, 30, 1, 4)}
    assert guards_accept(program, shapes) is not False
    sequence = [e for e in report.dynamic_axes if e["meaning"] == "sequence"]
    assert {e["input"] for e in sequence} == {"input_ids", "attention_mask", "cross_attention_mask"}
    assert all(e["status"] == "dynamic" and e["note"] == "" and e["max"] is None for e in sequence), sequence


@pytest.fixture(scope="module")
def mllama():
    """Tiny Mllama, its sample, and its generation split (one greedy ``generate`` recorded)."""
    from hfexport.generation import decompose_for_generation
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("mllama", "image-text-to-text")
    return model, inputs, decompose_for_generation(model, inputs)


def test_a_mllama_decode_step_gets_a_second_past_length_with_its_cross_attention_layers_held(mllama) -> None:
    # was: "no rule to derive 'cross_attention_mask' (2, 1, 1, 4) at another past length" (and, with no
    # role, "inputs ['cross_attention_mask'] next to the cache have no entry in the input-role table");
    # the cross-attention layer's cache holds the 68 image tokens (4 tiles x 17 patches), not the past
    from hfexport.inputs import prepare_for_export

    model, _, parts = mllama
    module, kwargs = parts["decode"]
    _, prepared, _ = prepare_for_export(module, kwargs)
    second, reason = derive_second_inputs(module, prepared)
    assert second is not None, reason
    layers = second["cache"].layers
    assert [tuple(layer.keys.shape) for layer in layers] == [(3, 2, 19, 16), (3, 2, 68, 16)]
    assert tuple(second["cross_attention_mask"].shape) == (3, 1, 1, 4)
    assert tuple(second["attention_mask"].shape) == (3, 20)
    with torch.no_grad():
        logits = module(**second).logits
    assert tuple(logits.shape) == (3, 1, model.config.text_config.vocab_size)
    assert bool(torch.isfinite(logits).all())


def test_a_text_only_mllama_prompt_runs_the_steps_with_zero_image_features_and_masks(mllama) -> None:
    # was: refused, "the prefill step takes 'cross_attention_states' from the multi_modal_projector,
    # which this prompt gives none of the image inputs for": model.generate skips the cross-attention
    # layers without an image, a branch the steps do not hold; zero features with a zero mask make
    # each such layer add exactly zero, which decomposition checks against the text-only forward
    from hfexport.generation import GenerationRunner, compare_with_generate
    from hfexport.testing.generation import eager_component_callers

    model, inputs, parts = mllama
    steps = parts.plan.step_inputs
    assert steps["prefill"]["cross_attention_states"]["without_image"] == {
        "zeros": [1, 4, 17, 64],
        "dtype": "float32",
    }
    assert steps["decode"]["cross_attention_mask"]["without_image"] == {
        "zeros": [1, 4],
        "dtype": "int64",
        "token_aligned": True,
    }
    runner = GenerationRunner(parts.plan, eager_component_callers(parts, model.config))
    ids = inputs["input_ids"][:1].clone()
    ids[ids == model.config.image_token_index] = 5
    ids = torch.cat([ids, ids[:, 1:]], 1)  # 17 tokens, longer than the sample's 9
    parity = compare_with_generate(
        runner, model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens=4
    )
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-5, parity.max_logit_diff
    # an image without its cross-attention mask is not a text-only turn: the missing input is named
    one = {k: v[:1] for k, v in inputs.items() if k != "cross_attention_mask"}
    with pytest.raises(ValueError, match="cross_attention_mask"):
        runner.generate(max_new_tokens=2, **one)
