"""Quality gates (hfexport.quality) and capture in a reduced dtype (hfexport.precision)."""

from __future__ import annotations

import math

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.errors import ExportValidationError
from hfexport.precision import model_in_dtype
from hfexport.quality import (
    default_quality_gates,
    describe_gates,
    is_four_bit,
    quality_gates_for,
    score_outputs,
    validate_quality,
)


def test_default_gates_per_dtype_and_method():
    assert default_quality_gates("float16") == {"cosine": 0.99, "top1_agreement": 0.98}
    assert default_quality_gates("float32", "int8-dynamic") == {"cosine": 0.99, "top1_agreement": 0.9}
    assert default_quality_gates("float32", "int4-weight") == {
        "cosine": 0.98,
        "top1_agreement": 0.9,
        "cache_cosine": 0.5,
    }
    assert [is_four_bit(m) for m in ("8da4w", "4w", "8w", "int8-static", "int4-weight")] == [
        True,
        True,
        False,
        False,
        True,
    ]


def test_gates_only_for_reduced_precision_and_overrides():
    assert quality_gates_for(DynamoConfig()) is None
    assert quality_gates_for(DynamoConfig(dtype="bfloat16")) == {"cosine": 0.99, "top1_agreement": 0.98}
    gates = quality_gates_for(DynamoConfig(quantization="int8-dynamic", quality_gates={"cosine": 0.95}))
    assert gates == {"cosine": 0.95, "top1_agreement": 0.9}
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['cosin'\]; allowed: cosine, cosine_min"):
        quality_gates_for(DynamoConfig(dtype="float16", quality_gates={"cosin": 0.9}))
    with pytest.raises(ValueError, match=r"a float in \[0, 1\]"):
        quality_gates_for(DynamoConfig(dtype="float16", quality_gates={"cosine": 1.5}))


def test_cosine_per_token_ignores_padding_and_top1_on_logits():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 4, 8, generator=gen)
    noisy = hidden.clone()
    noisy[1, 3] = -noisy[1, 3]  # a padded position, flipped: must not count
    noisy[0, 0] = -noisy[0, 0]  # a real token, flipped: cosine -1 for that token
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]] * 2)
    got_logits = logits.clone()
    got_logits[0, 1] = torch.tensor([0.0, 1.0])  # one of 7 real positions changes its arg-max
    rows = score_outputs(
        {"last_hidden_state": hidden, "logits": logits},
        {"last_hidden_state": noisy, "logits": got_logits},
        gates={"cosine": 0.99, "top1_agreement": 0.9},
        attention_mask=mask,
    )
    hidden_row, logits_row = rows
    assert hidden_row.compared == 7
    assert hidden_row.cosine == pytest.approx(5 / 7)  # 6 tokens at 1.0, one at -1.0
    assert hidden_row.cosine_min == pytest.approx(-1.0)
    assert hidden_row.top1_agreement is None
    assert not hidden_row.ok and hidden_row.failures == ["cosine = 0.7143 (gate >= 0.99)"]
    assert logits_row.top1_agreement == pytest.approx(6 / 7)
    # orthogonal one-hot rows: 6 tokens at cosine 1, one at 0; top-1 over 7 positions is recorded but
    # not gated (one flip alone would miss 0.9: top1_gate_applies)
    assert logits_row.failures == ["cosine = 0.8571 (gate >= 0.99)"]
    assert "top1_agreement" not in logits_row.gates
    # over 20 positions, the same single flip (0.95) passes and three flips (0.85) miss
    wide = torch.tensor([[[0.0, 1.0]] * 20])
    for flips, failures in ((1, []), (3, ["top1_agreement = 0.8500 (gate >= 0.9)"])):
        got = wide.clone()
        got[0, :flips] = torch.tensor([1.0, 0.0])
        (row,) = score_outputs({"logits": wide}, {"logits": got}, gates={"top1_agreement": 0.9})
        assert row.failures == failures and row.gates == {"top1_agreement": 0.9}


def test_top1_gate_applies_only_over_enough_positions():
    from hfexport.quality import top1_gate_applies

    assert not top1_gate_applies(0.9, 1) and not top1_gate_applies(0.9, 9) and top1_gate_applies(0.9, 10)
    assert not top1_gate_applies(0.98, 49) and top1_gate_applies(0.98, 50)
    assert top1_gate_applies(0.0, 1) and top1_gate_applies(1.0, 1)  # cannot miss / exactness asked for


def test_missing_output_and_shape_mismatch_fail():
    rows = score_outputs(
        {"a": torch.ones(2, 3), "b": torch.ones(2, 3)}, {"b": torch.ones(3, 3)}, gates={"cosine": 0.9}
    )
    assert [r.ok for r in rows] == [False, False]
    assert rows[0].failures == ["missing from the artifact's outputs"]
    assert rows[1].failures == ["shape (3, 3) != eager"]


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8, bias=False)
        self.out.weight = self.lin.weight  # tied
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.out(self.lin(x) * self.scale)}


