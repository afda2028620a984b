"""The second validation shape: another input shape a dynamic export must also compute right.

Every dynamic export is validated against eager PyTorch at the sample shape and at a second shape
(:func:`derive_second_inputs`). It is derived in two steps: a *size plan*
(:func:`hfexport.verify.sizes.plan_second_shape`: which axes move together and the new size of
each group) and values filled into it by input role (:func:`hfexport.verify.fill.fill_second_inputs`),
one path for plain inputs, declared ``dynamic_shapes`` and inputs next to a KV cache.
:func:`describe_second_shape` records what changed (``report.second_shape``).

Inputs holding a transformers ``Cache`` (the prefill and decode steps of a generation export):

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
  Next to a cross-attention mask (Mllama's ``cross_attention_mask``, the new tokens' row ``[batch,
  q, images, tiles]``), growing layers of another length than the past are the cross-attention
  layers' image keys/values: they keep their length and change along the batch only.
  Cache contents are the sample's, repeated along the batch and past axes (plus seeded noise of
  0.1 unless the sample's tokens are reused); new token ids are drawn from the sample's range (or
  the sample's own tokens, see ``reuse``), the 2-D mask is all ones over ``past + new`` positions,
  ``position_ids`` count on from the new past length (M-RoPE ``[3, batch, q]`` positions are the
  sample's moved by the change of past length), ``cache_position`` is
  ``arange(past, past + new)``. The size plan of a decode step has two groups, ``batch`` and
  ``past length`` (:func:`hfexport.verify.sizes.plan_cache_sizes`).

The derived cache is built from the sample's cache object with only its tensors replaced
(:func:`hfexport.tensors.set_leaf_tensors`), so the artifact and the eager reference get the very
same cache contents and the cache keeps the pytree layout the program was captured with.

Not derived (``None`` with the reason, and the second shape is skipped as before): an
encoder-decoder cache, cache layers other than ``DynamicLayer`` / ``StaticLayer`` (sliding-window
layers keep their length as a Python int, which the captured program holds fixed), a 4-D or dict
attention mask, and any input without a rule here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfexport.conventions import input_role
from hfexport.program_axes import axis_meaning
from hfexport.tensors import get_leaf_tensors
from hfexport.verify.caches import cache_past_length, find_cache, static_cache_length
from hfexport.verify.fill import fill_second_inputs
from hfexport.verify.sizes import plan_cache_sizes, plan_second_shape

__all__ = [
    "NOTHING_VARIED",
    "TOKEN_VALUES",
    "derive_cache_second_inputs",
    "derive_second_inputs",
    "describe_second_shape",
    "fit_static_spatial_axes",
    "reuses_sample_tokens",
]

#: the second-shape summary when no input axis could change (the program is static)
NOTHING_VARIED = "no axis changed"
#: what ``derive_second_inputs(token_values=...)`` accepts
TOKEN_VALUES = ("auto", "sample", "random")


def reuses_sample_tokens(config: Any, token_values: str = "auto") -> bool:
    """Whether derived token inputs reuse the sample's tokens (see :func:`derive_second_inputs`):
    ``token_values`` ``"sample"`` / ``"random"``, or for ``"auto"`` whether quality gates apply to
    ``config`` (:func:`hfexport.precision.is_quality_gated`).

    Raises:
        ValueError: ``token_values`` not one of :data:`TOKEN_VALUES`.
    """
    if token_values not in TOKEN_VALUES:
        raise ValueError(f"token_values={token_values!r} is invalid; allowed: {', '.join(TOKEN_VALUES)}")
    if token_values != "auto":
        return token_values == "sample"
    from hfexport.precision import is_quality_gated

    return is_quality_gated(config)


def derive_second_inputs(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    seed: int = 1,
    config: Any = None,
    program_axes: Sequence[Mapping[str, Any]] | None = None,
    token_values: str = "auto",
) -> tuple[dict[str, Any] | None, str]:
    """Build a second set of forward kwargs of another shape, to validate a dynamic export.

    What an axis means comes from the input-role table (:mod:`hfexport.conventions.roles`).

    With explicit ``config.dynamic_shapes``, only the axes declared dynamic change (a named
    ``Dim``, a derived ``Dim``, ``Dim.AUTO`` or ``Dim.DYNAMIC``; ``None``, ints, ``Dim.STATIC`` and
    absent axes are static), each within its declared ``min``/``max`` and, for token axes, the
    model's maximum positions. Axes that must have one size (a named ``Dim`` used twice; the batch
    axes of one modality; the axes of one sequence group, e.g. ``input_ids``/``attention_mask``)
    change together, and only when every one of them is declared dynamic. The batch grows by one,
    a token sequence to ``max(2 * length, 65)``, raw audio by half, image sides double, other axes
    double; a size outside the range falls back to the nearest size inside it (>= 2) that differs
    from the sample, or the axis stays.

    Without ``dynamic_shapes`` (``dynamic=True``), the batch grows by one, token sequences double
    and reach at least 65 tokens (capped by the model's maximum positions), image sides double
    (every input of one modality takes the same new height and width: ``pixel_values`` and
    ``pixel_mask``), audio features only change batch, raw audio (``input_values``) grows by half.
    With ``program_axes`` (what the captured program made of each axis, as
    :func:`hfexport.program_axes.program_input_axes` gives and the export report records in
    ``report.dynamic_axes``), an image side the program holds static (ViT: its position
    embeddings fix the image size) keeps its size, and one the program bounds takes the size
    nearest to double inside its range; token and batch axes are not fitted, so a program that
    specialised them still fails the second shape.

    Values: masks are ones, ``position_ids`` count up, token ids are drawn (seeded) from the range
    the sample uses, floats are standard normal. With ``token_values="sample"`` (the default for a
    quality-gated export: the gates score agreement with the fp32 model on the inputs, which only
    means something on inputs like the sample) the token inputs (``input_ids``,
    ``token_type_ids``, ``inputs_embeds`` and their decoder counterparts) reuse the sample instead:
    derived row ``i`` holds the real tokens (mask != 0) of sample row ``i % batch``, repeated along
    the sequence if needed, so the ids are the sample's, the mask is all ones and ``position_ids``
    count up consistently. The token sequence then gets a quarter *shorter* (at least 2 tokens;
    a sample of 1-2 tokens grows as above) instead of doubling: past the lengths the sample shows,
    a real LM leaves what it was trained on (IgLM-S, GPT-2 on ~120-token antibody chains, 8da4w:
    top-1 agreement 0.94 over positions 0-63 and 0.75 over 192-255 of the sample repeated to 244
    tokens, with fp32's own mean top probability falling from 0.81 to 0.62), so a gate there would
    score the model, not the export. The batch still grows by one. A prompt with placeholder
    tokens keeps the longer sequence. Other inputs (images, features, unknown names)
    are the sample repeated along the changed axes, plus noise for floats. A prompt holding
    placeholder tokens of a present modality (LLaVA's ``<image>`` tokens next to
    ``pixel_values``; the ids come from :func:`hfexport.conventions.placeholder_token_ids`) keeps
    them: derived row ``i`` has the placeholders of sample row ``i % batch`` at the same positions
    (its image is that row's, tiled), no drawn id equals a placeholder id, and the image size
    stays, so the count matches the features the encoder produces for the new batch. When the
    program holds the batch of such a modality's input static (LLaVA's one feature tensor per
    image fixes the image batch at capture), the batch of every input keeps its size and the
    prompt length alone changes.

    Inputs holding a transformers ``Cache`` (the prefill and decode steps of a generation export):
    an empty cache (a prefill) stays empty while the other inputs change by the rules above; a
    filled cache (a decode step) gets another past length, and the batch changes when the program
    keeps it dynamic, with the cache tensors, the mask, ``position_ids`` and ``cache_position``
    consistent with the new past; a static cache keeps its shape and moves its write position
    (:func:`derive_cache_second_inputs`, which also lists the caches it has no rule for).

    Args:
        model: the eager model (its config gives the maximum positions).
        inputs: the prepared forward kwargs.
        seed: seed for the random values.
        config: the export config; its ``dynamic_shapes`` select the axes (``None``: the
            ``dynamic=True`` rule above).
        program_axes: the captured program's axis outcomes (list of dicts with ``input``,
            ``axis``, ``status``, ``min``, ``max``); ``None``: image sides are taken as dynamic.
        token_values: ``"sample"`` (token inputs reuse the sample's tokens), ``"random"`` (drawn
            ids) or ``"auto"``: ``"sample"`` when quality gates apply to ``config``
            (:func:`hfexport.verify.gates.quality_gates_for`: a reduced dtype or a quantization), else
            ``"random"``.

    Returns:
        ``(second_inputs, reason)``: ``second_inputs`` is ``None`` when no sound second shape
        can be derived (a cache or an input without a rule, no dynamic axis that can change),
        with ``reason`` saying why; else ``reason`` is ``""``.

    Raises:
        ValueError: ``token_values`` not one of :data:`TOKEN_VALUES`.
    """
    reuse = reuses_sample_tokens(config, token_values)
    plan, reason = plan_second_shape(model, inputs, config=config, program_axes=program_axes, reuse=reuse)
    if plan is None:
        return None, reason
    return fill_second_inputs(inputs, plan, seed=seed, reuse=reuse)


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
    plan, reason = plan_cache_sizes(model, inputs, config=config, program_axes=program_axes)
    if plan is None:
        return None, reason
    return fill_second_inputs(inputs, plan, seed=seed, reuse=reuse)


def fit_static_spatial_axes(
    second: Mapping[str, Any], program_axes: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Narrow the image sides of derived second inputs to what the captured program takes.

    A model whose forward fixes its image size (ViT without position interpolation) is captured
    with static sides; a dynamic side may also be bounded. Only the spatial axes of the
    input-role table are narrowed (leading rows and columns kept): a batch or sequence axis the
    program holds static stays as derived, so the second-shape validation still reports a
    specialised token axis.

    Args:
        second: the derived forward kwargs.
        program_axes: the program's axis outcomes (``input``, ``axis``, ``status``, ``min``,
            ``max``), as :func:`hfexport.program_axes.program_input_axes` gives them.

    Returns:
        A new dict; inputs without a spatial axis beyond the program's size are the same objects.
    """
    limits = {
        (str(e.get("input")), int(e.get("axis", -1))): e.get("max")
        for e in program_axes
        if e.get("max") is not None
    }
    tensors = {k: v for k, v in second.items() if isinstance(v, torch.Tensor)}
    out = dict(second)
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None:
            continue
        value = t
        for axis in role.spatial_axes:
            limit = limits.get((key, axis))
            if limit is not None and int(value.shape[axis]) > int(limit):
                value = value.narrow(axis, 0, int(limit))
        if value is not t:
            out[key] = value.contiguous()
    return out


def describe_second_shape(sample: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """What a second shape changed with respect to the sample, as the export report records it
    (``report.second_shape``).

    Args:
        sample: the sample forward kwargs.
        second: the second forward kwargs (same keys).

    Returns:
        A JSON-safe dict: ``inputs`` (``{leaf path: shape}`` of ``second``, as ``report.input_names``
        names the sample's leaves); ``changed`` (one entry per changed axis: ``input``, ``axis``,
        ``meaning`` such as ``"batch"``, ``"sequence"`` or ``"past length"``, ``sample``,
        ``second``; the layers of a cache that change alike share one entry named
        ``cache.layers.*.keys``); ``values`` (0-d leaves whose value changed, e.g. a static cache's
        write position ``cache.layers.*.cumulative_length``); for inputs holding a cache
        ``past_length`` ``[sample, second]`` and ``cache_kind`` (``"dynamic"`` / ``"static"``, the
        latter with ``cache_positions``, the fixed length of its tensors); and ``summary``, one line
        such as ``"past length 8 -> 17; batch 2 -> 3 (input_ids, ...)"``.
    """

    before, after = get_leaf_tensors(dict(sample)), get_leaf_tensors(dict(second))
    found = find_cache(second)
    cache_key = found[0] if found is not None else None
    top = {k: v for k, v in second.items() if isinstance(v, torch.Tensor)}
    grouped: dict[tuple[str, int, str, int, int], None] = {}
    values: dict[tuple[str, str, Any, Any], None] = {}
    for path, new in after.items():
        old = before.get(path)
        if old is None:
            continue
        in_cache = cache_key is not None and path.startswith(f"{cache_key}.")
        name = re.sub(r"\.layers\.\d+\.", ".layers.*.", path) if in_cache else path
        if new.dim() == 0 and old.dim() == 0:
            if new.numel() and not torch.equal(new, old.to(new.dtype)):
                meaning = "cache write position" if path.endswith("cumulative_length") else "value"
                values[(name, meaning, old.item(), new.item())] = None
            continue
        if new.dim() != old.dim():
            continue
        for axis, (a, b) in enumerate(zip(old.shape, new.shape)):
            if a == b:
                continue
            if in_cache:
                meaning = {0: "batch", 2: "past length"}.get(axis, f"axis {axis}")
            elif path in top:
                meaning = axis_meaning(path, top[path], axis, top)
            else:
                meaning = f"axis {axis}"
            grouped[(name, axis, meaning, int(a), int(b))] = None
    out: dict[str, Any] = {
        "inputs": {path: list(t.shape) for path, t in after.items()},
        "changed": [
            {"input": n, "axis": a, "meaning": m, "sample": x, "second": y} for n, a, m, x, y in grouped
        ],
        "values": [{"input": n, "meaning": m, "sample": x, "second": y} for n, m, x, y in values],
    }
    lines: list[str] = []
    if found is not None:
        sample_cache = sample.get(found[0])
        past = [
            cache_past_length(sample_cache) if sample_cache is not None else 0,
            cache_past_length(found[1]),
        ]
        capacity = static_cache_length(found[1])
        out["past_length"] = past
        out["cache_kind"] = "static" if capacity is not None else "dynamic"
        if capacity is not None:
            out["cache_positions"] = capacity
        if past[0] != past[1]:
            lines.append(
                f"past length {past[0]} -> {past[1]}"
                + (f" (static cache: its tensors keep {capacity} positions)" if capacity is not None else "")
            )
    by_change: dict[tuple[str, int, int], list[str]] = {}
    for name, _, meaning, a, b in grouped:
        if meaning == "past length":
            continue  # said once above
        by_change.setdefault((meaning, a, b), []).append(name)
    for (meaning, a, b), names in by_change.items():
        lines.append(f"{meaning} {a} -> {b} ({', '.join(dict.fromkeys(names))})")
    for name, meaning, a, b in values:
        lines.append(f"{meaning} {a} -> {b} ({name})")
    out["summary"] = "; ".join(lines) or NOTHING_VARIED
    return out
