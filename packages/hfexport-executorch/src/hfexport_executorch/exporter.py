"""``ExecutorchExporter``: Hugging Face model -> ExecuTorch program (``.pte``), validated in the
ExecuTorch runtime.

Stages (each a line of the export report; 1-6 are the core's shared capture step,
:meth:`hfexport.exporter.HfExporter.captured_program`, with this backend's hooks):

1. ``prepare_backend``: :func:`hfexport_executorch.backends.prepare_backend` (partitioner, model
   adaptations such as dense mixture-of-experts for XNNPACK; ``cuda`` checks CUDA is usable);
2. ``patches``: ``apply_patches(f"executorch.{backend}")`` installs the ``"executorch"`` patches
   and those of the backend's scope, kept until lowering is done;
   then ``quantize`` with ``config.quantization``: the method's ``source`` phase (a quantized copy
   for ``8da4w`` / ``4w`` / ``8w`` / ``embedding_bits``; :mod:`hfexport_executorch.quantize`);
3. ``dynamic_shapes``: :func:`hfexport_executorch.bounds.plan_dynamic_shapes` bounds every
   ``Dim.AUTO`` axis by its role (batch, sequence, ...); a batch-1 sample is traced at batch 2
   (:func:`hfexport.batching.widen_unit_batch`, the core capture's own rule applied before planning);
4. ``capture``: the core :func:`hfexport.capture.capture` (``torch.export.export``), then for
   ``int8-dynamic`` ``quantize_pt2e`` (its ``program`` phase: PT2E, captured again);
5. ``fx_program_fixes``: ``apply_fx_program_fixes`` (e.g. bounding unbounded dynamic ranges);
6. ``fx_node_fixes``: ``apply_fx_node_fixes`` on the captured graph;
7. ``memory_budget``: :func:`hfexport_executorch.bounds.fit_memory_budget` narrows the bounds of
   the captured program until its estimated activation peak fits ``config.max_dynamic_bytes``
   (before lowering, so the delegates are lowered with the narrowed bounds too);
8. ``lower``: ``to_edge_transform_and_lower`` with the partitioner; the delegated share goes to
   ``report.extra["delegation"]``;
9. ``memory_planning``: ``to_executorch`` with a ``MemoryPlanningPass`` honouring
   ``alloc_graph_input``, ``alloc_graph_output`` and ``alloc_mutable_buffers``.

The base class then validates the program in the ExecuTorch runtime against eager PyTorch at the
sample shape and, for dynamic exports, at a second shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from hfexport.auto import register_exporter
from hfexport.batching import widen_unit_batch
from hfexport.config import ExecutorchConfig, QuantizationMethod
from hfexport.exporter import CaptureSession, HfExporter
from hfexport.report import ExportReport, Stage
from hfexport_executorch import bounds
from hfexport_executorch.backends import remember_runtime_backend, runtime_backend
from hfexport_executorch.generation import ExecutorchGenerationSupport
from hfexport_executorch.quantize import METHODS as _quantize_methods
from hfexport_executorch.quantize import WEIGHT_ONLY_METHODS
from hfexport_executorch.versions import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS

__all__ = ["ExecutorchCapture", "ExecutorchExporter"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ExecutorchCapture(CaptureSession):
    """The shared capture step's session with this backend's state between its hooks.

    Attributes:
        plan: the backend plan of ``prepare_backend`` (partitioners, registry key, device).
        dynamic: the dynamic-shape plan of ``dynamic_shapes`` (roles and bounds per axis).
        bounded_by_fix: the symbols ``bound_unbounded_dynamic_ranges`` bounded (name -> bound).
        bounded_by_guards: the symbols ``sequence_bounds_from_input_guards`` narrowed (name -> bound).
    """

    plan: Any = None
    dynamic: bounds.DynamicPlan | None = None
    bounded_by_fix: dict[str, Any] = dataclasses.field(default_factory=dict)
    bounded_by_guards: dict[str, Any] = dataclasses.field(default_factory=dict)


@register_exporter("executorch")
class ExecutorchExporter(HfExporter):
    """Export a transformers model to an ExecuTorch program and validate it in the ExecuTorch runtime.

    Args:
        config: the default :class:`hfexport.config.ExecutorchConfig` for :meth:`export`.

    Raises:
        ImportError: at construction, when torch or executorch is missing or older than
            :data:`hfexport_executorch.versions.MIN_VERSIONS` (the message has the pip command).

    ``export(model, sample_inputs, config)`` returns an ``ExecutorchProgramManager`` whose
    ``save(path)`` writes the ``.pte`` atomically; ``self.last_report.extra`` holds the dynamic
    bounds (``dynamic_bounds``), the memory budget outcome (``memory_budget``), the delegated share
    (``delegation``) and the planned arena size (``planned_memory_bytes``).

    Example::

        exporter = ExecutorchExporter()
        program = exporter.export(model, {"input_ids": ids, "attention_mask": mask},
                                  ExecutorchConfig(dynamic=True))
        program.save("model.pte")
    """

    export_format: ClassVar[str] = "executorch"
    config_class: ClassVar[type] = ExecutorchConfig
    package_name: ClassVar[str] = "hfexport-executorch"
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "executorch")
    min_versions: ClassVar[dict[str, str]] = dict(MIN_VERSIONS)
    tested_versions: ClassVar[dict[str, str]] = dict(TESTED_VERSIONS)
    supported_versions: ClassVar[dict[str, str]] = dict(SUPPORTED)
    artifact_filename: ClassVar[str] = "model.pte"
    stages: ClassVar[tuple[str, ...]] = (
        "prepare_backend",
        "quantize",
        "dynamic_shapes",
        "quantize_pt2e",
        "memory_budget",
        "memory_planning",
    )
    #: fp32; fp16, which XNNPACK delegates (its fp16 kernels, measured on IgLM-S: top-1 0.996 vs
    #: fp32 eager); bf16, which lowers and runs but entirely on portable kernels (XNNPACK claims no
    #: bf16 node here): correct (top-1 0.996) and slower; ``report.extra["delegation"]`` shows it.
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    #: auto exports every checkpoint in float32: XNNPACK delegates float32 (and float16, slower
    #: than float32 on CPUs without native fp16 arithmetic); bfloat16 runs on portable kernels only
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Measured peak per weight byte (Qwen3-0.6B fp32: 7.0 GB (W 2.38 GB): the eager weights, XNNPACK's serialized copy
    #: of every delegated weight and the emitter's copy of the embedding (docs/performance.md, "Scale")).
    memory_factor: ClassVar[float] = 2.6
    runtime_name: ClassVar[str] = "ExecuTorch's XNNPACK delegate"
    #: the shared capture step's session: this backend's plan, dynamic shapes and fixed bounds
    capture_session_class: ClassVar[type[CaptureSession]] = ExecutorchCapture
    #: see :mod:`hfexport_executorch.quantize` (``embedding_bits`` combines with any of them).
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod]] = dict(_quantize_methods)

    # -- stages ------------------------------------------------------------------------------------
    def check_precision(self, config: Any) -> None:
        """The base checks, then: quantization needs ``backend="xnnpack"`` (the methods lower to its
        quantized kernels, or for ``4w`` / ``8w`` to the quantized kernel library next to it), and
        ``4w`` / ``8w`` need float32 or float16 (``mixed_linear`` has no bfloat16 kernel), and
        ``kv_cache_dtype`` is refused (the ``llm-runner`` layout reads it and passes ``None``).
        ``ValueError`` naming what is allowed, before capture."""
        quantization = getattr(config, "quantization", None)
        super().check_precision(config)
        backend = getattr(config, "backend", "xnnpack")
        dtype = getattr(config, "dtype", None)
        if quantization is not None and quantization.method in WEIGHT_ONLY_METHODS and dtype == "bfloat16":
            raise ValueError(
                f"quantization method {quantization.method!r} runs on quantized_decomposed::mixed_linear, "
                "which has float32 and float16 kernels only; allowed: dtype='float32' or 'float16' with it, "
                "or method '8da4w' / 'int8-dynamic' for bfloat16"
            )
        if getattr(config, "kv_cache_dtype", None) is not None:
            raise ValueError(
                f"kv_cache_dtype={config.kv_cache_dtype!r} (--kv-cache-dtype) applies to the llm-runner layout's KV "
                "cache only; allowed here: None (export with --layout llm-runner --task text-generation for it)"
            )
        if quantization is not None and backend != "xnnpack":
            raise ValueError(
                f"quantization method {quantization.method!r} lowers to XNNPACK's quantized kernels; "
                f"backend={backend!r} has none here; allowed: ExecutorchConfig(backend='xnnpack') or "
                "quantization=None"
            )

    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: Any, report: ExportReport
    ) -> Any:
        """Stages 1-9 of the module docstring; returns the ``ExecutorchProgramManager``.

        Stages 1-6 are the base class's shared capture step
        (:meth:`hfexport.exporter.HfExporter.captured_program`) with this backend's hooks:
        :meth:`prepare_capture` (``prepare_backend``), :meth:`before_capture` (``dynamic_shapes``),
        :meth:`capture_program` (the capture with its dynamic-shape fallback) and
        :meth:`fix_program` (the role bounds the fixes read); the quantization methods run there by
        phase (:data:`hfexport_executorch.quantize.METHODS`). The memory budget, lowering and
        memory planning run with the patches still installed.
        """
        from hfexport_executorch.lowering import (
            constant_methods_of,
            delegation_summary,
            lower_to_edge,
            plan_memory,
            planned_memory_bytes,
        )
        from hfexport_executorch.serialize import attach_atomic_save

        quantization = getattr(config, "quantization", None)
        with self.captured_program(model, inputs, config, report) as session:
            assert isinstance(session, ExecutorchCapture) and session.plan is not None
            program, plan, dynamic = session.program, session.plan, session.dynamic
            # the bounds are fitted to the budget on the captured program, before lowering: a
            # delegate serializes the upper bounds it is lowered with and the XNNPACK runtime sizes
            # its workspace from them (Qwen3-0.6B's 40960 positions: 16 GB at the first run of a
            # 2x11 input when the bounds were narrowed after lowering, for the planner only)
            with report.stage("memory_budget"):
                symbols = bounds.collect_symbols(program, session.inputs, dynamic)
                for info in symbols:
                    if str(info.symbol) in session.bounded_by_fix:
                        info.source = f"{info.source}; bounded by bound_unbounded_dynamic_ranges"
                    if str(info.symbol) in session.bounded_by_guards:
                        info.source = f"{info.source}; narrowed to the input guards by sequence_bounds_from_input_guards"
                budget = config.max_dynamic_bytes or bounds.DEFAULT_MAX_DYNAMIC_BYTES
                unbacked = bounds.data_dependent_symbols(program, session.bounded_by_fix)
                outcome = bounds.fit_memory_budget(program, symbols, budget, unbacked)
                report.dynamic_bounds = _bounds_report(symbols, dynamic)
                _plan_dynamic_axes(report)
                report.extra["memory_budget"] = {
                    "budget_bytes": outcome.budget,
                    "estimated_peak_bytes_before": outcome.estimate_before,
                    "estimated_peak_bytes": outcome.estimate_after,
                    "narrowed": {k: list(v) for k, v in outcome.narrowed.items()},
                    "fits": outcome.fits,
                }
            defaulted = _defaulted_data_dependent_symbols(program, session.bounded_by_fix)
            with (
                report.stage(Stage.LOWER, detail=plan.delegate_id),
                _size_oblivious_if_image_sides(report),
                _named_data_dependent_sizes(defaulted),
            ):
                edge = lower_to_edge(program, plan.partitioners, constant_methods_of(session.model))
                report.extra["delegation"] = delegation_summary(edge)
                if quantization is not None and report.quantization is not None:
                    from hfexport_executorch.quantize import quantized_op_counts

                    report.quantization["ops"] = quantized_op_counts(edge)
            # to_executorch re-runs each delegate's graph on fake tensors (SpecPropPass), whose
            # broadcasting checks guard a 1x1 map at the sample as the re-trace of to_edge did
            # (PP-LCNetV4's text detector: image sides narrowed to 32), so it runs under the same flag
            with (
                report.stage("memory_planning"),
                _size_oblivious_if_image_sides(report),
                _named_data_dependent_sizes(defaulted),
            ):
                fuse = quantization is not None and quantization.embedding_bits is not None
                manager = plan_memory(edge, config, quant_fusion=fuse)
                report.extra["planned_memory_bytes"] = planned_memory_bytes(manager)
                if quantization is not None and report.quantization is not None:
                    _record_sizes(report.quantization, manager)
                report.extra["memory_planning"] = {
                    "alloc_graph_input": bool(config.alloc_graph_input),
                    "alloc_graph_output": bool(config.alloc_graph_output),
                    "alloc_mutable_buffers": bool(config.alloc_mutable_buffers),
                }
        remember_runtime_backend(manager, plan.runtime_backend)
        return attach_atomic_save(manager)

    # -- the shared capture step's hooks -----------------------------------------------------------
    def prepare_capture(self, session: CaptureSession) -> None:
        """Stage ``prepare_backend``: :func:`hfexport_executorch.backends.prepare_backend` (the
        partitioner, model adaptations kept until the step closes); its registry key
        (``executorch.<backend>``) is the one whose patches and fixes apply; inputs move to the
        backend's device."""
        from hfexport.tensors import cast_leaf_tensors
        from hfexport_executorch.backends import prepare_backend

        assert isinstance(session, ExecutorchCapture)
        config, report = session.config, session.report
        with report.stage("prepare_backend", detail=str(config.backend)):
            plan = prepare_backend(config.backend, session.model, session.stack)
            report.extra["backend"] = plan.name
            report.extra["backend_adaptations"] = list(plan.adaptations)
        session.plan = plan
        session.registry_key = plan.registry_key
        if plan.device.type != "cpu":
            session.inputs = cast_leaf_tensors(session.inputs, device=plan.device)

    def before_capture(self, session: CaptureSession) -> None:
        """Stage ``dynamic_shapes``: a batch-1 sample is traced at batch 2
        (:func:`hfexport.batching.widen_unit_batch`; ``session.inputs`` become the trace inputs,
        in contiguous memory: the program keeps each input's dim order from the sample, and the
        runtime is given row-major buffers, :func:`hfexport.tensors.contiguous_leaf_tensors`), and
        every dynamic axis gets a role and bounds (:func:`hfexport_executorch.bounds.plan_dynamic_shapes`)."""
        from hfexport.tensors import contiguous_leaf_tensors

        assert isinstance(session, ExecutorchCapture)
        with session.report.stage("dynamic_shapes"):
            trace_inputs, widened = widen_unit_batch(session.inputs, session.config)
            if widened:
                session.report.extra["trace_inputs"] = widened
            # a transposed sample (RecurrentGemma's convolution state from the prefill) would give the
            # program an input of dim order [0, 2, 1], while the runner passes row-major buffers
            trace_inputs = contiguous_leaf_tensors(trace_inputs)
            session.inputs = trace_inputs
            session.dynamic = bounds.plan_dynamic_shapes(session.model, trace_inputs, session.config)

    def capture_program(self, session: CaptureSession, module: torch.nn.Module) -> Any:
        """The core capture with the planned role dimensions, falling back to bounded ``Dim.AUTO``
        hints on a dynamic-shape constraint error (also for ``int8-dynamic``'s re-capture)."""
        from hfexport.capture import capture

        assert isinstance(session, ExecutorchCapture) and session.dynamic is not None
        return _capture_with_fallback(
            capture, module, session.inputs, session.config, session.dynamic, session.report
        )

    def fix_program(self, session: CaptureSession) -> list[str]:
        """The active program fixes, with the role bounds of the symbols captured unbounded in the
        graph's meta (what ``bound_unbounded_dynamic_ranges`` reads); the symbols it bounded are
        kept for the ``memory_budget`` stage."""
        from hfexport_executorch.workarounds.fx_fixes import (
            BOUNDED_META_KEY,
            BOUNDS_META_KEY,
            GUARD_BOUNDED_META_KEY,
            GUARD_BOUNDS_META_KEY,
        )

        assert isinstance(session, ExecutorchCapture) and session.dynamic is not None
        program = session.program
        symbols = bounds.collect_symbols(program, session.inputs, session.dynamic)
        program.graph_module.meta[BOUNDS_META_KEY] = _role_bounds_for_unbounded(symbols, session.model)
        axes = getattr(session.report, "dynamic_axes", None) if session.report is not None else None
        program.graph_module.meta[GUARD_BOUNDS_META_KEY] = _guard_bounds(symbols, axes)
        applied = super().fix_program(session)
        session.bounded_by_fix = dict(program.graph_module.meta.get(BOUNDED_META_KEY, {}))
        session.bounded_by_guards = dict(program.graph_module.meta.get(GUARD_BOUNDED_META_KEY, {}))
        return applied

    # -- runtime -----------------------------------------------------------------------------------
    def runner(self, artifact: Any) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """An :class:`hfexport_executorch.runtime.ExecutorchRunner` for ``artifact``.

        Args:
            artifact: the ``ExecutorchProgramManager`` :meth:`export` returned.

        Returns:
            A callable: forward kwargs -> ``{output leaf path: tensor}``; it raises
            ``RuntimeError`` when the runtime lacks the delegate backend the program needs.
        """
        from hfexport_executorch.runtime import ExecutorchRunner

        return ExecutorchRunner.from_manager(artifact, required_backend=runtime_backend(artifact))

    def second_shape_inputs(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], config: Any, report: ExportReport
    ) -> tuple[dict[str, Any] | None, str]:
        """The core's second shape (:meth:`hfexport.exporter.HfExporter.second_shape_inputs`) cut
        down to what the program accepts.

        The derived second shape (batch + 1, a sequence of at least 65 tokens; for a quantized or
        reduced-precision export the sample's own tokens, a quarter shorter) is cut to the planned
        bounds: a dynamic axis to its upper bound (an explicit ``Dim(max=32)`` for instance), an axis
        the export left static to its sample size. Beyond that a program is not meant to run
        (:class:`~hfexport_executorch.runtime.ExecutorchRunner` refuses). Inputs holding a KV cache
        (generation components) are derived inside the planned bounds instead
        (``report.dynamic_bounds``, cache leaves included) and not cut afterwards, which
        would part the mask from the cache length.
        """
        from transformers.cache_utils import Cache

        from hfexport.validation import derive_second_inputs

        program_axes = list(report.dynamic_axes or [])
        planned = report.dynamic_bounds or {}
        with_cache = any(isinstance(v, Cache) for v in inputs.values())
        if with_cache:
            # the mask, the positions and the cache must stay consistent: the derivation keeps
            # every axis inside the planned bounds (cache leaves included) instead of a cut after
            program_axes += [dict(a, status="dynamic") for a in planned.get("axes", [])]
        derived, reason = derive_second_inputs(model, inputs, config=config, program_axes=program_axes)
        if derived is None:
            return None, reason
        return (derived if with_cache else _fit_to_bounds(derived, inputs, planned)), ""

    # -- generation hooks: hfexport_executorch.generation.ExecutorchGenerationSupport -----------
    generation_support_class = ExecutorchGenerationSupport

    def save(self, artifact: Any, path: str | os.PathLike[str]) -> None:
        """Write ``artifact`` (an ``ExecutorchProgramManager``) to ``path`` (``.pte``) atomically.

        Raises:
            OSError: the file cannot be written; ``path`` is left as it was.
        """
        from hfexport_executorch.serialize import save_program

        save_program(artifact, path)


