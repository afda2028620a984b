"""ONNX IR fix: transpose the attention key of a rank-4 SDPA with one static ``Transpose``.

onnxscript's torchlib translates ``scaled_dot_product_attention`` for keys of any rank: it swaps
the last two axes of ``key`` as ``Reshape(key, [-1, S, D]) -> Transpose(perm=[0, 2, 1]) ->
Reshape([*batch, D, S])``, the shapes computed at run time from ``Shape(key)`` slices. For the
usual rank-4 ``[batch, heads, S, D]`` key that is one ``Transpose(perm=[0, 1, 3, 2])``, but ONNX
Runtime sees a ``Transpose`` between two ``Reshape``s: it cannot merge it with the key's own
``[0, 2, 1, 3]`` transpose before it, nor fold it into the score ``MatMul`` (``FusedMatMul`` with
``transB``), so every layer pays one more copy of the key. This fix replaces the chain with the
static transpose when the key's rank is known to be 4 and the reshapes are exactly torchlib's
(the shape slices checked), so the values are the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfexport_onnx.workarounds.ir_fixes import register_ir_fix
from hfexport_onnx.workarounds.sdpa_nan_guard import _constant

__all__ = ["static_key_transpose"]

_MAX = np.iinfo(np.int64).max
_MIN = np.iinfo(np.int64).min


def _producer(value: Any, op_type: str) -> Any:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _ints(value: Any) -> list[int] | None:
    """The integers of a constant ``value`` (initializer, ``Constant`` with ``value`` /
    ``value_ints`` / ``value_int``), else None."""
    array = _constant(value)
    if array is not None:
        return [int(v) for v in np.asarray(array).reshape(-1)]
    node = _producer(value, "Constant")
    if node is not None:
        for name in ("value_ints", "value_int"):
            attr = node.attributes.get(name)
            if attr is not None:
                return [int(v) for v in np.asarray(attr.value).reshape(-1)]
    return None


def _is_shape_slice(value: Any, key: Any, start: int, end: int) -> bool:
    """``value`` is ``Slice(Shape(key), [start], [end])`` (``end`` ``_MAX`` / ``start`` ``_MIN`` =
    open; any value at least the rank counts as open)."""
    node = _producer(value, "Slice")
    if node is None or len(node.inputs) not in (3, 4, 5):
        return False
    if len(node.inputs) > 3 and any(v is not None for v in node.inputs[3:]):
        axes_steps = [_ints(v) for v in node.inputs[3:] if v is not None]
        if any(a is None or a not in ([0], [1]) for a in axes_steps):
            return False
    shape = _producer(node.inputs[0], "Shape")
    if shape is None or shape.inputs[0] is not key or "end" in shape.attributes:
        return False
    if shape.attributes.get("start") is not None and shape.attributes["start"].value != 0:
        return False
    starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])

    def same(got: list[int] | None, want: int) -> bool:
        if got is None or len(got) != 1:
            return False
        if want == _MAX:
            return got[0] >= 4
        if want == _MIN:
            return got[0] <= -4 or got[0] == 0
        return got[0] == want

    return same(starts, start) and same(ends, end)


def _concat_parts(value: Any) -> list[Any] | None:
    node = _producer(value, "Concat")
    if node is None or len(node.inputs) != 3:
        return None
    axis = node.attributes.get("axis")
    return list(node.inputs) if axis is not None and axis.value == 0 else None


def _key_of(reshape_back: Any) -> Any:
    """The rank-4 key when ``reshape_back`` ends torchlib's key transposition, else None."""
    if reshape_back.op_type != "Reshape" or reshape_back.domain not in ("", "ai.onnx"):
        return None
    transpose = _producer(reshape_back.inputs[0], "Transpose")
    if transpose is None or list(transpose.attributes["perm"].value) != [0, 2, 1]:
        return None
    squeeze = _producer(transpose.inputs[0], "Reshape")
    if squeeze is None:
        return None
    key = squeeze.inputs[0]
    if key is None or key.shape is None or len(key.shape) != 4:
        return None
    first, back = _concat_parts(squeeze.inputs[1]), _concat_parts(reshape_back.inputs[1])
    if first is None or back is None or _ints(first[0]) != [-1]:
        return None
    ok = (
        _is_shape_slice(first[1], key, -2, -1)
        and _is_shape_slice(first[2], key, -1, _MAX)
        and _is_shape_slice(back[0], key, _MIN, -2)
        and _is_shape_slice(back[1], key, -1, _MAX)
        and _is_shape_slice(back[2], key, -2, -1)
    )
    return key if ok else None


@register_ir_fix(
    description="torchlib SDPA swaps the key's last two axes through Reshape -> Transpose -> Reshape "
    "(any rank); for a rank-4 key use one static Transpose(perm=[0, 1, 3, 2]) that ONNX Runtime "
    "merges with the key's head transpose and folds into the score MatMul",
    issue="https://github.com/microsoft/onnxscript/blob/main/onnxscript/function_libs/torch_lib/ops/nn.py",
    versions={"onnxscript": ">=0.5"},  # the rank-generic form is still emitted by onnxscript 0.7.2
)
def static_key_transpose(model: Any) -> bool:
    """Replace torchlib's run-time-shaped key transposition in the main graph of ``model`` (an
    ``onnx_ir.Model``, changed in place) by ``Transpose(key, perm=[0, 1, 3, 2])`` for each key of
    known rank 4; the dead shape nodes are left to the optimizer.

    Returns:
        True when at least one key transposition was replaced.
    """
    import onnx_ir as ir

    graph = model.graph
    replaced = 0
    for node in list(graph):
        key = _key_of(node)
        if key is None:
            continue
        transpose = ir.Node(
            "",
            "Transpose",
            [key],
            attributes=[ir.AttrInt64s("perm", [0, 1, 3, 2])],
            name=f"{node.name}_static",
        )
        transpose.metadata_props.update(node.metadata_props)
        out = transpose.outputs[0]
        out.dtype = node.outputs[0].dtype
        if key.shape is not None:
            dims = list(key.shape)
            out.shape = ir.Shape([dims[0], dims[1], dims[3], dims[2]])
        graph.insert_before(node, [transpose])
        node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        replaced += 1
    if replaced:
        # drop the old chains (Reshape -> Transpose -> Reshape and their shape arithmetic) now unused
        for node in reversed(list(graph)):
            unused = node.outputs and all(not o.uses() and o not in graph.outputs for o in node.outputs)
            if unused and node.op_type in ("Reshape", "Transpose", "Concat", "Slice", "Shape", "Constant"):
                graph.remove(node, safe=True)
    return replaced > 0
