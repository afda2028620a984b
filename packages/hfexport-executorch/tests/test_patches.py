"""Patches: scoped keys install only for their backend; the edge validator keeps dynamic batches."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch.export import Dim

from hfexport.capture import capture
from hfexport.config import ExecutorchConfig
from hfexport.errors import ExportStageError
from hfexport.registry import apply_patches, isolated_registry, register_patch

_TARGET = "hfexport_executorch_test_patch_target"


@pytest.fixture
def patch_target():
    module = types.ModuleType(_TARGET)
    module.parent = module.xnnpack = module.cuda = "original"
    sys.modules[_TARGET] = module
    yield module
    del sys.modules[_TARGET]


def _register_marker_patches() -> None:
    for key, attr in (
        ("executorch", "parent"),
        ("executorch.xnnpack", "xnnpack"),
        ("executorch.cuda", "cuda"),
    ):
        register_patch(
            key,
            f"{_TARGET}.{attr}",
            description=f"marker for {key}",
            issue="https://github.com/pytorch/executorch/issues/1",
            versions={"torch": ">=2"},
        )(lambda original, key=key: f"patched by {key}")


def test_exporter_installs_parent_and_own_scope_only(patch_target, toy_projection, monkeypatch, toy_inputs):
    from hfexport import registry
    from hfexport_executorch import ExecutorchExporter

    seen: dict[str, object] = {}

    @contextlib.contextmanager
    def spy(key):
        with apply_patches(key) as installed:
            seen["key"] = key
            seen["values"] = (patch_target.parent, patch_target.xnnpack, patch_target.cuda)
            seen["installed"] = [e.backend for e in installed]
            raise LookupError("stop after the patches stage")
            yield installed  # pragma: no cover

    with isolated_registry():
        _register_marker_patches()
        monkeypatch.setattr(registry, "apply_patches", spy)
        exporter = ExecutorchExporter()
        with pytest.raises(ExportStageError, match="stage 'patches'"):
            exporter.export(toy_projection, toy_inputs(), ExecutorchConfig(backend="xnnpack"))
    assert seen["key"] == "executorch.xnnpack"
    assert seen["values"] == ("patched by executorch", "patched by executorch.xnnpack", "original")
    assert seen["installed"] == ["executorch", "executorch.xnnpack"]
    record = next(s for s in exporter.last_report.stages if s.name == "patches")
    assert record.status == "failed" and record.detail == "executorch.xnnpack"
    # everything restored after the failed export
    assert (patch_target.parent, patch_target.xnnpack, patch_target.cuda) == ("original",) * 3


def test_cuda_scope_does_not_see_xnnpack_patches(patch_target):
    with isolated_registry():
        _register_marker_patches()
        with apply_patches("executorch.cuda"):
            assert (patch_target.parent, patch_target.xnnpack, patch_target.cuda) == (
                "patched by executorch",
                "original",
                "patched by executorch.cuda",
            )
    assert patch_target.cuda == "original"


class ToySplit(torch.nn.Module):
    """``input_ids`` ``[batch, seq, 12]`` split in three along the last axis: ``a * b + c``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        a, b, c = input_ids.split(4, dim=-1)
        return a * b + c


def _edge_batch_size(patched: bool):
    from executorch.exir import to_edge

    dims = {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)}}
    inputs = {"input_ids": torch.randn(2, 6, 12)}
    program = capture(ToySplit(), inputs, ExecutorchConfig(dynamic_shapes=dims))
    with apply_patches("executorch") if patched else contextlib.nullcontext():
        edge = to_edge(program)
    node = next(n for n in edge.exported_program().graph.nodes if n.op == "placeholder")
    return node.meta["val"].shape[0]


def test_edge_validator_specialises_batch_without_the_patch():
    # Documents the ExecuTorch bug worked around by keep_dynamic_dims_in_list_returning_ops: when
    # this fails (the batch stays symbolic unpatched), the patch can be retired.
    assert _edge_batch_size(patched=False) == 2


def test_edge_validator_keeps_batch_dynamic_with_the_patch():
    size = _edge_batch_size(patched=True)
    assert isinstance(size, torch.SymInt)
    assert str(size.node.expr).startswith("s")


class ToyKeepLast(torch.nn.Module):
    """``input_ids`` ``[batch, seq, 12]`` -> its last ``min(seq, 4)`` positions, doubled (a sliding window)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from hfexport.workarounds.torch_export import keep_last

        return keep_last(input_ids, 4, dim=1) * 2


def _keep_last_program():
    dims = {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)}}
    return capture(ToyKeepLast(), {"input_ids": torch.randn(2, 6, 12)}, ExecutorchConfig(dynamic_shapes=dims))


def test_edge_verifier_rejects_symbolic_min_without_the_patch():
    # Documents pytorch/executorch#11988: when this stops raising, edge_verifier_accepts_symbolic_min_max
    # can be retired.
    from executorch.exir import to_edge

    program = _keep_last_program()
    assert any(n.target is torch.sym_min for n in program.graph.nodes)
    with pytest.raises(AssertionError):
        to_edge(program)


def test_symbolic_min_lowers_and_runs_with_the_patch():
    from executorch.exir import to_edge

    from hfexport_executorch.runtime import load_method, load_program

    with apply_patches("executorch"):
        manager = to_edge(_keep_last_program()).to_executorch()
    method = load_method(load_program(manager.buffer))
    for seq in (1, 3, 4, 9, 64):
        x = torch.randn(3, seq, 12)
        (out,) = method.execute([x])
        expected = x[:, max(seq - 4, 0) :, :] * 2
        assert out.shape == expected.shape
        assert torch.equal(out, expected)


class ToyConv1d(torch.nn.Module):
    """``input_values`` ``[batch, length]`` -> conv1d feature frames ``[batch, 8, frames]`` (wav2vec2-like)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 8, kernel_size=10, stride=5, bias=False)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.conv(input_values[:, None])


