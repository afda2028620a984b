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

__all__ = ["concatenated_weight", "pack_sibling_matmuls"]


def _constant_tensor(value: Any) -> Any:
    """The tensor of an initializer, or of a ``Constant`` node's ``value`` attribute, or ``None``."""
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            tensor = producer.attributes["value"].as_tensor()
    return tensor


def concatenated_weight(sources: list[Any], name: str) -> Any:
    """An initializer ``name`` holding the constant 2-D weights of the values ``sources`` side by
    side (``concat(axis=1)``), computed each time it is read (``onnx_ir.LazyTensor``).

    The packed weight is never stored: the graph keeps reading its parts (the exporter's own
    weights, which the eager model shares), and whoever reads it (the quantizer, the runtime
    session's writer, the save) builds one packed tensor at a time and drops it. Storing it would
    hold a second copy of every packed projection for the rest of the export (292 MB of
    SmolLM2-135M's 538 MB).

    Args:
        sources: ``onnx_ir.Value`` objects with constant ``[K, N_i]`` weights of one dtype
            (initializers or ``Constant`` outputs).
        name: the new value's name.

    Returns:
        The ``onnx_ir.Value`` (``[K, sum(N_i)]``), for the caller to register as an initializer.

    Raises:
        ValueError: a source is not a constant.
    """
    import onnx_ir as ir

    tensors = [_constant_tensor(v) for v in sources]
    if any(t is None for t in tensors):
        raise ValueError(f"{name}: every packed weight must be a constant; got {[v.name for v in sources]}")
    rows = int(tensors[0].shape[0])
    cols = sum(int(t.shape[1]) for t in tensors)
    dtype = tensors[0].dtype

    def build() -> Any:
        return ir.tensor(np.concatenate([np.asarray(t.numpy()) for t in tensors], axis=1), name=name)

    weight = ir.Value(name=name, shape=ir.Shape([rows, cols]), type=ir.TensorType(dtype))
    weight.const_value = ir.LazyTensor(build, dtype=dtype, shape=ir.Shape([rows, cols]), name=name)
    return weight


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

    The packed weight is computed when read (:func:`concatenated_weight`); the old weights are
    left for the optimizer's removal of unused initializers (the packed one reads them).
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
        name = f"{nodes[0].inputs[1].name}_packed"
        weight = concatenated_weight([n.inputs[1] for n in nodes], name)
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
