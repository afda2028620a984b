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


def test_bert_plain_graph_keeps_layer_norm_out_of_ort_skip_fusion(bert_export, tmp_path):
    """The plain float32 graph gets the ``ort_kernel_fixes`` stage: every residual
    ``Add -> LayerNormalization`` (embeddings + two per layer) is wrapped, so the CPU session runs
    ``LayerNormalization`` (vectorized) and no ``SkipLayerNormalization`` (scalar loop, 7x slower
    at 8 x 64 x 384); parity with eager is unchanged."""
    model, program, report = bert_export
    layers = model.config.num_hidden_layers
    assert report.extra["ort_kernel_fixes"] == {"keep_layer_norm_unfused": 2 * layers + 1}
    assert report.applied["ort_kernel_fixes"] == [f"keep_layer_norm_unfused x{2 * layers + 1}"]
    stage = next(s for s in report.stages if s.name == "ort_kernel_fixes")
    assert stage.status == "ok" and stage.detail == f"keep_layer_norm_unfused x{2 * layers + 1}"
    run_ops = _ort_optimized_ops(ir.serde.serialize_model(program.model), tmp_path)
    assert run_ops["SkipLayerNormalization"] == 0 and run_ops["LayerNormalization"] == 2 * layers + 1
    for label in ("sample", "second_shape"):
        rows = {r["name"]: r for r in report.validation[label]}
        assert rows["last_hidden_state"]["ok"] and rows["last_hidden_state"]["max_abs_diff"] < 1e-5


def test_bert_cpu_fused_graph_has_no_skip_layer_normalization(bert_export, tmp_path):
    """``ort_fusions="cpu"``: the attention and GELU fusions stay, no ``SkipLayerNormalization`` is
    written (the rewrite runs for CUDA only) and the session does not fuse one either (the
    ``ort_kernel_fixes`` stage runs after the fusions); outputs equal the plain graph's within 1e-5."""
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, ort_fusions="cpu"))
    report = exporter.last_report
    layers = model.config.num_hidden_layers
    fused = report.extra["ort_fusions"]
    assert "skip_layer_normalization" not in fused["fused"]
    assert "com.microsoft.SkipLayerNormalization" not in fused["contrib_ops"]
    assert fused["contrib_ops"]["com.microsoft.Attention"] == layers
    assert report.extra["ort_kernel_fixes"] == {"keep_layer_norm_unfused": 2 * layers + 1}
    proto = ir.serde.serialize_model(program.model)
    run_ops = _ort_optimized_ops(proto, tmp_path)
    assert run_ops["SkipLayerNormalization"] == 0 and run_ops["LayerNormalization"] == 2 * layers + 1
    assert run_ops["Attention"] == layers
    feed = {k: v.numpy() for k, v in inputs.items() if k in {i.name for i in proto.graph.input}}
    plain = _ort_outputs(bert_export[1].model, feed)
    for got, expected in zip(_ort_outputs(program.model, feed), plain, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_skip_layer_normalization_fusion_runs_for_cuda_only(monkeypatch):
    """On the same optimized BERT graph (no kernel fixes), the CUDA fusions still write one
    ``SkipLayerNormalization`` per residual (the CUDA kernel is not the slow one) next to the
    ``Attention`` fusion; the CPU fusions write none."""
    from hfexport.testing import tiny_model
    from hfexport_onnx import fusions
    from hfexport_onnx.workarounds import ort_layer_norm

    entries = {p: [e.name for e in fusions.fusion_entries(p)] for p in fusions.PROVIDERS}
    name = "hfexport_onnx.fusions.fuse_skip_layer_normalization"
    assert name in entries["cuda"] and name not in entries["cpu"]
    monkeypatch.setattr(ort_layer_norm, "apply_ort_kernel_fixes", lambda model: {})
    model, inputs = tiny_model("bert")
    program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True))
    layers = model.config.num_hidden_layers
    proto = ir.serde.serialize_model(program.model)
    counts = {}
    for provider in fusions.PROVIDERS:
        graph = ir.serde.deserialize_model(proto)
        fusions.apply_ort_fusions(graph, provider)
        counts[provider] = fusions.contrib_op_counts(graph)
    assert counts["cuda"]["com.microsoft.SkipLayerNormalization"] == 2 * layers
    assert "com.microsoft.SkipLayerNormalization" not in counts["cpu"]
    assert counts["cuda"]["com.microsoft.Attention"] == counts["cpu"]["com.microsoft.Attention"] == layers


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