def test_model_in_dtype_restores_original_tensors_also_on_failure():
    model = _Tiny()
    weight, bias, scale = model.lin.weight, model.lin.bias, model.scale
    values = weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"), model_in_dtype(model, "float16"):
        assert model.lin.weight.dtype == torch.float16 and model.scale.dtype == torch.float16
        assert model.out.weight is model.lin.weight  # tying kept
        raise RuntimeError("boom")
    assert model.lin.weight is weight and model.lin.bias is bias and model.scale is scale
    assert model.out.weight is weight and weight.dtype == torch.float32
    assert torch.equal(weight.detach(), values)


def test_validate_quality_names_metric_value_and_override():
    model = _Tiny().eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def half_run(kwargs):
        assert kwargs["x"].dtype == torch.float16  # the artifact gets inputs in its dtype
        with model_in_dtype(model, "float16"):
            return {"y": model(**kwargs)["y"]}

    rows = validate_quality(model, half_run, {"x": x}, gates={"cosine": 0.99}, dtype="float16")
    assert rows[0].ok and rows[0].cosine > 0.9999 and 0 < rows[0].max_abs_diff < 1e-2

    def bad_run(kwargs):
        return {"y": -model(x=kwargs["x"])["y"]}

    with pytest.raises(ExportValidationError) as info:
        validate_quality(model, bad_run, {"x": x}, gates={"cosine": 0.99}, label="second shape")
    text = str(info.value)
    assert "on the second shape inputs: y: cosine = -1.0000 (gate >= 0.99)" in text
    # the suggested gate is one this artifact passes (its measured value, rounded down), so following
    # the hint ends the retry loop
    assert "config.quality_gates={'cosine': -1.0}" in text and "--gate cosine=-1.0" in text
    assert info.value.table[0].cosine == pytest.approx(-1.0)
    # the table title states what is gated: the mean cosine, with the min recorded only
    assert "(gated: mean per-vector cosine >= 0.99 (cosine); min cosine recorded, not gated)" in text
    assert "cos mean" in text and "cos min" in text

    # only the missed metric is suggested for lowering (here the cosine floor, not the mean)
    with pytest.raises(ExportValidationError) as info:
        validate_quality(model, half_run, {"x": x}, gates={"cosine": 0.5, "cosine_min": 1.0}, dtype="float16")
    text = str(info.value)
    assert "config.quality_gates={'cosine_min': 0.99}" in text and "--gate cosine_min=0.99" in text
    assert "--gate cosine=" not in text


def test_describe_gates_names_statistic_direction_and_threshold():
    assert describe_gates({"cosine": 0.99, "top1_agreement": 0.9}) == (
        "gated: mean per-vector cosine >= 0.99 (cosine); top-1 agreement (fraction of positions) >= 0.9 "
        "(top1_agreement); min cosine recorded, not gated"
    )
    assert describe_gates({"cosine": 0.98, "cosine_min": 0.9, "max_abs_diff": 0.5}) == (
        "gated: mean per-vector cosine >= 0.98 (cosine); min per-vector cosine >= 0.9 (cosine_min); "
        "max |artifact - eager| <= 0.5 (max_abs_diff)"
    )
    assert describe_gates({}) == "no quality gates"


def test_scores_are_the_same_in_chunks_as_in_one_pass(monkeypatch):
    """Outputs are scored in float64 chunks of rows: the cosines, top-1 and max diff of 8 chunks
    equal those of one pass, padding and NaN rules included."""
    import hfexport.verify.gates as q

    torch.manual_seed(0)
    expected = torch.randn(3, 7, 50)
    actual = expected + 0.3 * torch.randn(3, 7, 50)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :2] = 0
    gates = {"cosine": 0.5, "top1_agreement": 0.5}
    whole = q.score_outputs({"logits": expected}, {"logits": actual}, gates=gates, attention_mask=mask)[0]
    monkeypatch.setattr(q, "_CHUNK", 150)  # 3 rows of 50 per chunk: 7 chunks for 19 kept rows
    chunked = q.score_outputs({"logits": expected}, {"logits": actual}, gates=gates, attention_mask=mask)[0]
    assert (
        chunked.cosine == pytest.approx(whole.cosine, abs=1e-12) and chunked.compared == whole.compared == 19
    )
    assert chunked.cosine_min == pytest.approx(whole.cosine_min, abs=1e-12)
    assert chunked.top1_agreement == whole.top1_agreement and chunked.max_abs_diff == whole.max_abs_diff
    broken = actual.clone()
    broken[2, 6, 3] = float("nan")  # NaN in the artifact only: no similarity, infinite difference
    row = q.score_outputs({"logits": expected}, {"logits": broken}, gates=gates)[0]
    assert row.cosine == 0.0 and row.max_abs_diff == math.inf and not row.ok


def test_gate_failure_names_an_unnamed_single_output():
    """A module returning one bare tensor has the output name ''; the message says "output", not ": "."""
    model = torch.nn.Linear(8, 8)
    inputs = {"input": torch.randn(4, 8)}
    with pytest.raises(ExportValidationError) as info:
        validate_quality(model, lambda kw: {"": -model(**kw)}, inputs, gates={"cosine": 0.99})
    message = str(info.value)
    assert "on the sample inputs: output: cosine = -1.0000 (gate >= 0.99)" in message
    assert ": :" not in message
