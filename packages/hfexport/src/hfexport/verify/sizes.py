"""The size plan of a second validation shape: which input axes move together, and to which size.

A dynamic export is validated at the sample shape and at a second shape. Choosing that shape is
two steps: this module decides the *sizes* (a :class:`SizePlan`), and
:mod:`hfexport.verify.fill` fills values of those sizes by input role, in one path for every kind
of input set.

An :class:`AxisGroup` is a set of axes that must have one size (every batch axis; the axes of one
sequence group such as ``input_ids``/``attention_mask``; the heights of one modality; the past
length a KV cache and the mask over ``past + new`` positions share) with the size of the sample
and the new one. What an axis means comes from the input-role table
(:mod:`hfexport.conventions.roles`). Three sources give the groups and their sizes, each with the
rules documented on :func:`hfexport.verify.second_shape.derive_second_inputs`:

- ``"dynamic"``: the export asked every axis dynamic (``dynamic=True``): one batch group
  (batch + 1), one group per token sequence (doubled, at least 65 tokens, capped by the model's
  positions; a quarter shorter when the sample's tokens are reused), raw audio (+ half), image
  sides per modality (doubled), fitted to what the captured program took;
- ``"dynamic_shapes"``: axes declared dynamic in ``config.dynamic_shapes``, grouped by role and by
  ``Dim`` name, each inside its declared range;
- ``"cache"``: a filled KV cache (a decode step): the batch and the past length, inside the ranges
  the program took; the number of new tokens stays.

An input set with an empty cache (a prefill) is planned as the other inputs are, with token
sequences kept below a static cache's length and ``cache_position`` following the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.conventions import (
    DECODER,
    SIGNAL,
    TEXT,
    input_role,
    max_positions,
    modality_of,
    placeholder_token_ids,
)
from hfexport.program_axes import STATUS_STATIC, axis_range, choose_size
from hfexport.tensors import get_leaf_tensors
from hfexport.verify.caches import cache_layer_kind, cache_past_length, find_cache, static_cache_length

__all__ = [
    "NO_VALUE_RULE",
    "PAST_LENGTH",
    "TOKEN_KINDS",
    "AxisGroup",
    "AxisMember",
    "SizePlan",
    "cache_state_paths",
    "plan_cache_sizes",
    "plan_second_shape",
    "prompt_placeholders",
]

#: the meaning of the axis group a filled KV cache and its mask share
PAST_LENGTH = "past length"
#: input kinds of the role table whose values a second shape cannot invent at another size: they
#: say where image tokens sit (``mm_token_type_ids``), describe images (``image_grid_thw``) or
#: count cache positions (only the cache rules of :mod:`hfexport.verify.fill` count them on)
NO_VALUE_RULE = ("modality_types", "grid", "cache_positions", "cache", "encoder_outputs")
#: input kinds aligned with the new tokens ``[batch, q, ...]`` of a decode step
TOKEN_KINDS = ("ids", "embeds", "type_ids")

Node = tuple[str, int]


@dataclass(frozen=True)
class AxisMember:
    """One axis of an :class:`AxisGroup`.

    Attributes:
        input: the forward kwarg (``input_ids``), or a cache leaf path (``cache.layers.0.keys``).
        axis: the axis index in that tensor.
        offset: the axis holds the group's size plus this (a 2-D mask over ``past + q`` positions
            carries the past length with offset ``q``); 0 for every other axis.
    """

    input: str
    axis: int
    offset: int = 0


@dataclass(frozen=True)
class AxisGroup:
    """Axes that must have one size, with the sample's size and the second shape's.

    Attributes:
        meaning: ``"batch"``, ``"sequence"``, ``"decoder sequence"``, ``"audio samples"``,
            ``"image height"``, ``"image width"``, ``"video height"`` ..., ``"past length"``, or
            ``"axis <n>"`` for an axis the role table does not know.
        members: the axes, in input order.
        sample: the size in the sample inputs (of the group's quantity: a mask member with an
            offset holds ``sample + offset``).
        size: the size in the second shape; ``size == sample`` when the group keeps its size.
        note: why the group keeps its size (``""`` when it changes, or nothing was tried); for
            an axis of a derived ``Dim``, the root it follows.
        dim: the ``torch.export.Dim`` name the group was declared with, or ``None``.
    """

    meaning: str
    members: tuple[AxisMember, ...]
    sample: int
    size: int
    note: str = ""
    dim: str | None = None

    @property
    def changes(self) -> bool:
        """Whether the second shape gives this group another size."""
        return self.size != self.sample

    def inputs(self) -> tuple[str, ...]:
        """The distinct inputs of the members, in order."""
        return tuple(dict.fromkeys(m.input for m in self.members))


@dataclass
class SizePlan:
    """The sizes of a second validation shape, per axis group (see the module docstring).

    Attributes:
        source: ``"dynamic"``, ``"dynamic_shapes"`` or ``"cache"`` (which rules chose the sizes).
        groups: the axis groups, changing or not.
        cache_key: the kwarg holding a transformers ``Cache``, or ``None``.
        cache_kind: ``"dynamic"`` / ``"static"`` for a filled cache whose past length is planned,
            ``"empty"`` for an empty cache (a prefill, copied unchanged), ``None`` without a cache.
        placeholders: ``{modality: token id}`` of the prompt's placeholder tokens the fill keeps
            in place (LLaVA's ``<image>`` tokens next to ``pixel_values``).
    """

    source: str
    groups: list[AxisGroup] = field(default_factory=list)
    cache_key: str | None = None
    cache_kind: str | None = None
    placeholders: dict[str, int] = field(default_factory=dict)

    def group(self, meaning: str) -> AxisGroup | None:
        """The first group of ``meaning``, or ``None``."""
        return next((g for g in self.groups if g.meaning == meaning), None)

    @property
    def past(self) -> AxisGroup | None:
        """The past-length group of a filled cache, or ``None``."""
        return self.group(PAST_LENGTH)

    def new_past(self) -> int:
        """The second shape's past length (0 without a filled cache)."""
        past = self.past
        return past.size if past is not None else 0

    def past_shift(self) -> int:
        """How far the past length moves (second minus sample; 0 without a filled cache)."""
        past = self.past
        return past.size - past.sample if past is not None else 0

    def sizes(self) -> dict[tuple[str, int], int]:
        """``{(input, axis): new size}`` of every axis of a changing group (offsets applied)."""
        out: dict[tuple[str, int], int] = {}
        for g in self.groups:
            if g.changes:
                for m in g.members:
                    out[(m.input, m.axis)] = g.size + m.offset
        return out

    def shape(self, key: str, tensor: torch.Tensor) -> tuple[int, ...]:
        """The second shape of input ``key`` (``tensor`` is its sample value)."""
        sizes = self.sizes()
        return tuple(sizes.get((key, axis), int(n)) for axis, n in enumerate(tensor.shape))

    @property
    def changes(self) -> bool:
        """Whether any group takes another size."""
        return any(g.changes for g in self.groups)


# -- the size rules --------------------------------------------------------------------------------
def _new_length(length: int, limit: int | None, *, minimum: int = 65) -> int:
    target = max(2 * length, minimum)
    if limit is not None:
        target = min(target, limit)
    return max(target, 1)


def _reuse_length(length: int, limit: int | None) -> int:
    """Sequence length of a second shape that reuses the sample's tokens: a quarter shorter (at
    least one token, never below 2), so every position stays inside the lengths the sample shows
    the model (a real LM's fp32 predictions, and so its top-1 agreement, degrade past them: IgLM-S
    at 122 -> 244 tokens, see :func:`hfexport.verify.second_shape.derive_second_inputs`); a sample
    too short for that grows as with drawn ids."""
    shorter = length - max(1, length // 4)
    if shorter >= 2:
        return shorter if limit is None else min(shorter, limit)
    return _new_length(length, limit)


def _program_size(
    program_axes: Sequence[Mapping[str, Any]], key: str, axis: int, sample: int, preferred: int
) -> int:
    """``preferred`` fitted to what the program holds for ``key``/``axis``: the sample size for a
    static axis, the size nearest ``preferred`` inside the range of a dynamic one; ``preferred``
    for an axis the program does not list."""
    for entry in program_axes:
        if entry.get("input") != key or entry.get("axis") != axis:
            continue
        if entry.get("status") == "static":
            return sample
        low = int(entry.get("min") or 0)
        high = entry.get("max")
        return choose_size(sample, preferred, low, int(high) if high is not None else None)
    return preferred


def _bounded_size(
    program_axes: Sequence[Mapping[str, Any]], key: str, axis: int, sample: int, preferred: int
) -> int:
    """``preferred`` moved inside the range of ``key``/``axis`` when the program bounds it from
    above; unchanged for an unbounded, static or unlisted axis (a specialised sequence stays
    derived, so the second-shape validation reports it)."""
    for entry in program_axes:
        if entry.get("input") == key and entry.get("axis") == axis:
            if entry.get("status") == "dynamic" and entry.get("max") is not None:
                # below the bound itself: a chunked forward often takes a path of its own at an exact
                # multiple of the chunk (no padding), which the program may exclude by a guard
                low, high = int(entry.get("min") or 0), int(entry["max"])
                return choose_size(sample, preferred, low, max(high - 1, low))
            break
    return preferred


def _token_bound(program_axes: Sequence[Mapping[str, Any]] | None, members: Sequence[Node]) -> int | None:
    """The lowest upper end the program's axis outcomes give any of ``members`` (token sequence axes
    that share one size) where the model, not the declared range, ends it (note ``"model-bounded"``:
    a range ending at the declared ``Dim(max=...)`` is the user's and its end is a valid size);
    ``None`` when none is."""
    highs = [
        int(e["max"])
        for e in program_axes or ()
        if e.get("status") == "dynamic"
        and e.get("note") == "model-bounded"
        and e.get("max") is not None
        and (str(e.get("input")), int(e.get("axis", -1))) in set(members)
    ]
    return min(highs) if highs else None


def _spatial_limits(program_axes: Sequence[Mapping[str, Any]] | None) -> dict[Node, int]:
    """``{(input, axis): max}`` of the program's axis outcomes that have an upper bound."""
    return {
        (str(e.get("input")), int(e.get("axis", -1))): int(e["max"])
        for e in program_axes or ()
        if e.get("max") is not None
    }


# -- placeholders of multimodal prompts ------------------------------------------------------------
def prompt_placeholders(tensors: Mapping[str, torch.Tensor], config: Any) -> dict[str, int]:
    """``{modality: placeholder token id}`` for the modalities whose input is present and whose
    placeholder token occurs in a text ``ids`` input (LLaVA: ``pixel_values`` and ``<image>``
    tokens in ``input_ids``); ids from :func:`hfexport.conventions.placeholder_token_ids`."""
    present = {modality_of(k) for k in tensors}
    ids = [
        t
        for k, t in tensors.items()
        if (role := input_role(k, t.dim(), present=tensors)) is not None and role.kind == "ids"
    ]
    found: dict[str, int] = {}
    for modality, token in placeholder_token_ids(config).items():
        if modality in present and any(bool((t == token).any()) for t in ids):
            found[modality] = token
    return found


def _placeholder_batch_fixed(
    tensors: Mapping[str, torch.Tensor],
    placeholders: Mapping[str, int],
    program_axes: Sequence[Mapping[str, Any]] | None,
) -> bool:
    """Whether the program holds static the batch of an input whose placeholders fill the prompt.

    The prompt's placeholder tokens are tied to the images (one token per vision feature), so with
    the image batch fixed by the program (transformers 5.24 LLaVA returns one feature tensor per
    image, so the output structure, and with it the image batch, is fixed at capture; the report
    reads ``"pixel_values batch: static 2 (model-fixed)"``), a second shape can only keep the batch
    of every input and change the prompt length."""
    if not placeholders or not program_axes:
        return False
    for entry in program_axes:
        key = entry.get("input")
        t = tensors.get(str(key))
        if t is None or entry.get("status") != "static":
            continue
        role = input_role(str(key), t.dim(), present=tensors)
        if role is not None and role.modality in placeholders and entry.get("axis") == role.batch_axis:
            return True
    return False


def _sequence_meaning(group: str) -> str:
    return {DECODER: "decoder sequence", SIGNAL: "audio samples"}.get(group, "sequence")


def _side_meaning(modality: str, side: str) -> str:
    return f"{'video' if modality == 'video' else 'image'} {side}"


# -- source "dynamic": every axis dynamic ------------------------------------------------------------
def _dynamic_plan(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    program_axes: Sequence[Mapping[str, Any]] | None,
    reuse: bool,
) -> SizePlan | str:
    batch = int(next(iter(tensors.values())).shape[0])
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors.values()):
        return "inputs do not share a leading batch dimension"
    config_ = getattr(model, "config", None)
    placeholders = prompt_placeholders(tensors, config_)
    fixed = _placeholder_batch_fixed(tensors, placeholders, program_axes)
    batch_members: list[AxisMember] = []
    # (meaning key) -> [members], sample, size, in the order the first input of each group comes
    groups: dict[str, tuple[str, list[AxisMember], int, int]] = {}
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None or role.batch_axis != 0 or role.kind in NO_VALUE_RULE:
            return f"no rule to derive a second shape for input {key!r} {tuple(t.shape)}"
        batch_members.append(AxisMember(key, 0))
        if role.sequence in (TEXT, DECODER) and role.sequence_axis is not None:
            axis = role.sequence_axis
            if role.sequence not in groups:
                decoder = role.sequence == DECODER
                sample = int(t.shape[axis])
                limit, _ = max_positions(config_, decoder=decoder)
                if reuse and not placeholders:
                    length = _reuse_length(sample, limit)
                elif decoder:
                    length = _new_length(sample, limit, minimum=2 * sample + 1)
                else:
                    length = _new_length(sample, limit)
                if program_axes is not None:  # a bounded range (chunked forward): a size it takes
                    length = _bounded_size(program_axes, key, axis, sample, length)
                groups[role.sequence] = (_sequence_meaning(role.sequence), [], sample, length)
            groups[role.sequence][1].append(AxisMember(key, axis))
        elif role.sequence == SIGNAL and role.sequence_axis is not None:
            sample = int(t.shape[role.sequence_axis])
            groups.setdefault(SIGNAL, (_sequence_meaning(SIGNAL), [], sample, sample + sample // 2))
            groups[SIGNAL][1].append(AxisMember(key, role.sequence_axis))
        elif role.spatial_axes:
            for side, axis in zip(("height", "width"), role.spatial_axes):
                name = f"{role.modality}.{side}"
                if name not in groups:
                    sample = int(t.shape[axis])
                    # a prompt with image tokens has one token per vision feature: keep the image size
                    grow = sample > 1 and role.modality not in placeholders
                    size = 2 * sample if grow else sample
                    if grow and program_axes is not None:
                        size = _program_size(program_axes, key, axis, sample, size)
                    groups[name] = (_side_meaning(role.modality, side), [], sample, size)
                groups[name][1].append(AxisMember(key, axis))
    note = "the program holds the batch of the images the prompt's placeholders stand for static"
    plan = SizePlan(
        "dynamic",
        [
            AxisGroup(
                "batch", tuple(batch_members), batch, batch if fixed else batch + 1, note if fixed else ""
            )
        ],
        placeholders=placeholders,
    )
    plan.groups += [AxisGroup(m, tuple(members), s, n) for m, members, s, n in groups.values()]
    return plan


# -- source "dynamic_shapes": the axes the export declared dynamic ---------------------------------
@dataclass
class _Declared:
    """One axis declared dynamic: its ``Dim`` name (``None`` for a hint), range and derivation."""

    name: str | None
    low: int
    high: int | None
    derived: tuple[str, Callable[[int], int]] | None = None


def _finite_int(value: Any) -> int | None:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(as_float) or as_float >= 2**62:
        return None
    return int(value)


def _declared(leaf: Any) -> _Declared | None:
    """The dynamic declaration of one ``dynamic_shapes`` leaf, or ``None`` for a static axis."""
    if leaf is None or isinstance(leaf, (bool, int)):
        return None
    hint_type = getattr(leaf, "type", None)
    if type(leaf).__name__ == "_DimHint" and hint_type is not None:
        if hint_type.name == "STATIC":
            return None
        return _Declared(None, _finite_int(leaf.min) or 0, _finite_int(leaf.max))
    root, fn = getattr(leaf, "root", None), getattr(leaf, "fn", None)
    if root is not None and callable(fn):
        return _Declared(None, 0, None, derived=(str(getattr(root, "__name__", root)), fn))
    if hasattr(leaf, "__name__") and hasattr(leaf, "min") and hasattr(leaf, "max"):
        return _Declared(str(leaf.__name__), _finite_int(leaf.min) or 0, _finite_int(leaf.max))
    return None


def _axis_specs(spec: Any, ndim: int) -> list[tuple[int, Any]]:
    if isinstance(spec, Mapping):
        return [(a, leaf) for a, leaf in spec.items() if isinstance(a, int) and 0 <= a < ndim]
    if isinstance(spec, (list, tuple)):
        return list(enumerate(spec))[:ndim]
    return []


class _Union:
    """Union-find over axes: the axes that must share one size."""

    def __init__(self, nodes: Iterable[Node]) -> None:
        self.parent = {node: node for node in nodes}

    def __contains__(self, node: Node) -> bool:
        return node in self.parent

    def find(self, node: Node) -> Node:
        while self.parent[node] != node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a: Node, b: Node) -> None:
        self.parent[self.find(a)] = self.find(b)

    def sets(self) -> list[list[Node]]:
        out: dict[Node, list[Node]] = {}
        for node in self.parent:
            out.setdefault(self.find(node), []).append(node)
        return list(out.values())


def _role_groups(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[Node, str], list[list[Node]]]:
    """What each axis means (``batch``, a sequence group, ``spatial``) and the axes that must have
    one size by the role table: the batch axes of one modality, the axes of one sequence group,
    the heights (widths) of one modality."""
    meaning: dict[Node, str] = {}
    groups: dict[tuple[str, str], list[Node]] = {}
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None:
            continue
        if role.batch_axis is not None:
            meaning[(key, role.batch_axis)] = "batch"
            groups.setdefault(("batch", role.modality), []).append((key, role.batch_axis))
        if role.sequence_axis is not None and role.sequence is not None:
            meaning[(key, role.sequence_axis)] = role.sequence
            groups.setdefault(("sequence", role.sequence), []).append((key, role.sequence_axis))
        for side, axis in zip(("height", "width"), role.spatial_axes):
            meaning[(key, axis)] = "spatial"
            groups.setdefault((side, role.modality), []).append((key, axis))
    return meaning, list(groups.values())


def _declared_meaning(kind: str, node: Node, tensors: Mapping[str, torch.Tensor]) -> str:
    if kind in (TEXT, DECODER, SIGNAL):
        return _sequence_meaning(kind)
    if kind == "batch":
        return "batch"
    key, axis = node
    role = input_role(key, tensors[key].dim(), present=tensors)
    if kind == "spatial" and role is not None:
        return _side_meaning(role.modality, "height" if axis == role.spatial_axes[0] else "width")
    return f"axis {axis}"


def _declared_plan(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    spec: Any,
    *,
    program_axes: Sequence[Mapping[str, Any]] | None,
    reuse: bool,
) -> SizePlan | str:
    if not isinstance(spec, Mapping):
        return "dynamic_shapes is not a dict keyed by forward kwarg name; no second shape derived"
    declared: dict[Node, _Declared] = {}
    for key, t in tensors.items():
        for axis, leaf in _axis_specs(spec.get(key), t.dim()):
            found = _declared(leaf)
            if found is not None:
                declared[(key, axis)] = found
    if not declared:
        return "dynamic_shapes declares no dynamic axis (every axis is static): the program takes one shape"

    union = _Union(node for node, d in declared.items() if not d.derived)
    meaning, role_groups = _role_groups(tensors)
    blocked: set[Node] = set()
    notes: list[str] = []
    for members in role_groups:
        dynamic = [m for m in members if m in union]
        static = [m for m in members if m not in declared]
        if not dynamic:
            continue
        if static:
            blocked.update(dynamic)
            notes.append(
                f"{static[0][0]} axis {static[0][1]} is static but must match the dynamic "
                f"{dynamic[0][0]} axis {dynamic[0][1]}"
            )
            continue
        for m in dynamic[1:]:
            union.union(m, dynamic[0])
    by_name: dict[str, Node] = {}
    for node, d in declared.items():
        if d.name is not None and node in union:
            if d.name in by_name:
                union.union(node, by_name[d.name])
            else:
                by_name[d.name] = node

    config_ = getattr(model, "config", None)
    placeholders = prompt_placeholders(tensors, config_)
    limits = _spatial_limits(program_axes)
    priority = (TEXT, DECODER, SIGNAL, "batch", "spatial")
    plan = SizePlan("dynamic_shapes", placeholders=placeholders)
    sizes: dict[Node, int] = {}
    for members in union.sets():
        if any(m in blocked for m in members):
            continue
        kinds = [meaning.get(m, "other") for m in members]
        kind = min(kinds, key=lambda k: priority.index(k) if k in priority else len(priority))
        sample = int(tensors[members[0][0]].shape[members[0][1]])
        low = max(declared[m].low for m in members)
        highs = [declared[m].high for m in members if declared[m].high is not None]
        if kind in (TEXT, DECODER):
            limit, _ = max_positions(config_, decoder=kind == DECODER)
            if limit is not None:
                highs.append(limit)
            # a program whose range ends below the declared one (a forward looping over the sample's
            # chunk count: Qwen3.5's gated delta rule, <= 63 tokens against a declared 512) takes a
            # size below its end, as the dynamic_shapes-free plan gives it (_bounded_size)
            bounded = _token_bound(program_axes, members)
            if bounded is not None:
                highs.append(max(bounded - 1, low))
        high = min(highs) if highs else None
        if kind == "batch":
            preferred = sample + 1
        elif kind in (TEXT, DECODER) and reuse and not placeholders:
            preferred = _reuse_length(sample, None)
        elif kind == TEXT:
            preferred = _new_length(sample, None)
        elif kind == DECODER:
            preferred = _new_length(sample, None, minimum=2 * sample + 1)
        elif kind == SIGNAL:
            preferred = sample + sample // 2
        else:
            preferred = 2 * sample
        size = choose_size(sample, preferred, low, high)
        note = ""
        if size == sample:
            note = (
                f"{members[0][0]} axis {members[0][1]} has no other size in its range [{max(low, 2)}, {high}]"
            )
            notes.append(note)
        else:
            sizes.update(dict.fromkeys(members, size))
        if kind == "spatial" and size != sample:
            # a side the captured program fixes or bounds (ViT: its position embeddings fix the image
            # size) stays inside what the program takes (the fill keeps the leading rows and columns)
            bound = [limits[m] for m in members if m in limits]
            if bound and min(bound) < size:
                size = min(bound)
        names = {declared[m].name for m in members if declared[m].name is not None}
        group = AxisGroup(
            _declared_meaning(kind, members[0], tensors),
            tuple(AxisMember(k, a) for k, a in members),
            sample,
            size,
            note,
            min(names) if names else None,
        )
        plan.groups.append(group)
    for node, d in declared.items():
        if d.derived is not None:
            root_node = by_name.get(d.derived[0])
            if root_node is not None and root_node in sizes:
                sample = int(tensors[node[0]].shape[node[1]])
                derived_size = int(d.derived[1](sizes[root_node]))
                plan.groups.append(
                    AxisGroup(
                        f"axis {node[1]}",
                        (AxisMember(*node),),
                        sample,
                        derived_size,
                        f"derived from Dim {d.derived[0]!r}",
                    )
                )
                sizes[node] = derived_size
    if not sizes:
        return "no declared dynamic axis can take another size: " + "; ".join(notes)
    for key, t in tensors.items():
        # integer inputs the role table does not know (cu_seqlens, grid_thw ...) usually describe the
        # other inputs' layout: values drawn for a new size would not describe them any more
        if input_role(key, t.dim(), present=tensors) is None and not t.is_floating_point():
            return (
                f"input {key!r} {tuple(t.shape)} holds integers the input-role table has no rule for; "
                "their values may depend on the other inputs' sizes, so pass second_inputs explicitly"
            )
    return plan


# -- source "cache": a filled KV cache (a decode step) ---------------------------------------------
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


def _ranged_size(
    sample: int,
    preferred: int,
    groups: Sequence[tuple[Sequence[Node], int]],
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


def cache_state_paths(cache: Any) -> dict[str, torch.Tensor]:
    """``{leaf path: tensor}`` of the key/value tensors of ``cache`` (``layers.0.keys`` ...)."""
    return {p: t for p, t in get_leaf_tensors(cache).items() if p.rsplit(".", 1)[-1] in ("keys", "values")}


def plan_cache_sizes(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    config: Any = None,
    program_axes: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[SizePlan | None, str]:
    """The size plan of a decode step's inputs (a filled KV cache among them): two groups, ``batch``
    (every input's batch axis and the cache tensors' axis 0) and ``past length`` (the mask's axis 1
    with offset ``q``, the new tokens, and a growing cache's position axis), each inside the range
    the program takes (see :func:`hfexport.verify.second_shape.derive_cache_second_inputs` for the
    rules).

    Args:
        model: the eager component (its ``config`` gives the maximum positions).
        inputs: its forward kwargs: one ``Cache``, tensors, scalar flags.
        config: the export config (explicit ``dynamic_shapes`` say which axes may change when the
            program's outcomes do not list them).
        program_axes: the program's axis outcomes (cache leaves named by their path), or ``None``.

    Returns:
        ``(plan, "")``, or ``(None, reason)``: no cache, an encoder-decoder cache, an empty cache (a
        prefill: :func:`plan_second_shape` plans it), layers other than ``DynamicLayer`` /
        ``StaticLayer``, an input without a rule next to the cache, or neither group can change.

    Raises:
        ValueError: ``inputs`` hold more than one ``Cache``.
    """
    plan = _cache_plan(model, inputs, config=config, program_axes=program_axes)
    return (None, plan) if isinstance(plan, str) else (plan, "")


def _cache_plan(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    config: Any,
    program_axes: Sequence[Mapping[str, Any]] | None,
) -> SizePlan | str:
    found = find_cache(inputs)
    if found is None:
        return "no cache among the inputs"
    cache_key, cache = found
    if hasattr(cache, "self_attention_cache"):
        return (
            f"{type(cache).__name__} {cache_key!r}: no second-shape rule for encoder-decoder caches (the "
            "cross-attention part is tied to the encoder outputs)"
        )
    others = {k: v for k, v in inputs.items() if k != cache_key and not isinstance(v, torch.Tensor)}
    odd = sorted(k for k, v in others.items() if v is not None and not isinstance(v, (bool, int, float, str)))
    if odd:
        return f"non-tensor inputs {odd} next to the cache have no second-shape rule"
    if not get_leaf_tensors(cache):
        return (
            f"the cache {cache_key!r} holds no tensor (a prefill): the other inputs take the plain second shape "
            "(hfexport.validation.derive_second_inputs derives them)"
        )
    kinds = {cache_layer_kind(layer) for layer in getattr(cache, "layers", [])}
    if not kinds or None in kinds or len(kinds) > 1:
        names = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        return (
            f"{type(cache).__name__} {cache_key!r} with layers {names}: a second past length is derived for "
            "caches of DynamicLayer or of StaticLayer only"
        )
    static = kinds == {"static"}
    if not all(getattr(layer, "is_initialized", False) for layer in cache.layers):
        return f"{type(cache).__name__} {cache_key!r} has uninitialised layers next to filled ones"
    past = cache_past_length(cache)
    if past < 1:
        return f"{type(cache).__name__} {cache_key!r} is allocated but holds no position"

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    roles = {k: input_role(k, t.dim(), present=tensors) for k, t in tensors.items()}
    unknown = sorted(k for k, r in roles.items() if r is None)
    if unknown:
        return f"inputs {unknown} next to the cache have no entry in the input-role table"
    tokens = [k for k, r in roles.items() if r is not None and r.kind in TOKEN_KINDS and r.batch_axis == 0]
    if not tokens:
        return "no token input (input_ids / inputs_embeds) next to the cache"
    token_key = tokens[0]
    batch, q = int(tensors[token_key].shape[0]), int(tensors[token_key].shape[1])
    decoder = roles[token_key] is not None and roles[token_key].sequence == DECODER  # type: ignore[union-attr]
    leaves = get_leaf_tensors(cache)
    state = cache_state_paths(cache)
    if any(t.dim() != 4 or int(t.shape[0]) != batch for t in state.values()):
        return f"cache tensors of {cache_key!r} are not [batch={batch}, heads, positions, head_dim]"
    cross_masks = [k for k, r in roles.items() if r is not None and r.kind == "cross_mask"]
    held: set[str] = set()
    if cross_masks and not static:
        # a cross-attending language model (Mllama; issue 28): its cross-attention layers hold the
        # image's keys and values, as many positions as image tokens, not the past; they keep
        # their length at another past (only the batch changes), and the cross-attention mask is
        # the new tokens' row of it, [batch, q, images, tiles]
        held = {p for p, t in state.items() if int(t.shape[2]) != past}
        for key in cross_masks:
            if int(tensors[key].shape[1]) != q:
                return (
                    f"{key!r} {tuple(tensors[key].shape)} is not the new tokens' row of the cross-attention "
                    f"mask ({q} tokens on axis 1); no rule to derive it at another past length"
                )
    extra = sorted(set(leaves) - set(state) - {p for p in leaves if p.endswith(".cumulative_length")})
    if extra:
        return f"cache state {extra[:3]} has no second-shape rule"

    # which axes may change, inside which range
    batch_pairs = [(k, r.batch_axis) for k, r in roles.items() if r is not None and r.batch_axis is not None]
    batch_pairs += [(f"{cache_key}.{p}", 0) for p in state]
    new_batch, batch_note = _ranged_size(batch, batch + 1, [(batch_pairs, 0)], program_axes, config)
    masks = [k for k, r in roles.items() if r is not None and r.kind == "mask"]
    for key in masks:
        if tensors[key].dim() != 2 or int(tensors[key].shape[1]) != past + q:
            return (
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
    past_groups: list[tuple[Sequence[Node], int]] = [([(k, 1)], q) for k in masks]
    if not static:  # a growing cache carries the past length on its position axis
        past_groups.append(([(f"{cache_key}.{p}", 2) for p in state if p not in held], 0))
    new_past, past_note = _ranged_size(past, 2 * past + 1, past_groups, program_axes, config, limits=limits)
    if new_batch == batch and new_past == past:
        return (
            f"neither the batch ({batch_note}) nor the past length of {cache_key!r} ({past_note}) can take "
            "another size"
        )
    for key, value in tensors.items():
        role = roles[key]
        assert role is not None
        if not (
            (role.kind in TOKEN_KINDS and role.batch_axis == 0)
            or (role.kind == "positions" and role.batch_axis is not None and role.sequence_axis is not None)
            or role.kind == "mask"
            or key in cross_masks
            or (role.kind == "cache_positions" and value.dim() == 1)
        ):
            return f"no rule to derive {key!r} {tuple(value.shape)} at another past length"
    past_members = [AxisMember(k, 1, q) for k in masks]
    if not static:
        past_members += [AxisMember(f"{cache_key}.{p}", 2) for p in state if p not in held]
    return SizePlan(
        "cache",
        [
            AxisGroup("batch", tuple(AxisMember(k, a) for k, a in batch_pairs), batch, new_batch, batch_note),
            AxisGroup(PAST_LENGTH, tuple(past_members), past, new_past, past_note),
        ],
        cache_key=cache_key,
        cache_kind="static" if static else "dynamic",
    )


# -- an empty cache (a prefill) --------------------------------------------------------------------
def _prefill_plan(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    found: tuple[str, Any],
    *,
    config: Any,
    program_axes: Sequence[Mapping[str, Any]] | None,
    reuse: bool,
) -> SizePlan | str:
    """The plan of the inputs other than the (empty) cache, token sequences no longer than a static
    cache takes (``max_cache_len - 1``: a mask as long as the cache takes another branch in
    transformers), ``cache_position`` following the last token sequence; the cache is copied."""
    cache_key, cache = found
    rest = {k: v for k, v in inputs.items() if k not in (cache_key, "cache_position")}
    plan = _plan_without_cache(model, rest, config=config, program_axes=program_axes, reuse=reuse)
    if isinstance(plan, str):
        return plan
    capacity = static_cache_length(cache)
    tensors = {k: v for k, v in rest.items() if isinstance(v, torch.Tensor)}
    order = list(tensors)
    last: tuple[int, AxisMember] | None = None  # the last token sequence in input order
    for index, group in enumerate(plan.groups):
        tokens = False
        for m in group.members:
            t = tensors.get(m.input)
            role = input_role(m.input, t.dim(), present=tensors) if t is not None else None
            if role is not None and role.sequence in (TEXT, DECODER) and m.axis == role.sequence_axis:
                tokens = True
                if last is None or order.index(m.input) >= order.index(last[1].input):
                    last = (index, m)
        if tokens and capacity is not None and group.size > capacity - 1:
            plan.groups[index] = AxisGroup(
                group.meaning, group.members, group.sample, capacity - 1, group.note, group.dim
            )
    position = inputs.get("cache_position")
    if isinstance(position, torch.Tensor):
        if last is None:
            # the sequence axis may be static (declared): cache_position then keeps its length
            if not any(
                (r := input_role(k, t.dim(), present=tensors)) is not None
                and r.sequence in (TEXT, DECODER)
                and r.sequence_axis is not None
                for k, t in tensors.items()
            ):
                return "cache_position next to no token sequence: no rule to derive it"
        else:
            index = last[0]
            group = plan.groups[index]
            plan.groups[index] = AxisGroup(
                group.meaning,
                (*group.members, AxisMember("cache_position", 0)),
                group.sample,
                group.size,
                group.note,
                group.dim,
            )
    plan.cache_key, plan.cache_kind = cache_key, "empty"
    return plan


def _plan_without_cache(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    config: Any,
    program_axes: Sequence[Mapping[str, Any]] | None,
    reuse: bool,
) -> SizePlan | str:
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    if any(v is not None and not isinstance(v, (bool, int, float, str)) for v in others.values()):
        return f"non-tensor inputs {sorted(others)} (e.g. a cache) need a component-specific second shape"
    if not tensors:
        return "no tensor inputs"
    explicit = getattr(config, "dynamic_shapes", None) if config is not None else None
    if explicit:
        return _declared_plan(model, tensors, explicit, program_axes=program_axes, reuse=reuse)
    return _dynamic_plan(model, tensors, program_axes=program_axes, reuse=reuse)


def plan_second_shape(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    config: Any = None,
    program_axes: Sequence[Mapping[str, Any]] | None = None,
    reuse: bool = False,
) -> tuple[SizePlan | None, str]:
    """The size plan of a second validation shape for ``inputs`` (the rules are those of
    :func:`hfexport.verify.second_shape.derive_second_inputs`, which fills values into it).

    Args:
        model: the eager model or component (its ``config`` gives the maximum positions and the
            placeholder token ids).
        inputs: the prepared forward kwargs (tensors, scalar flags, at most one transformers
            ``Cache``).
        config: the export config; its ``dynamic_shapes`` select the axes (``None`` or empty: every
            axis is taken as dynamic).
        program_axes: the captured program's axis outcomes (``input``, ``axis``, ``status``,
            ``min``, ``max``, as ``report.dynamic_axes`` records them); ``None``: not captured yet.
        reuse: the token inputs will reuse the sample's tokens (a quality-gated export): token
            sequences get a quarter shorter instead of doubling.

    Returns:
        ``(plan, "")``, or ``(None, reason)`` when no sound second shape can be planned (an input
        without a rule, no axis that can change, a cache without a rule).

    Raises:
        ValueError: ``inputs`` hold more than one ``Cache``.
    """
    found = find_cache(inputs)
    if found is None:
        plan = _plan_without_cache(model, inputs, config=config, program_axes=program_axes, reuse=reuse)
    elif get_leaf_tensors(found[1]):  # a filled cache: another past length
        plan = _cache_plan(model, inputs, config=config, program_axes=program_axes)
    else:
        plan = _prefill_plan(model, inputs, found, config=config, program_axes=program_axes, reuse=reuse)
    return (None, plan) if isinstance(plan, str) else (plan, "")
