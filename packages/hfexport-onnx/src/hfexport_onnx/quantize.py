"""ONNX Runtime quantization of an exported graph (``OnnxConfig.quantization``).

Methods (:data:`QUANTIZATION_METHODS`):

- ``int8-dynamic``: ``onnxruntime.quantization.quantize_dynamic``: int8 weights (per output channel
  unless ``per_channel=False``), activations quantized at run time (``DynamicQuantizeLinear`` +
  ``MatMulInteger``); the word embedding ``Gather`` is quantized too. Without
  ``quantization.exclude``, the FFN down-projections of the first two blocks stay float
  (:func:`sensitive_ffn_nodes`); with it, exactly the named modules do.
- ``int8-static``: ``quantize_static`` in QDQ format, MatMuls with constant weights only, activation
  ranges calibrated (MinMax) on :func:`hfexport.calibration.calibration_inputs`; without
  ``quantization.exclude`` every FFN down-projection stays float.
- ``int4-weight``: ``MatMulNBitsQuantizer``: 4-bit block-quantized MatMul weights, asymmetric
  (``com.microsoft.MatMulNBits``), ``group_size`` elements per block (default 32); activations and
  embeddings stay float.

``quantization.exclude`` names modules (``fnmatch`` patterns over module paths such as
``encoder.layer.*.output.dense`` or ``lm_head``): the nodes the torch exporter recorded under those
modules (``pkg.torch.onnx.name_scopes`` metadata) stay in float.
"""

from __future__ import annotations

import ast
import collections
import fnmatch
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "QUANTIZATION_METHODS",
    "QUANTIZED_OP_TYPES",
    "excluded_nodes",
    "quantize_ir_model",
    "quantized_op_counts",
    "sensitive_ffn_nodes",
]

logger = logging.getLogger(__name__)

#: method name -> one-line description (``OnnxExporter.quantization_methods``)
QUANTIZATION_METHODS: dict[str, str] = {
    "int8-dynamic": "ONNX Runtime quantize_dynamic: int8 per-channel weights, dynamic int8 activations "
    "(MatMulInteger), int8 word embeddings",
    "int8-static": "ONNX Runtime quantize_static: QDQ int8 MatMuls, activation ranges calibrated on prompts or "
    "sample inputs",
    "int4-weight": "ONNX Runtime MatMulNBits: 4-bit block-quantized MatMul weights (group_size, default 32)",
}

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


def _gemm_to_matmul(model: Any) -> int:
    """Rewrite ``Gemm(A, B, C)`` with a constant ``B`` (GPT-2's ``Conv1D`` is ``addmm``) into
    ``MatMul(A, B or B^T) + C`` in place, so the quantizers, which match ``MatMul``
    (``MatMulNBits``, dynamic ``MatMulInteger``), see those weights too. Only the plain form
    (``alpha = beta = 1``, ``transA = 0``) is rewritten; the node's metadata (module scopes) moves to
    the ``MatMul``. Returns the number of rewrites."""
    import onnx_ir as ir

    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
            continue
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if b is None or b.const_value is None:
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
        ir.convenience.replace_all_uses_with(old, result)
        if old in graph.outputs:
            graph.outputs[graph.outputs.index(old)] = result
            result.name, old.name = old.name, f"{old.name}_gemm"
        graph.remove(node, safe=True)
        count += 1
    return count


