"""Image axes of a dynamic ExecuTorch export stay dynamic beyond the sample size (issue 15)."""

from __future__ import annotations

import torch

from hfexport.config import ExecutorchConfig
from hfexport.testing import tiny_model
from hfexport_executorch import ExecutorchExporter, bounds


def test_spatial_axes_are_bounded_at_four_times_the_sample_or_the_config_image_size():
    pixels = torch.randn(2, 3, 32, 32)
    plan = bounds.plan_dynamic_shapes(
        torch.nn.Identity(), {"pixel_values": pixels}, ExecutorchConfig(dynamic=True)
    )
    sides = {p.axis: (p.role, p.max) for p in plan.axes if p.axis in (2, 3)}
    assert sides == {2: ("spatial", 128), 3: ("spatial", 128)}
    # height and width get their own symbols (non-square images), not one shared named Dim
    spec = plan.dynamic_shapes["pixel_values"]
    assert type(spec[2]).__name__ == "_DimHint" and type(spec[3]).__name__ == "_DimHint"

    class WithImageSize(torch.nn.Identity):
        config = type("Config", (), {"image_size": 224})()

    plan = bounds.plan_dynamic_shapes(
        WithImageSize(), {"pixel_values": pixels}, ExecutorchConfig(dynamic=True)
    )
    assert {p.axis: p.max for p in plan.axes if p.axis in (2, 3)} == {2: 224, 3: 224}


def test_siglip_sides_planned_dynamic_are_captured_static_as_model_fixed():
    # issue 15: the planned hints bound SigLIP's sides at 128 and the capture kept them dynamic,
    # although its 16-row position table fixes the 32x32 image; the second shape then fed 64x64
    from hfexport.capture import capture
    from hfexport.report import ExportReport

    model, inputs = tiny_model("siglip")
    config = ExecutorchConfig(dynamic=True)
    plan = bounds.plan_dynamic_shapes(model, inputs, config)
    assert {p.axis: (p.role, p.max) for p in plan.axes if p.role == "spatial"} == {
        2: ("spatial", 128),
        3: ("spatial", 128),
    }
    report = ExportReport(export_format="executorch")
    program = capture(model, inputs, config.replace(dynamic_shapes=plan.dynamic_shapes), report)
    assert "pixel_values image height/width: static 32 (model-fixed)" in report.dynamic_axes_summary
    symbols = bounds.collect_symbols(program, inputs, plan)
    assert {(path, axis) for info in symbols for path, axis in info.axes} == {("pixel_values", 0)}


def test_convnext_traced_at_32_runs_a_64_pixel_image():
    # issue 15: the .pte refused a 3x3x64x64 image (set_inputs error 0x10): sides bounded at the sample;
    # then to_edge's re-trace took the 1x1 last-stage map as constant (planned for 1x1, error 0x12)
    model, inputs = tiny_model("convnext", "image-classification")
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 32, 32)
    exporter = ExecutorchExporter()
    program = exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    second = report.validation["second_shape"]
    assert second and all(row["ok"] for row in second)
    sides = {a["axis"]: a["max"] for a in report.dynamic_bounds["axes"] if a["role"] == "spatial"}
    assert sides == {2: 128, 3: 128}

    assert "pixel_values image height/width: dynamic [32, 128]" in report.dynamic_axes_summary

    atol, _ = exporter.default_tolerances(model)
    run = exporter.runner(program)
    for shape in ((3, 3, 64, 64), (1, 3, 96, 80)):
        image = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
        got = run({"pixel_values": image})
        with torch.no_grad():
            expected = model(pixel_values=image).logits
        assert tuple(got["logits"].shape) == (shape[0], model.config.num_labels)
        assert (got["logits"] - expected).abs().max().item() < (atol or 1e-4)


class _FlattenedMap(torch.nn.Module):
    """Florence-2's projector in small: a position term over a ``[batch, channels, 1, 1]`` map,
    flattened to ``[batch, 1, channels]`` tokens, plus a temporal term."""

    def __init__(self) -> None:
        super().__init__()
        self.position = torch.nn.Parameter(torch.randn(1, 16, 1, 1))
        self.temporal = torch.nn.Parameter(torch.randn(1, 1, 16))

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        x = image_features + self.position.repeat(image_features.shape[0], 1, 1, 1)
        return x.flatten(2).transpose(1, 2) + self.temporal


def test_a_sample_with_channels_last_strides_on_size_one_axes_is_captured_row_major():
    # a permuted 1x1 feature map (Florence-2's vision tower output) is contiguous for torch, but
    # its strides (16, 1, 16, 16) made ExecuTorch derive a channels-last dim order
    # (pytorch/executorch#22520): the XNNPACK partition after the flatten produced [2, 16, 16] and
    # failed to resize its output planned for 8 * 16 elements (error 0x10, issue 28)
    features = torch.randn(2, 1, 1, 16).permute(0, 3, 1, 2)
    assert features.is_contiguous() and features.stride() == (16, 1, 16, 16)
    model = _FlattenedMap().eval()
    exporter = ExecutorchExporter()
    artifact = exporter.export(model, {"image_features": features}, ExecutorchConfig(dynamic=True))
    run = exporter.runner(artifact)
    for batch in (2, 5):
        sample = torch.randn(batch, 1, 1, 16).permute(0, 3, 1, 2)
        (got,) = run({"image_features": sample}).values()
        assert tuple(got.shape) == (batch, 1, 16)
        torch.testing.assert_close(got, model(sample), atol=1e-5, rtol=1e-5)
