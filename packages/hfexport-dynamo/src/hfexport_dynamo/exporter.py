"""``DynamoExporter``: export a transformers model to a ``torch.export.ExportedProgram`` (``.pt2``).

Stages of :meth:`DynamoExporter._export` (each a named stage of the export report; the shared
names are :class:`hfexport.report.Stage`, the capture steps :data:`hfexport.report.CAPTURE_STEPS`):

Stages 1-3 are the core's shared capture step
(:meth:`hfexport.exporter.HfExporter.captured_program`).

1. ``patches``: the active ``register_patch("dynamo", ...)`` workarounds
   (:mod:`hfexport_dynamo.workarounds.patches`), installed for the capture and the FX fixes;
   then ``quantize`` (``config.quantization``: ``int8-weight``'s ``source`` phase,
   :func:`hfexport_dynamo.quantize.apply_int8_weight`, whose copy is captured);
2. ``capture``, the core capture (:func:`hfexport.capture.capture`), then one report stage per step:
   ``capture.cache_pytrees`` (every ``Cache`` subclass, model-defined ones included, becomes a
   pytree node), ``capture.signature`` (a ``**kwargs`` forward gets an explicit keyword
   signature, so ``dynamic_shapes`` are keyed by kwarg name), ``capture.dynamic_shapes``
   (``Dim.AUTO`` on every axis for ``dynamic=True`` without explicit ``dynamic_shapes``),
   ``capture.reset_stale_state`` (rotary tables and the like an eager forward cached are cleared
   while tracing, restored after), ``capture.patches`` (the core ``"capture"`` workarounds of
   :mod:`hfexport.workarounds.capture`: sliding-window cache, size-1 batch axes) and
   ``capture.torch_export`` (``torch.export.export`` under ``no_grad`` with ``strict`` and
   ``prefer_deferred_runtime_asserts_over_guards`` from the config);
3. ``fx_program_fixes`` then ``fx_node_fixes``: the active ``register_fx_program_fix("dynamo")`` /
   ``register_fx_node_fix("dynamo")`` entries;
4. ``flat_io``: the flat names the saved ``.pt2`` will use (:mod:`hfexport_dynamo.flat_io`:
   :meth:`save` writes the program with flat keyword inputs and, where its outputs name
   transformers classes, a flat dict of outputs, so stock ``torch.export.load`` in a process that
   imports only torch reads and runs it), recorded in the report (``extra["flat_io"]``); the
   returned program itself keeps the eager input/output objects;
5. ``lower``, recorded as skipped: the ``ExportedProgram`` is the artifact (with
   ``config.quantization``: torchao's weights decomposed to plain aten,
   :func:`hfexport_dynamo.quantize.to_plain_aten`);
6. ``aoti_compile`` (only with ``config.aoti``): the program compiled with AOTInductor
   (:mod:`hfexport_dynamo.aoti`); :meth:`save` writes the package next to the ``.pt2``
   (``model.aoti.pt2``) and validation adds the stage ``validate_aoti``.

The base class then validates the program against eager PyTorch at the sample shape and, for
dynamic exports, at a second shape (:meth:`hfexport.exporter.HfExporter.validate`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from hfexport.auto import register_exporter
from hfexport.config import DynamoConfig, QuantizationMethod
from hfexport.exporter import HfExporter
from hfexport.report import CAPTURE_STEPS, ExportReport, Stage
from hfexport_dynamo import aoti as _aoti
from hfexport_dynamo.flat_io import flat_io_names, flat_program_io
from hfexport_dynamo.generation import DynamoGenerationSupport
from hfexport_dynamo.quantize import METHODS as _quantize_methods
from hfexport_dynamo.runtime import ProgramRunner
from hfexport_dynamo.serialization import load as load_program
from hfexport_dynamo.serialization import save as save_program
from hfexport_dynamo.versions import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS
from hfexport_dynamo.workarounds import patches as _patches  # noqa: F401  (registers the dynamo patches)

__all__ = ["DynamoExporter"]

logger = logging.getLogger(__name__)

# fp32 programs run the same aten kernels as eager PyTorch; differences come from decompositions
# and reassociation only (measured below 2e-6 on the tiny-model zoo).
_FP32_TOLERANCES = (1e-5, 1e-5)


def _quantized_matmuls(program: torch.export.ExportedProgram) -> int:
    """``aten.mm`` / ``addmm`` / ``linear`` nodes whose weight operand is computed from an int8 tensor."""

    def from_int8(node: Any, depth: int = 0) -> bool:
        if not isinstance(node, torch.fx.Node) or depth > 4:
            return False
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype == torch.int8:
            return True
        return node.op == "call_function" and any(from_int8(a, depth + 1) for a in node.all_input_nodes)

    count = 0
    for node in program.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and name in (
            "aten.mm.default",
            "aten.addmm.default",
            "aten.linear.default",
        ):
            count += any(from_int8(a) for a in node.all_input_nodes)
    return count


@register_exporter("dynamo")
class DynamoExporter(HfExporter):
    """Export a ``PreTrainedModel`` to a ``torch.export.ExportedProgram``.

    ``export(model, sample_inputs, DynamoConfig(dynamic=True))`` captures ``model(**sample_inputs)``
    and returns the ``ExportedProgram``; ``program.module()(**inputs)`` runs it and
    :meth:`save` writes it as ``.pt2`` and :meth:`load` (:func:`hfexport_dynamo.load`) reads it back.

    Args:
        config: default :class:`hfexport.config.DynamoConfig` for :meth:`export`.

    Raises:
        ImportError: at construction, when torch/transformers are missing or older than
            :data:`hfexport_dynamo.versions.MIN_VERSIONS`.
    """

    export_format: ClassVar[str] = "dynamo"
    config_class: ClassVar[type[DynamoConfig]] = DynamoConfig
    package_name: ClassVar[str] = "hfexport-dynamo"
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    min_versions: ClassVar[dict[str, str]] = dict(MIN_VERSIONS)
    tested_versions: ClassVar[dict[str, str]] = dict(TESTED_VERSIONS)
    supported_versions: ClassVar[dict[str, str]] = dict(SUPPORTED)
    artifact_filename: ClassVar[str] = "model.pt2"
    #: registry key whose patches and FX fixes this exporter applies
    registry_key: ClassVar[str] = "dynamo"
    #: the ``capture`` stage lists its steps (``capture.torch_export`` ...)
    records_capture_steps: ClassVar[bool] = True
    stages: ClassVar[tuple[str, ...]] = (
        "quantize",
        *CAPTURE_STEPS,
        "flat_io",
        "aoti_compile",
        "validate_aoti",
    )
    #: fp16 and bf16 programs run on CPU with the same aten kernels as eager PyTorch.
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    #: auto keeps the checkpoint's dtype: the program runs the same aten kernels as eager PyTorch
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: Measured peak per weight byte (Qwen3-0.6B: 3.95 GB fp32 (W 2.38 GB), 2.66 GB bf16; the eager model's weights
    #: plus validation activations (docs/performance.md, "Scale")).
    memory_factor: ClassVar[float] = 1.4
    runtime_name: ClassVar[str] = "PyTorch"
    #: The in-memory ``ExportedProgram`` is what PyTorch runs, sharing the model's weights: it is
    #: validated itself. Reading the ``.pt2`` back costs a graph deserialization about as long as
    #: the capture (11.6 s of a 44 s Qwen3-0.6B export) and proves only the serializer, which the
    #: package's load tests cover.
    validates_saved_file: ClassVar[bool] = False
    #: see :mod:`hfexport_dynamo.quantize`.
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod]] = dict(_quantize_methods)

    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: DynamoConfig, report: ExportReport
    ) -> torch.export.ExportedProgram:
        """Capture ``model(**inputs)`` under the dynamo patches, then apply the FX fixes.

        Args:
            model: the prepared model (eval mode, output flags applied by the base class).
            inputs: prepared forward kwargs (tensors, caches, ``None``).
            config: the :class:`~hfexport.config.DynamoConfig`.
            report: the export report; every step is a stage of it.

        Returns:
            The ``ExportedProgram``.

        Raises:
            ExportStageError: a stage failed; ``stage`` names it (``capture.torch_export`` ...).
            ValueError: ``config.dynamic_shapes`` names inputs that are not among ``inputs``.
        """
        # patches, quantize (int8-weight's source phase), capture, FX fixes: the shared capture step
        with self.captured_program(model, inputs, config, report) as session:
            program = session.program
        quantization = getattr(config, "quantization", None)
        summary = report.quantization
        if quantization is None:
            report.skip(Stage.LOWER, "the ExportedProgram is the artifact")
        else:
            with report.stage(Stage.LOWER, detail="run_decompositions: torchao weights -> plain aten"):
                from hfexport_dynamo.quantize import program_weight_bytes, to_plain_aten

                program = to_plain_aten(program)
                summary["weight_bytes_after"] = after = program_weight_bytes(program)
                summary["size_ratio"] = round(after / summary["weight_bytes_before"], 4)
                summary["quantized_mm_nodes"] = _quantized_matmuls(program)
        with report.stage("flat_io") as record:
            names = flat_io_names(program)
            record.detail = f"{len(names['inputs'])} input and {len(names.get('outputs', {}))} output leaves"
            report.extra["flat_io"] = names
        report.extra["range_constraints"] = {str(k): str(v) for k, v in program.range_constraints.items()}
        if getattr(config, "aoti", False):
            with report.stage("aoti_compile") as record, flat_program_io(program):
                package = _aoti.compile_package(program)
                record.detail = f"{package.stat().st_size / 1e6:.2f} MB"
        return program

    def check_precision(self, config: Any) -> None:
        """``embedding_bits`` refused with where 4/8-bit embeddings are
        (:func:`hfexport_dynamo.quantize.check_quantization`), then the base checks (dtype,
        quantization method, the options it reads: ``int8-weight`` reads ``exclude`` only, so
        ``per_channel=False`` and ``group_size`` are refused), and for ``config.aoti`` a C++ compiler
        on PATH.

        Runs at the start of :meth:`export`, before capture.

        Raises:
            ValueError: see :meth:`hfexport.exporter.HfExporter.check_precision`; an option
                ``int8-weight`` does not have, naming what is allowed.
            RuntimeError: ``config.aoti`` without a C++ compiler (:func:`hfexport_dynamo.aoti.check_aoti_available`).
        """
        from hfexport_dynamo.quantize import check_quantization

        check_quantization(getattr(config, "quantization", None))
        super().check_precision(config)
        if getattr(config, "aoti", False):
            _aoti.check_aoti_available()

    def extra_runners(
        self, artifact: Any, path: str | os.PathLike[str] | None
    ) -> list[tuple[str, str, Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]]]:
        """The AOTInductor package, when the program was compiled (``config.aoti``): validated in
        stage ``validate_aoti`` on the same input sets and references as the program (rows in
        ``report.validation["aoti_sample"]`` / ``["aoti_second_shape"]``), loaded with
        ``torch._inductor.aoti_load_package`` from the saved ``model.aoti.pt2`` next to ``path``, or
        from the compiled temporary package before a save."""
        package = _aoti.package_path(path) if path is not None else None
        if package is None or not package.is_file():
            package = _aoti.attached_package(artifact) if artifact is not None else None
        if package is None:
            return []
        return [("validate_aoti", "aoti", _aoti.AotiRunner(package))]

    def runner(
        self, artifact: torch.export.ExportedProgram
    ) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """Return a :class:`~hfexport_dynamo.runtime.ProgramRunner` for ``artifact``.

        Args:
            artifact: the ``ExportedProgram`` (exported or loaded with :func:`hfexport_dynamo.load`).

        Returns:
            A callable: forward kwargs -> ``{output_leaf_path: tensor}``.

        Raises:
            TypeError: ``artifact`` is not an ``ExportedProgram``.
        """
        if not isinstance(artifact, torch.export.ExportedProgram):
            raise TypeError(
                f"DynamoExporter.runner expects an ExportedProgram, got {type(artifact).__name__}"
            )
        return ProgramRunner(artifact)

    def save(self, artifact: torch.export.ExportedProgram, path: str | os.PathLike[str]) -> None:
        """Write ``artifact`` to ``path`` (``.pt2``) atomically; see :func:`hfexport_dynamo.save`.

        Raises:
            TypeError: ``artifact`` is not an ``ExportedProgram``.
            ValueError: ``path`` does not end with ``.pt2``.
        """
        save_program(artifact, path)
        _aoti.save_package(artifact, path)

    def load(
        self, path: str | os.PathLike[str], *, trust_remote_code: bool = False
    ) -> torch.export.ExportedProgram:
        """Read a ``.pt2`` back with the safe loader :func:`hfexport_dynamo.load`.

        The file is verified against a ``checksums.sha256`` next to it, refused when corrupt or
        ambiguous (duplicate zip members ...) and, unless ``trust_remote_code``, when it holds
        content that could run code; ``torch.export.load`` then runs with weights-only unpickling
        only. :meth:`runner` of the result runs it; this is also what loads saved generation
        components (the default ``generation_support.load_component`` runs ``self.runner(self.load(path))``).

        Args:
            path: the ``.pt2`` file.
            trust_remote_code: see :func:`hfexport_dynamo.load`.

        Returns:
            The ``ExportedProgram``.

        Raises:
            FileNotFoundError, hfexport.errors.IntegrityError, CorruptArtifactError,
            UnsafeArtifactError, ArtifactLoadError: see :func:`hfexport_dynamo.load`.
        """
        return load_program(path, trust_remote_code=trust_remote_code)

    # -- generation hooks: hfexport_dynamo.generation.DynamoGenerationSupport ------------------
    generation_support_class = DynamoGenerationSupport

    def default_tolerances(self, model: torch.nn.Module) -> tuple[float | None, float | None]:
        """``(1e-5, 1e-5)`` for fp32 models; ``(None, None)`` (the core's dtype defaults) otherwise."""
        try:
            dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        except StopIteration:
            return None, None
        return _FP32_TOLERANCES if dtype == torch.float32 else (None, None)
