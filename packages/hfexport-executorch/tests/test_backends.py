"""Stage 1, backend preparation: supported names, the cuda precondition, the MoE switch for XNNPACK."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hfexport.config import ExecutorchConfig
from hfexport.testing import tiny_model
from hfexport_executorch import ExecutorchExporter
from hfexport_executorch.backends import SUPPORTED_BACKENDS, prepare_backend


def test_unknown_backend_raises_value_error_listing_supported(toy_projection):
    with contextlib.ExitStack() as stack, pytest.raises(ValueError) as info:
        prepare_backend("vulkan", toy_projection, stack)
    message = str(info.value)
    assert "'vulkan' is not supported" in message
    assert "'xnnpack', 'cuda'" in message
    assert SUPPORTED_BACKENDS == ("xnnpack", "cuda")


def test_cuda_without_cuda_raises_runtime_error_saying_what_to_do(toy_projection, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with contextlib.ExitStack() as stack, pytest.raises(RuntimeError) as info:
        prepare_backend("cuda", toy_projection, stack)
    message = str(info.value)
    assert "backend='cuda' cannot be used: torch.cuda.is_available() is False" in message
    assert "ExecutorchConfig(backend='xnnpack')" in message
    assert "EXECUTORCH_BUILD_CUDA=ON" in message


def test_export_with_cuda_unavailable_fails_in_prepare_backend_and_leaves_model(
    toy_projection, monkeypatch, toy_inputs
):

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = {k: v.clone() for k, v in toy_projection.state_dict().items()}
    exporter = ExecutorchExporter()
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        exporter.export(toy_projection, toy_inputs(), ExecutorchConfig(backend="cuda"))
    stages = {s.name: s.status for s in exporter.last_report.stages}
    assert stages["prepare_backend"] == "failed"
    assert "capture" not in stages
    assert toy_projection.training is False
    for name, value in toy_projection.state_dict().items():
        assert torch.equal(value, before[name]) and value.device.type == "cpu"


def test_xnnpack_plan_has_partitioner_and_no_adaptation_for_dense_model(toy_projection):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    with contextlib.ExitStack() as stack:
        plan = prepare_backend("xnnpack", toy_projection, stack)
    assert plan.registry_key == "executorch.xnnpack"
    assert [type(p) for p in plan.partitioners] == [XnnpackPartitioner]
    assert plan.device == torch.device("cpu")
    assert plan.adaptations == []


def test_xnnpack_switches_experts_for_the_export_only():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from hfexport.registry import apply_patches
    from hfexport.workarounds.moe import dense_experts_forward

    model, _ = tiny_model("mixtral")
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert len(experts) == 2
    implementation = experts[0].config._experts_implementation
    with contextlib.ExitStack() as stack:
        plan = prepare_backend("xnnpack", model, stack)
        assert "2 experts module(s) computed densely" in plan.adaptations[0]
        # the shared core workaround, installed with the backend's patches (not on the instances)
        with apply_patches(plan.registry_key):
            assert ALL_EXPERTS_FUNCTIONS.get_interface(implementation, None) is dense_experts_forward
    assert ALL_EXPERTS_FUNCTIONS.get_interface(implementation, None) is not dense_experts_forward
    assert all("forward" not in vars(m) for m in experts)