def _ort_optimized_ops(model_proto: onnx.ModelProto, tmp_path) -> collections.Counter:
    """Op counts of the graph an ONNX Runtime CPU session runs (default optimization level)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


def test_bert_int8_dynamic_graph_quantizes_the_rewritten_attention_graph(tmp_path):
    """int8-dynamic runs on the fixed graph: no NaN guard, one static key transpose per layer,
    ``MatMulInteger`` for every constant-weight projection (random weights have no GELU outlier
    channel, so nothing is split off), every ``Add -> LayerNormalization`` wrapped so the session
    keeps ``LayerNormalization`` instead of fusing ``SkipLayerNormalization``, and the gates met."""
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, quantization="int8-dynamic"))
    report = exporter.last_report
    quant = report.quantization
    ops = collections.Counter(n.op_type for n in program.model.graph.all_nodes())
    layers = model.config.num_hidden_layers
    assert ops["IsNaN"] == 0 and ops["Softmax"] == layers
    assert "kept_float" not in quant and quant["outlier_channels"] == {}
    # Q, K, V, attention output, FFN up and down per layer, + pooler
    assert ops["MatMulInteger"] == 6 * layers + 1, ops
    assert ops["MatMul"] == 2 * layers, ops  # attention scores and context stay float
    # embeddings + two per layer
    assert quant["ort_kernel_fixes"] == {"keep_layer_norm_unfused": 2 * layers + 1}
    wraps = collections.Counter(
        (n.op_type, n.inputs[0].producer().op_type)
        for n in program.model.graph
        if n.name.endswith(("_unfused_in", "_unfused_out"))
    )
    assert wraps == {("Unsqueeze", "Add"): 2 * layers + 1, ("Squeeze", "LayerNormalization"): 2 * layers + 1}
    run_ops = _ort_optimized_ops(ir.serde.serialize_model(program.model), tmp_path)
    assert run_ops["SkipLayerNormalization"] == 0 and run_ops["LayerNormalization"] == 2 * layers + 1
    for label in ("sample", "second_shape"):
        for row in report.validation[label]:
            assert row["ok"] and 0.99 <= row["cosine"] < 1.0, row  # quantized: close, not equal


def _planted_outlier_bert(channel: int = 5, shift: float = 40.0):
    """Tiny BERT whose first FFN has one GELU output channel ``shift`` above the rest on every token
    (its up-projection bias raised), like all-MiniLM-L6-v2's channels 856 / 607 / 1004 / 358."""
    import torch

    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    with torch.no_grad():
        model.encoder.layer[0].intermediate.dense.bias[channel] += shift
    return model, inputs


def _ort_outputs(model: ir.Model, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)


def _int8_dynamic(model: ir.Model, exclude: list[str], tmp_path) -> ir.Model:
    from onnxruntime import quantization as q

    src, dst = tmp_path / "float.onnx", tmp_path / "int8.onnx"
    ir.save(model, src)
    q.quantize_dynamic(
        src,
        dst,
        weight_type=q.QuantType.QInt8,
        per_channel=True,
        nodes_to_exclude=exclude,
        extra_options={"MatMulConstBOnly": True},
    )
    return ir.load(dst)


