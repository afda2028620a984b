"""`hfexport export executorch --model tiny:qwen3 OUT`: the files it writes, the report, and the .pte
run in the ExecuTorch runtime at a shape the sample did not have (batch 1, 100 tokens)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hfexport.cli import app
from hfexport.testing import make_inputs, tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

runner = CliRunner()


def test_cli_exports_tiny_qwen3_to_a_pte_that_runs_past_the_sample_shape(tmp_path):
    out = tmp_path / "qwen3-pte"
    result = runner.invoke(
        app, ["export", "executorch", "--model", "tiny:qwen3", "--backend", "xnnpack", str(out)]
    )
    assert result.exit_code == 0, result.output
    # a causal LM with --task auto: the plain forward, and the line says how to get generation components
    assert (
        "exporting the plain forward (--task auto); --task text-generation exports the generation"
        in " ".join(result.output.split())
    )
    assert {p.name for p in out.iterdir()} == {
        "model.pte",
        "config.json",
        "export_report.json",
        "checksums.sha256",
    }

    saved = json.loads((out / "export_report.json").read_text())
    assert sorted(saved["sha256"]) == ["config.json", "model.pte"]
    report = saved["report"]
    assert {s["name"]: s["status"] for s in report["stages"]}["validate_second_shape"] == "ok"
    delegation = report["extra"]["delegation"]
    assert delegation["backends"] == {"XnnpackBackend": delegation["partitions"]}
    assert 0.3 < delegation["delegated_share"] <= 1.0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"

    from hfexport_executorch.runtime import load_method, load_program

    model, _ = tiny_model("qwen3")  # the same seeded weights the CLI exported
    inputs = make_inputs(model, batch_size=1, seq_len=100, seed=7)
    method = load_method(load_program(out / "model.pte"))
    logits = method.execute([inputs["input_ids"], inputs["attention_mask"]])[0]
    with torch.no_grad():
        expected = model(**inputs).logits
    assert logits.shape == expected.shape == (1, 100, model.config.vocab_size)
    assert (logits - expected).abs().max().item() < 1e-4


def test_cli_cuda_backend_without_cuda_says_what_to_do(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the cuda backend would export instead of refusing")
    out = tmp_path / "cuda"
    result = runner.invoke(
        app, ["export", "executorch", "--model", "tiny:qwen3", "--backend", "cuda", str(out)]
    )
    assert result.exit_code != 0
    message = " ".join(str(result.exception or "").split()) + " ".join(result.output.split())
    assert "CUDA" in message and "xnnpack" in message
    assert not out.exists() or not any(out.iterdir())
