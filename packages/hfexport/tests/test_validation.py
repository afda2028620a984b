"""Core validation: per-output comparison, padded positions, second-shape derivation, the error table."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hfexport.errors import ExportValidationError
from hfexport.validation import compare_outputs, default_tolerances, derive_second_inputs, validate_artifact
from hfexport.verify.compare import format_table


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


# -- second shape from explicit dynamic_shapes (issue 14 item 6) --------------------------------


def _text_inputs(batch=2, seq=8):
    return {
        "input_ids": torch.randint(3, 50, (batch, seq)),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
    }


def _config(dynamic_shapes):
    from hfexport.config import DynamoConfig

    return DynamoConfig(dynamic_shapes=dynamic_shapes)


def test_declared_batch_only_changes_the_batch_only():
    from torch.export import Dim

    batch = Dim("batch")
    spec = {"input_ids": {0: batch}, "attention_mask": {0: batch}}
    second, reason = derive_second_inputs(_Toy(), _text_inputs(), config=_config(spec))
    assert reason == ""
    assert second["input_ids"].shape == (3, 8) and second["attention_mask"].shape == (3, 8)
    assert int(second["input_ids"].min()) >= 3 and int(second["input_ids"].max()) < 50


def test_declared_sequence_only_keeps_the_batch_and_respects_max():
    from torch.export import Dim

    seq = Dim("seq")
    second, _ = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": {1: seq}, "attention_mask": {1: seq}})
    )
    assert second["input_ids"].shape == (2, 65) and second["attention_mask"].shape == (2, 65)
    seq32 = Dim("seq", max=32)
    second, _ = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": (None, seq32), "attention_mask": (None, seq32)})
    )
    assert second["input_ids"].shape == (2, 32)
    # the model's maximum positions cap a declared sequence too
    model = _Toy()
    model.config.max_position_embeddings = 20
    second, _ = derive_second_inputs(
        model, _text_inputs(), config=_config({"input_ids": {1: seq}, "attention_mask": {1: seq}})
    )
    assert second["input_ids"].shape == (2, 20)


def test_declared_hints_and_min_bounds():
    from torch.export import Dim

    spec = {
        "input_ids": {0: Dim.AUTO(min=2, max=2), 1: Dim.DYNAMIC(max=9)},
        "attention_mask": {0: Dim.AUTO(min=2, max=2), 1: Dim.DYNAMIC(max=9)},
    }
    second, _ = derive_second_inputs(_Toy(), _text_inputs(), config=_config(spec))
    # the batch range [2, 2] holds no other size; the sequence grows to its max 9
    assert second["input_ids"].shape == (2, 9)
    # a batch capped at the sample size goes down instead (never below 2)
    spec = {"input_ids": {0: Dim("b", max=3)}, "attention_mask": {0: Dim("b", max=3)}}
    second, _ = derive_second_inputs(_Toy(), _text_inputs(batch=3), config=_config(spec))
    assert second["input_ids"].shape == (2, 8)


def test_no_declared_dynamic_axis_gives_a_reason():
    from torch.export import Dim

    second, reason = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": None, "attention_mask": (Dim.STATIC, 8)})
    )
    assert second is None and "declares no dynamic axis" in reason
    # the mask's sequence is static while the ids' is declared dynamic: they must stay equal
    second, reason = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": {1: Dim("s")}})
    )
    assert (
        second is None
        and "attention_mask axis 1 is static but must match the dynamic input_ids axis 1" in reason
    )
    fixed = Dim.DYNAMIC(min=8, max=8)
    second, reason = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": {1: fixed}, "attention_mask": {1: fixed}})
    )
    assert second is None and "input_ids axis 1 has no other size in its range [8, 8]" in reason
    # a sequence capped at the sample size goes down instead
    capped = Dim("s", max=8)
    second, _ = derive_second_inputs(
        _Toy(), _text_inputs(), config=_config({"input_ids": {1: capped}, "attention_mask": {1: capped}})
    )
    assert second["input_ids"].shape == (2, 7)


def test_declared_axes_of_unknown_inputs_are_tiled():
    from torch.export import Dim

    inputs = {"x": torch.arange(6.0).reshape(2, 3)}
    second, reason = derive_second_inputs(_Toy(), inputs, config=_config({"x": {0: Dim("rows")}}))
    # an axis without a role doubles (a size that keeps divisibility by the sample's factors)
    assert reason == "" and second["x"].shape == (4, 3)
    # rows repeat the sample (plus 0.1-scaled noise)
    assert torch.allclose(second["x"][2], inputs["x"][0], atol=0.5)


def test_derived_dim_follows_its_root():
    from torch.export import Dim

    seq = Dim("seq", max=20)
    inputs = {"a": torch.zeros(2, 4), "b": torch.zeros(2, 8)}
    second, _ = derive_second_inputs(_Toy(), inputs, config=_config({"a": {1: seq}, "b": {1: 2 * seq}}))
    assert second["a"].shape == (2, 8) and second["b"].shape == (2, 16)


def test_dynamic_second_shape_changes_image_sides_too():
    # issue 15: a dynamic image export must be validated at another image size, not only another batch
    model = torch.nn.Conv2d(3, 4, 3)
    pixels = torch.randn(2, 3, 32, 32)
    mask = torch.ones(2, 32, 32, dtype=torch.long)
    second, reason = derive_second_inputs(model, {"pixel_values": pixels, "pixel_mask": mask})
    assert reason == ""
    assert tuple(second["pixel_values"].shape) == (3, 3, 64, 64)
    assert tuple(second["pixel_mask"].shape) == (3, 64, 64)
    assert second["pixel_mask"].dtype == torch.long and bool((second["pixel_mask"] == 1).all())


def test_fit_static_spatial_axes_narrows_only_image_sides():
    from hfexport.validation import fit_static_spatial_axes

    second = {"pixel_values": torch.randn(3, 3, 64, 64), "input_ids": torch.ones(3, 65, dtype=torch.long)}
    program_axes = [  # a ViT-like program: image sides fixed, tokens specialised to 8
        {"input": "pixel_values", "axis": 2, "status": "static", "min": 32, "max": 32},
        {"input": "pixel_values", "axis": 3, "status": "static", "min": 32, "max": 32},
        {"input": "input_ids", "axis": 1, "status": "static", "min": 8, "max": 8},
    ]
    fitted = fit_static_spatial_axes(second, program_axes)
    assert tuple(fitted["pixel_values"].shape) == (3, 3, 32, 32)
    assert torch.equal(fitted["pixel_values"], second["pixel_values"][:, :, :32, :32])
    assert fitted["input_ids"] is second["input_ids"]  # a specialised token axis is still reported


def test_second_shape_follows_the_program_image_axes():
    # issue 15: sides the program fixes stay, bounded sides take the nearest size inside the range
    model = torch.nn.Conv2d(3, 4, 3)
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
    fixed = [
        {"input": "pixel_values", "axis": 2, "status": "static", "min": 32, "max": 32},
        {"input": "pixel_values", "axis": 3, "status": "dynamic", "min": 32, "max": 63},
    ]
    second, reason = derive_second_inputs(model, inputs, program_axes=fixed)
    assert reason == ""
    assert tuple(second["pixel_values"].shape) == (3, 3, 32, 63)  # height kept, width at its bound
    free = [{"input": "pixel_values", "axis": a, "status": "dynamic", "min": 32, "max": None} for a in (2, 3)]
    second, _ = derive_second_inputs(model, inputs, program_axes=free)
    assert tuple(second["pixel_values"].shape) == (3, 3, 64, 64)
    bounded = [
        {"input": "pixel_values", "axis": a, "status": "dynamic", "min": 32, "max": 48} for a in (2, 3)
    ]
    second, _ = derive_second_inputs(model, inputs, program_axes=bounded)
    assert tuple(second["pixel_values"].shape) == (3, 3, 48, 48)


def test_second_shape_keeps_image_tokens_of_an_image_text_prompt():
    # issue 15: LLaVA checks that the prompt holds one <image> token per vision feature
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("llava")
    token = model.config.image_token_id
    per_row = (inputs["input_ids"] == token).sum(-1)
    assert per_row.tolist() == [16, 16]
    second, reason = derive_second_inputs(model, inputs)
    assert reason == ""
    assert tuple(second["pixel_values"].shape) == (3, 3, 32, 32)  # image size kept: 16 features each
    assert tuple(second["input_ids"].shape) == (3, 65)
    assert (second["input_ids"] == token).sum(-1).tolist() == [16, 16, 16]
    with torch.no_grad():
        logits = model(**second).logits
    assert tuple(logits.shape) == (3, 65, model.config.text_config.vocab_size)


def test_second_shape_keeps_the_batch_when_the_program_fixes_the_image_batch():
    # transformers 5.24 LLaVA returns one feature tensor per image, so a dynamic=True capture holds the
    # image batch static; a third prompt would need a third image, so only the prompt length changes
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("llava")
    token = model.config.image_token_id

    def axis(key, index, sample, status, low):
        high = sample if status == "static" else None
        return {"input": key, "axis": index, "sample": sample, "status": status, "min": low, "max": high}

    # what program_input_axes reports for the capture (pixel_values batch: static 2 (model-fixed))
    axes = [axis("pixel_values", 0, 2, "static", 2), axis("input_ids", 0, 2, "dynamic", 0)]
    axes.append(axis("input_ids", 1, 24, "dynamic", 2))
    second, reason = derive_second_inputs(model, inputs, program_axes=axes)
    assert reason == ""
    assert tuple(second["pixel_values"].shape) == (2, 3, 32, 32)
    assert tuple(second["input_ids"].shape) == tuple(second["attention_mask"].shape) == (2, 65)
    assert (second["input_ids"] == token).sum(-1).tolist() == [16, 16]
    with torch.no_grad():
        assert tuple(model(**second).logits.shape) == (2, 65, model.config.text_config.vocab_size)
    # a static batch of an input without placeholders in the prompt is not kept: the second shape
    # still grows the batch, so a program that specialised it fails its validation
    text_only = {k: v for k, v in inputs.items() if k != "pixel_values"}
    text_only["input_ids"] = torch.where(text_only["input_ids"] == token, 1, text_only["input_ids"])
    second, _ = derive_second_inputs(model, text_only, program_axes=[{**axes[1], "status": "static"}])
    assert tuple(second["input_ids"].shape) == (3, 65)


# -- second shape of a quality-gated export: the sample's own tokens (issue 12) -----------------------
def _padded_prompt():
    # two real prompts over a few distinct tokens; row 1 is right-padded with 0
    ids = torch.tensor([[5, 17, 42, 5, 17, 42, 9], [17, 42, 5, 0, 0, 0, 0]])
    types = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": types}


def _repeat_to(row: torch.Tensor, length: int) -> torch.Tensor:
    return row.repeat(-(-length // row.numel()))[:length]


def test_gated_second_shape_reuses_the_sample_tokens():
    # a quantized real LM scored on random ids, or past the lengths its sample shows, measures the
    # model rather than the export (IgLM-S 8da4w: top-1 0.94 on its 2x122 sample, 0.83 on random ids
    # at 3x244); the derived prompt reuses the sample's real tokens and gets a quarter shorter
    from hfexport.config import DynamoConfig

    inputs = _padded_prompt()
    second, reason = derive_second_inputs(_Toy(), inputs, config=DynamoConfig(quantization="8da4w"))
    assert reason == ""
    ids, mask, types = second["input_ids"], second["attention_mask"], second["token_type_ids"]
    # the shape still changes in batch and sequence: batch + 1, 7 - 7 // 4 tokens
    assert ids.shape == mask.shape == types.shape == (3, 6)
    assert set(ids.unique().tolist()) <= {5, 9, 17, 42}  # only the sample's real tokens, no padding
    assert torch.equal(ids[0], _repeat_to(inputs["input_ids"][0], 6))
    assert torch.equal(ids[1], _repeat_to(torch.tensor([17, 42, 5]), 6))  # the padding dropped
    assert torch.equal(ids[2], ids[0])  # the extra row repeats sample row 0
    assert bool((mask == 1).all()) and mask.dtype == torch.long
    # token types travel with their tokens
    assert torch.equal(types[0], _repeat_to(inputs["token_type_ids"][0], 6))
    assert torch.equal(types[1], _repeat_to(torch.tensor([0, 0, 1]), 6))
    # without gates the ids are drawn: tokens the sample never held appear
    second, _ = derive_second_inputs(_Toy(), inputs, config=DynamoConfig())
    assert second["input_ids"].shape == (3, 65)
    assert not set(second["input_ids"].unique().tolist()) <= {0, 5, 9, 17, 42}


def test_gated_declared_second_shape_reuses_the_sample_tokens_and_positions_count_up():
    from torch.export import Dim

    from hfexport.config import DynamoConfig

    batch, seq = Dim("batch"), Dim("seq", max=40)
    inputs = _padded_prompt()
    inputs["position_ids"] = torch.arange(7).expand(2, 7).clone()
    spec = {key: {0: batch, 1: seq} for key in inputs}
    config = DynamoConfig(dynamic_shapes=spec, dtype="float16")
    second, reason = derive_second_inputs(_Toy(), inputs, config=config)
    assert reason == ""
    assert second["input_ids"].shape == (3, 6)
    assert set(second["input_ids"].unique().tolist()) <= {5, 9, 17, 42}
    assert torch.equal(second["input_ids"][1], _repeat_to(torch.tensor([17, 42, 5]), 6))
    assert torch.equal(second["position_ids"], torch.arange(6).expand(3, 6))
    # a range that holds no shorter size: the nearest other size inside it
    spec = {key: {0: batch, 1: Dim("seq", min=7, max=40)} for key in inputs}
    second, _ = derive_second_inputs(
        _Toy(), inputs, config=DynamoConfig(dynamic_shapes=spec, dtype="float16")
    )
    assert second["input_ids"].shape == (3, 8)
    assert torch.equal(second["input_ids"][0], _repeat_to(inputs["input_ids"][0], 8))
    assert bool((second["attention_mask"] == 1).all())


def test_token_values_override_the_automatic_choice():
    from hfexport.config import DynamoConfig

    inputs = _padded_prompt()
    # inputs_embeds reuse the real positions' vectors too
    embeds = torch.randn(2, 7, 4)
    second, _ = derive_second_inputs(
        _Toy(), {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]}, token_values="sample"
    )
    assert second["inputs_embeds"].shape == (3, 6, 4)
    assert torch.equal(second["inputs_embeds"][1], embeds[1, :3].repeat(2, 1))
    # a 2-token prompt has no shorter size (never below 2 tokens): it grows as with drawn ids
    short = {"input_ids": torch.tensor([[7, 8], [8, 7]])}
    second, _ = derive_second_inputs(_Toy(), short, token_values="sample")
    assert second["input_ids"].shape == (3, 65)
    assert torch.equal(second["input_ids"][2], torch.tensor([7, 8]).repeat(33)[:65])
    gated = DynamoConfig(quantization="8da4w")
    second, _ = derive_second_inputs(_Toy(), inputs, config=gated, token_values="random")
    assert not set(second["input_ids"].unique().tolist()) <= {0, 5, 9, 17, 42}
    with pytest.raises(ValueError, match=r"token_values='real' is invalid; allowed: auto, sample, random"):
        derive_second_inputs(_Toy(), inputs, token_values="real")


class _BoundedSequence(torch.nn.Module):
    """A forward that takes at most 11 tokens (it slices an 11-row table by the sequence length, as
    a position table or a padded chunk layout does): capture bounds the sequence at 11."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.table = torch.nn.Parameter(torch.randn(11, 8))

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids) * attention_mask[..., None]
        return x + self.table[: input_ids.shape[1]]


