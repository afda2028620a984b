"""What a captured program made of the input axes an export asked to be dynamic.

``torch.export`` may keep an axis marked dynamic (``Dim.AUTO``, a named ``Dim``) symbolic, bound
it, or specialise it to its sample size because the model needs that size: ViT without
``interpolate_pos_encoding`` compares the image side with ``config.image_size`` and adds position
embeddings of that grid, so its image height and width come out static. Nothing but the captured
program says which happened, so :func:`program_input_axes` reads it from the program's input
placeholders and range constraints, the capture records it in the export report
(``report.dynamic_axes``, with one line per input in ``report.dynamic_axes_summary``
such as ``"pixel_values image height/width: static 32 (model-fixed)"``), and the second-shape
validation keeps such axes at their size (:func:`hfexport.validation.derive_second_inputs`,
``program_axes``).
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.conventions import DECODER, SIGNAL, input_role

__all__ = [
    "MEMORY_BUDGET_NOTE",
    "SPATIAL_GROWTH",
    "axes_summary",
    "axis_meaning",
    "axis_range",
    "choose_size",
    "guards_accept",
    "program_input_axes",
    "sides_fixed_by_guards",
]

#: A dynamic image side (or audio feature axis) is expected to reach at least this many times its
#: sample size; a program range ending below that is reported as ``model-bounded``.
SPATIAL_GROWTH = 4

STATUS_STATIC = "static"
STATUS_DYNAMIC = "dynamic"
#: the note of an axis whose upper bound a backend narrowed to fit its memory budget after capture
#: (ExecuTorch's memory planning: ``"input_ids sequence: dynamic [1, 1024] (memory budget)"``)
MEMORY_BUDGET_NOTE = "memory budget"


def _is_dynamic_leaf(leaf: Any) -> bool:
    from hfexport.workarounds.torch_export import _is_dynamic_marker

    return _is_dynamic_marker(leaf)


def _asked_dynamic(spec: Any, ndim: int) -> list[int]:
    """Axes of one tensor's ``dynamic_shapes`` entry marked dynamic."""
    if isinstance(spec, Mapping):
        return sorted(
            a for a, leaf in spec.items() if isinstance(a, int) and a < ndim and _is_dynamic_leaf(leaf)
        )
    if isinstance(spec, (list, tuple)):
        return [a for a, leaf in enumerate(spec[:ndim]) if _is_dynamic_leaf(leaf)]
    return []


def _asked_max(spec: Any, axis: int) -> int | None:
    """The upper bound the export asked for on ``axis`` (a named ``Dim``'s or a bounded
    ``Dim.AUTO``'s ``max``); ``None`` when unbounded or not given."""
    if isinstance(spec, Mapping):
        leaf = spec.get(axis)
    elif isinstance(spec, (list, tuple)) and axis < len(spec):
        leaf = spec[axis]
    else:
        return None
    high = getattr(leaf, "max", None)
    return _finite(high) if high is not None else None


def axis_meaning(key: str, tensor: torch.Tensor, axis: int, present: Mapping[str, Any]) -> str:
    """What ``axis`` of input ``key`` means by the input-role table: ``"batch"``, ``"sequence"``,
    ``"decoder sequence"``, ``"image height"``, an axis the role names (``"images"``, ``"tiles"``)
    ... or ``"axis <n>"``."""
    role = input_role(key, tensor.dim(), present=present)
    if role is None:
        return f"axis {axis}"
    if axis == role.batch_axis:
        return "batch"
    if axis == role.sequence_axis:
        return {DECODER: "decoder sequence", SIGNAL: "audio samples"}.get(str(role.sequence), "sequence")
    if axis in role.spatial_axes:
        prefix = "video" if role.modality == "video" else "image"
        side = "height" if axis == role.spatial_axes[0] else "width"
        return f"{prefix} {side}"
    if role.kind == "pixels" and role.spatial_axes and axis == role.spatial_axes[0] - 1:
        return "video channels" if role.modality == "video" else "image channels"
    if role.kind == "features":
        return f"audio features axis {axis}"
    return role.axis_name(axis) or f"axis {axis}"


