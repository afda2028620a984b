"""The dense-prediction heads' capture workarounds (hfexport.workarounds.dense_prediction, issue 28).

Each patch is checked for its registry metadata, for being in place only inside ``apply_patches``
(and restored after, also when the block raises), and for a captured program that takes another
image size and gives eager's numbers there; without the patches the program keeps the sample's
size. Tiny models only (each case a few seconds).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hfexport import registry
from hfexport.registry import apply_patches
from hfexport.testing import tiny_model
from hfexport.workarounds import dense_prediction

HEAD = f"{dense_prediction.__name__}.dpt_head_records_patch_grid"
STAGE = f"{dense_prediction.__name__}.dpt_patch_grid_from_image"


def _attribute(path: str):
    module_name, _, attr = path.rpartition(".")
    module_name, _, cls = module_name.rpartition(".")
    owner = getattr(importlib.import_module(module_name), cls)
    return owner.__dict__[attr]


def _image_dynamic(inputs):
    auto = torch.export.Dim.AUTO
    return {"pixel_values": {0: auto, 2: auto, 3: auto}}


def _grown(inputs, factor=2):
    pixels = inputs["pixel_values"]
    gen = torch.Generator().manual_seed(3)
    batch, channels, height, width = pixels.shape
    return {"pixel_values": torch.randn(batch + 1, channels, height * factor, width * factor, generator=gen)}


def test_entries_are_registered_under_the_capture_scope_with_issue_links_and_ranges():
    assert dense_prediction.KEY == "capture.dense_prediction"
    found = {e.name: e for e in registry.entries(dense_prediction.KEY, kind="patch")}
    assert {HEAD, STAGE} <= set(found)
    assert found[HEAD].paths == dense_prediction.DPT_HEAD_TARGETS
    assert found[STAGE].paths == dense_prediction.DPT_REASSEMBLE_TARGETS
    for name in (HEAD, STAGE):
        entry = found[name]
        assert entry.issue == "https://github.com/huggingface/transformers/pull/26092"
        assert entry.description
        assert entry.is_active(), entry.inactive_reason()
        assert not entry.unresolved, entry.unresolved


def test_patches_are_in_place_only_inside_apply_patches_and_restored_after_an_error():
    paths = (*dense_prediction.DPT_HEAD_TARGETS, *dense_prediction.DPT_REASSEMBLE_TARGETS)
    before = {path: _attribute(path) for path in paths}
    with apply_patches("capture"):  # the parent key alone: none of them
        assert all(_attribute(path) is before[path] for path in paths)
    with pytest.raises(RuntimeError, match="boom"), apply_patches(dense_prediction.KEY):
        for path in paths:
            assert _attribute(path) is not before[path], path
        raise RuntimeError("boom")
    for path in paths:
        assert _attribute(path) is before[path], path


def test_capture_key_picks_the_scope_for_dpt_only():
    dpt, _ = tiny_model("dpt", "depth-estimation")
    assert dense_prediction.capture_key(dpt) == dense_prediction.KEY
    assert dense_prediction.capture_key(torch.nn.Sequential(dpt)) == dense_prediction.KEY
    glpn, _ = tiny_model("glpn", "depth-estimation")  # no ViT tokens to reshape
    assert dense_prediction.capture_key(glpn) is None
    assert dense_prediction.capture_key(torch.nn.Linear(2, 2)) is None


def test_patch_grid_divides_each_side_and_refuses_other_ranks():
    pixels = torch.zeros(2, 3, 48, 32)
    assert dense_prediction.patch_grid(pixels, 16) == (3, 2)
    assert dense_prediction.patch_grid(pixels, (8, 16)) == (6, 2)
    with pytest.raises(ValueError, match=r"\[batch, channels, height, width\]"):
        dense_prediction.patch_grid(torch.zeros(3, 48, 32), 16)


@pytest.mark.parametrize(
    "task",
    # the semantic-segmentation head runs the same ViT and neck: behind extended (~10 s each)
    ["depth-estimation", pytest.param("image-segmentation", marks=pytest.mark.extended)],
)
def test_dpt_program_takes_another_image_size_and_matches_eager(task):
    model, inputs = tiny_model("dpt", task)
    grown = _grown(inputs)
    with torch.no_grad():
        expected = model(**grown)
        with apply_patches(dense_prediction.KEY):
            program = torch.export.export(
                model, (), dict(inputs), dynamic_shapes=_image_dynamic(inputs), strict=False
            )
        got = program.module()(**grown)
    name = "predicted_depth" if task == "depth-estimation" else "logits"
    assert got[name].shape == expected[name].shape
    assert got[name].shape[0] == grown["pixel_values"].shape[0]
    assert float(expected[name].abs().max()) > 1e-3  # not a parity of zeros
    torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)


@pytest.mark.extended  # ~10 s; says when transformers' DPT no longer needs the patches
def test_dpt_program_keeps_the_sample_size_without_the_patches():
    model, inputs = tiny_model("dpt", "depth-estimation")
    with torch.no_grad():
        program = torch.export.export(
            model, (), dict(inputs), dynamic_shapes=_image_dynamic(inputs), strict=False
        )
        with pytest.raises(AssertionError, match=r"Guard failed: .*\*\* 0\.5"):
            program.module()(**_grown(inputs))


def test_eomt_entries_and_scope():
    names = {e.name for e in registry.entries(dense_prediction.KEY, kind="patch")}
    assert f"{dense_prediction.__name__}.eomt_mask_probabilities_as_numbers" in names
    preparers = {e.name for e in registry.entries("inputs", kind="input_preparer")}
    assert f"{dense_prediction.__name__}.eomt_mask_probabilities_before_capture" in preparers
    model, _ = tiny_model("eomt", "image-segmentation")
    assert dense_prediction.capture_key(model) == dense_prediction.KEY


def test_eomt_captures_its_mask_branch_and_matches_eager_at_another_batch():
    """issue 28: EoMT's per-block branch on attn_mask_probs values failed capture
    (GuardOnDataDependentSymNode: Eq(u0, 1)); with the preparer's numbers it is decided at capture."""
    model, inputs = tiny_model("eomt", "image-segmentation")
    dynamic = {"pixel_values": {0: torch.export.Dim.AUTO}}
    with torch.no_grad():
        with apply_patches(dense_prediction.KEY), pytest.raises(Exception, match="data-dependent"):
            torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
        assert dense_prediction.eomt_mask_probabilities_before_capture(model, inputs) is inputs
        grown = {"pixel_values": torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))}
        expected = model(**grown)
        with apply_patches(dense_prediction.KEY):
            program = torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
        got = program.module()(**grown)
    assert isinstance(model.attn_mask_probs, torch.Tensor)  # the buffer is back
    assert got.masks_queries_logits.shape == (3, 10, 16, 16)
    for name in ("masks_queries_logits", "class_queries_logits"):
        torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)


