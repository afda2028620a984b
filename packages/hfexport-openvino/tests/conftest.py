"""Fixtures for the hfexport-openvino tests: a toy module that converts in seconds, and the backend
registered in this process (also before the workspace installs its entry point)."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_outputs import BaseModelOutput

import hfexport_openvino  # noqa: F401  (registers the "openvino" exporter, workarounds and layout)


class TinyEncoder(torch.nn.Module):
    """``inputs_embeds [b, s, 8]`` float32, ``attention_mask [b, s]`` -> ``last_hidden_state [b, s, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.config = PretrainedConfig()

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> BaseModelOutput:
        hidden = torch.sin(self.proj(inputs_embeds)) * attention_mask.unsqueeze(-1).to(inputs_embeds.dtype)
        return BaseModelOutput(last_hidden_state=hidden + 0.5 * inputs_embeds)


@pytest.fixture
def tiny_encoder() -> tuple[TinyEncoder, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "inputs_embeds": torch.randn(2, 5, 8, generator=gen),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }
    return TinyEncoder().eval(), inputs
