"""The dynamo patches: dense MoE experts, guard-free sliding-window cache, size-one dynamic axes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.errors import ExportStageError
from hfexport.registry import apply_patches, entries, isolated_registry
from hfexport.testing import load_case
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo.patches import dense_experts_forward
from hfexport_dynamo.versions import SUPPORTED


def test_every_patch_names_its_upstream_issue_and_is_active_on_the_tested_pins():
    found = {e.name.rsplit(".", 1)[-1]: e for e in entries("dynamo", kind="patch")}
    assert {"dense_experts_while_tracing", "sliding_window_cache_without_slice_guard",
            "keep_size_one_axes_dynamic"} <= set(found)  # fmt: skip
    for entry in found.values():
        assert entry.issue.startswith("https://github.com/")
        assert entry.is_active(), entry.inactive_reason()
        assert not entry.unresolved
        assert not entry.is_stale(SUPPORTED)


# --------------------------------------------------------------------------------------------
# mixture of experts
# --------------------------------------------------------------------------------------------


def _experts(**overrides):
    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=16,
        intermediate_size=24,
        num_local_experts=5,
        num_experts_per_tok=2,
        **overrides,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    return experts.eval()


def test_dense_experts_compute_what_the_eager_loop_computes():
    experts = _experts()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 16, generator=gen)
    index = torch.randint(0, 5, (11, 2), generator=gen)
    index[:, 1] = (index[:, 0] + 1) % 5
    index[3, 1] = 5  # expert-parallel sentinel: contributes nothing in either implementation
    weights = torch.softmax(torch.randn(11, 2, generator=gen), dim=-1)
    with torch.no_grad():
        eager = experts(hidden, index, weights)
        dense = dense_experts_forward(experts, hidden, index, weights)
    assert dense.shape == (11, 16) and dense.dtype == hidden.dtype
    assert (dense - eager).abs().max().item() <= 1e-6
    assert eager.abs().max().item() > 1e-2  # not trivially zero


def _routed_experts(model, inputs):
    """Experts each layer's router picks for ``inputs`` (set of ids per layer)."""
    picked: list[set[int]] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: picked.append(set(out[2].flatten().tolist())))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return picked


def _repeated_token(token, batch, length):
    return {
        "input_ids": torch.full((batch, length), token),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
    }


@pytest.fixture(scope="module")
def eager_moe():
    """The C01 mixtral with the data-dependent 'eager' experts loop, and two inputs routed apart.

    A sequence repeating one token has identical hidden states at every position (attention
    averages identical values), so every token goes to the same two experts: the sample reaches
    only those, the second input other ones.
    """
    model = load_case("C01").build_model()
    model.set_experts_implementation("eager")
    sample = _repeated_token(5, 2, 6)
    sample_hits = _routed_experts(model, sample)
    for token in range(6, 128):
        second = _repeated_token(token, 3, 11)
        second_hits = _routed_experts(model, second)
        if any(hit - seen for hit, seen in zip(second_hits, sample_hits)):
            return model, sample, second, sample_hits, second_hits
    raise AssertionError("no token routes differently from the sample")


def test_eager_moe_export_keeps_experts_the_sample_never_reached(eager_moe):
    model, sample, second, sample_hits, second_hits = eager_moe
    assert all(len(hit) == 2 for hit in sample_hits)  # the sample reaches 2 of 4 experts per layer
    unreached = [sorted(hit - seen) for hit, seen in zip(second_hits, sample_hits)]
    assert any(unreached)  # the second input needs experts the trace never saw used
    exporter = DynamoExporter()
    program = exporter.export(model, sample, DynamoConfig(dynamic=True, validate_second_shape=False))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("nonzero" in t for t in targets)
    with torch.no_grad():
        expected = model(**second).logits
    got = exporter.runner(program)(second)["logits"]
    assert got.shape == (3, 11, 128)
    assert (got - expected).abs().max().item() <= 1e-5


def test_without_the_patch_the_eager_moe_loop_does_not_export(eager_moe):
    model, sample, *_ = eager_moe
    with isolated_registry(), pytest.raises(ExportStageError, match="data-dependent") as caught:
        DynamoExporter().export(model, sample, DynamoConfig(dynamic=True))
    assert caught.value.stage == "capture.torch_export"


# --------------------------------------------------------------------------------------------
# sliding-window cache
# --------------------------------------------------------------------------------------------


class SlidingCacheStep(torch.nn.Module):
    """One sliding-window cache update (window 6), returning the full and the kept states."""

    def forward(self, keys, values):
        layer = DynamicSlidingWindowLayer(sliding_window=6)
        full_keys, _ = layer.update(keys, values)
        return full_keys * 2, layer.keys, layer.values


def _capture_sliding(patched: bool):
    sample = {"keys": torch.randn(2, 2, 4, 8), "values": torch.randn(2, 2, 4, 8)}
    if patched:
        with apply_patches("dynamo"):
            return capture(SlidingCacheStep(), sample, DynamoConfig(dynamic=True))
    with isolated_registry():
        return capture(SlidingCacheStep(), sample, DynamoConfig(dynamic=True))


def test_sliding_window_cache_export_accepts_sequences_longer_than_the_window():
    program = _capture_sliding(patched=True)
    keys, values = torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    full, kept_keys, kept_values = program.module()(keys=keys, values=values)
    assert torch.equal(full, keys * 2)
    assert kept_keys.shape == (3, 2, 5, 8)  # window - 1 positions kept
    assert torch.equal(kept_keys, keys[:, :, -5:]) and torch.equal(kept_values, values[:, :, -5:])
    short = torch.randn(1, 2, 3, 8)
    assert torch.equal(program.module()(keys=short, values=short)[1], short)


def test_without_the_patch_the_sliding_window_slice_bounds_the_sequence():
    program = _capture_sliding(patched=False)
    uppers = [int(r.upper) for r in program.range_constraints.values() if r.upper < 10**6]
    assert uppers and max(uppers) <= 5
    with pytest.raises(AssertionError, match="Guard failed"):
        program.module()(keys=torch.randn(3, 2, 20, 8), values=torch.randn(3, 2, 20, 8))


# --------------------------------------------------------------------------------------------
# size-one axes
# --------------------------------------------------------------------------------------------


class Pool(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x, mask):
        return self.proj(x).mul(mask.unsqueeze(-1)).sum(dim=1)


def test_batch_one_sample_gives_a_program_with_a_dynamic_batch():
    sample = {"x": torch.randn(1, 5, 4), "mask": torch.ones(1, 5)}
    model = Pool().eval()
    with apply_patches("dynamo"):
        program = capture(model, sample, DynamoConfig(dynamic=True))
    other = {"x": torch.randn(3, 9, 4), "mask": torch.ones(3, 9)}
    got = program.module()(**other)
    assert got.shape == (3, 3)
    assert torch.allclose(got, model(**other), atol=1e-6, rtol=0)
    one = program.module()(**sample)
    assert torch.allclose(one, model(**sample), atol=1e-6, rtol=0)


def test_without_the_patch_a_batch_one_sample_specialises_the_batch():
    sample = {"x": torch.randn(1, 5, 4), "mask": torch.ones(1, 5)}
    with isolated_registry(), apply_patches("dynamo"):
        program = capture(Pool().eval(), sample, DynamoConfig(dynamic=True))
    with pytest.raises(AssertionError, match=r"Guard failed: x\.size\(\)\[0\] == 1"):
        program.module()(x=torch.randn(3, 9, 4), mask=torch.ones(3, 9))
