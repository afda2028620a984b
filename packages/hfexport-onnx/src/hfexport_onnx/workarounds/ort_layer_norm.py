"""ONNX Runtime kernel fix: keep ``Add -> LayerNormalization`` out of ORT's SkipLayerNormalization fusion.

ONNX Runtime's CPU execution provider rewrites every ``Add`` feeding a ``LayerNormalization`` (the
residual connection of a post-LN transformer block, plus an optional bias ``Add``) into one
``com.microsoft.SkipLayerNormalization`` node when a session is created (``SkipLayerNormFusion``,
on at the default ``ORT_ENABLE_ALL`` level). Its CPU kernel (``contrib_ops/cpu/skip_layer_norm.cc``)
normalizes each row in a scalar loop with one division per element, while the ONNX
``LayerNormalization`` kernel it replaces is vectorized (MLAS). Measured with onnxruntime 1.32.0 on
this project's machine (one thread, a ``[8, 64, 384]`` float32 input, CPU time per run):
``SkipLayerNormalization`` 0.78 ms, ``Add`` + ``LayerNormalization`` unfused 0.11 ms. On
all-MiniLM-L6-v2 at 8 x 64 the 12 fused nodes are about a quarter of the int8 graph's CPU time.
No upstream issue was found for it; the entry points at the kernel's source.

The fusion only matches a ``LayerNormalization`` whose input comes straight from an ``Add`` with
3-D inputs, so the fix inserts ``Unsqueeze(axes=[0])`` before the normalization and
``Squeeze(axes=[0])`` after it: the normalization runs over the same last axis on a ``[1, ...]``
view (ORT's ``Unsqueeze``/``Squeeze`` reuse the buffer), outputs are unchanged, and ORT keeps the
vectorized kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfexport import registry

__all__ = ["KIND", "keep_layer_norm_unfused", "ort_kernel_fix_entries"]

#: Registry kind of graph rewrites around an ONNX Runtime kernel (applied by the methods naming them).
KIND = "ort_kernel_fix"

registry.register_kind(
    KIND,
    description="fix(model: onnx_ir.Model) -> int rewriting an ONNX graph around a slow ONNX Runtime kernel "
    "(run by the ONNX quantization methods that name it; returns the number of rewrites)",
)


def ort_kernel_fix_entries() -> list[registry.RegistryEntry]:
    """Every registered ONNX Runtime kernel fix, active or not, in registration order."""
    return registry.entries("onnx", kind=KIND)


def _feeds_skip_layer_norm_fusion(node: Any) -> bool:
    """True when ``node`` is a ``LayerNormalization`` whose input is produced by an ``Add`` (the
    pattern ORT's ``SkipLayerNormFusion`` starts from)."""
    if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    return producer is not None and producer.op_type == "Add" and producer.domain in ("", "ai.onnx")


@registry.register(
    KIND,
    "onnx",
    description="wrap Add -> LayerNormalization in Unsqueeze/Squeeze so ONNX Runtime keeps its vectorized "
    "LayerNormalization kernel instead of fusing a scalar-loop SkipLayerNormalization (7x slower on CPU)",
    issue="https://github.com/microsoft/onnxruntime/blob/main/onnxruntime/contrib_ops/cpu/skip_layer_norm.cc",
    versions={"onnxruntime": ">=1.22"},  # measured on 1.32.0; the scalar loop is still in the kernel source
)
def keep_layer_norm_unfused(model: Any) -> int:
    """Give every ``LayerNormalization`` fed by an ``Add`` in the main graph of ``model`` (an
    ``onnx_ir.Model``, changed in place) an ``Unsqueeze(axes=[0])`` input and a ``Squeeze(axes=[0])``
    output, so ONNX Runtime's CPU session does not fuse it into ``SkipLayerNormalization``.

    The normalization axis must be the last one (``axis=-1``, the default; a positive axis would
    shift by one and is left alone). Outputs are bit-identical to the unfused ``Add`` +
    ``LayerNormalization`` pair; a graph output keeps its name.

    Returns:
        The number of normalizations wrapped.
    """
    import onnx_ir as ir

    graph = model.graph
    axes = None
    count = 0
    for node in list(graph):
        if not _feeds_skip_layer_norm_fusion(node):
            continue
        axis = node.attributes.get("axis")
        if axis is not None and axis.value != -1:
            continue
        if axes is None:
            name = "ort_layer_norm_unfused_axes"
            axes = ir.Value(name=name, const_value=ir.tensor(np.array([0], dtype=np.int64), name=name))
            axes.shape, axes.dtype = ir.Shape([1]), ir.DataType.INT64
            graph.register_initializer(axes)
        x, y = node.inputs[0], node.outputs[0]
        unsqueeze = ir.Node("", "Unsqueeze", inputs=[x, axes], name=f"{node.name}_unfused_in")
        if x.dtype is not None:
            unsqueeze.outputs[0].dtype = x.dtype
        graph.insert_before(node, [unsqueeze])
        node.replace_input_with(0, unsqueeze.outputs[0])
        uses, is_output = list(y.uses()), y in graph.outputs
        squeeze = ir.Node("", "Squeeze", inputs=[y, axes], name=f"{node.name}_unfused_out")
        result = squeeze.outputs[0]
        if y.dtype is not None:
            result.dtype = y.dtype
        result.shape = y.shape
        y.shape = None
        for new in (unsqueeze, squeeze):
            new.metadata_props.update(node.metadata_props)
        graph.insert_after(node, [squeeze])
        for user, index in uses:
            user.replace_input_with(index, result)
        if is_output:
            graph.outputs[graph.outputs.index(y)] = result
            name = y.name
            y.name = f"{name}_unsqueezed"
            result.name = name
        count += 1
    return count
