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
    "GREEDY_PARITY_TOKENS",
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


def _per_component(config: Any) -> bool:
    """``config`` is a ``{component: config}`` dict rather than one config (or its dict form)."""
    return (
        isinstance(config, Mapping)
        and bool(config)
        and all(_is_config(v) or isinstance(v, Mapping) or v is None for v in config.values())
    )


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
    if not _per_component(config):
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
            report.validation[label] = exporter.check_outputs(
                model, run, prepared, config, report=report, label=label.replace("_", " ")
            )


def _encoder_shapes(
    name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: GenerationPlan, config: Any
) -> Any:
    """A Qwen-style vision encoder exported with ``dynamic=True`` varies along the patch axis only:
    the other axes (``pixel_values``' patch size ``C * T * P * P``, the 2 rotary coordinates) are
    fixed by the model, so they are kept static instead of ``Dim.AUTO``. Likewise the model's own
    ``get_image_features`` as one component (:class:`hfexport.generation.multimodal.ImageFeatures`)
    varies along the image axis only: the image size is the model's (its position embeddings);
    a text it also reads (InstructBLIP's Q-Former instruction ``qformer_input_ids``, whose role has
    a sequence axis) varies along that axis too, up to the model's maximum positions; an image
    encoder of :attr:`GenerationPlan.per_image` takes one image of one size, all axes static."""
    from hfexport.generation.multimodal import ImageFeatures

    if (
        name in plan.per_image
        and getattr(config, "dynamic", False)
        and not getattr(config, "dynamic_shapes", None)
    ):
        # one image of one size per call (the image size is read as values): nothing varies
        return config.replace(dynamic=False)
    features = isinstance(module, ImageFeatures) or isinstance(getattr(module, "part", None), ImageFeatures)
    if (
        (name not in plan.vision_grid and not features)
        or not getattr(config, "dynamic", False)
        or getattr(config, "dynamic_shapes", None)
    ):
        return config
    from hfexport.generation.shapes import dynamic_shapes_by_rule, leading_axis_only
    from hfexport.inputs import prepare_for_export

    _, prepared, _ = prepare_for_export(module, kwargs)
    if not features:
        return config.replace(dynamic_shapes=dynamic_shapes_by_rule(prepared, leading_axis_only))
    from torch.export import Dim

    from hfexport.conventions import TEXT, input_role, max_positions

    # bounded by the model's positions, so a backend that plans memory (ExecuTorch) does not plan
    # the text at the sample's length
    limit, _ = max_positions(getattr(module, "config", None))
    text_axis = Dim.AUTO(min=1, max=int(limit)) if limit else Dim.AUTO

    def rule(path: str, tensor: torch.Tensor) -> dict[int, Any] | None:
        role = input_role(path, tensor.dim())
        axes = leading_axis_only(path, tensor) or {}
        if role is not None and role.modality == TEXT and role.sequence_axis is not None:
            axes[role.sequence_axis] = text_axis
        return axes or None

    return config.replace(dynamic_shapes=dynamic_shapes_by_rule(prepared, rule))


#: Model types whose generation state is a recurrence (conv / SSM / RWKV / RG-LRU state), not a
#: KV cache. Those in :data:`hfexport.generation.recurrent.RECURRENT_GENERATION_TYPES` (all of them
#: today) get prefill and decode components carrying the state as named tensors (issue 28); any
#: other would be refused up front by :func:`check_generation_cache` instead of failing in
#: ``generate()`` recording, in capture, or writing components the runner cannot feed.
RECURRENT_STATE_TYPES = frozenset({"mamba", "falcon_mamba", "mamba2", "rwkv", "recurrent_gemma"})


#: Why a refused recurrent type has no components yet (the refusal message says it); empty while
#: every type of :data:`RECURRENT_STATE_TYPES` is carried.
_REFUSAL_REASONS: dict[str, str] = {}


def _refused_recurrent_types() -> frozenset[str]:
    from hfexport.generation.recurrent import RECURRENT_GENERATION_TYPES

    return RECURRENT_STATE_TYPES - RECURRENT_GENERATION_TYPES


