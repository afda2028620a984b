"""``GenerationSupport``: everything a backend adds to the core's generation path, in one object.

The core exports, saves, loads and runs generation components itself (:mod:`hfexport.generation`);
a backend takes part through one object its exporter provides,
:attr:`hfexport.exporter.HfExporter.generation_support`, an instance of the class named by the
exporter's ``generation_support_class`` (default: this base class, whose hooks keep the core's
defaults). A backend subclasses :class:`GenerationSupport` in its own generation module and
overrides only the hooks that differ::

    class MyGenerationSupport(GenerationSupport):
        supports_empty_growing_cache = False

        def component_metadata(self, artifact):
            return {"specs": describe(artifact)}

    class MyExporter(HfExporter):
        generation_support_class = MyGenerationSupport

Hooks and who calls them:

=============================  ================================  ========================================
hook                           default                           called by
=============================  ================================  ========================================
``prepare_component``          the module unchanged              ``export_for_generation``
``component_config``           the config unchanged              ``export_for_generation``
``second_shape_skip_reason``   ``None`` (the generic reason)     ``export_for_generation``
``generation_source``          ``None`` (no shared copy)         ``export_for_generation``
``supports_empty_growing_..``  ``True``                          ``export_for_generation``
``component_filename``         ``name`` + artifact suffix        ``save_components``
``component_metadata``         ``{}``                            ``save_components``, export folders
``load_component``             ``runner(load(path))``            ``load_components``, ``hfexport.load``,
                                                                 validation of a saved artifact
``generation_runner``          ``GenerationRunner``              ``load_runner``, ``hfexport generate``
=============================  ================================  ========================================

Before this class existed the hooks were methods of ``HfExporter``; those names still work for one
release (:data:`LEGACY_HOOKS`): calling them delegates here with a ``DeprecationWarning``, and an
exporter subclass that overrides one is wrapped by :func:`legacy_support_class` so its override is
still the hook the core calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

__all__ = ["LEGACY_HOOKS", "GenerationSupport", "in_legacy_override", "legacy_support_class"]

#: The hook names that were methods (or, for ``supports_empty_growing_cache``, a class attribute)
#: of ``HfExporter`` before :class:`GenerationSupport`; deprecated there, removed in the next release.
LEGACY_HOOKS: tuple[str, ...] = (
    "prepare_component",
    "component_config",
    "component_metadata",
    "component_filename",
    "load_component",
    "generation_runner",
    "generation_source",
    "supports_empty_growing_cache",
)


class GenerationSupport:
    """What a backend adds to generation: hooks with the core's defaults, bound to one exporter.

    Args:
        exporter: the :class:`hfexport.exporter.HfExporter` this support belongs to; the hooks
            use its ``runner``, ``load``, ``artifact_filename``, ``check_precision`` and
            ``active_config`` (the resolved config of the export running now).

    Class attributes:
        supports_empty_growing_cache: whether a decode graph of this runtime can run on a growing
            (dynamic) cache of 0 positions, i.e. serve the prefill of a decoder-only model; when it
            is False and no ``prefill`` component is exported on a dynamic cache,
            ``export_for_generation`` refuses the export (``ValueError``) before any capture.
    """

    supports_empty_growing_cache: ClassVar[bool] = True

    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.exporter).__name__})"

    # -- export_for_generation -----------------------------------------------------------------
    def prepare_component(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> torch.nn.Module:
        """Adapt a generation component's module before it is exported (default: ``module``).

        Called by ``export_for_generation`` once per component, before :meth:`component_config`
        (and once more for the component's module in the shared :meth:`generation_source` copy).

        Args:
            name: the component (``"prefill"``, ``"decode"``, ``"image_encoder"`` ...).
            module: the exportable submodule (it has a transformers ``config``).
            kwargs: its recorded forward kwargs (tensors, ``Cache`` objects, output flags); do not
                modify them.
            plan: the :class:`hfexport.generation.plan.GenerationPlan` (``cache_kind``,
                ``max_cache_len``, ``architecture`` ...).

        Returns:
            The module to export: ``module`` itself or a wrapper with the same forward kwargs (e.g.
            :class:`hfexport.generation.parts.FunctionalCacheModule` for runtimes that do not write
            mutated inputs back).
        """
        return module

    def component_config(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any, config: Any
    ) -> Any:
        """Adapt a generation component's resolved config (default: ``config``).

        Args:
            name, module, kwargs, plan: as for :meth:`prepare_component` (``module`` is the
                prepared one).
            config: the component's config, already an instance of the exporter's ``config_class``.

        Returns:
            The config to export the component with (e.g. ``config.replace(dynamic_shapes=...)``
            with bounded dynamic axes); never mutate ``config`` in place.
        """
        return config

    def second_shape_skip_reason(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> str | None:
        """Why :meth:`component_config` exports ``name`` without the second-shape check it was asked
        for (``validate_second_shape`` turned off), recorded as the skipped stage's reason; ``None``
        (the default) leaves the core's generic reason.

        Args:
            name, module, kwargs, plan: as for :meth:`component_config`.
        """
        return None

    def generation_source(self, model: torch.nn.Module, config: Any) -> torch.nn.Module | None:
        """A transformed copy of ``model`` that every generation component is captured from, built
        once per ``export_for_generation`` (default: ``None``: each component's export transforms
        what it needs itself).

        A backend whose config transforms the weights before capture (a quantizing source
        transform) returns one transformed deep copy here, so ``prefill``, ``decode`` and the other
        components share one set of transformed weights; ``model`` itself is never modified. The
        copy must keep ``model``'s module structure (components are found in it by qualified name)
        and let the backend's capture recognise it as already transformed
        (:func:`hfexport.generation.parts.mark_transformed_source`). Components are exported with
        ``exporter.export(component, kwargs, config, source=<the same module in the copy>)`` and
        still validated against the untransformed model.

        Args:
            model: the generative model (left untouched).
            config: the component config (an instance of the exporter's ``config_class``).

        The default builds it from the exporter's declared quantization method
        (``exporter.quantization_methods``): a float32 export whose method has a ``source``-phase
        function (its ``apply`` for a ``source`` method, its ``prepare`` for a later one) gets that
        function's copy, marked with its facts, which the shared capture step
        (``HfExporter.captured_program``) recognises in each component instead of quantizing
        again. A reduced ``dtype`` gets ``None`` (each component casts, then quantizes).

        Returns:
            The copy, or ``None`` when ``config`` asks for no source transform.

        Raises:
            ValueError: the quantization is refused (``exporter.check_precision``).
        """
        exporter = self.exporter
        method = exporter.quantization_spec(config)
        source_function = method.source_function() if method is not None else None
        if source_function is None or str(getattr(config, "dtype", None) or "float32") != "float32":
            return None
        exporter.check_precision(config)
        from hfexport.generation.parts import mark_transformed_source
        from hfexport.linear_forms import weight_bytes
        from hfexport.quantization import QuantizationRequest

        before = weight_bytes(model)
        result = source_function(QuantizationRequest(model, config.quantization, "source"))
        if result.target is model:
            return None
        facts = {"method": config.quantization.method, **result.facts, "shared_by_components": True}
        facts.setdefault("weight_bytes_before", before)
        mark_transformed_source(result.target, model, facts)
        return result.target

    # -- folders -------------------------------------------------------------------------------
    def component_filename(self, name: str) -> str:
        """File name of generation component ``name`` in a saved folder (default: ``name`` plus
        the extension of the exporter's ``artifact_filename``, e.g. ``decode.onnx``; ``.bin`` when
        it has none).

        A backend whose runtime loads fixed file names (OpenVINO GenAI reads
        ``openvino_model.xml``) returns them here; ``save_components`` records the name in the
        manifest, so loading needs no rule.
        """
        suffix = "".join(Path(str(self.exporter.artifact_filename)).suffixes) or ".bin"
        return f"{name}{suffix}"

    def component_metadata(self, artifact: Any) -> dict[str, Any]:
        """JSON-safe facts :meth:`load_component` needs besides the file (default: ``{}``).

        Stored as the component's ``"metadata"`` in ``generation_manifest.json`` (and, for a
        one-artifact export folder, as the artifact's metadata in ``export_report.json``). The
        loader never imports modules named in it: a folder may come from someone else.

        Args:
            artifact: one artifact, as ``exporter.export`` returned it.

        Returns:
            A dict of JSON-serialisable values (strings, numbers, lists, dicts).
        """
        return {}

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """Load one saved artifact and return its caller (default:
        ``exporter.runner(exporter.load(path, trust_remote_code=False))``, the backend's safe loading).

        Args:
            path: the artifact file (``decode.pt2``, ``model.onnx`` ...).
            metadata: what :meth:`component_metadata` returned for it at save time.

        Returns:
            A callable: forward kwargs (the component's plan input structure) ->
            ``{output_leaf_path: tensor}``.

        Raises:
            FileNotFoundError: no file at ``path``.
            NotImplementedError: the backend cannot load saved artifacts.
        """
        return self.exporter.runner(self.exporter.load(path, trust_remote_code=False))

    def generation_runner(self, plan: Any, callers: Mapping[str, Any], **runner_kwargs: Any) -> Any:
        """The greedy runner over loaded components (default:
        :class:`hfexport.generation.GenerationRunner`).

        Called by :func:`hfexport.generation.load_runner` (hence ``hfexport generate`` and
        ``hfexport.load``) with the folder's plan and the callers :meth:`load_component` returned.
        A backend whose components are not stateless graphs (a decoder keeping its KV cache as
        runtime state) returns its own runner; it must offer ``plan`` and ``generate(input_ids,
        attention_mask=None, *, max_new_tokens, **inputs) -> int64 [batch, seq + n]``.

        Args:
            plan: the :class:`hfexport.generation.plan.GenerationPlan` of the folder.
            callers: ``{component: caller}`` from :meth:`load_component`.
            runner_kwargs: passed on to ``GenerationRunner`` (``prefill_with_decode`` ...).
        """
        from hfexport.generation.runner import GenerationRunner

        return GenerationRunner(plan, callers, **runner_kwargs)


# -- the deprecated HfExporter hooks ---------------------------------------------------------------
_ACTIVE = threading.local()


def _active() -> set[tuple[int, str]]:
    calls = getattr(_ACTIVE, "calls", None)
    if calls is None:
        calls = _ACTIVE.calls = set()
    return calls


def in_legacy_override(support: GenerationSupport, hook: str) -> bool:
    """Whether ``support`` is running the exporter's own deprecated override of ``hook`` in this
    thread (so a ``super().hook(...)`` call from it is part of that override, already warned about
    when its class was created)."""
    return (id(support), hook) in _active()


def _legacy_hook(base: type[GenerationSupport], hook: str) -> Any:
    """A support method that calls the exporter's own (deprecated) override of ``hook``; when that
    override calls ``super().hook(...)`` (reaching ``HfExporter``'s delegate, hence this support
    again), the call goes to ``base``'s implementation instead of looping."""
    default = getattr(base, hook)

    def method(self: GenerationSupport, *args: Any, **kwargs: Any) -> Any:
        key = (id(self), hook)
        calls = _active()
        if key in calls:  # the override's super() call: the support's own hook
            return default(self, *args, **kwargs)
        calls.add(key)
        try:
            return getattr(self.exporter, hook)(*args, **kwargs)
        finally:
            calls.discard(key)

    method.__name__ = hook
    method.__doc__ = f"The exporter's own ``{hook}`` (a deprecated ``HfExporter`` override)."
    return method


def legacy_support_class(
    base: type[GenerationSupport], exporter_class: type, hooks: Mapping[str, Any]
) -> type[GenerationSupport]:
    """A subclass of ``base`` whose hooks named in ``hooks`` come from ``exporter_class``'s
    deprecated overrides (methods, or the ``supports_empty_growing_cache`` value).

    Used by ``HfExporter.__init_subclass__`` for exporters written against the old contract, so
    their overrides keep taking effect for one release.

    Args:
        base: the support class the exporter had (its parent's ``generation_support_class``).
        exporter_class: the exporter subclass defining the overrides (names the new class).
        hooks: ``{hook name: what the exporter class defines}`` for names in :data:`LEGACY_HOOKS`.

    Returns:
        The new support class.
    """
    namespace: dict[str, Any] = {"__module__": exporter_class.__module__}
    for hook, value in hooks.items():
        if hook == "supports_empty_growing_cache":
            namespace[hook] = bool(value)
        else:
            namespace[hook] = _legacy_hook(base, hook)
    return type(f"{exporter_class.__name__}GenerationSupport", (base,), namespace)
