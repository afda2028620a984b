"""Turn sample forward kwargs into inputs that ``torch.export`` can trace, reversibly.

An export takes forward kwargs (``model(**inputs)``). Before tracing them:

- the loss/training path is refused (``labels``, ``future_values``, ``return_loss=True``, ...);
- output flags (``use_cache``, ``output_attentions``, ``output_hidden_states``,
  ``return_dict``) are lifted out of the kwargs, to be applied to the config for the duration
  of the export with :func:`apply_output_flags` (python bools are not graph inputs);
- floating point tensors are cast to the model's dtype, every tensor goes to its device;
- data-dependent inputs that tracing cannot compute are precomputed by the preparers
  registered with :func:`register_export_input_preparer`.

The context managers :func:`apply_output_flags`, :func:`attention_for_export` and
:func:`restore_model_state` change the model only inside their ``with`` body and put back the
exact previous state on exit, also when the body raises.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import ModelOutput

from hfexport.errors import UnsupportedInputError, UnsupportedModelError
from hfexport.input_checks import check_forward_kwargs, check_input_sizes, check_model
from hfexport.tensors import cast_leaf_tensors
from hfexport.workarounds.preparers import (
    ExportInputPreparer,
    apply_export_input_preparers,
    register_export_input_preparer,
    registered_export_input_preparers,
    unregister_export_input_preparer,
)

__all__ = [
    "LOSS_INPUT_KEYS",
    "OUTPUT_FLAG_KEYS",
    "ExportInputPreparer",
    "apply_output_flags",
    "attention_for_export",
    "precompute_export_inputs",
    "prepare_for_export",
    "register_export_input_preparer",
    "registered_export_input_preparers",
    "restore_model_state",
    "unregister_export_input_preparer",
]

logger = logging.getLogger(__name__)

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

#: Forward kwargs that select outputs; lifted into the config rather than traced.
OUTPUT_FLAG_KEYS: tuple[str, ...] = ("use_cache", "output_attentions", "output_hidden_states", "return_dict")

# Attention implementations that torch.export cannot trace (custom kernels, flex's
# higher-order op, paged attention with its own cache).
_UNTRACEABLE_ATTENTION_PREFIXES: tuple[str, ...] = ("flash_attention", "flex_attention", "paged|", "paged_")


# --------------------------------------------------------------------------------------------
# Config bookkeeping shared by the context managers
# --------------------------------------------------------------------------------------------


def _model_configs(model: Any) -> list[PreTrainedConfig]:
    """Every config object of ``model``: its config, nested sub-configs, submodules' configs."""
    found: dict[int, PreTrainedConfig] = {}

    def add(config: Any) -> None:
        if not isinstance(config, PreTrainedConfig) or id(config) in found:
            return
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            add(getattr(config, key, None))

    root = getattr(model, "config", None)
    add(root)
    if isinstance(root, PreTrainedConfig):
        for decoder in (True, False):
            try:
                add(root.get_text_config(decoder=decoder, encoder=not decoder))
            except (AttributeError, TypeError, ValueError):
                pass
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            add(getattr(module, "config", None))
    return list(found.values())


class _ConfigChanges:
    """Records raw ``__dict__`` changes made to configs, to undo them exactly.

    Setting a config attribute may go through a property with side effects (setting
    ``output_attentions=True`` may also set ``_attn_implementation``), so what is recorded is
    the difference of the instance dict before and after, not just the attribute set.
    """

    def __init__(self) -> None:
        self._records: list[tuple[PreTrainedConfig, str, bool, Any]] = []

    def capture(self, config: PreTrainedConfig, before: dict[str, Any]) -> None:
        after = vars(config)
        for key in list(before) + [key for key in after if key not in before]:
            if key not in after or key not in before or after[key] is not before[key]:
                self._records.append((config, key, key in before, before.get(key)))

    def setattr(self, config: PreTrainedConfig, name: str, value: Any) -> None:
        before = dict(vars(config))
        try:
            setattr(config, name, value)
        finally:
            self.capture(config, before)

    def undo(self) -> None:
        for config, key, existed, old in reversed(self._records):
            if existed:
                config.__dict__[key] = old
            else:
                config.__dict__.pop(key, None)
        self._records.clear()


