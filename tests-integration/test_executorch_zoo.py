"""Every tiny-model architecture through the ExecuTorch backend (XNNPACK), dynamic shapes.

One ``dynamic=True`` export per architecture. ``ExecutorchExporter.export`` itself validates the
``.pte`` in the ExecuTorch runtime against eager PyTorch at the sample shape (batch 2, 8 tokens)
and at a derived second shape (batch 3, 65 tokens: past the 64-token cap that made earlier
ExecuTorch exporters fail on ordinary prompts). The same program then runs at batch 1 with one
token, batch 2 with 100 tokens and batch 3 with 256 tokens, each compared with eager PyTorch.
"""

from __future__ import annotations

import time

import pytest

from hfexport.config import ExecutorchConfig
from hfexport.testing import make_inputs, tiny_model
from hfexport.testing.backend_suite import PRESET_ZOO, assert_matches_at_two_shapes
from hfexport.validation import validate_artifact
from hfexport_executorch import ExecutorchExporter

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# (batch, sequence) the exported program must run at, besides the sample and the second shape.
EXTRA_SHAPES = ((1, 1), (2, 100), (3, 256))


@pytest.mark.parametrize("model_type", PRESET_ZOO)  # wav2vec2, qwen2_vl: the shared cases
def test_zoo_dynamic_export_runs_at_many_shapes(model_type, record_property):
    model, inputs = tiny_model(model_type)  # batch 2, 8 tokens
    exporter = ExecutorchExporter()
    start = time.perf_counter()
    program = exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    record_property("export_seconds", round(time.perf_counter() - start, 1))
    report = exporter.last_report

    # validated in the ExecuTorch runtime at the sample and at the second shape
    _, second_rows = assert_matches_at_two_shapes(report, atol=None)  # the exporter's tolerance
    assert second_rows[0]["shape"][0] == 3  # batch 2 -> 3

    # bounds: batch up to at least 3, every sequence axis up to 256 (or the model's limit)
    axes = report.dynamic_bounds["axes"]
    assert {a["role"] for a in axes} >= {"batch"}
    assert all(a["max"] >= 3 for a in axes if a["role"] == "batch")
    assert all(a["max"] >= 256 for a in axes if a["role"] in ("sequence", "decoder_sequence"))
    # only axes without a shared role may be specialised (ViT's image size, Whisper's mel bins and frames)
    roles = {s["role"] for s in report.dynamic_bounds["specialized"]}
    assert roles <= {"other", "spatial", "frames"}, roles

    # the share XNNPACK took is recorded per artifact
    delegation = report.extra["delegation"]
    record_property("delegated_share", delegation["delegated_share"])
    assert delegation["partitions"] >= 1 and 0.0 < delegation["delegated_share"] <= 1.0
    assert report.extra["planned_memory_bytes"] > 0

    run = exporter.runner(program)
    for batch, seq in EXTRA_SHAPES:
        kwargs = make_inputs(model, batch_size=batch, seq_len=seq, seed=batch * 1000 + seq)
        rows = validate_artifact(model, run, kwargs, label=f"batch {batch}, {seq} tokens")
        assert rows and all(r.ok for r in rows)
        assert rows[0].shape[0] == batch


def test_tiny_siglip_validates_at_both_shapes():
    # SigLIP's towers use gelu_pytorch_tanh, which XNNPACK computed as exact GELU (pytorch/executorch#22851):
    # every output was off by ~1e-4 until the gelu_tanh_stays_portable partitioner rule kept it portable.
    model, inputs = tiny_model("siglip")  # SiglipForImageClassification, pixel_values [2, 3, 32, 32]
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == stages["validate_second_shape"] == "ok", report.summary_lines()
    assert "hfexport_executorch.workarounds.patches.gelu_tanh_stays_portable" in report.applied["patches"]
    sample_rows, second_rows = report.validation["sample"], report.validation["second_shape"]
    assert all(r["ok"] and r["max_abs_diff"] < 1e-5 for r in sample_rows + second_rows), (
        sample_rows + second_rows
    )
    assert second_rows[0]["shape"][0] == 3  # batch 2 -> 3
    # issue 15: the position table holds 16 patches, so the model fixes the 32x32 image; the second
    # shape kept it (it fed 64x64 while the bounded capture left the sides dynamic)
    assert "pixel_values image height/width: static 32 (model-fixed)" in report.dynamic_axes_summary
    assert [(s["axis"], s["tried"]) for s in report.extra["model_fixed_sides"]] == [(2, 64), (3, 64)]
    assert {a["role"] for a in report.dynamic_bounds["specialized"]} == {"spatial", "other"}
    assert any("gelu" in op for op in report.extra["delegation"]["portable_ops"]), report.extra["delegation"]