def _record_sizes(summary: dict[str, Any], manager: Any) -> None:
    """``artifact_bytes`` (the serialized ``.pte``) and ``size_ratio`` to ``weight_bytes_before`` (the
    unquantized weights, which an unquantized ``.pte`` stores as they are plus a few kB of program)."""
    size = len(manager.buffer)
    summary["artifact_bytes"] = size
    before = summary.get("weight_bytes_before") or 0
    summary["size_ratio"] = round(size / before, 4) if before else None


def _fit_to_bounds(
    derived: dict[str, Any], sample: Mapping[str, Any], dynamic_bounds: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Cut the derived second inputs to what the program accepts: a dynamic axis to its ``max``, a
    static axis to its sample size (leading elements kept)."""
    limits = {(a["input"], a["axis"]): a.get("max") for a in (dynamic_bounds or {}).get("axes", [])}
    out = dict(derived)
    for key, value in derived.items():
        reference = sample.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(reference, torch.Tensor):
            continue
        if value.dim() != reference.dim():
            continue
        for axis in range(value.dim()):
            limit = limits[(key, axis)] if (key, axis) in limits else int(reference.shape[axis])
            if limit is not None and value.shape[axis] > limit:
                value = value.narrow(axis, 0, int(limit))
        out[key] = value.contiguous()
    return out


def _defaulted_data_dependent_symbols(program: Any, bounded_by_fix: Mapping[str, Any]) -> list[str]:
    """The unbacked (data-dependent) symbols of ``program`` that had no finite upper bound when
    captured and were bounded by ``bound_unbounded_dynamic_ranges``' default rule, by name."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return sorted(
        str(s) for s in program.range_constraints if str(s) in bounded_by_fix and free_unbacked_symbols(s)
    )


