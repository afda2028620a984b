"""``ort_fusions="cpu"`` on a GQA llama decoder graph: GroupQueryAttention with the rotary embedding
fused, checked by op counts and against eager PyTorch (also on a left-padded batch)."""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("onnxruntime")

# float32 parity of the fused graph with eager PyTorch: measured <= 3e-7 on logits and caches
ATOL = 1e-5


@pytest.fixture(scope="module")
def fused_llama():
    """A seeded GQA llama (hidden 64, 2 layers, 4 query / 2 key-value heads) as one fused decoder graph."""

    from hfexport.config import OnnxConfig
    from hfexport_onnx import OnnxExporter
    from hfexport_onnx.decoder_graph import DecoderWithPast, export_decoder_with_past

    model = _tiny_gqa_llama()
    exporter = OnnxExporter()
    graph = export_decoder_with_past(model, None, OnnxConfig(ort_fusions="cpu"), None, exporter=exporter)
    return model, graph, exporter.runner(graph.artifact), DecoderWithPast(model, 2)


def test_fused_llama_decoder_has_group_query_attention_and_rotary(fused_llama):
    _, graph, _, _ = fused_llama
    report = graph.report
    fusions = report.extra["ort_fusions"]
    assert fusions["fused"]["cached_gqa"] == 2 and "cached_gqa x2" in report.applied["ort_fusions"]
    assert fusions["fused"]["sibling_matmuls_cpu"] == 2  # gate/up of each layer packed
    assert fusions["contrib_ops"] == {
        "com.microsoft.GroupQueryAttention": 2,
        "com.microsoft.SkipSimplifiedLayerNormalization": 4,
    }
    nodes = list(graph.artifact.model.graph)
    ops = collections.Counter(n.op_type for n in nodes)
    # no unfused attention left: no softmax, no repeat_kv expansion, no cache Concat, no rotate-half
    assert ops["Softmax"] == ops["MultiHeadAttention"] == ops["SDPA"] == ops["Transpose"] == ops["Neg"] == 0
    assert ops["RotaryEmbedding"] == 0  # inside GroupQueryAttention
    # per layer: packed QKV, o_proj, packed gate/up, down_proj; + lm_head
    assert ops["MatMul"] == 9 and ops["Split"] == 2 and ops["SimplifiedLayerNormalization"] == 1
    for i, node in enumerate(n for n in nodes if n.op_type == "GroupQueryAttention"):
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs == {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "rotary_interleaved": 0}
        packed = node.inputs[0]
        assert packed.producer().op_type == "MatMul" and packed.shape[2] == (4 + 2 * 2) * 16
        assert node.inputs[1] is None and node.inputs[2] is None
        assert [node.inputs[3].name, node.inputs[4].name] == [
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
        ]
        assert [v.name for v in node.outputs[1:]] == [f"present.{i}.key", f"present.{i}.value"]
        seqlens_k, total = node.inputs[5], node.inputs[6]
        assert seqlens_k.dtype.name == "INT32" and total.dtype.name == "INT32"
        assert node.inputs[9].name == "position_ids"
        assert node.inputs[10] is not None  # the model's mask as attention_bias


def test_fused_llama_decoder_matches_eager_at_prefill_and_decode(fused_llama):
    _, graph, _, _ = fused_llama
    for label in ("sample", "prefill_empty_past", "decode_step"):
        rows = {r["name"]: r for r in graph.report.validation[label]}
        assert set(rows) == {"logits"} | {f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")}
        for name, row in rows.items():
            assert row["ok"] and row["max_abs_diff"] <= ATOL, (label, name, row)


def _compare(eager, fused, valid):
    """Max abs diff of logits over ``valid`` query positions and of the caches over valid cache positions."""
    query = valid[:, -eager["logits"].shape[1] :]
    diffs = {"logits": (eager["logits"] - fused["logits"]).abs()[query].max().item()}
    for i, layer in enumerate(eager["present"]):
        for kv in ("key", "value"):
            diff = (layer[kv] - fused[f"present.{i}.{kv}"]).abs().amax(dim=(1, 3))  # [batch, positions]
            diffs[f"present.{i}.{kv}"] = diff[valid].max().item()
    return diffs


def test_fused_llama_decoder_matches_eager_on_a_left_padded_batch(fused_llama):
    """The fused graph keeps the model's mask and positions: a left-padded prompt, then a decode step,
    match eager on every non-padding position (padding query rows are not compared)."""
    _, _, run, wrapper = fused_llama
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    empty = [{"key": torch.zeros(2, 2, 0, 16), "value": torch.zeros(2, 2, 0, 16)} for _ in range(2)]
    prefill = {
        "input_ids": torch.randint(0, 128, (2, 5), generator=gen),
        "attention_mask": mask,
        "position_ids": positions,
        "past_key_values": empty,
    }
    with torch.no_grad():
        eager = wrapper(**prefill)
    diffs = _compare(eager, run(prefill), mask.bool())
    assert max(diffs.values()) <= ATOL, diffs

    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    step = {
        "input_ids": torch.randint(0, 128, (2, 1), generator=gen),
        "attention_mask": mask,
        "position_ids": positions[:, -1:] + 1,
        "past_key_values": [{"key": p["key"], "value": p["value"]} for p in eager["present"]],
    }
    with torch.no_grad():
        eager = wrapper(**step)
    fused = run(step)
    diffs = _compare(eager, fused, torch.ones_like(mask, dtype=torch.bool))  # past copied, new row valid
    assert max(diffs.values()) <= ATOL, diffs
    assert fused["present.0.key"].shape == (2, 2, 6, 16)


@pytest.mark.extended
def test_float16_llama_decoder_fuses_group_query_attention():
    """A float16 model computes cos/sin in float32 and casts them: the rewrite still matches, and the
    fused graph stays as close to eager as the unfused float16 graph (measured <= 5e-4 on logits)."""

    from hfexport.config import OnnxConfig
    from hfexport_onnx.decoder_graph import export_decoder_with_past

    model = _tiny_gqa_llama().half()
    graph = export_decoder_with_past(model, None, OnnxConfig(ort_fusions="cpu", atol=1e-2, rtol=1e-2), None)
    assert graph.report.extra["ort_fusions"]["contrib_ops"]["com.microsoft.GroupQueryAttention"] == 2
    for label in ("sample", "prefill_empty_past", "decode_step"):
        for row in graph.report.validation[label]:
            assert row["ok"] and row["max_abs_diff"] <= 2e-3, (label, row)


def test_cached_gqa_refuses_an_unknown_rotary_mode():
    from hfexport_onnx.gqa import fuse_cached_gqa

    with pytest.raises(ValueError, match=r"rotary='inside' is invalid; allowed: separate, gqa"):
        fuse_cached_gqa(object(), rotary="inside")


def _tiny_gqa_llama():
    """Seeded random llama with grouped-query attention: hidden 64, 2 layers, 4 heads / 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()