def _lower_conv1d(patched: bool):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    # bounded hints: a named length Dim is rejected (the frame count is specialised away from 1)
    dims = {"input_values": {0: Dim.AUTO(min=1, max=4), 1: Dim.AUTO(min=10, max=4000)}}
    program = capture(
        ToyConv1d(), {"input_values": torch.randn(2, 400)}, ExecutorchConfig(dynamic_shapes=dims)
    )
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def test_xnnpack_conv1d_with_dynamic_batch_and_length_fails_without_the_patch():
    # Documents pytorch/executorch#11449 on the installed executorch (retire the patch when this passes).
    with pytest.raises(RuntimeError, match="XNNPACK reshape only supports 1 dynamic dimension"):
        _lower_conv1d(patched=False)


def test_conv1d_stays_portable_and_runs_with_the_patch():
    from hfexport_executorch.runtime import load_method, load_program

    edge = _lower_conv1d(patched=True)
    targets = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    assert any("convolution" in t for t in targets)  # not delegated
    method = load_method(load_program(edge.to_executorch().buffer))
    model = ToyConv1d()
    for batch, length in ((1, 10), (3, 1234)):
        x = torch.randn(batch, length)
        (out,) = method.execute([x])
        with torch.no_grad():
            expected = model(x)
        assert out.shape == expected.shape
        assert (out - expected).abs().max().item() < 1e-5


class ToyInterleavedRotary(torch.nn.Module):
    """GPT-J/Cohere-style ``rotate_every_two``: ``stack((-x2, x1), -1).flatten(-2)`` on ``[b, s, h, d]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.proj(hidden).view(hidden.shape[0], hidden.shape[1], 2, 4)
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return (x + rotated).flatten(-2) * 2


def _lower_rotary(patched: bool):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    dims = {"hidden": {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}}
    program = capture(
        ToyInterleavedRotary(), {"hidden": torch.randn(2, 5, 8)}, ExecutorchConfig(dynamic_shapes=dims)
    )
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def test_xnnpack_unsqueeze_with_dynamic_batch_and_sequence_fails_without_the_patch():
    # Documents pytorch/executorch#11449 (unsqueeze_copy as static_reshape) on the installed executorch.
    with pytest.raises(RuntimeError, match="XNNPACK reshape only supports 1 dynamic dimension"):
        _lower_rotary(patched=False)


def test_unsqueeze_stays_portable_and_runs_with_the_patch():
    from hfexport_executorch.runtime import load_method, load_program

    edge = _lower_rotary(patched=True)
    targets = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    assert any("unsqueeze" in t for t in targets)  # kept out of the delegate
    assert any("executorch_call_delegate" in t for t in targets)  # the linear still is delegated
    buffer = edge.to_executorch().buffer  # the loaded program reads this buffer: keep it alive
    method = load_method(load_program(buffer))
    model = ToyInterleavedRotary()
    for batch, seq in ((1, 1), (3, 17), (4, 64)):
        x = torch.randn(batch, seq, 8)
        (out,) = method.execute([x])
        with torch.no_grad():
            expected = model(x)
        assert out.shape == (batch, seq, 8)
        assert (out - expected).abs().max().item() < 1e-5


class ToyTanhGelu(torch.nn.Module):
    """A linear layer then ``gelu(approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``: SigLIP, Gemma)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(hidden) * 4, approximate="tanh")


