"""Object-detection and image-segmentation programs on ExecuTorch (issue 28): the XNNPACK layout
tags keep the image sides' ranges, symbolic-size powers become products."""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._sympy.value_ranges import ValueRanges

import hfexport_executorch  # noqa: F401  (registers the patches)
from hfexport.registry import apply_patches


def _pooled_feature_map(side: int = 32, upper: int = 128):
    """A fake ``[2, 4, side // 32, side // 32]`` feature map (1x1 at the 32-pixel sample) of an image
    whose sides range over ``[1, upper]``; returns ``(map, shape_env, height symbol)``."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    dynamic = [DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.DYNAMIC]
    image = mode.from_tensor(
        torch.empty(2, 4, side, side), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic)
    )
    height = image.shape[2].node.expr
    for size in image.shape[2:]:
        env.var_to_range[size.node.expr] = ValueRanges(1, upper)
    with mode:
        pooled = torch.nn.functional.max_pool2d(image, 32, 32, ceil_mode=True)
    return pooled, env, height


def _is_nhwc(tensor: torch.Tensor) -> bool:
    from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
        ChannelsLastTaggedReshapePass,
    )

    return ChannelsLastTaggedReshapePass._is_nhwc_tensor(tensor)


def test_xnnpack_layout_tag_narrows_the_image_side_to_the_sample_without_the_patch():
    # Documents the fault layout_tags_without_size_guards works around (executorch 1.4.1): when
    # the range survives unpatched, the patch can be retired.
    pooled, env, height = _pooled_feature_map()
    assert _is_nhwc(pooled) is False
    assert env.var_to_range[height] == ValueRanges(1, 32)


def test_xnnpack_layout_tag_keeps_the_image_side_range_with_the_patch():
    pooled, env, height = _pooled_feature_map()
    with apply_patches("executorch.xnnpack"):
        assert _is_nhwc(pooled) is False  # contiguous (NCHW), as upstream answers at the sample
    assert env.var_to_range[height] == ValueRanges(1, 128)
    # a symbolic channels-last image is NHWC, still without narrowing its sides
    env = ShapeEnv()
    dynamic = [DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.DYNAMIC]
    image = FakeTensorMode(shape_env=env).from_tensor(
        torch.empty(2, 4, 32, 32).contiguous(memory_format=torch.channels_last),
        symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic),
    )
    for size in image.shape[2:]:
        env.var_to_range[size.node.expr] = ValueRanges(1, 128)
    with apply_patches("executorch.xnnpack"):
        assert _is_nhwc(image) is True
        # concrete tensors keep upstream's answers: NHWC only when channels-last and not also contiguous
        assert _is_nhwc(torch.empty(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)) is True
        assert _is_nhwc(torch.empty(2, 4, 8, 8)) is False
        assert _is_nhwc(torch.empty(2, 4, 1, 1).contiguous(memory_format=torch.channels_last)) is False
    assert env.var_to_range[image.shape[2].node.expr] == ValueRanges(1, 128)


def _pow_graph(exponent: object) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    side = graph.placeholder("side")
    power = graph.call_function(operator.pow, (side, exponent))
    graph.output(graph.call_function(operator.add, (power, 1)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_executorch_prim_ops_have_no_pow():
    # why symbolic_powers_as_products exists: the emitter's table of symbolic-int operators
    from executorch.exir.passes.executorch_prim_ops_registry import is_sym_op

    assert not is_sym_op(operator.pow)
    assert is_sym_op(operator.mul)


@pytest.mark.parametrize("exponent", [1, 2, 3])
def test_symbolic_powers_become_products_of_the_same_value(exponent):
    from hfexport_executorch.workarounds.edge_passes import symbolic_powers_as_products

    gm = _pow_graph(exponent)
    assert symbolic_powers_as_products(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert operator.pow not in targets
    assert targets.count(operator.mul) == exponent - 1
    for side in (1, 5, 17):
        assert gm(side) == side**exponent + 1


@pytest.mark.parametrize("exponent", [0, -1, 0.5, "k"])
def test_powers_without_a_positive_literal_exponent_are_left(exponent):
    from hfexport_executorch.workarounds.edge_passes import symbolic_powers_as_products

    gm = _pow_graph(exponent)
    assert symbolic_powers_as_products(gm) == 0
    assert operator.pow in [n.target for n in gm.graph.nodes]


def test_the_power_pass_is_registered_and_run_before_memory_planning():
    from hfexport import registry
    from hfexport_executorch.workarounds import edge_passes

    names = [e.name for e in registry.active_entries(edge_passes.KIND, "executorch.xnnpack")]
    assert f"{edge_passes.__name__}.symbolic_powers_as_products" in names
    passes = edge_passes.edge_passes("executorch.xnnpack")
    gm = _pow_graph(2)
    result = passes[names.index(f"{edge_passes.__name__}.symbolic_powers_as_products")](gm)
    assert result.modified and result.graph_module(3) == 10


def test_exact_quotients_cancel_over_inner_floor_divisions():
    """MobileViT's attention views: (X**2 * Y**2)//(X*Y) patches, X = (side - 1)//16 + 1. bound_sympy
    bounds it at 4096 for sides up to 128 while the tensor it views is planned for X*Y <= 64, so the
    view ran past the planned arena (method load failed with 0x21, MemoryAllocationFailed)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv
    from torch.utils._sympy.value_ranges import bound_sympy

    from hfexport_executorch.workarounds.patches import exact_floor_divisions, tighter_upper_bound

    height, width = sympy.symbols("s0 s1", integer=True, positive=True)
    ranges = {height: ValueRanges(1, 128), width: ValueRanges(1, 128)}
    rows, cols = FloorDiv(height - 1, 16) + 1, FloorDiv(width - 1, 16) + 1
    patches = FloorDiv(rows**2 * cols**2, rows * cols)
    assert int(bound_sympy(patches, ranges).upper) == 4096  # the planner's answer without the rewrite
    assert tighter_upper_bound(patches, ranges) == 64
    assert sympy.expand(exact_floor_divisions(patches) - rows * cols) == 0
    for h, w in ((1, 1), (32, 48), (127, 128)):
        point = {height: h, width: w}
        assert exact_floor_divisions(patches).subs(point) == patches.subs(point)
    # inexact quotients over inner floor divisions are kept
    assert exact_floor_divisions(FloorDiv(rows, 2)) == FloorDiv(rows, 2)
    assert exact_floor_divisions(FloorDiv(rows * cols + 1, rows)) == FloorDiv(rows * cols + 1, rows)


