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
    # the xnnpack scope: the partitioner rules (a broadcasting div kept portable among them), the
    # preprocess pass skipping, the layout tags without size guards and the core's shared
    # dense-experts MoE forward
    assert sorted(installed["executorch.xnnpack"]) == [
        "hfexport.workarounds.moe.dense_experts_for_every_implementation",
        "hfexport_executorch.workarounds.patches.batch_norm_1d_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.broadcast_div_stays_portable",
        "hfexport_executorch.workarounds.patches.conv1d_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.gelu_tanh_stays_portable",
        "hfexport_executorch.workarounds.patches.layout_tags_without_size_guards",
        "hfexport_executorch.workarounds.patches.max_dim_only_over_spatial_axes",
        "hfexport_executorch.workarounds.patches.prelu_only_over_4d_inputs",
        "hfexport_executorch.workarounds.patches.resize_with_own_scale_stays_portable",
        "hfexport_executorch.workarounds.patches.softmax_takes_nchw_inputs",
        "hfexport_executorch.workarounds.patches.tensors_above_six_dims_stay_portable",
        "hfexport_executorch.workarounds.patches.unsqueeze_with_one_dynamic_dim_only",
        "hfexport_executorch.workarounds.patches.xnnpack_preprocess_skips_inapplicable_passes",
    ]
    assert (
        "hfexport_executorch.workarounds.patches.keep_dynamic_dims_in_list_returning_ops"
        in installed["executorch"]
    )
    assert "hfexport_executorch.workarounds.patches.views_bounded_by_their_base" in installed["executorch"]


def test_an_export_validated_at_two_shapes_lowers_serializes_and_loads_once(
    toy_projection, toy_inputs, monkeypatch, tmp_path
):
    """The fixed cost of an export is paid once: one edge lowering (XNNPACK preprocess once per
    partition), one memory planning, one ``.pte`` serialization, and one runtime load of the saved
    file that serves both validation shapes."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir.program import _program

    from hfexport_executorch import runtime

    calls: dict[str, int] = {}

    def spy(owner, name, key=None):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[key or name] = calls.get(key or name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    spy(lowering, "_to_edge_transform_and_lower", "lower")
    spy(lowering, "plan_memory")
    spy(_program, "serialize_for_executorch", "serialize")
    spy(runtime, "load_program")
    spy(XnnpackBackend, "preprocess")  # a staticmethod: the plain function counted stays one

    exporter = ExecutorchExporter()
    report = exporter.export_to_path(
        toy_projection, toy_inputs(batch=2, seq=6), tmp_path / "model.pte", ExecutorchConfig(dynamic=True)
    )
    # both shapes validated against eager, on the one loaded program
    assert [tuple(r["shape"]) for r in report.validation["sample"]] == [(2, 6, 8)]
    assert report.validation["second_shape"][0]["shape"][0] == 3
    assert all(r["ok"] for key in ("sample", "second_shape") for r in report.validation[key])
    partitions = report.extra["delegation"]["partitions"]
    assert partitions >= 1
    assert calls == {
        "lower": 1,
        "preprocess": partitions,
        "plan_memory": 1,
        "serialize": 1,
        "load_program": 1,
    }
