"""Multi-token decode: merge single-token decode steps into one step with a longer query.

A decode graph captured from one single-token step has a query length of 1, which
``torch.export`` specialises (an axis of size 1 is never symbolic under ``Dim.AUTO``). Capturing
instead one call that carries two consecutive steps (the same cache as the first step, the tokens
of both) gives a query axis of size 2, which stays symbolic with ``dynamic=True``: the one graph
then serves 1-token decode, multi-token continuation (e.g. accepting speculative tokens) and, on an
empty static cache, the prefill.

Merge rules, per kwarg (see :func:`merge_decode_steps`):

- token-aligned inputs (``input_ids``, ``inputs_embeds``, ``decoder_input_ids``, token type ids):
  concatenated on dim 1;
- ``cache_position``: concatenated on dim 0;
- ``position_ids`` / ``decoder_position_ids``: concatenated on the last dim (2-D ``[batch, q]`` and
  M-RoPE ``[channels, batch, q]`` alike);
- a 4-D mask ``[batch, heads, q, kv]``: concatenated on the query axis (dim 2); narrower key axes
  are padded on the right with the "masked" value, since the first query may not see the later token;
- a 2-D mask ``[batch, past + q]``: the widest (last) one;
- a dict of masks (one per attention type): merged key by key with the rules above;
- the cache: the first step's (the merged call starts where the first step started);
- anything else must be equal in every step and is kept once.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfexport.conventions import DECODER, TEXT, names_with
from hfexport.tensors import get_leaf_tensors

__all__ = [
    "CACHE_KEYS",
    "MASK_KEYS",
    "POSITION_KEYS",
    "TOKEN_KEYS",
    "decode_inputs_for_query_length",
    "merge_decode_steps",
    "query_length",
]

logger = logging.getLogger(__name__)

# The key sets below come from the input-role table (hfexport.conventions.roles).
#: Kwargs aligned with the new tokens on dim 1: the token-level inputs of the text and decoder
#: sequence groups (ids, embeddings, token type ids).
TOKEN_KEYS: tuple[str, ...] = names_with(
    sequence=(TEXT, DECODER), kind=("ids", "embeds", "type_ids", "modality_types")
)
#: Position kwargs, aligned with the new tokens on their last dim.
POSITION_KEYS: tuple[str, ...] = names_with(sequence=(TEXT, DECODER), kind="positions")
#: Mask kwargs (2-D, 4-D or a dict of either).
MASK_KEYS: tuple[str, ...] = names_with(sequence=(TEXT, DECODER), kind="mask")
#: Cache kwargs (the first step's is kept).
CACHE_KEYS: tuple[str, ...] = names_with(kind="cache")


def query_length(kwargs: Mapping[str, Any]) -> int:
    """Number of new tokens in a decoder call (dim 1 of its ids or embeddings).

    Raises:
        ValueError: the call has none of ``input_ids``, ``inputs_embeds``, ``decoder_input_ids``,
            ``decoder_inputs_embeds``.
    """
    for key in ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            return int(value.shape[1])
    raise ValueError(
        f"the call has no token input (input_ids / inputs_embeds); its kwargs are {sorted(kwargs)}"
    )


def _masked_value(mask: torch.Tensor) -> Any:
    if mask.dtype == torch.bool:
        return False
    if mask.is_floating_point():
        return torch.finfo(mask.dtype).min
    return 0


def _merge_4d(key: str, masks: Sequence[torch.Tensor]) -> torch.Tensor:
    width = max(int(m.shape[-1]) for m in masks)
    padded = []
    for m in masks:
        if m.dim() != 4:
            raise ValueError(f"{key}: cannot merge a {m.dim()}-D mask with 4-D masks")
        if m.shape[-1] < width:
            pad = torch.full(
                (*m.shape[:-1], width - m.shape[-1]), _masked_value(m), dtype=m.dtype, device=m.device
            )
            m = torch.cat([m, pad], dim=-1)
        padded.append(m)
    return torch.cat(padded, dim=2)


def _merge_mask(key: str, masks: Sequence[Any]) -> Any:
    first = masks[0]
    if isinstance(first, Mapping):
        keys = list(first)
        if any(not isinstance(m, Mapping) or list(m) != keys for m in masks):
            raise ValueError(f"{key}: the decode steps carry dict masks with different keys")
        return type(first)({k: _merge_mask(f"{key}[{k!r}]", [m[k] for m in masks]) for k in keys})
    if first is None:
        if any(m is not None for m in masks):
            raise ValueError(f"{key}: some decode steps have a mask and others do not")
        return None
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{key}: cannot merge masks of type {type(first).__name__}")
    if first.dim() == 4:
        return _merge_4d(key, masks)
    if first.dim() == 2:
        return max(masks, key=lambda m: int(m.shape[-1]))
    raise ValueError(f"{key}: cannot merge {first.dim()}-D masks (2-D and 4-D masks are supported)")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (bool, int, float, str, type(None))):
        return a == b
    leaves_a, leaves_b = get_leaf_tensors(a), get_leaf_tensors(b)
    if leaves_a or leaves_b:
        return list(leaves_a) == list(leaves_b) and all(_same(leaves_a[k], leaves_b[k]) for k in leaves_a)
    return type(a) is type(b)


def merge_decode_steps(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge consecutive single-token decode calls into one multi-token call.

    Args:
        steps: kwargs of consecutive decode calls, in order (at least one), as captured from
            ``generate`` (see :mod:`hfexport.generation.recording`).

    Returns:
        One kwargs dict (new tensors; the cache object is the first step's, not copied) whose call
        computes the same logits, for every merged position, as the steps did one by one.

    Raises:
        ValueError: no steps; steps with different kwargs; a mask that cannot be merged; a kwarg
            outside the rules above whose value differs between steps (the message names it).
    """
    if not steps:
        raise ValueError("merge_decode_steps needs at least one decode step")
    keys = list(steps[0])
    for i, step in enumerate(steps[1:], start=1):
        if set(step) != set(keys):
            raise ValueError(
                f"decode step {i} has kwargs {sorted(step)} but step 0 has {sorted(keys)}; cannot merge them"
            )
    if len(steps) == 1:
        return dict(steps[0])
    merged: dict[str, Any] = {}
    for key in keys:
        values = [step[key] for step in steps]
        if key in CACHE_KEYS:
            merged[key] = values[0]
        elif key in TOKEN_KEYS and isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values, dim=1)
        elif key == "cache_position" and isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values, dim=0)
        elif key in POSITION_KEYS and isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values, dim=-1)
        elif key in MASK_KEYS:
            merged[key] = _merge_mask(key, values)
        else:
            if not all(_same(values[0], v) for v in values[1:]):
                raise ValueError(
                    f"decode kwarg {key!r} differs between steps and has no merge rule "
                    f"(token inputs merge on dim 1, positions on the last dim, masks on the query axis)"
                )
            merged[key] = values[0]
    return merged


