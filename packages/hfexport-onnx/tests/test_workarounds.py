"""The registered ONNX workarounds: each one's behaviour on a small input, and its metadata."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from transformers import PretrainedConfig

from hfexport import registry
from hfexport.config import OnnxConfig
from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner, ir_fixes, patches, translations
from hfexport_onnx.versions import SUPPORTED

ATOL = 1e-5


def test_every_onnx_workaround_names_issue_and_range():
    found = [*registry.entries("onnx"), *translations.translation_entries(), *ir_fixes.ir_fix_entries()]
    assert found
    for entry in found:
        assert entry.issue.startswith("https://github.com/"), entry.name
        assert entry.versions and entry.description, entry.name
        assert entry.is_active(), (
            f"{entry.name} is inactive with the tested versions: {entry.inactive_reason()}"
        )
        if hasattr(entry, "is_stale"):
            assert not entry.is_stale(SUPPORTED), f"{entry.name} can be retired"


@pytest.mark.parametrize("length", [1, 3, 4, 9])
def test_keep_last_equals_the_negative_slice(length):
    x = torch.arange(2 * length * 3).reshape(2, length, 3)
    assert torch.equal(patches.keep_last(x, 4, dim=1), x[:, -4:])


def test_sliding_window_update_keeps_sequence_axis_unbounded():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class Window(torch.nn.Module):
        def forward(self, states: torch.Tensor) -> torch.Tensor:
            layer = DynamicSlidingWindowLayer(sliding_window=5)
            full, _ = layer.update(states, states)
            return layer.keys + full.sum()

    sample = torch.randn(2, 2, 3, 4)
    with registry.apply_patches("onnx"):
        program = torch.export.export(Window(), (sample,), dynamic_shapes=({2: Dim.AUTO},), strict=False)
    assert DynamicSlidingWindowLayer.update.__qualname__ == "DynamicSlidingWindowLayer.update"  # restored
    (length,) = [r for s, r in program.range_constraints.items() if r.lower == 2]
    assert str(length.upper) == "int_oo"  # not bounded by sliding_window - 2
    longer = torch.randn(2, 2, 9, 4)
    assert torch.allclose(program.module()(longer), Window()(longer))
    assert program.module()(longer).shape == (2, 2, 4, 4)


def test_dynamic_unit_axis_detection():
    x = torch.zeros(1, 7)
    assert patches.has_dynamic_unit_axis({"x": x}, {"x": {0: Dim.AUTO, 1: Dim.AUTO}})
    assert not patches.has_dynamic_unit_axis({"x": x}, {"x": {0: None, 1: Dim.AUTO}})
    assert not patches.has_dynamic_unit_axis({"x": x}, {"x": {0: Dim.STATIC, 1: Dim.AUTO}})
    assert not patches.has_dynamic_unit_axis({"x": torch.zeros(2, 7)}, {"x": {0: Dim.AUTO, 1: Dim.AUTO}})
    assert patches.has_dynamic_unit_axis({"x": [x]}, {"x": [{0: Dim("b"), 1: None}]})


def test_batch_of_one_sample_exports_a_dynamic_batch(tiny_encoder):
    model, inputs = tiny_encoder
    one = {k: v[:1] for k, v in inputs.items()}
    program = OnnxExporter().export(model, one, OnnxConfig(dynamic=True, external_data=False))
    assert str(program.model.graph.inputs[0].shape[0]) != "1"
    three = {
        "inputs_embeds": torch.randn(3, 11, 8, generator=torch.Generator().manual_seed(5)),
        "attention_mask": torch.ones(3, 11, dtype=torch.int64),
    }
    got = OnnxRuntimeRunner(program)(three)["last_hidden_state"]
    with torch.no_grad():
        assert (got - model(**three).last_hidden_state).abs().max() <= ATOL


class GroupedMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

        self.config = PretrainedConfig()
        self.weight = torch.nn.Parameter(torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0)))

    def forward(self, inputs_embeds: torch.Tensor, offs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": torch.ops.transformers.grouped_mm_fallback(inputs_embeds, self.weight, offs)}


def test_grouped_mm_fallback_translation_selects_each_rows_expert():
    model = GroupedMatmul().eval()
    rows = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # expert 1 empty, row 6 past the last bound
    exporter = OnnxExporter()
    program = exporter.export(
        model, {"inputs_embeds": rows, "offs": offs}, OnnxConfig(external_data=False, validate=False)
    )
    assert exporter.last_report.applied["custom_translations"] == [
        f"{translations.__name__}.grouped_mm_fallback"
    ]
    runner = OnnxRuntimeRunner(program)
    for routing in (offs, torch.tensor([0, 3, 3, 7], dtype=torch.int32)):
        got = runner({"inputs_embeds": rows, "offs": routing})["logits"]
        with torch.no_grad():
            expected = model(rows, routing)["logits"]
        assert got.shape == (7, 5)
        assert (got - expected).abs().max() <= ATOL
        if routing[-1] < 7:
            assert torch.equal(got[6:], torch.zeros(1, 5))  # rows past the last bound stay 0
