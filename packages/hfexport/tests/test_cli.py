"""The console script: `env` lists backends with versions and drift; bad input exits non-zero."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hfexport import environment
from hfexport.cli import app

runner = CliRunner()


def test_env_table_lists_every_backend():
    result = runner.invoke(app, ["env"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    for name in ("hfexport-dynamo", "hfexport-onnx", "hfexport-executorch", "torch 2.13"):
        assert name in result.output


def test_env_json_reports_drift(monkeypatch):
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version", lambda d: "9.9.9" if d == "torch" else real(d))
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["torch"] == "9.9.9"
    backends = {b["format"]: b for b in data["backends"]}
    assert set(backends) == {"dynamo", "onnx", "executorch", "openvino"}
    for b in backends.values():
        if b["tested"].get("torch"):
            assert any(d.startswith("torch 9.9.9") for d in b["drift"]), b


def test_export_rejects_unknown_format_and_missing_model(tmp_path):
    result = runner.invoke(app, ["export", "tflite", str(tmp_path / "out"), "--model", "tiny:bert"])
    assert result.exit_code != 0
    assert "FORMAT must be one of dynamo, onnx, executorch, openvino" in " ".join(result.output.split())
    result = runner.invoke(
        app, ["export", "dynamo", str(tmp_path / "out"), "--model", str(tmp_path / "nope")]
    )
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "is not a local folder" in text and "stage 'load_model'" in text
    assert not (tmp_path / "out" / "model.pt2").exists()


def test_generate_needs_exactly_one_prompt_kind(tmp_path):
    result = runner.invoke(app, ["generate", str(tmp_path)])
    assert result.exit_code != 0 and "exactly one of --prompt or --input-ids" in result.output


def test_validation_table_names_a_bare_tensor_output(monkeypatch):
    """A forward returning one tensor (the ExecuTorch llm-runner forward) has an empty leaf path;
    the table still names the row."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import hfexport.cli as cli

    buffer = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=buffer, width=200))
    row = {
        "name": "",
        "shape": [2, 8, 512],
        "max_abs_diff": 1.5e-6,
        "max_rel_diff": 2e-5,
        "atol": 1e-4,
        "ok": True,
    }
    cli._print_validation(SimpleNamespace(validation={"sample": [row]}, extra={}))
    text = buffer.getvalue()
    assert "output 0 (a bare tensor)" in text and "2x8x512" in text and "1.500e-06" in text


def test_quantization_options_fill_the_quantization_config(tmp_path, monkeypatch):
    # issue 12: every QuantizationConfig field has its export option (each with a method that reads it)
    import hfexport.cli as cli
    import hfexport.loading

    made = []
    config_for = cli._config_for
    monkeypatch.setattr(cli, "_config_for", lambda *a, **k: made.append(config_for(*a, **k)) or made[-1])

    def stop(*args, **kwargs):
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(hfexport.loading, "load_model", stop)
    args = ["export", "executorch", str(tmp_path / "out"), "--model", "tiny:gpt2", "--quantize", "8da4w"]
    args += ["--embedding-bits", "4", "--group-size", "64", "--quantize-exclude", "lm_head"]
    args += ["--quantize-exclude", "transformer.h.0.*"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "stop before loading" in " ".join(result.output.split())
    (config,) = made
    assert config.quantization.to_dict() == {
        "method": "8da4w",
        "group_size": 64,
        "embedding_bits": 4,
        "per_channel": True,
        "exclude": ["lm_head", "transformer.h.0.*"],
        "calibration": None,
        "num_calibration_samples": 32,
    }
    made.clear()
    result = runner.invoke(app, [*args[:7], "--embedding-bits", "8"])
    assert result.exit_code == 1 and made[0].quantization.embedding_bits == 8
    assert made[0].quantization.per_channel is True and made[0].quantization.exclude == ()

    made.clear()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n", encoding="utf-8")
    args = ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:gpt2", "--quantize", "int8-static"]
    args += ["--per-tensor", "--calibration", str(prompts), "--calibration-samples", "3"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "stop before loading" in " ".join(result.output.split())
    assert made[0].quantization.to_dict() == {
        "method": "int8-static",
        "group_size": None,
        "embedding_bits": None,
        "per_channel": False,
        "exclude": [],
        "calibration": str(prompts),
        "num_calibration_samples": 3,
    }


def test_ort_fusions_outside_the_targets_names_them_without_python_none(tmp_path):
    result = runner.invoke(
        app,
        ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:bert", "--ort-fusions", "gpu"],
        env={"COLUMNS": "240", "NO_COLOR": "1"},
    )
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert (
        "Invalid value for --ort-fusions: 'gpu' is not a fusion target; --ort-fusions must be one of: "
        "cpu, cuda (or omit it for a graph without fused ops)"
    ) in text
    assert "None" not in text


def test_export_help_documents_the_quantization_options():
    result = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "240", "NO_COLOR": "1"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    assert "--embedding-bits <4|8>" in text and "4 or 8 bits (executorch; other backends refuse it)" in text
    for option in ("--group-size", "--per-tensor", "--quantize-exclude", "--calibration-samples"):
        assert option in text
