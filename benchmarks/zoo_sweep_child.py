"""The sweep's child process: build one model type's tiny model, then export it on each backend.

Run by ``zoo_sweep.py`` (next to this file) as ``python -c "...; from zoo_sweep_child import main;
main()" <model_type> <task> <backend,...>`` in a fresh interpreter (or a fork of the sweep). It prints one JSON line per step,
flushed as soon as the step ends: first ``{"kind": "build", ...}``, then ``{"kind": "cell",
"backend": ..., ...}`` per backend, so a parent that has to kill a hung or crashed child still keeps
every finished step. One interpreter serves all backends of a type: the imports and the tiny model
are paid once, which is most of a tiny export's wall time. Every backend gets a fresh tiny model,
so a backend that leaves state behind on the model cannot pass it to the next one.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from hfexport.validation import NOTHING_VARIED

__all__ = ["build", "export_cell", "main"]


def build(model_type: str, task: str) -> dict[str, Any]:
    """Build and eagerly run the tiny model of ``model_type`` for ``task``.

    Returns:
        ``{"status": "ok", "seconds", "params", "model_class", "inputs": {name: shape}}``, or
        ``{"status": "eager fails" | "unbuildable" | "not offered", "stage", "reason"}``.
    """
    from hfexport.testing import TinyModelUnavailable, tiny_model

    start = time.perf_counter()
    try:
        model, inputs = tiny_model(model_type, task, check_eager=True)
    except TinyModelUnavailable as exc:
        status = "eager fails" if exc.stage == "eager" else "unbuildable"
        return {"status": status, "stage": exc.stage, "reason": exc.reason}
    except ValueError as exc:
        return {"status": "not offered", "stage": "task", "reason": str(exc).splitlines()[0][:300]}
    return {
        "status": "ok",
        "seconds": round(time.perf_counter() - start, 2),
        "params": sum(p.numel() for p in model.parameters()),
        "model_class": type(model).__name__,
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
    }


def export_cell(backend: str, model_type: str, task: str) -> dict[str, Any]:
    """Export a fresh tiny model of ``model_type`` on ``backend`` with ``dynamic=True``.

    Returns:
        ``{"status": "pass", "seconds", "stages"}`` when the export validated at the sample shape
        and at the second shape; otherwise ``{"status": "fail", "stage", "reason", ...}`` with the
        failed stage and the first line of the error (a pass whose second-shape validation did not
        run, or found no axis to vary because the program came out static, counts as a failure of
        ``validate_second_shape``).
    """
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.testing import tiny_model

    model, inputs = tiny_model(model_type, task)
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    start = time.perf_counter()
    result: dict[str, Any] = {"status": "pass"}
    try:
        exporter.export(model, inputs, config)
    except Exception as exc:  # every failure becomes a cell of the coverage page
        report = getattr(exporter, "last_report", None)
        failed = [s.name for s in getattr(report, "stages", []) if s.status not in ("ok", "skipped")]
        stage = getattr(exc, "stage", None) or (failed[-1] if failed else "export")
        first = (str(exc).strip().splitlines() or [""])[0]
        result = {"status": "fail", "stage": stage, "reason": f"{type(exc).__name__}: {first}"[:300]}
    report = getattr(exporter, "last_report", None)
    stages = {s.name: s.status for s in getattr(report, "stages", [])}
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["stages"] = stages
    if result["status"] == "pass" and stages.get("validate_second_shape") != "ok":
        result = {
            **result,
            "status": "fail",
            "stage": "validate_second_shape",
            "reason": "second-shape validation did not run: " + str(stages.get("validate_second_shape")),
        }
    second = next((s for s in getattr(report, "stages", []) if s.name == "validate_second_shape"), None)
    if result["status"] == "pass" and second is not None and second.detail == NOTHING_VARIED:
        # asked dynamic, came out static: a pass here would claim dynamic shapes that do not hold
        result = {
            **result,
            "status": "fail",
            "stage": "validate_second_shape",
            "reason": "the program came out static: every axis asked dynamic was specialised, nothing varied",
        }
    return result


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Entry of the child: ``<model_type> <task> [<backend,...>]``; ``-`` as the only backend list
    entry, or no list, builds only. ``--no-build`` as the first argument skips the eager build."""
    args = list(sys.argv[1:] if argv is None else argv)
    skip_build = bool(args) and args[0] == "--no-build"
    if skip_build:
        args = args[1:]
    model_type, task = args[0], args[1]
    backends = [b for b in (args[2] if len(args) > 2 else "").split(",") if b and b != "-"]
    if not skip_build:
        built = build(model_type, task)
        _emit({"kind": "build", **built})
        if built["status"] != "ok":
            return
    for backend in backends:
        _emit({"kind": "cell", "backend": backend, **export_cell(backend, model_type, task)})


if __name__ == "__main__":
    main()
