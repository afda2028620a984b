"""``hfexport bench``: folders of three backends measured in their own runtimes against eager.

One tiny llama folder (config + seeded weights + tokenizer) exported three ways: ONNX ``--layout
genai`` (run by onnxruntime_genai), OpenVINO ``--layout genai`` (run by openvino_genai's
LLMPipeline) and a dynamo generation folder (run by hfexport's generation runner). Every fp32
artifact must generate the eager model's greedy tokens and score perplexity ratio 1 / KL 0 /
top-1 1 on the quality text; the speed columns must be filled with positive numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfexport.cli import app
from hfexport.testing.folders import tiny_model_folder

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("openvino_genai")

NEW_TOKENS = 12


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args, env={"COLUMNS": "250", "HFEXPORT_ISOLATE": "0"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    model = tiny_model_folder("llama", root / "model")
    out = {"model": model}
    for name, args in {
        "onnx-genai": ["export", "onnx", "--layout", "genai"],
        "openvino-genai": ["export", "openvino", "--layout", "genai"],
        "dynamo-generation": ["export", "dynamo"],
    }.items():
        result = _invoke([*args, str(root / name), "--model", str(model), "--task", "text-generation"])
        assert result.exit_code == 0, result.output
        out[name] = root / name
    return out


def test_bench_measures_each_folder_in_its_own_runtime_against_eager(folders):
    result = _invoke(
        [
            "bench",
            str(folders["onnx-genai"]),
            str(folders["openvino-genai"]),
            str(folders["dynamo-generation"]),
            "--reference",
            str(folders["model"]),
            "--new-tokens",
            str(NEW_TOKENS),
            "--runs",
            "1",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [row["runtime"] for row in rows] == ["eager", "onnxruntime-genai", "openvino-genai", "hfexport"]
    eager = rows[0]
    assert len(eager["tokens"]) == NEW_TOKENS
    for row in rows[1:]:
        assert row["error"] == "", row
        assert row["tokens"] == eager["tokens"], row["label"]
        assert row["tokens_equal_eager"] == NEW_TOKENS
        assert row["prefill_ms"] > 0 and row["decode_tokens_per_s"] > 0 and row["peak_rss_bytes"] > 0
        assert 0 < row["size_bytes"] < 5e6  # a ~1 MB tiny model, reports excluded
        text = row["text"]
        # fp32 artifacts of the same weights: the text metrics of a lossless export
        assert abs(text["perplexity_ratio"] - 1.0) < 1e-3, text
        assert text["kl_divergence"] < 1e-4, text
        assert text["top1_agreement_text"] > 0.99, text
        assert text["tokens"] > 500  # the whole quality passage, not a few positions


def test_the_table_names_the_columns_and_a_folder_no_runtime_opens_is_a_usage_error(folders, tmp_path):
    result = _invoke(
        ["bench", str(folders["onnx-genai"]), "--input-ids", "5,6,7", "--new-tokens", "4", "--runs", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "decode tok/s" in result.output and "onnxruntime-genai" in result.output
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    result = _invoke(["bench", str(tmp_path / "empty"), "--input-ids", "1,2"])
    assert result.exit_code == 2
    assert "no installed runtime opens" in result.output and "notes.txt" in result.output
    result = _invoke(["bench", str(folders["onnx-genai"]), "--new-tokens", "1"])
    assert result.exit_code == 2 and "--new-tokens" in result.output
    for bad in (["--input-ids=-1,2"], ["--input-ids", ","], ["--input-ids", "1", "--threads", "0"]):
        result = _invoke(["bench", str(folders["onnx-genai"]), *bad])
        assert result.exit_code == 2, (bad, result.output)
    result = _invoke(["bench", str(tmp_path / "nowhere"), "--input-ids", "1"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_the_measuring_child_loads_a_runtime_opener_without_the_backend_package(folders):
    """The child's peak memory is the runtime's: the ONNX opener is loaded from its file, so neither
    hfexport_onnx's __init__ (the exporter) nor torch is imported by it."""
    code = (
        "import sys\n"
        "from hfexport.bench.runtimes import load_opener\n"
        "opener = load_opener('hfexport_onnx.bench_runtime:open_folder')\n"
        "opened = opener(__import__('pathlib').Path(sys.argv[1]), 1)\n"
        "print(opened.generate([5, 6, 7], 3))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'hfexport_onnx') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folders["onnx-genai"])], capture_output=True, text=True, check=True
    )
    lines = proc.stdout.strip().splitlines()
    assert len(json.loads(lines[0])) == 3
    assert lines[1] == "[]"


@pytest.mark.extended
def test_bench_runs_an_executorch_llm_runner_folder_with_text_metrics(folders):
    """TextLLMRunner generates the eager tokens; the text metrics step forward(tokens, input_pos)
    one token at a time (the runner's program returns the last position's logits only)."""
    pytest.importorskip("executorch")
    out = folders["model"].parent / "executorch-llm-runner"
    result = _invoke(
        [
            "export",
            "executorch",
            str(out),
            "--model",
            str(folders["model"]),
            "--task",
            "text-generation",
            "--layout",
            "llm-runner",
        ]
    )
    assert result.exit_code == 0, result.output
    result = _invoke(
        [
            "bench",
            str(out),
            "--reference",
            str(folders["model"]),
            "--new-tokens",
            str(NEW_TOKENS),
            "--runs",
            "1",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    eager, row = json.loads(result.output)
    assert row["runtime"] == "executorch-llm-runner" and row["error"] == ""
    assert row["tokens"] == eager["tokens"] and len(row["tokens"]) == NEW_TOKENS
    assert abs(row["text"]["perplexity_ratio"] - 1.0) < 1e-3 and row["text"]["top1_agreement_text"] > 0.99
