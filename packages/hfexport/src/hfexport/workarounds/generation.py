"""Workarounds installed while the generation components are captured (registry key ``generation``).

Each one is registered with :func:`hfexport.registry.register_patch` and installed only inside
:func:`hfexport.registry.apply_patches` ``("generation")`` around the recording ``generate`` call,
so the caches built there (and therefore the traced graphs) have an export-friendly layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hfexport.registry import register_patch

__all__ = ["BACKEND", "full_attention_cache_layers", "full_attention_hybrid_cache_layers"]

logger = logging.getLogger(__name__)

#: Registry key of the generation workarounds.
BACKEND = "generation"

# Layer types whose cache layers keep their fill level in a Python int.
_SLIDING_LAYER_TYPES = ("sliding_attention",)
# Hybrid layer types (linear-attention state + a sliding-window key/value cache) -> the hybrid
# type with a full-attention key/value cache and the same conv / recurrent states.
_HYBRID_SLIDING_LAYER_TYPES = {"hybrid_sliding": "hybrid"}


@register_patch(
    BACKEND,
    "transformers.cache_utils.get_layer_types_and_kwargs",
    description=(
        "build full-attention cache layers for sliding-window layers (the attention mask keeps the window), "
        "so no Python-int fill level is baked into exported decode graphs"
    ),
    issue="https://github.com/huggingface/transformers/issues/44609",
    versions={"transformers": ">=4.56"},
)
def full_attention_cache_layers(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make every sliding-window cache layer a full-attention layer.

    ``DynamicSlidingWindowLayer`` and ``StaticSlidingWindowLayer`` track how many tokens they hold
    in a Python ``int`` (``cumulative_length`` / ``cumulative_length_int``) and branch on it. A
    traced graph bakes that int in: the exported decode graph would be right for one cache length
    only, and the int sits in the cache's pytree context, so the next step's cache would not even
    match the graph's input spec. transformers issue 44609 asks for a tensor-valued length; as of
    transformers 5.24 the int is still there, so the export side works around it: a full-attention
    layer keeps every position and the sliding-window mask, which transformers builds from the
    config's ``layer_types``/``sliding_window`` whatever the cache layer, hides the positions
    outside the window. Logits are the same; the cache grows past the window (``max_cache_len``
    positions for a static cache).
    """

    def layer_types_and_kwargs(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
        layer_types, per_layer_kwargs = original(config)
        types = list(layer_types)
        kwargs = [dict(k) for k in per_layer_kwargs]
        for i, layer_type in enumerate(types):
            if layer_type in _SLIDING_LAYER_TYPES:
                types[i] = "full_attention"
                kwargs[i].pop("sliding_window", None)
        return types, kwargs

    return layer_types_and_kwargs


@register_patch(
    BACKEND,
    "transformers.cache_utils.get_layer_types_and_kwargs",
    description=(
        "build hybrid full-attention cache layers (conv/recurrent state + growing keys/values) for hybrid "
        "sliding-window layers, so no Python-int fill level is baked into exported decode graphs"
    ),
    issue="https://github.com/huggingface/transformers/issues/44609",
    versions={"transformers": ">=5.0"},
)
def full_attention_hybrid_cache_layers(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make every ``hybrid_sliding`` cache layer a ``hybrid`` (full-attention) layer.

    ``LinearAttentionAndSlidingWindowAttentionLayer`` (layer type ``hybrid_sliding``: Inkling's
    sliding layers, whose keys and values pass a short convolution first) is a
    ``DynamicSlidingWindowLayer`` with conv states: it keeps its fill level in the Python ``int``
    ``cumulative_length`` (transformers issue 44609, still so in 5.24). A traced decode graph bakes
    that int in (its ``get_mask_sizes`` reads it): the exported decode was right for the sample's
    cache length only ("Guard failed: attention_mask.size()[1] <= 25" at the second generated
    token). ``LinearAttentionAndFullAttentionLayer`` (type ``hybrid``) holds the same conv states
    and grows its keys/values; the sliding-window mask, built from the config whatever the cache
    layer, hides the positions outside the window, and the key positions the attention reads
    (``kv_offset`` 0) are those of the keys kept. Logits are the same; the cache grows past the
    window. The ``number_of_states`` kwarg is kept, ``sliding_window`` dropped.
    """

    def layer_types_and_kwargs(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
        layer_types, per_layer_kwargs = original(config)
        types = list(layer_types)
        kwargs = [dict(k) for k in per_layer_kwargs]
        for i, layer_type in enumerate(types):
            if layer_type in _HYBRID_SLIDING_LAYER_TYPES:
                types[i] = _HYBRID_SLIDING_LAYER_TYPES[layer_type]
                kwargs[i].pop("sliding_window", None)
        return types, kwargs

    return layer_types_and_kwargs
