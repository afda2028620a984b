"""``OnnxExporter``: transformers model -> ``torch.onnx.ONNXProgram``, validated in ONNX Runtime.

Stages (each a method, each a line of the export report; the shared names are
:class:`hfexport.report.Stage`, the ONNX-only ones :attr:`OnnxExporter.stages`):

Stages 1-3 are the core's shared capture step
(:meth:`hfexport.exporter.HfExporter.captured_program`; :meth:`OnnxExporter.record_patches` splits
the patches), whose block spans stages 4-8 too.

1. ``patches`` / ``onnx_patches``: the active ``register_patch("onnx", ...)`` entries are
   installed (one ``apply_patches("onnx")`` block around capture, translation and the IR stages,
   where the onnxscript optimizer and rewriters run); patches of
   ``torch``/``transformers`` are reported under the shared ``patches`` stage, patches of
   ``torch.onnx``, ``onnxscript``, ``onnx_ir``, ``onnx`` and ``onnxruntime`` under
   ``onnx_patches``;
2. ``capture``: :func:`hfexport.capture.capture` (``torch.export.export`` with dynamic shapes,
   under the core ``"capture"`` workarounds, reported in ``applied["capture_patches"]``);
3. ``fx_program_fixes`` and ``fx_node_fixes``: ``register_fx_program_fix("onnx")`` and
   ``register_fx_node_fix("onnx")`` entries on the captured program;
The shared ``lower`` stage encloses stages 4-8 (recorded after it):

4. ``custom_translations`` then ``translate``: ``torch.onnx.export(program, dynamo=True,
   custom_translation_table=...)`` with the active :mod:`hfexport_onnx.workarounds.translations`;
5. ``io_names``: graph inputs/outputs renamed to leaf paths (:mod:`hfexport_onnx.io_names`),
   explicit ``Dim`` names given to the symbolic axes;
6. ``ir_fixes``: active :mod:`hfexport_onnx.workarounds.ir_fixes` on the ``onnx_ir`` model;
7. ``optimize``: the onnxscript optimizer (``ONNXProgram.optimize``) when ``config.optimize``;
   then ``ort_fusions`` (``config.ort_fusions``: ORT contrib-op rewrites, :mod:`hfexport_onnx.fusions`),
   ``ort_kernel_fixes`` (float32 graphs without quantization for the CPU: graph rewrites around slow
   ORT CPU kernels, :mod:`hfexport_onnx.workarounds.ort_layer_norm`) and ``quantize`` (``config.quantization``: the method's ``artifact`` phase,
   :meth:`hfexport.exporter.HfExporter.quantize_artifact` with :mod:`hfexport_onnx.quantize`) when
   asked for;
8. ``external_data``: decides how weights are saved (external data when
   ``config.external_data`` or when they exceed the 2 GiB protobuf limit).

``config.dtype="float16"`` captures in half precision (the core casts model and inputs); ONNX
Runtime's CPU provider has no bfloat16 kernels for MatMul/Add/Softmax here, so bfloat16 is
refused before capture. Reduced precision and quantization are validated with the core's quality
gates (:mod:`hfexport.quality`) against the fp32 eager model.

The base class then validates in ONNX Runtime (sample inputs and, for dynamic exports, a second
shape) and saves when ``config.output_path`` is set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.atomic import atomic_path
from hfexport.auto import register_exporter
from hfexport.config import OnnxConfig, QuantizationMethod, check_opset_version, onnx_opset_range
from hfexport.exporter import CaptureSession, HfExporter
from hfexport.linear_forms import eager_float32_bytes
from hfexport.report import ExportReport, Stage
from hfexport_onnx.generation import OnnxGenerationSupport
from hfexport_onnx.io_names import IoNames, assign_io_names
from hfexport_onnx.quantize import FLOAT16_QUANTIZATION_METHODS, QUANTIZATION_METHODS
from hfexport_onnx.runtime import (
    EXTERNAL_DATA_MIN_BYTES,
    PROTOBUF_LIMIT_BYTES,
    OnnxRuntimeRunner,
    append_initializers,
    initializer_bytes,
)
from hfexport_onnx.versions import MIN_VERSIONS, REQUIRED_PACKAGES, SUPPORTED, TESTED_VERSIONS
from hfexport_onnx.workarounds.ir_fixes import apply_ir_fixes
from hfexport_onnx.workarounds.translations import custom_translation_table

__all__ = ["BACKEND", "OnnxExporter", "SaveOptions", "supported_opset_range"]

logger = logging.getLogger(__name__)

#: Registry key of this backend's patches and FX fixes.
BACKEND = "onnx"

# Patch targets under these module prefixes are "ONNX patches"; every other target is a "torch patch".
_ONNX_SIDE_PREFIXES = ("torch.onnx", "onnxscript", "onnx_ir", "onnx.", "onnxruntime")


def supported_opset_range() -> tuple[int, int, str]:
    """``(lowest, highest, source)``: the ONNX opsets this installation can export to.

    ``torch.onnx`` emits opset ``ONNX_MIN_OPSET`` (18) and converts to ``opset_version`` with
    onnxscript's version converter, which refuses targets above its ``SUPPORTED_MAX_ONNX_OPSET``
    (then falls back to onnx's C converter, whose failures surface as a raw ``InvalidGraph`` in
    ONNX Runtime); the installed onnx must also know the opset. ``highest`` is the smaller of
    the two; ``source`` names both for error messages.
    """
    import importlib.metadata

    import onnx.defs

    lowest, highest, _ = onnx_opset_range()
    try:
        from onnxscript.version_converter import _version_converter

        highest = int(_version_converter.SUPPORTED_MAX_ONNX_OPSET)
    except (ImportError, AttributeError):  # a layout change: keep the core's reading
        pass
    onnx_max = int(onnx.defs.onnx_opset_version())
    source = (
        f"onnxscript {importlib.metadata.version('onnxscript')} converts to opset {highest}, "
        f"onnx {importlib.metadata.version('onnx')} knows opset {onnx_max}"
    )
    return lowest, min(highest, onnx_max), source


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How :meth:`OnnxExporter.save` writes an artifact (decided by the export's config).

    Attributes:
        external_data: weights go to ``<file>.data`` next to the model.
        include_initializers: store the weights at all (``OnnxConfig.export_params``).
        keep_initializers_as_inputs: also list the weights as graph inputs.
    """

    external_data: bool = True
    include_initializers: bool = True
    keep_initializers_as_inputs: bool = False