# --------------------------------------------------------------------------------------------
# Output flags
# --------------------------------------------------------------------------------------------


_MISSING = object()


def _wrap_forward_return_dict(model: torch.nn.Module, return_dict: bool) -> Callable[[], None]:
    """Make ``model(...)`` return a tuple (False) or a ModelOutput (True); return the undo."""
    original = model.forward
    previous = model.__dict__.get("forward", _MISSING)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if return_dict and getattr(getattr(model, "config", None), "return_dict", True) is False:
            kwargs.setdefault("return_dict", True)
        output = original(*args, **kwargs)
        if not return_dict and isinstance(output, ModelOutput):
            output = output.to_tuple()
        return output

    model.forward = forward

    def undo() -> None:
        if previous is _MISSING:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = previous

    return undo


@contextlib.contextmanager
def apply_output_flags(model: Any, output_flags: Mapping[str, Any]) -> Iterator[None]:
    """Apply output flags to the model for the duration of the ``with`` body.

    Each flag but ``return_dict`` is set on ``model.config`` (created if the config lacks it)
    and on every other config of the model that already has the attribute: nested sub-configs
    (``text_config``, ``vision_config``, ...) and the configs of sub-models; transformers reads
    ``use_cache``, ``output_attentions`` and ``output_hidden_states`` from there when the kwarg
    is absent.

    ``return_dict`` is not written to the config: in transformers 5.x ``config.return_dict``
    is read by every nested sub-model, so ``False`` there makes the inner model return a tuple
    to an outer model that expects a ``ModelOutput``. Instead ``model.forward`` is wrapped on
    the instance: with ``False`` a ``ModelOutput`` result is turned into ``output.to_tuple()``
    (None fields dropped, as transformers does); with ``True`` nothing changes unless the
    config says ``return_dict=False``, in which case ``return_dict=True`` is passed.

    On exit, also when the body raises, every config is put back exactly as it was: previous
    values restored, attributes that did not exist deleted, side effects of property setters
    undone; the forward wrapper is removed.

    Args:
        model: a ``PreTrainedModel`` (a ``torch.nn.Module`` with a transformers ``config``).
        output_flags: ``{name: value}``, typically the ``output_flags`` returned by
            :func:`prepare_for_export` (``use_cache``, ``output_attentions``,
            ``output_hidden_states``, ``return_dict``). ``None`` values are ignored.

    Yields:
        Nothing; the model is configured inside the ``with`` body.

    Raises:
        UnsupportedInputError: a flag is refused by the config, e.g. ``output_attentions=True``
            with an attention implementation other than ``eager`` (nothing stays changed).
        TypeError: ``model`` has no transformers config and a flag has a non-None value (with no
            flags, a plain module passes through unchanged).
    """
    root = getattr(model, "config", None)
    if not isinstance(root, PreTrainedConfig):
        if not any(value is not None for value in output_flags.values()):
            yield  # a plain module: no config flags to apply
            return
        raise TypeError(
            f"apply_output_flags needs a model with a transformers config to apply {sorted(output_flags)}, got "
            f"{type(model).__name__}; pass flags of a plain module as forward kwargs (prepare_for_export keeps them)"
        )
    changes = _ConfigChanges()
    undo_forward: Callable[[], None] | None = None
    configs = _model_configs(model)
    try:
        for name, value in output_flags.items():
            if value is None:
                continue
            if name == "return_dict":
                undo_forward = _wrap_forward_return_dict(model, bool(value))
                continue
            for config in configs:
                if config is root or hasattr(config, name):
                    try:
                        changes.setattr(config, name, value)
                    except ValueError as error:
                        raise UnsupportedInputError(
                            f"cannot set {name}={value!r} on {type(config).__name__} for export: {error} "
                            + (
                                "Load the model with attn_implementation='eager' to export attention weights, "
                                "or drop output_attentions from the inputs."
                                if name == "output_attentions"
                                else f"Drop {name} from the inputs."
                            )
                        ) from error
        yield
    finally:
        if undo_forward is not None:
            undo_forward()
        changes.undo()


