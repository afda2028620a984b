"""A second input shape for components that take a KV cache (prefill and decode steps).

Every dynamic export is validated against eager PyTorch at the sample shape and at a second shape
(:func:`hfexport.validation.derive_second_inputs`). The inputs of a generation component include a
transformers ``Cache`` object, whose tensors, the attention mask and the positions must agree with
one another, so the rules for plain tensors do not apply; :func:`derive_cache_second_inputs` holds
the rules for them:

- a cache that holds no tensor (the prefill: a growing cache of 0 positions, or a static cache not
  allocated yet): the other inputs take the plain second shape (another batch, another prompt
  length) and the cache stays empty;
- a filled cache (a decode step): the past length changes (``2 * past + 1``, moved inside the range
  the program takes for ``past + new tokens`` on the attention mask, the model's maximum positions
  and, for a static cache, ``max_cache_len - 1``), and so does the batch when the program keeps it
  dynamic. The number of new tokens stays (a multi-token decode graph is validated at other query
  lengths by :func:`hfexport.generation.export.validate_decode_lengths`). A growing cache gets
  tensors of the new past length; a static cache keeps its shape ``[batch, heads, max_cache_len,
  head_dim]`` and moves its write position (``cumulative_length``), the positions past it zeros.
  Cache contents are the sample's, repeated along the batch and past axes (plus seeded noise of
  0.1 unless the sample's tokens are reused); new token ids are drawn from the sample's range (or
  the sample's own tokens, see ``reuse``), the 2-D mask is all ones over ``past + new`` positions,
  ``position_ids`` count on from the new past length (M-RoPE ``[3, batch, q]`` positions are the
  sample's moved by the change of past length), ``cache_position`` is
  ``arange(past, past + new)``.

The derived cache is built from the sample's cache object with only its tensors replaced
(:func:`hfexport.tensors.set_leaf_tensors`), so the artifact and the eager reference get the very
same cache contents and the cache keeps the pytree layout the program was captured with.

Not derived (``None`` with the reason, and the second shape is skipped as before): an
encoder-decoder cache, cache layers other than ``DynamicLayer`` / ``StaticLayer`` (sliding-window
layers keep their length as a Python int, which the captured program holds fixed), a 4-D or dict
attention mask, and any input without a rule here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfexport.conventions import DECODER, input_role, max_positions
from hfexport.program_axes import STATUS_STATIC, axis_range, choose_size
from hfexport.tensors import get_leaf_tensors, set_leaf_tensors

__all__ = ["cache_past_length", "derive_cache_second_inputs", "find_cache", "static_cache_length"]

#: input kinds of the role table that are aligned with the new tokens ``[batch, q, ...]``
_TOKEN_KINDS = ("ids", "embeds", "type_ids")


def find_cache(inputs: Mapping[str, Any]) -> tuple[str, Any] | None:
    """``(kwarg name, cache)`` of the transformers ``Cache`` among ``inputs``, or ``None``.

    Raises:
        ValueError: more than one ``Cache`` among ``inputs``.
    """
    from transformers.cache_utils import Cache

    found = [(k, v) for k, v in inputs.items() if isinstance(v, Cache)]
    if len(found) > 1:
        raise ValueError(f"the inputs hold several caches ({[k for k, _ in found]}); expected at most one")
    return found[0] if found else None


def cache_past_length(cache: Any) -> int:
    """The number of positions ``cache`` holds (``get_seq_length()`` as an int; 0 for an empty cache)."""
    return int(cache.get_seq_length())


def static_cache_length(cache: Any) -> int | None:
    """The positions a static cache holds at most (the smallest ``max_cache_len`` of its layers that
    have one), also before it is allocated; ``None`` for a growing cache."""
    lengths = [
        int(layer.max_cache_len)
        for layer in getattr(cache, "layers", [])
        if isinstance(getattr(layer, "max_cache_len", None), int) and layer.max_cache_len > 0
    ]
    return min(lengths) if lengths else None


def _layer_kind(layer: Any) -> str | None:
    """``"dynamic"`` / ``"static"`` for the layer classes whose length is carried by tensors only."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if type(layer) is DynamicLayer:
        return "dynamic"
    if type(layer) is StaticLayer:
        return "static"
    return None