# Save options of the artifacts exported in this process, keyed by the ONNXProgram.
_SAVE_OPTIONS: weakref.WeakKeyDictionary[Any, SaveOptions] = weakref.WeakKeyDictionary()


def _is_onnx_side(entry: Any) -> bool:
    return any(
        path == p.rstrip(".") or path.startswith(p) for path in entry.paths for p in _ONNX_SIDE_PREFIXES
    )


def _explicit_dim_names(dynamic_shapes: Any) -> dict[str, dict[int, str]]:
    """``{kwarg: {axis: Dim name}}`` for the named ``Dim`` objects of top-level tensor inputs."""
    out: dict[str, dict[int, str]] = {}
    if not isinstance(dynamic_shapes, Mapping):
        return out
    for key, spec in dynamic_shapes.items():
        axes = (
            dict(spec)
            if isinstance(spec, Mapping)
            else dict(enumerate(spec))
            if isinstance(spec, (list, tuple))
            else {}
        )
        for axis, dim in axes.items():
            name = getattr(dim, "__name__", None)
            if isinstance(axis, int) and isinstance(name, str) and type(dim).__name__ != "_DimHint":
                out.setdefault(str(key), {})[axis] = name
    return out


@register_exporter(BACKEND)
class OnnxExporter(HfExporter):
    """Export transformers models to ONNX with ``torch.onnx`` (dynamo) and run them in ONNX Runtime.

    Args:
        config: default :class:`hfexport.config.OnnxConfig` for :meth:`export`.

    Raises:
        ImportError: torch, onnx, onnxscript or onnxruntime is missing or older than
            :data:`hfexport_onnx.versions.MIN_VERSIONS` (one message, with the pip command).

    ``export(model, forward_kwargs, config)`` returns a ``torch.onnx.ONNXProgram`` whose graph
    inputs are named by forward kwarg leaf path and outputs by model output leaf path; see the
    module docstring for the stages and ``docs/backends/onnx.md`` for the naming rule.
    """

    export_format: ClassVar[str] = BACKEND
    config_class: ClassVar[type[OnnxConfig]] = OnnxConfig
    package_name: ClassVar[str] = "hfexport-onnx"
    required_packages: ClassVar[tuple[str, ...]] = REQUIRED_PACKAGES
    min_versions: ClassVar[dict[str, str]] = MIN_VERSIONS
    tested_versions: ClassVar[dict[str, str]] = TESTED_VERSIONS
    supported_versions: ClassVar[dict[str, str]] = SUPPORTED
    artifact_filename: ClassVar[str] = "model.onnx"
    stages: ClassVar[tuple[str, ...]] = (
        "onnx_patches",
        "custom_translations",
        "translate",
        "io_names",
        "ir_fixes",
        "optimize",
        "ort_fusions",
        "ort_kernel_fixes",
        "quantize",
        "external_data",
    )
    #: float16 runs on ONNX Runtime's CPU provider; bfloat16 does not (no MatMul/Add kernels)
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16")
    #: auto exports every checkpoint in float32: no bfloat16 kernels, and float16 MatMul/attention
    #: run slower than float32 on the CPU provider (casts around the ops without fp16 kernels)
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Measured peak per weight byte (Qwen3-0.6B fp32: 4.21 GB (W 2.38 GB) (docs/performance.md, "Scale")).
    memory_factor: ClassVar[float] = 1.5
    runtime_name: ClassVar[str] = "ONNX Runtime's CPU provider"
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod]] = QUANTIZATION_METHODS

    def __init__(self, config: Any = None, *, calibration_data: Any = None) -> None:
        """
        Args:
            config: default :class:`hfexport.config.OnnxConfig`.
            calibration_data: forward-kwarg dicts calibrating ``int8-static`` (wins over
                ``quantization.calibration``); their keys must be the sample inputs' keys.
        """
        super().__init__(config)
        self.calibration_data = calibration_data

    def check_precision(self, config: Any) -> None:
        """The core checks (dtype, method, the options each method reads, gate names) plus, before
        capture: bfloat16 refused with what this ONNX Runtime runs; ``quantization.embedding_bits``
        refused (an ExecuTorch option; every ONNX method stores the word embedding in int8 itself);
        an ``int4-weight`` / ``int8-weight`` ``group_size`` that is not a MatMulNBits block size; ``calibration_data``
        given to a method that calibrates nothing (only ``int8-static`` does); quantization only of
        float32 graphs, or of float16 ones by :data:`FLOAT16_QUANTIZATION_METHODS`; the ``ort_fusions`` provider shipped by the installed onnxruntime
        (:func:`hfexport_onnx.fusions.check_fusion_target`).

        Raises:
            ValueError: any of those, naming what is allowed.
        """
        dtype = getattr(config, "dtype", None)
        if dtype is not None and dtype not in self.supported_dtypes:
            import onnxruntime as ort

            raise ValueError(
                f"dtype={dtype!r} cannot run in ONNX Runtime {ort.__version__}'s CPU provider (no {dtype} "
                f"MatMul/Add/Softmax kernels); allowed for onnx: {', '.join(self.supported_dtypes)}"
            )
        quantization = getattr(config, "quantization", None)
        method = self.quantization_methods.get(quantization.method) if quantization is not None else None
        if (
            quantization is not None
            and quantization.embedding_bits is not None
            and (method is None or "embedding_bits" not in method.options)
        ):
            # before the core's generic option check: this message says where 4/8-bit embeddings are
            readers = [m for m, spec in self.quantization_methods.items() if "embedding_bits" in spec.options]
            raise ValueError(
                f"quantization.embedding_bits={quantization.embedding_bits} is not an option of the onnx "
                f"backend's method {quantization.method!r} (it stores the word embedding in int8 already); "
                f"allowed: embedding_bits=None, method {' / '.join(map(repr, readers))} (4 or 8: the bits of "
                "a tied LM head and its embedding), or export_format='executorch' for 4/8-bit embeddings"
            )
        super().check_precision(config)
        if self.calibration_data is not None:
            readers = [m for m, spec in self.quantization_methods.items() if "calibration" in spec.options]
            method = quantization.method if quantization is not None else None
            if method not in readers:
                raise ValueError(
                    f"calibration_data is given but quantization method {method!r} calibrates nothing and would "
                    f"ignore it; allowed: calibration_data=None, or a method that calibrates: {', '.join(readers)}"
                )
        if (
            quantization is not None
            and quantization.method in ("int4-weight", "int8-weight")
            and quantization.group_size
        ):
            from hfexport_onnx.quantize import INT4_BLOCK_SIZES

            if int(quantization.group_size) not in INT4_BLOCK_SIZES:
                raise ValueError(
                    f"quantization.group_size={quantization.group_size} is not a MatMulNBits block size "
                    f"(ONNX Runtime's blockwise quantizer); allowed: {', '.join(map(str, INT4_BLOCK_SIZES))}"
                )
        if (
            quantization is not None
            and dtype not in (None, "float32")
            and not (dtype == "float16" and quantization.method in FLOAT16_QUANTIZATION_METHODS)
        ):
            raise ValueError(
                f"quantization {config.quantization.method!r} quantizes float32 graphs only; dtype={dtype!r} with "
                f"it is not allowed: use dtype='float32', or dtype='float16' with "
                f"{' / '.join(FLOAT16_QUANTIZATION_METHODS)} (MatMulNBits with float16 activations and scales: "
                "transformers.js's q4f16)"
            )
        from hfexport_onnx.fusions import check_fusion_target

        check_fusion_target(getattr(config, "ort_fusions", None))

    # -- config ------------------------------------------------------------------------------
    def _resolve_config(self, config: Any) -> OnnxConfig:
        """The base's config resolution plus the exact opset check (at construction and at the
        start of every export, before capture): see :func:`supported_opset_range`."""
        resolved = super()._resolve_config(config)
        if resolved.opset_version is not None:
            _, highest, source = supported_opset_range()
            check_opset_version(resolved.opset_version, highest=highest, source=source)
        return resolved  # type: ignore[return-value]

    # -- stages --------------------------------------------------------------------------------
    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: OnnxConfig, report: ExportReport
    ) -> Any:
        """Run stages 1-8 (see the module docstring) and return the ``ONNXProgram``."""
        calibration = self.calibration_batches(model, inputs, config)  # bad keys fail before capture
        report.extra["eager_weights_bytes"] = eager_float32_bytes(model)
        # the shared capture step (patches, capture, FX fixes) keeps the patches installed through
        # the IR stages too (the onnxscript optimizer and rewriters run there); the shared "lower"
        # stage spans translation and the IR stages
        with (
            self.captured_program(model, inputs, config, report) as session,
            report.stage(Stage.LOWER, detail="torch.onnx.export"),
        ):
            program = session.program
            table = self.translation_table(report)
            onnx_program = self.translate(program, config, table, report)
            self.name_io(onnx_program, program, config, report)
            self.fix_ir(onnx_program, report)
            self.optimize(onnx_program, config, report)
            self.fuse_for_ort(onnx_program, config, report)
            self.fix_for_ort_kernels(onnx_program, config, report)
            # the artifact phase: after the ORT fusions, before the external-data plan
            onnx_program.model = self.quantize_artifact(
                onnx_program.model, config, report, inputs=inputs, calibration=calibration
            )
            self.plan_external_data(onnx_program, config, report)
        return onnx_program

    def calibration_batches(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: OnnxConfig
    ) -> list[dict[str, Any]] | None:
        """Calibration inputs for a method that reads ``calibration`` (``int8-static``;
        :func:`hfexport.calibration.calibration_inputs`: ``calibration_data``, else the prompt file,
        else sample inputs + seeded random variants with a warning); ``None`` for other methods.

        Raises:
            ValueError: calibration keys that are not the model's inputs, an unreadable prompt file.
        """
        quantization = config.quantization
        method = self.quantization_spec(config)
        if quantization is None or method is None or "calibration" not in method.options:
            return None
        from hfexport.calibration import calibration_inputs

        return calibration_inputs(quantization, model, inputs, data=self.calibration_data)

    def fuse_for_ort(self, onnx_program: Any, config: OnnxConfig, report: ExportReport) -> None:
        """Stage ``ort_fusions``: the registered ORT fusions for ``config.ort_fusions``
        (:func:`hfexport_onnx.fusions.apply_ort_fusions`); ``report.applied["ort_fusions"]`` lists
        ``"<rewrite> x<count>"`` for each that fused, ``report.extra["ort_fusions"]`` the counts
        and the contrib ops in the graph."""
        if config.ort_fusions is None:
            return
        from hfexport_onnx.fusions import apply_ort_fusions, contrib_op_counts

        with report.stage("ort_fusions", detail=config.ort_fusions) as record:
            graph = onnx_program.model.graph
            before = graph.num_nodes()
            counts = apply_ort_fusions(onnx_program.model, config.ort_fusions, dtype=config.dtype)
            fused = {name: n for name, n in counts.items() if n}
            ops = contrib_op_counts(onnx_program.model)
            report.record_applied("ort_fusions", [f"{name} x{n}" for name, n in fused.items()])
            report.extra["ort_fusions"] = {"provider": config.ort_fusions, "fused": fused, "contrib_ops": ops}
            record.detail = (
                f"{config.ort_fusions}: {before} -> {onnx_program.model.graph.num_nodes()} nodes; "
                + (", ".join(f"{op.rsplit('.', 1)[-1]} x{n}" for op, n in ops.items()) or "nothing fused")
            )

    def fix_for_ort_kernels(self, onnx_program: Any, config: OnnxConfig, report: ExportReport) -> None:
        """Stage ``ort_kernel_fixes``: the active ``ort_kernel_fix`` entries
        (:func:`hfexport_onnx.workarounds.ort_layer_norm.apply_ort_kernel_fixes`) on a float32 graph
        without quantization whose target is ONNX Runtime's CPU provider (``config.ort_fusions``
        ``None`` or ``"cpu"``). ``report.applied["ort_kernel_fixes"]`` lists ``"<fix> x<count>"``
        for each that rewrote something, ``report.extra["ort_kernel_fixes"]`` every count.

        Not run for ``ort_fusions="cuda"`` (the CUDA kernels are not the slow ones), for float16
        graphs, or with quantization (the ``int8-dynamic`` method runs the fixes itself, after its
        own rewrites; the other methods were not measured with them).
        """
        if config.quantization is not None or config.ort_fusions == "cuda":
            return
        if (config.dtype or "float32") != "float32":
            return
        from hfexport_onnx.workarounds.ort_layer_norm import apply_ort_kernel_fixes

        with report.stage("ort_kernel_fixes") as record:
            counts = apply_ort_kernel_fixes(onnx_program.model)
            report.record_applied("ort_kernel_fixes", [f"{name} x{n}" for name, n in counts.items() if n])
            report.extra["ort_kernel_fixes"] = counts
            record.detail = ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none active"

    def record_patches(self, session: CaptureSession, record: Any) -> None:
        """Stages ``patches`` (torch/transformers side) and ``onnx_patches`` (recorded right after
        it): the installed ``"onnx"`` patches split by target; torch.onnx, onnxscript, onnx_ir, onnx
        and onnxruntime targets are this backend's own toolchain. They stay installed until the
        shared capture step's block closes (after the IR stages), and are restored then, also on
        error."""
        torch_side = [e.name for e in session.patches if not _is_onnx_side(e)]
        session.report.record_applied(Stage.PATCHES, torch_side)
        record.detail = f"{len(torch_side)} installed"
        with session.report.stage("onnx_patches") as onnx_record:
            onnx_side = [e.name for e in session.patches if _is_onnx_side(e)]
            session.report.record_applied("onnx_patches", onnx_side)
            onnx_record.detail = f"{len(onnx_side)} installed"

    def translation_table(self, report: ExportReport) -> dict[Any, Callable[..., Any]]:
        """Stage ``custom_translations``: the active translations of :mod:`hfexport_onnx.workarounds.translations`."""
        with report.stage("custom_translations") as record:
            table, names = custom_translation_table()
            report.record_applied("custom_translations", names)
            record.detail = f"{len(names)} translation(s) for {len(table)} aten overload(s)"
        return table

    def translate(
        self,
        program: torch.export.ExportedProgram,
        config: OnnxConfig,
        table: dict[Any, Callable[..., Any]],
        report: ExportReport,
    ) -> Any:
        """Stage ``translate``: ``torch.onnx.export(program, dynamo=True, ...)`` without optimization."""
        with report.stage("translate") as record:
            onnx_program = torch.onnx.export(
                program,
                (),
                dynamo=True,
                custom_translation_table=table or None,
                opset_version=config.opset_version,
                optimize=False,
                verify=False,
                report=False,
                verbose=False,
            )
            record.detail = f"opset {onnx_program.model.opset_imports.get('', '?')}"
        return onnx_program

    def name_io(
        self,
        onnx_program: Any,
        program: torch.export.ExportedProgram,
        config: OnnxConfig,
        report: ExportReport,
    ) -> IoNames:
        """Stage ``io_names``: leaf-path names for graph inputs/outputs; ``Dim`` names for axes."""
        with report.stage("io_names") as record:
            names = assign_io_names(onnx_program.model, program)
            renamed = self._name_axes(onnx_program, config)
            report.extra["onnx_inputs"] = list(names.inputs)
            report.extra["onnx_outputs"] = list(names.outputs)
            if names.pruned_inputs:
                report.extra["onnx_pruned_inputs"] = names.pruned_inputs
            if renamed:
                report.extra["onnx_axis_names"] = renamed
            record.detail = f"{len(names.inputs)} inputs, {len(names.outputs)} outputs"
        return names

    @staticmethod
    def _name_axes(onnx_program: Any, config: OnnxConfig) -> dict[str, str]:
        """Give symbolic axes the names of the explicit ``Dim`` objects that made them dynamic."""
        import onnx_ir as ir

        wanted = _explicit_dim_names(config.dynamic_shapes)
        mapping: dict[str, str] = {}
        by_name = {v.name: v for v in onnx_program.model.graph.inputs}
        for key, axes in wanted.items():
            value = by_name.get(key)
            if value is None or value.shape is None:
                continue
            for axis, name in axes.items():
                if axis < len(value.shape) and isinstance(value.shape[axis], ir.SymbolicDim):
                    current = value.shape[axis].value
                    if current is not None and current != name:
                        mapping[current] = name
        if mapping:
            onnx_program.rename_axes(mapping)
        return mapping

    def fix_ir(self, onnx_program: Any, report: ExportReport) -> None:
        """Stage ``ir_fixes``: the active fixes of :mod:`hfexport_onnx.workarounds.ir_fixes`."""
        with report.stage("ir_fixes") as record:
            applied = apply_ir_fixes(onnx_program.model)
            report.record_applied("ir_fixes", applied)
            record.detail = f"{len(applied)} applied"

    def optimize(self, onnx_program: Any, config: OnnxConfig, report: ExportReport) -> None:
        """Stage ``optimize``: ``ONNXProgram.optimize()`` (onnxscript optimizer) when ``config.optimize``.

        The graph input/output names survive; inputs the optimizer drops as unused are removed
        from the name mapping and listed in ``report.extra["onnx_pruned_inputs"]``.
        """
        if not config.optimize:
            report.skip("optimize", "config.optimize is False")
            return
        from hfexport_onnx.io_names import INPUTS_KEY, io_names_from_metadata

        with report.stage("optimize") as record:
            before = onnx_program.model.graph.num_nodes()
            onnx_program.optimize()
            graph = onnx_program.model.graph
            names = io_names_from_metadata(onnx_program.model.metadata_props)
            if names is not None:
                present = {v.name for v in graph.inputs}
                dropped = [p for n, p in names.inputs.items() if n not in present]
                if dropped:
                    names.inputs = {n: p for n, p in names.inputs.items() if n in present}
                    onnx_program.model.metadata_props[INPUTS_KEY] = names.to_metadata()[INPUTS_KEY]
                    report.extra.setdefault("onnx_pruned_inputs", []).extend(dropped)
                missing = [n for n in names.outputs if n not in {v.name for v in graph.outputs}]
                if missing:
                    raise RuntimeError(
                        f"the optimizer renamed graph outputs {missing}; export with optimize=False"
                    )
            record.detail = f"{before} -> {graph.num_nodes()} nodes"

    def plan_external_data(self, onnx_program: Any, config: OnnxConfig, report: ExportReport) -> SaveOptions:
        """Stage ``external_data``: decide how :meth:`save` stores the weights.

        External data is used when ``config.external_data`` is True or when the weights exceed
        the 2 GiB protobuf limit (then whatever the config says, with a note in the report).
        """
        with report.stage("external_data") as record:
            size = initializer_bytes(onnx_program.model)
            too_big = size >= PROTOBUF_LIMIT_BYTES
            options = SaveOptions(
                external_data=bool(config.external_data or too_big),
                include_initializers=config.export_params,
                keep_initializers_as_inputs=config.keep_initializers_as_inputs,
            )
            _SAVE_OPTIONS[onnx_program] = options
            report.extra["onnx_weights_bytes"] = size
            report.extra["onnx_save"] = dataclasses.asdict(options)
            record.detail = (
                f"{size / 2**20:.1f} MiB of weights, "
                + ("external data" if options.external_data else "inside the model file")
                + (" (above the 2 GiB protobuf limit)" if too_big and not config.external_data else "")
            )
        return options

    # -- runtime, tolerances, save ------------------------------------------------------------
    def runner(self, artifact: Any) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """An :class:`~hfexport_onnx.runtime.OnnxRuntimeRunner` (CPU execution provider) over ``artifact``.

        Args:
            artifact: the ``ONNXProgram`` from :meth:`export`, an ``onnx_ir.Model``, an
                ``onnx.ModelProto`` or a saved ``.onnx`` path.

        Returns:
            A callable: forward kwargs -> ``{leaf_path: tensor}``.

        The session runs without ONNX Runtime's CPU memory arena: validation runs a few large
        inputs once (the quality text's prefills: logits of ``[tokens, vocab]``), whose buffers an
        arena would keep for the rest of the export instead of freeing them after each run. An
        in-memory artifact's weights are shared with the session (``share_weights``: ONNX Runtime
        reads the model's own buffers instead of holding a copy of them).
        """
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        return OnnxRuntimeRunner(artifact, session_options=options, share_weights=True)

    def load(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
        """Read a saved ``.onnx`` file (with its external data, if any) as an ``onnx.ModelProto``.

        ONNX files hold no Python code, so ``trust_remote_code`` changes nothing here.

        Raises:
            FileNotFoundError: no file at ``path``.
        """
        import onnx

        if not os.path.isfile(path):
            raise FileNotFoundError(f"no ONNX model at {path}")
        return onnx.load(os.fspath(path))

    # -- generation hooks: hfexport_onnx.generation.OnnxGenerationSupport ----------------------
    generation_support_class = OnnxGenerationSupport

    def default_tolerances(self, model: torch.nn.Module) -> tuple[float | None, float | None]:
        """fp32: ``(1e-4, 1e-3)``; fp16/bf16: ``(1e-2, 1e-2)`` (from the model's parameter dtype)."""
        from hfexport.validation import default_tolerances

        param = next(iter(model.parameters()), None)
        return default_tolerances(param.dtype if param is not None else torch.float32)

    def save(self, artifact: Any, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
        """Write ``artifact`` (an ``ONNXProgram``) to ``path`` atomically.

        Args:
            artifact: the ``torch.onnx.ONNXProgram`` from :meth:`export`.
            path: destination file, e.g. ``out/model.onnx``; with external data the weights go to
                ``out/model.onnx.data`` next to it.
            external_data: override the choice made at export (``config.external_data``, forced
                on above the 2 GiB protobuf limit).

        Raises:
            TypeError: ``artifact`` is not an ``ONNXProgram``.
            IsADirectoryError: ``path`` is an existing directory (give a file path).

        Nothing is left half-written: the files are written in a hidden staging folder next to
        ``path`` and moved into place (weights first, model last) only once complete. Weights
        inside the model file (at least :data:`hfexport_onnx.runtime.EXTERNAL_DATA_MIN_BYTES` of
        them) are appended one tensor at a time (:func:`hfexport_onnx.runtime.append_initializers`),
        never serialized as one message.
        """
        if not hasattr(artifact, "save") or not hasattr(artifact, "model"):
            raise TypeError(
                f"OnnxExporter.save expects a torch.onnx.ONNXProgram, got {type(artifact).__name__}"
            )
        target = Path(path)
        if target.is_dir():
            raise IsADirectoryError(
                f"{target} is a directory; pass a file path such as {target / self.artifact_filename}"
            )
        options = _SAVE_OPTIONS.get(artifact)
        if options is None:
            config = self.config if isinstance(self.config, OnnxConfig) else OnnxConfig()
            options = SaveOptions(
                config.external_data, config.export_params, config.keep_initializers_as_inputs
            )
        use_external = options.external_data if external_data is None else external_data
        if not use_external and initializer_bytes(artifact.model) >= PROTOBUF_LIMIT_BYTES:
            logger.warning("weights exceed the 2 GiB protobuf limit: saving %s with external data", target)
            use_external = True
        kwargs = {
            "include_initializers": options.include_initializers,
            "keep_initializers_as_inputs": options.keep_initializers_as_inputs,
        }
        if not use_external:
            with atomic_path(target) as tmp:
                if (
                    options.include_initializers
                    and initializer_bytes(artifact.model) >= EXTERNAL_DATA_MIN_BYTES
                ):
                    # the graph, then its weights tensor by tensor: no whole ModelProto of them
                    artifact.save(tmp, external_data=False, **{**kwargs, "include_initializers": False})
                    append_initializers(tmp, artifact.model.graph)
                else:
                    artifact.save(tmp, external_data=False, **kwargs)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
        try:
            artifact.save(staging / target.name, external_data=True, **kwargs)
            files = sorted(p for p in staging.iterdir() if p.name != target.name)
            for item in files:  # weights first: the model file only appears once they are complete
                os.replace(item, target.parent / item.name)
            os.replace(staging / target.name, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
