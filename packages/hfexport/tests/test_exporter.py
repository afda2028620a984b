"""The HfExporter template: stages in the report, two-shape validation, state restored on failure."""

from __future__ import annotations

import pytest
import torch

from hfexport.atomic import atomic_output_dir, atomic_path
from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.errors import ExportStageError, ExportValidationError, UnsupportedInputError
from hfexport.exporter import HfExporter
from hfexport.inputs.flags import program_output_flags
from hfexport.tensors import get_leaf_tensors
from hfexport.testing import tiny_model


class CoreOnlyExporter(HfExporter):
    """A minimal backend: the core capture, run with ExportedProgram.module()."""

    export_format = "core-test"
    config_class = DynamoConfig
    required_packages = ("torch", "transformers")
    artifact_filename = "model.txt"
    perturb = 0.0
    fail_in_capture = False

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            if self.fail_in_capture:
                raise RuntimeError("boom")
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        def run(kwargs):
            out = get_leaf_tensors(artifact.module()(**kwargs))
            return {k: v + self.perturb if v.is_floating_point() else v for k, v in out.items()}

        return run

    def save(self, artifact, path):
        with atomic_path(path) as tmp:
            tmp.write_text(str(artifact.graph_signature))


@pytest.fixture(scope="module")
def bert():
    return tiny_model("bert")


def test_dynamic_export_validates_two_shapes_and_reports_stages(bert):
    model, inputs = bert
    exporter = CoreOnlyExporter()
    exporter.export(model, inputs, DynamoConfig(dynamic=True))
    report = exporter.last_report
    assert [s.name for s in report.stages] == [
        "prepare_inputs",
        "capture",
        "reference",  # the eager outputs of both shapes, before the runtime runs the artifact
        "validate",
        "validate_second_shape",
    ]
    assert report.stages[2].detail == "sample, second shape"
    assert all(s.status == "ok" for s in report.stages)
    second = {r["name"]: r for r in report.validation["second_shape"]}
    assert list(second["last_hidden_state"]["shape"][:2]) == [3, 65]
    assert second["last_hidden_state"]["max_abs_diff"] <= 1e-4
    assert report.input_names["input_ids"] == {"shape": [2, 8], "dtype": "torch.int64"}


def test_static_export_skips_second_shape(bert):
    model, inputs = bert
    exporter = CoreOnlyExporter()
    exporter.export(model, inputs, DynamoConfig())
    assert [s.name for s in exporter.last_report.stages] == [
        "prepare_inputs",
        "capture",
        "reference",
        "validate",
    ]


def test_validation_failure_raises_with_table(bert):
    model, inputs = bert
    exporter = CoreOnlyExporter()
    exporter.perturb = 1e-2
    with pytest.raises(ExportValidationError, match="last_hidden_state") as info:
        exporter.export(model, inputs, DynamoConfig())
    assert info.value.table[0].max_abs_diff == pytest.approx(1e-2, rel=1e-3)
    exporter.export(model, inputs, DynamoConfig(atol=2e-2, rtol=0.0))  # a looser atol passes


def test_failed_export_restores_model_and_names_stage(bert):
    model, inputs = bert
    model.train()
    model.config.output_hidden_states = False
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exporter = CoreOnlyExporter()
    exporter.fail_in_capture = True
    with pytest.raises(ExportStageError, match="stage 'capture'") as info:
        exporter.export(model, {**inputs, "output_hidden_states": True}, DynamoConfig())
    assert info.value.stage == "capture" and isinstance(info.value, RuntimeError)
    assert model.training is True and model.config.output_hidden_states is False
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.eval()


def test_labels_rejected_before_anything_runs(bert):
    model, inputs = bert
    with pytest.raises(UnsupportedInputError, match="labels"):
        CoreOnlyExporter().export(model, {**inputs, "labels": inputs["input_ids"]})


def test_output_path_is_written_atomically(tmp_path):
    good = tmp_path / "model.txt"
    good.write_text("good")
    with pytest.raises(RuntimeError), atomic_path(good) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert good.read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.txt"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_text("old")
    (out / "export_report.json").write_text(
        '{"export_format": "dynamo"}'
    )  # a previous export: may be replaced
    with pytest.raises(KeyError), atomic_output_dir(out) as staging:
        (staging / "model.onnx").write_text("partial")
        raise KeyError("fail")
    assert (out / "model.onnx").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.txt", "out"]


