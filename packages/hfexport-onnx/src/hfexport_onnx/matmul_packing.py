"""Pack sibling MatMuls (one input, several constant weights) into one MatMul and a Split.

A llama MLP projects the same hidden state twice (``gate_proj`` and ``up_proj``); at decode time
(one token) each projection is a matrix-vector product whose cost is reading its weights, plus a
fixed cost per kernel launch. One ``MatMul`` over the concatenated weights reads the same bytes in
one launch, and ``Split`` hands each consumer its slice. The result is bit-identical: every output
column is the same dot product as before.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

__all__ = ["pack_sibling_matmuls"]


def _weight(node: Any) -> np.ndarray | None:
    value = node.inputs[1]
    if value is None or value.const_value is None or len(value.uses()) != 1:
        return None
    array = np.asarray(value.const_value.numpy())
    return array if array.ndim == 2 else None


def pack_sibling_matmuls(model: Any) -> int:
    """Replace groups of ``MatMul(x, W_i)`` sharing ``x`` (constant 2-D ``W_i`` of one dtype and row
    count, each used once) by ``Split(MatMul(x, concat(W_i, axis=1)))``, in place.

    Args:
        model: an ``onnx_ir.Model``; only the main graph is rewritten.

    Returns:
        The number of MatMuls removed (a group of ``n`` counts ``n - 1``).

    The old weights are left for the optimizer's removal of unused initializers.
    """
    import onnx_ir as ir

    graph = model.graph
    groups: dict[int, list[Any]] = collections.defaultdict(list)
    for node in graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and _weight(node) is not None:
            groups[id(node.inputs[0])].append(node)
    removed = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        weights = [_weight(n) for n in nodes]
        if len({(w.shape[0], w.dtype) for w in weights}) != 1:
            continue
        packed = np.concatenate(weights, axis=1)
        name = f"{nodes[0].inputs[1].name}_packed"
        weight = ir.Value(
            name=name, shape=ir.Shape(packed.shape), type=ir.TensorType(ir.DataType.from_numpy(packed.dtype))
        )
        weight.const_value = ir.tensor(packed, name=name)
        graph.register_initializer(weight)
        sizes = ir.Value(
            name=f"{name}_sizes", shape=ir.Shape([len(weights)]), type=ir.TensorType(ir.DataType.INT64)
        )
        sizes.const_value = ir.tensor(
            np.asarray([w.shape[1] for w in weights], dtype=np.int64), name=sizes.name
        )
        graph.register_initializer(sizes)
        matmul = ir.Node("", "MatMul", [nodes[0].inputs[0], weight])
        split = ir.Node(
            "",
            "Split",
            [matmul.outputs[0], sizes],
            attributes=[ir.AttrInt64("axis", -1)],
            num_outputs=len(nodes),
        )
        graph.insert_before(nodes[0], [matmul, split])
        for old, new in zip(nodes, split.outputs):
            new.shape, new.type = old.outputs[0].shape, old.outputs[0].type
            old.outputs[0].replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(nodes, safe=True)
        removed += len(nodes) - 1
    if removed:
        graph.sort()
    return removed