def _user_input_values(program: torch.export.ExportedProgram) -> dict[str, Any] | None:
    """The program's keyword inputs as fake values (tensors with ``SymInt`` sizes), by name."""
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    spec = program.call_spec.in_spec
    if spec is None or any(n not in by_name for n in names):
        return None
    values = [by_name[n].meta.get("val") for n in names]
    try:
        args_kwargs = pytree.tree_unflatten(values, spec)
    except Exception:  # a spec that does not match the placeholders: nothing to read
        return None
    if not isinstance(args_kwargs, tuple) or len(args_kwargs) != 2 or not isinstance(args_kwargs[1], dict):
        return None
    return args_kwargs[1]


def _finite(value: Any) -> int | None:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    if as_float == float("inf") or as_float >= 2**62:
        return None
    return int(value)


def program_input_axes(
    program: torch.export.ExportedProgram,
    inputs: Mapping[str, Any],
    dynamic_shapes: Any,
    position_limit: int | None = None,
) -> list[dict[str, Any]]:
    """The outcome of every top-level tensor input axis that ``dynamic_shapes`` marked dynamic.

    Args:
        program: the captured program (its keyword inputs are the forward kwargs).
        inputs: the forward kwargs it was traced with (sample sizes).
        dynamic_shapes: the ``dynamic_shapes`` given to ``torch.export`` (dict keyed by kwarg).
        position_limit: the model's own sequence limit (``max_position_embeddings``): a sequence
            range ending there is the model's documented limit, not ``"model-bounded"``.

    Returns:
        One dict per such axis, in input and axis order: ``input`` (kwarg name), ``axis``,
        ``meaning`` (``"batch"``, ``"sequence"``, ``"image height"``, ``"audio features axis 1"``
        ...), ``sample`` (its size in ``inputs``), ``status`` (``"dynamic"`` or ``"static"``),
        ``min``/``max`` (the program's range; ``max`` is ``None`` when unbounded; both the size for a
        static axis) and ``note``: ``"model-fixed"`` for an axis the capture specialised
        (``"weights"`` for image channels, which the first layer fixes),
        ``"model-bounded"`` for an image side or audio feature axis whose range ends below
        :data:`SPATIAL_GROWTH` times the sample, and for a sequence axis whose range ends below
        the bound the export asked for (none for ``Dim.AUTO``: a forward that loops over
        fixed-size chunks of the sequence accepts only as many chunks as the sample had), else
        ``""``. ``[]`` when ``dynamic_shapes`` is not
        a dict or the program's inputs cannot be matched to the kwargs.
    """
    if not isinstance(dynamic_shapes, Mapping):
        return []
    values = _user_input_values(program)
    if values is None:
        return []
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    out: list[dict[str, Any]] = []
    for key, tensor in tensors.items():
        fake = values.get(key)
        if not isinstance(fake, torch.Tensor) or fake.dim() != tensor.dim():
            continue
        for axis in _asked_dynamic(dynamic_shapes.get(key), tensor.dim()):
            size = fake.shape[axis]
            sample = int(tensor.shape[axis])
            meaning = axis_meaning(key, tensor, axis, tensors)
            entry: dict[str, Any] = {"input": key, "axis": axis, "meaning": meaning, "sample": sample}
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.free_symbols:
                vr = program.range_constraints.get(expr)
                low = _finite(vr.lower) if vr is not None else None
                high = _finite(vr.upper) if vr is not None else None
                note = ""
                grows = meaning.startswith(("image", "video", "audio features"))
                if grows and high is not None and high < SPATIAL_GROWTH * sample:
                    note = "model-bounded"
                asked = _asked_max(dynamic_shapes.get(key), axis)
                if (
                    meaning.endswith("sequence")
                    and high is not None
                    and (asked is None or high < asked)
                    and (position_limit is None or high < position_limit)
                ):
                    note = "model-bounded"  # e.g. a forward that loops over fixed-size chunks
                entry.update(status=STATUS_DYNAMIC, min=low, max=high, note=note)
            else:
                value = int(expr) if expr is not None else int(size)
                # channels are fixed by the first layer's weights, never expected to vary
                note = "weights" if meaning.endswith(" channels") else "model-fixed"
                entry.update(status=STATUS_STATIC, min=value, max=value, note=note)
            out.append(entry)
    _bound_by_guards(program, tensors, out, position_limit)
    _fix_sides_by_guards(program, tensors, out)
    return out


