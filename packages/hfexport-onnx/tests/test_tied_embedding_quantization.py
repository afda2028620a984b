"""``int4-weight`` on a tied language model: the word embedding is gathered from the LM head's
quantized blocks (``GatherBlockQuantized``, as ONNX Runtime GenAI's builder writes tied weights)
instead of a second, int8 copy of the table; ``embedding_bits`` picks the shared head's bits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfexport import AutoHfExporter, OnnxConfig
from hfexport.config import QuantizationConfig

VOCAB, HIDDEN = 2048, 64


def _tied_llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _export(
    embedding_bits: int | None,
    ort_fusions: str | None = "cpu",
    dtype: str | None = None,
    dynamic: bool = True,
):
    model, inputs = _tied_llama()
    # a random-weight model: its arg-max is noise under 4-bit rounding, so top-1 is not gated
    config = OnnxConfig(
        dynamic=dynamic,
        ort_fusions=ort_fusions,
        quantization=QuantizationConfig("int4-weight", embedding_bits=embedding_bits),
        quality_gates={"top1_agreement": 0.0},
        dtype=dtype,
    )
    exporter = AutoHfExporter.from_config(config)
    program = exporter.export(model, inputs)
    return program.model, exporter.last_report


@pytest.mark.parametrize(("embedding_bits", "bits"), [(None, 8), (4, 4)])
def test_a_tied_embedding_is_gathered_from_the_heads_blocks(embedding_bits, bits):
    model, report = _export(embedding_bits)
    ops = Counter(n.op_type for n in model.graph)
    assert ops["GatherBlockQuantized"] == 1 and ops["Gather"] + ops["DequantizeLinear"] == 0
    tied = report.quantization["tied_embedding"]
    assert tied["bits"] == bits
    gather = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.attributes["N"].value == VOCAB)
    assert gather.attributes["bits"].value == head.attributes["bits"].value == bits
    assert gather.inputs[2] is head.inputs[2]  # one set of scales, read by both
    # no table of the vocabulary is stored twice, in float or in int8
    tables = [v for v in model.graph.initializers.values() if VOCAB in tuple(v.shape or ())]
    assert len(tables) == 2, [(v.name, v.shape) for v in tables]  # the head's blocks and its scales
    # validated against eager (cosine gates of a 4-bit method) in ONNX Runtime at two shapes
    assert report.validation and all(row["ok"] for rows in report.validation.values() for row in rows)


def test_four_bit_shared_head_is_smaller_and_an_untied_model_keeps_its_int8_embedding():
    eight = _export(None)[1].quantization["weights_bytes_after"]
    four = _export(4)[1].quantization["weights_bytes_after"]
    # the head's [2048, 64] weight: 8 bits -> 4 bits saves about 2048 * 64 / 2 bytes
    assert eight - four == pytest.approx(VOCAB * HIDDEN / 2, rel=0.05)
    model, inputs = _tied_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    exporter = AutoHfExporter.from_config(
        OnnxConfig(dynamic=True, quantization="int4-weight", quality_gates={"top1_agreement": 0.0})
    )
    program = exporter.export(model, inputs)
    assert exporter.last_report.quantization.get("tied_embedding") is None
    ops = Counter(n.op_type for n in program.model.graph)
    assert ops["GatherBlockQuantized"] == 0 and ops["DequantizeLinear"] >= 1  # the int8 table
    assert (
        np.dtype(
            next(
                v for v in program.model.graph.initializers.values() if v.name.endswith("_int8")
            ).dtype.numpy()
        )
        == np.int8
    )


def test_without_ort_fusions_the_folded_transpose_is_found_tied_too():
    model, report = _export(None, ort_fusions=None)
    assert report.quantization["tied_embedding"]["bits"] == 8
    assert Counter(n.op_type for n in model.graph)["GatherBlockQuantized"] == 1


def test_float16_q4f16_graph_shares_the_tied_embedding_with_float16_scales():
    """``dtype="float16"`` + ``int4-weight`` (transformers.js's q4f16): the float16 table is gathered
    from the 8-bit head's blocks too, all scales float16, float16 in and out; validated in ONNX
    Runtime against fp32 eager with the 4-bit gates."""
    import onnx_ir as ir

    model, report = _export(None, ort_fusions=None, dtype="float16", dynamic=False)  # static: seconds
    ops = Counter(n.op_type for n in model.graph)
    assert ops["GatherBlockQuantized"] == 1 and ops["Gather"] == 0
    assert report.quantization["tied_embedding"]["bits"] == 8
    nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 7 + 1  # 7 projections per layer + the head
    assert {n.inputs[2].dtype for n in nbits} == {ir.DataType.FLOAT16}
    assert model.graph.outputs[0].dtype == ir.DataType.FLOAT16
    # no float table left: [2048, 64] float16 would be 256 KiB; the 4/8-bit weights are uint8
    assert not [
        v.name
        for v in model.graph.initializers.values()
        if v.dtype == ir.DataType.FLOAT16 and VOCAB in tuple(v.shape or ())
    ][1:]
    logits = report.validation["sample"][0]
    assert logits["name"] == "logits" and logits["dtype"] == "torch.float16" and logits["cosine"] >= 0.98


@pytest.mark.extended  # 16-100 s: the long tail (nox -s integration)
def test_an_untied_float16_embedding_becomes_int8_with_a_float16_scale():
    import onnx_ir as ir

    model, inputs = _tied_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    exporter = AutoHfExporter.from_config(
        OnnxConfig(
            dynamic=True, dtype="float16", quantization="int4-weight", quality_gates={"top1_agreement": 0.0}
        )
    )
    program = exporter.export(model, inputs)
    assert exporter.last_report.quantization["int8_embeddings"]
    dq = next(n for n in program.model.graph if n.op_type == "DequantizeLinear")
    table = dq.inputs[0].producer().inputs[0]  # Gather(int8 table, ids) -> DequantizeLinear
    assert table.dtype == ir.DataType.INT8 and tuple(table.shape) == (VOCAB, HIDDEN)
    assert dq.inputs[1].dtype == ir.DataType.FLOAT16
    assert dq.outputs[0].dtype == ir.DataType.FLOAT16
