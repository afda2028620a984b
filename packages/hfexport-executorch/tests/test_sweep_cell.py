"""The whole-library sweep's verdict on an ExecuTorch export whose program came out static."""

from __future__ import annotations

import torch


class _StaticBatch(torch.nn.Module):
    """Specialises every axis asked dynamic: a (2, 8, 4) table is added to the embeddings."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)
        self.table = torch.nn.Parameter(torch.randn(2, 8, 4))

    def forward(self, input_ids, attention_mask):
        return self.emb(input_ids) * attention_mask[..., None] + self.table


def test_a_pass_whose_program_came_out_static_is_a_failure_of_the_second_shape(monkeypatch):
    # ExecuTorch fits the second shape into the program's bounds: a static program validates at the
    # sample's shape twice, which the sweep must not count as a dynamic pass
    import hfexport.testing as testing
    from hfexport.testing import sweep_child

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(
        testing,
        "tiny_model",
        lambda *a, **k: (_StaticBatch().eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
    )
    cell = sweep_child.export_cell("executorch", "static-toy", "feature-extraction")
    assert cell["status"] == "fail" and cell["stage"] == "validate_second_shape"
    assert (
        cell["reason"]
        == "the program came out static: every axis asked dynamic was specialised, nothing varied"
    )