def test_outlier_channel_split_is_exact_in_float_and_narrows_the_int8_error(bert_export, tmp_path):
    """On the float graph with a GELU channel planted 40 above the rest, the split computes what the
    graph computes (float32 rounding only) and splits off that channel alone; quantized, it errs
    less than the same graph quantized whole (measured 1 - cosine 2e-5 against 5e-5 at shift 40)."""
    from hfexport.testing import tiny_model
    from hfexport_onnx.quantize import _gelu_ffn, split_outlier_channels

    _, program, _ = bert_export
    planted = ir.from_proto(ir.serde.serialize_model(program.model))  # a copy: the fixture is shared
    down = next(n for n in planted.graph if n.op_type == "MatMul" and _gelu_ffn(n) is not None)
    gelu, bias_add, _, bias = _gelu_ffn(down)
    raised = bias.const_value.numpy().copy()
    raised[5] += 40.0
    new_bias = ir.Value(name="planted_bias", const_value=ir.tensor(raised, name="planted_bias"))
    new_bias.shape, new_bias.dtype = ir.Shape(raised.shape), ir.DataType.FLOAT
    planted.graph.register_initializer(new_bias)  # its own value: layers may share a zero bias
    user = bias_add or gelu
    user.replace_input_with(list(user.inputs).index(bias), new_bias)
    _, inputs = tiny_model("bert")
    feed = {k: v.numpy() for k, v in inputs.items()}
    reference = _ort_outputs(planted, feed)
    whole = _int8_dynamic(planted, [], tmp_path)
    split, side = split_outlier_channels(planted, [feed])
    assert split == {down.name: [5]} and len(side) == 2
    for a, b in zip(_ort_outputs(planted, feed), reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def error(model: ir.Model) -> float:  # 1 - mean per-token cosine of last_hidden_state
        out, ref = _ort_outputs(model, feed)[0], reference[0]
        cos = (out * ref).sum(-1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(ref, axis=-1)
        return float(1.0 - cos.mean())

    assert error(_int8_dynamic(planted, side, tmp_path)) < 0.6 * error(whole)


@pytest.mark.extended  # one more export; the default run checks the same wiring on MiniLM's real weights
def test_int8_dynamic_computes_a_gelu_outlier_channel_in_float():
    """A planted GELU outlier channel (40 above the rest) is found on the sample inputs and runs in a
    float side path: two small float MatMuls, every projection still int8, the default gates met."""
    model, inputs = _planted_outlier_bert()
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, quantization="int8-dynamic"))
    report = exporter.last_report
    quant = report.quantization
    ops = collections.Counter(n.op_type for n in program.model.graph.all_nodes())
    layers = model.config.num_hidden_layers
    assert list(quant["outlier_channels"].values()) == [[5]] and quant["float_outlier_matmuls"] == 2
    assert ops["MatMulInteger"] == 6 * layers + 1, ops
    assert ops["MatMul"] == 2 * layers + 2, ops  # attention scores and context + the side path
    for label in ("sample", "second_shape"):
        for row in report.validation[label]:
            assert row["ok"] and 0.99 <= row["cosine"] < 1.0, row


def test_keep_layer_norm_unfused_stops_the_skip_layer_norm_fusion(tmp_path):
    """``Add -> LayerNormalization`` on ``[batch, seq, hidden]`` is fused into ORT's scalar-loop
    ``SkipLayerNormalization`` by a default CPU session; wrapped, the session keeps the vectorized
    ``LayerNormalization``, the output keeps its name and equals the unfused pair's exactly."""
    import onnxruntime as ort

    from hfexport_onnx.workarounds.ort_layer_norm import KIND, keep_layer_norm_unfused

    hidden = 16
    rng = np.random.default_rng(0)
    shape = ["batch", "seq", hidden]
    proto = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Add", ["x", "skip"], ["sum"]),
                helper.make_node(
                    "LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12
                ),
            ],
            "residual",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "skip")],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
            [
                onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "gamma"),
                onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "beta"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    assert _ort_optimized_ops(proto, tmp_path)["SkipLayerNormalization"] == 1  # what ORT does unaided
    model = ir.from_proto(proto)
    assert keep_layer_norm_unfused(model) == 1
    fixed = ir.serde.serialize_model(model)
    assert [o.name for o in fixed.graph.output] == ["y"]
    run_ops = _ort_optimized_ops(fixed, tmp_path)
    assert run_ops["SkipLayerNormalization"] == 0 and run_ops["LayerNormalization"] == 1
    feed = {n: rng.standard_normal((3, 5, hidden)).astype(np.float32) for n in ("x", "skip")}
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # no fusion: Add + LN
    expected = ort.InferenceSession(proto.SerializeToString(), basic, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got.run(None, feed)[0], expected.run(None, feed)[0])
    entry = registry.entries("onnx", kind=KIND)[0]
    assert entry.func is keep_layer_norm_unfused and entry.versions == {"onnxruntime": ">=1.22"}


