"""Image sides the model itself fixes, found before capture by a shape-only probe (issue 15).

A ``dynamic=True`` export marks every image height and width ``Dim.AUTO``: torch decides. Whether
the model accepts another side is written in its code, and the trace does not always say so:

- ViT without ``interpolate_pos_encoding`` compares the side with ``config.image_size`` and
  raises; ``torch.export`` guards that comparison and specialises the side (the program says
  ``static 32``).
- SigLIP adds its ``(image_size / patch)**2``-row position table to the patch embeddings with no
  check. The broadcast leaves the guard ``(height // 8) * (width // 8) == 16`` on the program's
  inputs, which is no range, so the sides come out "dynamic [8, inf]": a program that refuses every
  size but the sample's ("Guard failed"), on every backend, and the second-shape validation feeds
  it doubled sides.

:func:`model_fixed_image_sides` asks the model instead of the trace: it runs the forward twice
under ``FakeTensorMode`` (shapes only, nothing computed, no weights copied), once on the sample
and once with the image sides doubled, which is the size the second-shape validation
(:func:`hfexport.validation.derive_second_inputs`) feeds. A side for which the sample runs and
the doubled one does not is fixed by the model; :func:`hfexport.capture.capture` traces it
static, and the report says ``"pixel_values image height/width: static 32 (model-fixed)"`` as it
does for ViT. A probe that fails on the sample as well (a data-dependent op, an op without a
fake kernel) decides nothing and the sides stay as torch makes them. ConvNeXt (convolutions and
pooling only) runs doubled, so its sides stay dynamic.

Only ``Dim.AUTO`` sides are probed (``dynamic=True``, ExecuTorch's bounded hints): a named
``Dim`` or ``Dim.DYNAMIC`` is the user's demand and goes to ``torch.export`` as given.

The probe runs with the patches registered under :data:`PROBE_KEY` in place
(:func:`bypass_transformers_lru_caches`): transformers memoises helpers of about 60 vision models
(DINOv3's patch coordinates, DETR's and BEiT's position tables) in module-level LRU caches keyed
by sizes, and a fake probe would leave a fake tensor there for the eager model to read later.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hfexport.conventions import input_role
from hfexport.registry import apply_patches, register_patch

__all__ = [
    "PROBE_KEY",
    "SIDE_GROWTH",
    "bypass_transformers_lru_caches",
    "keep_sides_static",
    "model_fixed_image_sides",
]

#: Registry key of the patches in place while the probe runs the model on fake tensors.
PROBE_KEY = "side_probe"


@register_patch(
    PROBE_KEY,
    "transformers.pytorch_utils.is_torchdynamo_compiling",
    description=(
        "side probe: transformers' compile_compatible_method_lru_cache helpers compute without their cache, so the "
        "fake probe stores no fake tensor for the eager model to read later (DINOv3 patch coordinates: CHMv2's "
        "eager reference came out fake, DataDependentOutputException: aten.equal.default)"
    ),
    # no transformers issue filed; diffusers fixed the same fault of its copy of the helper
    issue="https://github.com/huggingface/diffusers/pull/13290",
    versions={"transformers": ">=5.23,<6"},
)
def bypass_transformers_lru_caches(original: Any) -> Any:
    """Replace ``transformers.pytorch_utils.is_torchdynamo_compiling`` while the probe runs.

    ``compile_compatible_method_lru_cache`` (``transformers.pytorch_utils``) memoises a function
    in a module-level ``functools.lru_cache`` unless this name says torch is compiling. The probe
    runs the forward under ``FakeTensorMode`` without compiling, so the cache kept the fake result
    of, e.g., DINOv3's ``get_patches_center_coordinates(4, 4, ...)``: the next eager forward at that
    image size read it, its output was a fake tensor, and validation failed on
    ``DataDependentOutputException: aten.equal.default`` (CHMv2 at the sample or the doubled image
    size, on every backend). Inside the probe the replacement answers True, so the helpers compute
    without their cache (the same values), as they do while ``torch.export`` traces. Only the
    helpers of that module read this name; the rest of transformers keeps its own check.

    Returns:
        A function of no arguments returning True.
    """

    @functools.wraps(original)
    def is_torchdynamo_compiling() -> bool:
        return True

    return is_torchdynamo_compiling


#: The probe multiplies every dynamic image side by this (the second shape's growth).
SIDE_GROWTH = 2


def _is_auto_hint(leaf: Any) -> bool:
    """``Dim.AUTO`` (with or without a range); not ``Dim.DYNAMIC``, ``Dim.STATIC`` or a named ``Dim``."""
    return type(leaf).__name__ == "_DimHint" and getattr(getattr(leaf, "type", None), "name", "") == "AUTO"


def _leaf(spec: Any, axis: int) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(axis)
    if isinstance(spec, (list, tuple)) and axis < len(spec):
        return spec[axis]
    return None


def _auto_sides(
    inputs: Mapping[str, Any], dynamic_shapes: Mapping[str, Any]
) -> dict[str, list[tuple[str, int]]]:
    """``{modality: [(input, axis), ...]}`` of the image sides marked ``Dim.AUTO`` (sample size > 1)."""
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    found: dict[str, list[tuple[str, int]]] = {}
    for key, tensor in tensors.items():
        role = input_role(key, tensor.dim(), present=tensors)
        for axis in role.spatial_axes if role is not None else ():
            if tensor.shape[axis] > 1 and _is_auto_hint(_leaf(dynamic_shapes.get(key), axis)):
                found.setdefault(role.modality, []).append((key, axis))
    return found


@contextlib.contextmanager
def _quiet_fake_kernels() -> Iterator[None]:
    """Mute ``torch._subclasses.fake_tensor``'s error log (it logs the traceback of every meta
    kernel that raises, which a refused probe shape is expected to make)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def _method_caches(model: torch.nn.Module) -> list[Any]:
    """The ``functools`` caches of the methods of ``model``'s module classes: a method decorated
    with ``functools.lru_cache`` / ``functools.cache`` (OmDet-Turbo's anchors), or wrapped by a
    function holding such a cache in its closure (transformers' ``compile_compatible_method_lru_cache``:
    the DETR family's anchors and position tables, which bypasses its cache only while compiling)."""
    found: dict[int, Any] = {}
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            for attr in vars(klass).values():
                fn = getattr(attr, "__func__", attr)  # staticmethod / classmethod
                cells = getattr(fn, "__closure__", None) or ()
                for candidate in (fn, *(c.cell_contents for c in cells if c.cell_contents is not None)):
                    if callable(getattr(candidate, "cache_clear", None)):
                        found[id(candidate)] = candidate
    return list(found.values())


