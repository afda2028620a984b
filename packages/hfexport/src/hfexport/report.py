"""The export report: every stage of an export, its outcome and its time.

A report is filled while an export runs (:meth:`ExportReport.stage`) and ends up in
``export_report.json`` next to the artifact, so a failure says where it happened, for which
component and with which inputs.
"""

from __future__ import annotations

import contextlib
import enum
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hfexport import faults
from hfexport.atomic import note_stage
from hfexport.errors import MEMORY_OPTIONS, ExportMemoryError, ExportStageError, HfExportError
from hfexport.memory import current_rss_bytes, peak_rss_bytes

__all__ = ["CAPTURE_STEPS", "SHARED_STAGES", "TYPED_FACTS", "ExportReport", "Stage", "StageRecord"]


class Stage(enum.StrEnum):
    """The stages every backend runs, named once so every ``export_report.json`` shares the keys.

    In run order: ``prepare_inputs`` (base class: output flags, attention, preparers, the cast to
    the reference dtype), ``patches``, ``capture``, ``fx_program_fixes``, ``fx_node_fixes``,
    ``lower``, ``reference`` (the eager outputs validation compares with, computed before the
    runtime loads the artifact), ``save`` (when there is a path), ``load_artifact`` (the saved file
    loaded in its runtime for validation), ``validate``, ``validate_second_shape`` (the last five
    by the base class). A backend records a
    shared stage under exactly this name (members are ``str``, so ``report.stage(Stage.CAPTURE)``
    records ``"capture"``) and the names of the patches/fixes it applied there under the same key
    of ``report.applied``. Rules:

    - ``patches`` installs the workarounds on torch/transformers code that are active around
      capture (registry kind ``patch`` under the backend's key). Patches a backend puts on its
      own toolchain (ONNX: torch.onnx/onnxscript) are a backend stage ``<backend>_patches``
      (``onnx_patches``) recorded right after ``patches``.
    - ``lower`` turns the captured program into the backend's artifact. A backend whose lowering
      is several steps records ``lower`` around them and its own stages inside (ONNX:
      ``custom_translations``, ``translate``, ``io_names``, ``ir_fixes``, ``optimize``,
      ``external_data``); a backend without lowering records it as skipped (dynamo: the
      ``ExportedProgram`` is the artifact).
    - A stage made of named steps lists the steps after it as ``<stage>.<step>``
      (:data:`CAPTURE_STEPS`). A failure marks the innermost step and the enclosing stage failed;
      the error names the innermost.
    - Anything else is a backend stage, declared in the exporter's ``stages`` class attribute
      (ExecuTorch: ``prepare_backend``, ``dynamic_shapes``, ``memory_budget``,
      ``memory_planning``), recorded between the shared stages in run order.

    ``validate_second_shape``, ``save`` and ``load_artifact`` appear only when they apply (a dynamic
    export; an ``output_path``); ``validate`` appears as skipped when ``config.validate`` is False.
    """

    PREPARE_INPUTS = "prepare_inputs"
    PATCHES = "patches"
    CAPTURE = "capture"
    FX_PROGRAM_FIXES = "fx_program_fixes"
    FX_NODE_FIXES = "fx_node_fixes"
    LOWER = "lower"
    REFERENCE = "reference"
    SAVE = "save"
    LOAD_ARTIFACT = "load_artifact"
    VALIDATE = "validate"
    VALIDATE_SECOND_SHAPE = "validate_second_shape"


#: the shared stage names in run order
SHARED_STAGES: tuple[str, ...] = tuple(s.value for s in Stage)

#: the steps of :func:`hfexport.capture.capture` when it records them (``record_stages=True``)
CAPTURE_STEPS: tuple[str, ...] = (
    "capture.cache_pytrees",
    "capture.signature",
    "capture.dynamic_shapes",
    "capture.reset_stale_state",
    "capture.patches",
    "capture.torch_export",
)

# Errors the user can act on directly keep their type; anything else is wrapped so the message
# names the stage it came from.
_PASS_THROUGH = (HfExportError, ValueError, TypeError, ImportError, KeyboardInterrupt)