def _reset_cache(cache: Any) -> Any:
    """A copy of ``cache`` holding no tokens, with the same structure (pytree layout).

    Static layers keep their preallocated tensors, zeroed, with a length of 0; growing layers keep
    tensors with 0 positions on the sequence axis (``[batch, heads, 0, head_dim]``).

    Raises:
        ValueError: a layer that is neither (e.g. linear-attention state), or an encoder-decoder
            cache (its cross-attention part is not empty at a decoder's first step).
    """
    if hasattr(cache, "self_attention_cache"):
        raise ValueError("an encoder-decoder cache cannot be emptied: its first step uses the prefill graph")
    fresh = copy.deepcopy(cache)
    for layer in getattr(fresh, "layers", []):
        if not getattr(layer, "is_initialized", False) or not isinstance(
            getattr(layer, "keys", None), torch.Tensor
        ):
            raise ValueError(f"cannot empty an uninitialised {type(layer).__name__} layer")
        if getattr(layer, "is_compileable", False):
            layer.keys.zero_()
            layer.values.zero_()
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.zero_()
        elif layer.keys.dim() == 4:
            layer.keys = layer.keys[..., :0, :].clone()
            layer.values = layer.values[..., :0, :].clone()
        else:  # pragma: no cover - other layer kinds are not produced by the capture
            raise ValueError(f"cannot empty a {type(layer).__name__} cache layer")
    return fresh


