"""Decomposition into prefill/decode from one real ``generate`` call."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, StaticCache

from hfexport.generation import decompose_for_generation, decompose_prefill_decode
from hfexport.generation.recording import normalise_call, padding_mask_for_call
from hfexport.registry import apply_patches, entries
from hfexport.testing import tiny_model
from hfexport.workarounds.generation import BACKEND


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_normalise_call_names_positional_arguments_and_drops_output_selectors() -> None:
    linear = torch.nn.Linear(2, 3)
    x = torch.randn(1, 2)
    assert normalise_call(linear, (x,), {}) == {"input": x}

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
            return input_ids

        def forward_star(self, *args):  # pragma: no cover - signature only
            return args

    model = Model()
    ids = torch.ones(1, 2, dtype=torch.int64)
    named = normalise_call(model, (ids,), {"logits_to_keep": 1, "attention_mask": None, "cache": "c"})
    assert named == {"input_ids": ids, "cache": "c"}

    class Star(torch.nn.Module):
        def forward(self, *args):
            return args

    with pytest.raises(TypeError, match=r"through \*args"):
        normalise_call(Star(), (ids,), {})


def test_padding_mask_for_call_extends_the_prompt_mask() -> None:
    base = torch.tensor([[0, 1, 1], [1, 1, 1]])
    prefill = {"input_ids": torch.ones(2, 3, dtype=torch.int64)}
    assert torch.equal(padding_mask_for_call(prefill, base, 2), base)
    assert (
        padding_mask_for_call({"input_ids": torch.ones(2, 2, dtype=torch.int64)}, None, 2).tolist()
        == [[1, 1]] * 2
    )


def test_prefill_and_decode_kwargs_from_generate(llama) -> None:
    model, inputs = llama
    config = GenerationConfig(max_new_tokens=50, do_sample=False)
    before = config.to_dict()
    parts = decompose_prefill_decode(model, inputs, generation_config=config)
    assert list(parts) == ["prefill", "decode"]
    assert config.to_dict() == before, "the caller's generation config must not be mutated"
    prefill_model, prefill = parts["prefill"]
    decode_model, decode = parts["decode"]
    assert prefill_model is model and decode_model is model
    assert "logits_to_keep" not in prefill and "logits_to_keep" not in decode
    assert torch.equal(prefill["input_ids"], inputs["input_ids"])
    assert decode["input_ids"].shape == (2, 1)
    # generate drops an all-ones mask; the decomposition keeps the 2-D padding mask [batch, past + q]
    assert decode["attention_mask"].shape == (2, 9)
    assert decode["position_ids"].tolist() == [[8], [8]]
    assert decode["cache"].get_seq_length() == 8
    assert parts.plan.cache_kind == "dynamic" and parts.plan.architecture == "decoder"
    assert parts.plan.io["decode"].outputs[0] == "logits"
    assert "cache.layers.0.keys" in parts.plan.io["decode"].tensor_paths


def test_multi_token_decode_merges_two_steps_with_the_same_logits(llama) -> None:
    model, inputs = llama
    parts = decompose_prefill_decode(model, inputs, multi_token_decode=True)
    _, decode = parts["decode"]
    assert decode["input_ids"].shape == (2, 2)
    assert decode["attention_mask"].shape == (2, 10)
    assert decode["position_ids"].tolist() == [[8, 9], [8, 9]]
    _, prefill = parts["prefill"]
    with torch.no_grad():
        merged = model(**copy.deepcopy({k: v for k, v in decode.items()})).logits
        # the same two tokens one at a time, from the prompt's cache
        step_cache = copy.deepcopy(prefill["cache"])
        model(
            input_ids=prefill["input_ids"],
            position_ids=prefill["position_ids"],
            cache=step_cache,
            use_cache=True,
        )
        first = model(
            input_ids=decode["input_ids"][:, :1],
            position_ids=decode["position_ids"][:, :1],
            attention_mask=decode["attention_mask"][:, :9],
            cache=step_cache,
            use_cache=True,
        ).logits
        second = model(
            input_ids=decode["input_ids"][:, 1:],
            position_ids=decode["position_ids"][:, 1:],
            attention_mask=decode["attention_mask"],
            cache=step_cache,
            use_cache=True,
        ).logits
    torch.testing.assert_close(merged[:, 0], first[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged[:, 1], second[:, 0], atol=1e-5, rtol=1e-5)


def test_static_cache_is_forwarded_to_capture(llama) -> None:
    model, inputs = llama
    config = GenerationConfig(cache_implementation="static", max_cache_len=24)
    parts = decompose_prefill_decode(model, inputs, generation_config=config)
    _, decode = parts["decode"]
    assert isinstance(decode["cache"], StaticCache)
    assert decode["cache"].layers[0].keys.shape[2] == 24
    assert int(decode["cache"].layers[0].cumulative_length) == 8
    # a 2-D mask instead of the 4-D mask generate builds for static caches
    assert decode["attention_mask"].shape == (2, 9)
    assert parts.plan.cache_kind == "static" and parts.plan.max_cache_len == 24
    assert config.max_cache_len == 24 and config.max_new_tokens != 2
    with pytest.raises(ValueError, match="max_cache_len=N"):
        decompose_prefill_decode(
            model, inputs, generation_config=GenerationConfig(cache_implementation="static")
        )


def test_generate_failure_names_the_model_and_inputs(llama) -> None:
    model, inputs = llama
    bad = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"][:, :3]}
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM with inputs \['attention_mask', 'input_ids'\]"):
        decompose_prefill_decode(model, bad)
    with pytest.raises(ValueError, match="input_ids"):
        decompose_prefill_decode(model, {"attention_mask": inputs["attention_mask"]})


def test_generate_that_bypasses_forward_is_reported(llama, monkeypatch) -> None:
    model, inputs = llama

    def fake_generate(**kwargs):
        return torch.cat([kwargs["input_ids"], kwargs["input_ids"][:, :2]], dim=1)

    monkeypatch.setattr(model, "generate", fake_generate)
    with pytest.raises(RuntimeError, match="bypasses its forward"):
        decompose_prefill_decode(model, inputs)


def test_sliding_window_layers_are_captured_as_full_layers_with_the_same_logits() -> None:
    model, inputs = tiny_model("gemma2", sliding_window=4)
    assert [e for e in entries(BACKEND) if e.is_active()], "the sliding-window patch must be active"
    parts = decompose_for_generation(model, inputs)
    _, decode = parts["decode"]
    assert all(type(layer) is DynamicLayer for layer in decode["cache"].layers)
    assert decode["cache"].get_seq_length() == 8  # every position kept, more than the window of 4
    with torch.no_grad():
        got = model(**copy.deepcopy(decode)).logits
        # the same step through the model's own sliding-window cache
        sliding = DynamicCache(config=model.config)
        _, prefill = parts["prefill"]
        model(
            input_ids=prefill["input_ids"],
            position_ids=prefill["position_ids"],
            cache=sliding,
            use_cache=True,
        )
        # the reference keeps only window - 1 states in its sliding layers
        assert sliding.layers[0].keys.shape[-2] == 3
        want = model(
            input_ids=decode["input_ids"],
            position_ids=decode["position_ids"],
            attention_mask=decode["attention_mask"],
            cache=sliding,
            use_cache=True,
        ).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with apply_patches(BACKEND):
        assert all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
    assert any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers)
