"""Core validation: per-output comparison, padded positions, second-shape derivation, the error table."""

from __future__ import annotations

import math

import pytest
import torch

from hfexport.errors import ExportValidationError
from hfexport.validation import compare_outputs, default_tolerances, derive_second_inputs, validate_artifact


def test_default_tolerances():
    assert default_tolerances(torch.float32) == (1e-4, 1e-3)
    assert default_tolerances(torch.float16) == (1e-2, 1e-2)
    assert default_tolerances(torch.bfloat16) == (1e-2, 1e-2)


def test_compare_reports_max_abs_and_rel_diff():
    exp = {"logits": torch.tensor([[1.0, 2.0], [4.0, -8.0]])}
    got = {"logits": torch.tensor([[1.0, 2.5], [4.0, -8.0]])}
    (row,) = compare_outputs(exp, got)
    assert row.max_abs_diff == pytest.approx(0.5)
    assert row.max_rel_diff == pytest.approx(0.25)
    assert row.ok is False and row.shape == (2, 2) and row.compared == 4
    (row,) = compare_outputs(exp, got, atol=0.6)
    assert row.ok is True


def test_shape_mismatch_and_missing_output_fail():
    exp = {"a": torch.zeros(2, 3), "b": torch.zeros(1)}
    rows = compare_outputs(exp, {"a": torch.zeros(3, 2)})
    assert [r.ok for r in rows] == [False, False]
    assert math.isinf(rows[0].max_abs_diff) and rows[0].expected_shape == (2, 3)
    assert rows[1].shape == ()


def test_padded_positions_are_not_compared():
    exp = torch.zeros(2, 4, 3)
    got = exp.clone()
    got[0, 0] = 100.0  # a padded position
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    (row,) = compare_outputs({"logits": exp}, {"logits": got}, attention_mask=mask)
    assert row.ok and row.max_abs_diff == 0.0 and row.compared == 7 * 3
    (row,) = compare_outputs({"logits": exp}, {"logits": got})
    assert not row.ok and row.max_abs_diff == 100.0


def test_nan_must_match():
    (row,) = compare_outputs({"x": torch.tensor([float("nan"), 1.0])}, {"x": torch.tensor([0.0, 1.0])})
    assert row.ok is False


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"max_position_embeddings": 512})()
        self.emb = torch.nn.Embedding(50, 4)

    def forward(self, input_ids, attention_mask):
        return {"last_hidden_state": self.emb(input_ids) * attention_mask[..., None]}


def test_validate_artifact_raises_with_table():
    model = _Toy().eval()
    inputs = {"input_ids": torch.randint(0, 50, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long)}

    def broken(kw):
        return {"last_hidden_state": model(**kw)["last_hidden_state"] + 1e-2}

    with pytest.raises(ExportValidationError) as info:
        validate_artifact(model, broken, inputs)
    assert "last_hidden_state" in str(info.value) and "NO" in str(info.value)
    assert info.value.table[0].max_abs_diff == pytest.approx(1e-2, rel=1e-3)
    rows = validate_artifact(
        model, lambda kw: {"last_hidden_state": model(**kw)["last_hidden_state"]}, inputs
    )
    assert rows[0].ok and rows[0].max_abs_diff == 0.0


def test_second_inputs_grow_batch_and_sequence():
    model = _Toy()
    inputs = {"input_ids": torch.randint(3, 50, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    second, reason = derive_second_inputs(model, inputs)
    assert reason == ""
    assert second["input_ids"].shape == (3, 65) and second["attention_mask"].shape == (3, 65)
    assert int(second["input_ids"].min()) >= 3 and int(second["input_ids"].max()) < 50
    model.config.max_position_embeddings = 40
    second, _ = derive_second_inputs(model, inputs)
    assert second["input_ids"].shape == (3, 40)


def test_second_inputs_refuse_unknown_tensor():
    second, reason = derive_second_inputs(_Toy(), {"mystery": torch.zeros(2, 3)})
    assert second is None and "mystery" in reason
