"""``HfExporter``: the abstract base every backend implements, and the whole backend contract.

Everything the core asks of a backend is a method or class attribute of this class; nothing is
found by module name or probed with ``getattr``. A backend subclass sets the class attributes and
implements three methods:

- ``_export(model, inputs, config, report) -> artifact``: its stages (patches, capture, fixes,
  lowering), each inside ``report.stage(name)``, the shared ones named by
  :class:`hfexport.report.Stage` and its own declared in the ``stages`` class attribute;
- ``runner(artifact) -> callable``: forward kwargs -> ``{output_name: tensor}``, used by validation;
- ``save(artifact, path)``: write the artifact file.

It may override, where the defaults do not fit:

- ``load(path, *, trust_remote_code=False) -> artifact``: read a saved artifact (default: refuses);
- generation hooks, used by ``export_for_generation`` and the generation folder loader:
  ``prepare_component`` (adapt a component's module before export, default: unchanged),
  ``component_config`` (adapt its config, default: unchanged), ``component_metadata`` (JSON-safe
  facts the loader needs, stored in ``generation_manifest.json``, default: ``{}``),
  ``load_component`` (a saved component file -> caller, default: ``runner(load(path))``),
  ``generation_source`` (one transformed copy of the model, e.g. quantized, that every component
  is captured from, default: ``None``) and ``supports_empty_growing_cache`` (default: True).

The base class owns what every backend shares: environment validation, input preparation, the
reversible model state (training mode, attention implementation, output flags), validation
against eager PyTorch at the sample shape and a second shape, and the report.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.config import ExportConfigMixin, QuantizationMethod
from hfexport.environment import check_environment, format_problems, warn_drift_once
from hfexport.report import ExportReport, Stage

__all__ = ["HfExporter"]

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


class HfExporter(abc.ABC):
    """Abstract exporter of a ``transformers.PreTrainedModel`` to one runtime.

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
        supports_empty_growing_cache: see the generation hooks below (default True).
        stages: the names of the backend's own report stages (those not in
            :class:`hfexport.report.Stage`), in run order; a test holds every report to them.

    Methods a backend implements: :meth:`_export`, :meth:`runner`, :meth:`save`. Methods with
    defaults it may override: :meth:`load`, :meth:`default_tolerances`, and the generation hooks
    :meth:`prepare_component`, :meth:`component_config`, :meth:`component_metadata`,
    :meth:`load_component`, :meth:`generation_source`.

    Args:
        config: the default config for :meth:`export` (an instance of ``config_class``).

    Raises:
        ImportError: at construction, when a required package is missing or below its minimum;
            one message lists every problem and the pip command installing the tested pins.
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
    #: Whether a decode graph of this runtime can run on a growing (dynamic) cache of 0 positions,
    #: i.e. serve the prefill of a decoder-only model (read by ``export_for_generation``: when it is
    #: False and no ``prefill`` component is exported on a dynamic cache, the export is refused).
    supports_empty_growing_cache: ClassVar[bool] = True
    #: The backend's own stage names (the shared ones are :class:`hfexport.report.Stage`).
    stages: ClassVar[tuple[str, ...]] = ()
    #: ``config.dtype`` values this backend can capture and run here (see :meth:`check_precision`).
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: ``config.quantization.method`` names this backend implements -> a
    #: :class:`hfexport.config.QuantizationMethod` (what it does and which options it reads; a
    #: plain description string is accepted too and declares nothing, so its options are not checked).
    quantization_methods: ClassVar[Mapping[str, QuantizationMethod | str]] = {}

    def __init__(self, config: ExportConfigMixin | None = None) -> None:
        self.validate_environment()
        self.config = self._resolve_config(config) if config is not None else None
        self.last_report: ExportReport | None = None
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
        ``DynamoConfig`` subclass is fine for dynamo; an ``OnnxConfig``, which subclasses
        ``DynamoConfig`` but names another format, is not). An exporter that keeps the base
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

        Raises:
            ValueError: ``config.dtype`` not in :attr:`supported_dtypes`,
                ``config.quantization.method`` not in :attr:`quantization_methods`, a quantization
                option the method does not read (:meth:`hfexport.config.QuantizationConfig.check_options`),
                or ``config.quality_gates`` naming an unknown metric; the message names what is allowed.
        """
        dtype = getattr(config, "dtype", "float32")
        if dtype not in self.supported_dtypes:
            raise ValueError(
                f"dtype={dtype!r} is not supported by the {self.export_format} backend here; "
                f"allowed: {', '.join(self.supported_dtypes)}"
            )
        quantization = getattr(config, "quantization", None)
        from hfexport.quality import quality_gates_for

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
            model: a ``PreTrainedModel`` (or any ``nn.Module`` with a keyword forward).
            sample_inputs: **forward kwargs**, as ``model(**sample_inputs)`` takes them: tensors
                (``input_ids`` int64 ``[batch, seq]``, ``attention_mask``, ``pixel_values`` ...)
                and ``Cache`` objects. Output flags (``use_cache``, ``return_dict``, ...) are
                applied to the config while tracing only.
            config: the backend's config (or a dict for ``config_class.from_dict``); defaults to the
                one given at construction, else the class defaults.
            component: name of the exported component, used in the report and errors.
            source: a transformed copy of ``model`` (same structure and forward, e.g. the quantized
                copy :meth:`generation_source` built once for every generation component) to
                capture instead of ``model``; the artifact is still validated against ``model``
                (the fp32 eager reference). The same output flags and attention settings are applied
                to it for the export and undone afterwards.

        Returns:
            The backend's artifact (``ExportedProgram``, ``torch.onnx.ONNXProgram``,
            ``ExecutorchProgramManager``). ``self.last_report`` holds the :class:`ExportReport`.

        Raises:
            UnsupportedInputError: loss inputs (``labels`` ...) among ``sample_inputs``.
            UnsupportedModelError: an attention implementation with no export path.
            ExportStageError: a stage failed (the message names the stage and component).
            ExportValidationError: the artifact's outputs differ from eager PyTorch beyond
                tolerance (the message holds the per-output table).

        The model is left as it was: training mode, config flags, attention implementation and
        patched attributes are restored, also when the export fails.
        """
        from hfexport.inputs import (
            apply_output_flags,
            attention_for_export,
            prepare_for_export,
            restore_model_state,
        )

        config = self._resolve_config(config)
        self.check_precision(config)
        report = ExportReport(
            export_format=self.export_format,
            component=component,
            model_class=type(model).__name__,
            callback=self.stage_callback,
        )
        self.last_report = report
        with contextlib.ExitStack() as stack:
            # one export of a model object at a time: torch.export swaps its parameters for fakes
            stack.enter_context(_model_lock(model))
            stack.enter_context(restore_model_state(model))
            if source is not None:
                stack.enter_context(restore_model_state(source))
            with report.stage(Stage.PREPARE_INPUTS):
                stack.enter_context(attention_for_export(model))
                model, inputs, flags = prepare_for_export(model, sample_inputs)
                stack.enter_context(apply_output_flags(model, flags))
                if source is not None:
                    stack.enter_context(attention_for_export(source))
                    stack.enter_context(apply_output_flags(source, flags))
                from hfexport.tensors import get_leaf_tensors

                report.input_names = {
                    k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                    for k, v in get_leaf_tensors(inputs).items()
                }
            with torch.no_grad():
                artifact = self._export_in_dtype(model if source is None else source, inputs, config, report)
                if getattr(config, "validate", True):
                    self.validate(artifact, model, inputs, config, report)
                else:
                    report.skip(Stage.VALIDATE, "config.validate is False")
        output_path = getattr(config, "output_path", None)
        if output_path:
            with report.stage(Stage.SAVE, detail=str(output_path)):
                self.save(artifact, output_path)
        return artifact

    def _export_in_dtype(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: Any, report: ExportReport
    ) -> Any:
        """Run :meth:`_export` with the model and its float inputs cast to ``config.dtype`` (the
        shared capture path of every backend); the model's own weights are back when it returns or
        raises (:func:`hfexport.precision.model_in_dtype`), so validation compares with fp32."""
        dtype = str(getattr(config, "dtype", "float32") or "float32")
        if dtype == "float32":
            return self._export(model, inputs, config, report)
        from hfexport.precision import model_in_dtype, torch_dtype
        from hfexport.tensors import cast_leaf_tensors

        report.extra["dtype"] = dtype
        with model_in_dtype(model, dtype):
            return self._export(model, cast_leaf_tensors(inputs, torch_dtype(dtype)), config, report)

    @abc.abstractmethod
    def _export(
        self, model: torch.nn.Module, inputs: dict[str, Any], config: Any, report: ExportReport
    ) -> Any:
        """Backend stages: capture, fixes, lowering. Each inside ``report.stage(name)``."""

    @abc.abstractmethod
    def runner(self, artifact: Any) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        """Return a callable running ``artifact`` on forward kwargs -> ``{output_name: tensor}``.

        Output names are the eager output's leaf paths (``logits``, ``last_hidden_state``,
        ``past_key_values.layers.0.keys``), as :func:`hfexport.tensors.get_leaf_tensors` gives.
        """

    @abc.abstractmethod
    def save(self, artifact: Any, path: str | os.PathLike[str]) -> None:
        """Write ``artifact`` to ``path`` atomically (no half-written file on failure)."""

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

    # -- generation hooks --------------------------------------------------------------------------
    def prepare_component(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> torch.nn.Module:
        """Adapt a generation component's module before it is exported (default: ``module``).

        Called by ``export_for_generation`` once per component, before :meth:`component_config`.

        Args:
            name: the component (``"prefill"``, ``"decode"``, ``"image_encoder"`` ...).
            module: the exportable submodule (it has a transformers ``config``).
            kwargs: its recorded forward kwargs (tensors, ``Cache`` objects); do not modify them.
            plan: the :class:`hfexport.generation.plan.GenerationPlan` (``cache_kind``,
                ``max_cache_len``, ``architecture`` ...).

        Returns:
            The module to export: ``module`` itself or a wrapper with the same forward kwargs (e.g.
            :class:`hfexport.generation.parts.FunctionalCacheModule` for runtimes that do not
            write mutated inputs back).
        """
        return module

    def component_config(
        self,
        name: str,
        module: torch.nn.Module,
        kwargs: Mapping[str, Any],
        plan: Any,
        config: ExportConfigMixin,
    ) -> ExportConfigMixin:
        """Adapt a generation component's resolved config (default: ``config``).

        Args:
            name, module, kwargs, plan: as for :meth:`prepare_component` (``module`` is the
                prepared one).
            config: the component's config, already an instance of :attr:`config_class`.

        Returns:
            The config to export the component with (e.g. ``config.replace(dynamic_shapes=...)``
            with bounded dynamic axes); never mutate ``config`` in place.
        """
        return config

    def component_metadata(self, artifact: Any) -> dict[str, Any]:
        """JSON-safe facts :meth:`load_component` needs besides the file (default: ``{}``).

        Stored as the component's ``"metadata"`` in ``generation_manifest.json``. The loader never
        imports modules named in it: a manifest comes from a folder, i.e. possibly from someone else.

        Args:
            artifact: one component's artifact, as :meth:`export` returned it.

        Returns:
            A dict of JSON-serialisable values (strings, numbers, lists, dicts).
        """
        return {}

    def component_filename(self, name: str) -> str:
        """File name of generation component ``name`` in a saved folder (default: ``name`` plus the
        extension of :attr:`artifact_filename`, e.g. ``decode.onnx``).

        A backend whose runtime loads fixed file names (OpenVINO GenAI reads ``openvino_model.xml``)
        returns them here; ``save_components`` records the name in the manifest, so loading needs
        no rule.
        """
        suffix = "".join(Path(str(self.artifact_filename)).suffixes) or ".bin"
        return f"{name}{suffix}"

    def generation_runner(self, plan: Any, callers: Mapping[str, Any], **runner_kwargs: Any) -> Any:
        """The greedy runner over loaded components (default: :class:`hfexport.generation.GenerationRunner`).

        Called by :func:`hfexport.generation.load_runner` (hence ``hfexport generate``) with the
        folder's plan and the callers :meth:`load_component` returned. A backend whose components
        are not stateless graphs (a decoder keeping its KV cache as runtime state) returns its own
        runner here; it must offer ``plan`` and ``generate(input_ids, attention_mask=None, *,
        max_new_tokens, **inputs) -> int64 [batch, seq + n]`` like ``GenerationRunner``.

        Args:
            plan: the :class:`hfexport.generation.plan.GenerationPlan` of the folder.
            callers: ``{component: caller}`` from :meth:`load_component`.
            runner_kwargs: passed on to ``GenerationRunner`` (``prefill_with_decode`` ...).
        """
        from hfexport.generation.runner import GenerationRunner

        return GenerationRunner(plan, callers, **runner_kwargs)

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """Load one saved generation component and return its caller.

        The default is ``self.runner(self.load(path))``, with the backend's safe loading
        (``trust_remote_code=False``).

        Args:
            path: the component file (``decode.pt2`` ...).
            metadata: what :meth:`component_metadata` returned for it at save time.

        Returns:
            A callable: forward kwargs (the component's plan input structure) ->
            ``{output_leaf_path: tensor}``.

        Raises:
            FileNotFoundError: no file at ``path``.
            NotImplementedError: the backend cannot load saved artifacts.
        """
        return self.runner(self.load(path, trust_remote_code=False))

    def generation_source(self, model: torch.nn.Module, config: Any) -> torch.nn.Module | None:
        """A transformed copy of ``model`` that every generation component is captured from, built
        once per :meth:`export_for_generation` (default: ``None``, each component's :meth:`export`
        transforms what it needs itself).

        A backend whose config transforms the model's weights before capture (a quantizing source
        transform) returns one transformed deep copy here, so that ``prefill``, ``decode`` and the
        other components share one set of transformed weights instead of transforming the model
        once per component; ``model`` itself is never modified. The copy must keep ``model``'s
        module structure (components are found in it by their qualified names) and let the
        backend's ``_export`` recognise it as already transformed. Components are exported with
        ``export(component_module, kwargs, config, source=<the same module in the copy>)`` and still
        validated against the untransformed model.

        Args:
            model: the generative model (left untouched).
            config: the component config (an instance of :attr:`config_class`).

        Returns:
            The copy, or ``None`` when ``config`` asks for no source transform.
        """
        return None

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
        :meth:`generation_source` builds one transformed copy that every component is captured
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
        second shape (another batch size, a longer sequence; see
        :func:`hfexport.validation.derive_second_inputs`).

        A reduced-precision or quantized export (``config.dtype != "float32"`` or
        ``config.quantization``) is scored against the fp32 eager ``model`` with the quality gates
        of :func:`hfexport.quality.quality_gates_for` (cosine, top-1 agreement; the artifact gets
        its float inputs in ``config.dtype``) instead of allclose; ``report.validation`` then holds
        :class:`hfexport.quality.OutputQuality` rows and ``report.extra["quality_gates"]`` the gates.
        The derived second shape of such an export reuses the sample's real tokens (a quarter
        shorter, batch + 1) instead of random ids, so the gates score inputs like the sample.

        Inputs holding a KV cache (the ``prefill`` and ``decode`` components of
        :meth:`export_for_generation`) get a second shape too: a prefill another batch and prompt
        length on its empty cache, a decode step another past length (and batch, when the program
        keeps it dynamic) with cache, mask and positions to match; a static cache keeps its shape
        and moves its write position. ``report.extra["second_shape"]``
        (:func:`hfexport.validation.describe_second_shape`) records the shapes used and which axes
        and values changed; its ``summary`` is also the detail of the ``validate_second_shape``
        stage. When no second shape can be derived, that stage is recorded as skipped with the reason.

        Raises:
            ExportValidationError: an output differs beyond tolerance, or misses a quality gate
                (the message names the metric, its value and the threshold).
        """
        from hfexport.validation import derive_second_inputs, describe_second_shape

        def check(run: Any, these: Mapping[str, Any], label: str) -> list[dict[str, Any]]:
            return self.check_outputs(model, run, these, config, report=report, label=label)

        with report.stage(Stage.VALIDATE, detail="sample inputs"):
            run = self.runner(artifact)  # a runtime that refuses the artifact fails in this stage
            report.validation["sample"] = check(run, inputs, "sample")
        if not (getattr(config, "is_dynamic", False) and getattr(config, "validate_second_shape", True)):
            return
        if second_inputs is None:
            # image sides the captured program holds static (ViT's image size) keep their size
            second_inputs, reason = derive_second_inputs(
                model, inputs, config=config, program_axes=report.extra.get("dynamic_axes")
            )
            if second_inputs is None:
                report.skip(Stage.VALIDATE_SECOND_SHAPE, reason)
                return
        described = describe_second_shape(inputs, second_inputs)
        report.extra["second_shape"] = described
        with report.stage(Stage.VALIDATE_SECOND_SHAPE, detail=described["summary"]):
            report.validation["second_shape"] = check(run, second_inputs, "second shape")

    def check_outputs(
        self,
        model: torch.nn.Module,
        run: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]],
        inputs: Mapping[str, Any],
        config: Any,
        *,
        report: ExportReport | None = None,
        label: str = "sample",
    ) -> list[dict[str, Any]]:
        """Compare one run of an artifact with the eager ``model`` on ``inputs``, as :meth:`validate` does.

        The one comparison every validation of an export goes through, also those outside
        :meth:`validate` (a decoder graph's prefill-on-empty-past and decode-step checks ...), so
        a reduced-precision or quantized artifact is always scored the same way.

        Args:
            model: the eager model in float32 (the reference), flags applied as for the export.
            run: the backend runner (forward kwargs -> ``{output_name: tensor}``).
            inputs: forward kwargs in float32 (``Cache`` objects or nested lists/dicts of cache
                tensors included), as the eager model takes them.
            config: the export's config. With ``config.dtype`` other than ``"float32"`` or a
                ``config.quantization`` (:func:`hfexport.quality.quality_gates_for`), the artifact
                gets a copy of ``inputs`` whose floating point tensors (KV caches, ``inputs_embeds``,
                masks/biases in float) are cast to ``config.dtype`` (integer tensors such as ids,
                masks and positions keep theirs) and is scored with the quality gates; otherwise it
                gets ``inputs`` unchanged and is compared with allclose at ``config.atol``/``rtol``
                (``None``: :meth:`default_tolerances`).
            report: when given, ``report.extra["quality_gates"]`` records the gates in force.
            label: name of the input set in messages (``"sample"``, ``"decode step"``).

        Returns:
            The rows as dicts (:class:`hfexport.quality.OutputQuality` or
            :class:`hfexport.validation.OutputComparison`), as ``report.validation`` stores them.

        Raises:
            ExportValidationError: an output differs beyond tolerance or misses a gate.
        """
        from hfexport.quality import quality_gates_for, validate_quality
        from hfexport.validation import validate_artifact

        gates = quality_gates_for(config)
        if gates is not None:
            if report is not None:
                report.extra["quality_gates"] = dict(gates)
            dtype = str(getattr(config, "dtype", "float32") or "float32")
            rows: list[Any] = validate_quality(model, run, inputs, gates=gates, dtype=dtype, label=label)
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
            )
        return [r.to_dict() for r in rows]

    # -- helpers for the CLI -----------------------------------------------------------------------
    def artifact_path(self, output_dir: str | os.PathLike[str]) -> Path:
        """Where the CLI writes the artifact inside ``output_dir``."""
        return Path(output_dir) / self.artifact_filename

    def __repr__(self) -> str:
        return f"{type(self).__name__}(export_format={self.export_format!r})"
