"""Reduced-precision generation export on dynamo (tiny llama): prefill and decode programs captured
in ``config.dtype``, scored against the fp32 model by the quality gates, saved, and generating from
the folder; the manifest records the graphs' float dtype."""

from __future__ import annotations

import json

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.generation import MANIFEST_NAME, load_runner, save_components
from hfexport.testing import tiny_model
from hfexport_dynamo import DynamoExporter


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.extended)])
def test_reduced_precision_generation_export_gates_and_generates(tmp_path, dtype):
    model, inputs = tiny_model("llama")
    exporter = DynamoExporter()
    parts = exporter.export_for_generation(model, inputs, DynamoConfig(dynamic=True, dtype=dtype))
    assert model.dtype == torch.float32
    for name in ("prefill", "decode"):
        report = parts.reports[name]
        assert report.extra["dtype"] == dtype
        assert report.extra["quality_gates"] == {"cosine": 0.99, "top1_agreement": 0.98}
        logits = next(r for r in report.validation["sample"] if r["name"] == "logits")
        assert logits["dtype"] == f"torch.{dtype}" and logits["ok"], (name, logits)
        assert logits["cosine"] >= 0.999 and logits["top1_agreement"] == 1.0, (name, logits)
    # greedy generation over the exported programs next to fp32 model.generate: reported, not gated
    parity = parts.reports["decode"].extra["greedy_parity"]
    assert "error" not in parity and len(parity["sequence"]) == len(parity["reference"]) == 16
    assert parity["matching_prefix"] >= 1, parity  # measured on tiny llama: 16 (no divergence)

    save_components(exporter, parts, tmp_path, model=model)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    leaves = {leaf["path"]: leaf.get("dtype") for leaf in manifest["plan"]["io"]["decode"]["leaves"]}
    assert leaves["cache.layers.0.keys"] == dtype and leaves["input_ids"] == "int64"
    out = load_runner(tmp_path, exporter=exporter).generate(
        inputs["input_ids"], inputs["attention_mask"], max_new_tokens=4
    )
    assert out.shape == (2, inputs["input_ids"].shape[1] + 4)
    assert out[0, -4:].tolist() == parity["sequence"][:4]
