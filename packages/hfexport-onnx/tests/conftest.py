"""Fixtures for the hfexport-onnx unit tests: small hand-written modules that export in seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_outputs import BaseModelOutput


class TinyEncoder(torch.nn.Module):
    """``inputs_embeds [b, s, 8]`` (float32), ``attention_mask [b, s]`` -> ``last_hidden_state [b, s, 8]``.

    ``sin(linear(x)) * mask + 0.5 * x``: a Linear (an initializer to tamper with) and an
    ``aten.sin`` node (a node for FX fixes and custom translations to rewrite).
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.config = PretrainedConfig()  # the export flags machinery reads a transformers config

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> BaseModelOutput:
        hidden = torch.sin(self.proj(inputs_embeds)) * attention_mask.unsqueeze(-1).to(inputs_embeds.dtype)
        return BaseModelOutput(last_hidden_state=hidden + 0.5 * inputs_embeds)


def make_tiny_encoder() -> tuple[TinyEncoder, dict[str, torch.Tensor]]:
    """A :class:`TinyEncoder` and a batch of 2 x 5 inputs (one padded row)."""
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "inputs_embeds": torch.randn(2, 5, 8, generator=gen),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }
    return TinyEncoder().eval(), inputs


@pytest.fixture
def tiny_encoder() -> tuple[TinyEncoder, dict[str, torch.Tensor]]:
    """A fresh :func:`make_tiny_encoder` per test."""
    return make_tiny_encoder()


@pytest.fixture(scope="session")
def tiny_encoder_builder():
    """:func:`make_tiny_encoder` itself, for module-scoped fixtures."""
    return make_tiny_encoder
