"""ONNX Runtime quantization of an exported graph (``OnnxConfig.quantization``).

Methods (:data:`QUANTIZATION_METHODS`):

- ``int8-dynamic``: ``onnxruntime.quantization.quantize_dynamic``: int8 weights (per output channel
  unless ``per_channel=False``), activations quantized at run time (``DynamicQuantizeLinear`` +
  ``MatMulInteger``); the word embedding ``Gather`` is quantized too. Every constant-weight MatMul
  is quantized; the few outlier channels of each GELU feed-forward block (found on the sample
  inputs) run in a float side path (:func:`split_outlier_channels`), and ``Add -> LayerNormalization``
  is kept out of ONNX Runtime's slow ``SkipLayerNormalization`` fusion
  (:mod:`hfexport_onnx.workarounds.ort_layer_norm`). With ``quantization.exclude``, exactly the named
  modules stay float; without sample inputs the first two FFN down-projections do
  (:func:`sensitive_ffn_nodes`).
- ``int8-static``: ``quantize_static`` in QDQ format, MatMuls with constant weights only, activation
  ranges calibrated (MinMax) on :func:`hfexport.calibration.calibration_inputs`; without
  ``quantization.exclude`` every FFN down-projection stays float.
- ``int4-weight``: ``MatMulNBitsQuantizer``: 4-bit block-quantized MatMul weights
  (``com.microsoft.MatMulNBits``), ``group_size`` elements per block (default 32), symmetric unless
  ``symmetric=False``, ``accuracy_level`` 4 (int8 compute) unless set: the recipe of ONNX Runtime
  GenAI's model builder (``-p int4``); without ``quantization.exclude`` the FFN up-projections of
  GELU models get 8-bit blocks (:func:`ffn_up_nodes`); the word embedding is int8.
- ``int8-weight``: the same with 8-bit blocks everywhere (weight-only int8 for LLM decode).

``int4-weight`` and ``int8-weight`` also quantize a float16 graph (``config.dtype="float16"``,
:data:`FLOAT16_QUANTIZATION_METHODS`): ``MatMulNBits`` then takes float16 activations and scales,
a tied embedding is gathered with float16 scales and an untied one is int8 with a float16 scale
(transformers.js's ``q4f16``, :mod:`hfexport_onnx.layouts.transformers_js`). The int8 methods
quantize float32 graphs only.

``quantization.exclude`` names modules (``fnmatch`` patterns over module paths such as
``encoder.layer.*.output.dense`` or ``lm_head``): the nodes the torch exporter recorded under those
modules (``pkg.torch.onnx.name_scopes`` metadata) stay in float.
"""

from __future__ import annotations

import ast
import collections
import fnmatch
import functools
import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hfexport.config import QuantizationMethod
from hfexport.quantization import QuantizationRequest, QuantizationResult

__all__ = [
    "ACCURACY_LEVEL",
    "FLOAT16_QUANTIZATION_METHODS",
    "INT4_BLOCK_SIZE",
    "INT4_BLOCK_SIZES",
    "QUANTIZATION_METHODS",
    "QUANTIZED_OP_TYPES",
    "activation_matmuls",
    "apply_int4_weight",
    "apply_int8_dynamic",
    "apply_int8_static",
    "apply_int8_weight",
    "excluded_nodes",
    "ffn_up_nodes",
    "int8_weight_only",
    "lm_head_nodes",
    "matmul_nbits_in_place",
    "quantize_embeddings",
    "quantize_ir_model",
    "quantized_op_counts",
    "sensitive_ffn_nodes",
    "share_tied_embedding",
    "smooth_activations",
    "split_outlier_channels",
    "split_packed_nbits",
    "tied_embedding",
]

logger = logging.getLogger(__name__)

#: method name -> what it does and the ``QuantizationConfig`` options it reads
#: (``OnnxExporter.quantization_methods``; any other option is refused before capture)
QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {
    "int8-dynamic": QuantizationMethod(
        "ONNX Runtime quantize_dynamic: int8 per-channel weights, dynamic int8 activations "
        "(MatMulInteger), GELU outlier channels in a float side path, int8 word embeddings",
        options=frozenset({"per_channel", "exclude"}),
        phase="artifact",
        apply="hfexport_onnx.quantize:apply_int8_dynamic",
    ),
    "int8-static": QuantizationMethod(
        "ONNX Runtime quantize_static: QDQ int8 MatMuls with smoothed activations, ranges calibrated on "
        "prompts or sample inputs, int8 word embedding",
        options=frozenset({"per_channel", "exclude", "calibration", "num_calibration_samples"}),
        phase="artifact",
        apply="hfexport_onnx.quantize:apply_int8_static",
    ),
    "int4-weight": QuantizationMethod(
        "ONNX Runtime MatMulNBits: 4-bit block-quantized MatMul weights (group_size, default 32; "
        "symmetric by default; accuracy_level default 4 = int8 compute), GELU FFN up-projections and "
        "the LM head 8-bit (embedding_bits=4: 4-bit), a tied word embedding gathered from the head's "
        "blocks (GatherBlockQuantized), an untied one int8",
        options=frozenset({"group_size", "exclude", "symmetric", "accuracy_level", "embedding_bits"}),
        phase="artifact",
        apply="hfexport_onnx.quantize:apply_int4_weight",
    ),
    "int8-weight": QuantizationMethod(
        "ONNX Runtime MatMulNBits: 8-bit block-quantized MatMul weights (group_size, default 32; "
        "symmetric by default; accuracy_level default 4 = int8 compute), a tied word embedding gathered "
        "from the head's blocks (GatherBlockQuantized), an untied one int8",
        options=frozenset({"group_size", "exclude", "symmetric", "accuracy_level"}),
        phase="artifact",
        apply="hfexport_onnx.quantize:apply_int8_weight",
    ),
}

#: the methods that also quantize a float16 graph (``config.dtype="float16"``): ``MatMulNBits`` has
#: float16 activations and scales (``T``), the 4-bit case being transformers.js's ``q4f16``; ONNX
#: Runtime 1.32's CPU provider registers a float16 ``MatMulNBits`` kernel that converts the
#: activations and scales to float32 around its float32 kernel on x86-64. The int8 methods emit
#: float32-only ops (``DynamicQuantizeLinear``, float32 scales) and need a float32 graph.
FLOAT16_QUANTIZATION_METHODS = ("int4-weight", "int8-weight")

#: op types that show a quantized graph, counted in the report
QUANTIZED_OP_TYPES = (
    "MatMulInteger",
    "DynamicQuantizeLinear",
    "QuantizeLinear",
    "DequantizeLinear",
    "MatMulNBits",
    "QAttention",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QGemm",
)

_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def _scopes(node: Any) -> list[str]:
    raw = node.metadata_props.get(_SCOPES_KEY) if hasattr(node, "metadata_props") else None
    if not raw:
        return []
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    return [s for s in scopes[:-1] if isinstance(s, str) and s]


def excluded_nodes(model: Any, patterns: Sequence[str]) -> list[str]:
    """Names of the nodes of ``model`` (``onnx_ir.Model``) recorded under a module matching ``patterns``.

    Raises:
        ValueError: a pattern matches no node (a typo would otherwise quantize everything silently).
    """
    if not patterns:
        return []
    found: list[str] = []
    hits = dict.fromkeys(patterns, 0)
    for node in model.graph.all_nodes():
        scopes = _scopes(node)
        matched = [p for p in patterns if any(fnmatch.fnmatchcase(s, p) for s in scopes)]
        for p in matched:
            hits[p] += 1
        if matched and node.name:
            found.append(node.name)
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        raise ValueError(
            f"quantization.exclude pattern(s) {missing} match no module of the exported graph; allowed: module "
            "paths such as 'encoder.layer.*.output.dense' or 'lm_head' (fnmatch patterns)"
        )
    return found


_GELU_OPS = ("Gelu", "FastGelu", "BiasGelu", "QuickGelu")


def _is_gelu_output(value: Any, depth: int = 3) -> bool:
    """True when ``value`` is a GELU's output: a GELU op, or a ``Mul`` with an ``Erf``/``Tanh``
    within ``depth`` producers (the decomposed erf/tanh GELU)."""
    node = value.producer() if value is not None else None
    if node is None:
        return False
    if node.op_type in _GELU_OPS:
        return True
    if node.op_type != "Mul":
        return False
    frontier, seen = [node], 0
    while frontier and seen < depth:
        nxt = []
        for n in frontier:
            for v in n.inputs:
                producer = v.producer() if v is not None else None
                if producer is None:
                    continue
                if producer.op_type in ("Erf", "Tanh"):
                    return True
                nxt.append(producer)
        frontier, seen = nxt, seen + 1
    return False


