"""Image sides the model fixes are found before capture and traced static (issue 15)."""

from __future__ import annotations

import functools
import logging

import torch
from torch.export import Dim

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.report import ExportReport
from hfexport.side_probe import keep_sides_static, model_fixed_image_sides
from hfexport.testing import tiny_model
from hfexport.validation import derive_second_inputs

AUTO = {"pixel_values": {0: Dim.AUTO, 1: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}}
# what the ExecuTorch backend plans for dynamic=True: bounded hints, sides up to 4x the sample
BOUNDED = {
    "pixel_values": {
        0: Dim.AUTO(min=1, max=8),
        1: None,
        2: Dim.AUTO(min=1, max=128),
        3: Dim.AUTO(min=1, max=128),
    }
}


class PatchTable(torch.nn.Module):
    """Patches of 8 plus a position table of 4 rows: only 16x16 images fit (SigLIP in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 4, 8, stride=8)
        self.table = torch.nn.Parameter(torch.randn(1, 4, 4))

    def forward(self, pixel_values):
        return self.patch(pixel_values).flatten(2).transpose(1, 2) + self.table


class ConvOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, pixel_values):
        return self.conv(pixel_values).mean((2, 3))


class DataDependent(PatchTable):
    """Branches on a value: no fake run decides anything, the sample's included."""

    def forward(self, pixel_values):
        if pixel_values.mean() > 100:
            return pixel_values
        return super().forward(pixel_values)


def _pixels(side=16):
    return {"pixel_values": torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0))}


def test_a_position_table_fixes_the_sides_and_convolutions_do_not():
    fixed = model_fixed_image_sides(PatchTable(), _pixels(), AUTO)
    assert [(f["input"], f["axis"], f["sample"], f["tried"]) for f in fixed] == [
        ("pixel_values", 2, 16, 32),
        ("pixel_values", 3, 16, 32),
    ]
    assert fixed[0]["reason"].startswith("RuntimeError: Attempting to broadcast a dimension of length 4"), (
        fixed
    )
    assert model_fixed_image_sides(ConvOnly(), _pixels(), AUTO) == []
    assert model_fixed_image_sides(ConvOnly(), _pixels(), BOUNDED) == []


def test_only_auto_sides_are_probed():
    named = {"pixel_values": {0: Dim.AUTO, 2: Dim("height", min=8, max=64), 3: Dim.DYNAMIC}}
    assert model_fixed_image_sides(PatchTable(), _pixels(), named) == []
    assert model_fixed_image_sides(PatchTable(), _pixels(), {"pixel_values": {0: Dim.AUTO}}) == []
    assert model_fixed_image_sides(PatchTable(), _pixels(), None) == []
    # a size-1 side (a 1-pixel strip) is not grown
    assert model_fixed_image_sides(ConvOnly(), {"pixel_values": torch.randn(2, 3, 1, 16)}, AUTO) == []


def test_a_probe_that_fails_on_the_sample_decides_nothing_and_leaves_no_state():
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    model = DataDependent()
    assert model_fixed_image_sides(model, _pixels(), AUTO) == []
    assert fake_log.level == level
    out = model(**_pixels())  # eager still runs on real tensors
    assert type(out) is torch.Tensor and tuple(out.shape) == (2, 4, 4)


def test_keep_sides_static_keeps_the_spec_form():
    fixed = [{"input": "pixel_values", "axis": 2}, {"input": "pixel_values", "axis": 3}]
    spec = keep_sides_static(AUTO, fixed)["pixel_values"]
    assert spec[0] is Dim.AUTO and spec[2] is Dim.STATIC and spec[3] is Dim.STATIC
    assert AUTO["pixel_values"][2] is Dim.AUTO  # the argument is not modified
    as_tuple = keep_sides_static({"pixel_values": (Dim.AUTO,) * 4}, fixed)["pixel_values"]
    assert as_tuple == (Dim.AUTO, Dim.AUTO, Dim.STATIC, Dim.STATIC)
    assert keep_sides_static(AUTO, []) is AUTO


def test_tiny_siglip_sides_are_model_fixed_with_bounded_hints():
    # issue 15: with the bounded hints ExecuTorch captures with, SigLIP's sides came out dynamic
    # although its 16-row position table fixes them at 32, and the second shape fed 64x64
    model, inputs = tiny_model("siglip")
    report = ExportReport(export_format="test")
    program = capture(model, inputs, DynamoConfig(dynamic_shapes=BOUNDED), report)
    assert "pixel_values image height/width: static 32 (model-fixed)" in report.dynamic_axes_summary
    assert "pixel_values batch: dynamic [2, 8]" in report.dynamic_axes_summary
    assert [(s["axis"], s["sample"], s["tried"]) for s in report.extra["model_fixed_sides"]] == [
        (2, 32, 64),
        (3, 32, 64),
    ]
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert reason == "" and tuple(second["pixel_values"].shape) == (3, 3, 32, 32)
    with torch.no_grad():
        got = program.module()(**second).logits
        expected = model(**second).logits
    assert (got - expected).abs().max().item() < 1e-5


def test_tiny_convnext_sides_stay_dynamic_with_bounded_hints():
    model, inputs = tiny_model("convnext", "image-classification")
    report = ExportReport(export_format="test")
    capture(model, inputs, DynamoConfig(dynamic_shapes=BOUNDED), report)
    assert "pixel_values image height/width: dynamic [32, 128]" in report.dynamic_axes_summary
    assert "model_fixed_sides" not in report.extra


