"""Walk, copy and cast the tensors inside nested model inputs and outputs.

Forward kwargs and model outputs are trees: dicts, lists, tuples, dataclasses, transformers
``ModelOutput`` objects and transformers ``Cache`` objects, with tensors at the leaves. This
module gives every leaf tensor a stable dotted path (``cache.layers.0.keys``) and rebuilds such
trees with transformed leaves (clone, cast, replace), so export, validation and reporting all
name tensors the same way.

Cache layout (transformers 5.x, read from ``transformers.cache_utils``):

- ``DynamicCache``/``StaticCache`` (and every other ``Cache`` but ``EncoderDecoderCache``) hold a
  ``layers`` list, one layer object per decoder layer. Layers are created lazily: until a
  layer's first ``update`` its ``keys``/``values`` are ``None`` and ``is_initialized`` is False.
- ``EncoderDecoderCache`` holds two caches, ``self_attention_cache`` and
  ``cross_attention_cache``, and no ``layers`` of its own.
- The state of a layer depends on its class (see :func:`register_cache_layer_state`):
  ``keys``/``values`` ``[batch, kv_heads, seq, head_dim]`` for every attention layer, plus the
  in-place position counter ``cumulative_length`` (0-d int64 tensor) for static layers, the
  indexer buffers for sparse-attention layers, and the ``conv_states``/``recurrent_states``
  dicts (``{state_idx: tensor}``) for linear-attention layers. Configuration values
  (``max_cache_len``, ``sliding_window``, the ``_sliding_window_tensor`` of sliding layers) are
  not state and get no path.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    LinearAttentionCacheLayerMixin,
    StaticIndexedLayer,
    StaticLayer,
)
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import ModelOutput

__all__ = [
    "CacheLayerState",
    "cache_layer_state",
    "cast_leaf_tensors",
    "contiguous_leaf_tensors",
    "duplicate_leaf_tensors",
    "get_leaf_tensors",
    "register_cache_layer_state",
    "set_leaf_tensors",
]

logger = logging.getLogger(__name__)

# A leaf function receives the dotted path of a tensor (None for a tensor that is internal to a
# cache object and is not part of its state, e.g. a sliding window size kept as a tensor) and
# returns the tensor to put in its place.
_LeafFn = Callable[[str | None, torch.Tensor], torch.Tensor]

# Values that are never walked into and never transformed.
_OPAQUE_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
    torch.dtype,
    torch.device,
    PreTrainedConfig,
    torch.nn.Module,
)


@dataclasses.dataclass(frozen=True)
class CacheLayerState:
    """Which attributes of a cache layer class are state tensors.

    Attributes:
        names: attribute names, in path order. Each attribute holds a tensor, ``None`` (skipped),
            or a dict/list/tuple of those (``conv_states`` is ``{state_idx: tensor}``).
        initialized_flag: name of a boolean attribute of the layer; while it is False the
            attributes in ``names`` are not state (lazily allocated layers). ``None`` means the
            attributes are always state when they hold tensors.
    """

    names: tuple[str, ...]
    initialized_flag: str | None = None


_LAYER_STATES: dict[type, CacheLayerState] = {}


def register_cache_layer_state(
    layer_cls: type, *names: str, initialized_flag: str | None = None
) -> CacheLayerState:
    """Declare the state attributes of a cache layer class.

    A layer's state is the union, base classes first, of what is registered for every class in
    its MRO; registering a class again replaces its entry. Public attributes of a layer that hold
    tensors but are registered nowhere in its MRO are taken as state as well, after the
    registered ones and sorted by name, so model-specific layers defined in modeling files
    (e.g. an extra ``idx_keys`` buffer) are not silently dropped.

    Args:
        layer_cls: the cache layer class (e.g. ``transformers.cache_utils.StaticLayer``).
        *names: attribute names holding state tensors, in the order their paths should appear.
        initialized_flag: boolean attribute that is False while these attributes are not
            allocated yet (e.g. ``"is_initialized"``); ``None`` if there is none.

    Returns:
        The registered :class:`CacheLayerState`.

    Raises:
        TypeError: ``layer_cls`` is not a class.
        ValueError: no names given.
    """
    if not isinstance(layer_cls, type):
        raise TypeError(f"register_cache_layer_state expects a class, got {type(layer_cls).__name__}")
    if not names:
        raise ValueError(
            f"register_cache_layer_state({layer_cls.__name__}) needs at least one attribute name"
        )
    state = CacheLayerState(names=tuple(names), initialized_flag=initialized_flag)
    _LAYER_STATES[layer_cls] = state
    return state


register_cache_layer_state(CacheLayerMixin, "keys", "values", initialized_flag="is_initialized")
register_cache_layer_state(
    StaticLayer, "keys", "values", "cumulative_length", initialized_flag="is_initialized"
)
register_cache_layer_state(
    DynamicIndexedLayer, "indexer_keys", "indexer_position_ids", initialized_flag="is_indexer_initialized"
)
register_cache_layer_state(
    StaticIndexedLayer,
    "indexer_keys",
    "indexer_position_ids",
    "indexer_cumulative_length",
    initialized_flag="is_indexer_initialized",
)
register_cache_layer_state(LinearAttentionCacheLayerMixin, "conv_states", "recurrent_states")


def _contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_contains_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains_tensor(v) for v in value)
    return False


def _layer_state_names(layer: Any) -> tuple[list[str], set[str]]:
    """Return ``(state names in path order, every name registered in the layer's MRO)``."""
    active: list[str] = []
    registered: set[str] = set()
    for klass in reversed(type(layer).__mro__):
        state = _LAYER_STATES.get(klass)
        if state is None:
            continue
        registered.update(state.names)
        initialized = state.initialized_flag is None or bool(getattr(layer, state.initialized_flag, False))
        if initialized:
            active.extend(name for name in state.names if name not in active)
    extras = sorted(
        name
        for name, value in vars(layer).items()
        if not name.startswith("_") and name not in registered and _contains_tensor(value)
    )
    if extras:
        logger.debug(
            "cache layer %s: unregistered tensor attributes %s taken as state", type(layer).__name__, extras
        )
    return active + extras, registered


def cache_layer_state(layer: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Return the state tensors of one cache layer, keyed by dotted path.

    Args:
        layer: a transformers cache layer (``DynamicLayer``, ``StaticLayer``,
            ``LinearAttentionLayer``, ``DummyLayer``, ...).
        prefix: path prefix, e.g. ``"cache.layers.0"``.

    Returns:
        ``{path: tensor}`` in path order: for a filled ``DynamicLayer`` ``{"keys": ...,
        "values": ...}`` (each ``[batch, kv_heads, seq, head_dim]``); for a ``StaticLayer``
        also ``"cumulative_length"`` (0-d int64); empty for an uninitialised layer and for a
        ``DummyLayer``.
    """
    return get_leaf_tensors(_CacheLayerView(layer), prefix)


class _CacheLayerView:
    """Marks a lone layer so the walker treats it as a cache layer (used by cache_layer_state)."""

    __slots__ = ("layer",)

    def __init__(self, layer: Any) -> None:
        self.layer = layer


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _map_internal(value: Any, fn: _LeafFn) -> Any:
    """Rebuild a non-state value found inside a cache object; its tensors get no path."""
    if isinstance(value, torch.Tensor):
        return fn(None, value)
    if isinstance(value, Cache):
        return _map_cache(value, lambda _path, tensor: fn(None, tensor), "")
    if isinstance(value, (CacheLayerMixin, LinearAttentionCacheLayerMixin, DummyLayer)):
        return _map_layer(value, fn, None)
    if isinstance(value, dict):
        new = copy.copy(value)
        for key, item in value.items():
            new[key] = _map_internal(item, fn)
        return new
    if isinstance(value, list):
        return [_map_internal(item, fn) for item in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_map_internal(item, fn) for item in value)
    return value


def _map_layer(layer: Any, fn: _LeafFn, prefix: str | None) -> Any:
    new = copy.copy(layer)
    if not hasattr(layer, "__dict__"):
        return new
    state_names, _ = _layer_state_names(layer) if prefix is not None else ([], set())
    attributes = vars(layer)
    for name in state_names:
        if name in attributes:
            new.__dict__[name] = _map(attributes[name], fn, _join(prefix or "", name))
    for name, value in attributes.items():
        if name not in state_names:
            new.__dict__[name] = _map_internal(value, fn)
    return new


def _map_cache(cache: Cache, fn: _LeafFn, prefix: str) -> Cache:
    new = copy.copy(cache)
    attributes = vars(cache)
    # Path order: the layers first, then nested caches (EncoderDecoderCache) in attribute order.
    if "layers" in attributes:
        new.__dict__["layers"] = [
            _map_layer(layer, fn, _join(prefix, f"layers.{index}"))
            for index, layer in enumerate(attributes["layers"])
        ]
    for name, value in attributes.items():
        if name == "layers":
            continue
        if isinstance(value, Cache):
            new.__dict__[name] = _map_cache(value, fn, _join(prefix, name))
        else:
            new.__dict__[name] = _map_internal(value, fn)
    return new


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _map(obj: Any, fn: _LeafFn, prefix: str) -> Any:
    """Rebuild ``obj`` with every leaf tensor replaced by ``fn(path, tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(prefix, obj)
    if isinstance(obj, _OPAQUE_TYPES):
        return obj
    if isinstance(obj, _CacheLayerView):
        return _CacheLayerView(_map_layer(obj.layer, fn, prefix))
    if isinstance(obj, Cache):
        return _map_cache(obj, fn, prefix)
    if isinstance(obj, ModelOutput):
        # An OrderedDict whose keys are exactly its non-None fields.
        return type(obj)(**{key: _map(value, fn, _join(prefix, key)) for key, value in obj.items()})
    if isinstance(obj, Mapping):
        items = {key: _map(value, fn, _join(prefix, key)) for key, value in obj.items()}
        if type(obj) is dict:
            return items
        new = copy.copy(obj)
        for key, value in items.items():
            new[key] = value
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            if hasattr(obj, field.name):
                value = _map(getattr(obj, field.name), fn, _join(prefix, field.name))
                object.__setattr__(new, field.name, value)
        return new
    if _is_namedtuple(obj):
        return type(obj)(*(_map(value, fn, _join(prefix, name)) for name, value in zip(obj._fields, obj)))
    if isinstance(obj, list):
        items_list = [_map(value, fn, _join(prefix, index)) for index, value in enumerate(obj)]
        return items_list if type(obj) is list else type(obj)(items_list)
    if isinstance(obj, tuple):
        items_tuple = tuple(_map(value, fn, _join(prefix, index)) for index, value in enumerate(obj))
        return items_tuple if type(obj) is tuple else type(obj)(items_tuple)
    return obj


def get_leaf_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Collect every leaf tensor of a nested structure, keyed by its dotted path.

    Walks tensors, dicts and other mappings (insertion order), transformers ``ModelOutput``
    (its non-None fields, in field order), dataclasses (field order), named tuples (field
    names), lists and tuples (indices) and transformers ``Cache`` objects (see the module
    docstring for their layout). ``None``, enums, Python and symbolic scalars, strings, dtypes,
    devices, configs, modules and unknown objects are skipped.

    Args:
        obj: the structure, typically a dict of forward kwargs or a model output.
        prefix: path prefix prepended to every key (``""`` for none).

    Returns:
        ``{path: tensor}`` in a deterministic order (the walk order above). Forward kwargs
        ``{"input_ids": t, "cache": DynamicCache}`` of a 2-layer decoder give ``input_ids``,
        ``cache.layers.0.keys``, ``cache.layers.0.values``, ``cache.layers.1.keys``,
        ``cache.layers.1.values``. The tensors are the original objects, not copies. A tensor
        passed alone gets the path ``prefix``.

    Raises:
        ValueError: two leaves map to the same path (e.g. dict keys ``1`` and ``"1"``).
    """
    leaves: dict[str, torch.Tensor] = {}

    def record(path: str | None, tensor: torch.Tensor) -> torch.Tensor:
        if path is not None:
            if path in leaves:
                raise ValueError(f"two tensors share the path {path!r}; use keys that differ as strings")
            leaves[path] = tensor
        return tensor

    _map(obj, record, prefix)
    return leaves


def _memoized(transform: Callable[[torch.Tensor], torch.Tensor]) -> _LeafFn:
    """Apply ``transform`` once per distinct tensor, so aliased tensors stay aliased."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def leaf(path: str | None, tensor: torch.Tensor) -> torch.Tensor:
        hit = memo.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1]
        result = transform(tensor)
        memo[id(tensor)] = (tensor, result)
        return result

    return leaf


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    copied = tensor.detach().clone()
    if tensor.requires_grad and tensor.is_leaf:
        copied.requires_grad_(True)
    return copied


def duplicate_leaf_tensors(obj: Any) -> Any:
    """Copy a nested structure, cloning every tensor in it.

    Containers, dataclasses and ``ModelOutput`` objects are rebuilt with the same types; caches
    become new objects of the same class with new layer objects and cloned tensors (their
    internal tensors as well, e.g. the position counter of a static layer), so running a model
    on the copy leaves the original untouched. Tensors that were the same object stay the same
    (cloned) object. Clones are detached from the autograd graph: a leaf tensor keeps its
    ``requires_grad`` flag, a tensor computed with grad enabled becomes plain data (so the
    in-place updates of a static cache keep working on the copy). Objects that are neither containers nor caches (configs, modules,
    scalars) are shared, not copied.

    Args:
        obj: the structure (see :func:`get_leaf_tensors` for what is walked).

    Returns:
        The copy; ``get_leaf_tensors`` gives the same paths, shapes, dtypes and values on it.
    """
    return _map(obj, _memoized(_clone), "")


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a row-major (C-order) tensor of ``shape``, an axis of size 1 included
    (``[2, 128, 1, 1]`` -> ``(128, 1, 1, 1)``)."""
    strides: list[int] = []
    step = 1
    for size in reversed(list(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_contiguous() and tuple(tensor.stride()) == _row_major_strides(tensor.shape):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def contiguous_leaf_tensors(obj: Any) -> Any:
    """Return the structure with every tensor in contiguous (row-major) memory, with row-major strides.

    A tensor that already is contiguous with row-major strides is shared, not copied; a strided
    view (a transposed state a model returned) becomes a contiguous copy with the same shape,
    dtype, device and values. So does a tensor that ``is_contiguous()`` but carries other strides
    on its axes of size 1 (a permuted ``[batch, channels, 1, 1]`` feature map: strides ``(128, 1,
    128, 128)``): torch calls it contiguous and ``.contiguous()`` keeps it, but ExecuTorch derives
    each tensor's dim order from its strides alone and took it for channels-last
    (pytorch/executorch#22520), so Florence-2's projector, captured on such image features, had an
    XNNPACK partition read them as ``[batch, 128, 128]`` at run time (error 0x10, issue 28).
    Aliased tensors stay aliased. Backends whose runtime reads input buffers in row-major order
    capture on these: ``torch.export`` records each input's strides from the sample, and a program
    traced on a transposed sample expects its input in that layout.

    Args:
        obj: the structure (see :func:`get_leaf_tensors` for what is walked).

    Returns:
        A rebuilt structure (the input is not modified).
    """
    return _map(obj, _memoized(_row_major), "")


def _update_cache_metadata(obj: Any, dtype: torch.dtype | None, device: torch.device | None) -> None:
    """Keep ``device``/``dtype`` bookkeeping of rebuilt cache objects in line with their tensors."""
    if isinstance(obj, Cache):
        for name, value in vars(obj).items():
            if name == "layers":
                for layer in value:
                    _update_cache_metadata(layer, dtype, device)
            elif isinstance(value, Cache):
                _update_cache_metadata(value, dtype, device)
        return
    if not hasattr(obj, "__dict__"):
        return
    for name, value in list(vars(obj).items()):
        if device is not None and (name == "device" or name.endswith("_device")) and value is not None:
            obj.__dict__[name] = device
        if (
            dtype is not None
            and (name == "dtype" or name.endswith("_dtype"))
            and isinstance(value, torch.dtype)
            and value.is_floating_point
        ):
            obj.__dict__[name] = dtype


def cast_leaf_tensors(
    obj: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    floating_only: bool = True,
) -> Any:
    """Return the structure with its tensors converted to ``dtype`` and moved to ``device``.

    Args:
        obj: the structure (see :func:`get_leaf_tensors` for what is walked).
        dtype: target dtype. With ``floating_only=True`` (default) it applies to floating point
            tensors only; integer, bool and complex tensors keep their dtype. With
            ``floating_only=False`` it applies to every tensor. ``None`` keeps dtypes.
        device: target device, applied to every tensor whatever its dtype. ``None`` keeps
            devices. Cache objects also get their ``device`` bookkeeping attributes updated.
        floating_only: see ``dtype``.

    Returns:
        A rebuilt structure (the input is not modified): containers and caches are new
        objects; a tensor that needs no conversion is shared with the input rather than copied.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    target_device = torch.device(device) if device is not None else None

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        new_dtype = None
        if dtype is not None and (tensor.is_floating_point() or not floating_only):
            new_dtype = dtype
        if new_dtype is None and target_device is None:
            return tensor
        return tensor.to(device=target_device, dtype=new_dtype)

    result = _map(obj, _memoized(convert), "")
    metadata_dtype = dtype if dtype is not None and dtype.is_floating_point else None
    if metadata_dtype is not None or target_device is not None:
        for cache in _iter_caches(result):
            _update_cache_metadata(cache, metadata_dtype, target_device)
    return result


def _iter_caches(obj: Any) -> list[Cache]:
    found: list[Cache] = []

    def visit(value: Any) -> None:
        if isinstance(value, Cache):
            found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name, None))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(obj)
    return found


def set_leaf_tensors(obj: Any, mapping: Mapping[str, torch.Tensor]) -> Any:
    """Return the structure with the tensors at the given paths replaced.

    Args:
        obj: the structure (see :func:`get_leaf_tensors` for what is walked and how paths read).
        mapping: ``{path: new_tensor}``; paths as :func:`get_leaf_tensors` returns them. Leaves
            not in ``mapping`` are kept (shared with the input).

    Returns:
        A rebuilt structure (the input is not modified) with the same types as ``obj``.

    Raises:
        KeyError: a path in ``mapping`` is not a leaf of ``obj`` (lists the unknown paths).
        TypeError: a value of ``mapping`` is not a tensor.
    """
    for path, value in mapping.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"set_leaf_tensors: the value for {path!r} is a {type(value).__name__}, not a tensor"
            )
    used: set[str] = set()

    def replace(path: str | None, tensor: torch.Tensor) -> torch.Tensor:
        if path is not None and path in mapping:
            used.add(path)
            return mapping[path]
        return tensor

    result = _map(obj, replace, "")
    unknown = sorted(set(mapping) - used)
    if unknown:
        raise KeyError(f"set_leaf_tensors: no leaf tensor at {unknown}")
    return result