def test_depth_pro_program_takes_another_batch_and_matches_eager():
    """issue 28: DepthPro's patch encoder counted its patches with len(), which fixed the batch
    (Eq(batch, 2)); with the patch the batch stays symbolic and the numbers are eager's."""
    name = f"{dense_prediction.__name__}.depth_pro_patch_counts_stay_symbolic"
    entry = next(e for e in registry.entries(dense_prediction.KEY, kind="patch") if e.name == name)
    assert entry.paths == dense_prediction.DEPTH_PRO_PATCH_ENCODER_TARGETS
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved
    model, inputs = tiny_model("depth_pro", "depth-estimation")
    assert dense_prediction.capture_key(model) == dense_prediction.KEY
    module = importlib.import_module("transformers.models.depth_pro.modeling_depth_pro")
    dynamic = {"pixel_values": {0: torch.export.Dim.AUTO}}
    with torch.no_grad():
        with apply_patches(dense_prediction.KEY):
            program = torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
        assert "len" not in module.__dict__  # the global is gone again
        for batch in (1, 3):
            grown = {
                "pixel_values": torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
            }
            expected = model(**grown).predicted_depth
            got = program.module()(**grown).predicted_depth
            assert got.shape == expected.shape == (batch, 64, 64)
            assert float(expected.abs().max()) > 1e-2  # not a parity of zeros
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.extended  # ~5 s quiet; says when transformers' DepthPro no longer needs the patch
def test_depth_pro_program_fixes_the_batch_without_the_patch():
    model, inputs = tiny_model("depth_pro", "depth-estimation")
    dynamic = {"pixel_values": {0: torch.export.Dim.AUTO}}
    with torch.no_grad():
        program = torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
    assert not program.range_constraints  # Eq(batch, 2): no symbol left