@contextlib.contextmanager
def _named_data_dependent_sizes(symbols: list[str]) -> Iterator[None]:
    """Lowering or memory planning of a program with data-dependent sizes that carry no bound of the
    model's own (``symbols``) failed: re-raised as :class:`hfexport.errors.DataDependentSizeError`
    naming them (the cause chained), since the failure comes from them (a guard on ``u271 < 1``
    that ``to_executorch``'s re-trace cannot decide, a buffer planned at ``2**36`` elements that
    the ``.pte`` cannot hold): HunYuan-VL's vision tower sizes its position grid from the values
    of ``grid_thw`` (issue 28). A failure of a program without such symbols passes unchanged."""
    try:
        yield
    except Exception as exc:
        if not symbols or isinstance(exc, MemoryError):
            raise
        from hfexport.errors import DataDependentSizeError

        raise DataDependentSizeError(
            f"ExecuTorch plans every buffer at its upper bound, and the program has sizes computed from input "
            f"values ({', '.join(symbols)}: data-dependent, no finite bound of the model's own) that it could not "
            f"plan: {type(exc).__name__}: {exc}. Give those sizes a bound (a torch._check in the model) or export "
            "the module for fixed values of the inputs they are computed from",
            symbols=symbols,
        ) from exc


@contextlib.contextmanager
def _size_oblivious_if_image_sides(report: ExportReport) -> Iterator[None]:
    """Lower with ``backed_size_oblivious`` when the program has a dynamic image side.

    The capture traced such a program size-obliviously
    (:func:`hfexport.workarounds.capture.keep_size_one_batch_dynamic`): a feature map that is 1x1
    in the sample (ConvNeXt's last stage on 32x32 images) stays symbolic. ``to_edge`` re-traces the
    program for its decompositions; without the flag that re-trace takes such a map as the
    constant 1 (the layer norm of ConvNeXt's last stage came out ``[batch, 1, 1, 128]``, planned for
    1x1 and refused a 64x64 image at run time), so the lowering runs under the same flag. So does
    memory planning: ``to_executorch``'s ``SpecPropPass`` runs each delegate's graph on fake tensors
    again, and a broadcast against a map that is 1x1 in the sample guarded the image sides to the
    sample's 32 (PP-OCRv6's small text detector planned ``pixel_values`` at ``[8, 3, 32, 32]``).
    """
    import torch.fx.experimental._config as fx_config

    sides = [
        a
        for a in report.dynamic_axes or []
        if a.get("status") == "dynamic" and str(a.get("meaning", "")).startswith(("image ", "video "))
    ]
    if not sides:
        yield
        return
    with fx_config.patch(backed_size_oblivious=True):
        yield


