"""What a user's terminal shows for `hfexport export` without -v (new-user trial): no library noise
(transformers' right-padding warning, ONNX Runtime's own warnings, ExecuTorch's cpuinfo lines), which
goes to the CLI log file instead, and the summary of a generation export (every component's quality,
the size line, greedy parity vs model.generate). Run as subprocesses: native libraries write to the
process's file descriptor 2, which an in-process runner does not capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport import cli_logging

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: What each library printed on the terminal of the trial's quiet runs.
NOISE = (
    "right-padding was detected",  # transformers.generation.utils, model.generate on padded prompts
    "[W:onnxruntime",  # ONNX Runtime's default logger ("Removing initializer ...")
    "Removing initializer",
    "cpuinfo_utils",  # ExecuTorch's runtime when the first XNNPACK program loads
    "is an Enum subclass",
    "torchvision is not installed",
)


def _hfexport(*args: str, log: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TRANSFORMERS_VERBOSITY")}
    env.update({cli_logging.LOG_FILE_ENV: str(log), "COLUMNS": "200", "NO_COLOR": "1"})
    return subprocess.run(
        [sys.executable, "-m", "hfexport.cli", "export", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


def test_quantized_generation_export_is_quiet_and_summarises_every_component(tmp_path):
    from hfexport.testing.folders import tiny_model_folder

    folder = tiny_model_folder("llama", tmp_path / "llama")  # a tokenizer: prompts padded on the right
    out, log = tmp_path / "out", tmp_path / "cli.log"
    args = ["onnx", str(out), "--model", str(folder), "--task", "text-generation"]
    # random weights: top-1 agreement means little, so its gate is off; cosine keeps its default
    proc = _hfexport(*args, "--quantize", "int8-dynamic", "--gate", "top1_agreement=0", log=log)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _noise(proc.stdout + proc.stderr) == []
    assert proc.stderr.strip() == "", proc.stderr
    assert (
        "WARNING transformers.generation.utils: A decoder-only architecture is being used, but right-padding"
        in (log.read_text())
    )

    text = " ".join(proc.stdout.split())
    saved = json.loads((out / "export_report.json").read_text())
    assert list(saved["component_reports"]) == ["prefill", "decode"]
    for name in ("prefill", "decode"):
        assert f"quality vs fp32 eager: {name}, sample inputs (gated: mean per-vector cosine >= 0.99" in text
        logits = next(
            r for r in saved["component_reports"][name]["validation"]["sample"] if r["name"] == "logits"
        )
        assert logits["cosine"] >= 0.99 and f"{logits['cosine']:.4f}" in text
    change = saved["size_change"]
    sizes = {name: c["bytes"] / 1e6 for name, c in change["components"].items()}
    assert sizes["prefill"] > 0 and sizes["decode"] > 0
    assert (
        f"size: fp32 eager weights {change['eager_float32_bytes'] / 1e6:.1f} MB -> prefill {sizes['prefill']:.1f} MB"
        in text
    )
    parity = saved["report"]["extra"]["greedy_parity"]
    assert "error" not in parity and len(parity["sequence"]) == parity["new_tokens"] == 16
    if parity["tokens_equal"]:
        assert "greedy parity vs model.generate: tokens equal (16 of 16 new tokens)" in text
    else:
        row, index = parity["first_divergence"]
        assert (
            f"greedy parity vs model.generate: tokens differ; {parity['matching_prefix']} of 16 new tokens equal, "
            f"first divergence at new token {index} (row {row})"
        ) in text


def test_static_int8_export_keeps_onnx_runtime_warnings_in_the_log(tmp_path, minilm_path):
    # onnxruntime.quantization warns through the root logger before it calibrates ("Please consider
    # to run pre-processing before quantization"): the log gets it, the terminal does not. ONNX
    # Runtime's native "Removing initializer 'pooler.dense.weight'" (the pooler Gemm's weight left
    # unused once our Gemm -> MatMul rewrite transposed it) is gone: the rewrite drops the unused
    # original, so the saved graph has no unused initializer left to warn about. (The native
    # routing itself: hfexport-onnx's test_runtime_and_save.)
    import onnx

    out, log = tmp_path / "out", tmp_path / "cli.log"
    proc = _hfexport("onnx", str(out), "--model", str(minilm_path), "--quantize", "int8-static", log=log)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _noise(proc.stdout + proc.stderr) == []
    assert "pre-processing before quantization" not in proc.stdout + proc.stderr
    assert "WARNING root: Please consider to run pre-processing before quantization" in log.read_text()
    assert "Removing initializer" not in log.read_text()
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    used = {name for node in graph.node for name in node.input}
    assert [i.name for i in graph.initializer if i.name not in used] == []


def test_executorch_cpuinfo_lines_stay_off_the_terminal(tmp_path):
    """ExecuTorch's C++ runtime prints ``[cpuinfo_utils.cpp:...]`` lines to file descriptor 2 when
    validation loads the first XNNPACK program; through the console-script path (the supervised
    child, ``hfexport.native_output``) they reach the log file, not the terminal (issue 29)."""
    pytest.importorskip("hfexport_executorch")
    out, log = tmp_path / "out", tmp_path / "cli.log"
    proc = _hfexport("executorch", str(out), "--model", "tiny:bert", log=log)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpuinfo_utils" not in proc.stdout + proc.stderr  # (the tmp path itself holds "cpuinfo")
    assert proc.stderr.strip() == "", proc.stderr
    if sys.platform == "linux":  # ExecuTorch 1.4.1 prints them there; once it stops, this is moot
        assert "INFO executorch.native: [cpuinfo_utils.cpp:" in log.read_text()