def sides_fixed_by_guards(
    program: torch.export.ExportedProgram, inputs: Mapping[str, Any], dynamic_shapes: Any
) -> list[dict[str, Any]]:
    """The image sides ``Dim.AUTO`` left symbolic in ``program`` whose input guards accept only the
    sample's size (:func:`program_input_axes` reads them ``"static <size> (model-fixed)"``).

    Swin's windows are the case (issue 28): at a 32 px sample its later stages are no larger than a
    window, so the forward takes its ``min(height, width) <= window_size`` branch; torch records
    that as guards, not as a range, and the program's graph keeps the sides as symbols that every
    size computation downstream carries (floor divisions of the padded window grids). A backend that
    re-traces the program (ExecuTorch's and OpenVINO's decompositions) simplifies those expressions
    again for every view, which is where the time goes (pytorch/pytorch#141675: ``FloorDiv.eval``'s
    ``sympy.simplify``), for sides no input but the sample's can take.

    Args:
        program: the captured program (its keyword inputs are the forward kwargs).
        inputs: the forward kwargs it was traced with (sample sizes).
        dynamic_shapes: the ``dynamic_shapes`` given to ``torch.export`` (dict keyed by kwarg);
            only sides marked ``Dim.AUTO`` are returned (a named ``Dim`` or ``Dim.DYNAMIC`` is the
            caller's demand).

    Returns:
        One dict per such side (``input``, ``axis``, ``sample``), in input and axis order, in the
        form :func:`hfexport.side_probe.keep_sides_static` takes; ``[]`` when there are none, or
        when ``dynamic_shapes`` is not a dict or the program's inputs cannot be matched.
    """
    from hfexport.side_probe import _is_auto_hint, _leaf

    if not isinstance(dynamic_shapes, Mapping):
        return []
    values = _user_input_values(program)
    if values is None:
        return []
    found = []
    for entry in program_input_axes(program, inputs, dynamic_shapes):
        meaning = str(entry["meaning"])
        if (
            entry["status"] != STATUS_STATIC
            or entry["note"] != "model-fixed"
            or not meaning.startswith(("image ", "video "))
            or meaning.endswith(" channels")
            or not _is_auto_hint(_leaf(dynamic_shapes.get(entry["input"]), entry["axis"]))
        ):
            continue
        fake = values.get(entry["input"])
        size = fake.shape[entry["axis"]] if isinstance(fake, torch.Tensor) else None
        if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:  # static by guards only
            found.append({"input": entry["input"], "axis": entry["axis"], "sample": entry["sample"]})
    return found


#: how far past the sample a sequence axis is checked against the program's input guards
GUARD_SCAN_LIMIT = 4096


class _Sized:
    """Stands for an input in a guard expression: only its ``size()`` is read."""

    def __init__(self, shape: Sequence[int]) -> None:
        self._shape = tuple(int(d) for d in shape)

    def size(self) -> tuple[int, ...]:
        return self._shape


def guards_accept(program: Any, shapes: Mapping[str, Sequence[int]]) -> bool | None:
    """Whether the input guards ``torch.export`` recorded for ``program`` (its ``_guards_code``,
    the Python expressions its module asserts before running) hold for inputs of ``shapes``.

    Args:
        program: a captured ``ExportedProgram``.
        shapes: forward kwarg name -> the shape to check (every input the guards name).

    Returns:
        ``True`` / ``False``; ``None`` when the program records no guards or one of them cannot be
        evaluated from shapes alone (it names another input, an unknown function).
    """
    code = getattr(program, "_guards_code", None)
    if not code:
        return None
    inputs = {"L": {k: _Sized(v) for k, v in shapes.items()}}
    # torch writes ceil as math.ceil, a float of a size as torch.sym_float (DepthPro's image pyramid:
    # math.trunc(0.25 * torch.sym_float(width)) == 8; DINOv3's patch-center coordinates) and a square
    # root as torch._sym_sqrt
    scope = {"__builtins__": {}, "max": max, "min": min, "math": math, "torch": _GUARD_TORCH}
    try:
        return all(bool(eval(expr, scope, inputs)) for expr in _compiled(tuple(code)))
    except Exception:  # a guard outside shape arithmetic: undecided
        return None


