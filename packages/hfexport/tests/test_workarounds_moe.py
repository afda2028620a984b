"""The shared dense mixture-of-experts workaround computes what transformers' eager loop computes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from hfexport.registry import apply_patches, entries, isolated_registry
from hfexport.workarounds import moe


def _experts(model_type: str, dtype: torch.dtype, **overrides):
    """A tiny experts module of ``model_type`` (eager implementation), random weights, in ``dtype``."""
    if model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        config = AutoConfig.for_model(
            "mixtral",
            hidden_size=16,
            intermediate_size=24,
            num_local_experts=5,
            num_experts_per_tok=2,
            **overrides,
        )
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts as cls

        config = AutoConfig.for_model(
            "qwen2_moe",
            hidden_size=16,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=2,
            **overrides,
        )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = cls(config)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return experts.to(dtype).eval()


def _routing(tokens: int, num_experts: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, num_experts, (tokens, 2), generator=gen)
    index[:, 1] = (index[:, 0] + 1) % num_experts
    # float32 routing weights, as the routers compute them (softmax in float32)
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)
    return index, weights


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_float32_matches_eager_with_a_sentinel_id(model_type):
    experts = _experts(model_type, torch.float32)
    index, weights = _routing(11, 5)
    index[3, 1] = 5  # expert-parallel sentinel (>= num_experts): contributes nothing in eager
    hidden = torch.randn(11, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = experts(hidden, index, weights)
        dense = moe.dense_experts_forward(experts, hidden, index, weights)
    assert dense.shape == (11, 16) and dense.dtype == torch.float32
    assert eager.abs().max().item() > 1e-2
    assert (dense - eager).abs().max().item() <= 1e-6


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_bfloat16_activations_keep_float32_routing_like_eager(model_type):
    """bf16 experts with fp32 router weights: weighting and sum in fp32, then one cast (as eager)."""
    experts = _experts(model_type, torch.bfloat16)
    index, weights = _routing(13, 5, seed=3)
    hidden = torch.randn(13, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        eager = experts(hidden, index, weights).float()
        dense = moe.dense_experts_forward(experts, hidden, index, weights)
        # the diverged variant: routing weights cast to bf16 before weighting and summing
        coarse = moe.dense_experts_forward(experts, hidden, index, weights.to(torch.bfloat16))
        reference = moe.dense_experts_forward(experts.float(), hidden.float(), index, weights)
    assert dense.dtype == torch.bfloat16
    scale = eager.abs().max().item()
    ulp = torch.finfo(torch.bfloat16).eps * 2 ** math.floor(math.log2(scale))
    dense_err = (dense.float() - eager).abs().max().item()
    assert dense_err <= ulp  # within one bf16 rounding step of the eager loop
    assert dense_err <= (coarse.float() - eager).abs().max().item()
    # float32 routing keeps the result closer to the float32 computation than bf16 routing does
    assert (dense.float() - reference).abs().max() < (coarse.float() - reference).abs().max()


def test_patch_dispatch_per_registration():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    with isolated_registry():
        moe.register_dense_experts("demo", every_implementation=False)
        moe.register_dense_experts("demo.strict", every_implementation=True)
        moe.register_dense_experts("demo", every_implementation=False)  # idempotent
        (entry,) = entries("demo")
        assert entry.issue == moe.METADATA["issue"] and entry.paths == (moe.TARGET,)
        sentinel = object()
        with apply_patches("demo"):
            assert ALL_EXPERTS_FUNCTIONS.get_interface("eager", sentinel) is moe.dense_experts_forward
            assert (
                ALL_EXPERTS_FUNCTIONS.get_interface("grouped_mm", sentinel) is not moe.dense_experts_forward
            )
        # the scoped key adds the every-implementation patch on top of its parent's
        with apply_patches("demo.strict"):
            assert ALL_EXPERTS_FUNCTIONS.get_interface("grouped_mm", sentinel) is moe.dense_experts_forward
        assert ALL_EXPERTS_FUNCTIONS.get_interface("eager", sentinel) is sentinel
