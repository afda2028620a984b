"""Values of a second validation shape, filled by input role into the sizes of a :class:`SizePlan`.

One path for every input set (plain inputs, declared ``dynamic_shapes``, inputs next to a KV
cache); what a value is follows from the input's role in :mod:`hfexport.conventions.roles` and
from which of its axes the plan changes:

- an input whose shape and past length stay is passed through unchanged (the same object);
- ``position_ids`` count up along the sequence axis from the second shape's past length (0
  without a cache); M-RoPE positions ``[3, batch, q]`` next to a filled cache are the sample's,
  moved by the change of past length;
- ``cache_position`` counts from the second past length over the new tokens;
- masks whose batch or sequence changes are all ones (an unpadded row);
- token inputs (``input_ids``, ``token_type_ids``, ``inputs_embeds`` and the decoder's) are drawn
  (seeded) from the range the sample uses (floats standard normal), or, with ``reuse``, repeat the
  sample's real tokens (mask != 0): derived row ``i`` holds those of sample row ``i % batch``;
  token ids whose every row ends with one special id found nowhere else and below every other id
  (``</s>``: :func:`sentence_end_token`) keep it as the last token of every derived row, the rest
  filled as above from the sample without its last column;
- raw audio (``input_values``) is standard normal;
- every other changed input (images, audio features, unknown names, an input whose other axes
  change) is the sample repeated (or cut) along the changed axes, plus 0.1-scaled noise for floats;
- inputs the plan changes but whose values follow from others (``mm_token_type_ids``,
  ``image_grid_thw``, ``encoder_outputs``) are refused with the reason;
- a filled cache is rebuilt from the sample's cache object with only its tensors replaced (the
  sample's keys/values repeated to the new batch and past length, plus 0.1-scaled noise unless
  ``reuse``; a static cache keeps its length, zeros past the new write position); an empty cache
  is copied.

The prompt's placeholder tokens (``<image>`` next to ``pixel_values``) are put back at the
positions of the sample row each derived row repeats.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.conventions import InputRole, input_role
from hfexport.tensors import get_leaf_tensors, set_leaf_tensors
from hfexport.verify.caches import cache_past_length
from hfexport.verify.sizes import NO_VALUE_RULE, SizePlan, cache_state_paths

__all__ = ["fill_second_inputs", "sentence_end_token"]

#: input kinds whose values follow from their shape alone (random ids/embeddings, ones, counts)
_GENERATED = ("ids", "type_ids", "embeds", "mask", "positions", "signal")
#: token inputs that reuse the sample's real tokens with ``reuse``
_FROM_SAMPLE = ("ids", "type_ids", "embeds")


def _generate(t: torch.Tensor, role: InputRole, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` for an input whose values follow from its shape: floats are standard
    normal, ids are drawn from the range the sample uses."""
    if t.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype).to(t.device)
    low = int(t.min()) if t.numel() else 0
    high = int(t.max()) + 1 if t.numel() else 2
    return torch.randint(low, max(high, low + 1), shape, generator=gen, dtype=t.dtype).to(t.device)


def _count_up(t: torch.Tensor, axis: int, shape: tuple[int, ...], start: int) -> torch.Tensor:
    """``start, start + 1, ...`` along ``axis``, broadcast to ``shape`` in ``t``'s dtype."""
    length = shape[axis]
    view = [1] * len(shape)
    view[axis] = length
    steps = torch.arange(start, start + length, device=t.device)
    return steps.view(view).expand(shape).to(t.dtype).contiguous()


