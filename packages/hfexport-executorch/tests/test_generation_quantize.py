"""Quantized generation exports: ``export_for_generation`` and the ``llm-runner`` layout honour
``ExecutorchConfig.quantization``.

The source model is quantized once (:meth:`ExecutorchExporter.generation_source`) and every
component (``prefill``, ``decode``) is captured from that copy, then gated against the fp32 eager
model (top-1 of the logits, the looser cache gate) with the greedy tokens compared with
``model.generate``. Real weights only (quality is meaningless on random ones): IgLM-S (GPT-2, 3
layers) by default, IgLM (12.9M) extended; both copied into a temporary folder by
:func:`hfexport.testing.folders.package_model_folder` (never into the repository).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from hfexport.config import ExecutorchConfig
from hfexport.linear_forms import weight_bytes
from hfexport.quality import CACHE_COSINE_GATE, default_quality_gates, score_outputs, top1_gate_applies
from hfexport.testing.folders import package_model_folder
from hfexport_executorch import ExecutorchExporter

PROMPT = "[HEAVY] [HUMAN] EVQLVESGGGLVQPGGSLRLSCAAS"


def _load(name: str, dest: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = package_model_folder(name, dest)
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT, add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return folder, model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# -- unit: the pieces the fix rests on ---------------------------------------------------------------
def test_a_deepcopy_under_output_flags_runs_its_own_weights() -> None:
    # root cause of the dropped quantization: the return_dict forward wrapper closed over the
    # original model, so a copy taken inside apply_output_flags (a backend's quantized copy) ran
    # the original's weights
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfexport.inputs import apply_output_flags

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)).eval()
    ids = torch.arange(6).unsqueeze(0)
    with apply_output_flags(model, {"return_dict": True, "use_cache": False}), torch.no_grad():
        twin = copy.deepcopy(model)
        twin.lm_head.weight.data.zero_()
        assert torch.count_nonzero(twin(input_ids=ids).logits) == 0
        assert torch.count_nonzero(model(input_ids=ids).logits) > 0
    assert "forward" not in model.__dict__


def test_kv_cache_outputs_of_a_language_model_get_the_looser_cache_gate() -> None:
    gates = default_quality_gates("float32", "8da4w")
    assert gates == {"cosine": 0.98, "top1_agreement": 0.9, "cache_cosine": 0.5} and CACHE_COSINE_GATE == 0.9
    torch.manual_seed(0)
    logits = torch.randn(1, 12, 11)  # 12 positions: enough for the top-1 gate (top1_gate_applies)
    keys = torch.randn(1, 2, 12, 8)
    noisy = keys + 0.35 * torch.randn_like(keys)  # mean per-vector cosine ~0.94
    expected = {"logits": logits, "cache.layers.0.keys": keys}
    rows = score_outputs(expected, {"logits": logits, "cache.layers.0.keys": noisy}, gates=gates)
    assert rows[0].gates == {"cosine": 0.98, "top1_agreement": 0.9} and rows[0].ok
    assert rows[1].gates == {"cosine": 0.5} and 0.9 < rows[1].cosine < 0.98 and rows[1].ok
    # an 8-bit method keeps the 0.9 cache gate; an explicit cache_cosine gate replaces it
    eight = score_outputs(
        expected,
        {"logits": logits, "cache.layers.0.keys": noisy},
        gates=default_quality_gates("float32", "8w"),
    )
    assert eight[1].gates == {"cosine": 0.9} and eight[1].ok
    strict = score_outputs(
        expected, {"logits": logits, "cache.layers.0.keys": noisy}, gates={**gates, "cache_cosine": 0.97}
    )
    assert strict[1].gates == {"cosine": 0.97} and not strict[1].ok
    broken = score_outputs(
        expected, {"logits": logits, "cache.layers.0.keys": torch.randn_like(keys)}, gates=gates
    )
    assert not broken[1].ok and broken[1].failures[0].startswith("cosine = ")
    # without token logits (an encoder's hidden states) every float output keeps the full gate
    plain = score_outputs({"cache.layers.0.keys": keys}, {"cache.layers.0.keys": noisy}, gates=gates)
    assert plain[0].gates["cosine"] == 0.98 and not plain[0].ok
    # a lower cosine gate (the benchmark's 0.0) is never tightened for the cache
    assert score_outputs(expected, {"logits": logits, "cache.layers.0.keys": noisy}, gates={"cosine": 0.0})[
        1
    ].gates == {"cosine": 0.0}


# -- export_for_generation ---------------------------------------------------------------------------
def _check_quantized_generation(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from hfexport.generation import save_components
    from hfexport_executorch import quantize

    _, model, inputs = _load(name, tmp_path / "model")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    calls = []
    real = quantize.quantize_copy
    monkeypatch.setattr(quantize, "quantize_copy", lambda m, q: calls.append(type(m).__name__) or real(m, q))

    exporter = ExecutorchExporter()
    parts = exporter.export_for_generation(
        model, inputs, ExecutorchConfig(dynamic=True, quantization="8da4w")
    )
    assert list(parts) == ["prefill", "decode"]
    assert calls == ["GPT2LMHeadModel"]  # one quantized copy shared by both components

    # the user's model is untouched: fp32 Conv1D weights, no leftover forward wrapper
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert {
        n: type(m).__name__ for n, m in model.named_modules()
    } == kinds and "forward" not in model.__dict__

    written = save_components(exporter, parts, tmp_path / "gen", model=model)
    sizes = {Path(p).stem: Path(p).stat().st_size for p in written if str(p).endswith(".pte")}
    fp32 = weight_bytes(model)
    facts: dict = {"sizes": sizes, "fp32_weight_bytes": fp32, "reports": {}}
    for component, report in parts.reports.items():
        quant = report.quantization
        assert quant["method"] == "8da4w" and quant["shared_by_components"] is True
        assert quant["weight_bytes_before"] == fp32
        assert quant["artifact_bytes"] == sizes[component]
        assert sizes[component] / fp32 < 0.5 and quant["size_ratio"] < 0.5, (
            component,
            sizes[component],
            fp32,
        )
        assert quant["linear"] == model.config.n_layer * 4 + 1  # c_attn, c_proj, c_fc, mlp.c_proj + lm_head
        assert quant["ops"]["delegated_quantized_linear"] > 0, quant["ops"]
        # gated against fp32 eager: top-1 of the logits, the cache at the cache gate
        rows = {r["name"]: r for r in report.validation["sample"]}
        logits = rows["logits"]
        # top-1 is gated over enough positions only (the decode step's few tokens: recorded, not gated)
        gated = {"cosine": 0.98} | (
            {"top1_agreement": 0.9} if top1_gate_applies(0.9, logits["compared"]) else {}
        )
        assert logits["kind"] == "quality" and logits["gates"] == gated, (component, logits)
        assert logits["ok"] and (logits["top1_agreement"] >= 0.9 or "top1_agreement" not in gated), logits
        caches = [r for n, r in rows.items() if n.startswith("cache.")]
        assert len(caches) == 2 * model.config.n_layer
        assert all(r["gates"] == {"cosine": CACHE_COSINE_GATE} and r["ok"] for r in caches)
        # quantized for real: the logits are not fp32's to the last bit
        assert logits["max_abs_diff"] > 1e-3, logits
        facts["reports"][component] = {"top1": logits["top1_agreement"], "cosine": logits["cosine"]}
    parity = parts.reports["decode"].greedy_parity
    assert "error" not in parity, parity
    assert parity["new_tokens"] == 16 and len(parity["sequence"]) == len(parity["reference"]) == 16
    assert 0 <= parity["matching_prefix"] <= 16
    assert (parity["first_divergence"] is None) == (parity["matching_prefix"] == 16) == parity["tokens_equal"]
    assert parity["top1_agreement"] is not None and 0.0 <= parity["top1_agreement"] <= 1.0
    facts["greedy_parity"] = parity
    return facts


@pytest.mark.extended  # two XNNPACK 8da4w lowerings of real weights: minutes on 2 cores (the unit tests
# above catch the root cause, a copy running the original's weights, in the default run)
def test_8da4w_generation_export_of_real_gpt2_is_quantized_and_gated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts = _check_quantized_generation("iglm/IgLM-S", tmp_path, monkeypatch)
    # measured on IgLM-S: both .pte files ~0.26x of the fp32 weights (small model: the fp32
    # embeddings, 512 x 192 positions + 33 x 192 tokens, weigh more than in IgLM)
    assert all(size / facts["fp32_weight_bytes"] < 0.4 for size in facts["sizes"].values()), facts


@pytest.mark.extended
def test_8da4w_generation_export_of_real_gpt2_iglm_quarter_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts = _check_quantized_generation("iglm/IgLM", tmp_path, monkeypatch)
    assert all(size / facts["fp32_weight_bytes"] <= 0.25 for size in facts["sizes"].values()), facts
    assert all(r["top1"] >= 0.9 for r in facts["reports"].values()), facts


# -- llm-runner layout ---------------------------------------------------------------------------------
@pytest.mark.extended  # a 512-position static-cache program: minutes of lowering, like the fp32 IgLM-S runner test
def test_llm_runner_layout_honours_quantize_8da4w(tmp_path: Path) -> None:
    from hfexport.testing.invoke import export_layout

    folder, model, _ = _load("iglm/IgLM-S", tmp_path / "model")
    out = tmp_path / "out"
    result = export_layout(
        "executorch", folder, out, layout="llm-runner", task="text-generation", extra=["--quantize", "8da4w"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "export_report.json").read_text())
    size = (out / "model.pte").stat().st_size
    assert size / weight_bytes(model) < 0.5, size
    sequence = report["sequence_validation"]
    assert sequence["gates"] == {"cosine": 0.98, "top1_agreement": 0.9}
    assert sequence["top1_agreement"] == 1.0, sequence
    assert all(step["cosine"] >= 0.98 for step in sequence["steps"]), sequence
    assert max(step["max_abs_diff"] for step in sequence["steps"]) > 1e-3  # quantized for real
    text = json.dumps(report)
    assert '"delegated_quantized_linear"' in text and '"method": "8da4w"' in text
