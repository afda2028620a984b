"""Lowering and memory planning: the alloc_* flags reach MemoryPlanningPass; delegation is reported."""

from __future__ import annotations

import pytest

from hfexport.config import ExecutorchConfig
from hfexport_executorch import ExecutorchExporter, lowering


@pytest.fixture
def planning_calls(monkeypatch):
    calls: list[dict] = []

    class SpyPass(lowering.MemoryPlanningPass):
        def __init__(self, *args, **kwargs):
            calls.append(dict(kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lowering, "MemoryPlanningPass", SpyPass)
    return calls


def test_alloc_flags_reach_the_memory_planning_pass(toy_projection, planning_calls, toy_inputs):
    exporter = ExecutorchExporter()
    config = ExecutorchConfig(alloc_graph_input=False, alloc_graph_output=False, alloc_mutable_buffers=False)
    exporter.export(toy_projection, toy_inputs(), config)
    assert planning_calls == [
        {"alloc_graph_input": False, "alloc_graph_output": False, "alloc_mutable_buffers": False}
    ]
    report = exporter.last_report
    assert report.extra["memory_planning"] == {
        "alloc_graph_input": False,
        "alloc_graph_output": False,
        "alloc_mutable_buffers": False,
    }
    # the whole toy runs inside XNNPACK: with caller-owned inputs and outputs nothing is planned
    assert report.extra["planned_memory_bytes"] == 0
    # ... and the runtime still runs it (validation passed at the sample shape)
    assert [row["name"] for row in report.validation["sample"]] == ["hidden"]
    assert all(row["ok"] for row in report.validation["sample"])


def test_default_flags_plan_inputs_and_outputs(toy_projection, planning_calls, toy_inputs):
    exporter = ExecutorchExporter()
    exporter.export(toy_projection, toy_inputs(batch=2, seq=6), ExecutorchConfig())
    assert planning_calls == [
        {"alloc_graph_input": True, "alloc_graph_output": True, "alloc_mutable_buffers": True}
    ]
    # input [2, 6, 16] and output [2, 6, 8] float32 live in the planned arena
    assert exporter.last_report.extra["planned_memory_bytes"] >= (2 * 6 * 16 + 2 * 6 * 8) * 4


def test_delegation_summary_of_a_fully_delegated_model(toy_projection, toy_inputs):
    exporter = ExecutorchExporter()
    exporter.export(toy_projection, toy_inputs(), ExecutorchConfig(validate=False))
    delegation = exporter.last_report.extra["delegation"]
    assert delegation["partitions"] == 1
    assert delegation["backends"] == {"XnnpackBackend": 1}
    assert delegation["portable_nodes"] == 0 and delegation["portable_ops"] == {}
    assert delegation["delegated_nodes"] >= 2  # linear + relu at least
    assert delegation["delegated_share"] == 1.0
    stages = [s.name for s in exporter.last_report.stages]
    assert stages == [
        "prepare_inputs",
        "prepare_backend",
        "patches",
        "dynamic_shapes",
        "capture",
        "fx_program_fixes",
        "fx_node_fixes",
        "memory_budget",  # before lowering: the delegates are lowered with the narrowed bounds
        "lower",
        "memory_planning",
        "validate",
    ]
    assert exporter.last_report.stages[-1].status == "skipped"
    # the patches stage lists what it installed per key: parent key first, then the xnnpack scope
    installed = next(s for s in exporter.last_report.stages if s.name == "patches").data
    assert list(installed) == ["executorch", "executorch.xnnpack"]
    # the xnnpack scope: the partitioner rules, the preprocess pass skipping and the core's shared
    # dense-experts MoE forward
    assert sorted(installed["executorch.xnnpack"]) == [
        "hfexport.workarounds.moe.dense_experts_for_every_implementation",
        "hfexport_executorch.workarounds.patches.batch_norm_1d_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.conv1d_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.gelu_tanh_stays_portable",
        "hfexport_executorch.workarounds.patches.max_dim_only_over_spatial_axes",
        "hfexport_executorch.workarounds.patches.unsqueeze_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.xnnpack_preprocess_skips_inapplicable_passes",
    ]
    assert (
        "hfexport_executorch.workarounds.patches.keep_dynamic_dims_in_list_returning_ops"
        in installed["executorch"]
    )