def _run_tanh_gelu(patched: bool) -> tuple[list[str], float]:
    """Lower ToyTanhGelu for XNNPACK (dynamic batch), run it; return (edge targets, max abs diff to eager)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program

    model = ToyTanhGelu()
    dims = {"hidden": {0: Dim("batch", min=1, max=64)}}
    program = capture(model, {"hidden": torch.randn(2, 8)}, ExecutorchConfig(dynamic_shapes=dims))
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    targets = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    buffer = edge.to_executorch().buffer  # the loaded program reads this buffer: keep it alive
    method = load_method(load_program(buffer))
    x = torch.linspace(-1.5, 1.5, 64 * 8).reshape(64, 8)
    (out,) = method.execute([x])
    with torch.no_grad():
        expected = model(x)
    return targets, (out - expected).abs().max().item()


def test_xnnpack_computes_tanh_gelu_as_exact_gelu_without_the_patch():
    # Documents pytorch/executorch#22851 on the installed executorch (retire the patch when this fails):
    # the delegated GELU ignores approximate="tanh"; exact and tanh GELU differ by up to ~5e-4.
    targets, diff = _run_tanh_gelu(patched=False)
    assert not any("gelu" in t for t in targets)  # delegated
    assert diff > 1e-4


def test_tanh_gelu_stays_portable_and_matches_eager_with_the_patch():
    targets, diff = _run_tanh_gelu(patched=True)
    assert any("gelu" in t for t in targets)  # kept out of the delegate
    assert any("executorch_call_delegate" in t for t in targets)  # the linear still is delegated
    assert diff < 1e-5


class ToyRouterMax(torch.nn.Module):
    """A linear router then ``max`` over the last axis of a 4-D tensor (``dim=-1``, as the MoE routers
    of gpt_oss / hy_v4 / mimo_v2_flash take it), plus a ``max`` over axis 3 with ``keepdim=True``
    (the one form XNNPACK pools) and one over axis 1 without ``keepdim``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.proj(hidden)  # (batch, 2, 3, 8)
        last = scores.max(dim=-1).values  # (batch, 2, 3)
        pooled = scores.max(dim=3, keepdim=True).values[..., 0]  # (batch, 2, 3)
        across = scores.max(dim=1).values.sum(-1)[:, None]  # (batch, 1, 3)
        return last + pooled + across


def _lower_router_max(patched: bool) -> tuple[list[str], float]:
    """Lower ToyRouterMax for XNNPACK, run it; return (edge targets, max abs diff to eager)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program

    model = ToyRouterMax()
    program = capture(model, {"hidden": torch.randn(2, 2, 3, 8)}, ExecutorchConfig())
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    targets = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    buffer = edge.to_executorch().buffer
    method = load_method(load_program(buffer))
    x = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(1))
    (out,) = method.execute([x])
    with torch.no_grad():
        expected = model(x)
    return targets, (out - expected).abs().max().item()


def test_xnnpack_claims_max_over_the_last_axis_and_fails_to_lower_without_the_patch():
    # Documents the installed executorch (retire max_dim_only_over_spatial_axes when this fails): the
    # partitioner claims a 4-D max.dim whatever its dim, and the serializer then refuses it.
    with pytest.raises(
        RuntimeError, match=r"amax.default only supports (dim == 2 or dim == 3|keep_dim == True)"
    ):
        _lower_router_max(patched=False)


def test_max_over_other_axes_stays_portable_and_matches_eager_with_the_patch():
    targets, diff = _lower_router_max(patched=True)
    assert sum("max.dim" in t for t in targets) == 2  # dim=-1 and dim=1 run on the portable kernel
    assert any(
        "executorch_call_delegate" in t for t in targets
    )  # the linear and the dim=3 max still are delegated
    assert diff < 1e-6


class ToySequencePrelu(torch.nn.Module):
    """``[batch, seq, 8]`` -> linear -> PReLU (one slope, 0.25) -> linear: DAB-DETR's encoder feed-forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.PReLU()
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


def _lower_sequence_prelu(patched: bool) -> tuple[list[str], float]:
    """Lower ToySequencePrelu for XNNPACK, run it; return (edge targets, max abs diff to eager)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program

    model = ToySequencePrelu().eval()
    program = capture(model, {"hidden": torch.randn(2, 5, 8)}, ExecutorchConfig())
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    targets = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    method = load_method(load_program(edge.to_executorch().buffer))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    (out,) = method.execute([x])
    with torch.no_grad():
        expected = model(x)
    return targets, (out - expected).abs().max().item()


def test_xnnpack_claims_a_3d_prelu_and_fails_to_lower_without_the_patch():
    # Documents the installed executorch (retire prelu_only_over_4d_inputs when this fails): the
    # partitioner claims a prelu of any rank, and the NHWC layout pass refuses a 3-D one.
    with pytest.raises(Exception, match="ChannelsLastTaggedReshapePass"):
        _lower_sequence_prelu(patched=False)


def test_a_3d_prelu_is_decomposed_and_matches_eager_with_the_patch():
    targets, diff = _lower_sequence_prelu(patched=True)
    assert not any("prelu" in t for t in targets)  # decomposed before partitioning
    assert any("executorch_call_delegate" in t for t in targets)  # the linears are still delegated
    assert diff < 1e-5


class ToyBiasedSoftmax(torch.nn.Module):
    """Attention weights with a 1x1-convolution bias, as PP-DocLayoutV2's reading order:
    ``softmax(scores [b, 4, n, n] + conv(relations [b, 8, n, n]), dim=-1)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias = torch.nn.Conv2d(8, 4, kernel_size=1)

    def forward(self, relations: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores + self.bias(relations), dim=-1)