def _dim_order(stride):
    from executorch.exir import tensor as exir_tensor

    return tuple(exir_tensor.dim_order_from_stride(stride))


def _width(pooled: torch.Tensor):
    (symbol,) = pooled.shape[3].node.expr.free_symbols
    return symbol


def test_tensor_spec_dim_order_narrows_the_image_side_without_the_patch():
    # Documents the fault dim_order_without_size_guards works around (executorch 1.4.1): the
    # strides' sort compares the 1x1 map's width stride with 1 and guards at the sample
    pooled, env, _ = _pooled_feature_map()
    assert _dim_order(pooled.stride()) == (0, 1, 2, 3)
    assert env.var_to_range[_width(pooled)] == ValueRanges(1, 32)


def test_tensor_spec_dim_order_keeps_the_image_side_range_with_the_patch():
    pooled, env, height = _pooled_feature_map()
    with apply_patches("executorch"):
        assert _dim_order(pooled.stride()) == (0, 1, 2, 3)
        last = FakeTensorMode(shape_env=env).from_tensor(
            torch.empty(2, 4, 32, 32).contiguous(memory_format=torch.channels_last),
            symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.DYNAMIC]
            ),
        )
        assert _dim_order(last.stride()) == (0, 2, 3, 1)
        # concrete strides: upstream's answer
        assert _dim_order((96, 1, 12, 3)) == (0, 2, 3, 1)
    assert env.var_to_range[height] == ValueRanges(1, 128)
    assert env.var_to_range[_width(pooled)] == ValueRanges(1, 128)


