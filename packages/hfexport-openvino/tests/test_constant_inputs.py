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


class _PrecomputedEncoder(torch.nn.Module):
    """A decoder step that takes the images but reads the precomputed encoder output only
    (T5Gemma-2's prefill), with a constant flag after them."""

    def forward(
        self,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor,
        encoder_hidden: torch.Tensor,
        output_router_logits: bool = False,
    ) -> dict[str, torch.Tensor]:
        return {"out": encoder_hidden * attention_mask[..., None].float()}


def test_unread_tensor_input_left_out_does_not_shift_the_names():
    # OpenVINO 2026.4 leaves the unread pixel_values out of the model and keeps the constant as an
    # unread dynamic-rank parameter: named by position, pixel_values went to the mask and the CPU
    # plugin refused the dynamic-rank parameter (T5Gemma-2's prefill: "Check
    # '!shape.rank().is_dynamic()' failed")
    pixels, mask, hidden = torch.randn(2, 3, 8, 8), torch.ones(2, 5, dtype=torch.int64), torch.randn(2, 5, 4)
    kwargs = {
        "pixel_values": pixels,
        "attention_mask": mask,
        "encoder_hidden": hidden,
        "output_router_logits": False,
    }
    program = torch.export.export(_PrecomputedEncoder(), (), kwargs, strict=False)
    model = ov.convert_model(program)
    names = name_model_io(model, program)
    assert list(names.inputs) == ["attention_mask", "encoder_hidden"]
    assert [p.get_any_name() for p in model.inputs] == ["attention_mask", "encoder_hidden"]
    out = OpenvinoRunner(model)(kwargs)
    torch.testing.assert_close(out["out"], hidden * mask[..., None].float())
