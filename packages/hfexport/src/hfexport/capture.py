"""The ``torch.export`` capture every backend shares.

Stages (each a function, called in order by :func:`capture`):

1. :func:`signature_module`: give models whose ``forward`` takes ``**kwargs`` a module with an
   explicit keyword signature, so ``dynamic_shapes`` can be keyed by kwarg name;
2. :func:`hfexport.pytree.register_cache_pytrees`: caches become pytree nodes;
3. :func:`hfexport.batching.widen_unit_batch`: with ``dynamic=True``, a batch-1 sample is traced
   as batch 2 (rows repeated; recorded as ``report.extra["trace_inputs"]``), then
   :func:`resolve_dynamic_shapes`: ``Dim.AUTO`` on every tensor axis for ``dynamic=True``,
   or the user's ``dynamic_shapes`` completed with ``None`` for the inputs it leaves out; then
   :func:`hfexport.side_probe.model_fixed_image_sides`: ``Dim.AUTO`` image sides the model
   cannot grow (SigLIP's fixed position table) are traced static (``report.extra["model_fixed_sides"]``);
4. :func:`reset_stale_state`: drop cached tables a previous eager forward left on modules;
5. ``apply_patches("capture")``: the active workarounds of :mod:`hfexport.workarounds.torch_export`
   (faults of ``torch.export`` every backend meets), installed around the next step only; for a
   model of a family with capture patches of its own (:data:`CAPTURE_SCOPES`: dense-prediction heads,
   object detectors, time-series forecasters, text-to-audio models, text encoders, BART/T5
   classification heads, vision-language models) ``apply_patches("capture.<family>")`` instead,
   which adds that family's (:func:`capture_patch_key`);
6. ``torch.export.export(..., strict=..., prefer_deferred_runtime_asserts_over_guards=...)``, with
   the output flags of ``report.output_flags`` (lifted out of the inputs and applied to the
   model's config) given back as constant keyword inputs (:func:`flags_in_signature`), so the
   program takes the kwargs it was exported with and its guards refuse another flag value;
   ``Dim.AUTO`` image sides the program kept symbolic but whose guards accept the sample's size
   only (Swin's window minimums, :func:`hfexport.program_axes.sides_fixed_by_guards`) are traced
   once more, static (``report.extra["guard_fixed_sides"]``), so no backend's re-trace carries
   their size expressions (issue 28: ExecuTorch's decompositions of tiny MaskFormer spent tens of
   minutes simplifying them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.batching import widen_unit_batch
from hfexport.pytree import register_cache_pytrees
from hfexport.registry import apply_patches
from hfexport.side_probe import keep_sides_static, model_fixed_image_sides
from hfexport.workarounds import dense_prediction as _dense_prediction_workarounds
from hfexport.workarounds import detection as _detection_workarounds
from hfexport.workarounds import text_classification as _text_classification_workarounds
from hfexport.workarounds import text_encoders as _text_encoder_workarounds
from hfexport.workarounds import text_to_audio as _text_to_audio_workarounds
from hfexport.workarounds import time_series as _time_series_workarounds
from hfexport.workarounds import vision_language as _vision_language_workarounds

__all__ = [
    "CAPTURE_SCOPES",
    "KwargsModule",
    "auto_dynamic_shapes",
    "capture",
    "capture_patch_key",
    "check_dynamic_shapes",
    "check_shared_axes",
    "flags_in_signature",
    "register_stale_attribute",
    "release_shape_env_caches",
    "reset_stale_state",
    "resolve_dynamic_shapes",
    "signature_module",
]


#: The families with capture patches of their own, in the order their tests are tried (a model
#: matches at most one in practice; the first wins): each module has ``KEY`` and ``capture_key``
#: (:func:`hfexport.workarounds.scopes.holds_module_from` over its modeling files), issue 28.
CAPTURE_SCOPES = (
    _dense_prediction_workarounds,
    _detection_workarounds,
    _time_series_workarounds,
    _text_to_audio_workarounds,
    _text_encoder_workarounds,
    _text_classification_workarounds,
    _vision_language_workarounds,
)


def capture_patch_key(module: torch.nn.Module) -> str:
    """The registry key whose patches :func:`capture` installs around ``torch.export`` for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        The ``KEY`` (``"capture.<family>"``, or a scope of it the family chooses, such as
        ``"capture.vision_language.fixed_grid"``) of the first family of :data:`CAPTURE_SCOPES`
        whose modeling files define ``module`` or one of its submodules, else ``"capture"`` (the
        patches every model gets).
    """
    for scope in CAPTURE_SCOPES:
        key = scope.capture_key(module)
        if isinstance(key, str) and (key == scope.KEY or key.startswith(f"{scope.KEY}.")):
            return key
    return _time_series_workarounds.CAPTURE


logger = logging.getLogger(__name__)

_AUTO_WARNED = False
_ABSENT = object()

# Attributes some modules fill lazily during an eager forward (rotary tables, cached masks); left
# in place they are baked into the trace as constants of the wrong length. Name -> the value that
# means "nothing cached" (what the module's __init__ sets), put in place while tracing. The
# transformers 5.24 ones: wav2vec2-bert / seamless-m4t rotary embeddings
# (cached_rotary_positional_embedding, cached_sequence_length), glm-image decode positions
# (_cached_decode_position_ids); the others are common in remote-code modeling files.
STALE_ATTRIBUTES: dict[str, Any] = {
    "_cos_cached": None,
    "_sin_cached": None,
    "cos_cached": None,
    "sin_cached": None,
    "_cached_cos": None,
    "_cached_sin": None,
    "_seq_len_cached": 0,
    "_attention_mask_cache": None,
    "_causal_mask_cache": None,
    "cached_rotary_positional_embedding": None,
    "cached_sequence_length": None,
    "_cached_decode_position_ids": None,
}


class KwargsModule(torch.nn.Module):
    """Wrap ``model`` so its forward has exactly the keyword parameters in ``names``.

    ``torch.export`` binds inputs through ``inspect.signature(forward)``; a forward that takes
    ``**kwargs`` would put every input under one ``kwargs`` entry. The wrapper's signature lists
    each input by name, in order, keyword-only, and calls ``model(**kwargs)``.
    """

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self._names = list(names)
        params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
        sig = inspect.Signature(params)

        def forward(**kwargs: Any) -> Any:
            return self.model(**kwargs)

        forward.__signature__ = sig  # type: ignore[attr-defined]
        self.forward = forward  # type: ignore[method-assign]

    @property
    def config(self) -> Any:
        return getattr(self.model, "config", None)


def signature_module(model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.nn.Module:
    """Return ``model`` itself when its forward names every input, else a :class:`KwargsModule`."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return KwargsModule(model, list(inputs))
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if all(k in named for k in inputs):
        return model
    return KwargsModule(model, list(inputs))