class _ToyDetector(torch.nn.Module):
    """A pooled map broadcast against the full-resolution map, with dynamic image sides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.conv(pixel_values)
        return features * features.mean((2, 3), keepdim=True)


def test_memory_planning_runs_size_oblivious_for_dynamic_image_sides(monkeypatch):
    import torch.fx.experimental._config as fx_config

    from hfexport.config import ExecutorchConfig
    from hfexport_executorch import ExecutorchExporter, lowering

    seen = []
    original = lowering.plan_memory

    def recording(*args, **kwargs):
        seen.append(fx_config.backed_size_oblivious)
        return original(*args, **kwargs)

    monkeypatch.setattr(lowering, "plan_memory", recording)
    model = _ToyDetector().eval()
    exporter = ExecutorchExporter()
    config = ExecutorchConfig(dynamic=True, validate=False)  # the flag is the point; validation is slow
    exporter.export(model, {"pixel_values": torch.randn(2, 3, 32, 32)}, config)
    sides = [(a["meaning"], a["status"]) for a in exporter.last_report.dynamic_axes if a["axis"] >= 2]
    assert sides == [("image height", "dynamic"), ("image width", "dynamic")]
    assert seen == [True]


class _ChannelWindows(torch.nn.Module):
    """``[b, 64, side, side]`` -> ``[b, side**2, w, 64 // w]`` with ``w = side // 32`` windows: the view's
    ``w`` and ``64 // w`` axes trade size, as RF-DETR's and Donut-Swin's window partitions do."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = (image.flatten(2).transpose(1, 2) + 1).contiguous()
        windows = image.shape[2] // 32
        return tokens.view(image.shape[0], windows, -1, 64 // windows).transpose(1, 2) * 2


def _window_program(patched: bool):
    from hfexport.config import ExecutorchConfig
    from hfexport_executorch import lowering

    side = torch.export.Dim.AUTO(min=32, max=64)
    program = torch.export.export(
        _ChannelWindows().eval(),
        (torch.randn(2, 64, 32, 32),),
        dynamic_shapes=({0: torch.export.Dim.AUTO(min=1, max=8), 2: side, 3: side},),
    )
    with apply_patches("executorch") if patched else contextlib.nullcontext():
        return lowering.plan_memory(lowering.lower_to_edge(program, []), ExecutorchConfig())


def _view_and_base_bytes(manager) -> list[tuple[int, int]]:
    from executorch.exir import memory

    out = []
    for node in manager.exported_program().graph_module.graph.nodes:
        spec = node.meta.get("spec")
        if node.op == "call_function" and node.target is memory.view and spec.is_dynamic_shape_tensor:
            out.append((spec.nbytes(), spec._base.nbytes()))
    return out


@pytest.mark.parametrize(
    ("bound", "base", "expected"),
    [
        ([8, 2, 4096, 64], 8 * 4096 * 64, [4, 2, 4096, 64]),  # the toy below: 2x its base before
        ([8, 16, 4, 64, 4, 64], 8 * 256 * 64, [1, 2, 4, 64, 4, 64]),  # RF-DETR's partition, 256x before
        ([6, 5], 12, [12, 1]),  # no divisor fits: the first axis takes the rest
        ([3, 0, 4], 0, [0, 0, 0]),
    ],
)
def test_view_bound_within_base_holds_exactly_the_base_elements(bound, base, expected):
    import math

    from hfexport_executorch.workarounds.patches import view_bound_within_base

    shaped = view_bound_within_base(bound, base)
    assert shaped == expected and math.prod(shaped) == base


def test_view_bound_within_base_refuses_a_0d_view():
    from hfexport_executorch.workarounds.patches import view_bound_within_base

    with pytest.raises(ValueError, match="at least one axis"):
        view_bound_within_base([], 4)


@pytest.mark.extended  # a second lowering of the toy (~15 s on a loaded machine)
def test_window_view_is_planned_past_its_base_without_the_patch():
    # Documents the fault views_bounded_by_their_base works around (executorch 1.4.1): bounded axis by
    # axis, the view of [8, 4096, 64] floats is planned at [8, 2, 4096, 64], past its base's buffer
    assert (16777216, 8388608) in _view_and_base_bytes(_window_program(patched=False))


def test_window_view_fits_its_base_and_the_method_runs_two_sides():
    from hfexport_executorch.runtime import load_method, load_program

    manager = _window_program(patched=True)
    views = _view_and_base_bytes(manager)
    assert views and all(view == base for view, base in views)
    method = load_method(load_program(manager.buffer))  # raised MemoryAllocationFailed (0x21) before
    model = _ChannelWindows().eval()
    for side in (32, 64, 32):  # w = 1, 2, then back to 1 on the same loaded method
        image = torch.randn(2, 64, side, side, generator=torch.Generator().manual_seed(side))
        (out,) = method.execute([image])
        expected = model(image)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
