"""A constant (non-tensor) input that is not an output flag (a Mixture-of-Experts language model's
``output_router_logits=False``, issue 28: Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V) becomes an unread
parameter of dynamic type in ``openvino.convert_model``; the named model takes the program's tensor
inputs only (before: "the OpenVINO model has 3 inputs ..., the program 2; cannot name them")."""

from __future__ import annotations

import pytest
import torch

ov = pytest.importorskip("openvino")

from hfexport_openvino.naming import name_model_io  # noqa: E402
from hfexport_openvino.runtime import OpenvinoRunner  # noqa: E402


class _RouterFlag(torch.nn.Module):
    def forward(
        self, x: torch.Tensor, output_router_logits: bool = False, y: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        return {"out": x * 2.0 + y}


def test_constant_input_parameter_is_dropped():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    program = torch.export.export(
        _RouterFlag(), (), {"x": x, "output_router_logits": False, "y": y}, strict=False
    )
    model = ov.convert_model(program)
    assert len(model.inputs) == 3  # the constant became a parameter (OpenVINO 2026.4)
    names = name_model_io(model, program)
    assert list(names.inputs) == ["x", "y"]
    assert [p.get_any_name() for p in model.inputs] == ["x", "y"]
    out = OpenvinoRunner(model)({"x": x, "output_router_logits": False, "y": y})
    torch.testing.assert_close(out["out"], x * 2.0 + y)
