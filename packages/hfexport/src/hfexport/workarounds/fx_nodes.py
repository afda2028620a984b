"""Inserting FX nodes the way a workaround needs them: with a fake value and the source's metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SOURCE_META_KEYS", "insert_call"]

#: node metadata a new node takes from the node it stands for (stack trace, module path, source fn)
SOURCE_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


def insert_call(
    graph: torch.fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    like: torch.fx.Node,
) -> torch.fx.Node:
    """A ``call_function`` node of ``target(*args, **kwargs)`` at ``graph``'s insertion point.

    Its ``meta["val"]`` is ``target`` applied to the fake values of the node arguments (symbolic
    shapes propagate as ``torch.export`` records them; lists of nodes are mapped too), and it takes
    :data:`SOURCE_META_KEYS` from ``like`` so backends' debug handles and error messages still name
    the model code.

    Raises:
        KeyError: an argument node has no ``meta["val"]``.
        Whatever ``target`` raises on the fake values (e.g. a shape mismatch).
    """
    kwargs = dict(kwargs or {})
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    node.meta["val"] = target(*values[0], **values[1])
    for key in SOURCE_META_KEYS:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node
