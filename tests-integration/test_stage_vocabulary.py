"""Every backend's export report uses the shared stage names (``hfexport.report.Stage``), in order.

One dynamic export of the tiny BERT per installed backend, saved through ``output_path`` where
the config has one (ONNX, ExecuTorch; ``DynamoConfig`` has none, so its report has no ``save``
and no ``load_artifact``):
the shared names must appear in every report in the order of :data:`hfexport.report.SHARED_STAGES`,
and every other recorded name must be declared in the exporter's ``stages`` class attribute.
"""

from __future__ import annotations

import dataclasses

import pytest

from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.report import SHARED_STAGES, Stage
from hfexport.testing import tiny_model

BACKENDS = {
    "dynamo": ("hfexport_dynamo", "DynamoExporter", DynamoConfig, "model.pt2"),
    "onnx": ("hfexport_onnx", "OnnxExporter", OnnxConfig, "model.onnx"),
    "executorch": ("hfexport_executorch", "ExecutorchExporter", ExecutorchConfig, "model.pte"),
}


def test_shared_vocabulary_is_the_documented_run_order():
    assert SHARED_STAGES == (
        "prepare_inputs",
        "patches",
        "capture",
        "fx_program_fixes",
        "fx_node_fixes",
        "lower",
        "reference",
        "save",
        "load_artifact",
        "validate",
        "validate_second_shape",
    )
    assert Stage.CAPTURE == "capture" and isinstance(Stage.CAPTURE, str)


@pytest.fixture(scope="module")
def bert():
    return tiny_model("bert")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_report_uses_shared_stage_names_in_order(backend, bert, tmp_path):
    import importlib

    module_name, class_name, config_class, filename = BACKENDS[backend]
    exporter_class = getattr(importlib.import_module(module_name), class_name)
    model, inputs = bert
    exporter = exporter_class()
    path = tmp_path / filename
    saves = "output_path" in {f.name for f in dataclasses.fields(config_class)}
    config = config_class(dynamic=True, output_path=str(path)) if saves else config_class(dynamic=True)
    artifact = exporter.export(model, inputs, config)
    report = exporter.last_report
    names = [s.name for s in report.stages]

    shared = [name for name in names if name in SHARED_STAGES]
    # without output_path nothing is saved, so the in-memory artifact is validated (no load_artifact)
    expected = [name for name in SHARED_STAGES if saves or name not in (Stage.SAVE, Stage.LOAD_ARTIFACT)]
    assert shared == expected, report.summary_lines()
    own = [name for name in names if name not in SHARED_STAGES]
    undeclared = [name for name in own if name not in exporter_class.stages]
    assert not undeclared, f"{class_name} records stages it does not declare in .stages: {undeclared}"
    assert not set(exporter_class.stages) & set(SHARED_STAGES), "a backend redeclares a shared stage"
    assert all(s.status in ("ok", "skipped") for s in report.stages), report.summary_lines()
    # the applied patches/fixes of the shared stages are keyed by the shared stage names
    for kind in (Stage.PATCHES, Stage.FX_PROGRAM_FIXES, Stage.FX_NODE_FIXES):
        assert kind in report.applied, sorted(report.applied)
    if not saves:
        exporter.save(artifact, path)
    assert path.is_file()
    # the JSON report carries the same plain-string names
    assert [s["name"] for s in report.to_dict()["stages"]] == names