#: how many FFN down-projections (from the input side) ``int8-dynamic`` keeps in float by default
SENSITIVE_FFN_LAYERS = 2


def sensitive_ffn_nodes(model: Any, count: int = SENSITIVE_FFN_LAYERS) -> list[str]:
    """The first ``count`` MatMuls (graph order) whose activation input is a GELU output: the FFN
    down-projections of the first blocks, whose heavy-tailed inputs suffer most from per-tensor
    dynamic uint8 activations (on all-MiniLM-L6-v2 keeping two of them in float lifts the mean
    per-token cosine from 0.986 to 0.991 on random tokens at +1.5 MB)."""
    found = []
    for node in model.graph.all_nodes():
        if node.op_type == "MatMul" and node.name and _is_gelu_output(node.inputs[0]):
            found.append(node.name)
            if len(found) >= count:
                break
    return found


#: a GELU output channel is an outlier when its max |x| over the sample exceeds this many times the
#: 99th percentile of the layer's per-channel maxima (all-MiniLM-L6-v2: 24.5 / 20.4 / 17.5 and
#: 14.6 / 13.7 against 99th percentiles of 2.5-3.2 in blocks 0-3; blocks 4-5 have none)
OUTLIER_RATIO = 4.0
#: at most this many outlier channels per FFN down-projection are split off
OUTLIER_MAX_CHANNELS = 8


def _gelu_ffn(down: Any) -> tuple[Any, Any, Any, Any] | None:
    """``(gelu, bias_add, up, bias)`` when the activation of the ``MatMul`` ``down`` is
    ``Gelu(Add(MatMul(a, W1), b1))`` (``bias_add`` the ``Add``) or ``BiasGelu``/``FastGelu(MatMul(a, W1), b1)``
    (``bias_add`` None) with constant ``W1`` (2-D) and ``b1`` (1-D), else None."""
    x = down.inputs[0]
    gelu = x.producer() if x is not None else None
    if gelu is None or len(x.uses()) != 1:
        return None
    if gelu.op_type == "Gelu" and gelu.domain in ("", "ai.onnx"):
        add = gelu.inputs[0].producer() if gelu.inputs[0] is not None else None
        if add is None or add.op_type != "Add" or len(gelu.inputs[0].uses()) != 1:
            return None
        for value, bias in (add.inputs, add.inputs[::-1]):
            up = value.producer() if value is not None else None
            if (
                up is not None
                and up.op_type == "MatMul"
                and bias is not None
                and bias.const_value is not None
            ):
                break
        else:
            return None
    elif gelu.op_type in ("BiasGelu", "FastGelu") and gelu.domain == "com.microsoft" and len(gelu.inputs) > 1:
        add, bias = None, gelu.inputs[1]
        up = gelu.inputs[0].producer() if gelu.inputs[0] is not None else None
        if up is None or up.op_type != "MatMul" or bias is None or bias.const_value is None:
            return None
    else:
        return None
    weight = up.inputs[1]
    if weight is None or weight.const_value is None or len(weight.shape) != 2 or len(bias.shape) != 1:
        return None
    if len(up.outputs[0].uses()) != 1:
        return None
    return gelu, add, up, bias


def split_outlier_channels(
    model: Any,
    feeds: list[dict[str, np.ndarray]],
    *,
    exclude: Sequence[str] = (),
    ratio: float = OUTLIER_RATIO,
    max_channels: int = OUTLIER_MAX_CHANNELS,
) -> tuple[dict[str, list[int]], list[str]]:
    """Compute the few outlier channels of each GELU feed-forward block in float, beside the block,
    so dynamic int8 quantization of the rest sees a narrow activation range.

    Dynamic ``int8-dynamic`` gives the whole GELU output ``x = GELU(a @ W1 + b1)`` (``[..., k]``) one
    uint8 scale per run. In all-MiniLM-L6-v2's first four blocks one or two of the 1536 channels reach
    14-24 while the 99th percentile of the per-channel maxima is 2.5-3.2, so those channels alone set
    the scale and the rest of ``x`` keeps 2-3 significant bits; the down-projection then costs more
    accuracy than every other MatMul together. The outlier channels are the same on real and random
    tokens, so the sample inputs find them.

    For every ``MatMul(x, W2)`` whose ``x`` is such a GELU output (:func:`_gelu_ffn`) and not in
    ``exclude``, channels ``C`` with ``max|x_c| > ratio * percentile99`` over ``feeds`` (at most
    ``max_channels``, largest first) are moved out: ``W1[:, C]``, ``b1[C]`` and ``W2[C, :]`` become 0
    in the main path (``GELU(0) = 0``, so ``x_C`` is exactly 0 there: no extra pass over ``x``), and a
    float side path ``GELU(a @ W1[:, C] + b1[C]) @ W2[C, :]`` (``[..., |C|]`` wide) is added to the
    down-projection's output. The result equals the original graph in exact arithmetic.

    Args:
        model: the float graph (``onnx_ir.Model``), changed in place.
        feeds: ORT feeds ``{graph input name: ndarray}`` to measure the channel maxima on.
        exclude: node names left alone (``quantization.exclude`` matches).
        ratio: outlier threshold, in multiples of the 99th percentile of the per-channel maxima.
        max_channels: at most this many channels per down-projection.

    Returns:
        ``({down-projection name: outlier channels}, names of the side-path MatMuls)``; the side
        MatMuls must stay float (pass them to the quantizer's ``nodes_to_exclude``).
    """
    import onnx_ir as ir

    skip = set(exclude)
    downs = []
    for node in model.graph.all_nodes():
        if node.op_type != "MatMul" or not node.name or node.name in skip:
            continue
        weight = node.inputs[1]
        if weight is None or weight.const_value is None or len(weight.shape) != 2:
            continue
        chain = _gelu_ffn(node)
        if chain is not None and chain[2].name not in skip:
            downs.append((node, chain))
    if not downs or not feeds:
        return {}, []
    absmax = _channel_absmax(model, [down.inputs[0].name for down, _ in downs], feeds)
    graph = model.graph
    split: dict[str, list[int]] = {}
    side: list[str] = []
    for down, (gelu, add, up, bias) in downs:
        maxima = absmax[down.inputs[0].name]
        threshold = ratio * float(np.percentile(maxima, 99))
        channels = sorted(int(c) for c in np.argsort(maxima)[::-1][:max_channels] if maxima[c] > threshold)
        if not channels:
            continue
        w1, b1 = up.inputs[1].const_value.numpy(), bias.const_value.numpy()
        w2 = down.inputs[1].const_value.numpy()
        inliers = [w1.copy(), b1.copy(), w2.copy()]
        inliers[0][:, channels], inliers[1][channels], inliers[2][channels, :] = 0, 0, 0
        base = down.name
        old = [up.inputs[1], bias, down.inputs[1]]
        up.replace_input_with(1, _initializer(graph, f"{base}_up_weight_inliers", inliers[0]))
        bias_user = gelu if add is None else add
        bias_user.replace_input_with(
            list(bias_user.inputs).index(bias), _initializer(graph, f"{base}_up_bias_inliers", inliers[1])
        )
        down.replace_input_with(1, _initializer(graph, f"{base}_down_weight_inliers", inliers[2]))
        side_up = ir.Node(
            "",
            "MatMul",
            inputs=[up.inputs[0], _initializer(graph, f"{base}_up_weight_outliers", w1[:, channels].copy())],
            name=f"{base}_outliers_up",
        )
        side_bias = _initializer(graph, f"{base}_up_bias_outliers", b1[channels].copy())
        attributes = list(gelu.attributes.values())
        if add is None:
            side_gelu = ir.Node(
                gelu.domain,
                gelu.op_type,
                inputs=[side_up.outputs[0], side_bias],
                attributes=attributes,
                name=f"{base}_outliers_gelu",
            )
            nodes = [side_up, side_gelu]
        else:
            side_add = ir.Node(
                "", "Add", inputs=[side_up.outputs[0], side_bias], name=f"{base}_outliers_bias"
            )
            side_gelu = ir.Node(
                gelu.domain,
                gelu.op_type,
                inputs=[side_add.outputs[0]],
                attributes=attributes,
                name=f"{base}_outliers_gelu",
            )
            nodes = [side_up, side_add, side_gelu]
        side_down = ir.Node(
            "",
            "MatMul",
            inputs=[
                side_gelu.outputs[0],
                _initializer(graph, f"{base}_down_weight_outliers", w2[channels, :].copy()),
            ],
            name=f"{base}_outliers_down",
        )
        y = down.outputs[0]
        uses, is_output = list(y.uses()), y in graph.outputs
        total = ir.Node("", "Add", inputs=[y, side_down.outputs[0]], name=f"{base}_outliers_add")
        nodes += [side_down, total]
        for new in nodes:
            new.metadata_props.update(down.metadata_props)
            if y.dtype is not None:
                new.outputs[0].dtype = y.dtype
        total.outputs[0].shape = y.shape
        graph.insert_after(down, nodes)
        for user, index in uses:
            user.replace_input_with(index, total.outputs[0])
        if is_output:
            graph.outputs[graph.outputs.index(y)] = total.outputs[0]
            name = y.name
            y.name = f"{name}_inliers"
            total.outputs[0].name = name
        for value in old:
            if not value.uses() and value.name in graph.initializers:
                graph.initializers.pop(value.name)
        split[base] = channels
        side += [side_up.name, side_down.name]
    return split, side