def check_generation_cache(model: Any) -> None:
    """Refuse a model whose generation state :func:`export_components` cannot carry.

    Raises:
        UnsupportedModelError: ``model.config.model_type`` is a recurrent type without
            prefill/decode components yet (:data:`RECURRENT_STATE_TYPES` minus
            :data:`hfexport.generation.recurrent.RECURRENT_GENERATION_TYPES`); the message says
            what to export instead.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _refused_recurrent_types():
        from hfexport.errors import UnsupportedModelError

        why = _REFUSAL_REASONS.get(model_type, "prefill/decode components that carry it are not built yet")
        raise UnsupportedModelError(
            f"{model_type}'s generation state is a recurrence (its conv/SSM state), not a KV cache; "
            f"{why} (hfexport issue 28). Export the "
            "plain forward instead (CLI: --task auto; Python: exporter.export(model, {'input_ids': ...})), "
            "which runs at any sequence length"
        )


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

    An image encoder whose capture (or, on ExecuTorch, lowering or memory planning:
    :class:`hfexport.errors.DataDependentSizeError`) fails on a data-dependent value while its
    prompt holds a patch grid (``image_grid_thw`` read as values by the tower) is exported once
    more, for one image of
    the sample's grid (:class:`hfexport.generation.multimodal.SizedGridImageFeatures`, a
    re-recorded decomposition); the runner then calls it once per image of that grid.

    Returns:
        :class:`GenerationArtifacts` ``{component: artifact}`` with ``.plan`` and ``.reports``.

    Raises:
        UnsupportedModelError: a model whose generation state is a recurrence
            (:data:`RECURRENT_STATE_TYPES`), before anything runs.
        ValueError: bad inputs or a per-component config with missing entries.
        ComponentExportError: a component failed to export or validate (``RuntimeError``; the
            message names the component, its class and its input keys; the cause is chained).
        RuntimeError: ``generate`` failed while recording.
    """
    # a dtype or quantization method the backend cannot produce is refused before generate() runs
    check_generation_cache(model)
    given = config.values() if isinstance(config, Mapping) and _per_component(config) else [config]
    for one in given:
        exporter.check_precision(exporter._resolve_config(one))
    if decomposition is None:
        decomposition = decompose_for_generation(
            model, inputs, generation_config=generation_config, multi_token_decode=multi_token_decode
        )
    per_image_grid = False
    while True:
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
            and not exporter.generation_support.supports_empty_growing_cache
        ):
            raise ValueError(
                f"the {exporter.export_format} runtime cannot run a decode graph on an empty growing cache, so it "
                "cannot serve the prefill: export the 'prefill' component too, or use a static cache"
            )
        configs = resolve_component_configs(config, names)
        parent_config = getattr(model, "config", None)
        sources = _SourceCopies(exporter, model)
        artifacts: dict[str, Any] = {}
        reports: dict[str, Any] = {}
        resolved_configs: dict[str, Any] = {}
        for name in names:
            module, kwargs = decomposition[name]
            exportable = exportable_module(module, parent_config)
            exportable = exporter.generation_support.prepare_component(name, exportable, kwargs, plan)
            try:
                resolved = exporter._resolve_config(configs[name])
                resolved = _encoder_shapes(name, exportable, kwargs, plan, resolved)
                resolved = exporter.generation_support.component_config(
                    name, exportable, kwargs, plan, resolved
                )
                resolved_configs[name] = resolved
                source = sources.component(name, module, kwargs, plan, resolved)
                artifact = exporter.export(exportable, kwargs, resolved, component=name, source=source)
                reports[name] = exporter.last_report
                _record_second_shape_turned_off(
                    exporter, name, exportable, kwargs, plan, configs[name], resolved
                )
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
                if _grid_read_as_values(name, exc, plan, inputs, per_image_grid):
                    # retried once below with the image encoder exported for one image of one grid
                    sources.release()
                    break
                keys = sorted(kwargs)
                raise ComponentExportError(
                    f"exporting generation component {name!r} ({type(module).__name__}) with inputs {keys} to "
                    f"{exporter.export_format} failed: {type(exc).__name__}: {exc}",
                    component=name,
                    model_class=type(module).__name__,
                    input_keys=keys,
                ) from exc
            artifacts[name] = artifact
        else:
            break
        per_image_grid = True
        logger.info(
            "%s: the image tower reads image_grid_thw as values; exporting it for one image of the sample's grid",
            type(model).__name__,
        )
        decomposition = decompose_for_generation(
            model,
            inputs,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            per_image_grid=True,
        )
    sources.release()
    # the manifest records what each graph takes: float inputs (caches, pixel values) in the
    # component's config.dtype, so the runner casts to it and builds empty caches in it
    reduced = {
        name: str(getattr(c, "dtype", None) or "float32")
        for name, c in resolved_configs.items()
        if str(getattr(c, "dtype", None) or "float32") != "float32"
    }
    if reduced:
        io = {
            name: plan.io[name].in_dtype(reduced[name]) if name in reduced else plan.io[name]
            for name in plan.io
        }
        plan = dataclasses.replace(plan, io=io)
    result = GenerationArtifacts(artifacts, plan, reports, exporter.export_format)
    _record_greedy_parity(exporter, result, model, inputs, resolved_configs, generation_config)
    return result


