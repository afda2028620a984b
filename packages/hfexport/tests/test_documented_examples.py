"""The reference exporter API's documented examples, run as written.

Each test is one documented example with two changes only: the import line (``from hfexport
import ...`` / ``from hfexport.utils import ...``) and the model, a tiny seeded one from
:mod:`hfexport.testing` instead of a hub download (no network here). The assertions after each
example check what the documentation says it does.

The quickstarts need the backend packages; under ``nox -s tests(package='hfexport')`` (the core
installed alone) those tests are skipped, naming the missing package.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from hfexport.environment import installed_version
from hfexport.testing import tiny_model


def needs(package: str):
    return pytest.mark.skipif(
        installed_version(package) is None,
        reason=f"needs {package}, which this run does not install (the core's isolated run installs hfexport alone)",
    )


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _eager_logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


# --------------------------------------------------------------------------------------------------
# Quick start
# --------------------------------------------------------------------------------------------------
@needs("hfexport-dynamo")
def test_quickstart_dynamo(llama):
    from hfexport import DynamoConfig, DynamoExporter

    model, inputs = llama

    exporter = DynamoExporter()
    config = DynamoConfig(dynamic=True)
    exported = exporter.export(model, inputs, config=config)

    # run the exported graph directly
    outputs = exported.module()(**inputs)

    assert isinstance(exported, torch.export.ExportedProgram)
    torch.testing.assert_close(outputs.logits, _eager_logits(model, inputs), atol=1e-4, rtol=1e-4)


@needs("hfexport-onnx")
def test_quickstart_onnx(llama, tmp_path, monkeypatch):
    from hfexport import OnnxConfig, OnnxExporter

    monkeypatch.chdir(tmp_path)
    model, inputs = llama

    exporter = OnnxExporter()
    config = OnnxConfig(dynamic=True)
    onnx_program = exporter.export(model, inputs, config=config)

    # save and load with ONNX Runtime
    onnx_program.save("model.onnx")

    import onnxruntime as ort

    session = ort.InferenceSession("model.onnx")
    ort_inputs = {k: v.numpy() for k, v in inputs.items()}
    outputs = session.run(None, ort_inputs)

    assert (tmp_path / "model.onnx").is_file()
    expected = _eager_logits(model, inputs)
    assert outputs[0].shape == tuple(expected.shape)
    torch.testing.assert_close(torch.from_numpy(outputs[0]), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # ~3 min: XNNPACK lowering of a dynamic graph
@needs("hfexport-executorch")
def test_quickstart_executorch(llama, tmp_path, monkeypatch):
    from hfexport import ExecutorchConfig, ExecutorchExporter

    monkeypatch.chdir(tmp_path)
    model, inputs = llama

    exporter = ExecutorchExporter()
    config = ExecutorchConfig(backend="xnnpack", dynamic=True)
    et_program = exporter.export(model, inputs, config=config)

    # save for on-device deployment
    et_program.save("model.pte")

    assert (tmp_path / "model.pte").stat().st_size > 1000
    assert all(row["ok"] for row in exporter.last_report.validation["sample"])


# --------------------------------------------------------------------------------------------------
# Dynamic shapes, fine-grained
# --------------------------------------------------------------------------------------------------
@needs("hfexport-dynamo")
def test_fine_grained_dynamic_shapes(llama):
    from hfexport import DynamoConfig, DynamoExporter

    model, inputs = llama  # a padded batch of 2, as tokenizer([...], padding=True) gives

    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=1, max=2048)

    exporter = DynamoExporter()
    config = DynamoConfig(
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    exported = exporter.export(model, inputs, config=config)

    # the graph takes another batch size and sequence length without retracing
    other = {k: v[:1, :5] for k, v in inputs.items()}
    torch.testing.assert_close(
        exported.module()(**other).logits, _eager_logits(model, other), atol=1e-4, rtol=1e-4
    )
    assert "second_shape" in exporter.last_report.validation


# --------------------------------------------------------------------------------------------------
# Auto classes
# --------------------------------------------------------------------------------------------------
@needs("hfexport-onnx")
def test_auto_classes(llama):
    from hfexport import AutoExportConfig, AutoHfExporter, OnnxConfig, OnnxExporter

    model, inputs = llama

    export_config_dict = {"export_format": "onnx", "dynamic": True}
    config = AutoExportConfig.from_dict(export_config_dict)  # -> OnnxConfig
    exporter = AutoHfExporter.from_config(config)  # -> OnnxExporter

    onnx_program = exporter.export(model, inputs, config=config)

    assert type(config) is OnnxConfig and config.dynamic is True
    assert type(exporter) is OnnxExporter
    assert type(onnx_program).__name__ == "ONNXProgram"


# --------------------------------------------------------------------------------------------------
# Registries (the documented calls carry no keyword arguments)
# --------------------------------------------------------------------------------------------------
def test_register_patch_documented_form():
    from hfexport import registry
    from hfexport.utils import apply_patches, register_patch

    path = "transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeTop2Router._cast_classifier"
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    original = NllbMoeTop2Router.__dict__["_cast_classifier"]
    with registry.isolated_registry():

        @register_patch(
            "dynamo", "transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeTop2Router._cast_classifier"
        )
        def _patch_classifier_cast(_original):
            # Replace the untraceable dtype cast with a no-op during export.
            return lambda self, *args, **kwargs: None

        with apply_patches("dynamo") as applied:
            assert [e.paths for e in applied] == [(path,)]
            assert NllbMoeTop2Router._cast_classifier(object()) is None
        assert NllbMoeTop2Router.__dict__["_cast_classifier"] is original


def test_register_fx_node_fix_documented_form():
    from hfexport import registry
    from hfexport.utils import apply_fx_node_fixes, register_fx_node_fix

    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1

    gm = torch.export.export(Model(), (torch.randn(2, 3),)).module()
    with registry.isolated_registry():

        @register_fx_node_fix("onnx")
        def _fix_relu_as_clamp(gm, node):
            if node.target is not torch.ops.aten.relu.default:
                return False
            with gm.graph.inserting_before(node):
                clamp = gm.graph.call_function(torch.ops.aten.clamp.default, (node.args[0], 0.0))
            node.replace_all_uses_with(clamp)
            return True

        applied = apply_fx_node_fixes("onnx", gm)

    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.relu.default not in targets and torch.ops.aten.clamp.default in targets
    assert any("_fix_relu_as_clamp" in name for name in applied)
    x = torch.tensor([[-1.0, 0.5, 2.0], [0.0, -3.0, 1.0]])
    assert gm(x).tolist() == [[1.0, 1.5, 3.0], [1.0, 1.0, 2.0]]


def test_register_fx_program_fix_documented_form():
    from hfexport import registry
    from hfexport.utils import apply_fx_program_fixes, register_fx_program_fix

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * 2

    ep = torch.export.export(Model(), (torch.randn(2, 3),))
    with registry.isolated_registry():

        @register_fx_program_fix("executorch")
        def _fix_tag_program(exported_program):
            exported_program.graph_module.meta["fixed_by_docs_example"] = True

        applied = apply_fx_program_fixes("executorch", ep)

    assert ep.graph_module.meta["fixed_by_docs_example"] is True
    assert any("_fix_tag_program" in name for name in applied)


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------
@needs("hfexport-dynamo")
def test_decompose_then_export(llama):
    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.utils import decompose_for_generation

    model, inputs = llama
    exporter = DynamoExporter()
    config = DynamoConfig(dynamic=True)

    components = decompose_for_generation(model, inputs)
    # {"prefill": (submodel, fwd_kwargs), "decode": (...)}

    exported = {}
    for name, (submodel, subinputs) in components.items():
        eager_outputs = submodel(**subinputs)
        exported[name] = exporter.export(submodel, subinputs, config=config)

    assert list(exported) == ["prefill", "decode"]
    assert eager_outputs.logits.shape[0] == inputs["input_ids"].shape[0]
    assert all(isinstance(p, torch.export.ExportedProgram) for p in exported.values())


@needs("hfexport-dynamo")
def test_static_cache_multi_token_decode(llama):
    from transformers import GenerationConfig

    from hfexport import DynamoConfig, DynamoExporter

    model, inputs = llama
    generation_config = GenerationConfig(cache_implementation="static", max_cache_len=64)

    exporter = DynamoExporter()
    components = exporter.export_for_generation(
        model,
        inputs,
        DynamoConfig(dynamic=True),
        generation_config=generation_config,
        multi_token_decode=True,
        components=["decode"],
    )

    assert list(components) == ["decode"]
    assert components.plan.cache_kind == "static" and components.plan.max_cache_len == 64
    assert components.plan.multi_token_decode is True


def test_per_component_config_error(llama):
    from hfexport import DynamoConfig, HfExporter

    class _Exporter(HfExporter):
        config_class = DynamoConfig

        def _export(self, model, inputs, config, report):
            raise AssertionError("never reached: the config error comes first")

        def runner(self, artifact):
            raise AssertionError

        def save(self, artifact, path):
            raise AssertionError

    model, inputs = llama
    with pytest.raises(ValueError, match=r"misses \['decode'\]") as info:
        _Exporter().export_for_generation(model, inputs, {"prefill": DynamoConfig(dynamic=True)})
    assert "'prefill', 'decode'" in str(info.value)


# --------------------------------------------------------------------------------------------------
# A custom backend
# --------------------------------------------------------------------------------------------------
def test_custom_backend_skeleton(monkeypatch):
    from hfexport import auto

    monkeypatch.setattr(auto, "_EXPORTERS", dict(auto._EXPORTERS))
    monkeypatch.setattr(auto, "_CONFIGS", dict(auto._CONFIGS))

    from hfexport import (
        AutoHfExporter,
        ExportConfigMixin,
        HfExporter,
        register_export_config,
        register_exporter,
    )
    from hfexport.capture import capture
    from hfexport.utils import get_leaf_tensors

    @register_export_config("myformat")
    @dataclass
    class MyFormatConfig(ExportConfigMixin):
        export_format: str = "myformat"

    @register_exporter("myformat")
    class MyFormatExporter(HfExporter):
        def _export(self, model, inputs, config, report):
            with report.stage("capture"):
                return capture(model, inputs, config)

        def runner(self, artifact):
            module = artifact.module()
            return lambda inputs: get_leaf_tensors(module(**inputs))

        def save(self, artifact, path):
            torch.export.save(artifact, path)

    exporter = AutoHfExporter.from_config({"export_format": "myformat"})

    assert type(exporter) is MyFormatExporter and exporter.export_format == "myformat"
    assert type(exporter.config) is MyFormatConfig
    model, inputs = tiny_model("bert")
    exporter.export(model, inputs)
    rows = exporter.last_report.validation["sample"]
    assert "last_hidden_state" in [r["name"] for r in rows] and all(r["ok"] for r in rows)


# --------------------------------------------------------------------------------------------------
# Utilities
# --------------------------------------------------------------------------------------------------
def test_input_preparation(llama):
    from hfexport.errors import UnsupportedInputError
    from hfexport.utils import prepare_for_export

    model, inputs = llama
    model, prepared, flags = prepare_for_export(model, {**inputs, "use_cache": False})

    assert flags == {"use_cache": False} and "use_cache" not in prepared
    assert set(prepared) == set(inputs)
    with pytest.raises(UnsupportedInputError, match="labels"):
        prepare_for_export(model, {**inputs, "labels": inputs["input_ids"]})


def test_leaf_tensors(llama):
    from hfexport.utils import get_leaf_tensors

    model, inputs = llama
    with torch.no_grad():
        outputs = model(**inputs)
    leaves = get_leaf_tensors(outputs)

    assert next(iter(leaves)) == "logits"
    assert leaves["logits"] is outputs.logits
    # the KV cache is flattened into named leaves: <cache field>.layers.<i>.keys / .values
    (cache_field,) = {name.split(".layers.")[0] for name in leaves if ".layers." in name}
    keys = leaves[f"{cache_field}.layers.0.keys"]
    assert keys.shape[0] == 2 and keys.shape[2] == inputs["input_ids"].shape[1]
    assert all(isinstance(v, torch.Tensor) for v in leaves.values())


@needs("hfexport-executorch")
def test_cuda_refusal(llama, monkeypatch):
    from hfexport import ExecutorchConfig, ExecutorchExporter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, inputs = llama
    before = {k: v.clone() for k, v in model.state_dict().items()}

    exporter = ExecutorchExporter()
    with pytest.raises(Exception, match=r"backend='cuda' cannot be used") as info:
        exporter.export(model, inputs, config=ExecutorchConfig(backend="cuda"))

    assert "ExecutorchConfig(backend='xnnpack')" in str(info.value)
    assert next(model.parameters()).device.type == "cpu"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@needs("hfexport-dynamo")
def test_drift_warning(monkeypatch):
    from hfexport import DynamoExporter, environment

    monkeypatch.setattr(environment, "_DRIFT_WARNED", set())
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version", lambda d: "9.9.9" if d == "torch" else real(d))

    with pytest.warns(environment.VersionDriftWarning, match=r"torch 9\.9\.9 \(tested 2\.") as record:
        DynamoExporter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", environment.VersionDriftWarning)
        DynamoExporter()  # once per class per process
    assert len(record) == 1
