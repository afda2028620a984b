"""The dense mixture-of-experts forward used for XNNPACK (the core's shared workaround) matches transformers."""

from __future__ import annotations

import pytest
import torch

from hfexport.registry import apply_patches, entries
from hfexport.testing import tiny_model
from hfexport.workarounds.moe import dense_experts_forward, find_experts_modules


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


def test_xnnpack_key_registers_the_shared_dense_experts_for_every_implementation():
    import hfexport_executorch  # noqa: F401  (registers the workarounds)

    names = [e.name for e in entries("executorch.xnnpack", kind="patch")]
    assert "hfexport.workarounds.moe.dense_experts_for_every_implementation" in names
    assert not any("moe" in e.name for e in entries("executorch.cuda", kind="patch"))


def test_whole_model_logits_match_with_dense_experts(mixtral):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    import hfexport_executorch  # noqa: F401  (registers the workarounds)

    model, inputs = mixtral
    original = ExpertsInterface.__dict__["get_interface"]
    with torch.no_grad():
        expected = model(**inputs).logits
        with apply_patches("executorch.xnnpack"):
            _, experts = find_experts_modules(model)[0]
            picked = ALL_EXPERTS_FUNCTIONS.get_interface(experts.config._experts_implementation, None)
            assert picked is dense_experts_forward
            actual = model(**inputs).logits
    assert [name for name, _ in find_experts_modules(model)] == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert (actual - expected).abs().max().item() < 1e-5
    assert ExpertsInterface.__dict__["get_interface"] is original  # undone


def test_dense_model_has_no_experts():
    model, _ = tiny_model("llama")
    assert find_experts_modules(model) == []
