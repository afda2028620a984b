"""Inserting FX nodes the way a workaround needs them: with a fake value and the source's metadata."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["SOURCE_META_KEYS", "cat_result_size", "insert_call"]

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


def cat_result_size(
    graph: torch.fx.Graph,
    operands: Sequence[torch.fx.Node],
    values: Sequence[torch.Tensor],
    dim: int,
    result_shape: Sequence[Any],
) -> list[Any]:
    """The size of ``aten.cat(operands, dim)`` as a size list an FX node can take (``SymInt[]``):
    each static extent of ``result_shape`` as an int, a symbolic one as nodes inserted at
    ``graph``'s insertion point: ``aten.sym_size.int`` of the first operand on the other axes, the
    sum of the operands' ``aten.sym_size.int`` along ``dim``.

    Args:
        graph: the graph to insert the size nodes into.
        operands: the cat's tensor operands (nodes), all of the result's rank.
        values: their fake values (``meta["val"]``), in the same order.
        dim: the joined axis, non-negative.
        result_shape: the cat's result shape (ints and ``SymInt``).

    Returns:
        One entry per axis of the result: an int, or a node whose ``meta["val"]`` is the ``SymInt``.
        Used by the backends' fixes that replace a cat with no elements by a fill of its size
        (ExecuTorch, OpenVINO: GLM-5-Next's width-0 value cache).
    """

    def extent_of(index: int, axis: int) -> Any:
        extent = values[index].shape[axis]
        if isinstance(extent, int):
            return extent
        node = graph.call_function(torch.ops.aten.sym_size.int, (operands[index], axis))
        node.meta["val"] = extent
        return node

    def value(x: Any) -> Any:
        return x.meta["val"] if isinstance(x, torch.fx.Node) else x

    size: list[Any] = []
    for axis, extent in enumerate(result_shape):
        if isinstance(extent, int):
            size.append(extent)
        elif axis != dim:
            size.append(extent_of(0, axis))
        else:
            total: Any = 0
            for index in range(len(operands)):
                part = extent_of(index, axis)
                if isinstance(total, int) and isinstance(part, int):
                    total += part
                elif isinstance(total, int) and total == 0:
                    total = part
                elif not (isinstance(part, int) and part == 0):
                    summed = graph.call_function(operator.add, (total, part))
                    summed.meta["val"] = value(total) + value(part)
                    total = summed
            size.append(total)
    return size
