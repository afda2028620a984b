"""A tensor returned twice (issue 28: Inkling's vision model returns one tensor as
``last_hidden_state`` and ``pooler_output``) converts: OpenVINO's FX frontend failed with "Check
'is_number(name)' failed ... Tensor name is not a number: view:0" before
:func:`hfexport_openvino.workarounds.fx_fixes.repeated_outputs_as_copies`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("openvino")

from hfexport.config import OpenvinoConfig
from hfexport_openvino.workarounds.fx_fixes import repeated_outputs_as_copies


class _PooledTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(input_ids).reshape(input_ids.shape[0], 1, -1)
        return {
            "last_hidden_state": hidden,
            "pooler_output": hidden,
            "mask": input_ids > 3,
            "again": input_ids > 3,
        }


def test_a_tensor_returned_twice_converts_and_matches_eager_at_two_shapes():
    from hfexport_openvino import OpenvinoExporter

    exporter = OpenvinoExporter()
    inputs = {"input_ids": torch.tensor([[1, 5, 7], [2, 9, 3]])}
    exporter.export(_PooledTwice().eval(), inputs, OpenvinoConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_openvino.workarounds.fx_fixes.repeated_outputs_as_copies"
        in report.applied["fx_program_fixes"]
    )
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert {row["name"] for row in rows} == {"last_hidden_state", "pooler_output", "mask", "again"}
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows


def test_repeated_outputs_get_their_own_nodes_of_the_same_values():
    model = _PooledTwice().eval()
    program = torch.export.export(model, (torch.tensor([[1, 5, 7], [2, 9, 3]]),))
    repeated_outputs_as_copies(program)
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    assert len(set(outputs)) == len(outputs) == 4
    assert [s.arg.name for s in program.graph_signature.output_specs] == [n.name for n in outputs]
    x = torch.tensor([[4, 2, 10], [0, 6, 3]])
    got, expected = program.module()(x), model(x)
    for key in ("last_hidden_state", "pooler_output", "mask", "again"):
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key