def test_model_bounded_sequence_is_reported_and_the_second_shape_stays_inside_it(caplog):
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.report import ExportReport

    model = _BoundedSequence().eval()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    report = ExportReport(export_format="dynamo")
    with caplog.at_level("WARNING", logger="hfexport.capture"):
        program = capture(model, inputs, DynamoConfig(dynamic=True), report)
    sequence = [e for e in report.dynamic_axes if e["input"] == "input_ids" and e["meaning"] == "sequence"]
    assert [(e["status"], e["min"], e["max"], e["note"]) for e in sequence] == [
        ("dynamic", 2, 11, "model-bounded")
    ]
    assert "input_ids/attention_mask sequence: the captured program accepts lengths 2..11 only" in caplog.text
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert second["input_ids"].shape == (3, 10)  # inside [2, 11], below the bound, not the sample's 8
    with torch.no_grad():
        diff = (program.module()(**second) - model(**second)).abs().max().item()
    assert diff <= 1e-6


def test_a_sequence_bounded_at_the_models_own_position_limit_is_not_model_bounded(caplog):
    from transformers import BertConfig, BertModel

    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.report import ExportReport

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=40)  # fmt: skip
    model = BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    report = ExportReport(export_format="dynamo")
    with caplog.at_level("WARNING", logger="hfexport.capture"):
        capture(
            model,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            DynamoConfig(dynamic=True),
            report,
        )
    sequence = [e for e in report.dynamic_axes if e["meaning"] == "sequence"]
    assert sequence and all(
        e["max"] == 40 and e["note"] == "" for e in sequence
    )  # the position table's own size
    assert "accepts lengths" not in caplog.text


