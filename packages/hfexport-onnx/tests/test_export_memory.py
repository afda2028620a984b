"""Peak memory of an ONNX export (issue 27: at most ONNX Runtime GenAI's builder's).

- ``int4-weight`` / ``int8-weight`` write ``MatMulNBits`` in place on the ``onnx_ir`` model
  (:func:`hfexport_onnx.quantize.matmul_nbits_in_place`): the blocks, scales, zero points, names
  and attributes are those of ONNX Runtime's ``MatMulNBitsQuantizer`` (bit-identical, the same
  MLAS kernel), and each float weight is released as soon as it is quantized;
- packed projections (q/k/v, gate/up) are computed when read, never stored next to their parts;
- the validation session reads a large model from a file with external data, the save appends the
  weights one tensor at a time: the outputs are the same as from serialized bytes.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfexport import AutoHfExporter, OnnxConfig
from hfexport.config import QuantizationConfig
from hfexport_onnx import quantize as q

ort = pytest.importorskip("onnxruntime")


def _session(model: onnx.ModelProto) -> object:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _matmul_model(shapes: list[tuple[int, int]], seed: int = 0) -> ir.Model:
    """``x [2, K0]`` through a chain of MatMuls with float32 weights ``shapes`` (numpy-backed:
    owned by the graph alone)."""
    rng = np.random.default_rng(seed)
    x = ir.Value(name="x", shape=ir.Shape([2, shapes[0][0]]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="g")
    current = x
    for i, (k, n) in enumerate(shapes):
        weight = ir.Value(name=f"w{i}", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.FLOAT))
        weight.const_value = ir.tensor(rng.standard_normal((k, n)).astype(np.float32), name=f"w{i}")
        graph.register_initializer(weight)
        node = ir.Node("", "MatMul", [current, weight], name=f"mm{i}")
        graph.append(node)
        current = node.outputs[0]
        current.name, current.dtype, current.shape = f"y{i}", ir.DataType.FLOAT, ir.Shape([2, n])
    graph.outputs.append(current)
    return ir.Model(graph, ir_version=10)


# K = 96 is not a multiple of block 64: the rows are zero-padded to a whole block, as ORT pads them
SHAPES = [(96, 64), (64, 80), (80, 32)]


@pytest.mark.parametrize(
    ("bits", "block", "symmetric", "level"),
    [(4, 32, True, 4), (4, 64, False, 0), (8, 16, True, 4), (8, 32, False, 1)],
)
def test_matmul_nbits_in_place_is_onnxruntimes_quantizer_bit_for_bit(bits, block, symmetric, level):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = _matmul_model(SHAPES)
    reference = ir.to_proto(model)
    quantizer = MatMulNBitsQuantizer(
        reference,
        bits=bits,
        block_size=block,
        is_symmetric=symmetric,
        accuracy_level=level or None,
        nodes_to_exclude=["mm2"],
    )
    quantizer.process()
    reference = quantizer.model.model

    counts = q.matmul_nbits_in_place(
        model, bits=bits, block_size=block, symmetric=symmetric, accuracy_level=level, exclude=["mm2"]
    )
    assert counts == {4: 2 if bits == 4 else 0, 8: 2 if bits == 8 else 0}
    ours = ir.to_proto(model)
    expected = {t.name: onnx.numpy_helper.to_array(t) for t in reference.graph.initializer}
    got = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
    assert sorted(got) == sorted(expected)  # w0, w1 gone; w2 (excluded) kept; _Q, _scales(, _zero_points)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)

    def nodes(proto):
        return [
            (
                n.name,
                n.op_type,
                n.domain,
                list(n.input),
                {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute},
            )
            for n in proto.graph.node
        ]

    assert nodes(ours) == nodes(reference)
    x = np.random.default_rng(1).standard_normal((2, SHAPES[0][0])).astype(np.float32)
    np.testing.assert_array_equal(
        _session(ours).run(None, {"x": x})[0], _session(reference).run(None, {"x": x})[0]
    )


def test_each_float_weight_is_released_as_soon_as_it_is_quantized(monkeypatch):
    model = _matmul_model([(64, 64)] * 4)
    arrays = [weakref.ref(v.const_value.numpy()) for v in model.graph.initializers.values()]
    alive_at_call = []
    kernel = q._block_quantize

    def watched(array, *args, **kwargs):
        gc.collect()
        # the weight being quantized and those after it are alive; every earlier one is gone
        alive_at_call.append(sum(ref() is not None for ref in arrays))
        return kernel(array, *args, **kwargs)

    monkeypatch.setattr(q, "_block_quantize", watched)
    q.matmul_nbits_in_place(model, bits=4, block_size=32, symmetric=True, accuracy_level=4)
    gc.collect()
    assert alive_at_call == [4, 3, 2, 1]
    assert all(ref() is None for ref in arrays)
    assert sorted(model.graph.initializers) == sorted(f"w{i}_{s}" for i in range(4) for s in ("Q4", "scales"))


VOCAB = 2048


def _tied_llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(config).eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def fused_llama() -> onnx.ModelProto:
    """A tied tiny llama exported with the CPU fusions (packed q/k/v and gate/up), float32."""
    model, inputs = _tied_llama()
    exporter = AutoHfExporter.from_config(OnnxConfig(dynamic=True, ort_fusions="cpu", validate=False))
    program = exporter.export(model, inputs)
    packed = [v for v in program.model.graph.initializers.values() if v.name.endswith("_packed")]
    # computed when read: the graph stores no concatenated copy of its projections
    assert packed and all(isinstance(v.const_value, ir.LazyTensor) for v in packed)
    return ir.to_proto(program.model), {k: v.numpy() for k, v in inputs.items()}


def _previous_path(base: onnx.ModelProto, embedding_bits: int | None) -> onnx.ModelProto:
    """The int4-weight path before the in-place rewrite: the graph steps, then ORT's
    ``MatMulNBitsQuantizer`` on a ``ModelProto`` (4-bit, then 8-bit for the head), then the proto
    versions of :func:`split_packed_nbits` and :func:`share_tied_embedding`."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = ir.from_proto(copy.deepcopy(base))
    q._gemm_to_matmul(model)
    q._fold_weight_transposes(model)
    tied = q.tied_embedding(model)
    q.quantize_embeddings(model, [tied[0]])
    eight = [*q.ffn_up_nodes(model), *(q.lm_head_nodes(model) if embedding_bits != 4 else [])]
    proto = ir.to_proto(model)
    common = {"block_size": 32, "is_symmetric": True, "accuracy_level": 4}
    quantizer = MatMulNBitsQuantizer(proto, bits=4, nodes_to_exclude=eight, **common)
    quantizer.process()
    proto = quantizer.model.model
    if eight:
        four = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in eight]
        quantizer = MatMulNBitsQuantizer(proto, bits=8, nodes_to_exclude=four, **common)
        quantizer.process()
        proto = quantizer.model.model
    assert q.split_packed_nbits(proto) == 4  # q/k/v and gate/up of two layers
    assert q.share_tied_embedding(proto, tied[0], tied[1], block=32) == (embedding_bits or 8)
    return proto


