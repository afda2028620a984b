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

__all__ = [
    "POOLED_TASKS",
    "PooledMismatch",
    "build",
    "export_cell",
    "generation_cell",
    "main",
    "pooled_parity",
]


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
        and at the second shape (for :data:`POOLED_TASKS`, the mean-pooled embedding with a padded
        row too, :func:`pooled_parity`); otherwise ``{"status": "fail", "stage", "reason", ...}`` with the
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
    artifact = None
    try:
        artifact = exporter.export(model, inputs, config)
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
    if result["status"] == "pass" and task in POOLED_TASKS:
        try:
            result["pooled_max_abs_diff"] = pooled_parity(exporter, artifact, model, inputs, config)
        except Exception as exc:  # the pooled embedding's verdict is the cell's
            first = (str(exc).strip().splitlines() or [""])[0]
            stage = getattr(exc, "stage", None) or PooledMismatch.stage
            result = {
                **result,
                "status": "fail",
                "stage": stage,
                "reason": f"{type(exc).__name__}: {first}"[:300],
            }
    return result


# --- vision-language family (issue 28): generation from exported components -----------------------

#: greedy tokens compared with ``model.generate`` per image + prompt
VLM_NEW_TOKENS = 8


def _backend_generation_config(backend: str) -> dict[str, Any]:
    """Config fields of a generation export on ``backend``: ``dynamic=True``; OpenVINO's stateful
    decoder covers decoder-only language models only, so its stateless components here."""
    return {
        "export_format": backend,
        "dynamic": True,
        **({"stateful": False} if backend == "openvino" else {}),
    }


def generation_cell(backend: str, model_type: str, task: str) -> dict[str, Any]:
    """Export a fresh tiny vision-language model's generation components on ``backend`` and
    generate from them.

    ``export_for_generation`` with ``dynamic=True`` (each component validated against eager
    PyTorch at its sample and second shape), then greedy generation over the exported components
    for the sample image + prompt and for :func:`hfexport.generation.image_prompts.other_image_prompt`
    (more images and a longer prompt, or another image size), each compared token for token with
    ``model.generate(do_sample=False)``.

    Returns:
        ``{"status": "pass", "seconds", "stages", "components"}``; otherwise ``{"status": "fail",
        "stage", "reason", ...}`` with stage ``decompose`` (the model could not be split into
        components), the failed component's export stage (``"<component>: <stage>"``), or
        ``generate`` (the exported components ran but their tokens differ from ``model.generate``,
        or the runner failed; the reason names the shape and the first differing position).
    """
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.generation import GenerationRunner, callers_from_exporter, compare_with_generate
    from hfexport.generation.image_prompts import other_image_prompt
    from hfexport.testing import tiny_model

    model, inputs = tiny_model(model_type, task)
    config = AutoExportConfig.from_dict(_backend_generation_config(backend))
    exporter = AutoHfExporter.from_config(config)
    start = time.perf_counter()
    stages: dict[str, str] = {}

    def failed(stage: str, exc: BaseException | str) -> dict[str, Any]:
        text = (
            exc
            if isinstance(exc, str)
            else f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        )
        return {
            "status": "fail",
            "stage": stage,
            "reason": text[:300],
            "seconds": round(time.perf_counter() - start, 1),
            "stages": stages,
        }

    try:
        parts = exporter.export_for_generation(model, inputs, config)
    except Exception as exc:  # every failure becomes a cell of the coverage page
        component = getattr(exc, "component", None)
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if component is None:
            return failed("decompose", exc)
        stage = getattr(cause, "stage", None) or "export"
        return failed(
            stage, f"{component}: {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
        )
    for name, report in parts.reports.items():
        second = next((s.status for s in report.stages if s.name == "validate_second_shape"), "not run")
        stages[name] = f"second shape {second}"
    stages["export_for_generation"] = "ok"
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    shapes = {"sample": inputs}
    try:
        # an image encoder exported for one image size serves more images of that size
        shapes["second"] = other_image_prompt(model, inputs, same_image_size=bool(parts.plan.per_image))
    except Exception as exc:
        return failed("generate", f"no second image prompt: {type(exc).__name__}: {exc}")
    for label, prompt in shapes.items():
        try:
            parity = compare_with_generate(runner, model, prompt, max_new_tokens=VLM_NEW_TOKENS)
        except Exception as exc:
            return failed(
                "generate",
                f"at the {label} shape: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}",
            )
        if not parity.tokens_equal:
            where = parity.first_mismatch
            return failed(
                "generate",
                f"greedy tokens differ from model.generate at the {label} shape "
                f"({ {k: list(v.shape) for k, v in prompt.items() if hasattr(v, 'shape')} }): first at (row, position) "
                f"{where}, shapes {list(parity.sequences.shape)} vs {list(parity.reference.shape)}, "
                f"max logit diff {parity.max_logit_diff:.2e}",
            )
        stages[f"generate_{label}"] = "ok"
    return {
        "status": "pass",
        "seconds": round(time.perf_counter() - start, 1),
        "stages": stages,
        "components": list(parts),
    }