def _is_constraint_error(exc: BaseException) -> bool:
    """True for the errors ``torch.export`` raises when dynamic shapes contradict the model."""
    from torch._dynamo.exc import UserError
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return isinstance(exc, (UserError, ConstraintViolationError))


def _capture_with_fallback(
    capture: Callable[..., Any],
    model: torch.nn.Module,
    inputs: dict[str, Any],
    config: Any,
    dynamic: bounds.DynamicPlan,
    report: ExportReport,
) -> torch.export.ExportedProgram:
    """Capture with the named role dimensions; on a dynamic-shape constraint error, capture again
    with bounded ``Dim.AUTO`` hints (see :mod:`hfexport_executorch.bounds`)."""
    if dynamic.dynamic_shapes is None:
        report.extra["dynamic_shapes_mode"] = "static"
        return capture(model, inputs, config, report)
    try:
        program = capture(model, inputs, config.replace(dynamic_shapes=dynamic.dynamic_shapes), report)
        report.extra["dynamic_shapes_mode"] = (
            "named role dims" if dynamic.fallback is not None else "as given"
        )
        return program
    except Exception as exc:
        if dynamic.fallback is None or not _is_constraint_error(exc):
            raise
        reason = str(exc).strip().splitlines()[0][:300]
        logger.info(
            "named role dims rejected by torch.export (%s); capturing with bounded Dim.AUTO hints", reason
        )
    program = capture(model, inputs, config.replace(dynamic_shapes=dynamic.fallback), report)
    report.extra["dynamic_shapes_mode"] = f"bounded Dim.AUTO hints (named role dims rejected: {reason})"
    return program