def activation_matmuls(model: Any) -> list[str]:
    """Names of the ``MatMul`` nodes of ``model`` (``onnx_ir.Model``) whose second input is not a
    constant: the attention score ``Q @ K^T`` and context ``softmax @ V`` products. Static QDQ keeps
    them float by naming them in ``nodes_to_exclude``: with onnxruntime 1.32's QDQ format,
    ``quantize_static`` wrapped their inputs in Q/DQ pairs although ``MatMulConstBOnly`` was set
    (observed here; no upstream issue found), and uint8 softmax probabilities cost
    all-MiniLM-L6-v2 most of its accuracy."""
    return [
        node.name
        for node in model.graph.all_nodes()
        if node.op_type == "MatMul"
        and node.name
        and (len(node.inputs) < 2 or node.inputs[1] is None or node.inputs[1].const_value is None)
    ]


#: a constant ``Gather`` table with at least this many rows is a token embedding (quantized to int8)
MIN_EMBEDDING_ROWS = 1024


def quantize_embeddings(model: Any, exclude: Sequence[str] = ()) -> list[str]:
    """Store each token-embedding table of ``model`` (``onnx_ir.Model``, changed in place) in int8.

    A token embedding is a ``Gather`` on axis 0 of a constant float32 or float16 ``[rows, dim]``
    table with at least :data:`MIN_EMBEDDING_ROWS` rows (position and token-type tables stay
    float; a float16 table only in a graph of default-domain opset >= 19, where
    ``DequantizeLinear`` takes a float16 scale). The table becomes int8 with one symmetric
    per-tensor scale (``max |w| / 127``, in the table's dtype); the graph gathers the int8
    rows and dequantizes only those (``Gather -> DequantizeLinear``), so the whole table is never
    dequantized at run time. On all-MiniLM-L6-v2 the 46.9 MB word table becomes 11.7 MB at a mean
    per-token cosine of 0.9997 (min 0.9993) on its own.

    Args:
        model: the graph to rewrite.
        exclude: node names to leave alone (``quantization.exclude`` matches).

    Returns:
        The names of the rewritten ``Gather`` nodes.
    """
    import onnx_ir as ir

    done: list[str] = []
    skip = set(exclude)
    graph = model.graph
    float_types = {ir.DataType.FLOAT}
    if model.opset_imports.get("", 0) >= 19:  # DequantizeLinear-19: float16 scales
        float_types.add(ir.DataType.FLOAT16)
    for node in list(graph):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.name in skip:
            continue
        table = node.inputs[0]
        if table is None or table.const_value is None or table.dtype not in float_types:
            continue
        axis = node.attributes.get("axis")
        if (axis.value if axis is not None else 0) != 0:
            continue
        weights = table.const_value.numpy()
        if weights.ndim != 2 or weights.shape[0] < MIN_EMBEDDING_ROWS:
            continue
        scale = np.float32(max(float(np.abs(weights.astype(np.float32)).max()), 1e-12) / 127.0)
        quantized = np.clip(np.rint(weights.astype(np.float32) / scale), -127, 127).astype(np.int8)
        q_table = _initializer(graph, f"{table.name}_int8", quantized)
        q_scale = _initializer(graph, f"{table.name}_scale", np.asarray(scale, dtype=weights.dtype))
        gather = ir.Node(
            "",
            "Gather",
            inputs=[q_table, node.inputs[1]],
            attributes=[ir.AttrInt64("axis", 0)],
            name=node.name,
        )
        dequantize = ir.Node(
            "", "DequantizeLinear", inputs=[gather.outputs[0], q_scale], name=f"{node.name}_dq"
        )
        for new in (gather, dequantize):
            new.metadata_props.update(node.metadata_props)
        old = node.outputs[0]
        result = dequantize.outputs[0]
        result.shape, result.dtype = old.shape, old.dtype
        graph.insert_before(node, [gather, dequantize])
        ir.convenience.replace_all_uses_with(old, result)
        if old in graph.outputs:
            graph.outputs[graph.outputs.index(old)] = result
        graph.remove(node, safe=True)
        if not table.uses():
            graph.initializers.pop(table.name, None)
        done.append(node.name)
    return done


def _initializer(graph: Any, name: str, array: np.ndarray) -> Any:
    import onnx_ir as ir

    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.shape = ir.Shape(array.shape)
    value.dtype = value.const_value.dtype
    graph.register_initializer(value)
    return value


def int8_weight_only(model: Any, nodes: Sequence[str]) -> list[str]:
    """Store the constant ``[k, n]`` weights of the ``MatMul`` nodes ``nodes`` of ``model``
    (``onnx_ir.Model``, changed in place) as int8 with one symmetric scale per output column,
    dequantized in the graph (``DequantizeLinear(axis=1) -> MatMul``); the activation stays float.
    ``int8-static`` uses it for the MatMuls it keeps out of QDQ (the early FFN down-projections):
    on all-MiniLM-L6-v2 it costs no measurable cosine and 3.5 MB less than float weights.

    Returns:
        The names of the rewritten MatMuls.
    """
    import onnx_ir as ir

    wanted = set(nodes)
    done = []
    graph = model.graph
    for node in list(graph.all_nodes()):
        if node.op_type != "MatMul" or node.name not in wanted or node.inputs[1] is None:
            continue
        weight = node.inputs[1]
        if weight.const_value is None or weight.dtype != ir.DataType.FLOAT or len(weight.shape) != 2:
            continue
        array = weight.const_value.numpy()
        scale = (np.maximum(np.abs(array).max(axis=0), 1e-12) / 127.0).astype(np.float32)
        quantized = np.clip(np.rint(array / scale), -127, 127).astype(np.int8)
        q_weight = _initializer(graph, f"{weight.name}_int8", quantized)
        q_scale = _initializer(graph, f"{weight.name}_scale", scale)
        dequantize = ir.Node(
            "",
            "DequantizeLinear",
            inputs=[q_weight, q_scale],
            attributes=[ir.AttrInt64("axis", 1)],
            name=f"{node.name}_weight_dq",
        )
        dequantize.outputs[0].shape, dequantize.outputs[0].dtype = weight.shape, weight.dtype
        graph.insert_before(node, [dequantize])
        node.replace_input_with(1, dequantize.outputs[0])
        if not weight.uses():
            graph.initializers.pop(weight.name, None)
        done.append(node.name)
    return done


