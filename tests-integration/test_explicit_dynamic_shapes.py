"""Explicit ``dynamic_shapes`` validate at a second shape that changes only the declared axes
(issue 14 item 6): batch-only, sequence-only and a sequence with ``max=32``, per backend."""

from __future__ import annotations

import pytest
from torch.export import Dim

from hfexport.config import DynamoConfig, OnnxConfig
from hfexport.testing import tiny_model

pytestmark = [pytest.mark.integration]


def _spec(kind: str) -> dict:
    batch, seq, seq32 = Dim("batch"), Dim("seq"), Dim("seq", max=32)
    return {
        "batch": {"input_ids": {0: batch}, "attention_mask": {0: batch}},
        "sequence": {"input_ids": {1: seq}, "attention_mask": {1: seq}},
        "sequence-max-32": {"input_ids": (None, seq32), "attention_mask": (None, seq32)},
        "static": {"input_ids": None, "attention_mask": None},
    }[kind]


# the tiny llama's sample is [2, 8]; its vocabulary 256
EXPECTED_LOGITS = {"batch": (3, 8, 256), "sequence": (2, 65, 256), "sequence-max-32": (2, 32, 256)}


def _exporter(backend: str):
    if backend == "dynamo":
        from hfexport_dynamo import DynamoExporter

        return DynamoExporter(), DynamoConfig
    from hfexport_onnx import OnnxExporter

    return OnnxExporter(), OnnxConfig


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@pytest.mark.parametrize("kind", ["batch", "sequence", "sequence-max-32"])
def test_second_shape_changes_only_declared_axes(llama, backend, kind):
    model, inputs = llama
    exporter, config_cls = _exporter(backend)
    exporter.export(model, inputs, config_cls(dynamic_shapes=_spec(kind)))
    report = exporter.last_report
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok"
    logits = next(r for r in report.validation["second_shape"] if r["name"] == "logits")
    assert tuple(logits["shape"]) == EXPECTED_LOGITS[kind]
    assert logits["ok"] and float(logits["max_abs_diff"]) <= 1e-4


def test_static_dynamic_shapes_skip_the_second_shape_with_a_reason(llama):
    from hfexport_dynamo import DynamoExporter

    model, inputs = llama
    exporter = DynamoExporter()
    exporter.export(model, inputs, DynamoConfig(dynamic_shapes=_spec("static")))
    (skipped,) = [s for s in exporter.last_report.stages if s.name == "validate_second_shape"]
    assert skipped.status == "skipped"
    assert skipped.detail.startswith("dynamic_shapes declares no dynamic axis")
    assert "second_shape" not in exporter.last_report.validation