def _lower_biased_softmax(patched: bool) -> float:
    """Lower ToyBiasedSoftmax for XNNPACK, run it; return the max abs diff to eager."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program

    model = ToyBiasedSoftmax().eval()
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "relations": torch.randn(2, 8, 6, 6, generator=gen),
        "scores": torch.randn(2, 4, 6, 6, generator=gen),
    }
    program = capture(model, inputs, ExecutorchConfig())
    with apply_patches("executorch.xnnpack") if patched else contextlib.nullcontext():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    method = load_method(load_program(edge.to_executorch().buffer))
    (out,) = method.execute(list(inputs.values()))
    with torch.no_grad():
        expected = model(**inputs)
    return (out - expected).abs().max().item()


def test_xnnpack_softmax_of_a_convolution_output_normalises_the_channels_without_the_patch():
    # Documents the installed executorch (retire softmax_takes_nchw_inputs when this fails): the
    # softmax runs over the physical last axis of the NHWC-tagged sum, the 4 channels.
    assert _lower_biased_softmax(patched=False) > 0.05


def test_xnnpack_softmax_of_a_convolution_output_matches_eager_with_the_patch():
    assert _lower_biased_softmax(patched=True) < 1e-6


_PATTERN_PASSES = ("ConvertToSDPAPass", "ConvertToUpsampleBilinear2d")


class ToyTwoPartitions(torch.nn.Module):
    """Conv1d + batch norm + ReLU, a portable mean, then a linear and softmax: two XNNPACK partitions;
    the conv one has what FuseBatchNorm / Conv1dUnsqueeze act on, the linear one does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(4)
        self.norm.running_mean.uniform_(-0.5, 0.5)
        self.norm.running_var.uniform_(0.5, 1.5)
        self.proj = torch.nn.Linear(4, 4)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.conv(x)))
        return torch.softmax(self.proj(y.mean(-1)), dim=-1)


def _lower_two_partitions(skip: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, list[str]]:
    """Lower ToyTwoPartitions with the executorch.xnnpack patches; return the ``.pte`` and the XNNPACK
    passes that ran. ``skip=False`` keeps only the pattern-matching passes in the skip table (building
    their pattern graphs costs seconds; the extended test below covers them)."""
    from executorch.backends.xnnpack import _passes as xnnpack_passes
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.workarounds import patches

    if not skip:
        kept = {k: v for k, v in patches._XNNPACK_PASS_NEEDS.items() if k in _PATTERN_PASSES}
        monkeypatch.setattr(patches, "_XNNPACK_PASS_NEEDS", kept)
    program = capture(ToyTwoPartitions(), {"x": torch.randn(2, 4, 6)}, ExecutorchConfig())
    ran: list[str] = []
    with apply_patches("executorch.xnnpack"):
        inner = xnnpack_passes._transform

        def spy(ep, *passes, **kwargs):
            result = inner(ep, *passes, **kwargs)
            if result is not ep:
                ran.extend(type(p).__name__ for p in passes)
            return result

        monkeypatch.setattr(xnnpack_passes, "_transform", spy)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        monkeypatch.setattr(xnnpack_passes, "_transform", inner)
    return edge.to_executorch().buffer, ran


@pytest.mark.extended
def test_xnnpack_pass_skipping_leaves_the_program_byte_identical(monkeypatch):
    skipped_buffer, ran_skipping = _lower_two_partitions(True, monkeypatch)
    full_buffer, ran_all = _lower_two_partitions(False, monkeypatch)
    assert skipped_buffer == full_buffer
    partitions = ran_all.count("ChannelsLastTaggedReshapePass")  # always runs, once per partition
    assert partitions == 2
    assert ran_skipping.count("ChannelsLastTaggedReshapePass") == partitions
    # the conv partition still gets the passes that act on it; nothing else does
    assert ran_skipping.count("FuseBatchNormPass") == 1
    assert ran_skipping.count("Conv1dUnsqueezePass") == 1
    for name in (
        "ConvertToUpsampleBilinear2d",
        "PReLUReshapePass",
        "DecomposeConcatenate",
        "RemoveGetItemPass",
    ):
        assert name not in ran_skipping
    assert len(ran_skipping) <= len(ran_all) - 10


def test_xnnpack_pass_skip_table_names_default_passes():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    from hfexport_executorch.workarounds.patches import _XNNPACK_PASS_NEEDS

    default = {p.__name__ for p in XNNPACKPassManager(None).passes}
    assert set(_XNNPACK_PASS_NEEDS) <= default, set(_XNNPACK_PASS_NEEDS) - default


@pytest.mark.parametrize(
    ("name", "ops", "runs"),
    [
        ("ConvertToLinearPass", {"aten.linear.default", "aten.relu.default"}, False),
        ("ConvertToLinearPass", {"aten.mm.default"}, True),
        ("ConvertToLinearPass", {"aten.addmm.default", "aten.permute_copy.default"}, True),
        ("ConvertToLinearPass", {"aten.bmm.default"}, True),
        # addmm_mm_to_linear drops the view_copy around a linear
        ("ConvertToLinearPass", {"aten.linear.default", "aten.view_copy.default"}, True),
        ("DimOrderOpsRevertPass", {"aten.linear.default", "aten.add.Tensor"}, False),
        ("DimOrderOpsRevertPass", {"aten.add.Tensor", "dim_order_ops._to_dim_order_copy.default"}, True),
        ("DimOrderOpsRevertPass", {"dim_order_ops._clone_dim_order.default"}, True),
    ],
)
def test_xnnpack_pass_skip_table_runs_the_re_tracing_passes_only_where_they_rewrite(name, ops, runs):
    from hfexport_executorch.workarounds.patches import _XNNPACK_PASS_NEEDS

    assert _XNNPACK_PASS_NEEDS[name](frozenset(ops)) is runs


