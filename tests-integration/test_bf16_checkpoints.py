"""A checkpoint saved in bfloat16 (as Qwen3, Llama 3.x, SmolLM2 and Gemma are published) exports
on every backend with defaults, in the dtype the backend's runtime computes well, and validates
against the eager model in that dtype.

Each export runs the CLI as a user does (``hfexport export BACKEND --model FOLDER OUT``) on a tiny
qwen3 saved in bf16 (``config.json`` ``"dtype": "bfloat16"``): dynamo keeps bfloat16 (PyTorch
computes it), ONNX, ExecuTorch and OpenVINO export float32, compared with the float32 eager model
(the bf16 weights cast up exactly) at float32 tolerances; the saved folder then runs with
``hfexport.load`` and matches the eager model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: the dtype auto picks for a bf16 checkpoint, and the runtime's name in the decision's reason
EXPECTED = {
    "dynamo": ("bfloat16", "PyTorch computes bfloat16"),
    "onnx": ("float32", "ONNX Runtime's CPU provider computes float32 well here, not bfloat16"),
    "executorch": ("float32", "ExecuTorch's XNNPACK delegate computes float32 well here, not bfloat16"),
    "openvino": ("float32", "OpenVINO's CPU plugin (f32 hint) computes float32 well here, not bfloat16"),
}


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """A tiny seeded qwen3 with an offline tokenizer, saved in bfloat16."""
    from transformers import AutoModelForCausalLM

    from hfexport.testing.folders import tiny_model_folder

    folder = tiny_model_folder("qwen3", tmp_path_factory.mktemp("qwen3-bf16"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfexport.cli", "export", *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )


@pytest.mark.parametrize("backend", list(EXPECTED))
def test_bf16_checkpoint_exports_and_validates_with_defaults(backend, bf16_folder, tmp_path):
    out = tmp_path / "out"
    proc = _export(backend, str(out), "--model", str(bf16_folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_dtype, reason = EXPECTED[backend]
    assert f"export dtype {export_dtype} " in proc.stdout and reason in " ".join(proc.stdout.split())
    record = json.loads((out / "export_report.json").read_text())
    decision = record["dtype"]
    assert (decision["export"], decision["model"], decision["requested"]) == (export_dtype, "bfloat16", None)
    # a bf16 artifact is sized against the fp32 eager weights (a size line); a float32 one is plain
    change = record.get("size_change")
    if export_dtype == "float32":
        assert change is None
    else:
        assert change["artifact_bytes"] == (out / "model.pt2").stat().st_size, change
        assert change["eager_float32_bytes"] > 0 and "size: fp32 eager weights" in " ".join(
            proc.stdout.split()
        )
    for label in ("sample", "second_shape"):
        rows = {r["name"]: r for r in record["report"]["validation"][label]}
        assert all(r["ok"] for r in rows.values()), (label, rows)
        # float32 exports are held to float32 tolerances against the float32 (upcast) eager model;
        # the bf16 program is compared with the bf16 eager model (same kernels: 0 here)
        limit = 1e-4 if export_dtype == "float32" else 1e-2
        assert rows["logits"]["max_abs_diff"] <= limit, (label, rows["logits"])

    # the saved folder runs in its runtime and computes what the eager model computes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfexport

    tokenizer = AutoTokenizer.from_pretrained(bf16_folder)
    inputs = dict(tokenizer(["The quick brown fox"], return_tensors="pt"))
    eager = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=getattr(torch, export_dtype)).eval()
    with torch.no_grad():
        expected = eager(**inputs).logits
    got = hfexport.load(out)(**inputs).logits
    assert got.dtype == getattr(torch, export_dtype)
    assert (got.float() - expected.float()).abs().max() <= (1e-4 if export_dtype == "float32" else 1e-2)


def test_requested_dtype_casts_and_an_unsupported_one_is_refused_before_loading(bf16_folder, tmp_path):
    out = tmp_path / "fp32"
    proc = _export("dynamo", str(out), "--model", str(bf16_folder), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    decision = json.loads((out / "export_report.json").read_text())["dtype"]
    assert (decision["export"], decision["reference"], decision["reason"]) == (
        "float32",
        "float32",
        "requested",
    )
    program = torch.export.load(out / "model.pt2")
    assert {t.dtype for t in program.state_dict.values() if t.is_floating_point()} == {torch.float32}

    refused = _export("onnx", str(tmp_path / "bf16"), "--model", str(bf16_folder), "--dtype", "bfloat16")
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert (
        "dtype='bfloat16' cannot run in ONNX Runtime" in message
        and "allowed for onnx: float32, float16" in message
    )
    assert "loaded" not in refused.stdout  # refused before the model was loaded
    assert not (tmp_path / "bf16").exists()


def test_every_backend_declares_its_measured_memory_factor():
    """Each backend's estimate uses its own factor, measured at Qwen3-0.6B size, not the base's."""
    import importlib

    from hfexport.exporter import HfExporter

    factors = {}
    for backend, (module, name) in {
        "dynamo": ("hfexport_dynamo", "DynamoExporter"),
        "onnx": ("hfexport_onnx", "OnnxExporter"),
        "executorch": ("hfexport_executorch", "ExecutorchExporter"),
        "openvino": ("hfexport_openvino", "OpenvinoExporter"),
    }.items():
        cls = getattr(importlib.import_module(module), name)
        assert "memory_factor" in vars(cls), f"{name} inherits HfExporter.memory_factor"
        factors[backend] = cls.memory_factor
        # a 1.54B-parameter bf16 checkpoint (Qwen2.5-1.5B) fits a 24 GB machine on every backend
        decision = cls().decide_dtype("bfloat16", None)
        assert cls().estimate_peak_bytes(1_543_714_304, decision.export) < 22 * 10**9, (backend, decision)
    assert factors["dynamo"] < factors["onnx"] < factors["executorch"] != HfExporter.memory_factor


def test_cli_refuses_an_export_that_does_not_fit_before_loading(bf16_folder, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import hfexport.memory
    from hfexport.cli import app

    monkeypatch.setattr(hfexport.memory, "available_bytes", lambda: 100_000_000)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "onnx", str(out), "--model", str(bf16_folder)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Invalid value for --model: this onnx export of" in text and "in float32" in text
    assert "the machine has 100.00 MB available" in text and "--ignore-memory-estimate" in text
    assert "loaded" not in text and not out.exists()
    # the option skips the estimate (the tiny model fits in any case)
    result = CliRunner().invoke(
        app, ["export", "onnx", str(out), "--model", str(bf16_folder), "--ignore-memory-estimate"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "model.onnx").is_file()
