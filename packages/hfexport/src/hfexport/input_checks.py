"""Checks of the model and its sample forward kwargs, run before anything is traced.

:func:`hfexport.inputs.prepare_for_export` calls them, so every backend refuses the same bad
inputs with the same typed errors, before capture:

- :func:`check_model`: the model is an ``nn.Module`` whose forward takes keyword arguments;
- :func:`check_forward_kwargs`: every kwarg is one the forward names, or, for a forward taking
  ``**kwargs``, one that it can route (see the rule there); required parameters are given;
- :func:`check_input_sizes`: inputs that share an axis by their role (the input-role table,
  :mod:`hfexport.conventions.roles`) have one size on it, and no role axis is empty;
- :func:`check_token_ids`: token-id inputs (``input_ids``, ``decoder_input_ids``) are integer
  tensors, and ``input_ids`` lie inside the model's vocabulary (torch would otherwise fail deep in
  capture, or only in the eager reference, with "index out of range in self").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.conventions import input_role, is_known_input
from hfexport.errors import UnsupportedInputError

__all__ = [
    "check_forward_kwargs",
    "check_input_sizes",
    "check_model",
    "check_token_ids",
    "shared_axis_groups",
]

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_model(model: Any) -> None:
    """Refuse what is not an ``nn.Module``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (``None``, a function, a pipeline...);
            the message says what is needed.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"export needs a torch.nn.Module whose forward takes keyword arguments (a transformers "
            f"PreTrainedModel or your own module), got {type(model).__name__}"
        )


def _forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=512)
def _class_forward_names(cls: type) -> frozenset[str]:
    forward = getattr(cls, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(n for n, p in params.items() if p.kind in _KEYWORD)


def _routed_names(model: torch.nn.Module) -> set[str]:
    """Names a forward taking ``**kwargs`` can route: the parameters of every submodule's forward
    and the transformers kwargs its layers read."""
    names: set[str] = set()
    for module in model.modules():
        names |= _class_forward_names(type(module))
    try:
        from transformers.utils.generic import TransformersKwargs

        names |= set(getattr(TransformersKwargs, "__annotations__", {}))
    except ImportError:  # pragma: no cover - older transformers
        pass
    return names


def check_forward_kwargs(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, extra_names: tuple[str, ...] = ()
) -> None:
    """Refuse kwargs the model's forward cannot take, and a forward that takes no keywords.

    The rule: a kwarg is accepted when the forward names it as a parameter. When the forward also
    takes ``**kwargs``, a kwarg it does not name is accepted when it is in the input-role table,
    is a parameter of the forward of one of the model's submodules (transformers models route
    ``pixel_values``, ``cache_position``, ``position_ids`` ... to their inner models by name),
    is a transformers attention kwarg (``TransformersKwargs``), an output flag, or its value is
    a transformers ``Cache``, or it is among ``extra_names`` (the caller's output flags). Anything else (a typo such as ``foo=``) would be swallowed by
    ``**kwargs`` and never reach the graph.

    Args:
        model: the module (already checked with :func:`check_model`).
        inputs: the sample forward kwargs.
        extra_names: more names a ``**kwargs`` forward accepts.

    Raises:
        TypeError: the forward has required positional-only parameters, or takes only
            ``*args`` (it cannot be called with keyword arguments).
        UnsupportedInputError: a kwarg the forward does not take (the message names it and
            lists the forward's parameters), or a required parameter without a sample value.
    """
    signature = _forward_signature(model)
    if signature is None:
        return
    params = signature.parameters
    cls = type(model).__name__
    positional_only = [
        n for n, p in params.items() if p.kind == inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty
    ]
    named = [n for n, p in params.items() if p.kind in _KEYWORD]
    var_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if positional_only or (not named and not var_keyword):
        what = (
            f"positional-only parameter(s) {positional_only}"
            if positional_only
            else "positional arguments only"
        )
        raise TypeError(
            f"export needs a torch.nn.Module whose forward takes keyword arguments: {cls}.forward takes {what}, "
            f"and the export calls model(**sample_inputs). Wrap the model in a module whose forward names each "
            f"input as a keyword parameter (def forward(self, x): return model(x))."
        )
    unknown = [k for k in inputs if k not in params or params[k].kind not in _KEYWORD]
    if unknown and var_keyword:
        routed: set[str] | None = None
        still = []
        for key in unknown:
            if is_known_input(key) or key in extra_names or _is_cache(inputs[key]):
                continue
            if routed is None:
                routed = _routed_names(model)
            if key not in routed:
                still.append(key)
        unknown = still
    if unknown:
        raise UnsupportedInputError(
            f"the sample inputs give {unknown}, which {cls}.forward does not take "
            f"(its parameters: {named}); a kwarg the forward does not name would be ignored or fail at "
            f"trace time. Remove {unknown} from the inputs or rename them to forward parameters."
        )
    missing = [
        n for n, p in params.items() if p.kind in _KEYWORD and p.default is p.empty and n not in inputs
    ]
    if missing:
        raise UnsupportedInputError(
            f"{cls}.forward requires {missing}, which the sample inputs do not give; add a sample value for each"
        )


def _is_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, Cache)


