"""``HfExporter``: the base every backend implements, and the whole backend contract.

Everything the core asks of a backend is a method or class attribute of this class; nothing is
found by module name or probed with ``getattr``. ``export`` is the only method a backend must
provide. Two ways to do it:

- override ``export(model, sample_inputs, config=None, **kwargs) -> artifact`` alone: the backend
  works as written, unvalidated; the base class times the call and records in ``last_report``
  that the artifact was not validated (an ``export`` stage, then ``validate`` skipped, saying why);
- or implement the pipeline hooks and get capture, validation, reports and folders from the core:

  - ``_export(model, inputs, config, report) -> artifact``: its stages (patches, capture, fixes,
    lowering), each inside ``report.stage(name)``, the shared ones named by
    :class:`hfexport.report.Stage` and its own declared in the ``stages`` class attribute;
    ``with self.captured_program(model, inputs, config, report) as session`` runs the capture every
    backend shares (patches, the quantization method's source and program phases, capture, FX
    fixes) and yields the program with the patches still installed; hooks change what differs;
  - ``runner(artifact) -> callable``: forward kwargs -> ``{output_name: tensor}``, used by validation;
  - ``save(artifact, path)``: write the artifact file (export folders, ``export_to_path``).

It may override, where the defaults do not fit:

- ``load(path, *, trust_remote_code=False) -> artifact``: read a saved artifact (default: refuses);
- ``generation_support_class``: the :class:`hfexport.generation.support.GenerationSupport`
  subclass holding its generation hooks (how a component is prepared, configured, named, described
  in the manifest, loaded and run; default: the core's defaults). The hooks that were methods of
  this class (``prepare_component``, ``load_component`` ...) still work for one release, deprecated.

The base class owns what every backend shares: environment validation, input preparation, the
reversible model state (training mode, attention implementation, output flags), validation
against eager PyTorch at the sample shape and a second shape, and the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hfexport.config import ExportConfigMixin, QuantizationMethod
from hfexport.environment import check_environment, format_problems, warn_drift_once
from hfexport.report import ExportReport, Stage
from hfexport.verify.compare import FLOAT64_REFERENCE_MAX_PARAMETERS

if TYPE_CHECKING:
    from hfexport.generation.support import GenerationSupport

__all__ = ["CaptureSession", "HfExporter"]

_LOCKS_GUARD = threading.Lock()
_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()


def _model_lock(model: Any) -> threading.RLock:
    """The lock that serializes exports of one model object across threads (re-entrant, so a
    generation export may export its components inside)."""
    with _LOCKS_GUARD:
        try:
            lock = _MODEL_LOCKS.get(model)
        except TypeError:  # not weak-referenceable: no sharing to guard
            return threading.RLock()
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


logger = logging.getLogger(__name__)


def _parent(target: Path) -> Path:
    """The existing folder ``target`` is written into (created when missing)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _publish(staging: Path, target: Path) -> None:
    """Move the files a save wrote into ``staging`` next to ``target``: every companion file first
    (external data, packages), ``target`` itself last, each with an atomic rename."""
    files = sorted(p for p in staging.iterdir() if p.name != target.name)
    for item in [*files, staging / target.name]:
        if item.exists():
            os.replace(item, target.parent / item.name)


def _parameter_count(model: Any) -> int:
    """Elements of ``model``'s parameters (0 for anything that is not a module)."""
    return sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else 0


def _release_weights(model: torch.nn.Module) -> None:
    """Free ``model``'s parameters and buffers: each keeps its object but gets an empty tensor of
    its dtype as data, so the memory is returned as soon as nothing else holds the old tensors
    (objects that only hold the ``Parameter``, such as a saved ``requires_grad`` state, do not).
    ``Module.to("meta")`` would put new ``Parameter`` objects in the module and leave the old ones,
    with their storage, to whoever still references them."""
    if not isinstance(model, torch.nn.Module):
        return
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


#: the stage a backend that implements only ``export`` records around it
_EXPORT_STAGE = "export"