class CachedGrid(ConvOnly):
    """Adds a grid computed by a method cached on the feature map's (int) sides, as the DETR family's
    anchors and position tables are (``functools.lru_cache`` under transformers' wrapper)."""

    @functools.lru_cache(maxsize=4)  # noqa: B019 - the pattern under test
    def grid(self, height: int, width: int) -> torch.Tensor:
        return torch.arange(height * width, dtype=torch.float32).reshape(1, 1, height, width)

    def forward(self, pixel_values):
        feats = self.conv(pixel_values)
        return (feats + self.grid(int(feats.shape[2]), int(feats.shape[3]))).mean((2, 3))


def test_probe_leaves_no_fake_tensor_in_method_caches():
    from torch._subclasses.fake_tensor import FakeTensor

    model, inputs = CachedGrid(), _pixels()
    model_fixed_image_sides(model, inputs, AUTO)
    out = model(**inputs)  # the eager reference after the probe: no cached fake grid
    assert not isinstance(out, FakeTensor)
    torch.testing.assert_close(out, model.conv(inputs["pixel_values"]).mean((2, 3)) + 127.5)


def test_the_fake_probe_leaves_no_fake_tensor_in_transformers_lru_caches():
    """issue 28: DINOv3 memoises its patch coordinates per grid size (compile_compatible_method_lru_cache);
    the probe's fake forward left a FakeTensor there, and the next eager forward at the doubled size
    returned a fake output (CHMv2's validation: DataDependentOutputException: aten.equal.default)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from hfexport import registry
    from hfexport.side_probe import PROBE_KEY

    entry = {e.name: e for e in registry.entries(PROBE_KEY, kind="patch")}[
        "hfexport.side_probe.bypass_transformers_lru_caches"
    ]
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved
    model, _ = tiny_model("dinov3_vit", "feature-extraction")
    # a grid size (5x5 patches of 8, probed doubled to 10x10) no other test runs eagerly first
    sample = {"pixel_values": torch.randn(2, 3, 40, 40)}
    assert (
        model_fixed_image_sides(model, sample, {"pixel_values": {0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}})
        == []
    )
    doubled = torch.randn(2, 3, 80, 80)
    with torch.no_grad():
        out = model(pixel_values=doubled).last_hidden_state
    assert not isinstance(out, FakeTensor)
    assert out.shape == (2, 1 + model.config.num_register_tokens + 100, model.config.hidden_size)
    assert torch.isfinite(out).all()


class CachedConv(ConvOnly):
    """Writes the image features into the cache it is given, as a prefill does."""

    def forward(self, pixel_values, cache):
        features = self.conv(pixel_values).flatten(2)[:, None]  # [batch, 1 head, 4, h * w]
        keys, _ = cache.update(features, features, 0)
        return keys.mean()


def test_the_probe_leaves_the_given_cache_as_it_was():
    # issue 28: GIT's prefill takes pixel_values and an empty cache; the probe's fake run filled
    # the cache in place, so capture traced 2 layers of fake keys/values against the empty cache's
    # dynamic shapes ("Node arity mismatch; expected 4, but got 0")
    from transformers import DynamicCache

    cache = DynamicCache()
    inputs = {**_pixels(), "cache": cache}
    assert model_fixed_image_sides(CachedConv(), inputs, AUTO) == []  # convolutions take any side
    assert not any(getattr(layer, "is_initialized", False) for layer in cache.layers)
    assert CachedConv()(**inputs).shape == ()  # the probe ran the forward on the sample


class WindowBranch(ConvOnly):
    """Takes a branch on the feature map's area, as Swin's stages do on ``min(height, width) <=
    window_size``: eager runs at any size, the program's guard ``h * w <= 256`` is no range."""

    def forward(self, pixel_values):
        features = self.conv(pixel_values)
        height, width = features.shape[-2:]
        if height * width <= 256:
            return features.flatten(2).mean(2) * 2.0
        return features.flatten(2).amax(2)


def test_sides_the_guards_pin_are_traced_again_static():
    # issue 28: Swin's window minimums left the sides symbolic but pinned to the sample by guards;
    # ExecuTorch's re-trace spent tens of minutes simplifying their size expressions (pytorch#141675)
    from hfexport.program_axes import sides_fixed_by_guards

    model, inputs = WindowBranch().eval(), _pixels()
    assert model_fixed_image_sides(model, inputs, AUTO) == []  # eager runs doubled: the probe fixes nothing
    first = torch.export.export(model, (), inputs, dynamic_shapes=AUTO)
    pinned = sides_fixed_by_guards(first, inputs, AUTO)
    assert pinned == [
        {"input": "pixel_values", "axis": 2, "sample": 16},
        {"input": "pixel_values", "axis": 3, "sample": 16},
    ]
    assert sides_fixed_by_guards(first, inputs, {"pixel_values": {0: Dim.AUTO, 2: Dim.DYNAMIC}}) == []
    report = ExportReport(export_format="test")
    program = capture(model, inputs, DynamoConfig(dynamic=True), report)
    assert report.extra["guard_fixed_sides"] == pinned
    assert "pixel_values image height/width: static 16 (model-fixed)" in report.dynamic_axes_summary
    assert "pixel_values batch: dynamic [2, inf]" in report.dynamic_axes_summary
    (value,) = [
        n.meta["val"] for n in program.graph.nodes if n.op == "placeholder" and n.name == "pixel_values"
    ]
    assert tuple(value.shape[2:]) == (16, 16)  # plain ints: nothing symbolic left for a backend
    second = {"pixel_values": torch.randn(3, 3, 16, 16)}
    with torch.no_grad():
        assert (program.module()(**second) - model(**second)).abs().max().item() < 1e-6
    conv_report = ExportReport(export_format="test")
    capture(ConvOnly().eval(), inputs, DynamoConfig(dynamic=True), conv_report)
    assert "guard_fixed_sides" not in conv_report.extra
