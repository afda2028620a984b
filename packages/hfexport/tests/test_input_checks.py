"""Bad inputs refused before capture with typed errors (issue 14 items 8, 9, 14, 15)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.export import Dim

from hfexport.atomic import atomic_path
from hfexport.auto import AutoExportConfig, AutoHfExporter
from hfexport.capture import capture, check_dynamic_shapes
from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.errors import UnsupportedInputError
from hfexport.exporter import HfExporter
from hfexport.inputs import apply_output_flags, prepare_for_export
from hfexport.tensors import get_leaf_tensors
from hfexport.testing import tiny_model


class _CoreExporter(HfExporter):
    export_format = "core-test"
    config_class = DynamoConfig
    artifact_filename = "model.txt"

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return lambda kwargs: get_leaf_tensors(artifact.module()(**kwargs))

    def save(self, artifact, path):
        with atomic_path(path) as tmp:
            tmp.write_text(str(artifact.graph_signature))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# -- item 8: an exporter takes its own config class only ------------------------------------------


@pytest.mark.parametrize(
    "config",
    [OnnxConfig(), ExecutorchConfig(backend="cuda", output_path="model.pte")],
    ids=["onnx", "executorch"],
)
def test_a_config_of_another_format_is_refused(config):
    with pytest.raises(TypeError, match=f"_CoreExporter takes a DynamoConfig, got {type(config).__name__}"):
        _CoreExporter(config)
    with pytest.raises(TypeError, match=r"use AutoHfExporter\.from_config"):
        _CoreExporter().export(torch.nn.Linear(2, 2), {"input": torch.zeros(1, 2)}, config)


def test_a_subclass_keeping_the_format_is_accepted():
    @dataclasses.dataclass
    class MyDynamoConfig(DynamoConfig):
        note: str = ""

    assert isinstance(_CoreExporter(MyDynamoConfig(note="x")).config, MyDynamoConfig)
    assert type(_CoreExporter(DynamoConfig()).config) is DynamoConfig


# -- item 9: sizes that disagree, kwargs the forward does not take --------------------------------


@pytest.mark.parametrize(
    ("mask_shape", "label", "sizes"),
    [
        ((3, 8), "text batch", "input_ids [2, 8] has 2 on axis 0, attention_mask [3, 8] has 3 on axis 0"),
        (
            (2, 5),
            "text sequence length",
            "input_ids [2, 8] has 8 on axis 1, attention_mask [2, 5] has 5 on axis 1",
        ),
    ],
)
def test_disagreeing_sizes_are_refused(llama, mask_shape, label, sizes):
    model, inputs = llama
    bad = {**inputs, "attention_mask": torch.ones(mask_shape, dtype=torch.long)}
    with pytest.raises(UnsupportedInputError) as info:
        prepare_for_export(model, bad)
    assert str(info.value).startswith(f"the sample inputs disagree on the {label}: {sizes}")
    assert "Give inputs of one" in str(info.value)


def test_unknown_kwarg_is_refused_with_the_forward_parameters(llama):
    model, inputs = llama
    with pytest.raises(UnsupportedInputError) as info:
        prepare_for_export(model, {**inputs, "foo": torch.ones(2)})
    message = str(info.value)
    assert message.startswith("the sample inputs give ['foo'], which LlamaForCausalLM.forward does not take")
    assert "'input_ids'" in message and "Remove ['foo']" in message


def test_kwargs_forward_accepts_routed_names_and_refuses_the_rest():
    inner = torch.nn.Linear(4, 4)

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = inner

        def forward(self, x, scale=1.0):
            return self.proj(x) * scale

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x, **kwargs):
            return self.inner(x, **kwargs)

    model = Outer()
    # "scale" reaches Inner.forward; "pixel_values" is a known input role; flags are known
    prepare_for_export(model, {"x": torch.zeros(2, 4), "scale": 2.0})
    with pytest.raises(UnsupportedInputError, match=r"give \['colour'\], which Outer.forward does not take"):
        prepare_for_export(model, {"x": torch.zeros(2, 4), "colour": 1})


def test_mixed_modalities_and_decode_masks_are_not_compared():
    model, inputs = tiny_model("whisper")
    prepare_for_export(model, inputs)  # audio batch vs decoder ids: different modalities
    from transformers import DynamicCache

    llama_model, _ = tiny_model("llama")
    cache = DynamicCache(config=llama_model.config)
    with torch.no_grad():
        llama_model(input_ids=torch.ones(2, 4, dtype=torch.long), past_key_values=cache)
    # a decode step: the mask covers past + new tokens
    prepare_for_export(
        llama_model,
        {
            "input_ids": torch.ones(2, 1, dtype=torch.long),
            "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "past_key_values": cache,
        },
    )


# -- item 14: plain modules, positional-only forwards, no module ----------------------------------


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x, scale: float = 1.0):
        return {"y": self.proj(x) * scale}


def test_a_plain_module_exports_and_validates():
    exporter = _CoreExporter()
    program = exporter.export(_Plain(), {"x": torch.randn(2, 4)})
    assert program.module()(x=torch.ones(2, 4))["y"].shape == (2, 3)
    assert [s.status for s in exporter.last_report.stages] == ["ok", "ok", "ok", "ok"]
    assert exporter.last_report.validation["sample"][0]["ok"] is True


def test_plain_module_has_no_flags_to_apply():
    model = _Plain()
    with apply_output_flags(model, {}):
        pass
    with (
        pytest.raises(TypeError, match="needs a model with a transformers config to apply \\['use_cache'\\]"),
        apply_output_flags(model, {"use_cache": False}),
    ):
        pass


def test_positional_only_forward_and_non_module_get_type_errors():
    class Positional(torch.nn.Module):
        def forward(self, x, /):
            return x

    class ArgsOnly(torch.nn.Module):
        def forward(self, *args):
            return args[0]

    with pytest.raises(
        TypeError, match=r"forward takes keyword arguments: Positional.forward takes positional-only"
    ):
        _CoreExporter().export(Positional(), {"x": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"ArgsOnly\.forward takes positional arguments only"):
        _CoreExporter().export(ArgsOnly(), {"x": torch.zeros(2)})
    for model in (None, lambda x: x):
        with pytest.raises(
            TypeError, match=r"export needs a torch\.nn\.Module whose forward takes keyword arguments"
        ):
            _CoreExporter().export(model, {"x": torch.zeros(2)})


def test_missing_required_parameter_is_named():
    class Two(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    with pytest.raises(UnsupportedInputError, match=r"Two.forward requires \['y'\]"):
        prepare_for_export(Two(), {"x": torch.zeros(2)})


# -- item 15: dynamic_shapes that do not fit, corrupt recipes, empty axes -------------------------

_IDS = {"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8, dtype=torch.long)}


@pytest.mark.parametrize(
    ("spec", "first_line"),
    [
        (
            {"input_ids": (None, None, None)},
            "dynamic_shapes['input_ids'] gives 3 axes, but input_ids [2, 8] has 2",
        ),
        (
            {"input_ids": {2: Dim("s")}},
            "dynamic_shapes['input_ids'] names axes [2], but input_ids [2, 8] has 2 axes",
        ),
        (
            {"input_ids": {0: Dim("batch", max=1)}},
            "dynamic_shapes['input_ids'][0] = Dim('batch') with range [0, 1] does not admit the sample size 2",
        ),
        (
            {"input_ids": {1: Dim.AUTO(min=9)}},
            "dynamic_shapes['input_ids'][1] = Dim.AUTO with range [9, None] does not admit the sample size 8",
        ),
        (
            {"input_ids": {0: 3}},
            "dynamic_shapes['input_ids'][0] = 3, but input_ids [2, 8] has size 2 on axis 0",
        ),
        ({"labels": {0: Dim("b")}}, "dynamic_shapes names ['labels'], which are not among the sample inputs"),
    ],
)
def test_dynamic_shapes_that_do_not_fit_the_sample_are_refused(spec, first_line):
    with pytest.raises(ValueError) as info:
        check_dynamic_shapes(spec, _IDS)
    assert str(info.value).startswith(first_line)


def test_dynamic_shapes_checked_before_capture(llama):
    model, inputs = llama
    exporter = _CoreExporter()
    with pytest.raises(ValueError, match=r"gives 3 axes, but input_ids \[2, 8\] has 2"):
        exporter.export(model, inputs, DynamoConfig(dynamic_shapes={"input_ids": (None, None, None)}))
    assert exporter.last_report.stages[-1].name == "capture"  # raised by the shape check, not torch


def test_empty_sequence_is_refused_before_capture(llama):
    model, _ = llama
    empty = {
        "input_ids": torch.ones(2, 0, dtype=torch.long),
        "attention_mask": torch.ones(2, 0, dtype=torch.long),
    }
    with pytest.raises(UnsupportedInputError) as info:
        prepare_for_export(model, empty)
    assert str(info.value).startswith("input_ids [2, 0] has size 0 on axis 1 (its sequence axis)")


@pytest.mark.parametrize(
    ("text", "first_line"),
    [
        (
            "{bad json",
            "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)",
        ),
        ("[1, 2]", "holds a JSON list, not an object"),
        (json.dumps({"export_format": "dynamo", "atol": -1}), "atol=-1 is invalid"),
    ],
)
def test_corrupt_export_config_names_the_file(tmp_path, text, first_line):
    recipe = tmp_path / "export_config.json"
    recipe.write_text(text, encoding="utf-8")
    for read in (
        lambda: AutoExportConfig.from_json_file(recipe),
        lambda: AutoHfExporter.from_pretrained(tmp_path),
    ):
        with pytest.raises(ValueError) as info:
            read()
        assert str(info.value).startswith(str(recipe)) and first_line in str(info.value)
    if text.startswith("{bad"):
        with pytest.raises(ValueError, match=r"export_config\.json is not valid JSON"):
            DynamoConfig.from_json_file(recipe)