# --------------------------------------------------------------------------------------------
# Attention implementation
# --------------------------------------------------------------------------------------------


def _is_untraceable_attention(implementation: Any) -> bool:
    if not isinstance(implementation, str) or implementation in ("eager", "sdpa"):
        return False
    # Hub kernels are named "org/repo[:kernel]".
    return implementation.startswith(_UNTRACEABLE_ATTENTION_PREFIXES) or "/" in implementation


def _attention_tree(config: PreTrainedConfig) -> dict[str, Any]:
    """Nested ``set_attn_implementation`` request: sdpa where untraceable, unchanged elsewhere."""
    current = config._attn_implementation
    tree: dict[str, Any] = {"": "sdpa" if _is_untraceable_attention(current) else current}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig):
            tree[key] = _attention_tree(sub)
    return tree


@contextlib.contextmanager
def attention_for_export(model: Any) -> Iterator[None]:
    """Switch untraceable attention implementations to ``sdpa`` for the ``with`` body.

    ``torch.export`` traces ``eager`` and ``sdpa`` attention; flash attention kernels
    (``flash_attention_2/3/4``), ``flex_attention``, paged attention and hub kernels do not
    trace. Configs (the model's, its sub-configs', its sub-models') using one of those are
    switched to ``sdpa`` through ``model.set_attn_implementation``; configs on ``eager`` or
    ``sdpa`` are left alone, so a model with nothing to switch is not touched. On exit, also
    when the body raises, every config gets its exact previous implementation back (written
    directly, so restoring a flash implementation does not need flash-attn installed).

    Args:
        model: a ``PreTrainedModel``; other objects are passed through untouched.

    Yields:
        Nothing; inside the body every attention implementation is ``eager`` or ``sdpa``.

    Raises:
        UnsupportedModelError: an untraceable implementation is set and the model (or one of
            its sub-models) cannot switch to sdpa: no sdpa support (``_supports_sdpa`` is
            False), or no dynamic switching. The message says to load the model with
            ``attn_implementation="sdpa"`` or ``"eager"``.
    """
    configs = _model_configs(model)
    untraceable = {
        type(config).__name__: config._attn_implementation
        for config in configs
        if _is_untraceable_attention(getattr(config, "_attn_implementation", None))
    }
    if not untraceable:
        yield
        return

    def unsupported(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{type(model).__name__} uses attention {untraceable}, which torch.export cannot trace, and it "
            f"cannot be switched to sdpa: {reason}. Export needs sdpa or eager attention: load the model with "
            f'from_pretrained(..., attn_implementation="sdpa") or, if sdpa is not supported, '
            f'attn_implementation="eager".'
        )

    if not getattr(model, "_supports_sdpa", False):
        raise unsupported(f"{type(model).__name__} does not support sdpa")
    set_attn_implementation = getattr(model, "set_attn_implementation", None)
    if set_attn_implementation is None:
        raise unsupported(f"{type(model).__name__} has no set_attn_implementation")

    changes = _ConfigChanges()
    try:
        before = {id(config): dict(vars(config)) for config in configs}
        try:
            set_attn_implementation(_attention_tree(model.config))
        except (ValueError, ImportError) as error:
            raise unsupported(str(error)) from error
        finally:
            for config in configs:
                changes.capture(config, before[id(config)])
        still = [
            type(config).__name__
            for config in configs
            if _is_untraceable_attention(getattr(config, "_attn_implementation", None))
        ]
        if still:
            raise unsupported(f"the switch did not apply to {still} (no dynamic attention dispatch)")
        logger.info("attention %s switched to sdpa for export", untraceable)
        yield
    finally:
        changes.undo()


