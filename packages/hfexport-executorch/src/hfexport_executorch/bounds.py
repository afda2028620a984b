"""Upper bounds for dynamic dimensions, which ExecuTorch memory planning needs.

ExecuTorch plans every intermediate tensor at its *upper-bound* size when the program is
lowered, and the runtime allocates that plan when the program loads. A dynamic dimension without
a finite upper bound is planned at the size it had in the sample inputs (ExecuTorch 1.4 falls
back to the trace hint), so the program then fails at run time on any larger input. This module
gives every dynamic dimension a finite bound, in two steps:

1. **Before capture** (:func:`plan_dynamic_shapes`): ``Dim.AUTO``/``Dim.DYNAMIC`` hints, those of
   ``dynamic=True`` included, are translated per axis into a bounded dimension whose upper bound
   depends on the axis role. Axes with a role shared across inputs (the batch axis of every input
   of the common batch size, the sequence axis of ``input_ids``/``attention_mask``/..., the decoder
   sequence axis, ...) get one *named* ``Dim(role, min=1, max=N)`` per role, so the program knows
   that ``input_ids`` and ``attention_mask`` have the same length even where the model never
   combines them (with ``Dim.AUTO`` each gets its own symbol, and GPT-2-style models then only run
   at shapes where nothing relies on the two being equal). Axes without such a role keep a
   bounded hint ``Dim.AUTO(min=1, max=N)``. When ``torch.export`` rejects the named dimensions (the
   model specialises an axis, or needs a relation the roles do not express), the exporter captures
   again with bounded hints on every axis (:attr:`DynamicPlan.fallback`). Axes of sample size 0
   or 1 are never named (``torch.export`` specialises them), nor are image sides and audio
   feature axes (height and width need not be equal). The bound by role:

   ==========================  ===========================================================
   role                        upper bound
   ==========================  ===========================================================
   ``batch`` (axis 0)          :data:`DEFAULT_MAX_BATCH`
   ``sequence``                the model's maximum positions (``max_position_embeddings``,
                               ``n_positions``, ``max_source_positions``...), else
                               :data:`DEFAULT_MAX_SEQUENCE`
   ``decoder_sequence``        the decoder's maximum positions (``max_target_positions``...)
   ``cache_sequence``          as ``decoder_sequence`` (axis 2 of 4-D cache tensors)
   ``signal`` (raw audio)      :data:`DEFAULT_MAX_SIGNAL`
   ``spatial`` (image sides)   ``max(SPATIAL_GROWTH * sample, config image_size)`` (the
                               config's ``image_size``, its vision config's, first)
   ``frames`` (audio features) ``FRAMES_GROWTH * sample`` (non-batch axes of
                               ``input_features``; the mel axis is specialised by capture)
   ``other``                   the sample size: no rule says how far such an axis may grow
   ==========================  ===========================================================

   Explicit named ``Dim(name, min=..., max=...)`` from ``config.dynamic_shapes`` are kept as
   given; a named ``Dim`` without ``max`` is bounded after capture by the program fix
   ``bound_unbounded_dynamic_ranges`` with the same role rule.

2. **After capture, before lowering** (:func:`fit_memory_budget`): the peak of live activation
   bytes is estimated from the captured graph at the upper bounds (:func:`estimate_peak_bytes`;
   every activation counts, also those a delegate will compute: the XNNPACK runtime sizes its
   workspace from the upper bounds the delegate was lowered with, so narrowing after lowering
   would bound the planned arena only). While it exceeds
   the budget (``config.max_dynamic_bytes``, default :data:`DEFAULT_MAX_DYNAMIC_BYTES`), bounds
   that hfexport chose (never the user's explicit ``max``) are halved: sequence-like axes first,
   down to ``min(SEQUENCE_FLOOR, their bound)``; then batch axes down to
   ``min(BATCH_FLOOR, their bound)``; then sequence-like axes down to the sample size. Narrowing
   a range after capture is sound: every guard that held on the wider range still holds.

The final bounds are recorded in the export report (``report.dynamic_bounds``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

from hfexport.conventions import DECODER, SIGNAL, TEXT, input_role, max_positions, names_with

__all__ = [
    "BATCH_FLOOR",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_DYNAMIC_BYTES",
    "DEFAULT_MAX_SEQUENCE",
    "DEFAULT_MAX_SIGNAL",
    "SEQUENCE_FLOOR",
    "AxisPolicy",
    "BudgetResult",
    "DynamicPlan",
    "SymbolInfo",
    "axis_role",
    "collect_symbols",
    "data_dependent_symbols",
    "estimate_peak_bytes",
    "fit_memory_budget",
    "model_max_positions",
    "plan_dynamic_shapes",
    "set_symbol_upper_bound",
]

logger = logging.getLogger(__name__)

#: Upper bound of a dynamic batch axis when the user gives none.
DEFAULT_MAX_BATCH = 8
#: Upper bound of a sequence axis when the model config declares no maximum number of positions.
DEFAULT_MAX_SEQUENCE = 4096
#: Upper bound of a raw audio axis (``input_values``): 30 s at 16 kHz.
DEFAULT_MAX_SIGNAL = 30 * 16000
#: Memory budget for the planned activations at the upper bounds, in bytes (1 GiB).
DEFAULT_MAX_DYNAMIC_BYTES = 1 << 30
#: Image sides and audio feature axes of a ``dynamic=True`` export grow to this many times their
#: sample size (or the config's ``image_size``, when larger).
SPATIAL_GROWTH = 4
FRAMES_GROWTH = 4
#: The budget shrinks sequence bounds to this before it touches batch bounds.
SEQUENCE_FLOOR = 256
#: The budget shrinks batch bounds to this before it shrinks sequences below ``SEQUENCE_FLOOR``.
BATCH_FLOOR = 4

ROLE_BATCH = "batch"
ROLE_SEQUENCE = "sequence"
ROLE_DECODER_SEQUENCE = "decoder_sequence"
ROLE_CACHE_SEQUENCE = "cache_sequence"
ROLE_SIGNAL = "signal"
ROLE_SPATIAL = "spatial"
ROLE_FRAMES = "frames"
#: a size computed from tensor values (an unbacked symbol), not an input axis
ROLE_DATA_DEPENDENT = "data-dependent"
ROLE_OTHER = "other"
_SEQUENCE_ROLES = (
    ROLE_SEQUENCE,
    ROLE_DECODER_SEQUENCE,
    ROLE_CACHE_SEQUENCE,
    ROLE_SIGNAL,
    ROLE_SPATIAL,
    ROLE_FRAMES,
)
# roles whose axes share one named Dim per export (image sides and feature axes do not)
_SHARED_ROLES = (ROLE_BATCH, ROLE_SEQUENCE, ROLE_DECODER_SEQUENCE, ROLE_CACHE_SEQUENCE, ROLE_SIGNAL)

# Sequence groups of the input-role table (hfexport.conventions.roles) -> bound roles here.
_GROUP_ROLES = {TEXT: ROLE_SEQUENCE, DECODER: ROLE_DECODER_SEQUENCE, SIGNAL: ROLE_SIGNAL}

# Sources of a bound, as recorded in the report.
SOURCE_USER = "user"


@dataclasses.dataclass
class AxisPolicy:
    """How one input axis is bounded.

    Attributes:
        path: the input leaf path (``input_ids``, ``past_key_values.3``).
        axis: dimension index.
        role: ``batch``, ``sequence``, ``decoder_sequence``, ``cache_sequence``, ``signal``,
            ``spatial``, ``frames`` or ``other``.
        sample: the axis size in the sample inputs.
        max: the upper bound asked for; ``None`` for a user ``Dim`` without ``max``.
        source: where ``max`` comes from (``"user"``, ``"config.max_position_embeddings"``,
            ``"default"``, ``"sample size"``).
        min: the lower bound asked for (1 unless the user gave another).
    """

    path: str
    axis: int
    role: str
    sample: int
    max: int | None
    source: str
    min: int = 1


@dataclasses.dataclass
class DynamicPlan:
    """Result of :func:`plan_dynamic_shapes`.

    Attributes:
        dynamic_shapes: what to pass to ``torch.export`` (``None`` for a static export): named
            ``Dim`` objects shared per role where possible.
        fallback: the same plan with bounded ``Dim.AUTO`` hints instead of named role dimensions,
            to capture with when ``torch.export`` rejects ``dynamic_shapes``; ``None`` when
            ``dynamic_shapes`` has no named role dimension.
        axes: the bound of every dynamic axis, by input path and axis.
    """

    dynamic_shapes: dict[str, Any] | None
    fallback: dict[str, Any] | None = None
    axes: list[AxisPolicy] = dataclasses.field(default_factory=list)

    def policy(self, path: str, axis: int) -> AxisPolicy | None:
        """The :class:`AxisPolicy` of ``path``/``axis``, if that axis was marked dynamic."""
        for p in self.axes:
            if p.path == path and p.axis == axis:
                return p
        return None


def model_max_positions(config: Any, *, decoder: bool = False) -> tuple[int | None, str]:
    """The maximum number of positions a model config declares, and the attribute it came from.

    The core lookup :func:`hfexport.conventions.max_positions` (kept here under its old name).

    Args:
        config: a transformers config (its text config is searched too).
        decoder: look for the decoder's limit (``max_target_positions`` first).

    Returns:
        ``(limit, "config.<attribute>")``, or ``(None, "")`` when the config declares none.
    """
    return max_positions(config, decoder=decoder)


def axis_role(path: str, tensor: torch.Tensor, axis: int, top_level: Mapping[str, Any]) -> str:
    """The role of ``axis`` of the input leaf at ``path`` (see the module table).

    Args:
        path: input leaf path; its first component is the forward kwarg name.
        tensor: the sample tensor at ``path``.
        axis: the dimension index.
        top_level: all forward kwargs (to tell an audio ``attention_mask`` from a text one).
    """
    key = path.split(".", 1)[0]
    nested = "." in path
    if nested:
        if axis == 0:
            return ROLE_BATCH
        # an encoder-decoder's encoder outputs [batch, source, hidden] run along the source sequence
        # (the encoder's input length, as its attention mask): planned at the sample's length (role
        # "other"), a prompt longer than the sample's did not fit the prefill's and decode's plan
        if key == "encoder_outputs" and tensor.dim() == 3 and axis == 1:
            return ROLE_SEQUENCE
        return ROLE_CACHE_SEQUENCE if tensor.dim() == 4 and axis == 2 else ROLE_OTHER
    role = input_role(key, tensor.dim(), present=top_level)
    if role is None or role.batch_axis is None:
        # no role, or one that claims no batch axis: axis 0 is taken as the batch when its size
        # says so (see _Planner.role_of)
        return ROLE_BATCH if axis == 0 else ROLE_OTHER
    if axis == role.batch_axis:
        return ROLE_BATCH
    if axis == role.sequence_axis and role.sequence in _GROUP_ROLES:
        return _GROUP_ROLES[role.sequence]
    if axis in role.spatial_axes:
        return ROLE_SPATIAL
    if role.kind == "features":
        return ROLE_FRAMES
    return ROLE_OTHER


def _image_size(config: Any) -> tuple[int | None, str]:
    """The largest side of the config's ``image_size`` (its vision config's first), if any."""
    for cfg, prefix in ((getattr(config, "vision_config", None), "config.vision_config"), (config, "config")):
        value = getattr(cfg, "image_size", None) if cfg is not None else None
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            value = max(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{prefix}.image_size"
    return None, ""


def role_bound(role: str, sample: int, config: Any) -> tuple[int, str]:
    """``(upper bound, source)`` for an axis of ``role`` whose sample size is ``sample``.

    The bound is never below ``sample``.
    """
    if role == ROLE_BATCH:
        bound, source = DEFAULT_MAX_BATCH, "default batch bound"
    elif role in (ROLE_SEQUENCE, ROLE_DECODER_SEQUENCE, ROLE_CACHE_SEQUENCE):
        limit, source = (
            model_max_positions(config, decoder=role != ROLE_SEQUENCE) if config is not None else (None, "")
        )
        bound = limit if limit is not None else DEFAULT_MAX_SEQUENCE
        source = source or "default sequence bound (the config declares no maximum positions)"
    elif role == ROLE_SIGNAL:
        bound, source = DEFAULT_MAX_SIGNAL, "default audio bound (30 s at 16 kHz)"
    elif role == ROLE_SPATIAL:
        bound, source = SPATIAL_GROWTH * sample, f"{SPATIAL_GROWTH}x the sample image side"
        limit, limit_source = _image_size(config) if config is not None else (None, "")
        if limit is not None and limit > bound:
            bound, source = limit, limit_source
    elif role == ROLE_FRAMES:
        bound, source = FRAMES_GROWTH * sample, f"{FRAMES_GROWTH}x the sample audio feature axis"
    else:
        bound, source = sample, "sample size (no rule bounds this axis; pass an explicit Dim to let it grow)"
    if bound < sample:
        bound, source = sample, f"sample size (above the {source} {bound})"
    return bound, source


def _is_hint(leaf: Any) -> bool:
    return type(leaf).__name__ == "_DimHint" and hasattr(leaf, "type")


def _is_named_dim(leaf: Any) -> bool:
    return not _is_hint(leaf) and hasattr(leaf, "__name__") and hasattr(leaf, "min") and hasattr(leaf, "max")


def _finite(value: Any) -> int | None:
    if value is None:
        return None
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    if as_float == float("inf") or as_float >= 2**62:
        return None
    return int(value)


def _reference_sizes(inputs: Mapping[str, Any]) -> dict[str, int]:
    """Sample sizes that define each shared role: the batch, sequence and decoder sequence length.

    The batch comes from the first primary input of the role table that is present (``input_ids``,
    ``inputs_embeds``, ``input_features``, ``input_values``, ``pixel_values``, ``decoder_input_ids``
    ...), else axis 0 of the first tensor; each sequence role from the first input of its group,
    primary inputs first.
    """
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    out: dict[str, int] = {}
    for key in (*names_with(primary=True), *tensors):
        if key in tensors:
            role = input_role(key, tensors[key].dim())
            axis = role.batch_axis if role is not None and role.batch_axis is not None else 0
            out[ROLE_BATCH] = int(tensors[key].shape[axis])
            break
    primary = set(names_with(primary=True))
    for key in sorted(tensors, key=lambda k: k not in primary):  # stable: primary inputs first
        role = input_role(key, tensors[key].dim(), present=tensors)
        if role is None or role.sequence_axis is None or role.sequence not in _GROUP_ROLES:
            continue
        out.setdefault(_GROUP_ROLES[role.sequence], int(tensors[key].shape[role.sequence_axis]))
    return out


class _Planner:
    def __init__(self, inputs: Mapping[str, Any], config: Any) -> None:
        self.inputs = inputs
        self.config = config
        self.axes: list[AxisPolicy] = []
        self.reference = _reference_sizes(inputs)
        self.named: dict[str, Any] = {}

    def role_of(self, path: str, tensor: torch.Tensor, axis: int) -> str:
        role = axis_role(path, tensor, axis, self.inputs)
        if role in self.reference and int(tensor.shape[axis]) != self.reference[role]:
            return ROLE_OTHER  # e.g. qwen2-vl pixel_values: axis 0 counts patches, not batch rows
        return role

    def named_dim(self, role: str, bound: int) -> Any:
        from torch.export import Dim

        if role not in self.named:
            self.named[role] = Dim(role, min=1, max=bound)
        return self.named[role]

    def leaf(self, leaf: Any, tensor: torch.Tensor, axis: int, path: str) -> tuple[Any, Any]:
        """``(leaf for the named plan, leaf for the fallback plan)``."""
        from torch.export import Dim

        if axis >= tensor.dim():
            return leaf, leaf
        sample = int(tensor.shape[axis])
        role = self.role_of(path, tensor, axis)
        if _is_hint(leaf):
            kind = leaf.type.name
            if kind == "STATIC":
                return leaf, leaf
            factory = Dim.DYNAMIC if kind == "DYNAMIC" else Dim.AUTO
            low = int(leaf.min) if leaf.min is not None else 1
            if leaf.max is not None:
                self.axes.append(AxisPolicy(path, axis, role, sample, int(leaf.max), SOURCE_USER, low))
                return leaf, leaf
            bound, source = role_bound(role, sample, self.config)
            self.axes.append(AxisPolicy(path, axis, role, sample, bound, source, low))
            hint = factory(min=low, max=bound)
            if role in _SHARED_ROLES and sample >= 2 and leaf.min is None:
                return self.named_dim(role, bound), hint
            return hint, hint
        if _is_named_dim(leaf):
            low = _finite(leaf.min)
            self.axes.append(AxisPolicy(path, axis, role, sample, _finite(leaf.max), SOURCE_USER, low or 0))
        return leaf, leaf

    def tensor_spec(self, spec: Any, tensor: torch.Tensor, path: str) -> tuple[Any, Any]:
        if spec is None:
            return None, None
        if isinstance(spec, dict):
            pairs = {axis: self.leaf(leaf, tensor, int(axis), path) for axis, leaf in spec.items()}
            return {a: p[0] for a, p in pairs.items()}, {a: p[1] for a, p in pairs.items()}
        if isinstance(spec, (list, tuple)):
            pairs_list = [self.leaf(leaf, tensor, axis, path) for axis, leaf in enumerate(spec)]
            named, hints = [p[0] for p in pairs_list], [p[1] for p in pairs_list]
            return (tuple(named), tuple(hints)) if isinstance(spec, tuple) else (named, hints)
        return spec, spec

    def walk(self, spec: Any, value: Any, path: str) -> tuple[Any, Any]:
        if spec is None:
            return None, None
        if isinstance(value, torch.Tensor):
            return self.tensor_spec(spec, value, path)
        if isinstance(value, dict) and isinstance(spec, dict):
            pairs = {k: self.walk(spec.get(k), value.get(k), f"{path}.{k}") for k in spec}
            return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
        children: list[Any] | None = None
        if isinstance(value, (list, tuple)):
            children = list(value)
        else:
            node = pytree.SUPPORTED_NODES.get(type(value))
            if node is not None:
                children = list(node.flatten_fn(value)[0])
        if children is not None and isinstance(spec, (list, tuple)) and len(spec) == len(children):
            pairs_list = [self.walk(s, c, f"{path}.{i}") for i, (s, c) in enumerate(zip(spec, children))]
            named, hints = [p[0] for p in pairs_list], [p[1] for p in pairs_list]
            return (tuple(named), tuple(hints)) if isinstance(spec, tuple) else (named, hints)
        return spec, spec


def plan_dynamic_shapes(model: torch.nn.Module, inputs: Mapping[str, Any], config: Any) -> DynamicPlan:
    """Bounded ``dynamic_shapes`` for an ExecuTorch export (step 1 in the module doc).

    Args:
        model: the model (its config gives the sequence limits).
        inputs: the prepared forward kwargs.
        config: an ``ExecutorchConfig``; ``dynamic_shapes`` wins over ``dynamic=True``.

    Returns:
        The :class:`DynamicPlan`; ``dynamic_shapes`` is ``None`` for a static export. User-given
        bounds (a named ``Dim``, a hint with ``min``/``max``) are passed through unchanged.

    Raises:
        ValueError: ``config.dynamic_shapes`` does not fit ``inputs``
            (:func:`hfexport.capture.check_dynamic_shapes`: unknown inputs, an axis count or an
            axis index that does not fit, a range that excludes the sample size).
    """
    from hfexport.capture import auto_dynamic_shapes, check_dynamic_shapes

    explicit = getattr(config, "dynamic_shapes", None)
    if explicit:
        check_dynamic_shapes(explicit, inputs)
        spec: dict[str, Any] = {k: explicit.get(k) for k in inputs}
    elif getattr(config, "dynamic", False):
        spec = auto_dynamic_shapes(inputs)
    else:
        return DynamicPlan(None)
    planner = _Planner(inputs, getattr(model, "config", None))
    pairs = {k: planner.walk(spec[k], inputs[k], k) for k in inputs}
    named = {k: p[0] for k, p in pairs.items()}
    hints = {k: p[1] for k, p in pairs.items()}
    return DynamicPlan(named, hints if planner.named else None, planner.axes)


# --------------------------------------------------------------------------------------------------
# After capture: symbols, estimate, budget
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SymbolInfo:
    """One free symbol of the captured program and the input axes it sizes.

    Attributes:
        symbol: the sympy symbol (``s53``).
        axes: ``(input path, axis)`` pairs whose size is exactly this symbol.
        role: role of the first such axis.
        lower / upper: the program's range for it (``upper`` is ``None`` when unbounded).
        hint: its size in the sample inputs.
        source: where ``upper`` comes from (see :class:`AxisPolicy`); ``"user"`` bounds are
            never narrowed by the budget.
    """

    symbol: sympy.Symbol
    axes: list[tuple[str, int]]
    role: str
    lower: int
    upper: int | None
    hint: int
    source: str


def _user_input_paths(inputs: Mapping[str, Any]) -> list[str]:
    leaves, _ = pytree.tree_flatten_with_path(((), dict(inputs)))
    paths = []
    for key_path, _leaf in leaves:
        parts = []
        for entry in key_path[1:]:  # skip the args tuple position
            for attr in ("key", "idx", "name"):
                if hasattr(entry, attr):
                    parts.append(str(getattr(entry, attr)))
                    break
        paths.append(".".join(parts))
    return paths


def _user_input_placeholders(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    from torch.export.graph_signature import InputKind

    names = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [by_name[n] for n in names if n in by_name]


def _shape_env(ep: torch.export.ExportedProgram) -> Any | None:
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def collect_symbols(
    ep: torch.export.ExportedProgram, inputs: Mapping[str, Any] | None = None, plan: DynamicPlan | None = None
) -> list[SymbolInfo]:
    """List the free symbols sizing the program's user inputs, with their ranges and roles.

    Args:
        ep: the captured program.
        inputs: the sample forward kwargs, to name input axes by leaf path; without them the
            placeholder names are used.
        plan: the :class:`DynamicPlan` the program was captured with, for the bound sources.

    Returns:
        One :class:`SymbolInfo` per symbol, in order of first appearance.
    """
    placeholders = _user_input_placeholders(ep)
    paths = _user_input_paths(inputs) if inputs is not None else []
    if len(paths) != len(placeholders):
        paths = [p.name for p in placeholders]
    top_level = dict(inputs) if inputs is not None else {p: None for p in paths}
    found: dict[sympy.Symbol, SymbolInfo] = {}
    for path, node in zip(paths, placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for axis, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if not isinstance(expr, sympy.Symbol):
                continue
            if expr in found:
                found[expr].axes.append((path, axis))
                continue
            vr = ep.range_constraints.get(expr)
            lower = int(vr.lower) if vr is not None and vr.lower.is_finite else 0
            upper = _finite(vr.upper) if vr is not None else None
            hint = size.node.hint if size.node.hint is not None else size.node.shape_env.size_hint(expr)
            policy = plan.policy(path, axis) if plan is not None else None
            role = policy.role if policy is not None else axis_role(path, val, axis, top_level)
            source = policy.source if policy is not None else "captured range"
            if policy is not None and policy.source == SOURCE_USER and policy.max is None:
                source = "unbounded user Dim"
            found[expr] = SymbolInfo(expr, [(path, axis)], role, lower, upper, int(hint), source)
    return list(found.values())


def set_symbol_upper_bound(ep: torch.export.ExportedProgram, symbol: sympy.Symbol, upper: int) -> None:
    """Set the upper bound of ``symbol`` in ``ep.range_constraints`` and in the program's shape env.

    ExecuTorch memory planning evaluates tensor sizes at ``bound_sympy(expr, shape_env.var_to_range)``,
    so both places must agree. The lower bound is kept.

    Raises:
        KeyError: ``symbol`` is not a range-constrained symbol of ``ep``.
    """
    old = ep.range_constraints[symbol]
    new = ValueRanges(old.lower, sympy.Integer(int(upper)))
    ep.range_constraints[symbol] = new
    shape_env = _shape_env(ep)
    if shape_env is not None and symbol in shape_env.var_to_range:
        shape_env.var_to_range[symbol] = new


# Ops whose output aliases their input in the ExecuTorch program (no new buffer): views (an edge
# ``view_copy`` becomes a memory view when the program is emitted) and ``getitem`` of a tuple output.
_ALIAS_OPS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::alias",
    "aten::detach",
    "aten::view_copy",
    "aten::alias_copy",
    "getitem",
}


def _op_name(target: Any) -> str:
    name = getattr(target, "name", None)
    if callable(name):
        try:
            return str(name())
        except TypeError:
            pass
    return str(getattr(target, "__name__", target))


def _tensor_vals(val: Any) -> Iterable[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def estimate_peak_bytes(ep: torch.export.ExportedProgram, bounds: Mapping[sympy.Symbol, int]) -> int:
    """Peak bytes of simultaneously live activations of ``ep`` with its symbols at ``bounds``.

    A tensor is live from the node producing it to its last user; user inputs count, weights and
    constants do not (they are not part of the planned arena); views and ``getitem`` share their
    input's buffer. Applied to the lowered (edge) program, this approximates the arena ExecuTorch's
    memory planner allocates for the values outside delegates (delegate outputs included); the
    planner's real figure, with alignment and fragmentation, is reported after planning
    (``report.extra["planned_memory_bytes"]``). Delegates' internal workspaces are not counted.

    Args:
        ep: the captured or lowered program.
        bounds: value for each free symbol; symbols not given take their sample size, and
            unbacked (data-dependent) symbols their finite upper bound, else the largest value
            in ``bounds``. A size that divides by zero at ``bounds`` (undefined there) is taken at
            the sample sizes.

    Returns:
        The estimated peak, in bytes.
    """
    subs = {sym: sympy.Integer(int(v)) for sym, v in bounds.items()}

    # an unbacked symbol (a data-dependent size: tokens routed to an MoE expert, nonzero counts)
    # has no sample hint; it is taken at its finite upper bound, else at the largest bound given
    # (such sizes count tokens of the batch, so a whole batch-sequence is the pessimistic case)
    unbacked_fallback = max((int(v) for v in bounds.values()), default=1)

    @functools.cache
    def evaluate(expr: sympy.Expr) -> int:
        try:
            value = expr.xreplace(subs)
        except ZeroDivisionError:
            # a size the model's arithmetic leaves undefined at these bounds (Mask2Former's pixel
            # decoder: x // (m // 4) with m a padding remainder that is below 4 at side 128): the
            # program cannot run there, so the size is taken at the sample
            return int(shape_env.optimization_hint(expr, fallback=unbacked_fallback)) if shape_env else 0
        if value.is_number:
            return int(value)
        if shape_env is None:
            return 0
        if free_unbacked_symbols(value):
            upper = shape_env.bound_sympy(value).upper
            if upper.is_number and upper.is_finite:
                return int(upper)
        return int(shape_env.optimization_hint(value, fallback=unbacked_fallback))

    shape_env = _shape_env(ep)

    def size_of(v: torch.Tensor) -> int:
        numel = 1
        for s in v.shape:
            numel *= evaluate(s.node.expr) if isinstance(s, torch.SymInt) else int(s)
        return numel * v.dtype.itemsize

    from torch.export.graph_signature import InputKind

    user_inputs = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    nodes = list(ep.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        if (
            n.op == "call_function"
            and _op_name(n.target) in _ALIAS_OPS
            and n.args
            and isinstance(n.args[0], torch.fx.Node)
        ):
            base = n.args[0]
            owner[n] = owner.get(base, base)
    last_use: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for inp in n.all_input_nodes:
            root = owner.get(inp, inp)
            last_use[root] = max(last_use.get(root, -1), index[n])
    live = 0
    peak = 0
    sizes: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        if n in owner:
            pass
        elif (n.op == "placeholder" and n.name in user_inputs) or n.op == "call_function":
            size = sum(size_of(v) for v in _tensor_vals(n.meta.get("val")))
            sizes[n] = size
            live += size
            peak = max(peak, live)
        for inp in {owner.get(x, x) for x in n.all_input_nodes}:
            if last_use.get(inp) == i and inp in sizes:
                live -= sizes.pop(inp)
        if n in sizes and n not in last_use:  # never used: freed at once
            live -= sizes.pop(n)
    return peak


@dataclasses.dataclass
class BudgetResult:
    """Outcome of :func:`fit_memory_budget`.

    Attributes:
        budget: the budget in bytes.
        estimate_before / estimate_after: estimated peak bytes before and after narrowing.
        narrowed: ``{symbol name: (old upper, new upper)}`` for every bound the budget lowered.
        fits: whether the final estimate is within the budget.
    """

    budget: int
    estimate_before: int
    estimate_after: int
    narrowed: dict[str, tuple[int, int]]
    fits: bool


_BUDGET_WARNED = False


def fit_memory_budget(
    ep: torch.export.ExportedProgram,
    symbols: list[SymbolInfo],
    budget: int,
    data_dependent: Iterable[sympy.Symbol] = (),
) -> BudgetResult:
    """Narrow hfexport-chosen bounds until the estimated activation peak fits ``budget`` (step 2).

    Mutates ``ep`` (range constraints and shape env) and the ``upper`` of ``symbols``.

    The phases: sequence-like axes down to ``min(SEQUENCE_FLOOR, bound)``, batch axes down to
    ``min(BATCH_FLOOR, bound)``, then the ``data_dependent`` sizes down to
    ``min(SEQUENCE_FLOOR, bound)``, then sequences and batches down to their sample sizes. A
    data-dependent size (FastSpeech 2's frame count, declared at most 5000 by a ``torch._check``)
    has no sample to fall back to: before it was narrowable, its quadratic attention kept the
    estimate above the budget until every input axis sat at its sample size (a static program).
    A program so narrowed refuses, at run time, an input whose data-dependent size exceeds the new
    bound (ExecuTorch's bounded resize fails); the bound is in ``narrowed``.

    Args:
        ep: the captured program, every symbol bounded.
        symbols: from :func:`collect_symbols`.
        budget: bytes.
        data_dependent: unbacked symbols of ``ep`` (sizes computed from tensor values) whose finite
            upper bound the budget may narrow; the caller passes those the model itself bounds
            (a ``torch._check``), not those bounded by a default rule.

    Returns:
        A :class:`BudgetResult`. When even the smallest allowed bounds exceed the budget, the
        bounds stay at those minimums and a warning is logged (once per process).
    """
    global _BUDGET_WARNED
    bounded = [s for s in symbols if s.upper is not None]

    def current() -> dict[sympy.Symbol, int]:
        return {s.symbol: int(s.upper) for s in bounded}  # type: ignore[arg-type]

    before = estimate_peak_bytes(ep, current())
    estimate = before
    original = {s.symbol: s.upper for s in bounded}
    free = [s for s in bounded if s.source != SOURCE_USER]
    seq = [s for s in free if s.role in _SEQUENCE_ROLES]
    batch = [s for s in free if s.role == ROLE_BATCH]
    unbacked = _data_dependent_infos(ep, data_dependent)
    original.update({s.symbol: s.upper for s in unbacked})
    phases = [
        (seq, lambda s: max(s.hint, min(SEQUENCE_FLOOR, original[s.symbol]))),
        (batch, lambda s: max(s.hint, min(BATCH_FLOOR, original[s.symbol]))),
        (unbacked, lambda s: max(s.lower, min(SEQUENCE_FLOOR, original[s.symbol]))),
        (seq, lambda s: s.hint),
        (batch, lambda s: s.hint),
    ]
    for group, floor in phases:
        while estimate > budget:
            movable = [s for s in group if s.upper > floor(s)]  # type: ignore[operator]
            if not movable:
                break
            for s in movable:
                s.upper = max(floor(s), int(s.upper) // 2)  # type: ignore[arg-type]
                if s in unbacked:
                    # the estimate reads unbacked sizes from the shape env's ranges
                    set_symbol_upper_bound(ep, s.symbol, int(s.upper))  # type: ignore[arg-type]
            estimate = estimate_peak_bytes(ep, current())
    narrowed = {}
    for s in unbacked:
        if s.upper != original[s.symbol]:
            narrowed[str(s.symbol)] = (int(original[s.symbol]), int(s.upper))  # type: ignore[arg-type]
    for s in bounded:
        if s.upper != original[s.symbol]:
            set_symbol_upper_bound(ep, s.symbol, int(s.upper))  # type: ignore[arg-type]
            s.source = f"{s.source}, narrowed by the memory budget"
            narrowed[str(s.symbol)] = (int(original[s.symbol]), int(s.upper))  # type: ignore[arg-type]
    fits = estimate <= budget
    if not fits and not _BUDGET_WARNED:
        _BUDGET_WARNED = True
        logger.warning(
            "the planned activations need about %.1f MiB at the smallest allowed bounds, above the memory budget "
            "of %.1f MiB (ExecutorchConfig.max_dynamic_bytes); the program keeps those bounds",
            estimate / 2**20,
            budget / 2**20,
        )
    return BudgetResult(budget, before, estimate, narrowed, fits)


def _data_dependent_infos(
    ep: torch.export.ExportedProgram, symbols: Iterable[sympy.Symbol]
) -> list[SymbolInfo]:
    """A :class:`SymbolInfo` (role ``"data-dependent"``, no input axis) per unbacked symbol of
    ``symbols`` that ``ep`` ranges with a finite upper bound."""
    out = []
    for symbol in symbols:
        value_range = ep.range_constraints.get(symbol)
        upper = _finite(value_range.upper) if value_range is not None else None
        if upper is None or not free_unbacked_symbols(symbol):
            continue
        lower = int(value_range.lower) if value_range.lower.is_finite else 0
        out.append(SymbolInfo(symbol, [], ROLE_DATA_DEPENDENT, lower, int(upper), lower, "captured range"))
    return out


def data_dependent_symbols(
    ep: torch.export.ExportedProgram, bounded_by_fix: Iterable[str] = ()
) -> list[sympy.Symbol]:
    """The unbacked symbols of ``ep`` (sizes computed from tensor values, ``u0``...) that the captured
    program ranges with a finite upper bound of its own (a ``torch._check`` in the model or a capture
    patch), leaving out those named in ``bounded_by_fix`` (bounded after capture by a default rule).

    Returns:
        The symbols, in ``ep.range_constraints`` order: what :func:`fit_memory_budget` may narrow.
    """
    skip = set(bounded_by_fix)
    return [
        symbol
        for symbol, value_range in ep.range_constraints.items()
        if free_unbacked_symbols(symbol)
        and str(symbol) not in skip
        and _finite(value_range.upper) is not None
    ]


def is_unbounded(upper: Any) -> bool:
    """True when a range upper bound is infinite (``int_oo``) or missing."""
    return upper is None or upper is int_oo or _finite(upper) is None
