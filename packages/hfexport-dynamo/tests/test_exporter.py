"""DynamoExporter: registration, versions, stages, runner, tolerances, patches undone, model restored."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch

import hfexport
import hfexport_dynamo
from hfexport.auto import get_hf_exporter
from hfexport.config import DynamoConfig
from hfexport.errors import ExportStageError, UnsupportedInputError
from hfexport.registry import isolated_registry, register_patch
from hfexport.testing import tiny_model
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo.versions import MIN_VERSIONS, TESTED_VERSIONS

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_export(llama):
    model, inputs = llama
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    return exporter, program


def test_exporter_is_registered_under_dynamo_with_its_entry_point():
    assert get_hf_exporter("dynamo") is DynamoExporter
    assert hfexport.DynamoExporter is DynamoExporter
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hfexport.exporters")}
    assert points["dynamo"] == "hfexport_dynamo.exporter:DynamoExporter"
    assert DynamoExporter.export_format == "dynamo"
    assert DynamoExporter.package_name == "hfexport-dynamo"
    assert DynamoExporter.artifact_filename == "model.pt2"
    assert DynamoExporter().artifact_path("out") == Path("out") / "model.pt2"


def test_versions_are_written_once_and_the_tested_extra_pins_them():
    assert DynamoExporter.tested_versions == TESTED_VERSIONS == {"torch": "2.13.0", "transformers": "5.24.0"}
    assert DynamoExporter.min_versions == MIN_VERSIONS and MIN_VERSIONS["torch"] == "2.12"
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(project["optional-dependencies"]["tested"]) == sorted(
        f"{name}=={version}" for name, version in TESTED_VERSIONS.items()
    )
    assert "version" in project["dynamic"] and hfexport_dynamo.__version__


def test_missing_torch_floor_is_an_import_error(monkeypatch):
    monkeypatch.setattr(
        "hfexport.environment.installed_version", lambda name: "2.11.0" if name == "torch" else "5.24.0"
    )
    with pytest.raises(
        ImportError, match=r"(?s)torch 2\.11\.0 is older than the minimum 2\.12.*hfexport-dynamo\[tested\]"
    ):
        DynamoExporter()


def test_export_returns_a_program_validated_at_two_shapes_with_named_stages(llama, llama_export):
    model, inputs = llama
    exporter, program = llama_export
    assert isinstance(program, torch.export.ExportedProgram)
    report = exporter.last_report
    assert [s.name for s in report.stages] == [
        "prepare_inputs",
        "patches",
        "capture",
        "capture.cache_pytrees",
        "capture.signature",
        "capture.dynamic_shapes",
        "capture.reset_stale_state",
        "capture.patches",
        "capture.torch_export",
        "fx_program_fixes",
        "fx_node_fixes",
        "lower",
        "flat_io",
        "reference",
        "validate",
        "validate_second_shape",
    ]
    assert {s.name: s.status for s in report.stages if s.status != "ok"} == {"lower": "skipped"}
    assert report.extra["flat_io"]["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    assert report.extra["flat_io"]["outputs"]["cache__layers__1__values"] == "cache.layers.1.values"
    assert "hfexport.workarounds.moe.dense_experts_for_eager" in report.applied["patches"]
    assert report.applied["capture_patches"] == [
        "hfexport.workarounds.torch_export.sliding_window_update_keeps_dynamic_length",
        "hfexport.workarounds.torch_export.keep_size_one_batch_dynamic",
        "hfexport.workarounds.torch_export.avg_pool_over_the_whole_map_as_mean",
        "hfexport.workarounds.torch_export.max_pool_over_the_whole_map_as_amax",
        "hfexport.workarounds.torch_export.max_pool1d_as_max_pool2d",
        "hfexport.workarounds.torch_export.mask_functions_broadcast_instead_of_vmap",
        "hfexport.workarounds.torch_export.t5gemma2_eoi_embedding_as_where",
        "hfexport.workarounds.torch_export.moonshine_feature_lengths_by_floor_division",
    ]
    for rows in (report.validation["sample"], report.validation["second_shape"]):
        names = [row["name"] for row in rows]
        assert names[0] == "logits" and "cache.layers.1.values" in names
        assert all(row["ok"] and row["max_abs_diff"] <= 1e-5 and row["atol"] == 1e-5 for row in rows)
    assert tuple(report.validation["second_shape"][0]["shape"][:2]) == (3, 65)
    with torch.no_grad():
        expected = model(**inputs).logits
    assert torch.equal(program.module()(**inputs).logits, expected)


def test_runner_names_outputs_like_eager_and_refuses_other_inputs(llama, llama_export):
    _, inputs = llama
    exporter, program = llama_export
    run = exporter.runner(program)
    out = run(inputs)
    assert list(out)[:3] == ["logits", "cache.layers.0.keys", "cache.layers.0.values"]
    assert out["cache.layers.0.keys"].shape == (2, 2, 8, 16)
    with pytest.raises(UnsupportedInputError, match=r"missing \['attention_mask'\], unexpected \[\]"):
        run({"input_ids": inputs["input_ids"]})
    with pytest.raises(UnsupportedInputError, match=r"unexpected \['token_type_ids'\]"):
        run({**inputs, "token_type_ids": inputs["input_ids"]})
    with pytest.raises(TypeError, match="expects an ExportedProgram"):
        exporter.runner(object())


def test_default_tolerances_are_tight_for_fp32_only():
    exporter = DynamoExporter()
    assert exporter.default_tolerances(torch.nn.Linear(2, 2)) == (1e-5, 1e-5)
    assert exporter.default_tolerances(torch.nn.Linear(2, 2).to(torch.bfloat16)) == (None, None)
    assert exporter.default_tolerances(torch.nn.ReLU()) == (None, None)


# --------------------------------------------------------------------------------------------
# patches are undone, the model is left as it was
# --------------------------------------------------------------------------------------------

CALLS: list[str] = []


def _model_state(model):
    return (
        model.training,
        model.config.use_cache,
        model.config._attn_implementation,
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def _same_state(a, b):
    return a[:3] == b[:3] and a[3].keys() == b[3].keys() and all(torch.equal(a[3][k], b[3][k]) for k in a[3])


def test_patches_are_installed_for_the_capture_only_and_restored(llama):
    model, inputs = llama
    original = torch.nn.functional.silu
    CALLS.clear()
    with isolated_registry():

        @register_patch(
            "dynamo",
            "torch.nn.functional.silu",
            description="count silu calls while tracing",
            issue="https://github.com/pytorch/pytorch/issues/1",
            versions={"torch": ">=2"},
        )
        def counting_silu(orig):
            def silu(x, inplace=False):
                CALLS.append("traced" if torch.compiler.is_exporting() else "eager")
                return orig(x, inplace=inplace)

            return silu

        exporter = DynamoExporter()
        exporter.export(model, inputs, DynamoConfig(dynamic=False))
    assert torch.nn.functional.silu is original
    # called while tracing, never by the eager validation run (which runs after the restore)
    assert CALLS and set(CALLS) == {"traced"}
    count = len(CALLS)
    model(**inputs)
    assert len(CALLS) == count
    assert exporter.last_report.applied["patches"] == [f"{__name__}.{counting_silu.__qualname__}"]


def test_failed_export_restores_patches_and_leaves_the_model_as_it_was(llama):
    model, inputs = llama
    model.train()
    before = _model_state(model)
    original = torch.nn.functional.silu
    with isolated_registry():

        @register_patch(
            "dynamo",
            "torch.nn.functional.silu",
            description="fail while tracing",
            issue="https://github.com/pytorch/pytorch/issues/1",
            versions={"torch": ">=2"},
        )
        def failing_silu(orig):
            def silu(x, inplace=False):
                raise RuntimeError("deliberate failure inside the trace")

            return silu

        exporter = DynamoExporter()
        with pytest.raises(ExportStageError, match="deliberate failure") as caught:
            exporter.export(model, {**inputs, "use_cache": False}, DynamoConfig(dynamic=True))
    assert caught.value.stage == "capture.torch_export"
    assert torch.nn.functional.silu is original
    assert _same_state(before, _model_state(model))
    assert model.training is True
    model.eval()
    failed = [s for s in exporter.last_report.stages if s.status == "failed"]
    assert [s.name for s in failed] == ["capture", "capture.torch_export"]


def test_a_classification_head_is_exported_with_its_scores_and_no_kv_cache():
    # LlamaForSequenceClassification returns past_key_values by default (config.use_cache=True);
    # prepare_for_export turns the cache off for heads that never generate
    model, inputs = tiny_model("llama", "text-classification")
    with torch.no_grad():
        eager = model(**inputs)
    assert eager.past_key_values is not None
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    report = exporter.last_report
    assert report.output_flags == {"use_cache": False}
    for rows in (report.validation["sample"], report.validation["second_shape"]):
        assert [row["name"] for row in rows] == ["logits"]
        assert all(row["ok"] and row["max_abs_diff"] <= 1e-5 for row in rows)
    out = exporter.runner(program)(inputs)
    assert list(out) == ["logits"]
    assert (out["logits"] - eager.logits).abs().max().item() <= 1e-5
    assert model.config.use_cache is True  # restored after the export
