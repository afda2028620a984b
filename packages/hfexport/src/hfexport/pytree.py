"""Register transformers ``Cache`` classes as pytree nodes so ``torch.export`` can take and return them.

Every ``Cache`` subclass (``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache`` and classes
defined in model files) is flattened the same way: its children are the state tensors of its layers
(``layers.<i>.keys``, ``layers.<i>.values``, ``layers.<i>.cumulative_length``, named as
:func:`hfexport.tensors.get_leaf_tensors` names them) and any nested caches
(``self_attention_cache``); everything else (layer classes, ``max_cache_len``,
``is_initialized`` ...) is the node context, kept JSON-serialisable so an ``ExportedProgram`` holding
caches can be saved with ``torch.export.save`` and loaded again once the nodes are registered.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import threading
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["cache_classes", "register_cache_pytrees", "register_known_pytrees"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_REGISTERED: set[type] = set()
_SIMPLE = (bool, int, float, str, type(None))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(qualname: str) -> type:
    """Return the class a cache context names as ``module:qualname``; only cache classes.

    Contexts are read back from saved programs, i.e. from files: the module must already be
    imported or belong to the ``transformers`` package, and the object must be a ``Cache`` or a
    cache layer class, so a crafted context can neither import arbitrary modules nor instantiate
    arbitrary classes.

    Raises:
        ValueError: the module is not imported and not part of ``transformers``, or the name is not
            a cache or cache layer class.
    """
    from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

    module_name, _, name = qualname.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        if module_name != "transformers" and not module_name.startswith("transformers."):
            raise ValueError(
                f"cache context names {qualname!r}, whose module is neither imported nor part of transformers; "
                "import the modeling file that defines it first"
            )
        obj = importlib.import_module(module_name)
    for part in name.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise ValueError(f"cache context names {qualname!r}, which is not a class path")
        obj = getattr(obj, part, None)
    if not (
        isinstance(obj, type)
        and issubclass(obj, (Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin, DummyLayer))
    ):
        raise ValueError(
            f"cache context names {qualname!r}, which is not a transformers cache or cache layer class"
        )
    return obj


def _encode_value(value: Any) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        return {"__class__": _qualname(value)}
    if isinstance(value, (list, tuple)) and all(isinstance(v, _SIMPLE) for v in value):
        return {"__seq__": list(value), "tuple": isinstance(value, tuple)}
    if (
        isinstance(value, dict)
        and all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in value)
        and all(isinstance(v, _SIMPLE) for v in value.values())
    ):
        # e.g. EncoderDecoderCache.is_updated = {layer_idx: bool}; JSON keys must be strings, so pairs
        return {"__map__": [[k, v] for k, v in value.items()]}
    return {"__skip__": True}


def _decode_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "__device__" in value:
        return torch.device(value["__device__"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__class__" in value:
        return _resolve(value["__class__"])
    if "__tensor__" in value:
        tensor = torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        # Remember the value: flattening the rebuilt object again inside a fake/functional trace
        # must not read it back from the tensor (that would be a data-dependent SymInt).
        tensor._hfexport_context_value = value["__tensor__"]
        return tensor
    if "__map__" in value:
        return {k: v for k, v in value["__map__"]}
    if "__seq__" in value:
        return tuple(value["__seq__"]) if value["tuple"] else list(value["__seq__"])
    return None


def _split_object(
    obj: Any, prefix: str, children: list[Any], keys: list[str], *, layer: bool = False
) -> dict[str, Any]:
    """Split ``vars(obj)`` into pytree children and a JSON-safe context dict.

    Children are the state tensors, named and ordered as :func:`hfexport.tensors.get_leaf_tensors`
    names them (``layers.0.keys``, ``layers.0.cumulative_length``...), and nested caches. Other
    tensors of a layer (configuration such as a sliding-window size held in a 0-d tensor) are
    stored in the context by value.
    """
    from transformers.cache_utils import Cache

    from hfexport.tensors import _layer_state_names

    state = set(_layer_state_names(obj)[0]) if layer else set()
    context: dict[str, Any] = {"__class__": _qualname(type(obj)), "attrs": {}, "children": []}
    containers: list[str] = []
    for name in sorted(vars(obj)):
        value = vars(obj)[name]
        if _is_tensor_container(value) and name != "layers":
            containers.append(name)
        elif (isinstance(value, torch.Tensor) and (name in state or not layer)) or isinstance(value, Cache):
            children.append(value)
            keys.append(f"{prefix}{name}")
            context["children"].append(name)
        elif name == "layers" and isinstance(value, list):
            context["layers"] = [
                _split_object(item, f"{prefix}layers.{i}.", children, keys, layer=True)
                for i, item in enumerate(value)
            ]
        elif isinstance(value, torch.Tensor) and value.numel() <= 16:
            # Under fake tensor tracing (a re-trace such as run_decompositions) tolist() would give
            # data-dependent SymInts; a fake constant still carries its real value.
            concrete = getattr(value, "_hfexport_context_value", None)
            if concrete is None:
                constant = getattr(value, "constant", None)
                concrete = (constant if isinstance(constant, torch.Tensor) else value).tolist()
            context["attrs"][name] = {
                "__tensor__": concrete,
                "dtype": str(value.dtype).removeprefix("torch."),
            }
        else:
            encoded = _encode_value(value)
            if not (isinstance(encoded, dict) and encoded.get("__skip__")):
                context["attrs"][name] = encoded
    # lists/dicts of tensors (e.g. MiniMaxCache.linear_cache), after everything else: their
    # tensors are children ``<name>.<i>``, their structure a serialised treespec
    for name in containers:
        leaves, spec = pytree.tree_flatten(vars(obj)[name])
        context.setdefault("containers", {})[name] = [pytree.treespec_dumps(spec), len(leaves)]
        for index, leaf in enumerate(leaves):
            children.append(leaf)
            keys.append(f"{prefix}{name}.{index}")
    return context


def _is_tensor_container(value: Any) -> bool:
    """A non-empty list/tuple/dict whose pytree leaves are all tensors (empty sub-lists allowed)."""
    if not isinstance(value, (list, tuple, dict)) or not value:
        return False
    if isinstance(value, dict) and not all(isinstance(k, (int, str)) for k in value):
        return False
    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def _build_object(context: dict[str, Any], children: list[Any], cursor: list[int]) -> Any:
    cls = _resolve(context["__class__"])
    obj = object.__new__(cls)
    state = {name: _decode_value(v) for name, v in context["attrs"].items()}
    for name in context["children"]:
        state[name] = children[cursor[0]]
        cursor[0] += 1
    if "layers" in context:
        state["layers"] = [_build_object(c, children, cursor) for c in context["layers"]]
    for name, (spec, count) in context.get("containers", {}).items():
        state[name] = pytree.tree_unflatten(
            children[cursor[0] : cursor[0] + count], pytree.treespec_loads(spec)
        )
        cursor[0] += count
    obj.__dict__.update(state)
    return obj


def _cache_flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, Any]], str]:
    children: list[Any] = []
    keys: list[str] = []
    context = _split_object(cache, "", children, keys)
    return [(pytree.MappingKey(k), c) for k, c in zip(keys, children)], json.dumps(context, sort_keys=True)


def _cache_flatten(cache: Any) -> tuple[list[Any], str]:
    pairs, context = _cache_flatten_with_keys(cache)
    return [c for _, c in pairs], context


def _cache_unflatten(children: Any, context: str) -> Any:
    return _build_object(json.loads(context), list(children), [0])


def cache_classes() -> list[type]:
    """Every ``transformers.cache_utils.Cache`` subclass defined so far (model files included)."""
    from transformers.cache_utils import Cache

    found: list[type] = []
    stack = [Cache]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return found


def register_cache_pytrees(extra: list[type] | None = None) -> list[type]:
    """Register every known ``Cache`` subclass (and ``extra`` classes) as a pytree node.

    Safe to call many times and from several threads: a class is registered once per process
    (classes another library registered already are left alone). Call it again after importing a
    model file that defines its own cache class.

    Returns:
        The classes newly registered by this call.
    """
    new: list[type] = []
    with _LOCK:
        for cls in [*cache_classes(), *(extra or [])]:
            if cls in _REGISTERED:
                continue
            if cls in pytree.SUPPORTED_NODES:
                _REGISTERED.add(cls)
                continue
            pytree.register_pytree_node(
                cls,
                _cache_flatten,
                _cache_unflatten,
                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                flatten_with_keys_fn=_cache_flatten_with_keys,
                to_dumpable_context=lambda ctx: ctx,
                from_dumpable_context=lambda ctx: ctx,
            )
            _REGISTERED.add(cls)
            new.append(cls)
    if new:
        logger.debug("registered cache pytree nodes: %s", [c.__name__ for c in new])
    return new


def register_known_pytrees() -> list[type]:
    """Register the pytree node types a saved generation component may name: every ``Cache``
    class of ``transformers.cache_utils`` (plus cache classes of model files imported so far) and
    the model outputs of ``transformers.modeling_outputs`` (``BaseModelOutput`` as
    ``encoder_outputs`` ...), which transformers registers when the module is imported.

    This is the fixed allow-list loaders use instead of importing modules named by a file.

    Returns:
        The cache classes newly registered by this call.
    """
    import transformers.cache_utils  # defines the Cache classes
    import transformers.modeling_outputs  # noqa: F401  (registers the ModelOutput pytree nodes)

    return register_cache_pytrees()