def _has_cache(inputs: Mapping[str, Any]) -> bool:
    return any(
        _is_cache(v) or (k in ("past_key_values", "cache") and v is not None) for k, v in inputs.items()
    )


def _describe(key: str, tensor: torch.Tensor) -> str:
    return f"{key} {list(tensor.shape)}"


def shared_axis_groups(inputs: Mapping[str, Any]) -> dict[tuple[str, str], list[tuple[str, int]]]:
    """The axes the top-level tensors of ``inputs`` share by their role (the input-role table).

    Returns:
        ``{(what, name): [(input, axis), ...]}`` with ``what`` ``"batch"`` (``name`` the modality:
        ``text``, ``image`` ...) or ``"sequence"`` (``name`` the sequence group: ``text``,
        ``decoder``, ``signal``). With a cache among the inputs the masks are left out of the
        sequence groups (they cover past and new tokens).
    """
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    cached = _has_cache(inputs)
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for key, tensor in tensors.items():
        role = input_role(key, tensor.dim(), present=inputs)
        if role is None:
            continue
        if role.batch_axis is not None:
            groups.setdefault(("batch", role.modality), []).append((key, role.batch_axis))
        if (
            role.sequence_axis is not None
            and role.sequence is not None
            and not (cached and role.kind == "mask")
        ):
            groups.setdefault(("sequence", role.sequence), []).append((key, role.sequence_axis))
    return groups


def check_input_sizes(inputs: Mapping[str, Any]) -> None:
    """Refuse sample inputs whose shared axes disagree, or with an empty role axis.

    From the input-role table (at each tensor's rank), for the top-level tensors:

    - the batch axes of the inputs of one modality have one size (``input_ids``,
      ``attention_mask``, ``decoder_input_ids`` ... for text; a text ``attention_mask`` next to
      ``input_values`` counts as audio). Different modalities are not compared: CLIP takes any
      number of images next to its texts, LLaVA several images per prompt;
    - the sequence axes of one group have one length (``input_ids``, ``attention_mask``,
      ``token_type_ids``, 2-D ``position_ids`` ...; the decoder's; raw audio and its mask).
      With a cache among the inputs the masks are not compared (they cover past and new tokens);
    - no batch, sequence or spatial axis has size 0.

    Raises:
        UnsupportedInputError: the message names the inputs, their shapes and the axis, and says
            to give inputs that agree.
    """
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    for key, tensor in tensors.items():
        role = input_role(key, tensor.dim(), present=inputs)
        if role is None:
            continue
        for axis, meaning in role.axes().items():
            if tensor.shape[axis] == 0:
                raise UnsupportedInputError(
                    f"{_describe(key, tensor)} has size 0 on axis {axis} (its {meaning} axis); an empty "
                    f"{meaning} cannot be exported. Give at least one "
                    f"{'token' if meaning == 'sequence' else 'row' if meaning == 'batch' else 'pixel'} there."
                )
    groups = shared_axis_groups(inputs)
    for (what, name), members in groups.items():
        sizes = {int(tensors[k].shape[a]) for k, a in members}
        if len(sizes) < 2:
            continue
        first_key, first_axis = members[0]
        other_key, other_axis = next(
            (k, a) for k, a in members if tensors[k].shape[a] != tensors[first_key].shape[first_axis]
        )
        label = f"{name} batch" if what == "batch" else f"{name} sequence length"
        raise UnsupportedInputError(
            f"the sample inputs disagree on the {label}: {_describe(first_key, tensors[first_key])} has "
            f"{tensors[first_key].shape[first_axis]} on axis {first_axis}, "
            f"{_describe(other_key, tensors[other_key])} has {tensors[other_key].shape[other_axis]} on axis "
            f"{other_axis}. Give inputs of one {label} (as a tokenizer/processor call returns them)."
        )


