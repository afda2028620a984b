"""The plain ONNX graph of a BERT-like encoder (the all-MiniLM-L6-v2 deploy artifact): no dead
softmax NaN guard, no run-time transpose of constant weights, parity with eager at two shapes
(issue 27, MiniLM deploy table)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from hfexport import registry
from hfexport.config import OnnxConfig
from hfexport_onnx import OnnxExporter
from hfexport_onnx.workarounds.sdpa_nan_guard import drop_finite_mask_nan_guard

FIX = "hfexport_onnx.workarounds.sdpa_nan_guard.drop_finite_mask_nan_guard"
KEY_FIX = "hfexport_onnx.workarounds.sdpa_key_transpose.static_key_transpose"
LOWEST = float(np.finfo(np.float32).min)


@pytest.fixture(scope="module")
def bert_export():
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True))
    return model, program, exporter.last_report


def test_bert_graph_has_no_softmax_nan_guard_and_keeps_parity(bert_export):
    model, program, report = bert_export
    graph = program.model.graph
    ops = collections.Counter(n.op_type for n in graph.all_nodes())
    layers = model.config.num_hidden_layers
    assert FIX in report.applied["ir_fixes"]
    # one Softmax per layer, read directly by the context MatMul; the only Where left builds the
    # additive mask (shared by every layer)
    assert ops["Softmax"] == layers and ops["IsNaN"] == 0 and ops["Where"] == 1
    for node in graph.all_nodes():
        if node.op_type == "Softmax":
            assert [u.node.op_type for u in node.outputs[0].uses()] == ["MatMul"]
    # no run-time Transpose of a constant (a weight stored transposed would cost a copy per run)
    transposed = [
        n.name for n in graph.all_nodes() if n.op_type == "Transpose" and n.inputs[0].const_value is not None
    ]
    assert transposed == []
    weights = [n for n in graph.all_nodes() if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    assert len(weights) == 6 * layers  # Q, K, V, attention output, FFN up and down per layer
    # the key reaches the score MatMul through one static transpose per layer (torchlib's
    # Reshape -> Transpose([0, 2, 1]) -> Reshape chain replaced)
    assert KEY_FIX in report.applied["ir_fixes"]
    perms = collections.Counter(
        tuple(n.attributes["perm"].value) for n in graph.all_nodes() if n.op_type == "Transpose"
    )
    # (the optimizer merges the key's head transpose and the static one into [0, 2, 3, 1])
    assert perms == {(0, 2, 1, 3): 3 * layers, (0, 2, 3, 1): layers}, perms
    assert ops["Reshape"] == 4 * layers, ops  # Q, K, V to heads and the context back, nothing around the key
    for label in ("sample", "second_shape"):  # parity with eager at two shapes
        rows = {r["name"]: r for r in report.validation[label]}
        assert rows["last_hidden_state"]["ok"] and rows["last_hidden_state"]["max_abs_diff"] < 1e-4


def test_the_fixes_are_registered_with_their_upstream_references():
    entries = {e.name: e for e in registry.entries("onnx") if e.name in (FIX, KEY_FIX)}
    assert "onnxscript/pull/2654" in entries[FIX].issue
    assert entries[KEY_FIX].issue.endswith("onnxscript/function_libs/torch_lib/ops/nn.py")
    for entry in entries.values():
        assert entry.kind == "onnx_ir_fix" and entry.is_active() and entry.versions


def _guarded_softmax_model(fill: float) -> onnx.ModelProto:
    """``Where(IsNaN(p), 0, p)`` after ``p = Softmax(s + Where(mask, 0, fill))``: the torchlib form."""
    nodes = [
        helper.make_node("Where", ["mask", "zero", "fill"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("IsNaN", ["probs"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "probs"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "guard",
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 4]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])],
        [
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("fill", TensorProto.FLOAT, [], [fill]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def test_dropping_the_guard_changes_no_output_even_for_a_fully_masked_row():
    proto = _guarded_softmax_model(LOWEST)
    feed = {
        "scores": np.asarray([[0.5, -1.0, 2.0, 0.0], [3.0, 1.0, -2.0, 0.25]], dtype=np.float32),
        "mask": np.asarray([[True, True, False, True], [False, False, False, False]]),
    }
    before = _run(proto, feed)
    model = ir.from_proto(proto)
    assert drop_finite_mask_nan_guard(model) is True
    after_proto = ir.to_proto(model)
    assert [n.op_type for n in after_proto.graph.node] == ["Where", "Add", "Softmax"]
    after = _run(after_proto, feed)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(after[1], np.full(4, 0.25, dtype=np.float32))  # finite mask: uniform, no NaN


def test_a_minus_infinity_mask_keeps_its_guard():
    """With ``-inf`` (onnxscript before microsoft/onnxscript#2654) a fully masked row is 0 / 0: the
    guard is live and must stay."""
    model = ir.from_proto(_guarded_softmax_model(float("-inf")))
    assert drop_finite_mask_nan_guard(model) is False
    assert [n.op_type for n in model.graph] == ["Where", "Add", "Softmax", "IsNaN", "Where"]


def test_bert_int8_dynamic_graph_quantizes_the_rewritten_attention_graph():
    """int8-dynamic runs on the fixed graph: no NaN guard, one static key transpose per layer,
    ``MatMulInteger`` for every constant-weight projection but the kept-float FFN down-projections."""
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    exporter = OnnxExporter()
    program = exporter.export(
        model, inputs, OnnxConfig(dynamic=True, quantization="int8-dynamic", validate=False)
    )
    quant = exporter.last_report.quantization
    ops = collections.Counter(n.op_type for n in program.model.graph.all_nodes())
    layers = model.config.num_hidden_layers
    assert ops["IsNaN"] == 0 and ops["Softmax"] == layers
    kept = len(quant["kept_float"])
    assert kept == min(2, layers)
    # Q, K, V, attention output, FFN up (+ the down-projections not kept float) per layer, + pooler
    assert ops["MatMulInteger"] == 6 * layers - kept + 1, ops
    assert ops["MatMul"] == 2 * layers + kept, ops  # scores, context and the kept-float projections
