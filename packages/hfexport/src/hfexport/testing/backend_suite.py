"""The harness every backend's zoo and shared-case tests share.

Each backend runs the same suites on its exporter: every hand-written tiny preset
(:data:`PRESET_ZOO`), the shared regression cases (:func:`hfexport.testing.list_cases`), and the
checks on what the exporter reports (:func:`assert_stages_ok`, :func:`assert_matches_at_two_shapes`)
and on what the artifact computes (:func:`assert_runs_match_eager`). A known upstream failure is
declared once per test as a :class:`KnownFailure` and applied by :func:`export_unless_known_failure`,
so a skip always names its reason and never hides another failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hfexport.errors import ExportStageError
from hfexport.tiny import SUPPORTED_MODEL_TYPES
from hfexport.validation import validate_artifact

__all__ = [
    "CASE_COVERED_PRESETS",
    "PRESET_ZOO",
    "KnownFailure",
    "assert_matches_at_two_shapes",
    "assert_runs_match_eager",
    "assert_stages_ok",
    "export_unless_known_failure",
]

_T = TypeVar("_T")

#: hand-written presets whose export the shared cases cover (C08 wav2vec2 CTC, C04 Qwen2-VL's grid)
CASE_COVERED_PRESETS: tuple[str, ...] = ("wav2vec2", "qwen2_vl")
#: the hand-written presets a backend's zoo test exports with its plain ``export`` (the others are
#: covered by the shared cases), in :data:`hfexport.tiny.SUPPORTED_MODEL_TYPES` order
PRESET_ZOO: tuple[str, ...] = tuple(t for t in SUPPORTED_MODEL_TYPES if t not in CASE_COVERED_PRESETS)


@dataclass(frozen=True)
class KnownFailure:
    """An export failure a test expects (an upstream limit), and the reason its skip gives.

    Attributes:
        reason: the skip's reason: what fails, the upstream issue, and where the model is covered.
        stage: the :class:`~hfexport.errors.ExportStageError` stage it fails at, or a prefix of it
            (``"capture"`` matches ``"capture.torch_export"``).
        match: a regular expression searched in the error's message and in its cause's.
        strict: ``True``: an export that succeeds fails the test (the limit is gone: remove the
            declaration); ``False``: the test then goes on as for any other model.
    """

    reason: str
    stage: str = "capture"
    match: str = "data-dependent"
    strict: bool = True

    def matches(self, error: ExportStageError) -> bool:
        """Whether ``error`` is this failure (same stage or sub-stage, message or cause matching)."""
        stage_ok = error.stage == self.stage or error.stage.startswith(f"{self.stage}.")
        texts = (str(error), str(error.__cause__ or ""))
        return stage_ok and any(re.search(self.match, text) for text in texts)


def export_unless_known_failure(export: Callable[[], _T], known: KnownFailure | None) -> _T:
    """Run ``export()`` and return what it returns; skip the test on ``known``'s failure.

    Args:
        export: the export call (``lambda: exporter.export(model, inputs, config)``).
        known: the failure expected from this export, or ``None`` for none.

    Raises:
        pytest.skip.Exception: the export failed exactly as ``known`` says (its reason is the skip's).
        ExportStageError: any other export failure, unchanged.
        AssertionError: ``known`` is strict and the export succeeded.
    """
    try:
        result = export()
    except ExportStageError as error:
        if known is not None and known.matches(error):
            import pytest  # only here: importing this module needs no pytest

            pytest.skip(known.reason)
        raise
    if known is not None and known.strict:
        raise AssertionError(f"the known failure no longer happens, remove its skip: {known.reason}")
    return result


def _statuses(report: Any) -> dict[str, str]:
    return {stage.name: stage.status for stage in report.stages}


def assert_stages_ok(report: Any, *, second_shape: bool) -> None:
    """Every stage of ``report`` (an :class:`~hfexport.report.ExportReport`) is ``ok`` or ``skipped``,
    and with ``second_shape`` the ``validate_second_shape`` stage ran and is ``ok``.

    Raises:
        AssertionError: with the report's summary lines.
    """
    assert all(s.status in ("ok", "skipped") for s in report.stages), report.summary_lines()
    if second_shape:
        assert _statuses(report).get("validate_second_shape") == "ok", report.summary_lines()


def assert_matches_at_two_shapes(
    report: Any, atol: float | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The exporter validated the artifact at the sample shape and at a second, different shape.

    Args:
        report: the :class:`~hfexport.report.ExportReport` of a ``dynamic=True`` export.
        atol: the largest ``max_abs_diff`` accepted in any row; ``None`` accepts the exporter's own
            verdict (``ok``) alone.

    Returns:
        ``(sample_rows, second_rows)``: ``report.validation["sample"]`` and ``["second_shape"]``,
        one dict per compared output (``name``, ``shape``, ``ok``, ``max_abs_diff`` ...).

    Raises:
        AssertionError: a validation stage is not ``ok``, a row is not ``ok`` or exceeds ``atol``,
            the two shapes compared different outputs, or no output changed shape.
    """
    statuses = _statuses(report)
    assert statuses.get("validate") == "ok" and statuses.get("validate_second_shape") == "ok", (
        report.summary_lines()
    )
    sample, second = report.validation["sample"], report.validation["second_shape"]
    assert sample and [r["name"] for r in sample] == [r["name"] for r in second], (sample, second)
    for row in sample + second:
        assert row["ok"], row
        assert atol is None or float(row["max_abs_diff"]) <= atol, row
    assert any(tuple(a["shape"]) != tuple(b["shape"]) for a, b in zip(sample, second)), (sample, second)
    return sample, second


def assert_runs_match_eager(
    model: torch.nn.Module,
    runs: Mapping[str, Callable[[dict[str, Any]], Any]],
    input_sets: Iterable[dict[str, Any] | None],
    *,
    atol: float,
    first_output: str | Sequence[str] = "logits",
) -> None:
    """Every runner of ``runs`` matches eager ``model`` on every input set, within ``atol``.

    Args:
        model: the eager model.
        runs: label -> runner (``exporter.runner(artifact)``; ``"exported"``, ``"reloaded"`` ...).
        input_sets: forward kwargs to compare on; ``None`` entries (a case without second inputs)
            are left out.
        atol: absolute and relative tolerance of :func:`hfexport.validation.validate_artifact`.
        first_output: the name (or names) the first compared output must have.

    Raises:
        AssertionError: an output differs, or the first output has another name.
    """
    names = (first_output,) if isinstance(first_output, str) else tuple(first_output)
    sets = [kwargs for kwargs in input_sets if kwargs is not None]
    for label, run in runs.items():
        for kwargs in sets:
            rows = validate_artifact(model, run, kwargs, atol=atol, rtol=atol, label=label)
            assert rows[0].name in names and all(r.ok for r in rows), rows