def test_xnnpack_pass_skip_table_reads_edge_op_names_as_the_partition_graph_holds_them():
    from executorch.exir.dialects._ops import ops as exir_ops

    from hfexport_executorch.workarounds.patches import _edge_op_names

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(exir_ops.edge.dim_order_ops._to_dim_order_copy.default, (x,))
    graph.output(graph.call_function(exir_ops.edge.aten.mm.default, (y, y)))
    assert _edge_op_names(graph) == {"dim_order_ops._to_dim_order_copy.default", "aten.mm.default"}


@pytest.mark.extended
def test_xnnpack_pattern_graphs_hold_the_ops_the_skip_table_requires():
    # ConvertToSDPAPass / ConvertToUpsampleBilinear2d are skipped on partitions lacking these ops: valid only
    # while every pattern graph holds them (SubgraphMatcher matches each pattern node by call target).
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    from hfexport_executorch.workarounds.patches import _XNNPACK_PASS_NEEDS, _edge_op_names

    patterns = {
        "ConvertToSDPAPass": sdpa.get_graphs(),
        "ConvertToUpsampleBilinear2d": bilinear_2d.get_graphs_dict(),
    }
    for name, graphs in patterns.items():
        assert graphs
        for pattern in graphs:
            assert _XNNPACK_PASS_NEEDS[name](_edge_op_names(pattern.graph)), (
                name,
                _edge_op_names(pattern.graph),
            )


def test_a_dropped_program_frees_its_delegates_and_weights(tmp_path):
    """After an export, nothing of ExecuTorch's or torch's module state keeps the lowered program:
    the partition logger (``partition_log_keeps_no_node``), the node-comparison cache
    (``node_comparison_cache_per_export``) and the shape environments' caches
    (:func:`hfexport.capture.release_shape_env_caches`) each held the lowered modules, with their
    partitions' weights, for the rest of the process."""
    import gc
    import weakref

    from hfexport.testing import tiny_model
    from hfexport_executorch import ExecutorchExporter

    model, inputs = tiny_model("qwen3")
    program = ExecutorchExporter().export(model, inputs, ExecutorchConfig(dynamic=True, validate=False))
    delegates = [
        weakref.ref(m)
        for m in program.exported_program().graph_module.modules()
        if type(m).__name__ == "LoweredBackendModule"
    ]
    assert len(delegates) >= 3
    del program
    gc.collect()
    assert [ref for ref in delegates if ref() is not None] == []
    # what export_to_path relies on: the program is freed before the runtime loads the saved file
    report = ExecutorchExporter().export_to_path(
        model, inputs, tmp_path / "model.pte", ExecutorchConfig(dynamic=True)
    )
    assert [s.name for s in report.stages][-4:] == [
        "save",
        "load_artifact",
        "validate",
        "validate_second_shape",
    ]


def test_partition_copies_share_weights_and_copy_graphs():
    """``partition_copies_share_the_weights``: while the executorch patches are installed, delegate
    lowering's deep copies of a partition program share its weight tensors (and a duplicated
    weight is the same tensor) but not its graph; outside the patches ``copy`` is the real module."""
    import copy

    from executorch.exir.backend import backend_api
    from executorch.exir.backend.canonical_partitioners import duplicate_constant_node_pass

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)

    ep = torch.export.export(Tiny(), (torch.randn(2, 4),))
    weight = ep.state_dict["linear.weight"]
    with apply_patches("executorch"):
        copied = backend_api.copy.deepcopy(ep)
        assert copied.state_dict["linear.weight"] is weight  # shared, not copied
        assert copied.graph_module is not ep.graph_module and copied.graph is not ep.graph
        assert duplicate_constant_node_pass.copy.deepcopy(weight) is weight
    assert backend_api.copy is copy and duplicate_constant_node_pass.copy is copy
    assert copy.deepcopy(ep).state_dict["linear.weight"] is not weight


# --- circular padding without aten.empty (autoformer's trend projection, issue 28) ---------------


@pytest.mark.parametrize("pad", [(1, 1), (2, 0), (0, 3), (1, 2, 2, 1)])
def test_circular_pad_as_concat_matches_f_pad(pad):
    from hfexport_executorch.workarounds.patches import circular_pad_as_concat

    x = torch.randn(2, 3, 5) if len(pad) == 2 else torch.randn(2, 3, 4, 5)  # F.pad: the axes after channel
    expected = torch.nn.functional.pad(x, pad, mode="circular")
    got = circular_pad_as_concat(x, pad)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)  # the same values, moved: exact


def test_circular_pad_as_concat_rejects_bad_widths():
    from hfexport_executorch.workarounds.patches import circular_pad_as_concat

    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="non-negative"):
        circular_pad_as_concat(x, (1, -1))
    with pytest.raises(ValueError, match="non-negative"):
        circular_pad_as_concat(x, (1,))
    with pytest.raises(ValueError, match="larger than axis 2 of size 4"):
        circular_pad_as_concat(x, (5, 0))


class ToyCircularConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(4, 3, kernel_size=3, padding=1, padding_mode="circular", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _circular_conv_edge(patched: bool):
    from executorch.exir import to_edge

    model, x = ToyCircularConv().eval(), torch.randn(2, 4, 10)
    with torch.no_grad(), apply_patches("executorch") if patched else contextlib.nullcontext():
        program = torch.export.export(
            model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},), strict=False
        )
        edge = to_edge(program)
    node = next(n for n in edge.exported_program().graph.nodes if n.op == "placeholder" and n.name == "x")
    return model, program, node.meta["val"].shape[0]


@pytest.mark.extended  # a second to_edge of the toy (~5 s); the patched case runs by default
def test_circular_conv_batch_is_fixed_at_to_edge_without_the_patch():
    # Documents the ExecuTorch fault worked around by circular_pad_without_empty: when the batch
    # stays symbolic unpatched, the patch can be retired.
    _, _, batch = _circular_conv_edge(patched=False)
    assert batch == 2


def test_circular_conv_keeps_a_dynamic_batch_and_eager_values_with_the_patch():
    model, program, batch = _circular_conv_edge(patched=True)
    assert isinstance(batch, torch.SymInt)
    wider = torch.randn(5, 4, 10)
    with torch.no_grad():
        assert torch.allclose(program.module()(wider), model(wider), atol=1e-6, rtol=1e-6)


