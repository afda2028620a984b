"""A ceil_mode pooling window over the whole feature map (EfficientNet / ALIGN's pooler) exports
with dynamic image sides on every backend and matches eager at the sample and the second shape
(the core's capture patch ``avg_pool_over_the_whole_map_as_mean``; before it, ONNX Runtime divided
the window by the kernel area and OpenVINO refused a kernel larger than the map)."""

from __future__ import annotations

import pytest
import torch

from hfexport.auto import AutoHfExporter
from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig, OpenvinoConfig

CONFIGS = {
    "dynamo": DynamoConfig,
    "onnx": OnnxConfig,
    "executorch": ExecutorchConfig,
    "openvino": OpenvinoConfig,
}


class WholeMapPooler(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.pool = (torch.nn.AvgPool2d if kind == "avg" else torch.nn.MaxPool2d)(64, ceil_mode=True)

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pooled": self.pool(self.conv(pixel_values)).flatten(1)}


@pytest.mark.parametrize(
    ("backend", "kind"),
    # max pooling: only OpenVINO refused it (ONNX's MaxPool and ExecuTorch matched already)
    [*((b, "avg") for b in CONFIGS), ("openvino", "max")],
)
def test_whole_map_pooling_matches_eager_at_two_image_sizes(backend, kind):
    if backend in ("executorch", "openvino"):
        pytest.importorskip(backend, reason=f"the {backend} runtime is not installed")
    torch.manual_seed(0)
    model = WholeMapPooler(kind).eval()
    exporter = AutoHfExporter.from_config(CONFIGS[backend](dynamic=True))
    exporter.export(model, {"pixel_values": torch.randn(2, 3, 10, 14)})
    validation = exporter.last_report.validation
    assert validation["sample"][0]["ok"] and validation["second_shape"][0]["ok"], validation
    second = validation["second_shape"][0]
    assert second["max_abs_diff"] <= 1e-5, second
