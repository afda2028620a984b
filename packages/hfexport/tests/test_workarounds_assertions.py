"""hfexport.workarounds.assertions: runtime assertions and the computation only they use are erased."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from transformers.utils.import_utils import torch_compilable_check

from hfexport.workarounds.assertions import drop_runtime_assertions


class _PlaceholderMerge(torch.nn.Module):
    """LLaVA's merge in small: the prompt's placeholder count must match the features (a tensor check)."""

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        mask = ids == 7
        torch_compilable_check(mask.sum() * 4 == features.numel(), "placeholders and features do not match")
        embeds = torch.zeros(*ids.shape, 4)
        return embeds.masked_scatter(mask.unsqueeze(-1), features)


def _targets(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def _export_merge() -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor([[7, 1, 7, 2], [3, 7, 7, 4]])
    features = torch.randn(4, 4)
    sequence = Dim("sequence", min=2, max=64)
    program = torch.export.export(
        _PlaceholderMerge(), (ids, features), dynamic_shapes=({1: sequence}, None), strict=False
    )
    return program, (ids, features)


def test_tensor_check_of_torch_compilable_check_is_erased_with_its_condition():
    program, (ids, features) = _export_merge()
    before = _targets(program)
    # transformers 5.24 under tracing: torch._check_tensor_all(cond) -> _is_all_true -> item -> assertions
    assert "aten._is_all_true.default" in before
    assert "aten._assert_scalar.default" in before
    assert any(str(symbol).startswith("u") for symbol in program.range_constraints)

    dropped = drop_runtime_assertions(program)

    after = _targets(program)
    assert dropped.assertions == before.count("aten._assert_scalar.default") >= 1
    for gone in ("aten._is_all_true.default", "aten.item.default", "aten._assert_scalar.default"):
        assert gone not in after, gone
    # the computation of the output stays; only the condition's own nodes went
    assert "aten.masked_scatter.default" in after and "aten.eq.Scalar" in after
    assert dropped.dead_nodes >= 3
    assert dropped.symbols and all(name.startswith("u") for name in dropped.symbols)
    assert len(program.range_constraints) == 1  # the sequence symbol only
    assert not any(str(symbol).startswith("u") for symbol in program.range_constraints)
    # values unchanged, at the sample and at another prompt length
    torch.testing.assert_close(program.module()(ids, features), _PlaceholderMerge()(ids, features))
    longer = torch.tensor([[7, 1, 7, 2, 5, 5], [3, 7, 7, 4, 5, 5]])
    torch.testing.assert_close(program.module()(longer, features), _PlaceholderMerge()(longer, features))
    # a prompt with 3 placeholders for 4 features: eager raises, the program (like an ONNX model or a
    # .pte, which never ran the check) computes
    mismatched = torch.tensor([[7, 1, 7, 2], [3, 7, 1, 4]])
    with pytest.raises(ValueError, match="placeholders and features do not match"):
        _PlaceholderMerge()(mismatched, features)
    assert tuple(program.module()(mismatched, features).shape) == (2, 4, 4)


def test_condition_also_used_by_the_model_stays():
    class UsesCondition(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            positive = x > 0
            torch._check_tensor_all(positive)
            return positive.float() + x

    x = torch.rand(3, 5) + 0.5
    program = torch.export.export(UsesCondition(), (x,), strict=False)
    dropped = drop_runtime_assertions(program)
    after = _targets(program)
    assert dropped.assertions >= 1
    assert "aten.gt.Scalar" in after  # feeds the output as well
    assert not {"aten._is_all_true.default", "aten._assert_scalar.default"} & set(after)
    torch.testing.assert_close(program.module()(x), UsesCondition()(x))


def test_program_without_assertions_is_left_untouched():
    program = torch.export.export(torch.nn.Linear(4, 2), (torch.randn(3, 4),), strict=False)
    code = program.graph_module.code
    dropped = drop_runtime_assertions(program)
    assert (dropped.assertions, dropped.dead_nodes, dropped.symbols) == (0, 0, [])
    assert program.graph_module.code == code
