"""OnnxExporter: stages and report, workarounds installed and undone, I/O names, validation, save."""

from __future__ import annotations

import copy

import onnx_ir as ir
import pytest
import torch
from torch.export import Dim
from transformers import PretrainedConfig

from hfexport.config import OnnxConfig
from hfexport.errors import ExportStageError, ExportValidationError
from hfexport.registry import isolated_registry, register_fx_node_fix, register_patch
from hfexport.report import ExportReport
from hfexport.validation import validate_artifact
from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner
from hfexport_onnx.io_names import INPUTS_KEY, OUTPUTS_KEY, graph_output_names
from hfexport_onnx.workarounds import ir_fixes, translations

ATOL = 1e-5  # fp32 tiny modules: ONNX Runtime and PyTorch agree to ~1e-7

EXPECTED_STAGES = [
    "prepare_inputs",
    "patches",
    "onnx_patches",
    "capture",
    "fx_program_fixes",
    "fx_node_fixes",
    "lower",
    "custom_translations",
    "translate",
    "io_names",
    "ir_fixes",
    "optimize",
    "ort_kernel_fixes",
    "external_data",
    "reference",
    "save",  # saved into a staging folder, loaded from there, moved into place once validated
    "load_artifact",
    "validate",
    "validate_second_shape",
]

ISSUE = "https://github.com/pytorch/pytorch/issues/1"


@pytest.fixture(scope="module")
def exporter() -> OnnxExporter:
    return OnnxExporter()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_encoder_builder):
    """One dynamic export of TinyEncoder shared by the read-only tests (saved through output_path)."""
    model, inputs = tiny_encoder_builder()
    exporter = OnnxExporter()
    path = tmp_path_factory.mktemp("export") / "tiny.onnx"
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, output_path=str(path)))
    return exporter, program, model, inputs, path


# -- stages and report ---------------------------------------------------------------------------
def test_every_stage_runs_and_is_reported(exported):
    exporter, _program, _model, _inputs, path = exported
    report = exporter.last_report
    assert [s.name for s in report.stages] == EXPECTED_STAGES
    assert all(s.status == "ok" for s in report.stages), report.summary_lines()
    for kind in (
        "patches",
        "onnx_patches",
        "fx_program_fixes",
        "fx_node_fixes",
        "custom_translations",
        "ir_fixes",
    ):
        assert kind in report.applied
    assert report.extra["onnx_save"]["external_data"] is True
    assert path.is_file() and (path.parent / "tiny.onnx.data").is_file()


def test_validation_rows_hold_real_differences(exported):
    exporter, *_ = exported
    rows = exporter.last_report.validation
    assert [r["name"] for r in rows["sample"]] == ["last_hidden_state"]
    assert rows["sample"][0]["shape"] == [2, 5, 8] or tuple(rows["sample"][0]["shape"]) == (2, 5, 8)
    second = rows["second_shape"][0]
    assert tuple(second["shape"])[:2] == (3, 65)  # another batch size and a longer sequence
    for row in rows["sample"] + rows["second_shape"]:
        assert row["ok"] and float(row["max_abs_diff"]) <= ATOL


def test_optimize_can_be_skipped(exporter, tiny_encoder):
    model, inputs = tiny_encoder
    exporter.export(model, inputs, OnnxConfig(optimize=False, external_data=False))
    stages = {s.name: s for s in exporter.last_report.stages}
    assert stages["optimize"].status == "skipped"
    assert stages["optimize"].detail == "config.optimize is False"
    assert "validate_second_shape" not in stages  # static export: one shape only


# -- I/O names -----------------------------------------------------------------------------------
def test_graph_names_are_leaf_paths(exported):
    _exporter, program, *_ = exported
    graph = program.model.graph
    assert [v.name for v in graph.inputs] == ["inputs_embeds", "attention_mask"]
    assert [v.name for v in graph.outputs] == ["last_hidden_state"]
    assert INPUTS_KEY in program.model.metadata_props and OUTPUTS_KEY in program.model.metadata_props


