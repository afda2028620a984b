"""The zoo sweep's tooling (hfexport.testing.sweep): type lists, subprocess time limit, coverage page."""

from __future__ import annotations

import json

from hfexport.testing import sweep


def test_sweep_types_filters_and_limits():
    causal = sweep.sweep_types("causal-lm")
    assert len(causal) > 150 and causal == sorted(causal)
    assert {"llama", "granite", "olmo2", "mamba"} <= set(causal)
    assert sweep.sweep_types("causal-lm", types=["olmo2", "granite", "vit"]) == ["granite", "olmo2"]
    assert (
        sweep.sweep_types("image-classification", limit=3)
        == sorted(sweep.sweep_types("image-classification"))[:3]
    )


def test_child_past_its_time_limit_is_killed_and_reported():
    result = sweep._run_child("import time; time.sleep(30)", [], timeout=1)
    assert result == {"status": "fail", "stage": "timeout", "reason": "no result within 1 s"}
    crashed = sweep._run_child("raise SystemExit('boom at import')", [], timeout=30)
    assert (crashed["status"], crashed["stage"], crashed["reason"]) == ("fail", "crash", "boom at import")


def _write(out, family, model_type, build, backends):
    row = {"family": family, "task": sweep.FAMILIES[family], "model_type": model_type, "build": build,
           "backends": backends, "updated": "2026-12-01T23:00:00+00:00"}  # fmt: skip
    (out / f"{family}--{model_type}.json").write_text(json.dumps(row))


def test_render_counts_rows_cells_and_partial_banner(tmp_path):
    out = tmp_path / "zoo"
    out.mkdir()
    (out / "_run.json").write_text(
        json.dumps(
            {
                "date": "2026-12-01T22:00:00+00:00",
                "versions": {"torch": "2.13.0", "transformers": "5.24.0"},
                "families": ["causal-lm"],
                "backends": ["dynamo", "onnx"],
                "types": ["a", "b", "c"],
                "limit": None,
                "partial": True,
            }
        )
    )
    ok = {"status": "ok", "params": 120000}
    _write(out, "causal-lm", "b", ok, {"dynamo": {"status": "pass"}, "onnx": {"status": "pass"}})
    _write(out, "causal-lm", "a", ok, {"dynamo": {"status": "pass"},
           "onnx": {"status": "fail", "stage": "translate", "reason": "ConversionError: no | rule"}})  # fmt: skip
    _write(out, "causal-lm", "c", {"status": "eager fails", "stage": "eager", "reason": "ValueError: x"}, {})
    text = sweep.render(out, tmp_path / "coverage.md")
    assert (tmp_path / "coverage.md").read_text() == text
    assert "- Date: 2026-12-01" in text and "torch 2.13.0, transformers 5.24.0" in text
    assert "**Partial run** (types a, b, c; families causal-lm; backends dynamo, onnx)" in text
    assert "| causal-lm | 3 | 2 | 2 pass / 0 fail / 0 skip (100%) | 1 pass / 1 fail / 0 skip (50%) |" in text
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| a ") or line.startswith("| b ") or line.startswith("| c ")
    ]
    assert rows == [
        "| a | ok (0.12M params) | pass | **fail** (translate): ConversionError: no \\| rule |",
        "| b | ok (0.12M params) | pass | pass |",
        "| c | eager fails (eager): ValueError: x | n/a | n/a |",
    ]


def test_known_skips_name_the_model_side_change_for_mamba_and_llava():
    from hfexport.testing.sweep import KNOWN_SKIPS

    for backend in ("dynamo", "onnx", "executorch"):
        assert "mamba_selective_scan" in KNOWN_SKIPS[(backend, "mamba")]
        assert "list(image_features)" in KNOWN_SKIPS[(backend, "llava")]
        assert "aten._is_all_true" in KNOWN_SKIPS[(backend, "llava")]


def test_mamba_skip_names_the_model_side_construct():
    reason = sweep.KNOWN_SKIPS[("dynamo", "mamba")]
    assert {sweep.KNOWN_SKIPS[(b, "mamba")] for b in sweep.BACKENDS} == {reason}
    for part in (
        "transformers 5.24",
        "models/mamba/modeling_mamba.py",
        "mamba_selective_scan",
        "for index in range(seq_len)",
        "is_torchdynamo_exporting()",
        "Guard failed: attention_mask.size()[1] == 8",
    ):
        assert part in reason, part


def test_mamba_capture_still_specialises_the_sequence_length():
    # Documents the construct behind the mamba skip on the installed transformers: the plain forward's
    # selective scan is a Python loop over the sequence, unrolled at capture. Retire the skip when this fails.
    import inspect

    import pytest
    import torch
    from transformers.models.mamba import modeling_mamba

    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.testing import make_inputs, tiny_model

    source = inspect.getsource(modeling_mamba.mamba_selective_scan)
    assert "for index in range(seq_len):" in source
    assert "is_torchdynamo_compiling() and not is_torchdynamo_exporting()" in source

    model, inputs = tiny_model("mamba", "text-generation")  # batch 2, 8 tokens
    assert inputs["input_ids"].shape == (2, 8)
    program = capture(model, inputs, DynamoConfig(dynamic=True))
    module = program.module()
    with torch.no_grad():
        out = module(**make_inputs(model, batch_size=3, seq_len=8, seed=1))  # the batch stays dynamic
    assert out["logits"].shape[:2] == (3, 8)
    with pytest.raises(AssertionError, match=r"Guard failed: .*size\(\)\[1\] == 8"):
        module(**make_inputs(model, batch_size=2, seq_len=9, seed=2))
