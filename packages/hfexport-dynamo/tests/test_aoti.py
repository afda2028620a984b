"""AOTInductor: ``hfexport export dynamo --aoti`` writes ``model.aoti.pt2`` and validates it at both shapes."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hfexport.checkpoints import load_model
from hfexport.cli import app
from hfexport.config import DynamoConfig
from hfexport.testing.zoo import tiny_model
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo import aoti as aoti_module
from hfexport_dynamo.aoti import AotiRunner, package_path


def test_aoti_config_field_round_trips_through_json():
    config = DynamoConfig(dynamic=True, aoti=True)
    again = DynamoConfig.from_json_string(config.to_json_string())
    assert again.aoti is True and again == config
    assert DynamoConfig().aoti is False
    with pytest.raises(ValueError, match="aoti"):
        DynamoConfig(aoti="yes")
    assert package_path("out/model.pt2").name == "model.aoti.pt2"


def test_aoti_flag_is_refused_for_other_formats(tmp_path):
    result = CliRunner().invoke(
        app, ["export", "onnx", str(tmp_path / "o"), "--model", "tiny:bert", "--aoti"]
    )
    assert result.exit_code == 2
    assert "--aoti applies to the dynamo format, not onnx" in result.output
    assert not (tmp_path / "o").exists()


def test_no_cxx_compiler_fails_before_capture(monkeypatch):
    monkeypatch.setattr(aoti_module.shutil, "which", lambda name: None)
    monkeypatch.setenv("CXX", "no-such-compiler")
    model, inputs = tiny_model("bert")
    exporter = DynamoExporter()
    with pytest.raises(
        RuntimeError, match=r"needs a C\+\+ compiler; none of \['no-such-compiler', 'g\+\+'\]"
    ):
        exporter.export(model, inputs, DynamoConfig(dynamic=True, aoti=True))
    assert exporter.last_report is None  # refused before the report (and the capture) began


@pytest.mark.slow
def test_cli_aoti_writes_and_validates_the_package_at_both_shapes(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["export", "dynamo", str(out), "--model", "tiny:bert", "--aoti"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output[-3000:]
    assert (out / "model.pt2").is_file() and (out / "model.aoti.pt2").is_file()
    assert "model.aoti.pt2" in (out / "checksums.sha256").read_text()
    report = json.loads((out / "export_report.json").read_text())
    assert report["config"]["aoti"] is True
    stages = {s["name"]: s["status"] for s in report["report"]["stages"]}
    assert stages["aoti_compile"] == "ok" and stages["validate_aoti"] == "ok"
    validation = report["report"]["validation"]
    for key, shape in (("aoti_sample", [2, 8, 64]), ("aoti_second_shape", [3, 65, 64])):
        rows = {row["name"]: row for row in validation[key]}
        assert rows["last_hidden_state"]["shape"] == shape
        assert all(row["ok"] and row["max_abs_diff"] <= 1e-5 for row in rows.values()), rows
    # the package runs on its own, at yet another shape
    loaded = load_model("tiny:bert", "auto")
    ids = torch.randint(0, 50, (1, 11))
    inputs = {name: (ids if name == "input_ids" else torch.ones_like(ids)) for name in loaded.inputs}
    got = AotiRunner(out / "model.aoti.pt2")(inputs)
    with torch.no_grad():
        expected = loaded.model(**inputs)
    assert (got["last_hidden_state"] - expected.last_hidden_state).abs().max().item() <= 1e-5


@pytest.mark.extended
def test_cli_aoti_float16_package_is_scored_by_the_quality_gates(tmp_path):
    """The AOTI package of a float16 export is fed float16 inputs and gated (it used to get the
    float32 inputs and be compared with allclose: the export failed in ``validate_aoti``)."""
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["export", "dynamo", str(out), "--model", "tiny:llama", "--aoti", "--dtype", "float16"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output[-3000:]
    validation = json.loads((out / "export_report.json").read_text())["report"]["validation"]
    for key in ("aoti_sample", "aoti_second_shape"):
        logits = next(row for row in validation[key] if row["name"] == "logits")
        # measured: cosine 1.0000, top-1 1.0, max |diff| 3.8e-4 at both shapes
        assert logits["ok"] and logits["cosine"] >= 0.999 and logits["top1_agreement"] == 1.0, logits
        assert 0 < logits["max_abs_diff"] < 1e-2, logits