class _OnlyExport(HfExporter):
    """A backend as the contract documents the minimum: subclass HfExporter, implement export."""

    export_format = "only-export"
    config_class = DynamoConfig

    def export(self, model, sample_inputs, config=None, **kwargs):
        return torch.export.export(model, (), dict(sample_inputs), strict=False)


def test_a_backend_implementing_only_export_works_unvalidated_and_says_so(tmp_path):
    model = torch.nn.Linear(3, 2)
    inputs = {"input": torch.randn(4, 3)}
    exporter = _OnlyExport()  # no abstract _export/runner/save left to refuse it
    program = exporter.export(model, inputs)
    torch.testing.assert_close(program.module()(**inputs), model(**inputs))
    report = exporter.last_report
    assert [(s.name, s.status) for s in report.stages] == [("export", "ok"), ("validate", "skipped")]
    assert "not validated" in report.stages[-1].detail and "_OnlyExport" in report.stages[-1].detail
    assert report.model_class == "Linear" and "export" in _OnlyExport.stages
    with pytest.raises(NotImplementedError, match="implements only export"):
        exporter.export_to_path(model, inputs, tmp_path / "model.bin")
    with pytest.raises(NotImplementedError, match="cannot save"):
        exporter.save(program, tmp_path / "model.bin")


def test_a_failure_in_a_backends_own_export_is_reported_in_its_stage():
    class Failing(_OnlyExport):
        def export(self, model, sample_inputs, config=None, **kwargs):
            raise RuntimeError("lowering broke")

    exporter = Failing()
    with pytest.raises(ExportStageError, match=r"stage 'export'.*lowering broke"):
        exporter.export(torch.nn.Linear(3, 2), {"input": torch.randn(1, 3)})
    assert [(s.name, s.status) for s in exporter.last_report.stages] == [("export", "failed")]


def test_an_exporter_implementing_nothing_cannot_be_instantiated():
    class Nothing(HfExporter):
        export_format = "nothing"

    with pytest.raises(TypeError, match="Can't instantiate Nothing: it implements neither export"):
        Nothing()
    with pytest.raises(TypeError, match="Can't instantiate HfExporter"):
        HfExporter()


def test_a_pipeline_backend_overriding_export_keeps_its_own_report(bert):
    """A subclass of a full backend that overrides export and calls super() is not wrapped."""

    class Logged(CoreOnlyExporter):
        def export(self, model, sample_inputs, config=None, **kwargs):
            return super().export(model, sample_inputs, config, **kwargs)

    model, inputs = bert
    exporter = Logged()
    exporter.export(model, inputs, DynamoConfig())
    assert [s.name for s in exporter.last_report.stages][-1] == "validate"
    assert exporter.last_report.stages[-1].status == "ok"


def test_a_generation_component_program_takes_the_kwargs_it_was_exported_with():
    from hfexport.generation import decompose_for_generation

    model, inputs = tiny_model("llama")
    components = decompose_for_generation(
        model, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    )
    module, subinputs = components["prefill"]
    assert {"use_cache", "return_dict"} <= set(subinputs)
    exporter = CoreOnlyExporter()
    program = exporter.export(module, subinputs, DynamoConfig())
    with torch.no_grad():
        got = program.module()(**subinputs)  # the same kwargs, flags included
        expected = module(**subinputs)
    torch.testing.assert_close(get_leaf_tensors(got)["logits"], expected.logits)
    with pytest.raises(Exception, match="use_cache"):  # a flag other than the captured one is refused
        program.module()(**{**subinputs, "use_cache": not subinputs["use_cache"]})
    # the program's flags are its constant inputs, as captured; validation ran with them
    assert program_output_flags(program) == {"use_cache": True, "return_dict": True}
    assert exporter.last_report.output_flags == {"use_cache": True, "return_dict": True}
    assert exporter.last_report.validation["sample"] and all(
        r["ok"] for r in exporter.last_report.validation["sample"]
    )