@pytest.mark.parametrize("embedding_bits", [None, 4])
def test_tiny_llama_int4_equals_the_previous_quantizer_path(fused_llama, embedding_bits):
    base, feeds = fused_llama
    reference = _previous_path(base, embedding_bits)
    model, facts = q.quantize_ir_model(
        ir.from_proto(copy.deepcopy(base)), QuantizationConfig("int4-weight", embedding_bits=embedding_bits)
    )
    assert facts["split_packed_nbits"] == 4 and facts["tied_embedding"]["bits"] == (embedding_bits or 8)
    ours = ir.to_proto(model)
    expected = {t.name: onnx.numpy_helper.to_array(t) for t in reference.graph.initializer}
    got = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
    # the same tensors, bit for bit; the Split sizes the previous path left unused are gone
    assert set(expected) - set(got) == {n for n in expected if n.endswith("_packed_sizes")}
    assert set(got) <= set(expected)
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert [(n.name, n.op_type) for n in ours.graph.node] == [
        (n.name, n.op_type) for n in reference.graph.node
    ]
    out_ours, out_ref = _session(ours).run(None, feeds), _session(reference).run(None, feeds)
    assert len(out_ours) == len(out_ref) == 5  # logits + 2 layers x key/value
    for a, b in zip(out_ours, out_ref):
        np.testing.assert_array_equal(a, b)


