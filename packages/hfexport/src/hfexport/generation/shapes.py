"""Explicit ``torch.export`` dynamic shapes for generation components, chosen per input leaf.

``dynamic=True`` marks every axis ``Dim.AUTO``; for some components the model fixes axes that
would otherwise come out symbolic (the patch axis of a vision encoder's ``pixel_values``), or a
runtime needs named, bounded dimensions (ExecuTorch memory planning). :func:`dynamic_shapes_by_rule`
builds the ``dynamic_shapes`` structure ``torch.export`` expects (caches and model outputs as the
lists of their pytree children) from a rule deciding each tensor leaf's spec by its path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.generation.plan import keypath_to_str
from hfexport.pytree import register_cache_pytrees

__all__ = ["LeafRule", "dynamic_shapes_by_rule", "leading_axis_only"]

#: ``rule(path, tensor) -> {axis: Dim} | None``; ``None`` keeps the leaf static.
LeafRule = Callable[[str, torch.Tensor], "dict[int, Any] | None"]


def _spec(value: Any, path: str, rule: LeafRule) -> Any:
    if isinstance(value, torch.Tensor):
        return rule(path, value) if value.dim() else None
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    node = pytree.SUPPORTED_NODES.get(type(value))
    if type(value) not in (dict, list, tuple) and node is not None:
        if node.flatten_with_keys_fn is not None:
            keyed, _ = node.flatten_with_keys_fn(value)
            return [_spec(child, f"{path}.{keypath_to_str((key,))}", rule) for key, child in keyed]
        children, _ = node.flatten_fn(value)
        return [_spec(child, f"{path}.{i}", rule) for i, child in enumerate(children)]
    if isinstance(value, dict):
        return {k: _spec(v, f"{path}.{k}", rule) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        specs = [_spec(v, f"{path}.{i}", rule) for i, v in enumerate(value)]
        return tuple(specs) if isinstance(value, tuple) else specs
    return None


def dynamic_shapes_by_rule(inputs: Mapping[str, Any], rule: LeafRule) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export.export(kwargs=inputs)`` with each tensor leaf's spec
    given by ``rule(path, tensor)``.

    Args:
        inputs: prepared forward kwargs (tensors, caches, model outputs, constants).
        rule: called for every tensor leaf with at least one axis, with its dotted path
            (``input_ids``, ``cache.layers.0.keys``); returns ``{axis: Dim}`` or ``None`` (static).

    Returns:
        A dict keyed like ``inputs``.
    """
    register_cache_pytrees()
    return {name: _spec(value, name, rule) for name, value in inputs.items()}


def leading_axis_only(path: str, tensor: torch.Tensor) -> dict[int, Any] | None:
    """Rule: ``Dim.AUTO`` on axis 0, every other axis static."""
    from torch.export import Dim

    return {0: Dim.AUTO}