def test_collision_rule():
    assert graph_output_names(["logits", "state"], ["state"]) == ["logits", "state.out"]
    assert graph_output_names(["a", "state.out"], ["state.out"]) == ["a", "state.out.out"]
    with pytest.raises(ValueError, match="share the leaf path"):
        graph_output_names(["a", "a"], [])
    # a bare tensor output (leaf path "") is named "output", suffixed if an input already is
    assert graph_output_names([""], ["x"]) == ["output"]
    assert graph_output_names([""], ["output"]) == ["output.out"]


class BareProjector(torch.nn.Module):
    """A multimodal projector's shape: a plain module whose forward returns a bare tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(self.norm(image_features)))


def test_a_bare_tensor_output_survives_the_optimizer():
    """issue 28: the empty leaf path of a bare tensor output was used as the graph output name;
    onnxscript's optimizer renamed that unnamed value and the export failed in stage 'optimize'."""
    torch.manual_seed(0)
    model = BareProjector().eval()
    exporter = OnnxExporter()
    program = exporter.export(model, {"image_features": torch.randn(2, 5, 8)}, OnnxConfig(dynamic=True))
    stages = {s.name: s.status for s in exporter.last_report.stages}
    assert stages["optimize"] == "ok" and stages["validate"] == "ok"
    assert [v.name for v in program.model.graph.outputs] == ["output"]
    features = torch.randn(3, 7, 8)
    got = OnnxRuntimeRunner(program)({"image_features": features})
    assert list(got) == [""]  # the runner returns the eager leaf path
    with torch.no_grad():
        torch.testing.assert_close(got[""], model(features), atol=ATOL, rtol=0)


