"""Check and convert sample forward kwargs for export: :func:`prepare_for_export`.

Refuses the loss/training path, lifts the output flags, casts tensors to the model's dtype and
device, and precomputes data-dependent inputs with the registered preparers
(:mod:`hfexport.workarounds.input_preparers`, applied by :func:`precompute_export_inputs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

from hfexport.errors import UnsupportedInputError
from hfexport.input_checks import check_forward_kwargs, check_input_sizes, check_model, check_token_ids
from hfexport.inputs.config_undo import model_configs
from hfexport.inputs.flags import OUTPUT_FLAG_KEYS
from hfexport.tasks import CACHELESS_HEAD_SUFFIXES
from hfexport.tensors import cast_leaf_tensors
from hfexport.workarounds.input_preparers import apply_export_input_preparers

__all__ = ["LOSS_INPUT_KEYS", "precompute_export_inputs", "prepare_for_export"]

#: Forward kwargs that only feed a loss: exporting them would export the training path.
LOSS_INPUT_KEYS: tuple[str, ...] = (
    "labels",
    "future_values",
    "start_positions",
    "end_positions",
    "next_sentence_label",
    "sentence_order_label",
    "mc_labels",
)


def precompute_export_inputs(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply every registered preparer whose markers are all present in ``inputs``.

    Registers the built-in vision-language preparers first, then runs
    :func:`hfexport.workarounds.input_preparers.apply_export_input_preparers`.

    Args:
        model: the model being exported, passed to each preparer.
        inputs: forward kwargs; not modified.

    Returns:
        A new dict of forward kwargs: the output of the last matching preparer, or a copy of
        ``inputs`` if none matched.

    Raises:
        TypeError: a preparer returned something other than a mapping.
    """
    import hfexport.generation.vision_inputs  # noqa: F401  (registers the built-in vision-language preparers)

    return apply_export_input_preparers(model, inputs)


def _model_dtype_and_device(model: Any) -> tuple[torch.dtype | None, torch.device | None]:
    dtype = device = None
    try:
        dtype = model.dtype
    except (AttributeError, StopIteration):
        pass
    try:
        device = model.device
    except (AttributeError, StopIteration):
        pass
    if isinstance(model, torch.nn.Module) and (dtype is None or device is None):
        for parameter in model.parameters():
            device = device if device is not None else parameter.device
            if dtype is None and parameter.is_floating_point():
                dtype = parameter.dtype
            if dtype is not None:
                break
    if dtype is not None and not dtype.is_floating_point:
        dtype = None
    return dtype, device


