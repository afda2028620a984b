"""Complex-valued computation rewritten as real pairs (torch.polar rotary embeddings)."""

from __future__ import annotations

import torch

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.testing.programs import ComplexRotary
from hfexport.workarounds.complex_pairs import complex_as_real_pairs


def _complex_nodes(program: torch.export.ExportedProgram) -> int:
    def is_complex(node: torch.fx.Node) -> bool:
        value = node.meta.get("val")
        return isinstance(value, torch.Tensor) and value.is_complex()

    return sum(is_complex(n) for n in program.graph.nodes)


def test_complex_rotary_becomes_real_pairs_and_matches_eager_at_two_shapes():
    model = ComplexRotary().eval()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    program = capture(model, {"input_ids": ids}, DynamoConfig(dynamic=True))
    assert _complex_nodes(program) >= 5
    rewritten = complex_as_real_pairs(program)
    assert rewritten >= 7  # polar, slice, unsqueeze, mul (scalar), view_as_complex, mul, view_as_real
    assert _complex_nodes(program) == 0
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not targets & {"aten.polar.default", "aten.view_as_complex.default", "aten.view_as_real.default"}
    for batch, length in ((2, 8), (3, 29)):
        ids = torch.randint(0, 32, (batch, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            diff = (program.module()(input_ids=ids) - model(input_ids=ids)).abs().max().item()
        assert diff < 1e-6, (batch, length, diff)


class ComplexExp(torch.nn.Module):
    """A complex operation outside the rewrite's set (exp of a complex value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.exp(torch.view_as_complex(x)))


def test_a_complex_operation_outside_the_set_leaves_the_program_unchanged():
    program = capture(ComplexExp(), {"x": torch.randn(3, 2)}, DynamoConfig())
    before = [str(n.target) for n in program.graph.nodes]
    assert complex_as_real_pairs(program) == 0
    assert [str(n.target) for n in program.graph.nodes] == before


def test_a_real_program_is_left_alone():
    program = capture(torch.nn.Linear(4, 4), {"input": torch.randn(2, 4)}, DynamoConfig())
    assert complex_as_real_pairs(program) == 0
