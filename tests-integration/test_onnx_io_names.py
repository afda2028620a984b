"""Graph input/output names of an export that takes a cache: nested inputs get dotted leaf paths."""

from __future__ import annotations

import pytest
import torch

from hfexport.config import OnnxConfig
from hfexport.tensors import duplicate_leaf_tensors, get_leaf_tensors
from hfexport.testing import tiny_model
from hfexport.validation import compare_outputs, eager_outputs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL = 1e-4


def _decode_inputs(model, past: int, new: int, batch: int = 2, seed: int = 0) -> dict:
    """Forward kwargs of a decode step: ``new`` tokens after a ``past``-token prefill cache."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 256, (batch, past), generator=gen)
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    return {
        "input_ids": torch.randint(3, 256, (batch, new), generator=gen),
        "attention_mask": torch.ones(batch, past + new, dtype=torch.int64),
        "past_key_values": cache,
    }


def test_cache_inputs_are_named_by_leaf_path():
    from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner

    model, _ = tiny_model("llama")
    inputs = _decode_inputs(model, past=5, new=3)
    exporter = OnnxExporter()
    program = exporter.export(model, duplicate_leaf_tensors(inputs), OnnxConfig(dynamic=True))
    graph = program.model.graph
    cache_paths = [f"past_key_values.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]
    assert [v.name for v in graph.inputs] == ["input_ids", "attention_mask", *cache_paths]
    assert list(get_leaf_tensors(inputs)) == [v.name for v in graph.inputs]
    out_paths = [f"cache.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]
    assert [v.name for v in graph.outputs] == ["logits", *out_paths]
    # the core validated a second past length (5 -> 11) and batch (2 -> 3), named by leaf path too
    second = {s.name: s for s in exporter.last_report.stages}["validate_second_shape"]
    assert second.status == "ok" and second.detail.startswith("past length 5 -> 11; batch 2 -> 3")
    record = exporter.last_report.second_shape
    assert record["inputs"]["past_key_values.layers.0.keys"] == [3, 2, 11, 16]
    assert record["inputs"]["attention_mask"] == [3, 14] and record["inputs"]["input_ids"] == [3, 3]

    # and another step length, which the core's second shape keeps
    other = _decode_inputs(model, past=11, new=2, batch=3, seed=1)
    got = OnnxRuntimeRunner(program)(duplicate_leaf_tensors(other))
    rows = compare_outputs(eager_outputs(model, other), got, atol=ATOL)
    assert [r.name for r in rows] == ["logits", *out_paths]
    assert rows[0].shape == (3, 2, 256) and rows[1].shape == (3, 2, 13, 16)
    assert all(r.ok and r.max_abs_diff <= ATOL for r in rows), rows
