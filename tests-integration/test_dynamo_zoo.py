"""Every tiny-model architecture exports to an ExportedProgram with dynamic shapes, validates at two
shapes, and validates again after a save/load round trip (``hfexport_dynamo.save`` / ``load``).

One ``dynamic=True`` export per architecture: the exporter itself validates the sample inputs
(batch 2, 8 tokens) and a derived second shape (batch 3, 65 tokens; whisper/vit change the batch
and the decoder length only); the reloaded program is then checked on both input sets again.
Tolerance: the backend's fp32 default, atol = rtol = 1e-5.
"""

from __future__ import annotations

import time

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.testing import SUPPORTED_MODEL_TYPES, tiny_model
from hfexport.validation import derive_second_inputs, validate_artifact
from hfexport_dynamo import DynamoExporter, load

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ZOO = (
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "gpt_neox", "opt", "mixtral",
    "bert", "roberta", "distilbert", "t5", "bart", "vit", "whisper",
)  # fmt: skip
ATOL = RTOL = 1e-5


def test_zoo_list_is_the_tiny_model_zoo():
    # wav2vec2 and qwen2_vl are covered by the shared cases C08 and C04 (test_dynamo_cases.py)
    assert set(ZOO) == set(SUPPORTED_MODEL_TYPES) - {"wav2vec2", "qwen2_vl"}


@pytest.mark.parametrize("model_type", ZOO)
def test_architecture_exports_validates_two_shapes_and_reloads(model_type, tmp_path):
    model, inputs = tiny_model(model_type)
    exporter = DynamoExporter()
    start = time.perf_counter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    seconds = time.perf_counter() - start
    report = exporter.last_report
    assert isinstance(program, torch.export.ExportedProgram)
    assert {s.name: s.status for s in report.stages}["validate_second_shape"] == "ok", report.summary_lines()
    for label in ("sample", "second_shape"):
        rows = report.validation[label]
        assert rows and all(r["ok"] and r["max_abs_diff"] <= ATOL for r in rows), (label, rows)

    # image sides the program fixes (ViT's image size) keep their size, as in the export's own validation
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert any(second[k].shape != inputs[k].shape for k in inputs)

    path = exporter.artifact_path(tmp_path)
    exporter.save(program, path)
    reloaded = exporter.runner(load(path))
    for label, kwargs in (("reloaded sample", inputs), ("reloaded second shape", second)):
        rows = validate_artifact(model, reloaded, kwargs, atol=ATOL, rtol=RTOL, label=label)
        assert rows[0].name in ("logits", "last_hidden_state") and all(r.ok for r in rows)
    print(f"{model_type}: export+validation {seconds:.1f}s, max diff "
          f"{max(r['max_abs_diff'] for rows in report.validation.values() for r in rows):.2e}")  # fmt: skip