def _repeat_to(t: torch.Tensor, shape: Sequence[int], gen: torch.Generator | None) -> torch.Tensor:
    """``t`` repeated (or cut) along every axis to ``shape``; with ``gen`` floats get 0.1-scaled noise."""
    out = t
    for axis, size in enumerate(shape):
        current = int(out.shape[axis])
        if current == 0:
            return torch.zeros(tuple(shape), dtype=t.dtype, device=t.device)
        if size > current:
            reps = [1] * out.dim()
            reps[axis] = -(-int(size) // current)
            out = out.repeat(*reps)
        out = out.narrow(axis, 0, int(size))
    if gen is not None and out.is_floating_point():
        out = out + torch.randn(tuple(out.shape), generator=gen).to(out.dtype).to(out.device) * 0.1
    return out.contiguous()


def _asked_dynamic(config: Any, key: str, axis: int) -> bool:
    """Whether the export asked ``key``/``axis`` to be dynamic (``dynamic=True``: every axis)."""
    spec = getattr(config, "dynamic_shapes", None) if config is not None else None
    if not spec:
        return True
    if not isinstance(spec, Mapping):
        return False
    entry = spec.get(key)
    if isinstance(entry, Mapping):
        leaf = entry.get(axis)
    elif isinstance(entry, (list, tuple)) and axis < len(entry):
        leaf = entry[axis]
    else:
        return False
    return leaf is not None and not isinstance(leaf, (bool, int))


def _new_size(
    sample: int,
    preferred: int,
    groups: Sequence[tuple[Sequence[tuple[str, int]], int]],
    program_axes: Sequence[Mapping[str, Any]] | None,
    config: Any,
    *,
    limits: Sequence[int | None] = (),
) -> tuple[int, str]:
    """A size other than ``sample`` for a quantity that axes carry, or ``sample`` with the reason it stays.

    Args:
        groups: ``(pairs, offset)``: the ``(input, axis)`` pairs whose size is the quantity plus
            ``offset`` (a 2-D mask over ``past + q`` positions carries the past length with offset
            ``q``). No group: the quantity is a value, free inside ``limits``.
        limits: upper bounds of the quantity besides the program's.
    """
    low, high = 0, None
    for pairs, offset in groups:
        outcome = axis_range(program_axes, pairs)
        if outcome is None:
            # an axis the program's outcomes do not list: static when the export did not ask it
            # dynamic (a top-level kwarg; cache leaves are judged by the axes they must match)
            top_level = [(k, a) for k, a in pairs if "." not in k]
            if (
                program_axes is not None
                and top_level
                and not any(_asked_dynamic(config, k, a) for k, a in top_level)
            ):
                return sample, f"{top_level[0][0]} axis {top_level[0][1]} is not dynamic in the export"
            continue
        status, lo, hi = outcome
        if status == STATUS_STATIC:
            return sample, f"the program holds {pairs[0][0]} axis {pairs[0][1]} static"
        low = max(low, lo - offset)
        if hi is not None:
            high = hi - offset if high is None else min(high, hi - offset)
    for limit in limits:
        if limit is not None:
            high = limit if high is None else min(high, limit)
    size = choose_size(sample, preferred, max(low, 1), high)
    if size == sample:
        return sample, f"no other size in [{max(low, 2)}, {high}]"
    return size, ""


def derive_cache_second_inputs(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    config: Any = None,
    program_axes: Sequence[Mapping[str, Any]] | None = None,
    seed: int = 1,
    reuse: bool = False,
) -> tuple[dict[str, Any] | None, str]:
    """Second forward kwargs for a component whose inputs hold a KV cache (see the module docstring).

    Args:
        model: the eager component (its ``config`` gives the maximum positions).
        inputs: its prepared forward kwargs: one ``Cache`` (``cache`` / ``past_key_values``),
            tensors (``input_ids`` int64 ``[batch, q]``, ``attention_mask`` ``[batch, past + q]``,
            ``position_ids``, ``cache_position`` ...), scalar flags.
        config: the export config (its ``dynamic_shapes``, when explicit and ``program_axes`` is
            ``None``, say which axes may change).
        program_axes: the program's axis outcomes (``input``, ``axis``, ``status``, ``min``,
            ``max``; cache leaves named by their path, e.g. ``cache.layers.0.keys``): a static
            axis keeps its size, a dynamic one stays inside its range. ``None``: every axis the
            config asks dynamic is taken as unbounded.
        seed: seed for the drawn token ids and the noise.
        reuse: new tokens repeat the sample's tokens (a quality-gated export) and the cache is
            repeated without noise.

    Returns:
        ``(second_inputs, "")``, or ``(None, reason)`` when no sound second shape can be derived.
        The second inputs hold a new cache object (the sample's is left untouched).
    """
    found = find_cache(inputs)
    if found is None:
        return None, "no cache among the inputs"
    cache_key, cache = found
    if hasattr(cache, "self_attention_cache"):
        return None, (
            f"{type(cache).__name__} {cache_key!r}: no second-shape rule for encoder-decoder caches (the "
            "cross-attention part is tied to the encoder outputs)"
        )
    others = {k: v for k, v in inputs.items() if k != cache_key and not isinstance(v, torch.Tensor)}
    odd = sorted(k for k, v in others.items() if v is not None and not isinstance(v, (bool, int, float, str)))
    if odd:
        return None, f"non-tensor inputs {odd} next to the cache have no second-shape rule"
    if not get_leaf_tensors(cache):
        return None, (
            f"the cache {cache_key!r} holds no tensor (a prefill): the other inputs take the plain second shape "
            "(hfexport.validation.derive_second_inputs derives them)"
        )
    kinds = {_layer_kind(layer) for layer in getattr(cache, "layers", [])}
    if not kinds or None in kinds or len(kinds) > 1:
        names = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        return None, (
            f"{type(cache).__name__} {cache_key!r} with layers {names}: a second past length is derived for "
            "caches of DynamicLayer or of StaticLayer only"
        )
    static = kinds == {"static"}
    if not all(getattr(layer, "is_initialized", False) for layer in cache.layers):
        return None, f"{type(cache).__name__} {cache_key!r} has uninitialised layers next to filled ones"
    past = cache_past_length(cache)
    if past < 1:
        return None, f"{type(cache).__name__} {cache_key!r} is allocated but holds no position"

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    roles = {k: input_role(k, t.dim(), present=tensors) for k, t in tensors.items()}
    unknown = sorted(k for k, r in roles.items() if r is None)
    if unknown:
        return None, f"inputs {unknown} next to the cache have no entry in the input-role table"
    tokens = [k for k, r in roles.items() if r is not None and r.kind in _TOKEN_KINDS and r.batch_axis == 0]
    if not tokens:
        return None, "no token input (input_ids / inputs_embeds) next to the cache"
    token_key = tokens[0]
    batch, q = int(tensors[token_key].shape[0]), int(tensors[token_key].shape[1])
    decoder = roles[token_key] is not None and roles[token_key].sequence == DECODER  # type: ignore[union-attr]
    leaves = get_leaf_tensors(cache)
    state = {p: t for p, t in leaves.items() if p.rsplit(".", 1)[-1] in ("keys", "values")}
    if any(t.dim() != 4 or int(t.shape[0]) != batch for t in state.values()):
        return None, f"cache tensors of {cache_key!r} are not [batch={batch}, heads, positions, head_dim]"
    extra = sorted(set(leaves) - set(state) - {p for p in leaves if p.endswith(".cumulative_length")})
    if extra:
        return None, f"cache state {extra[:3]} has no second-shape rule"

    # which axes may change, inside which range
    batch_pairs = [(k, r.batch_axis) for k, r in roles.items() if r is not None and r.batch_axis is not None]
    batch_pairs += [(f"{cache_key}.{p}", 0) for p in state]
    new_batch, batch_note = _new_size(batch, batch + 1, [(batch_pairs, 0)], program_axes, config)
    masks = [k for k, r in roles.items() if r is not None and r.kind == "mask"]
    for key in masks:
        if tensors[key].dim() != 2 or int(tensors[key].shape[1]) != past + q:
            return None, (
                f"{key!r} {tuple(tensors[key].shape)} is not a 2-D mask over past + new positions "
                f"({past} + {q}); no rule to derive it at another past length"
            )
    limit, _ = max_positions(getattr(model, "config", None), decoder=decoder)
    limits: list[int | None] = [limit - q if limit is not None else None]
    if static:
        cache_len = min(int(t.shape[2]) for t in state.values())
        # a mask as long as the static cache takes another branch than the shorter ones the
        # decode steps feed (transformers pads a shorter mask to the cache length)
        limits.append(cache_len - 1 - q)
    groups: list[tuple[Sequence[tuple[str, int]], int]] = [([(k, 1)], q) for k in masks]
    if not static:  # a growing cache carries the past length on its position axis
        groups.append(([(f"{cache_key}.{p}", 2) for p in state], 0))
    new_past, past_note = _new_size(past, 2 * past + 1, groups, program_axes, config, limits=limits)
    if new_batch == batch and new_past == past:
        return None, (
            f"neither the batch ({batch_note}) nor the past length of {cache_key!r} ({past_note}) can take "
            "another size"
        )

    gen = None if reuse else torch.Generator().manual_seed(seed)
    draw = torch.Generator().manual_seed(seed + 1)
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key == cache_key or not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        role = roles[key]
        assert role is not None
        if role.kind in _TOKEN_KINDS and role.batch_axis == 0:
            shape = (new_batch, *value.shape[1:])
            if reuse or role.kind == "type_ids":
                out[key] = _repeat_to(value, shape, None)
            elif value.is_floating_point():
                out[key] = torch.randn(shape, generator=draw).to(value.dtype).to(value.device)
            else:
                low, high = int(value.min()), int(value.max()) + 1
                out[key] = torch.randint(low, max(high, low + 1), shape, generator=draw, dtype=value.dtype)
        elif role.kind == "positions" and role.batch_axis is not None and role.sequence_axis is not None:
            shape = list(value.shape)
            shape[role.batch_axis] = new_batch
            if value.dim() == 2:
                steps = torch.arange(new_past, new_past + int(value.shape[1]), dtype=value.dtype)
                out[key] = steps.expand(new_batch, -1).contiguous().to(value.device)
            else:  # M-RoPE [channels, batch, q]: the sample's positions, moved by the change of past
                out[key] = _repeat_to(value, shape, None) + (new_past - past)
        elif role.kind == "mask":
            out[key] = torch.ones((new_batch, new_past + q), dtype=value.dtype, device=value.device)
        elif role.kind == "cache_positions" and value.dim() == 1:
            out[key] = torch.arange(new_past, new_past + int(value.shape[0]), dtype=value.dtype).to(
                value.device
            )
        else:
            return None, f"no rule to derive {key!r} {tuple(value.shape)} at another past length"

    replaced: dict[str, torch.Tensor] = {}
    for path, t in leaves.items():
        if path in state:
            heads, dim = int(t.shape[1]), int(t.shape[3])
            filled = _repeat_to(t[:, :, :past], (new_batch, heads, new_past, dim), gen)
            if static:
                full = torch.zeros((new_batch, heads, int(t.shape[2]), dim), dtype=t.dtype, device=t.device)
                full[:, :, :new_past] = filled
                filled = full
            replaced[f"{cache_key}.{path}"] = filled
        else:  # a static layer's write position
            replaced[f"{cache_key}.{path}"] = torch.full_like(t, new_past)
    second = set_leaf_tensors({cache_key: cache}, replaced)[cache_key]
    if cache_past_length(second) != new_past:  # pragma: no cover - a layer kind the checks above let in
        return (
            None,
            f"the rebuilt {type(cache).__name__} reports {cache_past_length(second)} positions, not {new_past}",
        )
    out[cache_key] = second
    return out, ""