def _record_second_shape_turned_off(
    exporter: Any, name: str, module: Any, kwargs: Mapping[str, Any], plan: Any, asked: Any, resolved: Any
) -> None:
    """Record stage ``validate_second_shape`` as skipped, with the backend's reason, when its
    generation support turned off the second shape the config asked for (ExecuTorch's steps fed an
    image output without an input role); without the stage the export folder read "a static export,
    or validation is off", which was wrong for a dynamic, validated export (issue 28)."""
    from hfexport.report import Stage

    report = exporter.last_report
    if (
        report is None
        or not getattr(resolved, "is_dynamic", False)
        or not getattr(resolved, "validate", True)
        or getattr(resolved, "validate_second_shape", True)
        or not getattr(asked, "validate_second_shape", True)
        or any(s.name == Stage.VALIDATE_SECOND_SHAPE for s in report.stages)
    ):
        return
    reason = exporter.generation_support.second_shape_skip_reason(name, module, kwargs, plan)
    report.skip(
        Stage.VALIDATE_SECOND_SHAPE,
        reason
        or f"the {exporter.export_format} generation support exports the {name} component without a second shape",
    )


def _grid_read_as_values(
    name: str, exc: BaseException, plan: GenerationPlan, inputs: Mapping[str, Any], retried: bool
) -> bool:
    """True when the image encoder's export failed on a data-dependent value and its prompt holds a
    patch grid (``image_grid_thw``) that the encoder is not yet exported per image for: a tower
    that reads the grid as Python values (HunYuan-V4-VL's and Cosmos3-Edge's position embeddings
    resized with ``F.interpolate`` to each grid, Kimi-K2.5's per-grid frame index; issue 28) is
    then exported for one image of the sample's grid instead.

    The data-dependent failure is recognised anywhere in the exception chain: a guard on an
    unbacked symbol during capture (``GuardOnDataDependentSymNode``, ``data-dependent
    expression``), or a backend's :class:`hfexport.errors.DataDependentSizeError` when the capture
    passed and a later stage could not size the values read (ExecuTorch's lowering or memory
    planning of HunYuan-VL's tower: ``u271 < 1``, a buffer of ``2**36`` elements)."""
    from hfexport.errors import DataDependentSizeError
    from hfexport.generation.multimodal import GRID_INPUTS

    if retried or name != "image_encoder" or plan.architecture != "multimodal" or name in plan.per_image:
        return False
    if not any(isinstance(inputs.get(k), torch.Tensor) for k in GRID_INPUTS):
        return False
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__}: {seen}"
        if isinstance(seen, DataDependentSizeError):
            return True
        if "GuardOnDataDependentSymNode" in text or "data-dependent expression" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: New tokens of the greedy run that a gated (reduced-precision or quantized) generation export is
#: compared with ``model.generate`` on (:func:`_record_greedy_parity`).
GREEDY_PARITY_TOKENS = 16


