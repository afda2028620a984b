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
from hfexport.testing import tiny_model
from hfexport.testing.backend_suite import PRESET_ZOO, assert_matches_at_two_shapes, assert_runs_match_eager
from hfexport.validation import derive_second_inputs
from hfexport_dynamo import DynamoExporter, load

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL = RTOL = 1e-5


# wav2vec2 and qwen2_vl are covered by the shared cases C08 and C04 (test_dynamo_cases.py)
@pytest.mark.parametrize("model_type", PRESET_ZOO)
def test_architecture_exports_validates_two_shapes_and_reloads(model_type, tmp_path):
    model, inputs = tiny_model(model_type)
    exporter = DynamoExporter()
    start = time.perf_counter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    seconds = time.perf_counter() - start
    report = exporter.last_report
    assert isinstance(program, torch.export.ExportedProgram)
    assert_matches_at_two_shapes(report, ATOL)

    # image sides the program fixes (ViT's image size) keep their size, as in the export's own validation
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert second is not None, reason
    assert any(second[k].shape != inputs[k].shape for k in inputs)

    path = exporter.artifact_path(tmp_path)
    exporter.save(program, path)
    runs = {"reloaded": exporter.runner(load(path))}
    assert_runs_match_eager(
        model, runs, (inputs, second), atol=ATOL, first_output=("logits", "last_hidden_state")
    )
    print(f"{model_type}: export+validation {seconds:.1f}s, max diff "
          f"{max(r['max_abs_diff'] for rows in report.validation.values() for r in rows):.2e}")  # fmt: skip