def decode_inputs_for_query_length(
    decode_kwargs: Mapping[str, Any],
    q: int,
    *,
    empty_cache: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Forward kwargs for a decode graph with ``q`` new tokens, derived from captured decode kwargs.

    Used to validate a multi-token decode graph at other query lengths than the sample's. Token
    ids are drawn (seeded) from the range the sample uses, the 2-D mask covers ``past + q`` (its
    known prefix kept, ones after), positions continue from the sample's first position, token type
    ids are zeros.

    Args:
        decode_kwargs: the decode component's kwargs (2-D mask, cache with a sequence length).
        q: number of new tokens, >= 1.
        empty_cache: start from an emptied copy of the cache (static: zeroed, length 0; growing:
            0 positions): the call is then a prefill of ``q`` tokens, positions start at 0 and the
            mask is all ones.
        seed: seed for the token ids.

    Returns:
        A new kwargs dict; the cache is a deep copy (running the graph leaves the sample alone).

    Raises:
        ValueError: ``q < 1``; a 4-D or dict mask (only 2-D masks can be re-derived);
            ``empty_cache`` with an encoder-decoder cache.
    """
    if q < 1:
        raise ValueError(f"q must be >= 1, got {q}")
    gen = torch.Generator().manual_seed(seed)
    cache_key = next((k for k in CACHE_KEYS if k in decode_kwargs), None)
    cache = decode_kwargs.get(cache_key) if cache_key else None
    out: dict[str, Any] = {}
    past = 0
    if cache is not None:
        if empty_cache:
            out[cache_key] = _reset_cache(cache)  # type: ignore[index]
        else:
            out[cache_key] = copy.deepcopy(cache)  # type: ignore[index]
            past = int(cache.get_seq_length())
    for key, value in decode_kwargs.items():
        if key == cache_key:
            continue
        if not isinstance(value, torch.Tensor):
            out[key] = copy.deepcopy(value)
            continue
        if key in TOKEN_KEYS:
            if value.is_floating_point():
                out[key] = torch.randn((value.shape[0], q, *value.shape[2:]), generator=gen).to(value.dtype)
            elif key.endswith("token_type_ids"):
                out[key] = torch.zeros((value.shape[0], q), dtype=value.dtype)
            else:
                low, high = int(value.min()), int(value.max()) + 1
                out[key] = torch.randint(
                    low, max(high, low + 1), (value.shape[0], q), generator=gen, dtype=value.dtype
                )
        elif key in POSITION_KEYS:
            start = 0 if empty_cache else value[..., :1]
            steps = torch.arange(q, dtype=value.dtype)
            out[key] = (
                (steps + start).expand(*value.shape[:-1], q).contiguous() if empty_cache else (start + steps)
            )
        elif key in MASK_KEYS:
            if value.dim() != 2:
                raise ValueError(
                    f"{key} is {value.dim()}-D; only 2-D masks can be derived for another query length"
                )
            total = past + q
            if empty_cache:
                out[key] = torch.ones((value.shape[0], total), dtype=value.dtype)
            elif key == "attention_mask" and "decoder_input_ids" in decode_kwargs:
                out[key] = value.clone()  # encoder mask of an encoder-decoder: fixed
            else:
                known = value[:, : min(total, value.shape[1])]
                extra = torch.ones((value.shape[0], total - known.shape[1]), dtype=value.dtype)
                out[key] = torch.cat([known, extra], dim=1)
        elif key == "cache_position":
            start = 0 if empty_cache else int(value[0])
            out[key] = torch.arange(start, start + q, dtype=value.dtype)
        else:
            out[key] = value.clone()
    return out