# --------------------------------------------------------------------------------------------
# Model state
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def restore_model_state(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put the model in eval mode for the ``with`` body, then restore what may have changed.

    Snapshots every submodule's ``training`` flag, every parameter's ``requires_grad`` flag and
    the attributes of every config of the model; restores them on exit, also when the body
    raises (config attributes added inside are deleted, changed ones get their old object
    back). Weights are not copied: export must never modify them.

    Args:
        model: the model (any ``torch.nn.Module``).

    Yields:
        The same model, in eval mode.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    check_model(model)
    training = [(module, module.training) for module in model.modules()]
    requires_grad = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    configs = _model_configs(model)
    snapshots = [(config, dict(vars(config))) for config in configs]
    try:
        model.eval()
        yield model
    finally:
        for module, flag in training:
            module.training = flag
        for parameter, flag in requires_grad:
            if parameter.requires_grad != flag:
                parameter.requires_grad_(flag)
        changes = _ConfigChanges()
        for config, snapshot in snapshots:
            changes.capture(config, snapshot)
        changes.undo()


# --------------------------------------------------------------------------------------------
# Data-dependent input preparers (a kind of the central registry, hfexport.workarounds.preparers)
# --------------------------------------------------------------------------------------------


def precompute_export_inputs(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply every registered preparer whose markers are all present in ``inputs``.

    Registers the built-in vision-language preparers first, then runs
    :func:`hfexport.workarounds.preparers.apply_export_input_preparers`.

    Args:
        model: the model being exported, passed to each preparer.
        inputs: forward kwargs; not modified.

    Returns:
        A new dict of forward kwargs: the output of the last matching preparer, or a copy of
        ``inputs`` if none matched.

    Raises:
        TypeError: a preparer returned something other than a mapping.
    """
    import hfexport.generation.preparers  # noqa: F401  (registers the built-in vision-language preparers)

    return apply_export_input_preparers(model, inputs)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


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


def prepare_for_export(model: Any, inputs: Mapping[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Check and convert sample forward kwargs for export.

    Steps, in order: refuse a model that is not an ``nn.Module`` with a keyword forward; refuse
    loss inputs; refuse kwargs the forward does not take and inputs whose shared axes disagree or
    are empty (:mod:`hfexport.input_checks`); lift the output flags out of the kwargs (a plain
    ``nn.Module`` without a transformers config keeps them as forward kwargs); cast floating
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
        non-None value, to apply with :func:`apply_output_flags`.

    Raises:
        TypeError: ``inputs`` is not a mapping with string keys; ``model`` is not an ``nn.Module``
            or its forward takes no keyword arguments.
        UnsupportedInputError: ``inputs`` carries a loss input (``labels``, ``future_values``,
            ``start_positions``, ... with a non-None value) or ``return_loss=True``; a kwarg the
            forward does not take; inputs whose batch or sequence sizes disagree, or an empty
            batch/sequence axis. The message names the key (and sizes) and what to do.
    """
    check_model(model)
    if not isinstance(inputs, Mapping) or not all(isinstance(key, str) for key in inputs):
        raise TypeError(
            f"prepare_for_export expects forward kwargs as a dict with string keys, got {type(inputs).__name__}"
        )
    prepared = dict(inputs)

    for key in LOSS_INPUT_KEYS:
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
    check_input_sizes(prepared)

    output_flags: dict[str, Any] = {}
    has_config = isinstance(getattr(model, "config", None), PreTrainedConfig)
    for key in OUTPUT_FLAG_KEYS if has_config else ():
        if key in prepared:
            value = prepared.pop(key)
            if value is not None:
                output_flags[key] = value

    dtype, device = _model_dtype_and_device(model)
    prepared = cast_leaf_tensors(prepared, dtype=dtype, device=device)
    prepared = precompute_export_inputs(model, prepared)
    return model, prepared, output_flags