def _channel_absmax(
    model: Any, names: Sequence[str], feeds: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """``{value name: max |x| per last-axis channel}`` of the float values ``names`` of ``model``
    (``onnx_ir.Model``, not changed) over ``feeds``, run in ONNX Runtime without graph optimizations."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="hfexport-stats-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        proto = onnx.load(str(path), load_external_data=False)
        known = {o.name for o in proto.graph.output}
        for name in (n for n in names if n not in known):
            proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        stats_path = Path(tmp) / "stats.onnx"
        onnx.save(proto, str(stats_path))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(stats_path), options, providers=["CPUExecutionProvider"])
        absmax: dict[str, np.ndarray] = {}
        for feed in feeds:
            for name, value in zip(names, session.run(list(names), feed), strict=True):
                channel = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
                absmax[name] = channel if name not in absmax else np.maximum(absmax[name], channel)
        del session
    return absmax


#: SmoothQuant migration strength: ``s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)``
SMOOTHING_ALPHA = 0.5


def smooth_activations(
    model: Any,
    feeds: list[dict[str, np.ndarray]],
    nodes: Sequence[str],
    *,
    alpha: float = SMOOTHING_ALPHA,
) -> int:
    """SmoothQuant-style per-channel smoothing of the float activations feeding ``nodes``
    (constant-weight ``MatMul`` names) of ``model`` (``onnx_ir.Model``, changed in place).

    Static int8 gives a whole activation tensor one scale; a transformer's LayerNorm outputs carry a
    few channels tens of times larger than the rest, which then take all of the uint8 range. For each
    activation ``x`` (``[..., k]``) feeding the MatMuls, ``s_j = max|x_j|^alpha / max_i|W_ji|^(1-alpha)``
    (maxima over ``feeds`` and over every MatMul sharing ``x``); the graph computes
    ``(x * (1/s)) @ (diag(s) W)``, the same product in exact arithmetic, through one ``Mul`` that only
    those MatMuls read (residual and other readers keep ``x``). Calibration then sees flattened
    activations.

    Args:
        model: the float graph.
        feeds: calibration feeds, ``{graph input name: ndarray}``.
        nodes: the MatMuls that will be quantized.
        alpha: migration strength in ``[0, 1]``.

    Returns:
        The number of activations smoothed (one ``Mul`` each).
    """
    import onnx_ir as ir

    wanted = set(nodes)
    groups: dict[str, list[Any]] = {}
    for node in model.graph.all_nodes():
        if node.op_type == "MatMul" and node.name in wanted and node.inputs[1].const_value is not None:
            weight = node.inputs[1].const_value
            if len(weight.shape) == 2 and node.inputs[0] is not None and node.inputs[0].name:
                groups.setdefault(node.inputs[0].name, []).append(node)
    if not groups or not feeds:
        return 0
    absmax = _channel_absmax(model, list(groups), feeds)
    graph = model.graph
    for name, consumers in groups.items():
        x = consumers[0].inputs[0]
        w_max = np.max([np.abs(n.inputs[1].const_value.numpy()).max(axis=1) for n in consumers], axis=0)
        scale = np.power(np.maximum(absmax[name], 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
        scale = np.clip(scale, 1e-4, 1e4).astype(np.float32)
        inverse = _initializer(graph, f"{name}_smooth_inv", (1.0 / scale).astype(np.float32))
        mul = ir.Node("", "Mul", inputs=[x, inverse], name=f"{name}_smooth")
        mul.metadata_props.update(consumers[0].metadata_props)
        mul.outputs[0].shape, mul.outputs[0].dtype = x.shape, x.dtype
        graph.insert_before(consumers[0], [mul])
        for node in consumers:
            old = node.inputs[1]
            smoothed = old.const_value.numpy() * scale[:, None]
            node.replace_input_with(
                1, _initializer(graph, f"{old.name}_smoothed", smoothed.astype(np.float32))
            )
            node.replace_input_with(0, mul.outputs[0])
            if not old.uses():
                graph.initializers.pop(old.name, None)
    return len(groups)


def _gemm_to_matmul(model: Any) -> int:
    """Rewrite ``Gemm(A, B, C)`` with a constant ``B`` (GPT-2's ``Conv1D`` is ``addmm``) into
    ``MatMul(A, B or B^T) + C`` in place, so the quantizers, which match ``MatMul``
    (``MatMulNBits``, dynamic ``MatMulInteger``), see those weights too. Only the plain form
    (``alpha = beta = 1``, ``transA = 0``) is rewritten; the node's metadata (module scopes) moves to
    the ``MatMul``. Returns the number of rewrites.

    ONNX Runtime's ``com.microsoft.FusedMatMul`` with a constant 2-D ``B`` in the same plain form
    (``alpha = 1``, no ``transA`` / ``transBatch*``) is rewritten too: ``--ort-fusions`` folds the
    transpose of a tied LM head (``lm_head.weight`` shared with the word embedding) into one, which
    the quantizers would otherwise leave in float32 (on SmolLM2-135M 113 MB of a 209 MB int4 graph)."""
    import onnx_ir as ir

    graph = model.graph
    count = 0
    for node in list(graph):
        fused = node.op_type == "FusedMatMul" and node.domain == "com.microsoft"
        if not fused and (node.op_type != "Gemm" or node.domain not in ("", "ai.onnx")):
            continue
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
            continue
        if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
            continue
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 and not fused else None
        if b is None or b.const_value is None or len(b.const_value.shape) != 2:
            continue
        weight = b
        if attrs.get("transB", 0):
            array = b.const_value.numpy().T.copy()
            weight = ir.Value(
                name=f"{b.name}_transposed", const_value=ir.tensor(array, name=f"{b.name}_transposed")
            )
            weight.shape = ir.Shape(array.shape)
            weight.dtype = b.dtype
            graph.register_initializer(weight)
        matmul = ir.Node("", "MatMul", inputs=[a, weight], name=f"{node.name}_matmul")
        matmul.metadata_props.update(node.metadata_props)
        new_nodes = [matmul]
        result = matmul.outputs[0]
        if c is not None:
            add = ir.Node("", "Add", inputs=[result, c], name=f"{node.name}_bias")
            add.metadata_props.update(node.metadata_props)
            new_nodes.append(add)
            result = add.outputs[0]
        graph.insert_before(node, new_nodes)
        old = node.outputs[0]
        result.shape, result.dtype = old.shape, old.dtype
        is_output = old in graph.outputs
        ir.convenience.replace_all_uses_with(old, result, replace_graph_outputs=True)
        if is_output:
            name = old.name
            old.name = f"{name}_gemm"
            result.name = name
        graph.remove(node, safe=True)
        if weight is not b and not b.uses() and b.name in graph.initializers:
            graph.initializers.pop(b.name)
        count += 1
    return count


def _fold_weight_transposes(model: Any) -> int:
    """Give ``MatMul(A, Transpose(W))`` with a constant 2-D ``W`` a constant transposed weight, in
    place, so the quantizers (which take a constant ``B`` only) see it: a tied LM head exported
    without ``--ort-fusions`` reads the word embedding through a ``Transpose`` (the table itself
    stays for the embedding's ``Gather``). Returns the number of ``MatMul`` inputs rewritten."""
    import onnx_ir as ir

    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        b = node.inputs[1]
        producer = b.producer() if b is not None else None
        if producer is None or producer.op_type != "Transpose" or producer.domain not in ("", "ai.onnx"):
            continue
        source = producer.inputs[0]
        if source is None or source.const_value is None or len(source.const_value.shape) != 2:
            continue
        perm = producer.attributes.get("perm")
        if perm is not None and list(perm.value) != [1, 0]:
            continue
        array = source.const_value.numpy().T.copy()
        name = f"{source.name}_transposed"
        weight = graph.initializers.get(name)
        if weight is None:
            weight = ir.Value(name=name, const_value=ir.tensor(array, name=name))
            weight.shape = ir.Shape(array.shape)
            weight.dtype = source.dtype
            graph.register_initializer(weight)
        node.replace_input_with(1, weight)
        if not producer.outputs[0].uses() and producer.outputs[0] not in graph.outputs:
            graph.remove(producer, safe=True)
        count += 1
    return count


def quantized_op_counts(model: Any) -> dict[str, int]:
    """``{op_type: count}`` of the quantization ops in an ``onnx_ir.Model`` or ``onnx.ModelProto``."""
    nodes = model.graph.all_nodes() if hasattr(model.graph, "all_nodes") else model.graph.node
    counts = collections.Counter(n.op_type for n in nodes if n.op_type in QUANTIZED_OP_TYPES)
    return dict(sorted(counts.items()))


def _feeds(batches: list[Mapping[str, Any]], input_names: list[str]) -> list[dict[str, np.ndarray]]:
    """Forward-kwarg dicts -> ORT feeds ``{graph input name: ndarray}``."""
    from hfexport.tensors import get_leaf_tensors

    feeds = []
    for batch in batches:
        leaves = get_leaf_tensors(dict(batch))
        feeds.append({n: leaves[n].detach().cpu().numpy() for n in input_names if n in leaves})
    return feeds


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over ORT feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = feeds
        self._index = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._index >= len(self._feeds):
            return None
        self._index += 1
        return self._feeds[self._index - 1]

    def rewind(self) -> None:
        self._index = 0


def ffn_up_nodes(model: Any, depth: int = 3) -> list[str]:
    """Names of the constant-weight ``MatMul`` nodes of ``model`` (``onnx_ir.Model``) whose output
    reaches a GELU (``Gelu``/``FastGelu``/``BiasGelu`` or the decomposed erf GELU's ``Erf``) within
    ``depth`` consumers: the FFN up-projections, the MatMuls that lose most at 4 bits. (A ``Tanh``
    is not one: BERT's pooler is ``tanh(x @ W + b)``.)"""
    gelu = {*_GELU_OPS, "Erf"}
    found = []
    for node in model.graph.all_nodes():
        if node.op_type != "MatMul" or not node.name or node.inputs[1] is None:
            continue
        if node.inputs[1].const_value is None:
            continue
        frontier, hit = [node], False
        for _ in range(depth):
            frontier = [user for n in frontier for out in n.outputs for user, _ in out.uses()]
            if any(user.op_type in gelu for user in frontier):
                hit = True
                break
        if hit:
            found.append(node.name)
    return found


def lm_head_nodes(model: Any) -> list[str]:
    """Names of the constant-weight ``MatMul`` nodes of ``model`` (``onnx_ir.Model``) that are a
    language model's head: recorded under a module named ``lm_head`` (``pkg.torch.onnx.name_scopes``)
    or producing the graph output ``logits`` directly."""
    outputs = {v.name for v in model.graph.outputs}
    found = []
    for node in model.graph.all_nodes():
        if node.op_type != "MatMul" or not node.name or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        if node.inputs[1].const_value is None:
            continue
        scoped = any(s == "lm_head" or s.endswith(".lm_head") for s in _scopes(node))
        if scoped or ("logits" in outputs and node.outputs[0].name == "logits"):
            found.append(node.name)
    return found


#: the block sizes ONNX Runtime's blockwise quantizer (MlasQuantizeBlockwise) accepts
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
#: ``int4-weight`` / ``int8-weight`` block size when ``quantization.group_size`` is not set (ONNX
#: Runtime GenAI's model builder uses 32 as well)
INT4_BLOCK_SIZE = 32
#: ``MatMulNBits`` ``accuracy_level`` when ``quantization.accuracy_level`` is not set: 4 = int8
#: compute (activations quantized per block at run time; the CPU fast path)
ACCURACY_LEVEL = 4
#: symmetric blocks (no zero points) when ``quantization.symmetric`` is not set
SYMMETRIC = True


def tied_embedding(model: Any) -> tuple[str, str] | None:
    """The word embedding a language model's head shares its weights with (tied weights).

    A tied pair is a token-embedding ``Gather`` (axis 0 of a constant float32 or float16
    ``[vocab, hidden]`` table with at least :data:`MIN_EMBEDDING_ROWS` rows) and a head ``MatMul``
    (:func:`lm_head_nodes`) whose constant ``[hidden, vocab]`` weight is exactly the table's
    transpose (after :func:`_gemm_to_matmul`, which transposes a tied head's ``FusedMatMul``).

    Args:
        model: an ``onnx_ir.Model``.

    Returns:
        ``(gather node name, head MatMul node name)``, or ``None`` when the head is not tied.
    """
    import onnx_ir as ir

    heads = [n for n in model.graph.all_nodes() if n.name in set(lm_head_nodes(model))]
    if not heads:
        return None
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.name:
            continue
        table = node.inputs[0]
        axis = node.attributes.get("axis")
        if table is None or table.const_value is None:
            continue
        if table.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            continue
        if (axis.value if axis is not None else 0) != 0 or len(table.const_value.shape) != 2:
            continue
        rows, cols = table.const_value.shape
        if rows < MIN_EMBEDDING_ROWS:
            continue
        for head in heads:
            weight = head.inputs[1].const_value
            if tuple(weight.shape) != (cols, rows):
                continue
            if np.array_equal(weight.numpy().T, table.const_value.numpy()):
                return node.name, head.name
    return None


def share_tied_embedding(proto: Any, gather: str, head: str, *, block: int) -> int:
    """Gather the tied word embedding from its head's quantized blocks (as ONNX Runtime GenAI's
    builder does for tied weights): the embedding ``Gather`` node ``gather`` of ``proto``
    (changed in place) becomes ``com.microsoft.GatherBlockQuantized`` over the
    ``MatMulNBits`` head's ``B`` blocks (reshaped ``[vocab, n_blocks, blob] -> [vocab, blob *
    n_blocks]``) and scales (``[vocab, n_blocks]``, shared with the head), so the table is stored
    once, quantized, and only the gathered rows are dequantized at run time. The float table is
    dropped.

    Args:
        proto: the quantized model: an ``onnx_ir.Model`` or an ``onnx.ModelProto``.
        gather: the embedding ``Gather`` node's name (:func:`tied_embedding`).
        head: the head ``MatMul`` node's name before quantization (the quantizer names its
            ``MatMulNBits`` ``<head>_Q<bits>``).
        block: the head's block size (elements per block along the hidden axis).

    Returns:
        The head's bit width (4 or 8), or 0 when the head is not a zero-point-free
        ``MatMulNBits`` (nothing is changed then).
    """
    if not hasattr(proto, "SerializeToString"):
        return _share_tied_embedding_ir(proto, gather, head, block=block)
    import onnx
    from onnx import helper, numpy_helper

    graph = proto.graph
    nodes = {n.name: n for n in graph.node}
    head_node = next(
        (n for name, n in nodes.items() if n.op_type == "MatMulNBits" and name.startswith(f"{head}_Q")), None
    )
    old = nodes.get(gather)
    if head_node is None or old is None or (len(head_node.input) > 3 and head_node.input[3]):
        return 0  # a head with zero points (asymmetric) or not quantized: keep the int8 / float table
    attrs = {a.name: helper.get_attribute_value(a) for a in head_node.attribute}
    bits, vocab = int(attrs["bits"]), int(attrs["N"])
    inits = {i.name: i for i in graph.initializer}
    blocks, scales = inits[head_node.input[1]], inits[head_node.input[2]]
    scale_array = numpy_helper.to_array(scales)
    if scale_array.ndim == 1:  # [vocab * n_blocks] -> [vocab, n_blocks]: MatMulNBits reads either
        scales.CopyFrom(numpy_helper.from_array(scale_array.reshape(vocab, -1), name=scales.name))
    shape = numpy_helper.from_array(np.asarray([vocab, -1], dtype=np.int64), name=f"{gather}_blocks_shape")
    graph.initializer.append(shape)
    reshape = helper.make_node(
        "Reshape", [blocks.name, shape.name], [f"{gather}_blocks"], name=f"{gather}_reshape"
    )
    gathered = helper.make_node(
        "GatherBlockQuantized",
        [reshape.output[0], old.input[1], scales.name],
        list(old.output),
        name=f"{gather}_block_quantized",
        domain="com.microsoft",
        bits=bits,
        block_size=block,
        gather_axis=0,
        quantize_axis=1,
    )
    table = old.input[0]
    index = list(graph.node).index(old)
    graph.node.remove(old)
    graph.node.insert(index, gathered)
    graph.node.insert(index, reshape)
    if not any(table in n.input for n in graph.node):
        for i, init in enumerate(graph.initializer):
            if init.name == table:
                del graph.initializer[i]
                break
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return bits


def _share_tied_embedding_ir(model: Any, gather: str, head: str, *, block: int) -> int:
    """:func:`share_tied_embedding` on an ``onnx_ir.Model`` (the same nodes and names)."""
    import onnx_ir as ir

    graph = model.graph
    nodes = {n.name: n for n in graph if n.name}
    head_node = next(
        (n for name, n in nodes.items() if n.op_type == "MatMulNBits" and name.startswith(f"{head}_Q")), None
    )
    old = nodes.get(gather)
    if head_node is None or old is None or (len(head_node.inputs) > 3 and head_node.inputs[3] is not None):
        return 0  # a head with zero points (asymmetric) or not quantized: keep the int8 / float table
    bits, vocab = int(head_node.attributes["bits"].value), int(head_node.attributes["N"].value)
    blocks, scales = head_node.inputs[1], head_node.inputs[2]
    if scales.const_value is not None and len(scales.const_value.shape) == 1:
        array = scales.const_value.numpy().reshape(vocab, -1)  # MatMulNBits reads either
        scales.const_value = ir.tensor(array, name=scales.name)
        scales.shape = ir.Shape(array.shape)
    shape = _initializer(graph, f"{gather}_blocks_shape", np.asarray([vocab, -1], dtype=np.int64))
    reshape = ir.Node("", "Reshape", inputs=[blocks, shape], name=f"{gather}_reshape")
    reshape.outputs[0].name = f"{gather}_blocks"
    gathered = ir.Node(
        "com.microsoft",
        "GatherBlockQuantized",
        inputs=[reshape.outputs[0], old.inputs[1], scales],
        attributes=[
            ir.AttrInt64("bits", bits),
            ir.AttrInt64("block_size", block),
            ir.AttrInt64("gather_axis", 0),
            ir.AttrInt64("quantize_axis", 1),
        ],
        name=f"{gather}_block_quantized",
    )
    gathered.metadata_props.update(old.metadata_props)
    table = old.inputs[0]
    graph.insert_before(old, [reshape])
    ir.convenience.replace_nodes_and_values(
        graph, reshape, [old], [gathered], list(old.outputs), list(gathered.outputs)
    )
    if table is not None and not table.uses() and not table.is_graph_output():
        graph.initializers.pop(table.name, None)
    model.opset_imports.setdefault("com.microsoft", 1)
    return bits


def _nbits_weight(
    model: Any,
    quantization: Any,
    exclude: list[str],
    facts: dict[str, Any],
    *,
    bits: int,
) -> Any:
    """``int4-weight`` / ``int8-weight`` on ``model`` (``onnx_ir.Model``, rewritten in place and
    returned): every constant-weight ``MatMul`` (``lm_head`` included) becomes a
    ``com.microsoft.MatMulNBits`` with ``bits``-bit blocks of ``group_size`` elements along the
    input axis (default :data:`INT4_BLOCK_SIZE`), symmetric unless ``quantization.symmetric`` is
    False (default :data:`SYMMETRIC`), ``accuracy_level`` :data:`ACCURACY_LEVEL` (int8 compute)
    unless set. ``int4-weight`` without ``quantization.exclude`` keeps the FFN up-projections of
    GELU models (:func:`ffn_up_nodes`; none in SiLU LLMs) and a language model's head
    (:func:`lm_head_nodes`, a tied head's ``FusedMatMul`` rewritten by :func:`_gemm_to_matmul`
    first) at 8 bits: on SmolLM2-135M the 8-bit head costs nothing measurable on the text metrics
    (docs/backends/onnx.md). Then a packed projection's ``Split`` is undone
    (:func:`split_packed_nbits`) and a tied embedding gathered from the head's blocks
    (:func:`share_tied_embedding`).

    The blocks are what ONNX Runtime's ``MatMulNBitsQuantizer`` writes with its default (RTN)
    algorithm, as ONNX Runtime GenAI's model builder uses for ``-p int4``: the same MLAS kernel
    (:func:`matmul_nbits_in_place`), bit-identical, without the quantizer's copies of the graph."""
    block = int(quantization.group_size or INT4_BLOCK_SIZE)
    symmetric = SYMMETRIC if quantization.symmetric is None else bool(quantization.symmetric)
    level = ACCURACY_LEVEL if quantization.accuracy_level is None else int(quantization.accuracy_level)
    head_bits = int(quantization.embedding_bits or 8)
    heads = lm_head_nodes(model) if head_bits == 8 else []
    eight = [] if quantization.exclude or bits == 8 else [*ffn_up_nodes(model), *heads]
    facts.update(bits=bits, group_size=block, symmetric=symmetric, accuracy_level=level, eight_bit=eight)
    matmul_nbits_in_place(
        model,
        bits=bits,
        block_size=block,
        symmetric=symmetric,
        accuracy_level=level,
        exclude=exclude,
        eight_bit=eight,
    )
    facts["split_packed_nbits"] = split_packed_nbits(model)
    tied = facts.get("tied_embedding")
    if tied:
        shared = share_tied_embedding(model, tied["gather"], tied["head"], block=block)
        tied["bits"] = shared
        if not shared:  # asymmetric head blocks: the embedding stays the float table
            facts["tied_embedding"] = None
    return model


def _block_quantize(array: np.ndarray, bits: int, block: int, symmetric: bool) -> tuple[np.ndarray, ...]:
    """``[K, N]`` float32 -> ``(blocks [N, k_blocks, block * bits / 8] uint8, scales [N, k_blocks]
    float32, zero points [N, ceil(k_blocks * bits / 8)] uint8)``: MLAS's blockwise quantization
    (``MlasQuantizeBlockwise``, through the binding ONNX Runtime's ``MatMulNBitsQuantizer`` calls),
    rows zero-padded to a whole block as that quantizer pads them."""
    from onnxruntime.capi import _pybind_state as kernels

    rows, cols = array.shape
    pack = 8 // bits
    k_blocks = (rows + block - 1) // block
    if k_blocks * block != rows:
        array = np.pad(array, ((0, k_blocks * block - rows), (0, 0)), "constant")
    array = np.ascontiguousarray(array, dtype=np.float32)
    blocks = np.zeros((cols, k_blocks, (block + pack - 1) // pack), dtype=np.uint8)
    zero_points = np.zeros((cols, (k_blocks + pack - 1) // pack), dtype=np.uint8)
    scales = np.zeros((cols, k_blocks), dtype=np.float32)
    quantize = kernels.quantize_matmul_8bits if bits == 8 else kernels.quantize_matmul_4bits
    quantize(blocks, array, scales, zero_points, block, cols, rows, symmetric)
    return blocks, scales, zero_points


def matmul_nbits_in_place(
    model: Any,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    exclude: Sequence[str] = (),
    eight_bit: Sequence[str] = (),
) -> dict[int, int]:
    """Rewrite each ``MatMul`` of ``model`` (``onnx_ir.Model``, changed in place) whose second input
    is a float32 (or float16: q4f16) initializer of shape ``[K, N]`` into ``com.microsoft.MatMulNBits``
    (``K``, ``N``, ``bits``, ``block_size``, ``accuracy_level`` when not 0; inputs ``A``,
    ``<B>_Q<bits>`` uint8 ``[N, ceil(K / block_size), block_size * bits / 8]``, ``<B>_scales`` of the
    weight's dtype ``[N, ceil(K / block_size)]`` (a float16 weight is blocked in float32) and, asymmetric, ``<B>_zero_points`` uint8), node named
    ``<MatMul>_Q<bits>``: the tensors, names and attributes ONNX Runtime's ``MatMulNBitsQuantizer``
    (default algorithm, QOperator format) writes, from the same MLAS kernel, so the blocks are
    bit-identical to that quantizer's.

    Weight by weight, without a copy of the graph: the float32 initializer is dropped as soon as
    its last ``MatMul`` is rewritten, so the graph never holds a weight in both forms for more than
    one tensor (the quantizer copies the whole model into a ``ModelProto`` and builds a second one).

    Args:
        model: the float graph.
        bits: 4 or 8 for every MatMul not in ``eight_bit``.
        block_size: elements per block along ``K`` (:data:`INT4_BLOCK_SIZES`).
        symmetric: no zero points (``True``) or per-block zero points.
        accuracy_level: ``MatMulNBits`` ``accuracy_level`` (0: not written).
        exclude: ``MatMul`` node names left in float.
        eight_bit: ``MatMul`` node names quantized with 8-bit blocks whatever ``bits`` is.

    Returns:
        ``{bits: number of MatMuls rewritten}``.

    Raises:
        ValueError: ``bits`` is not 4 or 8, or ``block_size`` not one of :data:`INT4_BLOCK_SIZES`.

    A weight of rank above 2 (leading axes of size 1) is quantized only when ``A``'s rank is known
    and at least the weight's (then ``MatMulNBits`` gives the same shape); otherwise it stays float.
    """
    import onnx_ir as ir

    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits bits={bits} is not supported here; allowed: 4, 8")
    if block_size not in INT4_BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size} is not a MatMulNBits block size; allowed: {', '.join(map(str, INT4_BLOCK_SIZES))}"
        )
    skip, eight = set(exclude), set(eight_bit)
    counts = {4: 0, 8: 0}
    for graph in model.graphs():
        done: dict[tuple[str, int], tuple[Any, ...]] = {}
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.name in skip:
                continue
            weight = node.inputs[1] if len(node.inputs) > 1 else None
            if weight is None or weight.const_value is None or not weight.is_initializer():
                continue
            if weight.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
                continue
            half = weight.dtype == ir.DataType.FLOAT16  # q4f16: float16 activations and scales
            shape = tuple(weight.const_value.shape)
            if len(shape) < 2 or any(d != 1 for d in shape[:-2]):
                continue
            if len(shape) > 2:
                a = node.inputs[0]
                if a is None or a.shape is None or len(a.shape) < len(shape):
                    continue
            n_bits = 8 if node.name in eight else bits
            key = (weight.name, n_bits)
            if key not in done:
                array = weight.const_value.numpy().reshape(shape[-2], shape[-1])
                if half:  # the blocks are chosen in float32, the scales stored as MatMulNBits' T
                    array = array.astype(np.float32)
                blocks, scales, zero_points = _block_quantize(array, n_bits, block_size, symmetric)
                if half:
                    scales = scales.astype(np.float16)
                del array
                inits = [
                    _initializer(graph, f"{weight.name}_Q{n_bits}", blocks),
                    _initializer(graph, f"{weight.name}_scales", scales),
                ]
                if not symmetric:
                    inits.append(_initializer(graph, f"{weight.name}_zero_points", zero_points))
                done[key] = tuple(inits)
            attributes = [
                ir.AttrInt64("K", shape[-2]),
                ir.AttrInt64("N", shape[-1]),
                ir.AttrInt64("bits", n_bits),
                ir.AttrInt64("block_size", block_size),
            ]
            if accuracy_level:
                attributes.append(ir.AttrInt64("accuracy_level", accuracy_level))
            nbits = ir.Node(
                "com.microsoft",
                "MatMulNBits",
                inputs=[node.inputs[0], *done[key]],
                attributes=attributes,
                name=f"{node.name}_Q{n_bits}" if node.name else None,
            )
            nbits.metadata_props.update(node.metadata_props)
            ir.convenience.replace_nodes_and_values(
                graph, node, [node], [nbits], list(node.outputs), list(nbits.outputs)
            )
            if not weight.uses() and not weight.is_graph_output():
                graph.initializers.pop(weight.name, None)  # the float weight goes now
            counts[n_bits] += 1
    if any(counts.values()):
        model.opset_imports.setdefault("com.microsoft", 1)
    return counts


def split_packed_nbits(proto: Any) -> int:
    """Undo the sibling-MatMul packing (:mod:`hfexport_onnx.matmul_packing`) on quantized weights:
    each ``Split(MatMulNBits(x, B, scales[, zero_points]), sizes, axis=-1)`` of ``proto``
    becomes one ``MatMulNBits`` per part, over that part's
    rows of ``B`` / ``scales`` / ``zero_points`` (``MatMulNBits`` stores its weight transposed,
    ``[N, n_blocks, blob]``, so an output column range is a row range: the same bytes, bit-identical
    outputs).

    Packing saves a kernel launch for a float ``MatMul``; for ``MatMulNBits`` it measured the other
    way on SmolLM2-135M int4 decode (the ``Split`` copy costs more than the second launch; ONNX
    Runtime GenAI's builder keeps gate and up separate too).

    Args:
        proto: an ``onnx_ir.Model`` or an ``onnx.ModelProto``, changed in place.

    Returns:
        The number of ``Split`` nodes removed (0 when none has constant sizes on the last axis).
    """
    if not hasattr(proto, "SerializeToString"):
        return _split_packed_nbits_ir(proto)
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    uses = collections.Counter(i for n in graph.node for i in n.input)
    removed = 0
    for split in list(graph.node):
        if split.op_type != "Split" or len(split.input) < 2 or split.input[1] not in inits:
            continue
        node = producers.get(split.input[0])
        axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
        if node is None or node.op_type != "MatMulNBits" or axis != -1 or uses[split.input[0]] != 1:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        sizes = [int(v) for v in numpy_helper.to_array(inits[split.input[1]]).reshape(-1)]
        n = int(attrs["N"])
        if sum(sizes) != n or any(name not in inits for name in node.input[1:] if name):
            continue
        arrays = [numpy_helper.to_array(inits[name]) if name else None for name in node.input[1:]]
        if len(node.input) > 4 and any(node.input[4:]):
            continue  # g_idx / bias: not written by our quantizer
        parts, start = [], 0
        for i, (size, output) in enumerate(zip(sizes, split.output)):
            inputs = [node.input[0]]
            for name, array in zip(node.input[1:], arrays):
                if array is None:
                    inputs.append("")
                    continue
                rows = array.reshape(n, -1)[start : start + size]
                part = f"{name}_part{i}"
                graph.initializer.append(
                    numpy_helper.from_array(
                        rows.reshape((size, *array.shape[1:]))
                        if array.ndim > 1 and array.shape[0] == n
                        else rows.reshape(-1),
                        name=part,
                    )
                )
                inputs.append(part)
            parts.append(
                helper.make_node(
                    "MatMulNBits",
                    inputs,
                    [output],
                    name=f"{node.name}_part{i}",
                    domain=node.domain,
                    **{**attrs, "N": size},
                )
            )
            start += size
        index = list(graph.node).index(node)
        graph.node.remove(split)
        graph.node.remove(node)
        for offset, part in enumerate(parts):
            graph.node.insert(index + offset, part)
        for name in node.input[1:]:
            if name and not any(name in other.input for other in graph.node):
                graph.initializer.remove(inits.pop(name))
        removed += 1
    return removed


def _split_packed_nbits_ir(model: Any) -> int:
    """:func:`split_packed_nbits` on an ``onnx_ir.Model`` (same names: ``<node>_part<i>`` nodes,
    ``<tensor>_part<i>`` initializers)."""
    import onnx_ir as ir

    graph = model.graph
    removed = 0
    for split in list(graph):
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.inputs) < 2:
            continue
        packed, sizes_value = split.inputs[0], split.inputs[1]
        node = packed.producer() if packed is not None else None
        axis = split.attributes.get("axis")
        if node is None or node.op_type != "MatMulNBits" or (axis.value if axis is not None else 0) != -1:
            continue
        if sizes_value is None or sizes_value.const_value is None or len(packed.uses()) != 1:
            continue
        if packed.is_graph_output() or (len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:])):
            continue  # g_idx / bias: not written by our quantizer
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        sizes = [int(v) for v in sizes_value.const_value.numpy().reshape(-1)]
        n = int(attrs["N"])
        tensors = list(node.inputs[1:4])
        if sum(sizes) != n or any(v is not None and v.const_value is None for v in tensors):
            continue
        arrays = [v.const_value.numpy() if v is not None else None for v in tensors]
        parts, start = [], 0
        for i, (size, output) in enumerate(zip(sizes, split.outputs)):
            inputs = [node.inputs[0]]
            for value, array in zip(tensors, arrays):
                if value is None:
                    inputs.append(None)
                    continue
                rows = array.reshape(n, -1)[start : start + size]
                rows = (
                    rows.reshape((size, *array.shape[1:]))
                    if array.ndim > 1 and array.shape[0] == n
                    else rows.reshape(-1)
                )
                inputs.append(_initializer(graph, f"{value.name}_part{i}", np.ascontiguousarray(rows)))
            part = ir.Node(
                node.domain,
                "MatMulNBits",
                inputs=inputs,
                attributes=[ir.AttrInt64(k, int(v)) for k, v in {**attrs, "N": size}.items()],
                name=f"{node.name}_part{i}",
            )
            part.metadata_props.update(node.metadata_props)
            parts.append((part, output))
            start += size
        graph.insert_before(node, [p for p, _ in parts])
        for part, output in parts:
            ir.convenience.replace_nodes_and_values(graph, part, [], [], [output], [part.outputs[0]])
        graph.remove([split, node], safe=True)
        for value in [*tensors, sizes_value]:
            if value is not None and not value.uses() and value.is_initializer():
                graph.initializers.pop(value.name, None)
        removed += 1
    return removed


def _load(path: Path) -> Any:
    import onnx
    import onnx_ir as ir

    return ir.from_proto(onnx.load(str(path), load_external_data=True))


def _quantize_graph(
    request: QuantizationRequest,
    write: Callable[..., None] | None,
    *,
    in_place: Callable[..., Any] | None = None,
    keep_sensitive_float: bool,
    int8_embeddings: bool,
    share_tied: bool = False,
) -> QuantizationResult:
    """The steps every ONNX method shares around its quantizer ``write``: the ``exclude`` patterns
    resolved to nodes, ``Gemm`` -> ``MatMul``, the early FFN down-projections kept float
    (``keep_sensitive_float``, without ``exclude``), the word embedding in int8
    (``int8_embeddings``), then ``write(src, dst, model, quantization, exclude, facts, calibration)``
    in a temporary folder (``src`` not yet written: the writer saves the model when its own
    rewrites are done), the quantized graph read back with the exporter's metadata, its op counts
    and the weight bytes before/after. A method that rewrites the graph itself gives
    ``in_place(model, quantization, exclude, facts)`` instead of ``write`` (no temporary files, no
    second copy of the graph). The freed memory is handed back to the OS before the next stage
    (:func:`hfexport.memory.release_freed_memory`)."""
    from hfexport.memory import release_freed_memory
    from hfexport_onnx.runtime import initializer_bytes

    model, quantization = request.target, request.quantization
    before = initializer_bytes(model)
    exclude = excluded_nodes(model, quantization.exclude)
    facts: dict[str, Any] = {"method": quantization.method}
    facts["gemm_to_matmul"] = _gemm_to_matmul(model)
    facts["folded_weight_transposes"] = _fold_weight_transposes(model)
    if keep_sensitive_float and not quantization.exclude:
        # the FFN down-projections of the first two blocks read heavy-tailed GELU outputs: float
        auto = sensitive_ffn_nodes(model, SENSITIVE_FFN_LAYERS)
        exclude += auto
        facts["kept_float"] = auto
    # a symmetric head's blocks are what GatherBlockQuantized reads without zero points
    tied = tied_embedding(model) if share_tied and quantization.symmetric is not False else None
    if tied is not None and not any(tied[1] == name for name in exclude):
        facts["tied_embedding"] = {"gather": tied[0], "head": tied[1]}
    if int8_embeddings:
        skip = [*exclude, facts["tied_embedding"]["gather"]] if facts.get("tied_embedding") else exclude
        facts["int8_embeddings"] = quantize_embeddings(model, skip)
    facts["excluded_nodes"] = len(exclude)
    if in_place is not None:  # rewritten in place: no copy of the graph
        quantized = in_place(model, quantization, exclude, facts)
    else:
        with tempfile.TemporaryDirectory(prefix="hfexport-quantize-") as tmp:
            src, dst = Path(tmp) / "model.onnx", Path(tmp) / "quantized.onnx"
            write(src, dst, model, quantization, exclude, facts, request.calibration)
            quantized = _load(dst)
    release_freed_memory()  # the float weights just dropped, and the copies a quantizer made
    # keep the exporter's metadata (graph input/output leaf-path mapping) on the new model
    for key, value in model.metadata_props.items():
        quantized.metadata_props.setdefault(key, value)
    facts["quantized_ops"] = quantized_op_counts(quantized)
    after = initializer_bytes(quantized)
    facts.update(weights_bytes_before=before, weights_bytes_after=after)
    detail = f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB; " + ", ".join(
        f"{op} x{n}" for op, n in facts["quantized_ops"].items()
    )
    return QuantizationResult(quantized, facts, detail)


def _save(model: Any, src: Path) -> None:
    import onnx_ir as ir

    ir.save(model, src, external_data="model.onnx.data")


def _write_int8_dynamic(
    src: Path,
    dst: Path,
    model: Any,
    quantization: Any,
    exclude: list[str],
    facts: dict[str, Any],
    calibration: Any,
    *,
    feeds: list[dict[str, np.ndarray]] | None = None,
) -> None:
    from onnxruntime import quantization as q

    from hfexport_onnx.workarounds.ort_layer_norm import apply_ort_kernel_fixes

    facts["per_channel"] = quantization.per_channel
    side: list[str] = []
    if feeds:
        split, side = split_outlier_channels(model, feeds, exclude=exclude)
        facts["outlier_channels"] = split
        facts["float_outlier_matmuls"] = len(side)
    fixes = apply_ort_kernel_fixes(model)
    if fixes:
        facts["ort_kernel_fixes"] = fixes
    _save(model, src)
    q.quantize_dynamic(
        src,
        dst,
        weight_type=q.QuantType.QInt8,
        per_channel=quantization.per_channel,
        nodes_to_exclude=[*exclude, *side],
        use_external_data_format=True,
        extra_options={"MatMulConstBOnly": True},
    )


def _write_int8_static(
    src: Path,
    dst: Path,
    model: Any,
    quantization: Any,
    exclude: list[str],
    facts: dict[str, Any],
    calibration: Any,
) -> None:
    from onnxruntime import quantization as q

    if not calibration:
        raise ValueError(
            "int8-static needs calibration inputs; allowed: OnnxExporter(calibration_data=...), "
            "quantization.calibration (a prompt file) or the sample inputs (the exporter's default)"
        )
    names = [v.name for v in model.graph.inputs]
    feeds = _feeds(list(calibration), names)
    float_matmuls = activation_matmuls(model)
    skip = set(exclude) | set(float_matmuls)
    weight_matmuls = [
        n.name for n in model.graph.all_nodes() if n.op_type == "MatMul" and n.name and n.name not in skip
    ]
    smoothed = smooth_activations(model, feeds, weight_matmuls)
    facts.update(
        per_channel=quantization.per_channel,
        calibration_batches=len(calibration),
        calibrate_method="MinMax",
        activations="uint8 per-tensor (asymmetric)",
        smoothing_alpha=SMOOTHING_ALPHA,
        smoothed_activations=smoothed,
        float_activation_matmuls=len(float_matmuls),
    )
    # the MatMuls kept out of QDQ still store int8 weights (float activations)
    facts["int8_weight_only"] = int8_weight_only(model, facts.get("kept_float", []))
    _save(model, src)
    q.quantize_static(
        src,
        dst,
        _Reader(feeds),
        quant_format=q.QuantFormat.QDQ,
        op_types_to_quantize=["MatMul"],
        per_channel=quantization.per_channel,
        activation_type=q.QuantType.QUInt8,
        weight_type=q.QuantType.QInt8,
        nodes_to_exclude=sorted(skip),
        calibrate_method=q.CalibrationMethod.MinMax,
        use_external_data_format=True,
        # a MatMul's float output feeds the bias Add: quantizing it (ORT's default) adds a
        # second rounding per projection for no speed-up
        extra_options={"MatMulConstBOnly": True, "OpTypesToExcludeOutputQuantization": ["MatMul"]},
    )


def apply_int8_dynamic(request: QuantizationRequest) -> QuantizationResult:
    """``int8-dynamic`` (phase ``artifact``): ``quantize_dynamic`` on ``request.target`` (the
    ``onnx_ir.Model``, rewritten in place on the way; the result is a new model).

    With sample inputs (``request.inputs``, as in an export) every constant-weight MatMul is
    quantized and the outlier channels of the GELU feed-forward blocks, found on those inputs, run
    in a narrow float side path (:func:`split_outlier_channels`); without them (a bare
    :func:`quantize_ir_model` call) the first two FFN down-projections stay float instead
    (:func:`sensitive_ffn_nodes`). Either way the active ``ort_kernel_fix`` entries run on the
    graph (:func:`hfexport_onnx.workarounds.ort_layer_norm.keep_layer_norm_unfused`).

    Returns:
        The quantized model; facts ``method``, ``per_channel``, ``outlier_channels``
        (``{down-projection: [channels]}``), ``float_outlier_matmuls``, ``kept_float`` (without
        sample inputs), ``ort_kernel_fixes``, ``excluded_nodes``, ``quantized_ops``,
        ``weights_bytes_before`` / ``_after`` ...

    Raises:
        ValueError: an ``exclude`` pattern matching no module.
    """
    feeds: list[dict[str, np.ndarray]] = []
    if request.inputs:
        names = [v.name for v in request.target.graph.inputs]
        # only a feed for every graph input can run the float graph (a KV-cache component's
        # nested past may flatten to other names): otherwise the fallback recipe
        feeds = [feed for feed in _feeds([request.inputs], names) if set(feed) == set(names)]
    return _quantize_graph(
        request,
        functools.partial(_write_int8_dynamic, feeds=feeds),
        keep_sensitive_float=not feeds,
        int8_embeddings=False,
    )


def apply_int8_static(request: QuantizationRequest) -> QuantizationResult:
    """``int8-static`` (phase ``artifact``): smoothed QDQ ``quantize_static`` calibrated on
    ``request.calibration``.

    Raises:
        ValueError: no calibration batches; an ``exclude`` pattern matching no module.
    """
    return _quantize_graph(request, _write_int8_static, keep_sensitive_float=True, int8_embeddings=True)


def _nbits_in_place(bits: int) -> Callable[..., Any]:
    def quantize(model: Any, quantization: Any, exclude: list[str], facts: dict[str, Any]) -> Any:
        return _nbits_weight(model, quantization, exclude, facts, bits=bits)

    return quantize


def apply_int4_weight(request: QuantizationRequest) -> QuantizationResult:
    """``int4-weight`` (phase ``artifact``): 4-bit ``MatMulNBits`` blocks (:func:`_nbits_weight`).

    Raises:
        ValueError: an ``exclude`` pattern matching no module.
    """
    return _quantize_graph(
        request,
        None,
        in_place=_nbits_in_place(4),
        keep_sensitive_float=False,
        int8_embeddings=True,
        share_tied=True,
    )


def apply_int8_weight(request: QuantizationRequest) -> QuantizationResult:
    """``int8-weight`` (phase ``artifact``): 8-bit ``MatMulNBits`` blocks (:func:`_nbits_weight`).

    Raises:
        ValueError: an ``exclude`` pattern matching no module.
    """
    return _quantize_graph(
        request,
        None,
        in_place=_nbits_in_place(8),
        keep_sensitive_float=False,
        int8_embeddings=True,
        share_tied=True,
    )


def quantize_ir_model(
    model: Any,
    quantization: Any,
    *,
    calibration: list[Mapping[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantize an ``onnx_ir.Model`` with the ``apply`` function of ``quantization.method`` in
    :data:`QUANTIZATION_METHODS` (outside an export; the exporter calls the method through
    :meth:`hfexport.exporter.HfExporter.quantize_artifact`).

    Args:
        model: the exported (optimized, possibly fused) graph; rewritten in place on the way
            (``Gemm`` -> ``MatMul``, int8 embeddings, smoothing): use the returned model.
        quantization: the :class:`hfexport.config.QuantizationConfig`.
        calibration: forward-kwarg dicts (methods that read ``calibration`` only).

    Returns:
        ``(quantized onnx_ir.Model, facts)``: ``facts`` holds ``method``, ``excluded_nodes`` (count),
        ``quantized_ops`` ({op: count}), the weight bytes before/after and the options used.

    Raises:
        ValueError: an unknown method, an exclude pattern matching nothing, ``int8-static`` without
            calibration.
    """
    method = QUANTIZATION_METHODS.get(quantization.method)
    if method is None:
        raise ValueError(
            f"quantization method {quantization.method!r} is unknown; allowed: {', '.join(QUANTIZATION_METHODS)}"
        )
    result = method.resolve_apply()(
        QuantizationRequest(model, quantization, "artifact", calibration=calibration)
    )
    return result.target, result.facts