@contextlib.contextmanager
def flags_in_signature(module: torch.nn.Module, names: list[str], flags: Mapping[str, Any]) -> Iterator[None]:
    """Give ``module`` a forward whose signature is the keyword inputs ``names`` followed by the
    output flags ``flags``, for the ``with`` body (``torch.export`` binds kwargs and their
    ``dynamic_shapes`` by that signature); the module's own forward is back afterwards.

    The flags are already applied to the model's config (:func:`hfexport.inputs.apply_output_flags`);
    traced as kwargs, ``torch.export`` records them as constant inputs of the program, so
    ``program.module()(**inputs, use_cache=True)`` is accepted and another value fails its guard.
    The forward passes every kwarg on to the module's previous forward (which names each flag or
    takes ``**kwargs``: :func:`hfexport.inputs.prepare_for_export` checked it). No wrapper module
    is made, so parameter names stay the model's own.

    Args:
        module: the module ``torch.export`` captures.
        names: its input kwargs, in order.
        flags: ``{flag: value}``; with none, ``module`` is left as it is.
    """
    if not flags:
        yield
        return
    previous = module.__dict__.get("forward", _ABSENT)
    inner = module.forward
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in [*names, *flags]]

    def forward(**kwargs: Any) -> Any:
        return inner(**kwargs)

    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is _ABSENT:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous


