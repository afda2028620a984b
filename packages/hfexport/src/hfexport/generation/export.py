"""Export every generation component through a backend's normal ``export()``.

:func:`export_components` is what ``HfExporter.export_for_generation`` runs: decompose the model
(:func:`hfexport.generation.decompose.decompose_for_generation`), resolve one config per component,
export each component with ``exporter.export(submodel, kwargs, config, component=name)`` (so every
backend stage, patch, fix and the validation against eager PyTorch apply per component) and, for a
multi-token decode graph exported with dynamic shapes, validate it again at query lengths 1 and 4
and, when it is to serve the prefill (static cache, or no ``prefill`` component), as a prefill on
an empty cache.

A backend adapts a component through the generation hooks of its exporter (see
:class:`hfexport.exporter.HfExporter`): ``exporter.prepare_component(name, module, kwargs, plan)``
(ExecuTorch asks for :class:`~hfexport.generation.parts.FunctionalCacheModule` around static-cache
components), ``exporter.component_config(name, module, kwargs, plan, config)`` (ExecuTorch bounds
the dynamic axes of decode steps) and ``exporter.supports_empty_growing_cache`` (False: a decode
graph that cannot take a 0-position cache cannot serve the prefill). This module takes the
exporter as an argument and never looks a backend up. Vision encoders exported with
``dynamic=True`` vary along their patch axis only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfexport.errors import HfExportError
from hfexport.generation.decode import decode_inputs_for_query_length
from hfexport.generation.decompose import Decomposition, decompose_for_generation
from hfexport.generation.parts import exportable_module
from hfexport.generation.plan import GenerationPlan

__all__ = [
    "ComponentExportError",
    "GenerationArtifacts",
    "export_components",
    "resolve_component_configs",
    "validate_decode_lengths",
]

logger = logging.getLogger(__name__)


class ComponentExportError(HfExportError, RuntimeError):
    """Exporting one generation component failed.

    Attributes:
        component: the component's name (``"decode"``, ``"image_encoder"`` ...).
        model_class: class name of the exported submodule.
        input_keys: its forward kwargs' names.
    """

    def __init__(self, message: str, *, component: str, model_class: str, input_keys: list[str]) -> None:
        super().__init__(message)
        self.component = component
        self.model_class = model_class
        self.input_keys = input_keys


class GenerationArtifacts(dict):
    """``{component: artifact}`` as ``export_for_generation`` returns it, plus:

    Attributes:
        plan: the :class:`GenerationPlan` (what the runner and ``save_components`` need).
        reports: ``{component: ExportReport}``.
        export_format: the exporter's format name.
    """

    def __init__(
        self,
        artifacts: Mapping[str, Any],
        plan: GenerationPlan,
        reports: Mapping[str, Any],
        export_format: str,
    ) -> None:
        super().__init__(artifacts)
        self.plan = plan
        self.reports = dict(reports)
        self.export_format = export_format


def _is_config(value: Any) -> bool:
    from hfexport.config import ExportConfigMixin

    return isinstance(value, ExportConfigMixin)


def resolve_component_configs(config: Any, components: list[str]) -> dict[str, Any]:
    """One config per component.

    Args:
        config: one config (an ``ExportConfigMixin``, a dict for ``config_class.from_dict``, or
            ``None`` for the exporter's default) used for every component, or a dict
            ``{component: config}`` (recognised by its values being configs or dicts).
        components: the component names.

    Returns:
        ``{component: config}``.

    Raises:
        ValueError: a per-component dict that misses components or names unknown ones (the
            message lists the missing, the unknown and the expected names).
    """
    per_component = (
        isinstance(config, Mapping)
        and bool(config)
        and all(_is_config(v) or isinstance(v, Mapping) or v is None for v in config.values())
    )
    if not per_component:
        return {name: config for name in components}
    missing = [c for c in components if c not in config]
    unknown = [c for c in config if c not in components]
    if missing or unknown:
        raise ValueError(
            f"the per-component config misses {missing}"
            + (f" and names unknown components {unknown}" if unknown else "")
            + f"; expected one entry for each of {components}"
        )
    return {name: config[name] for name in components}


def validate_decode_lengths(
    exporter: Any,
    artifact: Any,
    model: torch.nn.Module,
    kwargs: Mapping[str, Any],
    config: Any,
    plan: GenerationPlan,
    report: Any,
) -> None:
    """Validate a multi-token decode graph at query lengths 1 and 4 and, on a static cache or when
    no prefill graph is exported (the decode graph then serves the prompt), as a prefill of 4
    tokens on an empty cache (the sample, 2 tokens, was validated by ``export``).

    Raises:
        ExportValidationError: an output differs from eager PyTorch beyond tolerance.
    """
    from hfexport.inputs import apply_output_flags, prepare_for_export
    from hfexport.quality import quality_gates_for, validate_quality
    from hfexport.validation import validate_artifact

    gates = quality_gates_for(config)
    atol_default, rtol_default = exporter.default_tolerances(model)
    atol = config.atol if getattr(config, "atol", None) is not None else atol_default
    rtol = config.rtol if getattr(config, "rtol", None) is not None else rtol_default
    run = exporter.runner(artifact)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("decode_q1", decode_inputs_for_query_length(kwargs, 1, seed=1)),
        ("decode_q4", decode_inputs_for_query_length(kwargs, 4, seed=2)),
    ]
    if plan.cache_kind == "static" or "prefill" not in plan.components:
        cases.append(
            (
                "decode_prefill_empty_cache",
                decode_inputs_for_query_length(kwargs, 4, empty_cache=True, seed=3),
            )
        )
    for label, raw in cases:
        _, prepared, flags = prepare_for_export(model, raw)
        with report.stage(f"validate_{label}"), apply_output_flags(model, flags), torch.no_grad():
            if gates is not None:
                rows = validate_quality(
                    model, run, prepared, gates=gates, dtype=config.dtype, label=label.replace("_", " ")
                )
            else:
                rows = validate_artifact(
                    model, run, prepared, atol=atol, rtol=rtol, label=label.replace("_", " ")
                )
            report.validation[label] = [r.to_dict() for r in rows]


def _encoder_shapes(
    name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: GenerationPlan, config: Any
) -> Any:
    """A Qwen-style vision encoder exported with ``dynamic=True`` varies along the patch axis only:
    the other axes (``pixel_values``' patch size ``C * T * P * P``, the 2 rotary coordinates) are
    fixed by the model, so they are kept static instead of ``Dim.AUTO``."""
    if (
        name not in plan.vision_grid
        or not getattr(config, "dynamic", False)
        or getattr(config, "dynamic_shapes", None)
    ):
        return config
    from hfexport.generation.shapes import dynamic_shapes_by_rule, leading_axis_only
    from hfexport.inputs import prepare_for_export

    _, prepared, _ = prepare_for_export(module, kwargs)
    return config.replace(dynamic_shapes=dynamic_shapes_by_rule(prepared, leading_axis_only))


def export_components(
    exporter: Any,
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    config: Any = None,
    *,
    generation_config: Any = None,
    multi_token_decode: bool = False,
    components: Sequence[str] | None = None,
    decomposition: Decomposition | None = None,
) -> GenerationArtifacts:
    """Decompose ``model`` and export every component with ``exporter``.

    Args:
        exporter: an ``HfExporter`` instance.
        model: the generative model.
        inputs: generate-style inputs (``input_ids``, ``attention_mask``, ``pixel_values`` ...).
        config: one config for every component or ``{component: config}``.
        generation_config: optional ``GenerationConfig`` (cache settings; copied).
        multi_token_decode: capture and export a multi-token decode graph.
        components: export only these components (default: all). A static-cache decoder needs
            only ``decode`` when it is a multi-token graph: the runner then prefills through it.
        decomposition: reuse an existing decomposition instead of recording a new one.

    Returns:
        :class:`GenerationArtifacts` ``{component: artifact}`` with ``.plan`` and ``.reports``.

    Raises:
        ValueError: bad inputs or a per-component config with missing entries.
        ComponentExportError: a component failed to export or validate (``RuntimeError``; the
            message names the component, its class and its input keys; the cause is chained).
        RuntimeError: ``generate`` failed while recording.
    """
    if decomposition is None:
        decomposition = decompose_for_generation(
            model, inputs, generation_config=generation_config, multi_token_decode=multi_token_decode
        )
    plan = decomposition.plan
    names = list(decomposition)
    if components is not None:
        unknown = [c for c in components if c not in names]
        if unknown or not components:
            raise ValueError(
                f"components={list(components)} names unknown components {unknown}; the model has {names}"
            )
        names = [n for n in names if n in components]
        plan = dataclasses.replace(plan, components=names, io={n: plan.io[n] for n in names})
    if (
        plan.architecture == "decoder"
        and plan.cache_kind == "dynamic"
        and "prefill" not in names
        and not exporter.supports_empty_growing_cache
    ):
        raise ValueError(
            f"the {exporter.export_format} runtime cannot run a decode graph on an empty growing cache, so it "
            "cannot serve the prefill: export the 'prefill' component too, or use a static cache"
        )
    configs = resolve_component_configs(config, names)
    parent_config = getattr(model, "config", None)
    artifacts: dict[str, Any] = {}
    reports: dict[str, Any] = {}
    for name in names:
        module, kwargs = decomposition[name]
        exportable = exportable_module(module, parent_config)
        exportable = exporter.prepare_component(name, exportable, kwargs, plan)
        try:
            resolved = exporter._resolve_config(configs[name])
            resolved = _encoder_shapes(name, exportable, kwargs, plan, resolved)
            resolved = exporter.component_config(name, exportable, kwargs, plan, resolved)
            artifact = exporter.export(exportable, kwargs, resolved, component=name)
            reports[name] = exporter.last_report
            if (
                name == "decode"
                and plan.multi_token_decode
                and resolved.is_dynamic
                and getattr(resolved, "validate", True)
            ):
                validate_decode_lengths(
                    exporter, artifact, exportable, kwargs, resolved, plan, exporter.last_report
                )
        except Exception as exc:
            keys = sorted(kwargs)
            raise ComponentExportError(
                f"exporting generation component {name!r} ({type(module).__name__}) with inputs {keys} to "
                f"{exporter.export_format} failed: {type(exc).__name__}: {exc}",
                component=name,
                model_class=type(module).__name__,
                input_keys=keys,
            ) from exc
        artifacts[name] = artifact
    return GenerationArtifacts(artifacts, plan, reports, exporter.export_format)