def _teacher_forces_future_values(model: Any) -> bool:
    """Whether ``model``'s forward decodes the forecast horizon from ``future_values`` (informer,
    autoformer, time_series_transformer: their forward also takes ``future_time_features`` and
    returns the horizon's distribution parameters only when ``future_values`` is given), so that
    ``future_values`` is a teacher-forced decoder input there, not only the loss's target."""
    import inspect

    try:
        return "future_time_features" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def prepare_for_export(model: Any, inputs: Mapping[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Check and convert sample forward kwargs for export.

    Steps, in order: refuse a model that is not an ``nn.Module`` with a keyword forward; refuse
    loss inputs; refuse kwargs the forward does not take and inputs whose shared axes disagree or
    are empty (:mod:`hfexport.input_checks`); lift the output flags out of the kwargs (a plain
    ``nn.Module`` without a transformers config keeps them as forward kwargs); for a head that
    never generates (``...ForSequenceClassification``, ``...ForTokenClassification``,
    ``...ForQuestionAnswering``, ``...ForMultipleChoice``) whose forward takes ``use_cache`` and
    whose config turns the cache on, add ``use_cache=False`` to the output flags unless the inputs
    set it (the program returns the scores, not a KV cache nobody reads); cast floating
    point tensors to the model's dtype and move every tensor (caches included) to the model's
    device; run :func:`precompute_export_inputs`. Neither ``model`` nor ``inputs`` is modified.

    Args:
        model: the ``PreTrainedModel`` (or any ``nn.Module`` with a keyword forward) to export.
        inputs: forward kwargs (``model(**inputs)``): tensors such as ``input_ids`` (int64
            ``[batch, seq]``), ``attention_mask``, ``pixel_values`` (float), caches, flags.

    Returns:
        ``(model, prepared_inputs, output_flags)``: the same model object; a new dict of
        kwargs without the flags; ``{flag: value}`` for the flags among ``use_cache``,
        ``output_attentions``, ``output_hidden_states``, ``return_dict`` that were given a
        non-None value (plus the head's ``use_cache=False`` above), to apply with
        :func:`apply_output_flags`.

    Raises:
        TypeError: ``inputs`` is not a mapping with string keys; ``model`` is not an ``nn.Module``
            or its forward takes no keyword arguments.
        UnsupportedInputError: ``inputs`` carries a loss input (``labels``, ``future_values``,
            ``start_positions``, ... with a non-None value; ``future_values`` is accepted by a
            forecaster whose forward also takes ``future_time_features``, which decodes from it) or ``return_loss=True``; a kwarg the
            forward does not take; inputs whose batch or sequence sizes disagree, or an empty
            batch/sequence axis; token ids that are not an integer tensor, or ``input_ids``
            outside the model's vocabulary (:func:`hfexport.input_checks.check_token_ids`). The
            message names the key (and sizes or values) and what to do.
    """
    check_model(model)
    if not isinstance(inputs, Mapping) or not all(isinstance(key, str) for key in inputs):
        raise TypeError(
            f"prepare_for_export expects forward kwargs as a dict with string keys, got {type(inputs).__name__}"
        )
    prepared = dict(inputs)

    for key in LOSS_INPUT_KEYS:
        if key == "future_values" and _teacher_forces_future_values(model):
            continue  # informer-like forecasters decode the horizon from it (issue 28)
        if prepared.get(key) is not None:
            raise UnsupportedInputError(
                f"the sample inputs contain {key!r}, which only feeds the loss: the loss/training path is not "
                f"exported. Drop {key!r} from the inputs to export the inference forward."
            )
        prepared.pop(key, None)
    if "return_loss" in prepared:
        if prepared["return_loss"]:
            raise UnsupportedInputError(
                "the sample inputs set 'return_loss=True': the loss/training path is not exported. "
                "Drop 'return_loss' from the inputs to export the inference forward."
            )
        prepared.pop("return_loss")

    check_forward_kwargs(model, prepared, extra_names=OUTPUT_FLAG_KEYS)
    check_token_ids(model, prepared)
    check_input_sizes(prepared)

    output_flags: dict[str, Any] = {}
    has_config = isinstance(getattr(model, "config", None), PreTrainedConfig)
    for key in OUTPUT_FLAG_KEYS if has_config else ():
        if key in prepared:
            value = prepared.pop(key)
            if value is not None:
                output_flags[key] = value

    if has_config and "use_cache" not in inputs and _scores_without_cache(model):
        output_flags["use_cache"] = False

    dtype, device = _model_dtype_and_device(model)
    prepared = cast_leaf_tensors(prepared, dtype=dtype, device=device)
    prepared = precompute_export_inputs(model, prepared)
    return model, prepared, output_flags


def _scores_without_cache(model: Any) -> bool:
    """Whether ``model`` is a head that scores its whole input and never generates (a class whose
    name ends with one of :data:`hfexport.tasks.CACHELESS_HEAD_SUFFIXES`), takes ``use_cache`` in
    its forward and has a config that turns the cache on: exported as is, its program would return
    the KV cache (``past_key_values``) beside the scores, outputs no caller of a classifier reads."""
    if not type(model).__name__.endswith(CACHELESS_HEAD_SUFFIXES):
        return False
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "use_cache" not in parameters:
        return False
    return any(getattr(config, "use_cache", None) for config in model_configs(model))
