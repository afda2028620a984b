"""The fine-grained dynamic-shape example: named batch/sequence dims on a padded batch of two prompts."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from hfexport.config import OnnxConfig
from hfexport.testing import tiny_model
from hfexport.validation import compare_outputs, eager_outputs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL = 1e-4


def _padded_prompts(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts: row i has ``length - 2 * i`` real tokens (at least one)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 256, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.int64)
    for row in range(batch):
        mask[row, : min(2 * row, length - 1)] = 0
    input_ids[mask == 0] = 0  # pad id of the tiny llama
    return {"input_ids": input_ids, "attention_mask": mask}


def test_named_dims_on_a_padded_batch():
    from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner

    model, _ = tiny_model("llama")
    inputs = _padded_prompts(2, 9, seed=0)  # a padded batch of two prompts
    batch, seq = Dim("batch", min=1, max=32), Dim("seq", min=1, max=2048)
    config = OnnxConfig(
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, config)
    report = exporter.last_report
    assert {s.name: s.status for s in report.stages}["validate_second_shape"] == "ok"
    assert all(r["ok"] and float(r["max_abs_diff"]) <= ATOL for r in report.validation["sample"])

    graph = program.model.graph
    assert [v.name for v in graph.inputs] == ["input_ids", "attention_mask"]
    assert [str(d) for d in graph.inputs[0].shape] == ["batch", "seq"]
    assert [str(d) for d in graph.inputs[1].shape] == ["batch", "seq"]
    assert [str(d) for d in graph.outputs[0].shape][:2] == ["batch", "seq"]

    # a third shape, padded as well: batch 5, 40 tokens
    runner = OnnxRuntimeRunner(program)
    third = _padded_prompts(5, 40, seed=3)
    rows = compare_outputs(
        eager_outputs(model, third), runner(third), atol=ATOL, attention_mask=third["attention_mask"]
    )
    logits = next(r for r in rows if r.name == "logits")
    assert logits.shape == (5, 40, 256)
    assert logits.ok and logits.max_abs_diff <= ATOL
    assert logits.compared == int(third["attention_mask"].sum()) * 256