def _real_positions(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{sequence group: bool [batch, seq]}``: the positions a 2-D mask of the group marks as real
    tokens (``mask != 0``); a group without such a mask is absent (every position is real)."""
    found: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if (
            role is not None
            and role.kind == "mask"
            and role.sequence is not None
            and (t.dim(), role.batch_axis, role.sequence_axis) == (2, 0, 1)
        ):
            found.setdefault(role.sequence, t != 0)
    return found


def sentence_end_token(t: torch.Tensor, role: InputRole) -> int | None:
    """The id every row of the token ids ``t`` ends with, when it marks the end of a sentence.

    ``t`` must be ``[batch, seq]`` integer ids (batch >= 2, seq >= 2) whose last column holds one
    id ``e`` that occurs nowhere else and lies below every other id of the sample: a special token
    the sample puts at each row's end (``</s>``, which the sequence-classification heads of BART
    and T5 pool at, and refuse rows without). ``None`` otherwise.
    """
    if (
        t.is_floating_point()
        or t.dim() != 2
        or (role.batch_axis, role.sequence_axis) != (0, 1)
        or int(t.shape[0]) < 2
        or int(t.shape[1]) < 2
    ):
        return None
    last, rest = t[:, -1], t[:, :-1]
    end = int(last[0])
    if bool((last != end).any()) or int(rest.min()) <= end:
        return None
    return end


def _ending_with(fill: Any, t: torch.Tensor, shape: tuple[int, ...], end: int) -> torch.Tensor | None:
    """``fill(t[:, :-1], shape with one token less)`` with ``end`` appended to every row (the
    sample's sentence end kept at the end of the derived rows)."""
    if int(shape[1]) < 2:
        return None
    body = fill(t[:, :-1].contiguous(), (int(shape[0]), int(shape[1]) - 1, *shape[2:]))
    if body is None:
        return None
    tail = torch.full((int(shape[0]), 1), end, dtype=t.dtype, device=t.device)
    return torch.cat([body, tail], dim=1)


def _from_sample(
    t: torch.Tensor, role: InputRole, shape: tuple[int, ...], real: torch.Tensor | None
) -> torch.Tensor | None:
    """``shape`` filled with the sample's own tokens: derived row ``i`` is the real (unmasked)
    tokens of sample row ``i % batch``, repeated along the sequence axis and cut to the new length
    (a row without a real token is taken whole). ``None`` when the layout is not ``[batch, seq, ...]``
    with the trailing axes of the sample, or the sample has no token."""
    if (
        (role.batch_axis, role.sequence_axis) != (0, 1)
        or t.dim() < 2
        or tuple(shape[2:]) != tuple(t.shape[2:])
    ):
        return None
    batch, length = int(t.shape[0]), int(shape[1])
    if batch == 0 or int(t.shape[1]) == 0:
        return None
    if real is not None and tuple(real.shape) != tuple(t.shape[:2]):
        real = None
    rows = []
    for row in range(int(shape[0])):
        source = t[row % batch]
        if real is not None and bool(real[row % batch].any()):
            source = source[real[row % batch].to(source.device)]
        reps = [-(-length // int(source.shape[0]))] + [1] * (source.dim() - 1)
        rows.append(source.repeat(*reps)[:length])
    return torch.stack(rows).contiguous()


def _tile(t: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator | None) -> torch.Tensor:
    """``t`` repeated (or cut) along every axis to ``shape``; with ``gen``, floats get 0.1-scaled
    noise so repeated rows differ (integers are repeated exactly). An empty axis gives zeros."""
    out = t
    for axis, size in enumerate(shape):
        current = int(out.shape[axis])
        if current == 0:
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
        if size > current:
            reps = [1] * out.dim()
            reps[axis] = -(-size // current)
            out = out.repeat(*reps)
        out = out.narrow(axis, 0, size)
    if gen is not None and out.is_floating_point():
        out = out + torch.randn(tuple(out.shape), generator=gen).to(out.dtype).to(out.device) * 0.1
    return out.contiguous()


def _fill_one(
    key: str,
    t: torch.Tensor,
    role: InputRole | None,
    shape: tuple[int, ...],
    plan: SizePlan,
    *,
    gen: torch.Generator,
    reuse: bool,
    real: Mapping[str, torch.Tensor],
) -> torch.Tensor | str:
    """The second value of one tensor input, or the reason it has none."""
    changed = {axis for axis, (a, b) in enumerate(zip(t.shape, shape)) if int(a) != b}
    counts = role is not None and role.kind in ("positions", "cache_positions")
    if not changed and not (counts and plan.past_shift()):
        return t
    if role is None:
        return _tile(t, shape, gen)
    if role.kind == "cache_positions" and t.dim() == 1:
        return _count_up(t, 0, shape, plan.new_past())
    if role.kind in NO_VALUE_RULE:
        return f"no rule to derive the values of {key!r} {tuple(t.shape)} at another shape"
    named = {role.batch_axis, role.sequence_axis} - {None}
    if role.kind not in _GENERATED or not changed <= named:
        return _tile(t, shape, gen)
    if role.kind == "positions":
        if plan.past is not None and t.dim() == 3:  # M-RoPE [3, batch, q]: moved by the change of past
            return _tile(t, shape, None) + plan.past_shift()
        if role.sequence_axis is None:
            return _tile(t, shape, gen)
        return _count_up(t, role.sequence_axis, shape, plan.new_past())
    if role.kind == "mask":
        return torch.ones(shape, dtype=t.dtype, device=t.device)
    end = sentence_end_token(t, role) if role.kind == "ids" else None
    if reuse and role.kind in _FROM_SAMPLE:
        mask = real.get(role.sequence or "")
        if end is not None:
            body_mask = mask[:, :-1] if mask is not None and mask.dim() == 2 else None
            reused = _ending_with(lambda body, s: _from_sample(body, role, s, body_mask), t, shape, end)
        else:
            reused = _from_sample(t, role, shape, mask)
        if reused is not None:
            return reused
    if end is not None:
        ended = _ending_with(lambda body, s: _generate(body, role, s, gen), t, shape, end)
        if ended is not None:
            return ended
    return _generate(t, role, shape, gen)


def _rebuild_cache(cache_key: str, cache: Any, plan: SizePlan, *, gen: torch.Generator | None) -> Any:
    """A new cache object of the plan's batch and past length (see the module docstring)."""
    batch = plan.group("batch")
    past = plan.past
    assert past is not None
    new_batch = batch.size if batch is not None else None
    replaced: dict[str, torch.Tensor] = {}
    state = cache_state_paths(cache)
    for path, t in get_leaf_tensors(cache).items():
        if path in state:
            heads, dim = int(t.shape[1]), int(t.shape[3])
            rows = new_batch if new_batch is not None else int(t.shape[0])
            if plan.cache_kind != "static" and not any(
                m.input == f"{cache_key}.{path}" for m in past.members
            ):
                # a layer the past does not lengthen (a cross-attention layer's image keys/values)
                replaced[f"{cache_key}.{path}"] = _tile(t, (rows, heads, int(t.shape[2]), dim), gen)
                continue
            filled = _tile(t[:, :, : past.sample], (rows, heads, past.size, dim), gen)
            if plan.cache_kind == "static":
                full = torch.zeros((rows, heads, int(t.shape[2]), dim), dtype=t.dtype, device=t.device)
                full[:, :, : past.size] = filled
                filled = full
            replaced[f"{cache_key}.{path}"] = filled
        else:  # a static layer's write position
            replaced[f"{cache_key}.{path}"] = torch.full_like(t, past.size)
    return set_leaf_tensors({cache_key: cache}, replaced)[cache_key]


def _keep_placeholders(
    sample: Mapping[str, torch.Tensor], out: dict[str, Any], placeholders: Mapping[str, int]
) -> str:
    """Put the prompt's placeholder tokens back into the derived token ids (in ``out``); the reason
    it cannot, or ``""``.

    A multimodal model replaces each placeholder token (``<image>``) by one feature of its
    encoder, and checks that the counts match. Derived row ``i`` repeats sample row ``i % batch``
    (images are tiled the same way), so it gets that row's placeholders at the same positions;
    drawn ids that happen to equal a placeholder id become another id.
    """
    if not placeholders:
        return ""
    tokens = set(placeholders.values())
    for key, t in sample.items():
        role = input_role(key, t.dim(), present=sample)
        new = out.get(key)
        if role is None or role.kind != "ids" or not isinstance(new, torch.Tensor) or new is t:
            continue
        axis = role.sequence_axis
        if axis != 1 or new.dim() != 2:
            continue
        used = sorted({int(v) for v in t.unique()} - tokens)
        filler = used[0] if used else 0
        new = new.clone()
        for token in tokens:
            new[new == token] = filler
        batch = int(t.shape[0])
        for row in range(int(new.shape[0])):
            source = t[row % batch]
            hits = (source.unsqueeze(-1) == torch.tensor(sorted(tokens), dtype=t.dtype)).any(-1)
            positions = hits.nonzero().flatten()
            if positions.numel() and int(positions.max()) >= int(new.shape[1]):
                return (
                    f"{key!r} holds placeholder tokens up to position {int(positions.max())}, beyond the derived "
                    f"length {int(new.shape[1])}; pass second_inputs explicitly"
                )
            new[row, positions] = source[positions]
        out[key] = new
    return ""


def fill_second_inputs(
    inputs: Mapping[str, Any], plan: SizePlan, *, seed: int = 1, reuse: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """Forward kwargs of the sizes ``plan`` gives, with values by input role (module docstring).

    Args:
        inputs: the sample forward kwargs the plan was made for
            (:func:`hfexport.verify.sizes.plan_second_shape`).
        plan: the size plan.
        seed: seed of the drawn values (token ids, noise); the cache noise draws from ``seed + 1``.
        reuse: token inputs repeat the sample's real tokens and a filled cache gets no noise.

    Returns:
        ``(second_inputs, "")`` (same keys as ``inputs``, in order; non-tensor values kept, a cache
        rebuilt or copied), or ``(None, reason)`` when an input the plan changes has no value
        rule, or a placeholder token would fall outside the derived prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    real = _real_positions(tensors) if reuse else {}
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key == plan.cache_key:
            if plan.cache_kind == "empty" or plan.past is None:
                out[key] = copy.deepcopy(value)
            else:
                noise = None if reuse else torch.Generator().manual_seed(seed + 1)
                out[key] = _rebuild_cache(key, value, plan, gen=noise)
            continue
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        role = input_role(key, value.dim(), present=tensors)
        filled = _fill_one(key, value, role, plan.shape(key, value), plan, gen=gen, reuse=reuse, real=real)
        if isinstance(filled, str):
            return None, filled
        out[key] = filled
    if plan.cache_key is not None and plan.past is not None:
        rebuilt = cache_past_length(out[plan.cache_key])
        if rebuilt != plan.past.size:  # pragma: no cover - a layer kind the plan's checks let in
            return None, (
                f"the rebuilt {type(out[plan.cache_key]).__name__} reports {rebuilt} positions, not {plan.past.size}"
            )
    reason = _keep_placeholders(tensors, out, plan.placeholders)
    return (None, reason) if reason else (out, "")