class _ChunkLoop(torch.nn.Module):
    """Pads the sequence to whole 4-token chunks and loops over them in Python (as chunked
    gated-delta-rule layers do): capture records ``ceil(length / 4) == 2`` as a guard, not a range."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids) * attention_mask[..., None]
        length = x.shape[1]
        padded = torch.nn.functional.pad(x, (0, 0, 0, (4 - length % 4) % 4))
        total = torch.zeros_like(x[:, 0])
        for i in range(padded.shape[1] // 4):
            total = total + padded[:, 4 * i : 4 * i + 4].sum(1)
        return x + total[:, None]


@pytest.mark.parametrize("asked_max", [None, 512], ids=["unbounded", "explicit-bound"])
def test_a_sequence_bound_recorded_only_as_guards_is_found_and_the_second_shape_respects_it(asked_max):
    """Also when the export asks for an explicit sequence bound (ExecuTorch bounds every axis: the
    range then reads [4, 512] and the guard still closes it at 8)."""
    from torch.export import Dim

    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.program_axes import guards_accept
    from hfexport.report import ExportReport

    model = _ChunkLoop().eval()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    report = ExportReport(export_format="dynamo")
    config = DynamoConfig(dynamic=True)
    if asked_max is not None:
        axes = {0: Dim.AUTO(min=1, max=16), 1: Dim.AUTO(min=1, max=asked_max)}
        config = DynamoConfig(dynamic=True, dynamic_shapes={"input_ids": axes, "attention_mask": axes})
    program = capture(model, inputs, config, report)
    assert all(program.range_constraints[s].upper > 8 for s in program.range_constraints)  # no range bound
    assert guards_accept(program, {"input_ids": (2, 8), "attention_mask": (2, 8)}) is True
    assert guards_accept(program, {"input_ids": (2, 9), "attention_mask": (2, 9)}) is False
    sequence = [e for e in report.dynamic_axes if e["meaning"] == "sequence"]
    assert {(e["max"], e["note"]) for e in sequence} == {(8, "model-bounded")}
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert second["input_ids"].shape[0] == 3 and 5 <= second["input_ids"].shape[1] < 8
    with torch.no_grad():
        diff = (program.module()(**second) - model(**second)).abs().max().item()
    assert diff <= 1e-6


class _GridBranch(torch.nn.Module):
    """DINOv2's position table in small: used as is for the 4x4 patch grid it was made for,
    interpolated otherwise; capture on a 32x32 image takes the first branch and records
    ``(height // 8) * (width // 8) == 16`` as a guard, not as a range."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patch = torch.nn.Conv2d(3, 4, 8, stride=8)
        self.position = torch.nn.Parameter(torch.randn(1, 4, 4, 4))

    def forward(self, pixel_values):
        grid = self.patch(pixel_values)
        position = self.position
        if grid.shape[2] * grid.shape[3] != 16:
            position = torch.nn.functional.interpolate(position, size=grid.shape[2:], mode="bilinear")
        return (grid + position).flatten(1)


def test_image_sides_fixed_only_by_guards_are_reported_static_and_the_second_shape_keeps_them():
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.program_axes import guards_accept
    from hfexport.report import ExportReport

    model = _GridBranch().eval()
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    first = torch.export.export(
        model, (), inputs, dynamic_shapes={"pixel_values": dict.fromkeys(range(4), torch.export.Dim.AUTO)}
    )
    assert guards_accept(first, {"pixel_values": (2, 3, 32, 32)}) is True
    assert guards_accept(first, {"pixel_values": (2, 3, 64, 64)}) is False
    report = ExportReport(export_format="dynamo")
    program = capture(model, inputs, DynamoConfig(dynamic=True), report)
    # issue 28: sides pinned by guards are traced again static
    assert [(s["axis"], s["sample"]) for s in report.extra["guard_fixed_sides"]] == [(2, 32), (3, 32)]
    sides = {e["meaning"]: (e["status"], e["max"], e["note"]) for e in report.dynamic_axes}
    assert sides["image height"] == sides["image width"] == ("static", 32, "model-fixed")
    assert sides["batch"][0] == "dynamic"
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert tuple(second["pixel_values"].shape) == (3, 3, 32, 32)
    with torch.no_grad():
        diff = (program.module()(**second) - model(**second)).abs().max().item()
    assert diff <= 1e-6


class _CeilBlocks(torch.nn.Module):
    """MobileViT's unfolding in small: ``math.ceil(height / 8)`` blocks, looped over in Python;
    torch writes the guard with ``math.ceil``."""

    def forward(self, pixel_values):
        out = pixel_values[:, :, :1, :1] * 0
        for i in range(math.ceil(pixel_values.shape[2] / 8)):
            out = out + pixel_values[:, :, 8 * i : 8 * i + 1, :1]
        return out


def test_guards_written_with_math_ceil_are_evaluated():
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.program_axes import guards_accept
    from hfexport.report import ExportReport

    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    program = torch.export.export(
        _CeilBlocks(),
        (),
        inputs,
        dynamic_shapes={"pixel_values": dict.fromkeys(range(4), torch.export.Dim.AUTO)},
    )
    assert any("math.ceil" in guard for guard in program._guards_code)
    assert guards_accept(program, {"pixel_values": (2, 3, 32, 32)}) is True
    assert guards_accept(program, {"pixel_values": (2, 3, 25, 32)}) is True  # still 4 blocks
    assert guards_accept(program, {"pixel_values": (2, 3, 64, 32)}) is False
    report = ExportReport(export_format="dynamo")
    capture(_CeilBlocks(), inputs, DynamoConfig(dynamic=True), report)
    height = next(e for e in report.dynamic_axes if e["meaning"] == "image height")
    assert (height["status"], height["max"], height["note"]) == ("static", 32, "model-fixed")


class _QuarterScalePatches(torch.nn.Module):
    """DepthPro's image pyramid in small: the image scaled by 0.25, then cut into 4x4 patches looped
    over in Python; torch writes the guards on the scaled size with ``torch.sym_float``."""

    def forward(self, pixel_values):
        small = torch.nn.functional.interpolate(pixel_values, scale_factor=0.25, mode="bilinear")
        out = small[:, :, :1, :1] * 0
        for i in range(small.shape[3] // 4):
            out = out + small[:, :, :1, 4 * i : 4 * i + 1]
        return out


def test_guards_written_with_torch_sym_float_are_evaluated():
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.program_axes import guards_accept
    from hfexport.report import ExportReport

    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    program = torch.export.export(
        _QuarterScalePatches(),
        (),
        inputs,
        dynamic_shapes={"pixel_values": dict.fromkeys(range(4), torch.export.Dim.AUTO)},
    )
    assert any("torch.sym_float" in guard for guard in program._guards_code)
    assert guards_accept(program, {"pixel_values": (2, 3, 32, 32)}) is True
    assert guards_accept(program, {"pixel_values": (2, 3, 32, 64)}) is False
    report = ExportReport(export_format="dynamo")
    capture(_QuarterScalePatches(), inputs, DynamoConfig(dynamic=True), report)
    width = next(e for e in report.dynamic_axes if e["meaning"] == "image width")
    assert (width["status"], width["max"], width["note"]) == ("static", 32, "model-fixed")


def test_guards_written_with_torch_sym_float_are_evaluated_and_fix_eomt_dinov3_image_sides():
    """issue 28: EoMT-DINOv3 folds its patch tokens to the config's grid (``reshape(b, -1, *grid)``),
    so only the sample's image size runs; the guard saying so sits next to DINOv3's patch-center
    guards, written with ``torch.sym_float``. Those were not evaluated, the sides stayed "dynamic
    [8, inf]" and the second shape doubled them (eager reference: "expected input[3, 256, 4, 4] to
    have 64 channels")."""
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.report import ExportReport
    from hfexport.testing import tiny_model
    from hfexport.workarounds.dense_prediction import eomt_mask_probabilities_before_capture

    model, inputs = tiny_model("eomt_dinov3", "image-segmentation")
    inputs = eomt_mask_probabilities_before_capture(model, inputs)
    report = ExportReport(export_format="dynamo")
    program = capture(model, inputs, DynamoConfig(dynamic=True), report)
    # the first program's guards (torch.sym_float among them) accepted 32x32 and refused 64x64, so
    # the sides were traced again static (issue 28, program_axes.sides_fixed_by_guards)
    assert [(s["axis"], s["sample"]) for s in report.extra["guard_fixed_sides"]] == [(2, 32), (3, 32)]
    sides = {e["meaning"]: (e["status"], e["max"], e["note"]) for e in report.dynamic_axes}
    assert sides["image height"] == sides["image width"] == ("static", 32, "model-fixed")
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert tuple(second["pixel_values"].shape) == (3, 3, 32, 32)
    with torch.no_grad():
        got, expected = program.module()(**second), model(**second)
    torch.testing.assert_close(
        got["masks_queries_logits"], expected.masks_queries_logits, atol=1e-4, rtol=1e-4
    )


def test_compare_outputs_works_in_chunks_and_keeps_allclose_semantics(monkeypatch):
    """Large outputs are compared in float64 chunks (a real LM's logits are 30M elements): a
    difference in the last chunk, NaNs, infinities and padding behave as torch.allclose does."""
    import hfexport.verify.compare as v

    monkeypatch.setattr(v, "_CHUNK", 1000)  # 3 x 5 x 400 = 6000 elements: six chunks
    expected = torch.randn(3, 5, 400)
    actual = expected.clone()
    actual[2, 4, 399] += 1.0  # the very last element, in the last chunk
    row = v.compare_outputs({"logits": expected}, {"logits": actual})[0]
    assert not row.ok and row.max_abs_diff == pytest.approx(1.0, abs=1e-6) and row.compared == 6000
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[2, 4] = 0  # that position is padding: not compared
    row = v.compare_outputs({"logits": expected}, {"logits": actual}, attention_mask=mask)[0]
    assert row.ok and row.max_abs_diff == 0.0 and row.compared == 6000 - 400
    inf = expected.clone()
    inf[0, 0, 0] = float("inf")
    row = v.compare_outputs({"logits": inf}, {"logits": inf.clone()})[0]
    assert row.ok and row.max_abs_diff == 0.0  # equal infinities agree, as in allclose
    nan = expected.clone()
    nan[1, 1, 1] = float("nan")
    assert v.compare_outputs({"logits": nan}, {"logits": nan.clone()})[0].ok  # NaNs at the same place
    assert not v.compare_outputs({"logits": nan}, {"logits": expected})[0].ok  # NaN only on one side
    # the expected tensor is never modified by the in-place arithmetic on its float64 copy
    doubles = torch.randn(4, 300, dtype=torch.float64)
    kept = doubles.clone()
    v.compare_outputs({"x": doubles}, {"x": doubles + 1})
    assert torch.equal(doubles, kept)


class _UnscaledDotProduct(torch.nn.Module):
    """Grounding DINO's contrastive logits: layer-normed 64-wide features of two towers multiplied
    without a 1/sqrt(d) scale (values in the tens), float32 rounding alone above atol 1e-4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
        self.text = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))

    def forward(self, pixel_values, text_embeds):
        # three steps, so float32 rounding accumulates as in a real encoder
        v = self.vision(torch.tanh(pixel_values) @ pixel_values.transpose(-1, -2) @ pixel_values / 8)
        return {"logits": (v @ self.text(text_embeds).transpose(-1, -2)) * 32}


def _dot_product_case():
    model = _UnscaledDotProduct().eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "pixel_values": torch.randn(3, 200, 64, generator=g) * 3,
        "text_embeds": torch.randn(3, 65, 64, generator=g),
    }
    with torch.no_grad():
        eager = model(**inputs)["logits"]
        ref = copy.deepcopy(model).double()(**{k: v.double() for k, v in inputs.items()})["logits"]
    return model, inputs, eager, ref


def test_float32_rounding_above_atol_is_judged_against_a_float64_reference():
    # a backend computing in another order lands as far from float64 as eager float32 does, but
    # more than atol away from eager: the float64 reference passes it (issue 28: grounding-dino)
    model, inputs, eager, ref = _dot_product_case()
    own_error = float((eager.double() - ref).abs().max())
    assert own_error > 2e-4  # eager float32 itself misses atol 1e-4 against float64
    reordered = (ref - (eager.double() - ref)).float()  # the mirror image of eager's rounding
    assert float((reordered - eager).abs().max()) > 1e-4
    run = lambda kwargs: {"logits": reordered}  # noqa: E731
    with pytest.raises(ExportValidationError, match="logits"):
        validate_artifact(model, run, inputs, float64_reference=False)
    (row,) = validate_artifact(model, run, inputs)
    assert row.ok and row.float32_rounding == pytest.approx(own_error)
    assert "float64 reference: eager float32 itself is" in format_table([row])
    assert model.vision[0].weight.dtype == torch.float32  # the float64 run used a copy


def test_an_export_error_above_float32_rounding_still_fails_against_float64():
    model, inputs, eager, ref = _dot_product_case()
    own_error = float((eager.double() - ref).abs().max())
    wrong = eager.clone().reshape(-1)
    where = int(eager.abs().reshape(-1).argmin())  # off where rtol gives no room
    wrong[where] += 10 * own_error  # one element off by ten times eager's own rounding
    wrong = wrong.reshape(eager.shape)
    with pytest.raises(ExportValidationError, match=r"logits.*NO \(float64 reference"):
        validate_artifact(model, lambda kwargs: {"logits": wrong}, inputs)