@contextlib.contextmanager
def _no_fake_cache_entries(model: torch.nn.Module) -> Iterator[None]:
    """Empty the model's method caches (:func:`_method_caches`) after the body. A probe runs the
    forward eagerly on fake tensors, so a cached method (keyed by plain ints: the sample's feature
    map sides) would keep a fake tensor, and the eager reference of the validation would get it
    back from the cache (``DataDependentOutputException: aten.equal.default`` when compared)."""
    try:
        yield
    finally:
        for cache in _method_caches(model):
            cache.cache_clear()


def _probe(
    model: torch.nn.Module, inputs: Mapping[str, Any], grow: set[tuple[str, int]], reset_state: Any
) -> str:
    """Run ``model(**inputs)`` on fake tensors, the sides in ``grow`` multiplied by
    :data:`SIDE_GROWTH`; ``""`` when it runs, else the first line of the error. Leaves no fake
    tensor behind in the model's method caches, nor in the non-tensor inputs (caches are copied)."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    # a cache object is updated in place by the forward: the probe gets its own copy, so the
    # capture after it still sees the sample's cache (an empty prefill cache stays empty: GIT's
    # prefill, issue 28, was traced with fake layers the probe had filled: "Node arity mismatch")
    inputs = {k: v if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in inputs.items()}
    try:
        with (
            _quiet_fake_kernels(),
            _no_fake_cache_entries(model),
            reset_state(model) if reset_state is not None else contextlib.nullcontext(),
            apply_patches(PROBE_KEY),
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            torch.no_grad(),
        ):
            kwargs: dict[str, Any] = {}
            for key, value in inputs.items():
                if not isinstance(value, torch.Tensor):
                    kwargs[key] = value
                    continue
                shape = [
                    size * SIDE_GROWTH if (key, axis) in grow else size
                    for axis, size in enumerate(value.shape)
                ]
                if list(value.shape) == shape:
                    kwargs[key] = mode.from_tensor(value)
                else:
                    kwargs[key] = torch.empty(shape, dtype=value.dtype, device=value.device)
            model(**kwargs)
    except Exception as exc:  # any failure: the caller compares with the sample's outcome
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
    return ""


def model_fixed_image_sides(
    model: torch.nn.Module, inputs: Mapping[str, Any], dynamic_shapes: Any, reset_state: Any = None
) -> list[dict[str, Any]]:
    """The image sides marked ``Dim.AUTO`` that the model cannot grow (see the module doc).

    Args:
        model: the module about to be captured; called as ``model(**inputs)`` on fake tensors
            (its weights are not copied; attributes it caches are reset afterwards, and the
            ``functools`` caches of its methods emptied, so no fake tensor outlives the probe).
        inputs: the forward kwargs to trace with (image sides are the input-role table's
            spatial axes, e.g. axes 2 and 3 of ``pixel_values`` ``[batch, 3, height, width]``).
        dynamic_shapes: the ``dynamic_shapes`` dict about to be given to ``torch.export``;
            anything else (``None``, a tuple) gives ``[]``.
        reset_state: a context manager factory run around each probe with ``model``
            (:func:`hfexport.capture.reset_stale_state`, passed by the capture: attributes an eager
            forward cached are cleared and restored); ``None`` runs the probe as is.

    Returns:
        One dict per fixed side, in input and axis order: ``input``, ``axis``, ``sample`` (its
        size), ``tried`` (the doubled size the model refused) and ``reason`` (the first line of
        the probe's error, e.g. ``"RuntimeError: The size of tensor a (64) must match the size of
        tensor b (16) at non-singleton dimension 1"``). The sides of one modality (``pixel_values``
        and ``pixel_mask``) are grown together, as the second shape grows them, so they are fixed
        together. ``[]`` when no side is marked ``Dim.AUTO`` or when the probe fails on the sample.
    """
    if not isinstance(dynamic_shapes, Mapping):
        return []
    by_modality = _auto_sides(inputs, dynamic_shapes)
    if not by_modality or _probe(model, inputs, set(), reset_state):
        return []
    fixed: list[dict[str, Any]] = []
    for sides in by_modality.values():
        reason = _probe(model, inputs, set(sides), reset_state)
        if not reason:
            continue
        for key, axis in sides:
            sample = int(inputs[key].shape[axis])
            fixed.append(
                {
                    "input": key,
                    "axis": axis,
                    "sample": sample,
                    "tried": sample * SIDE_GROWTH,
                    "reason": reason,
                }
            )
    return fixed


def keep_sides_static(dynamic_shapes: Any, fixed: list[dict[str, Any]]) -> Any:
    """``dynamic_shapes`` with each ``fixed`` side (``input``/``axis``) set to ``Dim.STATIC``.

    A new dict is returned (the argument is not modified); the spec of an input keeps its form
    (dict or tuple/list). With no ``fixed`` sides, ``dynamic_shapes`` itself is returned.
    """
    from torch.export import Dim

    if not fixed or not isinstance(dynamic_shapes, Mapping):
        return dynamic_shapes
    out = dict(dynamic_shapes)
    for side in fixed:
        spec, axis = out.get(side["input"]), int(side["axis"])
        if isinstance(spec, Mapping):
            out[side["input"]] = {**spec, axis: Dim.STATIC}
        elif isinstance(spec, (list, tuple)):
            items = list(spec)
            items[axis] = Dim.STATIC
            out[side["input"]] = type(spec)(items) if isinstance(spec, tuple) else items
    return out
