"""The dense mixture-of-experts forward used for XNNPACK matches transformers' experts forward."""

from __future__ import annotations

import pytest
import torch

from hfexport.testing import tiny_model
from hfexport_executorch.moe import dense_experts, dense_experts_forward, find_experts_modules


@pytest.fixture(scope="module")
def mixtral():
    model, inputs = tiny_model("mixtral", seq_len=11)
    return model, inputs


def test_dense_forward_matches_each_routing(mixtral):
    model, _ = mixtral
    _, experts = find_experts_modules(model)[0]
    num_experts = experts.down_proj.shape[0]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, experts.down_proj.shape[1], generator=gen)
    # every expert routed at least once: token t goes to experts t % E and (t + 1) % E
    index = torch.stack([torch.arange(13) % num_experts, (torch.arange(13) + 1) % num_experts], dim=1)
    weights = torch.softmax(torch.randn(13, 2, generator=gen), dim=-1)
    with torch.no_grad():
        expected = experts(hidden, index, weights)
        actual = dense_experts_forward(experts, hidden, index, weights)
    assert actual.shape == (13, hidden.shape[1])
    assert (actual - expected).abs().max().item() < 1e-5


def test_whole_model_logits_match_with_dense_experts(mixtral):
    model, inputs = mixtral
    with torch.no_grad():
        expected = model(**inputs).logits
        with dense_experts(model) as names:
            actual = model(**inputs).logits
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert (actual - expected).abs().max().item() < 1e-5


def test_switch_is_undone_on_error(mixtral):
    model, _ = mixtral
    with pytest.raises(KeyError), dense_experts(model):
        raise KeyError("boom")
    assert all("forward" not in vars(m) for _, m in find_experts_modules(model))


def test_dense_model_has_no_experts():
    model, _ = tiny_model("llama")
    assert find_experts_modules(model) == []