#: The ``torch`` names a guard expression calls, on plain Python numbers (torch's own ``sym_*``
#: functions are the same operations on concrete ints and floats).
_GUARD_TORCH = types.SimpleNamespace(
    sym_float=float,
    sym_int=int,
    sym_max=max,
    sym_min=min,
    sym_sqrt=math.sqrt,
    _sym_sqrt=math.sqrt,
    sym_not=operator.not_,
    sym_ite=lambda condition, then, otherwise: then if condition else otherwise,
)

_COMPILED: dict[tuple[str, ...], list[Any]] = {}


def _compiled(code: tuple[str, ...]) -> list[Any]:
    if code not in _COMPILED:
        _COMPILED.clear()  # one program at a time
        _COMPILED[code] = [compile(expr, "<export guard>", "eval") for expr in code]
    return _COMPILED[code]


def _bound_by_guards(
    program: Any,
    tensors: Mapping[str, torch.Tensor],
    entries: list[dict[str, Any]],
    position_limit: int | None,
) -> None:
    """Find an upper bound the program's input guards put on a sequence axis its range leaves open.

    A forward that pads the sequence to whole chunks and loops over them in Python (chunked
    gated-delta-rule linear attention: qwen3_next, olmo_hybrid) is captured for the sample's chunk
    count; torch records that as a guard such as ``ceil(length / 64) == 1``, not as a range, so the
    program's range says ``[4, inf]`` (or the explicit bound the export asked for: ExecuTorch bounds
    every axis, ``[4, 512]``). Every length from the sample up to the range's end is checked against
    the guards (all inputs sharing the axis move together); the first refused one closes the range:
    the entries get ``max`` and the note ``"model-bounded"``.
    """
    for meaning in ("sequence", "decoder sequence"):
        group = [
            e
            for e in entries
            if e["meaning"] == meaning and e["status"] == STATUS_DYNAMIC and e["note"] != "model-bounded"
        ]
        if not group:
            continue
        sample = group[0]["sample"]
        shapes = {k: list(t.shape) for k, t in tensors.items()}
        if guards_accept(program, shapes) is not True:
            return  # no guards, or not decidable from shapes
        ceiling = min(position_limit or GUARD_SCAN_LIMIT, GUARD_SCAN_LIMIT)
        if group[0]["max"] is not None:
            ceiling = min(ceiling, int(group[0]["max"]))
        for length in range(sample + 1, ceiling + 1):
            for e in group:
                shapes[e["input"]][e["axis"]] = length
            accepted = guards_accept(program, shapes)
            if accepted is None:
                break
            if not accepted:
                for e in group:
                    e.update(max=length - 1, note="model-bounded")
                break


def _fix_sides_by_guards(
    program: Any, tensors: Mapping[str, torch.Tensor], entries: list[dict[str, Any]]
) -> None:
    """Mark image sides whose range is open but whose input guards accept the sample's size only.

    A vision transformer that returns its position table unchanged when the patch grid is the one it
    was trained on, and interpolates it otherwise (DINOv2's ``interpolate_pos_encoding``), is captured
    on the first branch; torch records ``(height // 8) * (width // 8) == 16`` as a guard, not as a
    range (MobileViT: ``math.ceil``-written block counts; Swin: window-size minimums). Each side is
    doubled alone (the inputs sharing it move together): a side the guards refuse at twice the
    sample becomes ``status="static"`` at the sample's size with the note ``"model-fixed"``; when
    the guards then refuse the remaining sides doubled together, those are fixed too. A second
    shape keeps fixed sides at the sample's size.
    """
    group = [
        e
        for e in entries
        if str(e["meaning"]).startswith(("image ", "video "))
        and e["status"] == STATUS_DYNAMIC
        and not str(e["meaning"]).endswith(" channels")
    ]
    if not group:
        return
    shapes = {k: list(t.shape) for k, t in tensors.items()}
    if guards_accept(program, shapes) is not True:
        return  # no guards, or not decidable from shapes

    def accepted(moved: set[str]) -> bool | None:
        trial = {k: list(v) for k, v in shapes.items()}
        for e in group:
            if e["meaning"] in moved:
                trial[e["input"]][e["axis"]] = 2 * int(e["sample"])
        return guards_accept(program, trial)

    meanings = sorted({str(e["meaning"]) for e in group})
    outcomes = {m: accepted({m}) for m in meanings}
    if any(v is None for v in outcomes.values()):
        return  # undecidable: the range stands
    fixed = {m for m, ok in outcomes.items() if not ok}
    free = set(meanings) - fixed
    if len(free) > 1 and accepted(free) is False:
        fixed |= free
    for e in group:
        if e["meaning"] in fixed:
            e.update(status=STATUS_STATIC, min=e["sample"], max=e["sample"], note="model-fixed")