def quantized_op_counts(model: Any) -> dict[str, int]:
    """``{op_type: count}`` of the quantization ops in an ``onnx_ir.Model`` or ``onnx.ModelProto``."""
    nodes = model.graph.all_nodes() if hasattr(model.graph, "all_nodes") else model.graph.node
    counts = collections.Counter(n.op_type for n in nodes if n.op_type in QUANTIZED_OP_TYPES)
    return dict(sorted(counts.items()))


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over forward-kwarg dicts."""

    def __init__(self, batches: list[Mapping[str, Any]], input_names: list[str]) -> None:
        from hfexport.tensors import get_leaf_tensors

        feeds = []
        for batch in batches:
            leaves = get_leaf_tensors(dict(batch))
            feeds.append({n: leaves[n].detach().cpu().numpy() for n in input_names if n in leaves})
        self._iter = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def rewind(self) -> None:  # pragma: no cover - not used by MinMax
        pass


def _load(path: Path) -> Any:
    import onnx
    import onnx_ir as ir

    return ir.from_proto(onnx.load(str(path), load_external_data=True))


def quantize_ir_model(
    model: Any,
    quantization: Any,
    *,
    calibration: list[Mapping[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantize an ``onnx_ir.Model`` with ONNX Runtime's quantizers.

    Args:
        model: the exported (optimized, possibly fused) graph; not modified.
        quantization: the :class:`hfexport.config.QuantizationConfig` (``method`` one of
            :data:`QUANTIZATION_METHODS`, ``per_channel``, ``exclude``, ``group_size``).
        calibration: forward-kwarg dicts (``int8-static`` only).

    Returns:
        ``(quantized onnx_ir.Model, facts)``: ``facts`` holds ``method``, ``excluded_nodes`` (count),
        ``quantized_ops`` ({op: count}) and the options used.

    Raises:
        ValueError: an unknown method, an exclude pattern matching nothing, ``int8-static`` without
            calibration.
    """
    import onnx_ir as ir
    from onnxruntime import quantization as q

    method = quantization.method
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization method {method!r} is unknown; allowed: {', '.join(QUANTIZATION_METHODS)}"
        )
    exclude = excluded_nodes(model, quantization.exclude)
    facts: dict[str, Any] = {"method": method}
    facts["gemm_to_matmul"] = _gemm_to_matmul(model)
    if method in ("int8-dynamic", "int8-static") and not quantization.exclude:
        # static QDQ fixes activation ranges ahead of time: every FFN down-projection stays float
        auto = sensitive_ffn_nodes(model, SENSITIVE_FFN_LAYERS if method == "int8-dynamic" else 10**6)
        exclude += auto
        facts["kept_float"] = auto
    facts["excluded_nodes"] = len(exclude)
    with tempfile.TemporaryDirectory(prefix="hfexport-quantize-") as tmp:
        src, dst = Path(tmp) / "model.onnx", Path(tmp) / "quantized.onnx"
        ir.save(model, src, external_data="model.onnx.data")
        if method == "int8-dynamic":
            facts["per_channel"] = quantization.per_channel
            q.quantize_dynamic(
                src,
                dst,
                weight_type=q.QuantType.QInt8,
                per_channel=quantization.per_channel,
                nodes_to_exclude=exclude,
                use_external_data_format=True,
                extra_options={"MatMulConstBOnly": True},
            )
        elif method == "int8-static":
            if not calibration:
                raise ValueError("int8-static needs calibration inputs")
            names = [v.name for v in model.graph.inputs]
            facts.update(per_channel=quantization.per_channel, calibration_batches=len(calibration))
            q.quantize_static(
                src,
                dst,
                _Reader(calibration, names),
                quant_format=q.QuantFormat.QDQ,
                op_types_to_quantize=["MatMul"],
                per_channel=quantization.per_channel,
                activation_type=q.QuantType.QUInt8,
                weight_type=q.QuantType.QInt8,
                nodes_to_exclude=exclude,
                calibrate_method=q.CalibrationMethod.MinMax,
                use_external_data_format=True,
                extra_options={"MatMulConstBOnly": True},
            )
        else:  # int4-weight
            import onnx
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            block = int(quantization.group_size or 32)
            facts.update(group_size=block, symmetric=False)
            # asymmetric blocks (a zero point each): on all-MiniLM-L6-v2 mean per-token cosine
            # 0.976 vs 0.971 symmetric at block 32
            quantizer = MatMulNBitsQuantizer(
                onnx.load(str(src), load_external_data=True),
                block_size=block,
                is_symmetric=False,
                nodes_to_exclude=exclude,
            )
            quantizer.process()
            onnx.save_model(
                quantizer.model.model,
                str(dst),
                save_as_external_data=True,
                location="quantized.onnx.data",
            )
        quantized = _load(dst)
    # keep the exporter's metadata (graph input/output leaf-path mapping) on the new model
    for key, value in model.metadata_props.items():
        quantized.metadata_props.setdefault(key, value)
    facts["quantized_ops"] = quantized_op_counts(quantized)
    return quantized, facts