def _role_bounds_for_unbounded(symbols: list[bounds.SymbolInfo], model: torch.nn.Module) -> dict[str, int]:
    """``{symbol name: role bound}`` for the symbols captured without an upper bound."""
    config = getattr(model, "config", None)
    out = {}
    for info in symbols:
        if info.upper is None:
            out[str(info.symbol)], _ = bounds.role_bound(info.role, info.hint, config)
    return out


def _plan_dynamic_axes(report: ExportReport) -> None:
    """Give ``report.dynamic_axes`` (the capture's record of the program's input ranges) the upper
    bounds the program is planned for, from ``report.dynamic_bounds``, and rewrite
    ``report.dynamic_axes_summary`` from them: a bound the memory budget narrowed (tiny T5's
    sequence: 4096 -> 1024) is the one both say, with the note
    :data:`hfexport.program_axes.MEMORY_BUDGET_NOTE`
    (``"input_ids sequence: dynamic [1, 1024] (memory budget)"``). Axes the capture made static,
    and inputs nested below the top level (``dynamic_axes`` lists top-level inputs only), are
    left as they are."""
    from hfexport.program_axes import MEMORY_BUDGET_NOTE, axes_summary

    if not report.dynamic_axes or not report.dynamic_bounds:
        return
    planned = {(a["input"], a["axis"]): a for a in report.dynamic_bounds.get("axes", [])}
    for entry in report.dynamic_axes:
        bound = planned.get((entry.get("input"), entry.get("axis")))
        if bound is None or entry.get("status") != "dynamic" or bound.get("max") is None:
            continue
        entry["max"] = int(bound["max"])
        if "narrowed by the memory budget" in str(bound.get("source", "")):
            entry["note"] = MEMORY_BUDGET_NOTE
    report.dynamic_axes_summary = axes_summary(report.dynamic_axes)