_IDS_ALLOWED = "an integer (torch.long) tensor [batch, sequence] of token ids, as tokenizer(..., return_tensors='pt') gives"


def _embedding_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding table (its vocabulary size), or ``None`` when the model
    has no ``nn.Embedding`` input embedding (a plain module, a model reading float features)."""
    get = getattr(model, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        embedding = get()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    if isinstance(embedding, torch.nn.Embedding):
        return int(embedding.num_embeddings)
    return None


def check_token_ids(model: torch.nn.Module, inputs: Mapping[str, Any]) -> None:
    """Refuse token-id inputs that the model's embedding lookup cannot take, before capture.

    For every input whose role is token ids (``input_ids``, ``decoder_input_ids``):

    - a value that is not a tensor (a ``str``, a Python ``list``, a number) is refused: the
      export traces tensors (tokenize first);
    - for a model whose input embedding is an ``nn.Embedding`` (every transformers text model), a
      2-D floating point, complex or bool tensor is refused (the lookup takes integer ids), and
      ``input_ids`` must lie in ``[0, vocabulary size)`` (the embedding's rows).

    Args:
        model: the module to export (already checked with :func:`check_model`).
        inputs: the sample forward kwargs.

    Raises:
        UnsupportedInputError: the message names the input, its value (type, dtype or the
            offending ids) and what is allowed.
    """
    rows: int | None = None
    looked_up = False  # the embedding is looked up on first need
    for key, value in inputs.items():
        role = input_role(key)
        if role is None or role.kind != "ids" or value is None:
            continue
        if not isinstance(value, torch.Tensor):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise UnsupportedInputError(
                f"{key}={shown} is a {type(value).__name__}, which is invalid; allowed: {_IDS_ALLOWED}. "
                f"Tokenize the text first, or wrap the ids: torch.tensor([[...]])"
            )
        if value.dim() != role.ndim:
            continue  # another rank (a toy model's float features under this name): not ids
        if not looked_up:
            rows, looked_up = _embedding_rows(model), True
        if rows is None:
            continue
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise UnsupportedInputError(
                f"{key} is a {str(value.dtype).replace('torch.', '')} tensor {list(value.shape)}, which is invalid; "
                f"allowed: {_IDS_ALLOWED}; {type(model).__name__} looks ids up in its embedding table. "
                f"Pass {key}.long(), or inputs_embeds for float embeddings"
            )
        if key != "input_ids" or value.numel() == 0:
            continue
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= rows:
            bad = sorted({int(v) for v in value.flatten().tolist() if v < 0 or v >= rows})
            shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
            raise UnsupportedInputError(
                f"{key} holds token ids [{shown}] outside the vocabulary of {type(model).__name__}, which is "
                f"invalid; allowed: ids from 0 to {rows - 1} (its input embedding has {rows} rows). Tokenize "
                f"with the model's own tokenizer, or pass ids below {rows}"
            )