def test_large_models_reach_onnxruntime_and_disk_without_a_whole_proto(fused_llama, tmp_path, monkeypatch):
    import hfexport_onnx.exporter as exporter_module
    import hfexport_onnx.runtime as runtime
    from hfexport_onnx.runtime import OnnxRuntimeRunner

    base, feeds = fused_llama
    ids = torch.from_numpy(feeds["input_ids"])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    from_bytes = OnnxRuntimeRunner(ir.from_proto(base))
    assert from_bytes._tmpdir is None
    monkeypatch.setattr(runtime, "EXTERNAL_DATA_MIN_BYTES", 0)
    from_file = OnnxRuntimeRunner(ir.from_proto(base))
    assert from_file._tmpdir is not None  # model.onnx + model.onnx.data in a temporary folder
    expected, got = from_bytes(kwargs), from_file(kwargs)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)

    program = type("Program", (), {})()
    program.model = ir.from_proto(base)
    program.save = lambda path, **kw: torch.onnx.ONNXProgram(program.model, None).save(path, **kw)
    exporter = AutoHfExporter.from_config(OnnxConfig(external_data=False))
    monkeypatch.setattr(exporter_module, "EXTERNAL_DATA_MIN_BYTES", 0)
    exporter.save(program, tmp_path / "streamed.onnx")
    monkeypatch.setattr(exporter_module, "EXTERNAL_DATA_MIN_BYTES", 2**62)
    exporter.save(program, tmp_path / "whole.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed.onnx", "whole.onnx"]  # weights inside
    streamed, whole = onnx.load(tmp_path / "streamed.onnx"), onnx.load(tmp_path / "whole.onnx")
    assert [t.name for t in streamed.graph.initializer] == [t.name for t in whole.graph.initializer]
    for a, b in zip(streamed.graph.initializer, whole.graph.initializer):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    assert list(streamed.graph.node) == list(whole.graph.node)
    assert sorted(v.name for v in streamed.graph.value_info) == sorted(v.name for v in whole.graph.value_info)
    for a, b in zip(_session(streamed).run(None, feeds), _session(whole).run(None, feeds)):
        np.testing.assert_array_equal(a, b)


def test_validation_sessions_read_the_models_own_weights(fused_llama, monkeypatch):
    """OnnxExporter.runner shares a large in-memory model's weights with ONNX Runtime
    (add_initializer: no session copy) and, for a float graph, turns prepacking off (it would copy
    every MatMul weight): the outputs are bit-identical to a session that holds its own weights."""
    import hfexport_onnx.runtime as runtime
    from hfexport_onnx.runtime import OnnxRuntimeRunner

    base, feeds = fused_llama
    model = ir.from_proto(base)
    for value in model.graph.initializers.values():  # in memory as numpy, as translation leaves them
        value.const_value = ir.Tensor(np.ascontiguousarray(value.const_value.numpy()), name=value.name)
    monkeypatch.setattr(runtime, "EXTERNAL_DATA_MIN_BYTES", 0)
    monkeypatch.setattr(runtime, "_SHARE_MIN_BYTES", 1024)
    own = OnnxRuntimeRunner(model)
    shared = OnnxRuntimeRunner(model, share_weights=True)
    big = {n for n, v in model.graph.initializers.items() if v.const_value.nbytes >= 1024}
    assert len(shared._shared) == len(big) > 4
    for array, _ in shared._shared:  # the model's own buffers, not copies
        assert any(np.shares_memory(array, model.graph.initializers[n].const_value.raw) for n in big)
    options = shared.session.get_session_options()
    assert options.get_session_config_entry("session.disable_prepacking") == "1"
    with pytest.raises(RuntimeError, match="does not have configuration with key"):
        own.session.get_session_options().get_session_config_entry("session.disable_prepacking")
    ids = torch.from_numpy(feeds["input_ids"])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    expected, got = own(kwargs), shared(kwargs)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    # a quantized kernel's prepacking picks its compute path (MatMulNBits accuracy_level): kept on
    next(iter(model.graph)).op_type = "MatMulNBits"
    kept = shared._share_weights(model, None)
    with pytest.raises(RuntimeError, match="does not have configuration with key"):
        kept.get_session_config_entry("session.disable_prepacking")
