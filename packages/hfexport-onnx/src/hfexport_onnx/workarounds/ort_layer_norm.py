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
3-D inputs and no other consumer, so the fix inserts ``Unsqueeze(axes=[0])`` before the
normalization and ``Squeeze(axes=[0])`` after it: the normalization runs over the same last axis on
a ``[1, ...]`` view (ORT's ``Unsqueeze``/``Squeeze`` reuse the buffer), outputs are unchanged, and
ORT keeps the vectorized kernel. An ``Add`` whose sum is read elsewhere too (the residual stream of
a pre-LN decoder such as GPT-2) is not fused by ORT and is left alone.

Where it runs (:func:`apply_ort_kernel_fixes`): the export's ``ort_kernel_fixes`` stage on every
float32 graph without quantization that targets the CPU (``ort_fusions`` ``None`` or ``"cpu"``;
measured on all-MiniLM-L6-v2 8 x 64, interleaved: the plain graph at 0.85x of its time before
with 2 threads and 0.88x of its CPU time with 1, the fused one at 0.85x / 0.87x), and the
``int8-dynamic`` method on its graph. The CPU fused graph gets no offline
``SkipLayerNormalization`` either (:mod:`hfexport_onnx.fusions` runs that rewrite for CUDA only).
The simplified variant, ``SkipSimplifiedLayerNormalization`` (RMSNorm decoders, the ``genai``
layout), shares the kernel file but is not slow where it runs: one decode token of 576 channels
4.7 us fused against 4.9 us for ``Add`` + ``SimplifiedLayerNormalization``; those graphs are left
as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfexport import registry

__all__ = ["KIND", "apply_ort_kernel_fixes", "keep_layer_norm_unfused", "ort_kernel_fix_entries"]

#: Registry kind of graph rewrites around an ONNX Runtime kernel (applied by the methods naming them).
KIND = "ort_kernel_fix"

registry.register_kind(
    KIND,
    description="fix(model: onnx_ir.Model) -> int rewriting an ONNX graph around a slow ONNX Runtime kernel "
    "(run by the export's ort_kernel_fixes stage on float32 CPU graphs and by int8-dynamic; returns the "
    "number of rewrites)",
)


def ort_kernel_fix_entries() -> list[registry.RegistryEntry]:
    """Every registered ONNX Runtime kernel fix, active or not, in registration order."""
    return registry.entries("onnx", kind=KIND)


def apply_ort_kernel_fixes(model: Any) -> dict[str, int]:
    """Run the active ``ort_kernel_fix`` entries on ``model`` (an ``onnx_ir.Model``, changed in
    place) in registration order.

    Returns:
        ``{entry short name: rewrites}`` for every active entry (0 included), e.g.
        ``{"keep_layer_norm_unfused": 13}``.
    """
    return {
        entry.name.rsplit(".", 1)[-1]: int(entry.func(model))
        for entry in registry.active_entries(KIND, "onnx")
    }


def _feeds_skip_layer_norm_fusion(node: Any, graph_outputs: Any = ()) -> bool:
    """True when ``node`` is a ``LayerNormalization`` whose input is produced by an ``Add`` that
    nothing else reads (the pattern ORT's ``SkipLayerNormFusion`` starts from: an ``Add`` whose sum
    is also a graph output or feeds another node is not fused)."""
    if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    value = node.inputs[0] if node.inputs else None
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "Add" or producer.domain not in ("", "ai.onnx"):
        return False
    return len(list(value.uses())) == 1 and value not in graph_outputs


@registry.register(
    KIND,
    "onnx",
    description="wrap Add -> LayerNormalization in Unsqueeze/Squeeze so ONNX Runtime keeps its vectorized "
    "LayerNormalization kernel instead of fusing a scalar-loop SkipLayerNormalization (7x slower on CPU)",
    issue="https://github.com/microsoft/onnxruntime/blob/main/onnxruntime/contrib_ops/cpu/skip_layer_norm.cc",
    versions={"onnxruntime": ">=1.22"},  # measured on 1.32.0; the scalar loop is still in the kernel source
)
def keep_layer_norm_unfused(model: Any) -> int:
    """Give every ``LayerNormalization`` fed by an ``Add`` that nothing else reads in the main graph
    of ``model`` (an ``onnx_ir.Model``, changed in place) an ``Unsqueeze(axes=[0])`` input and a
    ``Squeeze(axes=[0])`` output, so ONNX Runtime's CPU session does not fuse it into
    ``SkipLayerNormalization``. Already wrapped normalizations (input from ``Unsqueeze``) are not
    matched again, so a second call returns 0.

    The normalization axis must be the last one (``axis=-1``, the default; a positive axis would
    shift by one and is left alone), and its optional mean / inverse standard deviation outputs
    unread. Outputs are bit-identical to the unfused ``Add`` +
    ``LayerNormalization`` pair; a graph output keeps its name.

    Returns:
        The number of normalizations wrapped.
    """
    import onnx_ir as ir

    graph = model.graph
    axes = None
    count = 0
    for node in list(graph):
        if not _feeds_skip_layer_norm_fusion(node, graph.outputs):
            continue
        axis = node.attributes.get("axis")
        if axis is not None and axis.value != -1:
            continue
        if any(o is not None and (o.uses() or o in graph.outputs) for o in node.outputs[1:]):
            continue  # its mean / inverse std outputs are read: they would keep the extra axis
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