class _SourceCopies:
    """The transformed copies of the model (``exporter.generation_support.generation_source``), one per distinct
    transform among the component configs, built on first use and shared by every component; a
    component is found in its copy by its qualified name in the model."""

    def __init__(self, exporter: Any, model: torch.nn.Module) -> None:
        self.exporter = exporter
        self.model = model
        self.copies: dict[str, torch.nn.Module | None] = {}
        self.paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}

    @staticmethod
    def _key(config: Any) -> str:
        quantization = getattr(config, "quantization", None)
        to_dict = getattr(quantization, "to_dict", None)
        described = to_dict() if callable(to_dict) else quantization
        return repr((str(getattr(config, "dtype", "float32")), described))

    def component(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: GenerationPlan, config: Any
    ) -> torch.nn.Module | None:
        """The component's module in the transformed copy, adapted as the component itself is
        (:func:`exportable_module`, ``generation_support.prepare_component``), or ``None`` (no transform, or
        the component is no submodule of the model: its own export then transforms it)."""
        key = self._key(config)
        if key not in self.copies:
            self.copies[key] = self.exporter.generation_support.generation_source(self.model, config)
        copy = self.copies[key]
        path = self.paths.get(id(module))
        if copy is None or path is None:
            return None
        part = copy.get_submodule(path)
        exportable = exportable_module(part, getattr(copy, "config", None))
        return self.exporter.generation_support.prepare_component(name, exportable, kwargs, plan)

    def release(self) -> None:
        self.copies.clear()


def _record_greedy_parity(
    exporter: Any,
    artifacts: GenerationArtifacts,
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    configs: Mapping[str, Any],
    generation_config: Any,
) -> None:
    """For a gated export (reduced precision or quantization, :func:`hfexport.quality.quality_gates_for`),
    run a greedy generation of :data:`GREEDY_PARITY_TOKENS` tokens over the exported components
    next to ``model.generate`` (fp32 eager) and record in the ``decode`` component's report
    (``report.greedy_parity``): ``new_tokens``, ``matching_prefix`` (new tokens equal to
    eager's before the first divergence), ``first_divergence`` (``[row, new-token index]`` or
    ``None``), ``tokens_equal`` and the per-step ``top1_agreement`` of the runner's logits with
    ``generate``'s over the steps both ran on the same prefix. Reported, not gated: the component
    gates (top-1 of the logits over the sample tokens) are; a quantized model may legitimately
    pick another token once two logits are close, and every later token then differs. A failure
    to run the loop is recorded as ``error`` and does not fail the export."""
    from hfexport.generation.parity import compare_with_generate
    from hfexport.generation.runner import GenerationRunner, callers_from_exporter
    from hfexport.verify.gates import quality_gates_for

    if not artifacts or not any(quality_gates_for(c) is not None for c in configs.values()):
        return
    if not all(getattr(c, "validate", True) for c in configs.values()):
        return
    report = artifacts.reports.get("decode") or artifacts.reports[list(artifacts)[-1]]
    record: dict[str, Any] = {"new_tokens": GREEDY_PARITY_TOKENS}
    try:
        runner = GenerationRunner(artifacts.plan, callers_from_exporter(exporter, artifacts))
        parity = compare_with_generate(
            runner, model, inputs, max_new_tokens=GREEDY_PARITY_TOKENS, generation_config=generation_config
        )
        prompt = int(inputs["input_ids"].shape[1])
        divergence = parity.first_mismatch
        record["first_divergence"] = (
            None if divergence is None else [divergence[0], max(0, divergence[1] - prompt)]
        )
        record["matching_prefix"] = (
            GREEDY_PARITY_TOKENS if divergence is None else max(0, divergence[1] - prompt)
        )
        record["tokens_equal"] = parity.tokens_equal
        steps = record["matching_prefix"] + (0 if divergence is None else 1)
        agree = [
            float((ours.argmax(-1) == theirs.argmax(-1).to(ours.device)).double().mean())
            for ours, theirs in list(zip(runner.last_logits, parity.reference_logits))[:steps]
        ]
        record["top1_agreement"] = round(sum(agree) / len(agree), 4) if agree else None
        record["sequence"] = parity.sequences[0, prompt:].tolist()
        record["reference"] = parity.reference[0, prompt:].tolist()
    except Exception as exc:  # reported, never fatal: the components passed their gates
        logger.warning("greedy parity of the exported components could not run: %s", exc)
        record["error"] = f"{type(exc).__name__}: {exc}"
    report.greedy_parity = record
    logger.info("greedy parity vs model.generate: %s", record)
