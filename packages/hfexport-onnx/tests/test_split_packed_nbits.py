"""``split_packed_nbits``: a packed ``MatMulNBits`` + ``Split`` becomes one ``MatMulNBits`` per part,
with bit-identical outputs (issue 27: the Split cost more than the launch it saved in int4 decode)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from hfexport_onnx.quantize import split_packed_nbits

ort = pytest.importorskip("onnxruntime")

K, BLOCK, SIZES = 64, 32, (48, 80)


def _packed_model(symmetric: bool):
    rng = np.random.default_rng(0)
    n, blocks = sum(SIZES), K // BLOCK
    weights = rng.integers(0, 256, size=(n, blocks, BLOCK // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=n * blocks).astype(np.float32)
    inputs = ["x", "B", "scales"]
    inits = [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "scales")]
    if not symmetric:  # 4-bit zero points, two per byte: [N * ceil(blocks / 2)]
        zp = rng.integers(0, 256, size=n * ((blocks + 1) // 2), dtype=np.uint8)
        inits.append(numpy_helper.from_array(zp, "zp"))
        inputs.append("zp")
    inits.append(numpy_helper.from_array(np.asarray(SIZES, dtype=np.int64), "sizes"))
    nodes = [
        helper.make_node(
            "MatMulNBits",
            inputs,
            ["y"],
            name="packed",
            domain="com.microsoft",
            K=K,
            N=n,
            bits=4,
            block_size=BLOCK,
        ),
        helper.make_node("Split", ["y", "sizes"], ["a", "b"], axis=-1),
        helper.make_node("Relu", ["a"], ["ra"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, K])],
        [
            helper.make_tensor_value_info("ra", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, None),
        ],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("symmetric", [True, False])
def test_split_packed_nbits_gives_the_same_outputs_per_part(symmetric):
    model = _packed_model(symmetric)
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
    before = _run(model, x)
    assert split_packed_nbits(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMulNBits", "MatMulNBits", "Relu"]
    assert [
        helper.get_attribute_value(a) for n in model.graph.node[:2] for a in n.attribute if a.name == "N"
    ] == list(SIZES)
    assert {i.name for i in model.graph.initializer}.isdisjoint({"B", "scales", "zp"})  # old tensors dropped
    after = _run(model, x)
    assert after[0].shape == (1, 3, SIZES[0]) and after[1].shape == (1, 3, SIZES[1])
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_split_packed_nbits_leaves_a_split_of_another_op_alone():
    model = _packed_model(True)
    model.graph.node[1].input[0] = "x"  # Split(x): not a MatMulNBits output
    assert split_packed_nbits(model) == 0
