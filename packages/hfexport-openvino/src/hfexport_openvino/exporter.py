"""``OpenvinoExporter``: transformers model -> OpenVINO IR, validated in OpenVINO Runtime.

Stages of :meth:`OpenvinoExporter._export` (each a stage of the export report; the shared names are
:class:`hfexport.report.Stage`, this backend's own :attr:`OpenvinoExporter.stages`):

Stages 1-3 are the core's shared capture step
(:meth:`hfexport.exporter.HfExporter.captured_program`, ``decompose`` its ``between_fixes`` hook).

1. ``patches``: the active ``register_patch("openvino", ...)`` workarounds, installed for the
   capture, the fixes and ``decompose``;
2. ``capture``: the core capture (:func:`hfexport.capture.capture`, ``torch.export.export``), with
   its steps as ``capture.<step>``;
3. ``fx_program_fixes``, then ``decompose`` (OpenVINO's own decomposition table, run here so
   that the fixes see the graph the frontend converts: :mod:`hfexport_openvino.decompositions`),
   then ``fx_node_fixes``: the active ``"openvino"`` FX fixes
   (:mod:`hfexport_openvino.workarounds.fx_fixes`);
4. ``lower`` (``openvino.convert_model``), enclosing ``convert`` (a rejected op raises
   :class:`~hfexport_openvino.errors.OpenvinoConversionError` naming the FX node and op) and
   ``io_names`` (leaf-path names, :mod:`hfexport_openvino.naming`);
5. ``quantize`` (only with ``config.quantization``): the artifact phase
   (:meth:`hfexport.exporter.HfExporter.quantize_artifact`) on the converted IR: the method's
   ``apply`` function (NNCF weight compression for the built-in methods,
   :mod:`hfexport_openvino.quantize`) gets an :class:`~hfexport_openvino.quantize.IrTarget`
   (:meth:`OpenvinoExporter.quantization_target`) and, for a method reading ``calibration``, the
   prompts' IR feeds.

The base class then validates the model compiled on ``config.device`` against eager PyTorch at
the sample shape and, for dynamic exports, a second shape.

Generation (:meth:`OpenvinoExporter.export_for_generation`): with ``config.stateful`` (the default)
a decoder-only language model is exported as one stateful decoder
(:mod:`hfexport_openvino.stateful`), the model OpenVINO GenAI's ``LLMPipeline`` runs; otherwise
the core's stateless prefill/decode components.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.auto import register_exporter
from hfexport.config import OpenvinoConfig, QuantizationMethod
from hfexport.exporter import CaptureSession, HfExporter
from hfexport.report import ExportReport, Stage
from hfexport_openvino.decompositions import decompose_like_openvino, frontend_input
from hfexport_openvino.errors import DeviceUnavailableError, OpenvinoConversionError
from hfexport_openvino.generation import OpenvinoGenerationSupport
from hfexport_openvino.naming import name_model_io
from hfexport_openvino.quantize import (
    QUANTIZATION_METHODS,
    IrTarget,
    calibration_feeds,
    check_quantization,
    module_paths,
)
from hfexport_openvino.runtime import PRECISION_KEY, OpenvinoRunner
from hfexport_openvino.versions import MIN_VERSIONS, REQUIRED_PACKAGES, SUPPORTED, TESTED_VERSIONS
from hfexport_openvino.workarounds.fx_fixes import BACKEND

__all__ = ["OpenvinoExporter", "check_device", "save_model"]

logger = logging.getLogger(__name__)

#: ``rt_info`` path recording ``compress_to_fp16`` for :meth:`OpenvinoExporter.save`.
_COMPRESS_KEY = ["hfexport", "compress_to_fp16"]
# OpenVINO's OPTIMIZATION_CAPABILITIES name -> our precision hint
_CAPABILITY = {"f32": "FP32", "f16": "FP16", "bf16": "BF16"}


def check_device(device: str, precision_hint: str | None) -> None:
    """Check that ``device`` is present and supports ``precision_hint``, before any capture.

    Args:
        device: ``"CPU"``, ``"GPU"``, ``"NPU"`` or an indexed one (``"GPU.1"``).
        precision_hint: ``None`` or ``"f32"`` / ``"f16"`` / ``"bf16"``.

    Raises:
        DeviceUnavailableError: the device is not among ``openvino.Core().available_devices``, or
            its ``OPTIMIZATION_CAPABILITIES`` lack the precision; the message lists what is there.
    """
    import openvino as ov

    core = ov.Core()
    available = list(core.available_devices)
    wanted = device.upper()
    family = wanted.split(".", 1)[0]
    present = wanted in available or (
        "." not in wanted and any(d.split(".", 1)[0] == family for d in available)
    )
    if not present:
        raise DeviceUnavailableError(
            f"OpenVINO device {device!r} is not present here; available devices: {', '.join(available) or 'none'}. "
            "Pass device='CPU' (the default) or install the device's driver and OpenVINO plugin."
        )
    if precision_hint is None:
        return
    capabilities = [str(c) for c in core.get_property(wanted, "OPTIMIZATION_CAPABILITIES")]
    if _CAPABILITY[precision_hint] not in capabilities:
        supported = [hint for hint, cap in _CAPABILITY.items() if cap in capabilities]
        raise DeviceUnavailableError(
            f"inference_precision_hint={precision_hint!r} is not supported by OpenVINO device {device!r} "
            f"(its OPTIMIZATION_CAPABILITIES: {', '.join(capabilities)}); allowed here: None, "
            + ", ".join(map(repr, supported))
        )


def save_model(ov_model: Any, path: str | os.PathLike[str], *, compress_to_fp16: bool = False) -> list[Path]:
    """Write ``ov_model`` as ``path`` (``.xml``) and its weights next to it (``.bin``), atomically.

    Both files are written into a hidden staging folder next to ``path`` and moved into place,
    weights first, the ``.xml`` last, so no half-written model is ever visible at ``path``.

    Args:
        ov_model: an ``openvino.Model``.
        path: the ``.xml`` file (e.g. ``out/openvino_model.xml``); the weights go to ``out/openvino_model.bin``.
        compress_to_fp16: store the weights as fp16.

    Returns:
        ``[xml_path, bin_path]``.

    Raises:
        ValueError: ``path`` does not end with ``.xml``.
        IsADirectoryError: ``path`` is a directory.
    """
    import openvino as ov

    target = Path(path)
    if target.suffix != ".xml":
        raise ValueError(f"OpenVINO models are saved as .xml (+ .bin); got {target}")
    if target.is_dir():
        raise IsADirectoryError(
            f"{target} is a directory; pass a file path such as {target / 'openvino_model.xml'}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
    try:
        ov.save_model(ov_model, staging / target.name, compress_to_fp16=compress_to_fp16)
        weights = target.with_suffix(".bin")
        os.replace(staging / weights.name, weights)
        os.replace(staging / target.name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [target, weights]


@register_exporter(BACKEND)
class OpenvinoExporter(HfExporter):
    """Export transformers models to OpenVINO IR and run them with ``openvino.Core().compile_model``.

    ``export(model, forward_kwargs, OpenvinoConfig(dynamic=True))`` returns an ``openvino.Model``
    whose inputs are named by forward kwarg leaf path and outputs by model output leaf path;
    :meth:`save` writes ``openvino_model.xml`` + ``openvino_model.bin``.

    Args:
        config: default :class:`hfexport.config.OpenvinoConfig` for :meth:`export`.

    Raises:
        ImportError: torch, transformers or openvino is missing or older than
            :data:`hfexport_openvino.versions.MIN_VERSIONS`.
        DeviceUnavailableError: (from :meth:`export` and construction with a config) the device is
            not present or does not support the precision hint.
    """

    export_format: ClassVar[str] = BACKEND
    config_class: ClassVar[type[OpenvinoConfig]] = OpenvinoConfig
    package_name: ClassVar[str] = "hfexport-openvino"
    required_packages: ClassVar[tuple[str, ...]] = REQUIRED_PACKAGES
    min_versions: ClassVar[dict[str, str]] = dict(MIN_VERSIONS)
    tested_versions: ClassVar[dict[str, str]] = dict(TESTED_VERSIONS)
    supported_versions: ClassVar[dict[str, str]] = dict(SUPPORTED)
    artifact_filename: ClassVar[str] = "openvino_model.xml"
    stages: ClassVar[tuple[str, ...]] = ("decompose", "convert", "io_names")
    #: the ``capture`` stage lists its steps (``capture.torch_export`` ...)
    records_capture_steps: ClassVar[bool] = True
    #: auto exports every checkpoint in float32 (the IR may store its weights in fp16,
    #: ``compress_to_fp16``; the precision the CPU plugin computes in is the compile hint)
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Measured peak per weight byte (Qwen3-0.6B fp32: 7.0 GB (W 2.38 GB): the CPU plugin's compiled model keeps the IR
    #: constants and its repacked weights (docs/performance.md, "Scale")).
    memory_factor: ClassVar[float] = 2.6
    runtime_name: ClassVar[str] = "OpenVINO's CPU plugin (f32 hint)"
    #: NNCF weight compression of the converted IR (:mod:`hfexport_openvino.quantize`)
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod]] = QUANTIZATION_METHODS

    # -- config ------------------------------------------------------------------------------
    def _resolve_config(self, config: Any) -> OpenvinoConfig:
        """The base's resolution plus the device / precision check (before any capture)."""
        resolved = super()._resolve_config(config)
        check_device(resolved.device, resolved.inference_precision_hint)
        return resolved  # type: ignore[return-value]

    def check_precision(self, config: Any) -> None:
        """The base's checks, then the values of ``config.quantization`` NNCF cannot take
        (:func:`hfexport_openvino.quantize.check_quantization`: group size, calibration file).

        Raises:
            ValueError: as the base; a ``group_size`` not in
                :data:`~hfexport_openvino.quantize.INT4_GROUP_SIZES`; a missing or empty calibration file.
        """
        super().check_precision(config)
        check_quantization(getattr(config, "quantization", None))

    # -- stages --------------------------------------------------------------------------------
    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: OpenvinoConfig, report: ExportReport
    ) -> Any:
        """Stages 1-5 of the module docstring; returns the named (and, with ``config.quantization``,
        weight-compressed) ``openvino.Model``.

        Stages 1-3 are the base class's shared capture step
        (:meth:`hfexport.exporter.HfExporter.captured_program`) with this backend's ``decompose``
        between the program and node fixes (:meth:`between_fixes`); the conversion runs once the
        patches are restored, then the artifact phase of the quantization method on the converted
        IR (:meth:`~hfexport.exporter.HfExporter.quantize_artifact`; nothing without quantization).
        """
        with self.captured_program(model, inputs, config, report) as session:
            program = session.program
        ov_model = self.convert(program, config, report)
        if getattr(config, "quantization", None) is None:
            return ov_model
        target = self.quantization_target(ov_model, program)
        calibration = self.calibration_feeds(ov_model, model, inputs, config)
        result = self.quantize_artifact(target, config, report, inputs=inputs, calibration=calibration)
        return result.model if isinstance(result, IrTarget) else result

    @staticmethod
    def quantization_target(ov_model: Any, program: torch.export.ExportedProgram) -> IrTarget:
        """What an artifact-phase quantization function gets as ``request.target``: ``ov_model``
        with the module paths of the FX nodes of ``program`` it was converted from (so
        ``quantization.exclude`` maps onto IR ops, :meth:`~hfexport_openvino.quantize.IrTarget.excluded_ops`).

        Args:
            ov_model: the converted, named ``openvino.Model``.
            program: the captured ``ExportedProgram`` it was converted from.

        Returns:
            An :class:`~hfexport_openvino.quantize.IrTarget`.
        """
        return IrTarget(ov_model, module_paths(program))

    def calibration_feeds(
        self, ov_model: Any, model: torch.nn.Module, inputs: Mapping[str, Any], config: OpenvinoConfig
    ) -> list[dict[str, Any]] | None:
        """``request.calibration`` of the artifact phase: the IR feeds of the prompts in
        ``quantization.calibration`` (:func:`hfexport_openvino.quantize.calibration_feeds`) for a
        method that reads ``calibration``; ``None`` when no prompt file is given or the method does
        not read it.

        Raises:
            ValueError: no tokenizer next to the model, prompts that tokenize to nothing, or an IR
                input the prompts cannot feed.
        """
        quantization = config.quantization
        method = self.quantization_spec(config)
        if quantization is None or quantization.calibration is None:
            return None
        if method is None or "calibration" not in method.options:
            return None
        return calibration_feeds(ov_model, quantization, model, inputs)

    def between_fixes(self, session: CaptureSession) -> None:
        """Stage ``decompose``: OpenVINO's own decomposition table on the captured program
        (:func:`hfexport_openvino.decompositions.decompose_like_openvino`), run between the program
        fixes and the node fixes so that the node fixes see the graph the frontend converts."""
        with session.report.stage("decompose") as record:
            session.program = decompose_like_openvino(session.program)
            record.detail = f"{len(session.program.graph.nodes)} nodes"

    def convert(
        self, program: torch.export.ExportedProgram, config: OpenvinoConfig, report: ExportReport
    ) -> Any:
        """Stage ``lower`` with ``convert`` (``openvino.convert_model``) and ``io_names``.

        Raises:
            OpenvinoConversionError: OpenVINO rejected ops; the message names the FX node(s) and op(s).
        """
        import openvino as ov

        with report.stage(Stage.LOWER, detail="openvino.convert_model"):
            with report.stage("convert") as record:
                try:
                    ov_model = ov.convert_model(frontend_input(program))
                except Exception as exc:
                    if type(exc).__name__ != "OpConversionFailure":
                        raise
                    graph_nodes: dict[str, list[str]] = {}
                    for module in program.graph_module.modules():
                        if isinstance(module, torch.fx.GraphModule):
                            for node in module.graph.nodes:
                                if node.op == "call_function":
                                    graph_nodes.setdefault(str(node.target), []).append(node.name)
                    raise OpenvinoConversionError(
                        f"openvino.convert_model rejected the captured program of component '{report.component}'",
                        stage="convert",
                        component=report.component,
                        detail=str(exc),
                        graph_nodes=graph_nodes,
                    ) from exc
                record.detail = f"{len(ov_model.get_ops())} ops"
            with report.stage("io_names") as record:
                names = name_model_io(ov_model, program)
                report.extra["openvino_inputs"] = list(names.inputs)
                report.extra["openvino_outputs"] = list(names.outputs)
                record.detail = f"{len(names.inputs)} inputs, {len(names.outputs)} outputs"
            self._record_options(ov_model, config)
        return ov_model

    @staticmethod
    def _record_options(ov_model: Any, config: OpenvinoConfig) -> None:
        """Store the save option and the precision hint in the model's ``rt_info`` (``hfexport/...``).

        The hint is read back by :class:`~hfexport_openvino.runtime.OpenvinoRunner` and the stateful
        runner; OpenVINO itself does not apply an IR's recorded ``INFERENCE_PRECISION_HINT`` (2026.4),
        so other loaders (``LLMPipeline``) take it as a property.
        """
        ov_model.set_rt_info(str(bool(config.compress_to_fp16)), _COMPRESS_KEY)
        if config.inference_precision_hint is not None:
            ov_model.set_rt_info(config.inference_precision_hint, PRECISION_KEY)

    # -- runtime, tolerances, save, load ---------------------------------------------------------
    def _device_settings(self) -> tuple[str, str | None]:
        """Device and precision hint of the export running now (validation compiles with them),
        else of the exporter's own config, else ``("CPU", None)``."""
        active = self.active_config if isinstance(self.active_config, OpenvinoConfig) else None
        config = active or (self.config if isinstance(self.config, OpenvinoConfig) else None)
        return (config.device, config.inference_precision_hint) if config is not None else ("CPU", None)

    def runner(self, artifact: Any) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """An :class:`~hfexport_openvino.runtime.OpenvinoRunner` over ``artifact``.

        Args:
            artifact: the ``openvino.Model`` from :meth:`export` or a saved ``openvino_model.xml`` path.

        Returns:
            A callable: forward kwargs -> ``{output_leaf_path: tensor}``.
        """
        device, hint = self._device_settings()
        return OpenvinoRunner(artifact, device=device, precision_hint=hint)

    def default_tolerances(self, model: torch.nn.Module) -> tuple[float | None, float | None]:
        """fp32: ``(1e-4, 1e-3)`` (OpenVINO fuses and reorders fp32 kernels); otherwise the core's defaults."""
        param = next(iter(model.parameters()), None)
        if param is None or param.dtype == torch.float32:
            return 1e-4, 1e-3
        return None, None

    def save(self, artifact: Any, path: str | os.PathLike[str]) -> None:
        """Write ``artifact`` (an ``openvino.Model``) as ``path`` (``.xml``) + ``.bin``, atomically.

        ``compress_to_fp16`` is the export's ``config.compress_to_fp16`` (recorded in the model).

        Raises:
            TypeError: ``artifact`` is not an ``openvino.Model``.
            ValueError: ``path`` does not end with ``.xml``.
        """
        import openvino as ov

        if not isinstance(artifact, ov.Model):
            raise TypeError(f"OpenvinoExporter.save expects an openvino.Model, got {type(artifact).__name__}")
        compress = False
        if artifact.has_rt_info(_COMPRESS_KEY):
            compress = str(artifact.get_rt_info(_COMPRESS_KEY).astype(str)) == "True"
        save_model(artifact, path, compress_to_fp16=compress)

    def load(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
        """Read a saved ``openvino_model.xml`` (+ ``.bin``) as an ``openvino.Model``.

        The files are checked against a ``checksums.sha256`` next to them when it lists them. IR
        files hold no Python code, so ``trust_remote_code`` changes nothing.

        Raises:
            FileNotFoundError: no ``.xml`` at ``path`` or no ``.bin`` next to it.
            hfexport.errors.IntegrityError: a file differs from its recorded SHA-256.
        """
        import openvino as ov

        from hfexport.integrity import verify_file

        path = Path(path)
        weights = path.with_suffix(".bin")
        for file in (path, weights):
            if not file.is_file():
                raise FileNotFoundError(f"no OpenVINO model file at {file}")
            verify_file(file)
        return ov.Core().read_model(os.fspath(path))

    # -- generation ------------------------------------------------------------------------------
    def export_for_generation(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], config: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Export for greedy generation; see :meth:`hfexport.exporter.HfExporter.export_for_generation`.

        With ``config.stateful`` (the default) the model must be a decoder-only language model: it is
        exported as one stateful decoder (:func:`hfexport_openvino.stateful.export_stateful_decoder`,
        component ``"stateful_decoder"``, saved as ``openvino_model.xml``), validated stateless at
        the sample and then as state against ``model.generate`` (greedy tokens equal). With
        ``stateful=False``, a per-component config dict, or a recurrent-state model (mamba, rwkv ...:
        :mod:`hfexport.generation.recurrent`), the core's stateless components.

        Raises:
            StatefulExportError: ``stateful=True`` for a model with no KV cache, an encoder-decoder
                or a multimodal model (before any capture).
            ValueError: ``stateful=True`` with ``multi_token_decode``/``components``/
                ``generation_config`` options that only stateless components take.
        """
        if isinstance(config, Mapping) and "export_format" not in config:  # {component: config}
            return super().export_for_generation(model, inputs, config, **kwargs)
        resolved = self._resolve_config(config)
        from hfexport.generation.recurrent import is_recurrent_state_model

        # a recurrent state (mamba, rwkv ...) is no KV cache the stateful decoder could hold: the core's
        # prefill/decode components carry it as named tensors (hfexport.generation.recurrent)
        if not resolved.stateful or is_recurrent_state_model(model):
            return super().export_for_generation(model, inputs, resolved, **kwargs)
        used = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if used:
            raise ValueError(
                f"{used} apply to stateless generation components; pass OpenvinoConfig(stateful=False) to use them"
            )
        from hfexport_openvino.stateful import export_stateful_decoder

        return export_stateful_decoder(self, model, inputs, resolved)

    # -- generation hooks: hfexport_openvino.generation.OpenvinoGenerationSupport ---------------
    generation_support_class = OpenvinoGenerationSupport