@dataclass
class StageRecord:
    """One stage: ``status`` is ``"ok"``, ``"failed"`` or ``"skipped"``; ``seconds`` wall time;
    ``rss_bytes`` the process's resident set size when the stage ended and ``peak_rss_bytes`` its
    peak since the process started, read at the same moment (:mod:`hfexport.memory`): the stage
    whose ``peak_rss_bytes`` exceeds the previous stage's raised the peak. ``None`` where the
    platform does not tell."""

    name: str
    status: str = "ok"
    seconds: float = 0.0
    detail: str = ""
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int | None = None
    rss_bytes: int | None = None


#: The typed facts of :class:`ExportReport` that later stages read back; :meth:`ExportReport.to_dict`
#: writes them into ``extra``.
TYPED_FACTS = (
    "dynamic_axes",
    "dynamic_axes_summary",
    "dynamic_bounds",
    "quantization",
    "second_shape",
    "quality_gates",
    "text_quality_gates",
    "top1_gated_on_text",
    "greedy_parity",
    "validation_generation",
    "output_flags",
)


@dataclass
class ExportReport:
    """What happened during one export (one component).

    Attributes:
        export_format: backend name (``"onnx"``, ...).
        component: model component (``"model"`` for a plain export, ``"decode"`` ...).
        model_class: class name of the exported module.
        input_names: forward kwarg leaf paths with shapes and dtypes.
        stages: the stages in order.
        applied: patches and fixes that were applied, by kind.
        validation: per-output comparison rows, per validated input set.
        extra: free-form facts for people and tools reading the report (e.g. XNNPACK delegation
            share, fused ORT ops); no stage of ours reads them back. What a later stage reads is a
            typed field below; :meth:`to_dict` writes those into ``extra`` too, under the same
            names, so ``export_report.json`` keeps one layout.
        dtype: the dtype decision (:class:`hfexport.precision.DtypeDecision` as a dict: ``export``,
            ``model``, ``reference``, ``requested``, ``reason``, ``upcasts``, ``gated``), ``None``
            before the export starts.
        artifact_metadata: what ``exporter.generation_support.component_metadata`` returned for the saved artifact
            (``None`` when nothing was saved); the folder's ``export_report.json`` keeps it for
            ``hfexport.load``.
        dynamic_axes: what the captured program made of each input axis asked dynamic (written by
            :func:`hfexport.capture.capture`, see :func:`hfexport.program_axes.program_input_axes`:
            ``input``, ``axis``, ``status``, ``min``, ``max``, ``meaning``, ``note``); read by
            second-shape derivation, the text-metric chunking and ExecuTorch's bound planning.
        dynamic_axes_summary: one line per input of :attr:`dynamic_axes` (the CLI prints them).
        dynamic_bounds: ExecuTorch's planned upper bounds per dynamic axis (``axes``,
            ``specialized``), read by its ``llm-runner`` layout.
        quantization: what the quantization did (method, options, counts per op kind, sizes).
        second_shape: the second validation shape (shapes, the axes it changes and their values,
            ``summary``); the folder records it per component.
        quality_gates: the per-output quality gates in force (``{metric: threshold}``).
        text_quality_gates: the language-model text gates asked for
            (:func:`hfexport.quality.text_gates_for`).
        top1_gated_on_text: top-1 agreement is gated over the text
            (``top1_agreement_text``) instead of over the sample positions.
        greedy_parity: greedy generation from the exported components against ``model.generate``
            (``hfexport.generation.export``, after the components are exported).
        validation_generation: the OpenVINO stateful decoder's own generation check.
        output_flags: the output flags of the sample inputs (``{"use_cache": True, ...}``), set
            by ``HfExporter.export`` after preparing the inputs; :func:`hfexport.capture.capture`
            makes them constant inputs of the program, validation passes them to the runner.
    """

    export_format: str
    component: str = "model"
    model_class: str = ""
    input_names: dict[str, dict[str, Any]] = field(default_factory=dict)
    stages: list[StageRecord] = field(default_factory=list)
    applied: dict[str, list[str]] = field(default_factory=dict)
    validation: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: dict[str, Any] | None = None
    artifact_metadata: dict[str, Any] | None = None
    dynamic_axes: list[dict[str, Any]] | None = None
    dynamic_axes_summary: list[str] | None = None
    dynamic_bounds: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    second_shape: dict[str, Any] | None = None
    quality_gates: dict[str, float] | None = None
    text_quality_gates: dict[str, float] | None = None
    top1_gated_on_text: bool = False
    greedy_parity: dict[str, Any] | None = None
    validation_generation: dict[str, Any] | None = None
    output_flags: dict[str, Any] | None = None
    # called as callback(event, record) with event "start" or "end"; used by the CLI for progress
    callback: Any = field(default=None, repr=False, compare=False)

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[StageRecord]:
        """Time a stage and record its outcome.

        Errors that the user can act on (``HfExportError``, ``ValueError``, ``TypeError``,
        ``ImportError``) and ``KeyboardInterrupt`` propagate unchanged with a note naming the
        stage; a ``MemoryError`` becomes :class:`~hfexport.errors.ExportMemoryError` (naming the
        stage and the options that lower the peak); any other exception is re-raised as
        :class:`~hfexport.errors.ExportStageError` naming the stage and component.

        At the start, the stage's name is written to the breadcrumb of the output folder being
        staged (:func:`hfexport.atomic.note_stage`) and the fault hook is consulted
        (:func:`hfexport.faults.reached`, inert unless ``HFEXPORT_FAULT`` is set).

        Raises:
            ExportStageError: the body raised an error that is not passed through.
            ExportMemoryError: the body raised ``MemoryError``.
        """
        name = str(name)
        record = StageRecord(name=name, detail=detail)
        self.stages.append(record)
        if self.callback is not None:
            self.callback("start", record)
        start = time.perf_counter()
        try:
            note_stage(name)  # the breadcrumb a killed run leaves (hfexport.atomic)
            faults.reached(f"stage:{name}")  # inert unless HFEXPORT_FAULT is set (hfexport.faults)
            yield record
        except _PASS_THROUGH as exc:
            record.status = "failed"
            record.error = f"{type(exc).__name__}: {exc}"
            # an ExportStageError from a nested stage already names the innermost stage
            if not isinstance(exc, ExportStageError) and not getattr(exc, "_hfexport_noted", False):
                exc.add_note(
                    f"hfexport: failed in stage '{name}' ({self.export_format}, component '{self.component}')"
                )
                exc._hfexport_noted = True  # type: ignore[attr-defined]
            raise
        except MemoryError as exc:
            record.status = "failed"
            record.error = f"{type(exc).__name__}: {exc}"
            raise ExportMemoryError(
                f"{self.export_format} export of component '{self.component}' ({self.model_class}) ran "
                f"out of memory in stage '{name}' (MemoryError{f': {exc}' if str(exc) else ''}). "
                f"{MEMORY_OPTIONS}",
                stage=name,
                component=self.component,
            ) from exc
        except Exception as exc:
            record.status = "failed"
            record.error = f"{type(exc).__name__}: {exc}"
            raise ExportStageError(
                f"{self.export_format} export of component '{self.component}' ({self.model_class}) failed in "
                f"stage '{name}': {type(exc).__name__}: {exc}",
                stage=name,
                component=self.component,
            ) from exc
        finally:
            record.seconds = round(time.perf_counter() - start, 4)
            record.peak_rss_bytes = peak_rss_bytes()
            record.rss_bytes = current_rss_bytes()
            if self.callback is not None:
                self.callback("end", record)

    def skip(self, name: str, reason: str) -> None:
        """Record a stage that did not run and why."""
        self.stages.append(StageRecord(name=str(name), status="skipped", detail=reason))

    def record_applied(self, kind: str, names: list[str]) -> None:
        """Add the names of applied patches/fixes under ``kind``."""
        self.applied.setdefault(str(kind), []).extend(names)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of the whole report: the typed facts (:data:`TYPED_FACTS`) that are set
        go into ``extra`` under their own names (the ``export_report.json`` layout)."""
        out = asdict(replace(self, callback=None))
        out.pop("callback", None)
        extra = out["extra"]
        for name in TYPED_FACTS:
            value = out.pop(name)
            if value is not None and value is not False:
                extra[name] = value
        return out

    def to_json(self) -> str:
        """The report as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    def summary_lines(self) -> list[str]:
        """Short human-readable lines: one per stage with status and seconds."""
        return [f"{s.name:<28} {s.status:<8} {s.seconds:8.2f}s {s.detail}".rstrip() for s in self.stages]