def test_exact_symbolic_quotients_are_cancelled_in_planned_sizes():
    """SEW-D's scores viewed [-1, heads, frames, frames]: the leading size (8*b*t**2)//(2*t**2) is 4*b,
    which bound_sympy bounded by max(numerator) // 1 (a 10 TB buffer: load failed with 0x21)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    from hfexport import registry
    from hfexport_executorch.workarounds import patches

    b, s = sympy.symbols("s0 s1", integer=True, positive=True)
    ranges = {b: ValueRanges(1, 8), s: ValueRanges(5, 1501)}
    frames = FloorDiv(s - 3, 2) + 1  # 1..750
    leading = FloorDiv(8 * b * frames * frames, 2 * frames * frames)
    assert int(bound_sympy(leading, ranges).upper) == 4_500_000  # the planner's answer without the patch
    assert patches.tighter_upper_bound(leading, ranges) == 32
    assert patches.tighter_upper_bound(leading * frames, ranges) == 32 * 750
    # an inexact quotient keeps the original bound, as does an expression without quotient
    assert patches.tighter_upper_bound(FloorDiv(3 * frames, 2), ranges) is None
    assert patches.tighter_upper_bound(b * frames, ranges) is None
    found = {e.name: e for e in registry.entries("executorch", kind="patch")}
    entry = found[f"{patches.__name__}.exact_quotients_in_upper_bounds"]
    assert entry.paths == (
        "executorch.exir.sym_util.eval_upper_bound",
        "executorch.exir.passes.sym_shape_eval_pass.eval_upper_bound",
    )
    assert not entry.unresolved and entry.is_active()
    wrapped = patches.exact_quotients_in_upper_bounds(lambda value: 7)
    assert wrapped(5) == 7  # plain ints: the original's answer


def test_an_expression_the_interval_analysis_refuses_keeps_the_planners_bound(monkeypatch):
    """FastSpeech 2 has sizes whose bound_sympy raises ValueRangeError: no tighter bound, no crash."""
    import sympy
    import torch.utils._sympy.value_ranges as value_ranges
    from torch.utils._sympy.functions import FloorDiv

    from hfexport_executorch.workarounds import patches

    b, s = sympy.symbols("s0 s1", integer=True, positive=True)
    expr = FloorDiv(4 * b * s, 2 * s)

    def refuse(*args, **kwargs):
        raise value_ranges.ValueRangeError("Invalid ranges [0:-1]")

    monkeypatch.setattr(value_ranges, "bound_sympy", refuse)
    assert patches.tighter_upper_bound(expr, {}) is None


def test_exact_floor_divisions_replaces_divisible_quotients_only():
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    from hfexport_executorch.workarounds.patches import exact_floor_divisions

    s, b = sympy.symbols("s b", integer=True, positive=True)
    assert exact_floor_divisions(FloorDiv(s**2, s)) == s
    assert exact_floor_divisions(FloorDiv((2 * s - 1) * FloorDiv(s**2, s), s)) == 2 * s - 1
    assert exact_floor_divisions(FloorDiv(b * s**2 + b * s, b * s)) == s + 1
    # not exact: kept as floor divisions
    assert exact_floor_divisions(FloorDiv(s, 2)) == FloorDiv(s, 2)
    assert exact_floor_divisions(FloorDiv(s + 1, s)) == FloorDiv(s + 1, s)
    assert exact_floor_divisions(FloorDiv(s**2, 2 * s)) == FloorDiv(s**2, 2 * s)
    assert exact_floor_divisions(s + 1) == s + 1


class ToyRelativeShift(torch.nn.Module):
    """XLNet's relative-position shift (``rel_shift_bnij``) on einsum scores ``[batch, seq, 2 * seq]``:
    the einsum's last size traces as ``(s**2)//s``, the shifted view's as ``((2*s - 1)*((s**2)//s))//s``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bid,bjd->bij", x, torch.cat([x, -x], dim=1))
        b, i, j = scores.shape
        shifted = scores.reshape(b, j, i)[:, 1:, :].reshape(b, i, j - 1)
        return shifted[:, :, :i]


def _relative_shift_program(patched: bool):
    from executorch.exir import to_edge

    from hfexport_executorch.lowering import planned_memory_bytes

    dims = {"x": {0: Dim.AUTO(min=1, max=4), 1: Dim.AUTO(min=2, max=512)}}
    program = capture(ToyRelativeShift(), {"x": torch.randn(2, 8, 4)}, ExecutorchConfig(dynamic_shapes=dims))
    with apply_patches("executorch") if patched else contextlib.nullcontext():
        manager = to_edge(program).to_executorch()
    return manager, planned_memory_bytes(manager)


# the largest activation at the bounds: the [4, 512, 2 * 512] float32 scores, 8 MiB
_SHIFT_SCORES_BYTES = 4 * 512 * 1024 * 4


def test_relative_shift_plans_a_quadratic_bound_without_the_patch():
    # Documents the interval bound of FloorDiv (bound_sympy: (s**2)//s <= 512**2 // 2): when this plans
    # near the true size, exact_quotients_in_upper_bounds can be retired.
    _, planned = _relative_shift_program(patched=False)
    assert planned > 100 * _SHIFT_SCORES_BYTES


def test_relative_shift_plans_its_true_bound_and_runs_at_the_bound_with_the_patch():
    from hfexport_executorch.runtime import load_method, load_program

    manager, planned = _relative_shift_program(patched=True)
    assert _SHIFT_SCORES_BYTES <= planned <= 4 * _SHIFT_SCORES_BYTES
    method = load_method(load_program(manager.buffer))
    for batch, seq in ((1, 2), (3, 9), (4, 512)):
        x = torch.randn(batch, seq, 4)
        (out,) = method.execute([x])
        expected = ToyRelativeShift()(x)
        assert out.shape == (batch, seq, seq)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class ToyFrameGrid(torch.nn.Module):
    """VITS-like: the frame count is the ``.item()`` of the summed durations (an unbacked size ``u``),
    and the output ``[batch, u, seq]`` has strides ``(u*seq, seq, 1)``."""

    def forward(self, x: torch.Tensor, durations: torch.Tensor) -> torch.Tensor:
        frames_count = durations.sum(1).max().item()
        torch._check(frames_count <= 64)
        frames = torch.arange(frames_count, dtype=x.dtype)
        return (x.unsqueeze(-1) * frames).transpose(1, 2) + 1.0


def _frame_grid_manager(patched: bool):
    from executorch.exir import to_edge

    dims = {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=32)}
    program = torch.export.export(
        ToyFrameGrid(), (torch.randn(2, 8), torch.full((2, 8), 2)), dynamic_shapes=(dims, dims)
    )
    with apply_patches("executorch") if patched else contextlib.nullcontext():
        return to_edge(program).to_executorch()


def test_stride_sort_guards_on_an_unbacked_frame_count_without_the_patch():
    # Documents executorch 1.4.1's stride comparison (pytorch/executorch#19516 decides divisibility one
    # way only): when this plans, stride_order_without_data_dependent_guards can be retired.
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    with pytest.raises(GuardOnDataDependentSymNode, match="data-dependent expression u"):
        _frame_grid_manager(patched=False)


def test_unbacked_frame_count_plans_and_matches_eager_with_the_patch():
    from hfexport_executorch.runtime import load_method, load_program

    manager = _frame_grid_manager(patched=True)  # the loaded program reads the manager's buffer
    method = load_method(load_program(manager.buffer))
    for batch, seq, duration in ((2, 8, 2), (3, 20, 1), (1, 2, 32)):
        x, durations = torch.randn(batch, seq), torch.full((batch, seq), duration)
        (out,) = method.execute([x, durations])
        expected = ToyFrameGrid()(x, durations)
        assert out.shape == (batch, seq * duration, seq)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_stride_order_by_divisibility_orders_multiples_and_refuses_unrelated_sizes():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    from hfexport_executorch.workarounds.patches import stride_order_without_data_dependent_guards

    shape_env = ShapeEnv()
    u, v = shape_env.create_unbacked_symint(), shape_env.create_unbacked_symint()

    def original(stride):
        return tuple(sorted(range(len(stride)), key=lambda i: stride[i], reverse=True))  # guards

    order = stride_order_without_data_dependent_guards(original)
    assert order((8, 1, 8 * u)) == (2, 0, 1)
    assert order((u, 4 * u, 1)) == (1, 0, 2)
    assert order((6, 3, 1)) == (0, 1, 2)
    with pytest.raises(GuardOnDataDependentSymNode):
        order((u, v, 1))


class ToyResponseNorm(torch.nn.Module):
    """ConvNeXt V2's global response norm on ``[batch, H, W, C]``: norms ``[batch, 1, 1, C]`` divided by
    their mean ``[batch, 1, 1, 1]`` (a broadcasting div), then a plain div of equal shapes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        scale = norms / (norms.mean(dim=-1, keepdim=True) + 1e-6)
        return (x * scale) / (x.abs() + 1.0)


def _div_nodes(dynamic: bool) -> list:
    dims = {"x": {0: Dim("batch", min=1, max=8), 1: Dim("h", min=2, max=64), 2: Dim("w", min=2, max=64)}}
    program = torch.export.export(
        ToyResponseNorm(), (), {"x": torch.randn(2, 8, 8, 16)}, dynamic_shapes=dims if dynamic else None
    )
    return [n for n in program.graph.nodes if n.target == torch.ops.aten.div.Tensor]


def test_only_a_broadcasting_div_over_dynamic_sizes_is_declined():
    from hfexport_executorch.workarounds.patches import _broadcasts_over_a_dynamic_size

    broadcast, same_shape = _div_nodes(dynamic=True)
    assert _broadcasts_over_a_dynamic_size(broadcast)  # [b, 1, 1, 16] / [b, 1, 1, 1]
    assert not _broadcasts_over_a_dynamic_size(same_shape)  # [b, h, w, 16] / [b, h, w, 16]
    assert not any(_broadcasts_over_a_dynamic_size(n) for n in _div_nodes(dynamic=False))


@pytest.mark.extended  # two tiny ConvNeXt V2 ExecuTorch exports: about a minute on 2 cores
def test_convnextv2_second_shape_matches_eager_only_with_the_broadcast_div_patch():
    from hfexport.errors import ExportValidationError
    from hfexport.registry import unregister
    from hfexport.testing import tiny_model
    from hfexport_executorch import ExecutorchExporter

    def export() -> None:
        model, inputs = tiny_model("convnextv2", "image-classification")
        ExecutorchExporter().export(model, inputs, ExecutorchConfig(dynamic=True))

    export()  # the 64 px second shape validates (logits within atol 1e-4)
    name = "hfexport_executorch.workarounds.patches.broadcast_div_stays_portable"
    removed = unregister("patch", name)
    assert removed
    try:
        with pytest.raises(ExportValidationError, match="second shape"):
            export()
    finally:
        from hfexport import registry

        for entry in removed:
            registry._REGISTRY.add(entry)


class ShiftedGridResize(torch.nn.Module):
    """Resizes a learned 8x8 position grid by ``(side + 0.1) / 8``, as HunYuan-V4-VL's vision
    patch embedding does: the scale is not the output/input size ratio (3/8, 5/8)."""

    def __init__(self, scales: tuple[float, float] = (3.1 / 8, 5.1 / 8)) -> None:
        super().__init__()
        self.grid = torch.nn.Parameter(torch.randn(1, 4, 8, 8))
        self.scales = scales

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.nn.functional.interpolate(
            self.grid, scale_factor=self.scales, mode="bilinear", align_corners=False
        )
        return input_ids + pos.flatten(2).transpose(1, 2)


def test_resize_with_its_own_scale_stays_portable_and_matches_eager():
    # hy_v4_vl's image encoder on ExecuTorch: "exported artifact does not match eager PyTorch" (XNNPACK's
    # static bilinear resize ignores scale_factor: 0.47 off on this toy without the patch)
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    exporter.export(ShiftedGridResize().eval(), {"input_ids": torch.randn(1, 15, 4)}, ExecutorchConfig())
    report = exporter.last_report
    installed = next(s for s in report.stages if s.name == "patches").data
    assert (
        "hfexport_executorch.workarounds.patches.resize_with_own_scale_stays_portable"
        in installed["executorch.xnnpack"]
    )
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


def test_only_a_resize_whose_scale_is_not_the_size_ratio_is_declined():
    from hfexport_executorch.workarounds.patches import _resize_scales_differ

    def resize_node(scales):
        rows = int(8 * scales[0]) * int(8 * scales[1])
        program = torch.export.export(ShiftedGridResize(scales), (torch.randn(1, rows, 4),))
        program = program.run_decompositions({})
        return next(n for n in program.graph.nodes if "upsample_bilinear2d" in str(n.target))

    assert _resize_scales_differ(resize_node((3.1 / 8, 5.1 / 8)))
    assert not _resize_scales_differ(resize_node((0.5, 0.25)))  # 8 -> 4 and 8 -> 2: the ratios


class SpaceTimeFold(torch.nn.Module):
    """Folds ``[B, T, H, W, C]`` 2x2 patches of space into channels through an 8-D reshape and permute,
    then projects them, as Inkling's vision encoder layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4 * 3, 5, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, t, h, w, c = pixel_values.shape
        x = pixel_values.reshape(b, t, 1, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
        return self.proj(x.reshape(b, t, h // 2, w // 2, 4 * c))


def test_tensors_above_six_dims_stay_portable_and_the_method_loads():
    # inkling_mm_model's image encoder: "Failed to define tensor 0 with code: xnn_status_unsupported_parameter",
    # "Failed to load method forward, error: 0x1" without the patch
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    exporter.export(SpaceTimeFold().eval(), {"pixel_values": torch.randn(2, 2, 4, 4, 3)}, ExecutorchConfig())
    report = exporter.last_report
    installed = next(s for s in report.stages if s.name == "patches").data
    assert (
        "hfexport_executorch.workarounds.patches.tensors_above_six_dims_stay_portable"
        in installed["executorch.xnnpack"]
    )
    assert report.extra["delegation"]  # the linear is still delegated
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows
