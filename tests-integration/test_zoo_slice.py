"""The default run's slice of the whole-library sweep (``nox -s zoo``, docs/coverage.md).

A fixed, small, representative set of architectures *outside* the nineteen hand-written presets,
built by the generic tiny presets (``tiny_model(model_type)``), exports with ``dynamic=True`` and
matches eager PyTorch at the sample shape (batch 2, 8 tokens) and at the exporter's derived second
shape. A regression in a popular decoder family fails the default run here.

Time box: the default slice is five dynamo exports (about 20 s each on an idle core, < 2 min in
all); the same types on ONNX and the rest of the slice are ``extended``.

* granite: llama-like with embedding/residual/attention/logit multipliers;
* olmo2: q/k RMS norms after projection, post-norms;
* phi: partial rotary embeddings, parallel attention/MLP, dense biases;
* starcoder2: grouped-query attention with biases, 32-token sliding window (generic shrink);
* bailing_hybrid: linear-attention layers that loop over 64-token chunks (the program bounds the
  sequence at 64: reported "model-bounded", second shape derived inside the range) + MoE;
* stablelm, gemma (extended): partial rotary + layer norm; gelu-tanh MLP with scaled embeddings.
"""

from __future__ import annotations

import pytest

from hfexport.testing import SUPPORTED_MODEL_TYPES, tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEFAULT_SLICE = ("granite", "olmo2", "phi", "starcoder2", "bailing_hybrid")
EXTENDED_SLICE = ("stablelm", "gemma")
ATOL = {"dynamo": 1e-5, "onnx": 1e-4}  # the backends' fp32 defaults

CASES = [
    *[pytest.param("dynamo", mt, id=f"dynamo-{mt}") for mt in DEFAULT_SLICE],
    *[pytest.param("dynamo", mt, id=f"dynamo-{mt}", marks=pytest.mark.extended) for mt in EXTENDED_SLICE],
    *[
        pytest.param("onnx", mt, id=f"onnx-{mt}", marks=pytest.mark.extended)
        for mt in (*DEFAULT_SLICE, *EXTENDED_SLICE)
    ],
]


def test_slice_is_outside_the_hand_written_presets():
    assert not set(DEFAULT_SLICE + EXTENDED_SLICE) & set(SUPPORTED_MODEL_TYPES)


def _exporter(backend: str):
    if backend == "dynamo":
        from hfexport.config import DynamoConfig
        from hfexport_dynamo import DynamoExporter

        return DynamoExporter(), DynamoConfig(dynamic=True)
    from hfexport.config import OnnxConfig
    from hfexport_onnx import OnnxExporter

    return OnnxExporter(), OnnxConfig(dynamic=True)


@pytest.mark.parametrize(("backend", "model_type"), CASES)
def test_generic_tiny_model_exports_and_matches_at_two_shapes(backend, model_type):
    model, inputs = tiny_model(model_type, "text-generation", check_eager=True)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {"input_ids": (2, 8), "attention_mask": (2, 8)}
    exporter, config = _exporter(backend)
    exporter.export(model, inputs, config)
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    assert statuses["validate_second_shape"] == "ok", report.summary_lines()
    sample, second = report.validation["sample"], report.validation["second_shape"]
    assert sample and second
    assert sample[0]["name"] == "logits" and tuple(sample[0]["shape"]) == (2, 8, model.config.vocab_size)
    assert tuple(second[0]["shape"]) != tuple(sample[0]["shape"])  # a genuinely different shape ran
    for row in sample + second:
        assert row["ok"] and float(row["max_abs_diff"]) <= ATOL[backend], row