class StateNet(torch.nn.Module):
    """Returns its ``state`` input updated (a cache-like output named like an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()

    def forward(self, inputs_embeds: torch.Tensor, state: torch.Tensor, extra: dict[str, torch.Tensor]):
        new_state = state + inputs_embeds.mean(dim=1)
        return {"logits": inputs_embeds * extra["scale"], "state": new_state}


def test_output_named_like_an_input_gets_suffix_and_nested_inputs_dotted(exporter):
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "inputs_embeds": torch.randn(2, 3, 4, generator=gen),
        "state": torch.randn(2, 4, generator=gen),
        "extra": {"scale": torch.randn(4, generator=gen)},
    }
    program = exporter.export(StateNet(), inputs, OnnxConfig(external_data=False))
    graph = program.model.graph
    assert [v.name for v in graph.inputs] == ["inputs_embeds", "state", "extra.scale"]
    assert [v.name for v in graph.outputs] == ["logits", "state.out"]
    got = OnnxRuntimeRunner(program)(inputs)
    assert sorted(got) == ["logits", "state"]
    expected = StateNet()(**inputs)
    assert (got["state"] - expected["state"]).abs().max() <= ATOL
    assert (got["logits"] - expected["logits"]).abs().max() <= ATOL


def test_explicit_dims_name_the_onnx_axes(exporter, tiny_encoder):
    model, inputs = tiny_encoder
    batch, seq = Dim("batch", min=1, max=32), Dim("seq", min=1, max=2048)
    shapes = {"inputs_embeds": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    program = exporter.export(model, inputs, OnnxConfig(dynamic_shapes=shapes, external_data=False))
    graph = program.model.graph
    assert [str(d) for d in graph.inputs[0].shape] == ["batch", "seq", "8"]
    assert [str(d) for d in graph.inputs[1].shape] == ["batch", "seq"]
    assert exporter.last_report.extra["onnx_axis_names"]


# -- workarounds: installed, applied, undone ------------------------------------------------------
def test_registered_patches_are_installed_during_export_and_restored(exporter, tiny_encoder):
    import onnxscript.optimizer

    model, inputs = tiny_encoder
    original_sin, original_optimize = torch.sin, onnxscript.optimizer.optimize
    calls: list[tuple[int, ...]] = []
    with isolated_registry():

        @register_patch(
            "onnx", "torch.sin", description="count sin calls", issue=ISSUE, versions={"torch": ">=2"}
        )
        def count_sin(original):
            def sin(x, *args, **kwargs):
                calls.append(tuple(x.shape))
                return original(x, *args, **kwargs)

            return sin

        @register_patch(
            "onnx",
            "onnxscript.optimizer.optimize",
            description="wrap optimize",
            issue=ISSUE,
            versions={"torch": ">=2"},
        )
        def wrap_optimize(original):
            return lambda *a, **k: original(*a, **k)

        exporter.export(model, inputs, OnnxConfig(external_data=False))
    assert calls, "the torch patch was not in place while the model was traced"
    assert torch.sin is original_sin
    assert onnxscript.optimizer.optimize is original_optimize
    applied = exporter.last_report.applied
    assert applied["patches"] == [f"{__name__}.{count_sin.__qualname__}"]
    assert applied["onnx_patches"] == [f"{__name__}.{wrap_optimize.__qualname__}"]


def _sin_to_cos(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.target is not torch.ops.aten.sin.default:
        return False
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(torch.ops.aten.cos.default, node.args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


def _cos_reference(model, inputs):
    x, mask = inputs["inputs_embeds"], inputs["attention_mask"]
    return torch.cos(model.proj(x)) * mask.unsqueeze(-1).float() + 0.5 * x


def test_fx_node_fix_rewrites_a_node(exporter, tiny_encoder):
    model, inputs = tiny_encoder
    with isolated_registry():
        register_fx_node_fix("onnx", description="sin becomes cos", issue=ISSUE, versions={"torch": ">=2"})(
            _sin_to_cos
        )
        program = exporter.export(model, inputs, OnnxConfig(external_data=False, validate=False))
    ops = [n.op_type for n in program.model.graph]
    assert "Cos" in ops and "Sin" not in ops
    assert exporter.last_report.applied["fx_node_fixes"] == [f"{__name__}._sin_to_cos"]
    got = OnnxRuntimeRunner(program)(inputs)["last_hidden_state"]
    with torch.no_grad():
        assert (got - _cos_reference(model, inputs)).abs().max() <= ATOL


def test_failed_export_restores_model_and_patches(exporter, tiny_encoder, tmp_path):
    model, inputs = tiny_encoder
    model.train()
    before = copy.deepcopy(model.state_dict())
    original_sin = torch.sin
    target = tmp_path / "model.onnx"

    def explode(gm, node):
        raise RuntimeError("fix failed on purpose")

    with isolated_registry():
        register_patch("onnx", "torch.sin", description="identity", issue=ISSUE, versions={"torch": ">=2"})(
            lambda original: lambda *a, **k: original(*a, **k)
        )
        register_fx_node_fix("onnx", description="raises", issue=ISSUE, versions={"torch": ">=2"})(explode)
        with pytest.raises(ExportStageError, match="stage 'fx_node_fixes'") as info:
            exporter.export(model, inputs, OnnxConfig(output_path=str(target)))
    assert info.value.stage == "fx_node_fixes"
    assert torch.sin is original_sin
    assert model.training is True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert list(tmp_path.iterdir()) == []


def test_validation_failure_leaves_no_file(exporter, tiny_encoder, tmp_path):
    model, inputs = tiny_encoder
    target = tmp_path / "model.onnx"
    with isolated_registry():
        register_fx_node_fix("onnx", description="sin becomes cos", issue=ISSUE, versions={"torch": ">=2"})(
            _sin_to_cos
        )
        with pytest.raises(ExportValidationError, match="last_hidden_state"):
            exporter.export(model, inputs, OnnxConfig(output_path=str(target)))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def empty_registry():
    with isolated_registry():
        yield


def test_custom_translation_is_used(exporter, tiny_encoder, empty_registry):
    model, inputs = tiny_encoder

    @translations.register_translation(
        torch.ops.aten.sin.default, description="sin as Cos", issue=ISSUE, versions={"torch": ">=2"}
    )
    def sin_as_cos(x):
        from onnxscript import opset18 as op

        return op.Cos(x)

    @translations.register_translation(
        "nonexistent_ns::nothing.default", description="unresolvable", issue=ISSUE, versions={"torch": ">=2"}
    )
    def never(x):
        raise AssertionError("not called")

    @translations.register_translation(
        torch.ops.aten.cos.default, description="inactive", issue=ISSUE, versions={"torch": "<1"}
    )
    def inactive(x):
        raise AssertionError("not called")

    program = exporter.export(model, inputs, OnnxConfig(external_data=False, validate=False))
    assert exporter.last_report.applied["custom_translations"] == [f"{__name__}.{sin_as_cos.__qualname__}"]
    got = OnnxRuntimeRunner(program)(inputs)["last_hidden_state"]
    with torch.no_grad():
        assert (got - _cos_reference(model, inputs)).abs().max() <= ATOL


def test_ir_fixes_run_in_order_and_report_changes(exporter, tiny_encoder, empty_registry):
    model, inputs = tiny_encoder
    seen: list[str] = []

    @ir_fixes.register_ir_fix(description="tags the graph", issue=ISSUE, versions={"torch": ">=2"})
    def tag_graph(model_ir):
        seen.append("tag")
        model_ir.graph.doc_string = "fixed"
        return True

    @ir_fixes.register_ir_fix(description="changes nothing", issue=ISSUE, versions={"torch": ">=2"})
    def no_change(model_ir):
        seen.append("noop")
        return False

    program = exporter.export(model, inputs, OnnxConfig(external_data=False))
    assert seen == ["tag", "noop"]
    assert exporter.last_report.applied["ir_fixes"] == [f"{__name__}.{tag_graph.__qualname__}"]
    assert program.model.graph.doc_string == "fixed"


def test_workaround_metadata_is_checked():
    with pytest.raises(ValueError, match="issue must be"):
        ir_fixes.register_ir_fix(description="x", issue="not a url", versions={"torch": ">=2"})
    with pytest.raises(ValueError, match="versions"):
        translations.register_translation(
            torch.ops.aten.sin.default, description="x", issue=ISSUE, versions={}
        )
    with pytest.raises(ValueError, match="at least one"):
        translations.register_translation(description="x", issue=ISSUE, versions={"torch": ">=2"})


# -- validation catches a wrong artifact ------------------------------------------------------------
def _copy_model(program) -> ir.Model:
    return ir.from_proto(program.model_proto)


def test_validation_raises_on_a_tampered_initializer(exported):
    exporter, program, model, inputs, _path = exported
    tampered = _copy_model(program)
    weight = next(v for v in tampered.graph.initializers.values() if v.const_value.shape == ir.Shape([8, 8]))
    weight.const_value = ir.tensor(weight.const_value.numpy() * 1.05)
    with pytest.raises(ExportValidationError, match="last_hidden_state") as info:
        validate_artifact(model, exporter.runner(tampered), inputs)
    row = info.value.table[0]
    assert not row.ok and row.max_abs_diff > 1e-3


def test_validation_raises_on_an_extra_mul(exported):
    exporter, program, model, inputs, _path = exported
    tampered = _copy_model(program)
    graph = tampered.graph
    out = graph.outputs[0]
    factor = ir.Value(name="factor", const_value=ir.tensor([1.01], dtype=ir.DataType.FLOAT))
    graph.register_initializer(factor)
    mul = ir.Node("", "Mul", [out, factor], num_outputs=1)
    graph.append(mul)
    new = mul.outputs[0]
    new.shape, new.type = out.shape, out.type
    out.name = "before_mul"
    new.name = "last_hidden_state"
    graph.outputs[0] = new
    report = ExportReport(export_format="onnx")
    with pytest.raises(ExportValidationError, match="last_hidden_state"):
        exporter.validate(tampered, model, inputs, OnnxConfig(dynamic=True), report)
    assert report.stages[-1].name == "validate" and report.stages[-1].status == "failed"


def test_saved_file_runs_and_matches(exported):
    _exporter, _program, model, inputs, path = exported
    got = OnnxRuntimeRunner(path)(inputs)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    assert (got["last_hidden_state"] - expected).abs().max() <= ATOL
