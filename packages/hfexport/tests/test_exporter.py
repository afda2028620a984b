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


def test_the_save_stage_names_the_file_not_the_staging_folder_it_is_written_in(bert, tmp_path):
    # the artifact is saved into a hidden staging folder next to the target and moved into place once
    # validated: the report (and the CLI's progress line) named that staging path, gone after the move
    model, inputs = bert
    exporter = CoreOnlyExporter()
    exporter.export_to_path(model, inputs, tmp_path / "model.bin", DynamoConfig())
    (save,) = [s for s in exporter.last_report.stages if s.name == "save"]
    assert save.detail == "model.bin"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


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


# --------------------------------------------------------------------------------------------------
# the shared capture step and the quantization phases
# --------------------------------------------------------------------------------------------------
class Marker:
    """What the capture step's test patch replaces."""

    @staticmethod
    def value():
        return "original"


def _seen_marker(model, inputs):  # what _export saw while the patches were installed
    return Marker.value()


def _scale_source(request):
    """Source phase: a copy whose first Linear weight is doubled."""
    import copy

    quantized = copy.deepcopy(request.target)
    first = next(m for m in quantized.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        first.weight.mul_(2)
    return _Result(quantized, {"doubled": 1, "phase_seen": request.phase}, "doubled one weight")


def _count_program(request):
    """Program phase: the program unchanged, its node count as a fact; re-captures once."""
    recaptured = request.capture(request.target.module())
    return _Result(recaptured, {"nodes": len(recaptured.graph.nodes), "inputs": sorted(request.inputs)}, "")


def _tag_artifact(request):
    """Artifact phase: the artifact wrapped in a tuple with a tag."""
    return _Result(("tagged", request.target), {"calibration": request.calibration}, "tagged")


def _result_class():
    from hfexport.quantization import QuantizationResult

    return QuantizationResult


_Result = _result_class()


class SharedCaptureExporter(HfExporter):
    """A backend on the shared capture step: only its own lowering (a string) differs."""

    export_format = "core-capture"
    config_class = DynamoConfig
    artifact_filename = "model.txt"
    stages = ("quantize", "quantize_program", "lowered")
    fail_inside = False

    def _export(self, model, inputs, config, report):
        with self.captured_program(model, inputs, config, report) as session:
            self.seen_during = Marker.value()
            if self.fail_inside:
                raise RuntimeError("lowering broke")
            program = session.program
        self.seen_after = Marker.value()
        self.session = session
        with report.stage("lowered"):
            artifact = self.quantize_artifact(program, config, report, inputs=inputs, calibration=["c"])
        return artifact

    def runner(self, artifact):
        program = artifact[1] if isinstance(artifact, tuple) else artifact

        def run(kwargs):
            return get_leaf_tensors(program.module()(**kwargs))

        return run

    def save(self, artifact, path):
        with atomic_path(path) as tmp:
            tmp.write_text("artifact")


def _with_methods(**methods):
    from hfexport.config import QuantizationMethod

    table = {
        "src": QuantizationMethod("doubles a weight", phase="source", apply=_scale_source),
        "prog": QuantizationMethod(
            "counts nodes",
            phase="program",
            apply=_count_program,
            prepare=_scale_source,
            stage="quantize_program",
        ),
        "art": QuantizationMethod("tags the artifact", phase="artifact", apply=_tag_artifact),
        "declared": "a plain description: the backend would apply it itself",
    }
    return type("WithMethods", (SharedCaptureExporter,), {"quantization_methods": table})


@pytest.fixture
def capture_patch():
    from hfexport.registry import isolated_registry, register_patch

    with isolated_registry():

        @register_patch("core-capture", f"{__name__}.Marker.value")
        def patched(original):
            return staticmethod(lambda: "patched")

        yield


def test_shared_capture_step_records_the_four_stages_and_keeps_patches_until_the_block_exits(
    bert, capture_patch
):
    model, inputs = bert
    exporter = SharedCaptureExporter()
    exporter.export(model, inputs, DynamoConfig())
    report = exporter.last_report
    assert [s.name for s in report.stages] == [
        "prepare_inputs",
        "patches",
        "capture",
        "fx_program_fixes",
        "fx_node_fixes",
        "lowered",
        "reference",
        "validate",
    ]
    assert exporter.seen_during == "patched" and exporter.seen_after == "original" == Marker.value()
    (name,) = report.applied["patches"]
    assert name.endswith(".patched")
    assert report.stages[1].detail == "core-capture: 1 installed"
    assert report.stages[1].data == {"core-capture": [name]}
    assert report.applied["fx_program_fixes"] == [] and report.stages[3].detail == "0 applied"
    session = exporter.session
    assert session.registry_key == "core-capture" and session.model is session.original
    assert isinstance(session.program, torch.export.ExportedProgram) and session.method is None
    assert report.quantization is None and "quantize" not in report.applied


def test_shared_capture_step_restores_the_patches_when_the_block_raises(bert, capture_patch):
    model, inputs = bert
    exporter = SharedCaptureExporter()
    exporter.fail_inside = True
    with pytest.raises(RuntimeError, match="lowering broke"):
        exporter.export(model, inputs, DynamoConfig())
    assert Marker.value() == "original" and exporter.seen_during == "patched"


def test_quantization_runs_in_its_declared_phase(bert):
    from hfexport.config import QuantizationConfig

    model, inputs = bert
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    exporter_class = _with_methods()

    source = exporter_class()
    program = source.export(model, inputs, DynamoConfig(quantization="src", validate=False))
    report = source.last_report
    names = [s.name for s in report.stages]
    assert names[:4] == ["prepare_inputs", "patches", "quantize", "capture"]
    assert report.stages[2].detail == "doubled one weight"
    assert report.quantization["method"] == "src" and report.quantization["doubled"] == 1
    assert report.quantization["phase_seen"] == "source" and report.quantization["weight_bytes_before"] > 0
    assert report.applied["quantize"] == ["src"]
    first = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(program.state_dict[f"{first}.weight"], 2 * weights[f"{first}.weight"])
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # the model is untouched

    later = exporter_class()
    later.export(model, inputs, DynamoConfig(quantization=QuantizationConfig("prog"), validate=False))
    report = later.last_report
    names = [s.name for s in report.stages]
    assert names[:7] == [
        "prepare_inputs",
        "patches",
        "quantize",  # its prepare function, in the source phase
        "capture",
        "quantize_program",
        "fx_program_fixes",
        "fx_node_fixes",
    ]
    assert report.quantization["doubled"] == 1 and report.quantization["nodes"] > 10
    assert report.quantization["inputs"] == sorted(inputs)
    assert report.applied["quantize_program"] == ["prog"]

    artifact_phase = exporter_class()
    artifact = artifact_phase.export(model, inputs, DynamoConfig(quantization="art", validate=False))
    report = artifact_phase.last_report
    assert artifact[0] == "tagged" and isinstance(artifact[1], torch.export.ExportedProgram)
    names = [s.name for s in report.stages]
    assert names[names.index("lowered") :] == ["lowered", "quantize", "validate"]  # validate: skipped
    assert "quantize" not in names[: names.index("lowered")]
    assert report.quantization == {"method": "art", "calibration": ["c"]}
    assert report.stages[names.index("quantize")].detail == "tagged"

    declared = exporter_class()  # a plain description: nothing runs it for the backend
    declared.export(model, inputs, DynamoConfig(quantization="declared", validate=False))
    assert "quantize" not in [s.name for s in declared.last_report.stages]


def test_generation_source_is_the_source_phase_copy_shared_by_components(bert):
    from hfexport.generation.parts import transformed_source_of

    model, inputs = bert
    exporter = _with_methods()()
    copy = exporter.generation_source(model, DynamoConfig(quantization="src"))
    facts, original = transformed_source_of(copy)
    assert original is model and facts["shared_by_components"] is True and facts["doubled"] == 1
    assert exporter.generation_source(model, DynamoConfig(quantization="art")) is None  # no source phase
    assert exporter.generation_source(model, DynamoConfig()) is None
    assert exporter.generation_source(model, DynamoConfig(quantization="src", dtype="float16")) is None
    # a component of the shared copy is not quantized again: the copy's facts are reported
    exporter.export(copy, inputs, DynamoConfig(quantization="src", validate=False))
    report = exporter.last_report
    assert report.quantization["shared_by_components"] is True
    assert next(s for s in report.stages if s.name == "quantize").detail == (
        "src: quantized once for every generation component"
    )


def test_register_quantization_method_adds_a_method_to_a_backends_table():
    from hfexport.config import QuantizationConfig, QuantizationMethod
    from hfexport.quantization import isolated_quantization_methods, register_quantization_method
    from hfexport.registry import register_quantization_method as from_registry

    assert from_registry is register_quantization_method
    exporter_class = _with_methods()
    method = QuantizationMethod("tags too", options={"exclude"}, phase="artifact", apply=_tag_artifact)
    with isolated_quantization_methods():
        assert register_quantization_method("core-capture", "tag2", method) is method
        assert register_quantization_method("core-capture", "tag2", method) is method  # idempotent
        assert list(exporter_class.quantization_methods) == ["src", "prog", "art", "declared", "tag2"]
        exporter_class().check_precision(
            DynamoConfig(quantization=QuantizationConfig("tag2", exclude=("x",)))
        )
        with pytest.raises(ValueError, match=r"quantization.per_channel=False is not read .* 'tag2'"):
            exporter_class().check_precision(
                DynamoConfig(quantization=QuantizationConfig("tag2", per_channel=False))
            )
        other = QuantizationMethod("other", phase="artifact", apply=_tag_artifact)
        with pytest.raises(ValueError, match="'tag2' is already a core-capture method"):
            register_quantization_method("core-capture", "tag2", other)
        with pytest.raises(ValueError, match="declares no phase and apply function"):
            register_quantization_method("core-capture", "tag3", QuantizationMethod("nothing runs it"))
        with pytest.raises(TypeError, match=r"takes a hfexport\.config\.QuantizationMethod, got str"):
            register_quantization_method("core-capture", "tag3", "a description")
    assert "tag2" not in exporter_class.quantization_methods
    with pytest.raises(
        ValueError, match="quantization method 'tag2' is not one of the core-capture backend's"
    ):
        exporter_class().check_precision(DynamoConfig(quantization="tag2"))