def test_keep_layer_norm_unfused_leaves_a_residual_sum_read_elsewhere(tmp_path):
    """A pre-LN residual stream (GPT-2): the ``Add``'s sum feeds the ``LayerNormalization`` and the
    next residual ``Add``. ORT does not fuse that pair, so the fix leaves it unwrapped; a second
    call on a wrapped graph finds nothing either."""
    from hfexport_onnx.workarounds.ort_layer_norm import apply_ort_kernel_fixes

    hidden = 16
    rng = np.random.default_rng(1)
    shape = ["batch", "seq", hidden]
    proto = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Add", ["x", "skip"], ["sum"]),
                helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["normed"], axis=-1),
                helper.make_node("Add", ["sum", "normed"], ["y"]),
            ],
            "pre_ln",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "skip")],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
            [
                onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "gamma"),
                onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "beta"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    run_ops = _ort_optimized_ops(proto, tmp_path)
    assert run_ops["SkipLayerNormalization"] == 0 and run_ops["LayerNormalization"] == 1  # ORT: no fusion
    model = ir.from_proto(proto)
    assert apply_ort_kernel_fixes(model) == {"keep_layer_norm_unfused": 0}
    assert [n.op_type for n in model.graph] == ["Add", "LayerNormalization", "Add"]


def test_keep_layer_norm_unfused_leaves_a_normalization_whose_mean_is_read():
    """A ``LayerNormalization`` whose mean output is read would hand its reader the extra leading
    axis of the wrapped input: the fix leaves it alone."""
    from hfexport_onnx.workarounds.ort_layer_norm import keep_layer_norm_unfused

    hidden = 8
    shape = ["batch", "seq", hidden]
    proto = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Add", ["x", "skip"], ["sum"]),
                helper.make_node("LayerNormalization", ["sum", "gamma"], ["y", "mean"], axis=-1),
            ],
            "mean_read",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "skip")],
            [
                helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
                helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["batch", "seq", 1]),
            ],
            [onnx.numpy_helper.from_array(np.ones(hidden, np.float32), "gamma")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = ir.from_proto(proto)
    assert keep_layer_norm_unfused(model) == 0
    assert [n.op_type for n in model.graph] == ["Add", "LayerNormalization"]


def test_gpt2_cpu_fused_graph_gives_its_gemms_rank_2_inputs():
    """Tiny GPT-2 (``Conv1D``: flatten to 2-D + ``Gemm``) with ``ort_fusions="cpu"``: the
    MultiHeadAttention fusion hands the output projection's ``Gemm`` its 3-D output, which ONNX
    Runtime refused to load; each such ``Gemm`` gets a ``Reshape`` to rank 2 and the fused graph
    matches eager at both validation shapes."""
    from hfexport.testing import tiny_model
    from hfexport_onnx.fusions import gemm_inputs_to_rank_2

    model, inputs = tiny_model("gpt2", "feature-extraction")
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, ort_fusions="cpu"))
    report = exporter.last_report
    layers = model.config.n_layer
    assert report.extra["ort_fusions"]["contrib_ops"]["com.microsoft.MultiHeadAttention"] == layers
    gemms = [n for n in program.model.graph if n.op_type == "Gemm"]
    fed = [
        n for n in gemms if n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "Reshape"
    ]
    assert len(fed) == len(gemms) and any(n.name.endswith("_rank2") for n in program.model.graph)
    assert gemm_inputs_to_rank_2(program.model) == 0  # nothing left to repair
    for label in ("sample", "second_shape"):
        rows = {r["name"]: r for r in report.validation[label]}
        assert rows["last_hidden_state"]["ok"] and rows["last_hidden_state"]["max_abs_diff"] < 1e-5, rows
