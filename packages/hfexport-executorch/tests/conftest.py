"""Shared fixtures of the hfexport-executorch unit tests: tiny toy modules, built seeded."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

# Registers the backend's patches and fixes in the process registry before any test swaps in an
# isolated registry (an import inside one would register them there and lose them).
import hfexport_executorch  # noqa: F401


class ToyProjection(torch.nn.Module):
    """``input_ids`` float ``[batch, seq, 16]`` -> ``{"hidden": relu(linear(input_ids))}`` ``[batch, seq, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()  # the core export reads output flags from a transformers config
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": torch.relu(self.proj(input_ids))}


class ToyDouble(torch.nn.Module):
    """``input_ids`` float ``[batch, seq, 16]`` -> ``(input_ids * 2).sum(-1)``: peak live bytes ``128 * batch * seq``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (input_ids * 2).sum(-1)


def make_toy_inputs(batch: int = 2, seq: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float ``input_ids`` ``[batch, seq, 16]`` from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randn(batch, seq, 16, generator=gen)}


def make_toy_projection() -> ToyProjection:
    """A :class:`ToyProjection` with seeded weights, in eval mode."""
    torch.manual_seed(0)
    return ToyProjection().eval()


@pytest.fixture(scope="session")
def toy_inputs():
    """``toy_inputs(batch=2, seq=6, seed=0)`` -> ``{"input_ids": float [batch, seq, 16]}``."""
    return make_toy_inputs


@pytest.fixture(scope="session")
def toy_projection_factory():
    """A function building a fresh seeded :class:`ToyProjection`."""
    return make_toy_projection


@pytest.fixture
def toy_projection() -> ToyProjection:
    return make_toy_projection()


@pytest.fixture
def toy_double() -> ToyDouble:
    return ToyDouble().eval()
