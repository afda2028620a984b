"""The dynamo patches: dense MoE experts (the shared capture workarounds are tested in the core)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hfexport.config import DynamoConfig
from hfexport.errors import ExportStageError
from hfexport.registry import entries, isolated_registry
from hfexport.testing import load_case
from hfexport.workarounds.moe import dense_experts_forward
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo.versions import SUPPORTED


def test_every_patch_names_its_upstream_issue_and_is_active_on_the_tested_pins():
    found = {e.name.rsplit(".", 1)[-1]: e for e in entries("dynamo", kind="patch")}
    assert "dense_experts_for_eager" in found  # the core's shared MoE workaround, "eager" loop only
    # the torch.export faults every backend meets are patched once, by the core capture
    shared = {"torch.export.export", "transformers.cache_utils.DynamicSlidingWindowLayer.update"}
    assert not {p for e in found.values() for p in e.paths} & shared
    core = {e.name.rsplit(".", 1)[-1] for e in entries("capture", kind="patch")}
    assert {"sliding_window_update_keeps_dynamic_length", "keep_size_one_batch_dynamic"} <= core
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