def _describe(entry: Mapping[str, Any]) -> str:
    if entry["status"] == STATUS_STATIC:
        return f"static {entry['max']} ({entry['note']})"
    high = "inf" if entry["max"] is None else str(entry["max"])
    text = f"dynamic [{entry['min']}, {high}]"
    return f"{text} ({entry['note']})" if entry.get("note") else text


def axes_summary(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per input and outcome, e.g. ``"pixel_values image height/width: static 32
    (model-fixed)"`` or ``"input_ids batch, sequence: dynamic [2, inf]"``; image height and width
    with one outcome share a line."""
    lines: list[str] = []
    groups: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        groups.setdefault((str(entry["input"]), _describe(entry)), []).append(str(entry["meaning"]))
    for (key, text), meanings in groups.items():
        sides = [m for m in meanings if m.endswith((" height", " width"))]
        if len(sides) == 2 and sides[0].split()[0] == sides[1].split()[0]:
            merged = f"{sides[0].split()[0]} height/width"
            meanings = [merged if m == sides[0] else m for m in meanings if m != sides[1]]
        lines.append(f"{key} {', '.join(meanings)}: {text}")
    return lines


def choose_size(sample: int, preferred: int, low: int, high: int | None) -> int:
    """The size a second-shape validation gives an axis: ``preferred`` moved into
    ``[max(low, 2), high]``; the nearest other size when that is the sample's; the sample size when
    the range holds no other.

    Args:
        sample: the axis' size in the sample inputs.
        preferred: the size the rule of the axis asks for (batch + 1, a doubled sequence ...).
        low / high: the range the program (or the model) accepts; ``high=None`` is unbounded.
    """
    low = max(low, 2)
    size = max(preferred, low)
    if high is not None:
        size = min(size, high)
    if size == sample or size < low:
        for candidate in (sample + 1, sample - 1):
            if candidate >= low and (high is None or candidate <= high):
                return candidate
        return sample
    return size


def axis_range(
    entries: Sequence[Mapping[str, Any]] | None, pairs: Sequence[tuple[str, int]]
) -> tuple[str, int, int | None] | None:
    """What the program's axis outcomes say about axes that must share one size.

    Args:
        entries: axis outcomes with ``input``, ``axis``, ``min``, ``max`` and optionally
            ``status`` (:func:`program_input_axes`' entries; a backend's planned bounds, which
            carry no status, count as dynamic).
        pairs: ``(input, axis)`` of the axes, e.g. ``[("input_ids", 0), ("attention_mask", 0)]``.

    Returns:
        ``None`` when no entry names one of ``pairs``; ``("static", size, size)`` when one of them
        is static; else ``("dynamic", low, high)``, the intersection of their ranges (``high``
        ``None`` when unbounded).
    """
    wanted = set(pairs)
    low, high, found = 0, None, False
    for entry in entries or ():
        if (entry.get("input"), entry.get("axis")) not in wanted:
            continue
        found = True
        if entry.get("status", STATUS_DYNAMIC) == STATUS_STATIC:
            size = int(entry.get("max") if entry.get("max") is not None else entry.get("sample", 0))
            return STATUS_STATIC, size, size
        low = max(low, int(entry.get("min") or 0))
        top = entry.get("max")
        if top is not None:
            high = int(top) if high is None else min(high, int(top))
    return (STATUS_DYNAMIC, low, high) if found else None
