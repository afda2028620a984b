"""Reduced-precision (``config.dtype``) exports outside the plain ``export`` path: validations that
build their own inputs (``HfExporter.check_outputs``), the generation manifest's input dtypes and
the runner's casting, and refusing a dtype before ``generate`` runs. Core capture only; each backend
package has its own reduced-precision generation test."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.exporter import HfExporter
from hfexport.generation import ComponentIO, GenerationRunner, exported_program_caller
from hfexport.precision import model_in_dtype
from hfexport.testing import tiny_model


class _HalfExporter(HfExporter):
    """Core capture; the artifact is the ``ExportedProgram`` (runs in float16 on CPU under torch)."""

    export_format = "dynamo"
    config_class = DynamoConfig
    artifact_filename = "model.pt2"
    supported_dtypes = ("float32", "float16")

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def save(self, artifact, path):  # not used here
        raise NotImplementedError


class _CacheModel(torch.nn.Module):
    """``x [b, 8]`` float, ``steps [b]`` int, ``past [{"key": [b, 8]}]`` -> ``y``: a float input
    nested like a decoder graph's past keys."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, steps, past):
        return {"y": self.lin(x + past[0]["key"]) * steps[:, None]}


def test_check_outputs_casts_nested_float_inputs_to_the_config_dtype():
    model = _CacheModel().eval()
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "x": torch.randn(3, 8, generator=gen),
        "steps": torch.tensor([1, 2, 3]),
        "past": [{"key": torch.randn(3, 8, generator=gen)}],
    }
    seen = {}

    def half_run(kwargs):
        seen.update(x=kwargs["x"].dtype, steps=kwargs["steps"].dtype, key=kwargs["past"][0]["key"].dtype)
        with model_in_dtype(model, "float16"):
            return {"y": model(**kwargs)["y"]}

    exporter = _HalfExporter()
    rows = exporter.check_outputs(model, half_run, inputs, DynamoConfig(dtype="float16"), label="decode step")
    # the artifact got every float leaf (the nested past key included) in float16, ints untouched
    assert seen == {"x": torch.float16, "steps": torch.int64, "key": torch.float16}
    assert inputs["past"][0]["key"].dtype == torch.float32  # the caller's inputs are not changed
    (row,) = rows
    assert row["ok"] and row["cosine"] > 0.9999 and 0 < row["max_abs_diff"] < 2e-2

    # float32: allclose at the default tolerances, inputs given as they are
    def fp32_run(kwargs):
        assert kwargs["past"][0]["key"].dtype == torch.float32
        return {"y": model(**kwargs)["y"]}

    (row,) = exporter.check_outputs(model, fp32_run, inputs, DynamoConfig())
    assert row["ok"] and row["max_abs_diff"] == 0.0 and "cosine" not in row


def test_component_io_in_dtype_records_and_build_casts_float_leaves():
    io = ComponentIO.from_kwargs(
        {"input_ids": torch.zeros(1, 2, dtype=torch.int64), "cache": {"k": torch.zeros(1, 2, 0, 4)}},
        ["logits"],
    )
    half = io.in_dtype("float16")
    assert {leaf["path"]: leaf["dtype"] for leaf in half.leaves} == {
        "input_ids": "int64",
        "cache.k": "float16",
    }
    assert io.leaves[1]["dtype"] == "float32"  # a copy
    built = half.build(lambda path: torch.ones(1, 2) if path == "input_ids" else torch.ones(1, 2, 3, 4))
    # a float32 value for a float16 leaf is cast; an int leaf keeps what it was given
    assert built["cache"]["k"].dtype == torch.float16 and built["input_ids"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"dtype='int8' is not a floating point torch dtype"):
        io.in_dtype("int8")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_float16_static_decode_only_export_prefills_through_its_empty_cache(llama):
    """The runner builds the empty static cache from the manifest: in float16 for a float16 graph."""
    model, inputs = llama
    exporter = _HalfExporter()
    artifacts = exporter.export_for_generation(
        model,
        inputs,
        DynamoConfig(dynamic=True, dtype="float16"),
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=24),
        multi_token_decode=True,
        components=["decode"],
    )
    assert model.dtype == torch.float32  # the user's model is back in float32
    io = artifacts.plan.io["decode"]
    dtypes = {leaf["path"]: leaf["dtype"] for leaf in io.leaves if leaf["tensor"]}
    assert dtypes["cache.layers.0.keys"] == dtypes["cache.layers.1.values"] == "float16"
    assert dtypes["cache.layers.0.cumulative_length"] == dtypes["input_ids"] == "int64"
    report = artifacts.reports["decode"]
    assert report.quality_gates == {"cosine": 0.99, "top1_agreement": 0.98}
    # the decode graph served the prompt on an empty cache (validated with the gates) ...
    for label in ("decode_q1", "decode_q4", "decode_prefill_empty_cache"):
        logits = next(r for r in report.validation[label] if r["name"] == "logits")
        assert logits["ok"] and logits["top1_agreement"] >= 0.98 and logits["cosine"] >= 0.99, (label, logits)
    # ... and greedy generation over it ran next to model.generate (reported, not gated)
    parity = report.greedy_parity
    assert "error" not in parity and len(parity["sequence"]) == 16
    runner = GenerationRunner(
        artifacts.plan, {"decode": exported_program_caller(artifacts["decode"])}, prefill_with_decode=True
    )
    out = runner.generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=4)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 4)


def test_a_dtype_the_backend_cannot_produce_is_refused_before_generate_runs(llama, monkeypatch):
    model, inputs = llama

    def no_generate(*args, **kwargs):
        raise AssertionError("generate ran before the dtype was checked")

    monkeypatch.setattr(model, "generate", no_generate)
    with pytest.raises(ValueError, match=r"dtype='bfloat16' is not supported .* allowed: float32, float16"):
        _HalfExporter().export_for_generation(model, inputs, DynamoConfig(dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"dtype='bfloat16' is not supported"):
        _HalfExporter().export_for_generation(
            model, inputs, {"prefill": DynamoConfig(), "decode": DynamoConfig(dtype="bfloat16")}
        )