#: task -> the cell function of a family that checks more than a plain export
TASK_CELLS = {"image-text-to-text": generation_cell}


# issue 28, sentence embeddings: the mean-pooled embedding users compute from last_hidden_state
#: tasks whose cell also checks the mean-pooled embedding (:func:`pooled_parity`)
POOLED_TASKS = frozenset({"feature-extraction"})
#: largest difference allowed between the artifact's and eager's pooled embeddings, relative to the
#: largest eager value (at least 1)
POOLED_TOLERANCE = 1e-4


class PooledMismatch(AssertionError):
    """The artifact's mean-pooled embedding differs from eager PyTorch's (``stage`` names the check)."""

    stage = "validate_pooled"


def _mean_pool(hidden: Any, mask: Any) -> Any:
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def pooled_parity(
    exporter: Any, artifact: Any, model: Any, inputs: dict[str, Any], config: Any
) -> list[float]:
    """Check the mean-pooled sentence embedding of ``artifact`` against eager PyTorch's.

    At the sample shape and at the exporter's second shape (when it derives one), the last row of
    ``attention_mask`` is padded (its second half zeroed, as a shorter sentence in a batch is), both
    the artifact and eager ``model`` run, and ``last_hidden_state`` is averaged over the unpadded
    positions, the pooling sentence-transformers models use.

    Returns:
        The largest absolute difference per shape checked.

    Raises:
        PooledMismatch: a pooled embedding differs beyond :data:`POOLED_TOLERANCE` (relative to the
            largest eager value), or the artifact gives no ``last_hidden_state``.
    """
    import torch

    run = exporter.runner(artifact)
    shapes = [dict(inputs)]
    second, _ = exporter.second_shape_inputs(model, inputs, config, exporter.last_report)
    if second is not None:
        shapes.append(dict(second))
    diffs = []
    for kwargs in shapes:
        ids = kwargs.get("input_ids")
        if ids is not None and "attention_mask" in kwargs:
            mask = torch.ones_like(kwargs["attention_mask"])
            mask[-1, (mask.shape[1] + 1) // 2 :] = 0
            kwargs["attention_mask"] = mask
        mask = kwargs.get("attention_mask")
        with torch.no_grad():
            eager = model(**kwargs).last_hidden_state
        got = run(kwargs).get("last_hidden_state")
        if got is None:
            raise PooledMismatch("the artifact gives no last_hidden_state to pool")
        if mask is None:
            mask = torch.ones(eager.shape[:2], dtype=torch.int64)
        want, have = _mean_pool(eager, mask), _mean_pool(torch.as_tensor(got).to(eager.dtype), mask)
        diff = float((want - have).abs().max())
        limit = POOLED_TOLERANCE * max(1.0, float(want.abs().max()))
        if not diff <= limit:
            raise PooledMismatch(
                f"mean-pooled embedding at {list(eager.shape[:2])} (last row padded) does not match eager "
                f"PyTorch: max abs diff {diff:.2e} > {limit:.2e}"
            )
        diffs.append(diff)
    return diffs


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
        cell = TASK_CELLS.get(task, export_cell)
        _emit({"kind": "cell", "backend": backend, **cell(backend, model_type, task)})


if __name__ == "__main__":
    main()