def _auto_for(value: Any) -> Any:
    from torch.export import Dim

    if isinstance(value, torch.Tensor):
        return {i: Dim.AUTO for i in range(value.dim())} if value.dim() else None
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if type(value) not in (dict, list, tuple) and type(value) in pytree.SUPPORTED_NODES:
        # a registered node that subclasses dict/tuple (transformers ModelOutput): its children, as a list
        children, _ = pytree.SUPPORTED_NODES[type(value)].flatten_fn(value)
        return [_auto_for(c) for c in children]
    if isinstance(value, dict):
        return {k: _auto_for(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(_auto_for(v) for v in value)
            if isinstance(value, tuple)
            else [_auto_for(v) for v in value]
        )
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:
        children, _ = node.flatten_fn(value)
        return [_auto_for(c) for c in children]
    return None


def auto_dynamic_shapes(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``Dim.AUTO`` on every axis of every tensor leaf of ``inputs`` (caches included).

    Returns a dict keyed like ``inputs``; a registered pytree node (a ``Cache``) gets the list of
    its children's specs, as ``torch.export`` expects. Mirrors ``torch.export.Dim.AUTO`` semantics:
    torch decides per axis whether it is dynamic (an axis of size 0 or 1 in the sample stays
    static), so give samples with batch >= 2 and sequence >= 2 for those axes to be dynamic.
    """
    return {k: _auto_for(v) for k, v in inputs.items()}


def _leaf_range(leaf: Any) -> tuple[str, int | None, int | None] | None:
    """``(description, min, max)`` of a dynamic ``dynamic_shapes`` leaf, ``None`` for a static one."""
    from hfexport.config import _finite_or_none

    hint_type = getattr(leaf, "type", None)
    if type(leaf).__name__ == "_DimHint" and hint_type is not None:
        if hint_type.name == "STATIC":
            return None
        return f"Dim.{hint_type.name}", _finite_or_none(leaf.min), _finite_or_none(leaf.max)
    if getattr(leaf, "root", None) is not None and callable(getattr(leaf, "fn", None)):
        return None  # a derived Dim: its range follows its root's
    if hasattr(leaf, "__name__") and hasattr(leaf, "min") and hasattr(leaf, "max"):
        return f"Dim({leaf.__name__!r})", _finite_or_none(leaf.min), _finite_or_none(leaf.max)
    return None


def check_dynamic_shapes(dynamic_shapes: Any, inputs: Mapping[str, Any]) -> None:
    """Check explicit ``dynamic_shapes`` against the sample inputs, before capture.

    For every top-level tensor input: a dict spec is keyed by axis indices ``0 <= axis < ndim``;
    a tuple/list spec has one entry per axis; an int entry equals the sample size; a ``Dim`` or
    a ``Dim.AUTO``/``Dim.DYNAMIC`` hint with a range admits the sample size (``min <= size <=
    max``). A spec for ``None`` or a Python scalar must be ``None``. Inputs sharing an axis are
    marked alike (:func:`check_shared_axes`). Caches and other nested inputs are left to
    ``torch.export``.

    Raises:
        ValueError: ``dynamic_shapes`` is not a dict keyed by kwarg name, names unknown inputs, or
            an entry breaks a rule above; the message names the input, the axis, the sizes and
            what to change.
    """
    if not isinstance(dynamic_shapes, Mapping):
        raise ValueError(
            f"dynamic_shapes must be a dict keyed by forward kwarg name, got {type(dynamic_shapes).__name__}; "
            "e.g. {'input_ids': {0: Dim('batch'), 1: Dim('sequence')}}"
        )
    unknown = sorted(set(dynamic_shapes) - set(inputs))
    if unknown:
        raise ValueError(
            f"dynamic_shapes names {unknown}, which are not among the sample inputs {sorted(inputs)}; "
            "key dynamic_shapes by forward kwarg name"
        )
    for key, spec in dynamic_shapes.items():
        value = inputs[key]
        if spec is None:
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            raise ValueError(
                f"dynamic_shapes[{key!r}] = {spec!r}, but the sample input {key!r} is {value!r}, which has no "
                f"axes; give None for it"
            )
        if not isinstance(value, torch.Tensor):
            continue
        shape = list(value.shape)
        if isinstance(spec, Mapping):
            bad = [
                a for a in spec if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < value.dim()
            ]
            if bad:
                raise ValueError(
                    f"dynamic_shapes[{key!r}] names axes {bad}, but {key} {shape} has {value.dim()} axes "
                    f"(0..{value.dim() - 1}); key the dict by axis index"
                )
            axes = list(spec.items())
        elif isinstance(spec, (list, tuple)):
            if len(spec) != value.dim():
                raise ValueError(
                    f"dynamic_shapes[{key!r}] gives {len(spec)} axes, but {key} {shape} has {value.dim()}; "
                    f"give one entry per axis (None for a static axis) or a dict {{axis: Dim}}"
                )
            axes = list(enumerate(spec))
        else:
            raise ValueError(
                f"dynamic_shapes[{key!r}] = {spec!r} is not a dict {{axis: Dim}}, a tuple with one entry per "
                f"axis, or None"
            )
        for axis, leaf in axes:
            size = shape[axis]
            if isinstance(leaf, int) and not isinstance(leaf, bool):
                if leaf != size:
                    raise ValueError(
                        f"dynamic_shapes[{key!r}][{axis}] = {leaf}, but {key} {shape} has size {size} on axis "
                        f"{axis}; give {size} or None for a static axis"
                    )
                continue
            found = _leaf_range(leaf)
            if found is None:
                continue
            what, low, high = found
            if low is not None and high is not None and low > high:
                raise ValueError(
                    f"dynamic_shapes[{key!r}][{axis}] = {what} has min {low} above max {high}; give min <= max"
                )
            if (low is not None and size < low) or (high is not None and size > high):
                raise ValueError(
                    f"dynamic_shapes[{key!r}][{axis}] = {what} with range [{low}, {high}] does not admit the "
                    f"sample size {size} of {key} {shape} on axis {axis}; widen the range to include {size} "
                    f"or give sample inputs inside it"
                )
    check_shared_axes(dynamic_shapes, inputs)


def _axis_mark(spec: Any, axis: int) -> tuple[bool, str] | None:
    """``(dynamic, shown)`` for ``axis`` of one input's ``dynamic_shapes`` entry, ``None`` when the
    entry says nothing (``None`` for the whole input, the way omitted inputs are completed)."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        if axis not in spec:
            return False, "not listed (static)"
        leaf = spec[axis]
    elif isinstance(spec, (list, tuple)) and axis < len(spec):
        leaf = spec[axis]
    else:
        return None
    if leaf is None or (isinstance(leaf, int) and not isinstance(leaf, bool)):
        return False, repr(leaf)
    hint_type = getattr(leaf, "type", None)
    if type(leaf).__name__ == "_DimHint" and hint_type is not None:
        return hint_type.name != "STATIC", f"Dim.{hint_type.name}"
    name = getattr(leaf, "__name__", None)
    return True, f"Dim({name!r})" if name else repr(leaf)


def check_shared_axes(dynamic_shapes: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Refuse ``dynamic_shapes`` that mark an axis dynamic on one input and static on another
    input sharing it (the text batch of ``input_ids`` and ``attention_mask``, their sequence ...).

    Which inputs share an axis comes from the input-role table
    (:func:`hfexport.input_checks.shared_axis_groups`). Only inputs ``dynamic_shapes`` gives an
    entry for are compared; an input it omits, or maps to ``None``, is static by completion and
    is left to ``torch.export``. ``torch.export`` would otherwise specialize the dynamic axis to
    the sample size or fail with a constraint violation deep in capture.

    Raises:
        ValueError: the message names the axis, the two inputs and their marks, and what to change.
    """
    from hfexport.input_checks import shared_axis_groups

    for (what, name), members in shared_axis_groups(inputs).items():
        marks = []
        for key, axis in members:
            if key not in dynamic_shapes:
                continue
            mark = _axis_mark(dynamic_shapes[key], axis)
            if mark is not None:
                marks.append((key, axis, *mark))
        dynamic = [m for m in marks if m[2]]
        static = [m for m in marks if not m[2]]
        if dynamic and static:
            (dkey, daxis, _, dshown), (skey, saxis, _, sshown) = dynamic[0], static[0]
            label = f"{name} batch" if what == "batch" else f"{name} sequence"
            raise ValueError(
                f"dynamic_shapes marks the {label} axis dynamic on {dkey} (dynamic_shapes[{dkey!r}][{daxis}] = "
                f"{dshown}) and static on {skey} (dynamic_shapes[{skey!r}][{saxis}] = {sshown}), which is "
                f"invalid: both inputs have one size on that axis; allowed: the same Dim on both "
                f"({skey!r}: {{{saxis}: {dshown}}}), or the axis static on both"
            )


def resolve_dynamic_shapes(config: Any, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``dynamic_shapes`` to pass to ``torch.export.export`` for ``config``.

    Explicit ``config.dynamic_shapes`` win (inputs they omit are static); else ``dynamic=True``
    gives :func:`auto_dynamic_shapes` (warning once that naming only the varying axes exports
    faster); else ``None`` (static).

    Raises:
        ValueError: ``dynamic_shapes`` does not fit the sample inputs (see :func:`check_dynamic_shapes`).
    """
    global _AUTO_WARNED
    explicit = getattr(config, "dynamic_shapes", None)
    if explicit:
        check_dynamic_shapes(explicit, inputs)
        return {k: explicit.get(k) for k in inputs}
    if getattr(config, "dynamic", False):
        if not _AUTO_WARNED:
            _AUTO_WARNED = True
            logger.info(
                "dynamic=True marks every axis Dim.AUTO, which exports slower than naming only the axes that "
                "vary (config.dynamic_shapes)"
            )
        return auto_dynamic_shapes(inputs)
    return None


@contextlib.contextmanager
def reset_stale_state(model: torch.nn.Module) -> Iterator[list[str]]:
    """Clear lazily cached attributes (see ``STALE_ATTRIBUTES``) for the body; restore them after.

    Every module of ``model`` holding one of the attributes (as a plain instance attribute, not a
    buffer) gets the attribute's "nothing cached" value, so a table an eager forward computed for
    another length is recomputed inside the trace instead of being baked in as a constant. On
    exit every listed attribute gets its original object back (one the trace set on a module that
    had none is removed), also when the body raises.

    Yields the dotted names of the attributes that were cleared, for the report.
    """
    saved: list[tuple[torch.nn.Module, str, Any]] = []
    names: list[str] = []
    for mod_name, module in model.named_modules():
        for attr, empty in STALE_ATTRIBUTES.items():
            value = vars(module).get(attr, _ABSENT)
            # every listed attribute is restored afterwards, also an empty one: the trace may have
            # filled it with a traced tensor that must not outlive the export
            saved.append((module, attr, value))
            if value is _ABSENT or value is None or (not isinstance(value, torch.Tensor) and value == empty):
                continue
            names.append(f"{mod_name}.{attr}" if mod_name else attr)
            object.__setattr__(module, attr, empty)
    try:
        yield names
    finally:
        for module, attr, value in saved:
            if value is _ABSENT:
                vars(module).pop(attr, None)
            else:
                object.__setattr__(module, attr, value)


def register_stale_attribute(name: str, empty: Any = None) -> None:
    """Add an attribute name to those :func:`reset_stale_state` clears while tracing.

    Args:
        name: instance attribute a module fills lazily during a forward (e.g. ``"_rope_cache"``).
        empty: the value meaning "nothing cached", put in place while tracing (default ``None``).

    Raises:
        ValueError: ``name`` is not a Python identifier.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"stale attribute name must be an identifier, got {name!r}")
    STALE_ATTRIBUTES[name] = empty


@contextlib.contextmanager
def _no_stage(name: str) -> Iterator[None]:
    yield None


def capture(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    config: Any,
    report: Any | None = None,
    *,
    record_stages: bool = False,
) -> torch.export.ExportedProgram:
    """Run ``torch.export.export`` on ``model`` with forward kwargs ``inputs``.

    Args:
        model: the module to capture (eval mode).
        inputs: forward kwargs: tensors, caches, ``None`` and Python scalars.
        config: a ``DynamoConfig`` (or subclass): ``dynamic``, ``dynamic_shapes``, ``strict``,
            ``prefer_deferred_runtime_asserts_over_guards`` are used.
        report: an ``ExportReport``; its ``output_flags`` (set by ``HfExporter.export``) become
            constant keyword inputs of the program (:func:`flags_in_signature`); facts (dynamic
            shapes, cleared attributes) go in ``extra``, the
            names of the capture workarounds in effect in ``applied["capture_patches"]``, the image
            sides the model fixes in ``extra["model_fixed_sides"]`` (when there are any; see
            :func:`hfexport.side_probe.model_fixed_image_sides`), the sides its guards pin to the
            sample and that were traced again static in ``extra["guard_fixed_sides"]``
            (:func:`hfexport.program_axes.sides_fixed_by_guards`), and what the program made of each
            axis asked dynamic in ``report.dynamic_axes`` (with ``report.dynamic_axes_summary``;
            see :func:`hfexport.program_axes.program_input_axes`; a fixed side reads
            ``"static 32 (model-fixed)"``).
        record_stages: with a ``report``, run each step inside ``report.stage(...)`` so the report
            (and an error) names it: ``capture.cache_pytrees``, ``capture.signature``,
            ``capture.dynamic_shapes``, ``capture.reset_stale_state``, ``capture.patches``,
            ``capture.torch_export``.
            Off by default: callers that wrap the whole call in their own stage keep one stage.

    Returns:
        The ``ExportedProgram``; its ``module()`` takes the same keyword inputs, and the output
        flags of ``report.output_flags`` (required, as every exported kwarg is; another value
        fails a guard naming the flag).

    Raises:
        ValueError: ``dynamic_shapes`` names unknown inputs.
        Whatever ``torch.export.export`` raises (the caller's report stage names the stage).
    """
    stage = report.stage if (report is not None and record_stages) else _no_stage
    with stage("capture.cache_pytrees"):
        register_cache_pytrees()
    with stage("capture.signature"):
        module = signature_module(model, inputs)
        kwargs = dict(inputs)
    with stage("capture.dynamic_shapes"):
        kwargs, widened = widen_unit_batch(kwargs, config)
        dynamic_shapes = resolve_dynamic_shapes(config, kwargs)
        # image sides the model fixes are traced static; the report still lists them as asked
        fixed_sides = model_fixed_image_sides(module, kwargs, dynamic_shapes, reset_state=reset_stale_state)
        traced_shapes = keep_sides_static(dynamic_shapes, fixed_sides)
    with contextlib.ExitStack() as stack:
        with stage("capture.reset_stale_state"):
            cleared = stack.enter_context(reset_stale_state(model))
        stack.enter_context(torch.no_grad())
        if report is not None:
            from hfexport.config import encode_dynamic_shapes

            report.extra["cleared_stale_attributes"] = cleared
            if widened:
                report.extra["trace_inputs"] = widened
            if fixed_sides:
                report.extra["model_fixed_sides"] = fixed_sides
            try:
                report.extra["dynamic_shapes"] = encode_dynamic_shapes(dynamic_shapes)
            except ValueError:
                report.extra["dynamic_shapes"] = str(dynamic_shapes)
        with stage("capture.patches"):
            key = capture_patch_key(module)
            in_effect = stack.enter_context(apply_patches(key))
            if report is not None:
                recorded = report.applied.get("capture_patches", [])
                report.record_applied(
                    "capture_patches", [e.name for e in in_effect if e.name not in recorded]
                )
        flags = dict((report.output_flags if report is not None else None) or {})
        if flags and isinstance(traced_shapes, dict):
            traced_shapes = {**traced_shapes, **dict.fromkeys(flags)}
        with stage("capture.torch_export"), flags_in_signature(module, list(kwargs), flags):
            export = functools.partial(
                torch.export.export,
                module,
                args=(),
                kwargs={**kwargs, **flags},
                strict=bool(getattr(config, "strict", False)),
                prefer_deferred_runtime_asserts_over_guards=bool(
                    getattr(config, "prefer_deferred_runtime_asserts_over_guards", False)
                ),
            )
            program = export(dynamic_shapes=traced_shapes)
            from hfexport.program_axes import sides_fixed_by_guards

            # sides the program's guards pin to the sample (Swin's window minimums) are traced again
            # static, so no backend re-simplifies their symbolic sizes (program_axes.sides_fixed_by_guards)
            pinned = sides_fixed_by_guards(program, kwargs, traced_shapes)
            if pinned:
                logger.info(
                    "image sides %s: the captured program's guards accept the sample's size only; traced again "
                    "with them static",
                    ", ".join(f"{side['input']}.shape[{side['axis']}]={side['sample']}" for side in pinned),
                )
                del program
                with reset_stale_state(model):  # nothing the first trace cached reaches the second
                    program = export(dynamic_shapes=keep_sides_static(traced_shapes, pinned))
                if report is not None:
                    report.extra["guard_fixed_sides"] = pinned
        if key == _vision_language_workarounds.FIXED_GRID_KEY:
            dropped = _vision_language_workarounds.drop_constant_reads(program)
            if report is not None and dropped:
                report.extra["dropped_constant_reads"] = dropped
    if report is not None:
        # which axes asked dynamic stayed dynamic, and which the model fixed (ViT's and SigLIP's image size)
        from hfexport.conventions.config_lookups import max_positions
        from hfexport.program_axes import axes_summary, program_input_axes

        limit, _ = max_positions(getattr(model, "config", None))
        axes = program_input_axes(program, kwargs, dynamic_shapes, position_limit=limit)
        report.dynamic_axes = axes
        report.dynamic_axes_summary = axes_summary(axes)
        bounded: dict[tuple[str, Any, Any], list[str]] = {}
        for entry in axes:
            if entry.get("note") == "model-bounded" and str(entry.get("meaning", "")).endswith("sequence"):
                key = (str(entry["meaning"]), entry.get("min"), entry.get("max"))
                bounded.setdefault(key, []).append(str(entry["input"]))
        for (meaning, low, high), names in bounded.items():
            logger.warning(
                "%s %s: the captured program accepts lengths %s..%s only: the model's forward fixes a count at "
                "the sample's length (e.g. a Python loop over fixed-size chunks, unrolled at capture); feed "
                "lengths in this range, or trace with a sample of the length you need",
                "/".join(names),
                meaning,
                low,
                high,
            )
    return program


def release_shape_env_caches() -> int:
    """Clear the class-wide caches of ``torch``'s ``ShapeEnv`` methods and of ``FakeTensorMode``,
    which keep every ``ShapeEnv`` they saw alive (and through fake-tensor dispatch cache keys, the
    operator arguments of the traced graphs).

    ``ShapeEnv`` methods are memoized with ``lru_cache`` wrappers defined on the class, keyed by
    ``self``: after an export, the capture's (and a backend's re-traces') shape environments stay
    reachable from them, and with them whatever their ``fake_tensor_cache`` keys hold; the
    class-wide ``FakeTensorMode.cache`` (fake dispatch of ops without symbolic shapes) holds such
    keys too, and ``PhiloxStateTracker`` (RNG decompositions) keeps the last graph's fake tensors,
    hence its fake mode and shape environment, in class state: both are reset as well. Shape
    environments kept alive by other module state (``proxy_tensor``'s tables of traced nodes) get
    their ``fake_tensor_cache`` emptied, so at worst they keep their own symbols, not the graphs
    and weights their cache keys named. Measured on
    an ExecuTorch export of a 218M-parameter Qwen3: the 55 lowered XNNPACK modules of the freed
    program, each keeping its partition's weights (1.3 GB), stayed resident until the caches were
    cleared. The caches only save recomputation; clearing them changes no result. A related
    upstream report of cache entries outliving their ``ShapeEnv``: pytorch/pytorch#190686 (torch
    2.13; the method caches are unchanged there).

    Returns:
        The number of caches cleared.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cleared = 0
    for value in vars(ShapeEnv).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
            cleared += 1
    FakeTensorMode.cache_clear()  # the class-wide dispatch cache of static-shape ops: same keys
    # the RNG-decomposition tracker keeps the fake tensors of the last traced graph in class state
    from torch._decomp.decompositions_for_rng import PhiloxStateTracker

    PhiloxStateTracker.reset()
    # shape environments still reachable from torch's module state (graphs of earlier traces kept
    # by proxy_tensor's tables, ...) keep what their fake-tensor dispatch caches saw: emptied too
    import gc

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance also reads obj.__class__, which some module proxies
        # answer with a deprecation warning (torch.distributed.reduce_op)
        if issubclass(type(obj), ShapeEnv):
            obj.fake_tensor_cache.clear()
            cleared += 1
    return cleared + 2