def _guard_bounds(
    symbols: list[bounds.SymbolInfo], program_axes: list[dict[str, Any]] | None
) -> dict[str, int]:
    """``{symbol name: largest size}`` for the symbols sizing an input axis whose range the
    program's input guards end below (``program_axes`` entries of note ``"model-bounded"``, as
    :func:`hfexport.program_axes.program_input_axes` records them in ``report.dynamic_axes``): what
    ``sequence_bounds_from_input_guards`` narrows the ranges to."""
    limits = {
        (str(e["input"]), int(e["axis"])): int(e["max"])
        for e in program_axes or ()
        if e.get("note") == "model-bounded" and e.get("status") == "dynamic" and e.get("max") is not None
    }
    out: dict[str, int] = {}
    for info in symbols:
        found = [limits[(path, axis)] for path, axis in info.axes if (path, axis) in limits]
        if found:
            out[str(info.symbol)] = min(found)
    return out


def _bounds_report(symbols: list[bounds.SymbolInfo], dynamic: bounds.DynamicPlan) -> dict[str, Any]:
    """``report.dynamic_bounds``: one entry per dynamic input axis (``axes``), and the axes
    that were asked to be dynamic but that ``torch.export`` specialised (``specialized``: input,
    axis, role; e.g. ViT's image size, which its position embeddings fix).

    ``min``/``max`` are the bounds the program is planned for and validated with; ``program_range``
    is the range ``torch.export`` recorded (its lower end is 2 for axes traced at size >= 2, which
    ExecuTorch does not enforce: batch and sequence axes run from 1).
    """
    axes = []
    seen: set[tuple[str, int]] = set()
    for info in symbols:
        for path, axis in info.axes:
            seen.add((path, axis))
            policy = dynamic.policy(path, axis)
            axes.append(
                {
                    "input": path,
                    "axis": axis,
                    "role": info.role,
                    "symbol": str(info.symbol),
                    "min": policy.min if policy is not None else info.lower,
                    "max": info.upper,
                    "program_range": [info.lower, info.upper],
                    "sample": info.hint,
                    "source": info.source,
                }
            )
    static = [
        {"input": p.path, "axis": p.axis, "role": p.role}
        for p in dynamic.axes
        if (p.path, p.axis) not in seen
    ]
    return {"axes": axes, "specialized": static}