class _ReportedExport:
    """The ``export`` of a backend that implements only ``export`` (no pipeline hooks): calls it
    inside an ``export`` stage of a new report and records that the artifact was not validated,
    so ``last_report`` says what happened whatever the backend's ``export`` records itself."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__
        self.__name__ = getattr(function, "__name__", "export")
        self.__wrapped__ = function

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return _bound_export(self.function, instance)


def _bound_export(function: Callable[..., Any], exporter: HfExporter) -> Callable[..., Any]:
    @functools.wraps(function)
    def export(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        report = ExportReport(
            export_format=exporter.export_format,
            component=str(kwargs.get("component", "model")),
            model_class=type(model).__name__,
            callback=exporter.stage_callback,
        )
        exporter.last_report = report
        with report.stage(_EXPORT_STAGE, detail=f"{type(exporter).__name__}.export"):
            artifact = function(exporter, *args, **kwargs)
        if exporter.last_report is not report:  # the backend made its own report: it has the say
            return artifact
        report.skip(
            Stage.VALIDATE,
            f"not validated: {type(exporter).__name__} implements only export(), not the pipeline "
            "hooks (_export, runner, save) that the core validates with",
        )
        return artifact

    return export


@dataclasses.dataclass
class CaptureSession:
    """The state of one run of the shared capture step (:meth:`HfExporter.captured_program`),
    passed to every capture hook and yielded to the backend.

    A backend whose hooks share more state subclasses it (a dataclass, with defaults) and names the
    subclass in :attr:`HfExporter.capture_session_class`.

    Attributes:
        model: the module to capture: the prepared model, replaced by its quantized copy after a
            ``source``-phase quantization (the user's model is never modified).
        inputs: the forward kwargs captured with (a hook may replace them, e.g. a widened batch).
        config: the export's resolved config.
        report: the export's report.
        registry_key: the key whose patches and FX fixes are applied (:attr:`HfExporter.registry_key`,
            else the export format; :meth:`HfExporter.prepare_capture` may change it).
        original: the model as given, before any source transform.
        stack: closes when the capture step's ``with`` block exits: the patches are restored then;
            a hook may enter its own contexts in it (restored in reverse order, also on error).
        patches: the patch entries installed for the capture (``RegistryEntry`` objects).
        method: the declared :class:`hfexport.config.QuantizationMethod` of ``config.quantization``
            (``None`` without quantization, or when the backend declared a plain description).
        program: the captured ``ExportedProgram`` once the ``capture`` stage ran.
    """

    model: torch.nn.Module
    inputs: dict[str, Any]
    config: Any
    report: ExportReport
    registry_key: str
    original: torch.nn.Module
    stack: contextlib.ExitStack
    patches: list[Any] = dataclasses.field(default_factory=list)
    method: QuantizationMethod | None = None
    program: Any = None


def _deprecated(exporter: HfExporter, hook: str) -> None:
    """Warn that ``HfExporter.<hook>`` is deprecated, unless it is reached from the exporter's own
    override of it (``super().hook(...)``), whose class was warned about at creation."""
    from hfexport.generation.support import in_legacy_override

    if in_legacy_override(exporter.generation_support, hook):
        return
    warnings.warn(
        f"HfExporter.{hook} is deprecated and will be removed in the next release: use "
        f"exporter.generation_support.{hook} (hfexport.generation.support.GenerationSupport)",
        DeprecationWarning,
        stacklevel=3,
    )


def _adopt_legacy_hooks(cls: type[HfExporter]) -> None:
    """Keep the generation hooks an exporter subclass still overrides under their old
    ``HfExporter`` names working for one release: warn once, at class creation, and give the class
    a ``generation_support_class`` that calls its overrides
    (:func:`hfexport.generation.support.legacy_support_class`)."""
    from hfexport.generation.support import LEGACY_HOOKS, GenerationSupport, legacy_support_class

    hooks = {name: cls.__dict__[name] for name in LEGACY_HOOKS if name in cls.__dict__}
    if not hooks:
        return
    warnings.warn(
        f"{cls.__qualname__} overrides {', '.join(sorted(hooks))} of HfExporter, deprecated and ignored from the "
        "next release: move them to a subclass of hfexport.generation.support.GenerationSupport named by "
        f"{cls.__qualname__}.generation_support_class",
        DeprecationWarning,
        stacklevel=3,
    )
    base = cls.generation_support_class or GenerationSupport
    cls.generation_support_class = legacy_support_class(base, cls, hooks)


class HfExporter:
    """Base exporter of a ``transformers.PreTrainedModel`` to one runtime.

    Class attributes:
        export_format: the format name (``"dynamo"``, ``"onnx"``, ``"executorch"``).
        config_class: the config dataclass this exporter takes.
        package_name: the distribution that provides the backend (for install messages).
        required_packages: distributions that must be installed.
        min_versions: ``{distribution: version}`` hard floors; below one -> ``ImportError``.
        tested_versions: ``{distribution: version}`` validated pins; drift -> one warning per class
            per process.
        artifact_filename: file name the CLI writes (``model.onnx``, ...); its suffix is also the
            suffix of saved generation components (``decode.onnx``).
        generation_support_class: the :class:`hfexport.generation.support.GenerationSupport`
            subclass of the backend (``None``: the base class, the core's defaults).
        stages: the names of the backend's own report stages (those not in
            :class:`hfexport.report.Stage`), in run order; a test holds every report to them.

    A backend implements :meth:`export` alone (its artifact is then unvalidated, and
    ``last_report`` says so), or the pipeline hooks :meth:`_export`, :meth:`runner` and
    :meth:`save`, which the base class's :meth:`export` drives (preparation, capture, validation,
    report). Methods with defaults it may override: :meth:`load`, :meth:`default_tolerances`; its
    generation hooks are one object, :attr:`generation_support` (an instance of
    :attr:`generation_support_class`).

    Args:
        config: the default config for :meth:`export` (an instance of ``config_class``).

    Raises:
        ImportError: at construction, when a required package is missing or below its minimum;
            one message lists every problem and the pip command installing the tested pins.
        TypeError: at construction, when the class implements neither :meth:`export` nor
            :meth:`_export` (as Python refuses an abstract class).
    """

    export_format: ClassVar[str] = ""
    config_class: ClassVar[type[ExportConfigMixin]] = ExportConfigMixin
    package_name: ClassVar[str] = "hfexport"
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    min_versions: ClassVar[dict[str, str]] = {}
    tested_versions: ClassVar[dict[str, str]] = {}
    # {distribution: specifier} the package declares it supports (used to find stale workarounds)
    supported_versions: ClassVar[dict[str, str]] = {}
    artifact_filename: ClassVar[str] = "model"
    #: The backend's generation hooks: a :class:`hfexport.generation.support.GenerationSupport`
    #: subclass, instantiated once per exporter as :attr:`generation_support` (``None``: the base
    #: class, whose hooks are the core's defaults).
    generation_support_class: ClassVar[type[GenerationSupport] | None] = None
    #: The backend's own stage names (the shared ones are :class:`hfexport.report.Stage`).
    stages: ClassVar[tuple[str, ...]] = ()
    #: ``config.dtype`` values this backend can capture and run here (see :meth:`check_precision`).
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: The dtypes this backend's runtime computes well on CPU, preferred first: ``config.dtype=None``
    #: (auto) keeps a model in one of them and exports any other in the first (:meth:`decide_dtype`).
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Whether an export with a path validates the saved file in the runtime (the in-memory
    #: artifact is freed first), rather than the in-memory artifact: True where the runtime runs
    #: something else than the object the export built (a session over the file).
    validates_saved_file: ClassVar[bool] = True
    #: The runtime's name in the reason of a dtype decision (``"ONNX Runtime's CPU provider"``).
    runtime_name: ClassVar[str] = "the runtime"
    #: Peak resident memory of a whole export (CLI, validation included) per byte of weights in the
    #: export dtype, measured at 0.6B parameters (docs/performance.md), for :meth:`estimate_peak_bytes`.
    memory_factor: ClassVar[float] = 2.0
    #: What the process holds besides the weights (imports, runtime libraries), bytes.
    memory_base_bytes: ClassVar[int] = 1_000_000_000
    #: ``config.quantization.method`` names this backend implements -> a
    #: :class:`hfexport.config.QuantizationMethod` (what it does and which options it reads; a
    #: plain description string is accepted too and declares nothing, so its options are not checked).
    #: Every subclass's value becomes a :class:`hfexport.quantization.QuantizationMethodTable`: its
    #: own methods plus those registered for its format with
    #: :func:`hfexport.quantization.register_quantization_method`.
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod | str]] = {}
    #: The registry key whose patches and FX fixes :meth:`captured_program` applies (``""``: the
    #: :attr:`export_format`); a backend may pick another per export in :meth:`prepare_capture`.
    registry_key: ClassVar[str] = ""
    #: Whether the ``capture`` stage lists its steps (``capture.signature``, ``capture.torch_export``
    #: ...) as stages of their own (:func:`hfexport.capture.capture`'s ``record_stages``).
    records_capture_steps: ClassVar[bool] = False
    #: The :class:`CaptureSession` (sub)class :meth:`captured_program` creates: a backend whose
    #: hooks share more state subclasses the dataclass with its own typed fields.
    capture_session_class: ClassVar[type[CaptureSession]] = CaptureSession

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that overrides :meth:`export` without the pipeline hooks gets its ``export``
        wrapped so ``last_report`` records it (:func:`_reported_export`)."""
        super().__init_subclass__(**kwargs)
        from hfexport.quantization import QuantizationMethodTable

        declared = cls.__dict__.get("quantization_methods", cls.quantization_methods)
        if not (isinstance(declared, QuantizationMethodTable) and declared.backend == cls.export_format):
            own = declared.own if isinstance(declared, QuantizationMethodTable) else dict(declared or {})
            cls.quantization_methods = QuantizationMethodTable(cls.export_format, own)
        _adopt_legacy_hooks(cls)
        own = cls.__dict__.get("export")
        if own is not None and cls._export is HfExporter._export and not isinstance(own, _ReportedExport):
            cls.export = _ReportedExport(own)  # type: ignore[method-assign]
            if _EXPORT_STAGE not in cls.stages:
                cls.stages = (*cls.stages, _EXPORT_STAGE)

    def __init__(self, config: ExportConfigMixin | None = None) -> None:
        cls = type(self)
        if cls.export is HfExporter.export and cls._export is HfExporter._export:
            raise TypeError(
                f"Can't instantiate {cls.__name__}: it implements neither export(model, sample_inputs, "
                "config) nor the pipeline hooks _export/runner/save of HfExporter; implement export "
                "(unvalidated) or the hooks (validated by the core)"
            )
        self.validate_environment()
        self.config = self._resolve_config(config) if config is not None else None
        self.last_report: ExportReport | None = None
        #: the resolved config (dtype decided) of the last export, what
        #: :func:`hfexport.folder.write_export_folder` records by default
        self.last_config: ExportConfigMixin | None = None
        #: the resolved config of the export running now (dtype decided), ``None`` between exports:
        #: what :meth:`runner` and ``generation_support.load_component`` read for runtime settings
        self.active_config: ExportConfigMixin | None = None
        # optional progress hook: callback(event, stage_record), event in {"start", "end"}
        self.stage_callback: Callable[[str, Any], None] | None = None

    # -- environment -------------------------------------------------------------------------------
    @classmethod
    def validate_environment(cls) -> None:
        """Check installed packages in one pass.

        Raises:
            ImportError: missing or too-old packages, all listed, with a pip command naming the
                tested pins (``pip install 'hfexport-onnx[tested]'``).
        """
        problems, drift = check_environment(cls.required_packages, cls.min_versions, cls.tested_versions)
        if problems:
            pins = " ".join(f"'{name}=={ver}'" for name, ver in cls.tested_versions.items())
            spec = f"'{cls.package_name}[tested]'" + (f"  (that is: {pins})" if pins else "")
            raise ImportError(format_problems(cls.__name__, problems, spec))
        warn_drift_once(f"{cls.__module__}.{cls.__qualname__}", drift)

    # -- config ------------------------------------------------------------------------------------
    def _resolve_config(self, config: ExportConfigMixin | Mapping[str, Any] | None) -> ExportConfigMixin:
        if config is None:
            config = self.config if getattr(self, "config", None) is not None else self.config_class()
        if isinstance(config, Mapping):
            config = self.config_class.from_dict(dict(config))
        if not self._takes_config(config):
            raise TypeError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "use AutoHfExporter.from_config to pick the exporter matching a config"
            )
        return config

    @classmethod
    def _takes_config(cls, config: Any) -> bool:
        """True when ``config`` is this exporter's own config: an instance of exactly
        ``config_class``, or of a subclass that keeps its ``export_format`` (a user's
        ``DynamoConfig`` subclass is fine for dynamo; a plugin's ``DynamoConfig`` subclass that
        names another format is not). An exporter that keeps the base
        ``ExportConfigMixin`` as its ``config_class`` takes any config naming its ``export_format``."""
        if type(config) is cls.config_class:
            return True
        if not isinstance(config, cls.config_class):
            return False
        own = getattr(cls.config_class, "FORMAT", None)
        own = getattr(own, "value", own)
        if not own:
            field = getattr(cls.config_class, "__dataclass_fields__", {}).get("export_format")
            own = getattr(field, "default", None)
        if not own:  # a config_class that names no format (the base mixin): the exporter's format
            own = cls.export_format
        return bool(own) and str(getattr(config, "export_format", "")) == str(own)

    def check_precision(self, config: Any) -> None:
        """Refuse a ``dtype`` or quantization method this backend cannot produce, before capture.

        Backends with more conditions (an ONNX Runtime build without fp16 kernels, a fusion target
        the installed runtime does not ship) extend this and call ``super()``.

        ``config.dtype=None`` (auto) always passes: :meth:`decide_dtype` picks a native dtype.

        Raises:
            ValueError: ``config.dtype`` not in :attr:`supported_dtypes`,
                ``config.quantization.method`` not in :attr:`quantization_methods`, a quantization
                option the method does not read (:meth:`hfexport.config.QuantizationConfig.check_options`),
                or ``config.quality_gates`` naming an unknown metric; the message names what is allowed.
        """
        dtype = getattr(config, "dtype", None)
        if dtype is not None and dtype not in self.supported_dtypes:
            raise ValueError(
                f"dtype={dtype!r} is not supported by the {self.export_format} backend here; "
                f"allowed: {', '.join(self.supported_dtypes)}"
            )
        quantization = getattr(config, "quantization", None)
        from hfexport.verify.gates import quality_gates_for

        quality_gates_for(config)  # unknown gate names are refused before capture
        if quantization is not None and quantization.method not in self.quantization_methods:
            allowed = ", ".join(self.quantization_methods) or "none (this backend does not quantize)"
            raise ValueError(
                f"quantization method {quantization.method!r} is not one of the {self.export_format} "
                f"backend's; allowed: {allowed}"
            )
        if quantization is not None:
            quantization.check_options(self.quantization_methods, self.export_format)

    # -- the export --------------------------------------------------------------------------------
    def decide_dtype(self, model: torch.nn.Module | torch.dtype | str, config: Any) -> Any:
        """The dtype an export of ``model`` with ``config`` computes in, and its reference.

        ``config.dtype=None`` (auto) keeps the model's dtype when it is one of :attr:`native_dtypes`
        and takes ``native_dtypes[0]`` otherwise; an explicit ``config.dtype`` is used as given (the
        backend refused it before, in :meth:`check_precision`, if it cannot run it). See
        :func:`hfexport.precision.decide_dtype`.

        Args:
            model: the model (the dtype of most of its floating point weights counts) or a
                checkpoint's dtype (the CLI decides before loading, so it loads in the export dtype).
            config: the export's config.

        Returns:
            A :class:`hfexport.precision.DtypeDecision` (``export``, ``model``, ``reference``,
            ``reason``); the report records it as ``ExportReport.dtype``.
        """
        from hfexport.precision import decide_dtype

        requested = getattr(config, "dtype", None)
        return decide_dtype(model, requested, self.native_dtypes, self.runtime_name)

    def estimate_peak_bytes(self, parameters: int, dtype: str) -> int:
        """Estimated peak resident memory of an export of a model of ``parameters`` parameters in
        ``dtype``: :attr:`memory_base_bytes` + :attr:`memory_factor` x the weight bytes.

        Args:
            parameters: number of weight elements (the checkpoint's, e.g. from its safetensors headers).
            dtype: the export dtype (``"float32"`` ...).

        Returns:
            Bytes.
        """
        from hfexport.precision import torch_dtype

        weight_bytes = parameters * torch_dtype(dtype).itemsize
        return int(self.memory_base_bytes + self.memory_factor * weight_bytes)

    def check_memory(self, parameters: int, decision: Any, available: int | None) -> None:
        """Refuse, before the weights are loaded, an export whose estimated peak
        (:meth:`estimate_peak_bytes`) exceeds ``available`` bytes.

        Args:
            parameters: number of weight elements of the checkpoint.
            decision: the export's :class:`hfexport.precision.DtypeDecision`.
            available: bytes the machine can give (:func:`hfexport.memory.available_bytes`); ``None``
                (unknown) passes.

        Raises:
            InsufficientMemoryError: the estimate exceeds ``available``; the message gives both, the
                weight size and the options that lower the peak.
        """
        if available is None:
            return
        from hfexport.errors import InsufficientMemoryError
        from hfexport.memory import format_bytes
        from hfexport.precision import torch_dtype

        # the weights are loaded in the reference's dtype (float32 for a float32 export), which may be
        # wider than the export's (a float16 export of a float32 checkpoint casts a copy)
        widest = max((decision.export, decision.reference), key=lambda d: torch_dtype(d).itemsize)
        estimate = self.estimate_peak_bytes(parameters, widest)
        if estimate <= available:
            return
        options = []
        smaller = [
            d
            for d in self.supported_dtypes
            if torch_dtype(d).itemsize < torch_dtype(decision.export).itemsize
        ]
        if smaller:
            options.append(f"--dtype {smaller[0]} (half the weight bytes)")
        options += [
            "--no-validate (the runtime does not load the artifact; about one copy of the weights less)",
            "closing other programs, or a machine with more memory",
            "--ignore-memory-estimate to try anyway",
        ]
        raise InsufficientMemoryError(
            f"this {self.export_format} export of {parameters / 1e9:.2f}B parameters in {decision.export} "
            f"({format_bytes(parameters * torch_dtype(decision.export).itemsize)} of weights) needs about "
            f"{format_bytes(estimate)} at its peak, and the machine has {format_bytes(available)} available; "
            f"options: {'; '.join(options)}"
        )

    def export(
        self,
        model: torch.nn.Module,
        sample_inputs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, Any] | None = None,
        *,
        component: str = "model",
        source: torch.nn.Module | None = None,
    ) -> Any:
        """Export ``model`` traced on ``sample_inputs``, validate it, and return the artifact.

        Args:
            model: a ``PreTrainedModel`` (or any ``nn.Module`` with a keyword forward), in any
                floating point dtype (a bfloat16 checkpoint exports as :meth:`decide_dtype` says).
            sample_inputs: **forward kwargs**, as ``model(**sample_inputs)`` takes them: tensors
                (``input_ids`` int64 ``[batch, seq]``, ``attention_mask``, ``pixel_values`` ...)
                and ``Cache`` objects. Output flags (``use_cache``, ``return_dict``, ...) are
                applied to the config while tracing only. Floating point inputs are cast to the
                dtype of the eager reference (the export's own dtype for the artifact).
            config: the backend's config (or a dict for ``config_class.from_dict``); defaults to the
                one given at construction, else the class defaults.
            component: name of the exported component, used in the report and errors.
            source: a transformed copy of ``model`` (same structure and forward, e.g. the quantized
                copy ``generation_support.generation_source`` built once for every generation component) to
                capture instead of ``model``; the artifact is still validated against ``model``
                (the fp32 eager reference). The same output flags and attention settings are applied
                to it for the export and undone afterwards.

        Returns:
            The backend's artifact (``ExportedProgram``, ``torch.onnx.ONNXProgram``,
            ``ExecutorchProgramManager``). ``self.last_report`` holds the :class:`ExportReport`.
            With ``config.output_path`` set, the artifact is also saved there (before validation,
            which then runs the saved file).

        Raises:
            UnsupportedInputError: loss inputs (``labels`` ...) among ``sample_inputs``.
            UnsupportedModelError: an attention implementation with no export path.
            ValueError: ``config.quality_gates`` on an export the dtype decision compares by
                tolerances (a bfloat16 program of a bfloat16 model), or a config the backend refuses.
            ExportStageError: a stage failed (the message names the stage and component).
            ExportValidationError: the artifact's outputs differ from eager PyTorch beyond
                tolerance (the message holds the per-output table).
            OutputDirectoryError: ``config.output_path`` is a folder, lies under a file, or its
                folder cannot be written (checked before any model work).

        The model is left as it was: training mode, config flags, attention implementation,
        weights (dtype included) and patched attributes are restored, also when the export fails.
        """
        output_path = getattr(self._resolve_config(config), "output_path", None)
        if output_path is not None:  # before any model work: a bad path fails now, not in save
            from hfexport.atomic import check_output_file

            check_output_file(output_path, what="output_path")
        artifact, _ = self._run_export(
            model, sample_inputs, config, component=component, source=source, path=output_path
        )
        return artifact

    def export_to_path(
        self,
        model: torch.nn.Module,
        sample_inputs: Mapping[str, Any],
        path: str | os.PathLike[str],
        config: ExportConfigMixin | Mapping[str, Any] | None = None,
        *,
        component: str = "model",
        release_model: bool = False,
    ) -> ExportReport:
        """Export ``model``, save the artifact to ``path``, and validate the saved file.

        The lowest-memory way to export (what the CLI runs): the eager reference outputs are
        computed right after capture, the artifact is saved, then every in-memory copy of it is
        dropped before the runtime loads the saved file (memory-mapped where the runtime offers
        it) for the comparison. With ``release_model=True`` the model's weights are released too
        (emptied once the references exist), so the runtime's copy of the weights is the only one
        left while validating.

        Args:
            model, sample_inputs, config, component: as for :meth:`export`.
            path: the artifact file to write (``model.onnx``, ``model.pte`` ...); files the backend
                writes beside it (external data) go to the same folder.
            release_model: free the model's weights after the references are computed. The model
                is then unusable (its tensors are empty), also when the export fails; for callers
                that loaded it for this export only.

        Returns:
            The :class:`ExportReport` (also ``self.last_report``).

        Raises:
            As :meth:`export`; :class:`hfexport.errors.OutputDirectoryError` (before any model
            work) when ``path`` is a folder, lies under a file or its folder cannot be written;
            ``OSError`` when writing fails later.
        """
        from hfexport.atomic import check_output_file

        check_output_file(path, what="path")
        _, report = self._run_export(
            model,
            sample_inputs,
            config,
            component=component,
            source=None,
            path=path,
            keep_artifact=False,
            release_model=release_model,
        )
        return report

    def _run_export(
        self,
        model: torch.nn.Module,
        sample_inputs: Mapping[str, Any],
        config: Any,
        *,
        component: str,
        source: torch.nn.Module | None,
        path: str | os.PathLike[str] | None,
        keep_artifact: bool = True,
        release_model: bool = False,
    ) -> tuple[Any, ExportReport]:
        """The stages every export runs: prepare, capture and lower (:meth:`_export`), eager
        references, save, validation; see :meth:`export` and :meth:`export_to_path`."""
        from hfexport.capture import release_shape_env_caches
        from hfexport.input_checks import check_model
        from hfexport.inputs import (
            apply_output_flags,
            attention_for_export,
            prepare_for_export,
            restore_model_state,
        )
        from hfexport.precision import model_in_dtype, torch_dtype
        from hfexport.tensors import cast_leaf_tensors, get_leaf_tensors

        config = self._resolve_config(config)
        self.check_precision(config)
        check_model(model)
        decision = self.decide_dtype(model, config)
        config = self.config_in_dtype(config, decision)
        self.last_config = config
        report = ExportReport(
            export_format=self.export_format,
            component=component,
            model_class=type(model).__name__,
            callback=self.stage_callback,
            dtype=decision.to_dict(),
        )
        self.last_report = report
        validate = bool(getattr(config, "validate", True))
        artifact: Any = None
        owner = model
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._in_use(config))
            stack.callback(release_shape_env_caches)  # also after a failure: nothing pinned
            if release_model:  # runs last: after the model's state and dtype are restored
                stack.callback(_release_weights, owner)
            # one export of a model object at a time: torch.export swaps its parameters for fakes
            stack.enter_context(_model_lock(model))
            stack.enter_context(restore_model_state(model))
            if source is not None:
                stack.enter_context(restore_model_state(source))
            with report.stage(Stage.PREPARE_INPUTS):
                if decision.upcasts:  # the reference and the capture compute in float32 (exact cast)
                    stack.enter_context(model_in_dtype(model, "float32"))
                stack.enter_context(attention_for_export(model))
                model, inputs, flags = prepare_for_export(model, sample_inputs)
                inputs = cast_leaf_tensors(inputs, torch_dtype(decision.reference))
                stack.enter_context(apply_output_flags(model, flags))
                report.output_flags = dict(flags) or None  # constant inputs of the program (capture)
                if source is not None:
                    stack.enter_context(attention_for_export(source))
                    stack.enter_context(apply_output_flags(source, flags))
                report.input_names = {
                    k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                    for k, v in get_leaf_tensors(inputs).items()
                }
            with torch.no_grad():
                artifact = self._export_in_dtype(model if source is None else source, inputs, config, report)
                sets = self.reference_outputs(model, inputs, config, report) if validate else None
                if sets is None:
                    report.skip(Stage.VALIDATE, "config.validate is False")
                run = None
                staged: Path | None = None
                if path is not None:
                    # saved into a staging folder next to ``path``, validated there, moved into place
                    # only once validation passed: a failed export leaves ``path`` as it was
                    target = Path(path)
                    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=_parent(target)))
                    stack.callback(shutil.rmtree, staging, True)
                    staged = staging / target.name
                    with report.stage(
                        Stage.SAVE, detail=target.name
                    ):  # the CLI saves into its staging folder
                        self.save(artifact, staged)
                        metadata = self.generation_support.component_metadata(artifact)
                        report.artifact_metadata = metadata
                    from hfexport.integrity import hash_in_background

                    hash_in_background(staging)  # the folder's checksums, while the artifact is validated
                    if sets is not None and not (self.validates_saved_file and self.loads_artifacts()):
                        extra = self.extra_runners(artifact, staged)  # validated in memory
                    elif sets is not None:
                        extra = self.extra_runners(artifact, staged)
                        if not keep_artifact:
                            artifact = None
                            # a model small enough for a float64 reference (at most 256 MB in float32)
                            # keeps its weights until validation is done: judge_by_float64_reference
                            # runs it again when a float32 output misses the default tolerances
                            if release_model and _parameter_count(owner) > FLOAT64_REFERENCE_MAX_PARAMETERS:
                                _release_weights(owner)
                            release_shape_env_caches()  # they pin the freed program's graphs
                            gc.collect()
                        with report.stage(Stage.LOAD_ARTIFACT, detail=target.name):
                            from hfexport.integrity import mark_written

                            mark_written(staging)  # its checksums are written after validation
                            run = self.generation_support.load_component(staged, metadata)
                elif sets is not None:
                    extra = self.extra_runners(artifact, None)
                if sets is not None:
                    self.compare(sets, model, config, report, runner=run, artifact=artifact, extra=extra)
                if staged is not None:
                    _publish(staged.parent, Path(path))
        return artifact, report

    def loads_artifacts(self) -> bool:
        """Whether this backend reads its saved artifacts back (:meth:`load` overridden, or
        ``load_component`` of its :attr:`generation_support`): then an export with a path validates
        the saved file (when :attr:`validates_saved_file`); otherwise the in-memory artifact is
        validated (and kept until then)."""
        from hfexport.generation.support import GenerationSupport

        loader = type(self.generation_support).load_component
        return type(self).load is not HfExporter.load or loader is not GenerationSupport.load_component

    @functools.cached_property
    def generation_support(self) -> GenerationSupport:
        """The backend's generation hooks: an instance of :attr:`generation_support_class` bound
        to this exporter (built on first use, then kept).

        Used by ``export_for_generation`` (``prepare_component``, ``component_config``,
        ``generation_source``, ``supports_empty_growing_cache``), ``save_components`` and export
        folders (``component_filename``, ``component_metadata``), and every loader
        (``load_component``, ``generation_runner``); see
        :class:`hfexport.generation.support.GenerationSupport`.
        """
        from hfexport.generation.support import GenerationSupport

        cls = type(self).generation_support_class or GenerationSupport
        return cls(self)

    @contextlib.contextmanager
    def _in_use(self, config: Any) -> Any:
        previous = self.active_config
        self.active_config = config
        try:
            yield
        finally:
            self.active_config = previous

    @staticmethod
    def config_in_dtype(config: Any, decision: Any) -> Any:
        """``config`` with ``dtype`` set to the decision's export dtype (auto resolved), after the
        check that quality gates given apply (a gated export is one whose dtype differs from its
        reference, or a quantized one)."""
        if getattr(config, "quality_gates", None) and not (
            decision.gated or getattr(config, "quantization", None) is not None
        ):
            raise ValueError(
                f"quality_gates={config.quality_gates!r} cannot apply: this export computes in {decision.export} "
                f"like its eager reference ({decision.reference}), so it is compared by tolerances (atol/rtol), "
                "not gated; allowed: quality_gates=None, or a dtype other than the model's, or a quantization"
            )
        if "dtype" in getattr(config, "__dataclass_fields__", {}) and config.dtype != decision.export:
            return config.replace(dtype=decision.export)
        return config

    def _export_in_dtype(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: Any, report: ExportReport
    ) -> Any:
        """Run :meth:`_export` with the model and its float inputs cast to ``config.dtype`` (the
        shared capture path of every backend) when the model computes in another dtype; the model's
        own weights are back when it returns or raises (:func:`hfexport.precision.model_in_dtype`),
        so validation compares with the reference."""
        from hfexport.precision import dtype_name, model_dtype, model_in_dtype, torch_dtype
        from hfexport.tensors import cast_leaf_tensors

        dtype = str((report.dtype or {}).get("export") or getattr(config, "dtype", None) or "float32")
        if dtype_name(model_dtype(model)) == dtype:
            return self._export(model, cast_leaf_tensors(inputs, torch_dtype(dtype)), config, report)
        with model_in_dtype(model, dtype):
            return self._export(model, cast_leaf_tensors(inputs, torch_dtype(dtype)), config, report)

    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: Any, report: ExportReport
    ) -> Any:
        """Backend stages: capture, fixes, lowering. Each inside ``report.stage(name)``.

        Args:
            model: the prepared model (output flags applied, in the export dtype).
            inputs: the prepared forward kwargs, cast to the export dtype.
            config: the resolved config (dtype decided).
            report: the export's report; record each stage in it.

        Returns:
            The backend's artifact.

        Raises:
            NotImplementedError: the backend implements only :meth:`export` (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} ({self.export_format!r}) implements only export(); the core's pipeline "
            "(export_to_path, the CLI, generation components) needs its hooks _export, runner and save"
        )

    # -- the shared capture step -------------------------------------------------------------------
    @contextlib.contextmanager
    def captured_program(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        config: Any,
        report: ExportReport,
        *,
        registry_key: str | None = None,
    ) -> Iterator[CaptureSession]:
        """The capture every backend shares, as a context manager: installs the backend's patches,
        captures, fixes, and yields the session (``session.program`` is the ``ExportedProgram``)
        with the patches still installed; they are restored when the block exits, also on error.

        Stages, in order (each a stage of ``report``; a hook a backend overrides in brackets):

        1. [:meth:`prepare_capture`]: the backend's own work before the patches (none by default);
        2. ``patches``: ``apply_patches(session.registry_key)`` [:meth:`record_patches` records them];
        3. ``quantize`` (a source method's ``stage``): the ``source`` phase of the declared
           quantization method (its ``apply``, or its ``prepare`` for a later phase) on the eager
           module; the copy it returns is captured. A generation component of a copy
           :meth:`generation_source` quantized once is recognised and not quantized again.
           ``report.quantization`` gets the facts;
        4. [:meth:`before_capture`]: the backend's work on the inputs/model before capture;
        5. ``capture`` [:meth:`capture_program`]: :func:`hfexport.capture.capture`, its steps as
           ``capture.<step>`` stages when :attr:`records_capture_steps`;
        6. the method's ``stage`` (``quantize`` by default): the ``program`` phase on the captured
           program;
        7. ``fx_program_fixes`` [:meth:`fix_program`], then [:meth:`between_fixes`] (OpenVINO's
           ``decompose``), then ``fx_node_fixes`` [:meth:`fix_nodes`].

        Args:
            model: the prepared model (as :meth:`_export` gets it).
            inputs: the prepared forward kwargs.
            config: the export's resolved config.
            report: the export's report.
            registry_key: the patches/fixes key (default :attr:`registry_key`, else
                :attr:`export_format`).

        Yields:
            The :class:`CaptureSession` (an instance of :attr:`capture_session_class`).

        Raises:
            ExportStageError: a stage failed (the report names it); whatever a hook raises.
        """
        from hfexport.registry import apply_patches

        key = registry_key or self.registry_key or self.export_format
        with contextlib.ExitStack() as stack:
            session = self.capture_session_class(
                model=model,
                inputs=dict(inputs),
                config=config,
                report=report,
                registry_key=key,
                original=model,
                stack=stack,
                method=self.quantization_spec(config),
            )
            self.prepare_capture(session)
            with report.stage(Stage.PATCHES, detail=session.registry_key) as record:
                session.patches = list(stack.enter_context(apply_patches(session.registry_key)))
                self.record_patches(session, record)
            source_function = session.method.source_function() if session.method is not None else None
            if source_function is not None:  # a source method's own stage; a later one's prepare: quantize
                stage = session.method.stage if session.method.phase == "source" else "quantize"
                with report.stage(stage, detail=config.quantization.method) as record:
                    self._quantize_source(session, source_function, record)
            self.before_capture(session)
            with report.stage(Stage.CAPTURE):
                session.program = self.capture_program(session, session.model)
            if session.method is not None and session.method.phase == "program":
                with report.stage(session.method.stage, detail=config.quantization.method) as record:
                    result = session.method.resolve_apply()(
                        self._quantization_request(
                            session,
                            session.program,
                            "program",
                            capture=lambda module: self.capture_program(session, module),
                        )
                    )
                    session.program = result.target
                    self._record_quantization(
                        report,
                        config.quantization.method,
                        result,
                        record,
                        session.method.stage,
                        replace=False,
                    )
            with report.stage(Stage.FX_PROGRAM_FIXES) as record:
                applied = self.fix_program(session)
                report.record_applied(Stage.FX_PROGRAM_FIXES, applied)
                record.detail = f"{len(applied)} applied"
            self.between_fixes(session)
            with report.stage(Stage.FX_NODE_FIXES) as record:
                applied = self.fix_nodes(session)
                report.record_applied(Stage.FX_NODE_FIXES, applied)
                record.detail = f"{len(applied)} applied"
            yield session

    def prepare_capture(self, session: CaptureSession) -> None:
        """Hook of :meth:`captured_program`, before the patches: the backend's own preparation
        (ExecuTorch: its backend plan, which picks ``session.registry_key``). Default: nothing."""

    def record_patches(self, session: CaptureSession, record: Any) -> None:
        """Hook of :meth:`captured_program`, inside the ``patches`` stage: record the installed
        ``session.patches``. Default: every name under ``report.applied["patches"]``, grouped by
        registry key in ``record.data``, the count as the detail. ONNX splits them into torch-side
        ``patches`` and a stage ``onnx_patches`` of its own."""
        names = [entry.name for entry in session.patches]
        session.report.record_applied(Stage.PATCHES, names)
        for entry in session.patches:  # by key: a parent key ("executorch") first, then its scope
            record.data.setdefault(entry.backend, []).append(entry.name)
        record.detail = f"{session.registry_key}: {len(names)} installed"

    def before_capture(self, session: CaptureSession) -> None:
        """Hook of :meth:`captured_program`, after the patches and the ``source`` quantization,
        before ``capture``: the backend's work on ``session.inputs`` / ``session.model``
        (ExecuTorch: the ``dynamic_shapes`` stage). Default: nothing."""

    def capture_program(self, session: CaptureSession, module: torch.nn.Module) -> Any:
        """Hook of :meth:`captured_program`: capture ``module`` (``session.model``, or a module a
        ``program``-phase quantization re-captures) with ``session.inputs`` and ``session.config``.

        Default: :func:`hfexport.capture.capture`, with its steps as stages when
        :attr:`records_capture_steps`.

        Returns:
            The ``ExportedProgram``.
        """
        from hfexport.capture import capture

        return capture(
            module, session.inputs, session.config, session.report, record_stages=self.records_capture_steps
        )

    def fix_program(self, session: CaptureSession) -> list[str]:
        """Hook of :meth:`captured_program`, inside ``fx_program_fixes``: apply the active
        ``register_fx_program_fix(session.registry_key)`` entries to ``session.program``.

        Returns:
            The names of the fixes applied.
        """
        from hfexport.registry import apply_fx_program_fixes

        return apply_fx_program_fixes(session.registry_key, session.program)

    def between_fixes(self, session: CaptureSession) -> None:
        """Hook of :meth:`captured_program`, between ``fx_program_fixes`` and ``fx_node_fixes``
        (OpenVINO: its ``decompose`` stage, which may replace ``session.program``). Default: nothing."""

    def fix_nodes(self, session: CaptureSession) -> list[str]:
        """Hook of :meth:`captured_program`, inside ``fx_node_fixes``: apply the active
        ``register_fx_node_fix(session.registry_key)`` entries to ``session.program``'s graph.

        Returns:
            The names of the fixes applied.
        """
        from hfexport.registry import apply_fx_node_fixes

        return apply_fx_node_fixes(session.registry_key, session.program.graph_module)

    # -- quantization phases -----------------------------------------------------------------------
    def quantization_spec(self, config: Any) -> QuantizationMethod | None:
        """The declared :class:`hfexport.config.QuantizationMethod` of ``config.quantization``
        (from :attr:`quantization_methods`), ``None`` without quantization or when the backend
        declared the method by a plain description (it then applies it itself)."""
        quantization = getattr(config, "quantization", None)
        if quantization is None:
            return None
        method = self.quantization_methods.get(quantization.method)
        return method if isinstance(method, QuantizationMethod) else None

    def quantize_artifact(
        self,
        artifact: Any,
        config: Any,
        report: ExportReport,
        *,
        inputs: Mapping[str, Any] | None = None,
        calibration: Any = None,
    ) -> Any:
        """The ``artifact`` phase: the call a backend makes where its lowered artifact is ready to
        quantize (ONNX: after the ORT fusions, before the external-data plan).

        Runs the declared method's ``apply`` in its stage (``quantize``) when its phase is
        ``artifact``; otherwise returns ``artifact`` unchanged and records nothing.

        Args:
            artifact: what the backend's artifact-phase functions take (ONNX: the ``onnx_ir.Model``).
            config: the export's config.
            report: the export's report: ``report.quantization`` gets the facts,
                ``report.applied["quantize"]`` the method name.
            inputs: the sample forward kwargs, passed on in the request.
            calibration: calibration batches, passed on in the request.

        Returns:
            The quantized artifact (the function's ``result.target``), or ``artifact``.
        """
        method = self.quantization_spec(config)
        if method is None or method.phase != "artifact":
            return artifact
        from hfexport.quantization import QuantizationRequest

        with report.stage(method.stage, detail=config.quantization.method) as record:
            request = QuantizationRequest(
                artifact,
                config.quantization,
                "artifact",
                inputs=dict(inputs or {}),
                report=report,
                calibration=calibration,
            )
            result = method.resolve_apply()(request)
            self._record_quantization(
                report, config.quantization.method, result, record, method.stage, replace=True
            )
        return result.target

    def _quantization_request(
        self, session: CaptureSession, target: Any, phase: str, *, capture: Callable[[Any], Any] | None = None
    ) -> Any:
        from hfexport.quantization import QuantizationRequest

        return QuantizationRequest(
            target,
            session.config.quantization,
            phase,
            inputs=session.inputs,
            report=session.report,
            capture=capture,
        )

    def _quantize_source(self, session: CaptureSession, function: Callable[[Any], Any], record: Any) -> None:
        """Stage ``quantize`` of :meth:`captured_program`: the source phase, or the facts of the copy
        :meth:`generation_source` quantized once when ``session.model`` is part of it."""
        from hfexport.generation.parts import transformed_source_of
        from hfexport.linear_forms import weight_bytes

        method = session.config.quantization.method
        shared = transformed_source_of(session.model)
        if shared is not None:  # a generation component of the copy quantized once for all
            facts, original = shared
            session.report.quantization = {
                **facts,
                "weight_bytes_before": (
                    weight_bytes(original) if original is not None else facts.get("weight_bytes_before")
                ),
            }
            record.detail = f"{method}: quantized once for every generation component"
            return
        before = weight_bytes(session.model)
        result = function(self._quantization_request(session, session.model, "source"))
        session.model = result.target
        session.report.quantization = {"method": method, "weight_bytes_before": before, **result.facts}
        session.report.record_applied("quantize", [method])
        if result.detail:
            record.detail = result.detail

    @staticmethod
    def _record_quantization(
        report: ExportReport, method: str, result: Any, record: Any, stage: str, *, replace: bool
    ) -> None:
        """Facts of a ``program`` / ``artifact`` phase into ``report.quantization`` (replacing them,
        or added to the source phase's), the method under ``report.applied[stage]``."""
        if replace or not report.quantization:
            report.quantization = {"method": method, **result.facts}
        else:
            report.quantization.update(result.facts)
        report.record_applied(stage, [method])
        if result.detail:
            record.detail = result.detail

    def runner(self, artifact: Any) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """Return a callable running ``artifact`` on forward kwargs -> ``{output_name: tensor}``.

        Output names are the eager output's leaf paths (``logits``, ``last_hidden_state``,
        ``past_key_values.layers.0.keys``), as :func:`hfexport.tensors.get_leaf_tensors` gives.

        Raises:
            NotImplementedError: the backend cannot run its artifacts (the default; it is then
                not validated).
        """
        raise NotImplementedError(
            f"{type(self).__name__} ({self.export_format!r}) cannot run its artifacts: it does not "
            "implement HfExporter.runner"
        )

    def save(self, artifact: Any, path: str | os.PathLike[str]) -> None:
        """Write ``artifact`` to ``path`` atomically (no half-written file on failure).

        Raises:
            NotImplementedError: the backend cannot save its artifacts (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} ({self.export_format!r}) cannot save its artifacts: it does not "
            "implement HfExporter.save"
        )

    def load(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
        """Read an artifact written by :meth:`save` (the backend's own loader).

        Args:
            path: the artifact file (``model.pt2``, ``decode.onnx`` ...).
            trust_remote_code: allow content that can run code when loaded (pickles that are not
                weights-only ...). Loaders must refuse such content when it is False.

        Returns:
            The backend's artifact, as :meth:`runner` takes it.

        Raises:
            NotImplementedError: the backend cannot read its artifacts back (the default).
            FileNotFoundError: no file at ``path``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} ({self.export_format!r}) cannot load saved artifacts; "
            "its backend does not implement HfExporter.load"
        )

    # -- generation hooks: deprecated names (moved to GenerationSupport) -------------------------
    def prepare_component(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> torch.nn.Module:
        """Deprecated: ``generation_support.prepare_component`` (removed in the next release)."""
        _deprecated(self, "prepare_component")
        return self.generation_support.prepare_component(name, module, kwargs, plan)

    def component_config(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any, config: Any
    ) -> Any:
        """Deprecated: ``generation_support.component_config`` (removed in the next release)."""
        _deprecated(self, "component_config")
        return self.generation_support.component_config(name, module, kwargs, plan, config)

    def component_metadata(self, artifact: Any) -> dict[str, Any]:
        """Deprecated: ``generation_support.component_metadata`` (removed in the next release)."""
        _deprecated(self, "component_metadata")
        return self.generation_support.component_metadata(artifact)

    def component_filename(self, name: str) -> str:
        """Deprecated: ``generation_support.component_filename`` (removed in the next release)."""
        _deprecated(self, "component_filename")
        return self.generation_support.component_filename(name)

    def generation_runner(self, plan: Any, callers: Mapping[str, Any], **runner_kwargs: Any) -> Any:
        """Deprecated: ``generation_support.generation_runner`` (removed in the next release)."""
        _deprecated(self, "generation_runner")
        return self.generation_support.generation_runner(plan, callers, **runner_kwargs)

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """Deprecated: ``generation_support.load_component`` (removed in the next release)."""
        _deprecated(self, "load_component")
        return self.generation_support.load_component(path, metadata)

    def generation_source(self, model: torch.nn.Module, config: Any) -> torch.nn.Module | None:
        """Deprecated: ``generation_support.generation_source`` (removed in the next release)."""
        _deprecated(self, "generation_source")
        return self.generation_support.generation_source(model, config)

    @property
    def supports_empty_growing_cache(self) -> bool:
        """Deprecated: ``generation_support.supports_empty_growing_cache`` (removed in the next release)."""
        _deprecated(self, "supports_empty_growing_cache")
        return self.generation_support.supports_empty_growing_cache

    def export_for_generation(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, Any] | None = None,
        *,
        generation_config: Any = None,
        multi_token_decode: bool = False,
        components: Any = None,
    ) -> dict[str, Any]:
        """Export the components a greedy generation loop runs, each validated against eager PyTorch.

        The components are found by :func:`hfexport.generation.decompose_for_generation` from one
        short real ``model.generate()`` call: ``prefill`` / ``decode`` (decoder-only),
        ``encoder`` / ``prefill`` / ``decode`` (encoder-decoder), or ``image_encoder`` /
        ``audio_encoder`` / ``multi_modal_projector`` / ``embed_tokens`` / ``language_model`` /
        ``lm_head`` / ``decode`` (multimodal). Each is exported with :meth:`export`
        (``component=name``).

        Args:
            model: a generative ``PreTrainedModel``.
            inputs: **generate-style** inputs: ``input_ids`` int64 ``[batch, seq]``,
                ``attention_mask`` ``[batch, seq]``, and for multimodal models the processor's
                outputs (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` ...).
            config: one config for every component, or ``{component: config}`` with one entry per
                component.
            generation_config: optional ``GenerationConfig`` (copied, never mutated);
                ``cache_implementation="static"`` with ``max_cache_len`` exports graphs that take a
                preallocated cache and update it in place.
            multi_token_decode: capture the decode step with two new tokens, so a ``dynamic=True``
                decode graph takes any query length (1-token decode, multi-token continuation,
                prefill on an empty static cache); it is then also validated at lengths 1 and 4.
            components: export only these component names (default: all); e.g. ``["decode"]``
                for a static-cache multi-token decode graph, which then also serves the prefill.

        Returns:
            ``{component_name: artifact}`` (a ``GenerationArtifacts`` dict carrying ``.plan`` and
            ``.reports``; give it to :func:`hfexport.generation.save_components`).

        Raises:
            ValueError: bad inputs; a per-component config with missing entries (lists the missing
                and the expected names); a static cache without ``max_cache_len``.
            RuntimeError: ``generate`` failed, or a component failed to export (the message names
                the component, the submodel class and the input keys).

        A ``config.quantization`` that transforms the weights before capture is applied once:
        ``generation_support.generation_source`` builds one transformed copy that every component is captured
        from (``model`` is never modified). A reduced-precision or quantized export is gated per
        component against the fp32 eager model (top-1 agreement of the logits, cosine; KV-cache
        outputs at :data:`hfexport.quality.CACHE_COSINE_GATE`), and a greedy generation over the
        exported components is compared with ``model.generate`` (``reports["decode"].extra
        ["greedy_parity"]``: matching new tokens, first divergence; reported, not gated).

        The model is left as it was, also when an export fails.
        """
        from hfexport.generation.export import export_components

        return export_components(
            self,
            model,
            inputs,
            config,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            components=components,
        )

    # -- validation --------------------------------------------------------------------------------
    def default_tolerances(self, model: torch.nn.Module) -> tuple[float | None, float | None]:
        """Backend default ``(atol, rtol)``; ``None`` takes the dtype default of the core."""
        return None, None

    def second_shape_inputs(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], config: Any, report: ExportReport
    ) -> tuple[dict[str, Any] | None, str]:
        """The second input set a dynamic export is validated at, or ``(None, reason)``.

        The default derives it with :func:`hfexport.validation.derive_second_inputs` (another batch
        size, a longer sequence; image sides the captured program holds static keep their size).
        A backend whose programs accept a narrower range (ExecuTorch's planned bounds) overrides it.

        Args:
            model: the eager reference model.
            inputs: the prepared sample forward kwargs (in the reference dtype).
            config: the export's config.
            report: the export report (``report.dynamic_axes`` from the capture).

        Returns:
            ``(forward kwargs, "")`` or ``(None, why no second shape can be derived)``.
        """
        from hfexport.verify.second_shape import derive_second_inputs

        return derive_second_inputs(model, inputs, config=config, program_axes=report.dynamic_axes)

    def reference_outputs(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        config: Any,
        report: ExportReport,
        *,
        second_inputs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Stage ``reference``: the input sets validation runs and the eager model's outputs on each.

        Computed once, before the runtime loads the artifact, so the eager model's activations and
        the runtime's never coexist (and a caller may free the model's weights afterwards); the
        memory the eager runs freed is handed back to the OS
        (:func:`hfexport.memory.release_freed_memory`). The sets
        are the sample inputs and, for a dynamic export with ``config.validate_second_shape``, the
        second shape (``second_inputs`` or :meth:`second_shape_inputs`); a second shape that cannot
        be derived records stage ``validate_second_shape`` as skipped with the reason.

        Returns:
            :class:`hfexport.validation.ValidationSet` objects (label, stage, inputs, expected
            outputs ``{leaf path: tensor}``), sample first.
        """
        from hfexport.verify.compare import ValidationSet, eager_outputs
        from hfexport.verify.second_shape import describe_second_shape

        sets = [ValidationSet("sample", Stage.VALIDATE, dict(inputs), detail="sample inputs")]
        if getattr(config, "is_dynamic", False) and getattr(config, "validate_second_shape", True):
            if second_inputs is None:
                second_inputs, reason = self.second_shape_inputs(model, inputs, config, report)
            if second_inputs is None:
                report.skip(Stage.VALIDATE_SECOND_SHAPE, reason)
            else:
                described = describe_second_shape(inputs, second_inputs)
                report.second_shape = described
                sets.append(
                    ValidationSet(
                        "second shape",
                        Stage.VALIDATE_SECOND_SHAPE,
                        dict(second_inputs),
                        detail=described["summary"],
                    )
                )
        with report.stage(Stage.REFERENCE, detail=", ".join(s.label for s in sets)):
            for item in sets:
                item.expected = eager_outputs(model, item.inputs)
            sets[0].text = self.text_reference(model, inputs, config, report)
            from hfexport.memory import release_freed_memory

            release_freed_memory()  # the eager activations, before the runtime loads the artifact
        return sets

    def text_reference(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        config: Any,
        report: ExportReport,
        *,
        plan: Any = None,
        source: Any = None,
    ) -> Any:
        """The eager side of the language-model text metrics (:func:`hfexport.quality.text_quality`)
        for a quantized causal LM (or an export whose ``quality_gates`` name a text metric), or
        ``None`` when they do not apply.

        The quality text (:func:`hfexport.quality.quality_text`) is tokenized with the tokenizer
        saved next to the model (UTF-8 bytes when there is none), cut into prefill chunks that the
        program accepts (:func:`hfexport.quality.plain_text_inputs`: the model's position limit, a
        dynamic sequence axis's bound, a static axis's sample size) and run through the eager model.
        ``report.extra["text_quality"]`` records why the metrics were skipped for a causal LM whose
        inputs are not a plain prefill, or whose tokenizer maps more than
        :data:`hfexport.quality.UNKNOWN_TOKEN_FRACTION` of the text to its unknown token
        (:func:`hfexport.quality.text_coverage_problem`; then only the text gates named in
        ``config.quality_gates`` apply, and without any the metrics are skipped).
        Gates not named in ``config.quality_gates`` (the defaults) are applied only when the eager
        model is not at chance on the text (:data:`hfexport.quality.CHANCE_PERPLEXITY_FRACTION`).
        When ``top1_agreement_text`` is gated and ``config.quality_gates`` does not name
        ``top1_agreement``, the per-output ``top1_agreement`` of this export is recorded but not
        gated (``report.top1_gated_on_text``): top-1 over a few sample positions (6 random
        ids for a decoder graph) flips by noise on a real LM's near-ties. A model may feed the text
        itself through the attributes ``hfexport_text_plan`` (as ``plan``) and
        ``hfexport_text_source`` (as ``source``).

        Args:
            model: the eager reference model (float32).
            inputs: the sample forward kwargs.
            config: the export's config.
            report: the export report (``report.dynamic_axes`` bounds the chunks).
            plan: ``(make_inputs, chunking)`` as :func:`hfexport.quality.plain_text_inputs` returns,
                for inputs that are not a plain prefill (a decoder graph with an empty past);
                ``None`` derives it from ``inputs``.
            source: the ``PreTrainedModel`` whose tokenizer folder and vocabulary apply when
                ``model`` is a wrapper around it (``None``: ``model``).

        Returns:
            A :class:`hfexport.quality.TextReference` or ``None``.

        Raises:
            ValueError: the tokenizer gives ids outside the model's vocabulary.
        """
        from hfexport.precision import dtype_name, model_dtype
        from hfexport.verify.gates import text_default_gates, text_gates_for
        from hfexport.verify.text import (
            is_causal_lm,
            model_tokenizer,
            plain_text_inputs,
            text_chunks,
            text_coverage_problem,
            text_gates_in_force,
            text_reference,
            text_token_ids,
        )

        gates = text_gates_for(config, reference=dtype_name(model_dtype(model)))
        if gates is None:
            return None
        if plan is None:  # a wrapper that feeds the text itself (the ONNX decoder graph)
            plan = getattr(model, "hfexport_text_plan", None)
            source = getattr(model, "hfexport_text_source", None) if source is None else source
        if plan is None:
            plan = plain_text_inputs(model, inputs, report.dynamic_axes)
        if isinstance(plan, str):
            if is_causal_lm(model):
                report.extra["text_quality"] = {"skipped": plan}
            return None
        make_inputs, chunking = plan
        source = model if source is None else source
        text_config = getattr(source, "config", None)
        if text_config is not None and hasattr(text_config, "get_text_config"):
            text_config = text_config.get_text_config()
        tokenizer_object = model_tokenizer(source)
        ids, tokenizer = text_token_ids(tokenizer_object, getattr(text_config, "vocab_size", None))
        problem = text_coverage_problem(tokenizer_object, ids)
        if problem is not None:  # out-of-domain text: only the gates the user named apply
            defaults = set(text_default_gates(config, gates))
            gates = {k: v for k, v in gates.items() if k not in defaults}
            if not gates:
                report.extra["text_quality"] = {"skipped": problem}
                return None
        chunks = text_chunks(ids, **chunking)
        report.text_quality_gates = dict(gates)
        reference = text_reference(
            model,
            make_inputs,
            chunks,
            gates=gates,
            tokenizer=tokenizer,
            default_gates=text_default_gates(config, gates),
            artifact_dtype=str(getattr(config, "dtype", None) or "float32"),
            spill=True,  # the eager logits wait in a temporary file, read back block by block
        )
        named = set(getattr(config, "quality_gates", None) or {})
        if "top1_agreement" not in named and "top1_agreement_text" in text_gates_in_force(reference):
            # top-1 over every position of the text replaces top-1 over the few sample positions,
            # where near-ties of a real LM on random ids flip by noise (hfexport.quality)
            report.top1_gated_on_text = True
        return reference

    def check_text(
        self,
        run: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]],
        reference: Any,
        report: ExportReport,
    ) -> dict[str, Any]:
        """Run the artifact on the text chunks of ``reference`` (:meth:`text_reference`) and score it
        (:func:`hfexport.quality.validate_text`); records the result in ``report.validation["text"]``.

        Returns:
            The :class:`hfexport.quality.TextQuality` as a dict (``kind = "text_quality"``).

        Raises:
            ExportValidationError: a text gate is missed (metric, value, gate and margin named).
        """
        from hfexport.inputs.flags import with_output_flags
        from hfexport.verify.text import validate_text

        result = validate_text(reference, with_output_flags(run, report.output_flags), raise_on_failure=False)
        row = result.to_dict()
        report.validation["text"] = [row]
        if not result.ok:
            from hfexport.errors import ExportValidationError
            from hfexport.verify.text import format_text_quality, text_gate_message

            raise ExportValidationError(text_gate_message(result, format_text_quality(result)), [result])
        return row

    def extra_runners(
        self, artifact: Any, path: str | os.PathLike[str] | None
    ) -> list[tuple[str, str, Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]]]:
        """More runners validated on the same input sets as the artifact (default: none).

        Dynamo returns its AOTInductor package here. Called after the save (``path`` the saved
        artifact, whose sibling files the runner may read) or, without a save, with ``path=None``.

        Returns:
            ``[(stage name, label prefix, runner)]``; each is validated in its own stage (declared
            in :attr:`stages`) and its rows go to ``report.validation[f"{prefix}_{label}"]``.
        """
        return []

    def compare(
        self,
        sets: list[Any],
        model: torch.nn.Module,
        config: Any,
        report: ExportReport,
        *,
        runner: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]] | None = None,
        artifact: Any = None,
        extra: list[tuple[str, str, Any]] = (),
    ) -> None:
        """Stages ``validate`` / ``validate_second_shape``: run the artifact on each set of
        :meth:`reference_outputs` and compare with its expected outputs (:meth:`check_outputs`).

        Args:
            sets: from :meth:`reference_outputs`.
            model: the eager reference (its dtype decides quality gates vs tolerances; it is not run).
            config, report: the export's.
            runner: the artifact's runner (loaded from the saved file); ``None`` builds
                ``self.runner(artifact)`` inside stage ``validate`` (a runtime that refuses the
                artifact fails there).
            artifact: the in-memory artifact, when ``runner`` is ``None``.
            extra: from :meth:`extra_runners`.

        Raises:
            ExportValidationError: an output differs beyond tolerance or misses a quality gate.
        """
        run = runner
        for item in sets:
            with report.stage(item.stage, detail=item.detail):
                if run is None:
                    run = self.runner(artifact)
                report.validation[item.key] = self.check_outputs(
                    model, run, item.inputs, config, report=report, label=item.label, expected=item.expected
                )
                if item.text is not None:
                    self.check_text(run, item.text, report)
        for stage, prefix, extra_run in extra:
            with report.stage(stage):
                for item in sets:
                    report.validation[f"{prefix}_{item.key}"] = self.check_outputs(
                        model,
                        extra_run,
                        item.inputs,
                        config,
                        report=report,
                        label=f"{prefix} {item.label}",
                        expected=item.expected,
                    )

    def validate(
        self,
        artifact: Any,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        config: Any,
        report: ExportReport,
        *,
        second_inputs: Mapping[str, Any] | None = None,
    ) -> None:
        """Compare the artifact with eager PyTorch at the sample shape and, for dynamic exports, a
        second shape (another batch size, a longer sequence; see :meth:`second_shape_inputs`):
        :meth:`reference_outputs`, then :meth:`compare` on the in-memory artifact.

        An export whose artifact computes in another dtype than its eager reference (a float16
        export of a float32 model, a bfloat16 one of a float32 model) or a quantized one is scored
        with the quality gates of :func:`hfexport.quality.quality_gates_for` (cosine, top-1
        agreement; the artifact gets its float inputs in ``config.dtype``) instead of allclose;
        ``report.validation`` then holds :class:`hfexport.quality.OutputQuality` rows and
        ``report.quality_gates`` the gates. The derived second shape of such an export
        reuses the sample's real tokens (a quarter shorter, batch + 1) instead of random ids, so the
        gates score inputs like the sample.

        Inputs holding a KV cache (the ``prefill`` and ``decode`` components of
        :meth:`export_for_generation`) get a second shape too: a prefill another batch and prompt
        length on its empty cache, a decode step another past length (and batch, when the program
        keeps it dynamic) with cache, mask and positions to match; a static cache keeps its shape
        and moves its write position. ``report.second_shape``
        (:func:`hfexport.validation.describe_second_shape`) records the shapes used and which axes
        and values changed; its ``summary`` is also the detail of the ``validate_second_shape``
        stage. When no second shape can be derived, that stage is recorded as skipped with the reason.

        Raises:
            ExportValidationError: an output differs beyond tolerance, or misses a quality gate
                (the message names the metric, its value and the threshold).
        """
        sets = self.reference_outputs(model, inputs, config, report, second_inputs=second_inputs)
        self.compare(sets, model, config, report, artifact=artifact, extra=self.extra_runners(artifact, None))

    def check_outputs(
        self,
        model: torch.nn.Module,
        run: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]],
        inputs: Mapping[str, Any],
        config: Any,
        *,
        report: ExportReport | None = None,
        label: str = "sample",
        expected: Mapping[str, torch.Tensor] | None = None,
    ) -> list[dict[str, Any]]:
        """Compare one run of an artifact with the eager ``model`` on ``inputs``, as :meth:`validate` does.

        The one comparison every validation of an export goes through, also those outside
        :meth:`validate` (a decoder graph's prefill-on-empty-past and decode-step checks ...), so
        a reduced-precision or quantized artifact is always scored the same way.

        Args:
            model: the eager reference model (float32 for a float32 export; the model's own dtype
                otherwise), flags applied as for the export.
            run: the backend runner (forward kwargs -> ``{output_name: tensor}``); with a
                ``report`` whose ``output_flags`` are set, it is called with ``inputs`` plus those
                flags (the kwargs the artifact was exported with).
            inputs: forward kwargs in the reference model's dtype (``Cache`` objects or nested
                lists/dicts of cache tensors included), as the eager model takes them.
            config: the export's config. When ``config.dtype`` differs from the reference model's
                dtype or ``config.quantization`` is set (:func:`hfexport.quality.quality_gates_for`),
                the artifact gets a copy of ``inputs`` whose floating point tensors (KV caches,
                ``inputs_embeds``, masks/biases in float) are cast to ``config.dtype`` (integer
                tensors such as ids, masks and positions keep theirs) and is scored with the quality
                gates; otherwise it gets ``inputs`` unchanged and is compared with allclose at
                ``config.atol``/``rtol`` (``None``: :meth:`default_tolerances`).
            report: when given, ``report.quality_gates`` records the gates in force.
            label: name of the input set in messages (``"sample"``, ``"decode step"``).
            expected: the eager outputs on ``inputs`` when already computed
                (:meth:`reference_outputs`); ``None`` runs ``model`` here.

        Returns:
            The rows as dicts (:class:`hfexport.quality.OutputQuality` or
            :class:`hfexport.validation.OutputComparison`), as ``report.validation`` stores them.

        Raises:
            ExportValidationError: an output differs beyond tolerance or misses a gate.
        """
        from hfexport.inputs.flags import with_output_flags
        from hfexport.precision import dtype_name, model_dtype
        from hfexport.verify.compare import validate_artifact
        from hfexport.verify.gates import output_gates, quality_gates_for, validate_quality

        if report is not None:  # the artifact gets the kwargs it was exported with, flags included
            run = with_output_flags(run, report.output_flags)
        gates = quality_gates_for(config, reference=dtype_name(model_dtype(model)))
        if gates is not None:
            gates = output_gates(gates)  # the text metrics are scored by check_text
            if report is not None and report.top1_gated_on_text:
                gates.pop("top1_agreement", None)  # recorded, gated as top1_agreement_text
            if report is not None:
                report.quality_gates = dict(gates)
            dtype = str(getattr(config, "dtype", None) or "float32")
            rows: list[Any] = validate_quality(
                model, run, inputs, gates=gates, dtype=dtype, label=label, expected=expected
            )
        else:
            atol_default, rtol_default = self.default_tolerances(model)
            # a plugin's config need not have DynamoConfig's fields: absent ones take the defaults
            atol = getattr(config, "atol", None)
            rtol = getattr(config, "rtol", None)
            rows = validate_artifact(
                model,
                run,
                inputs,
                atol=atol if atol is not None else atol_default,
                rtol=rtol if rtol is not None else rtol_default,
                label=label,
                expected=expected,
                # tolerances the user chose are the verdict; the defaults fall back to a float64
                # reference for outputs whose float32 rounding in eager already exceeds them
                float64_reference=atol is None and rtol is None,
            )
        return [r.to_dict() for r in rows]

    # -- helpers for the CLI -----------------------------------------------------------------------
    def artifact_path(self, output_dir: str | os.PathLike[str]) -> Path:
        """Where the CLI writes the artifact inside ``output_dir``."""
        return Path(output_dir) / self.artifact_filename

    def __repr__(self) -> str:
        return f"{type(self).__name__}(export_format={self.export_format!r})"
