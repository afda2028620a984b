"""What the second-shape validation needs to know about a transformers KV cache among the inputs.

A generation component (prefill, decode step) takes one ``Cache`` object next to its tensors. These
helpers find it and read the two lengths the size plan (:mod:`hfexport.verify.sizes`) works with:
the positions it holds (the *past length*) and, for a static cache, the positions it can hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["cache_layer_kind", "cache_past_length", "find_cache", "static_cache_length"]


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


def cache_layer_kind(layer: Any) -> str | None:
    """``"dynamic"`` (``DynamicLayer``) or ``"static"`` (``StaticLayer``): the layer classes whose
    length is carried by their tensors only; ``None`` for any other layer (sliding-window layers
    keep their length as a Python int, which a captured program holds fixed)."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if type(layer) is DynamicLayer:
        return "dynamic"
    if type(layer) is StaticLayer:
        return "static"
    return None
