"""Small captured programs that reproduce one model-side construct, shared by the backends' tests."""

from __future__ import annotations

import torch
from torch.export import Dim

__all__ = ["ComplexRotary", "PlaceholderCheck", "placeholder_check_program"]


class PlaceholderCheck(torch.nn.Module):
    """LLaVA's placeholder merge in small: transformers' ``torch_compilable_check`` on a tensor condition.

    ``forward(input_ids [batch, sequence] int64, features [n, 4] float32) -> [batch, sequence, 4]
    float32``: the rows of ``features`` fill the positions where ``input_ids == 7`` (zeros
    elsewhere). Raises ``ValueError`` (eagerly) when the number of ``7`` tokens times 4 differs from
    ``features.numel()``; captured, the check becomes ``aten._is_all_true -> item -> _assert_scalar``.
    """

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        from transformers.utils.import_utils import torch_compilable_check

        mask = input_ids == 7
        torch_compilable_check(mask.sum() * 4 == features.numel(), "placeholders and features do not match")
        return torch.zeros(*input_ids.shape, 4).masked_scatter(mask.unsqueeze(-1), features)


def placeholder_check_program() -> tuple[torch.export.ExportedProgram, torch.Tensor, torch.Tensor]:
    """:class:`PlaceholderCheck` captured (non-strict) with a dynamic sequence ``[2, 64]``.

    Returns:
        ``(program, input_ids [2, 4] int64 with four 7s, features [4, 4] float32, seeded)``.
    """
    ids = torch.tensor([[7, 1, 7, 2], [3, 7, 7, 4]])
    features = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    sequence = Dim("sequence", min=2, max=64)
    program = torch.export.export(
        PlaceholderCheck(), (ids, features), dynamic_shapes=({1: sequence}, None), strict=False
    )
    return program, ids, features


class ComplexRotary(torch.nn.Module):
    """deepseek_v2 / llama4's complex rotary embedding in small.

    ``forward(input_ids [batch, sequence] int64 in [0, 32)) -> [batch, sequence, 16] float32``:
    embedded and projected features read as 8 complex pairs (``view_as_complex``), multiplied by
    half a unit rotation per position (``torch.polar``, sliced and unsqueezed) and turned back
    (``view_as_real``). Captured, every complex operation stays in the program.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 16)
        inv_freq = 1.0 / (100 ** (torch.arange(0, 8, dtype=torch.float32) / 8))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(input_ids))  # (batch, length, 16)
        positions = torch.arange(input_ids.shape[1] + 4, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]  # (length + 4, 8)
        rotation = torch.polar(torch.ones_like(angles), angles)[: input_ids.shape[1]].unsqueeze(0) * 0.5
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation).flatten(2)
