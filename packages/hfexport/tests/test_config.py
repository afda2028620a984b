"""Config dataclasses: defaults, validation errors, dict/JSON round trips (Dim included)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from torch.export import Dim

from hfexport.auto import AutoExportConfig
from hfexport.config import DynamoConfig, ExecutorchConfig, ExportFormat, OnnxConfig, OpenvinoConfig


def test_defaults_match_the_documented_ones():
    c = DynamoConfig()
    assert (c.export_format, c.dynamic, c.strict, c.dynamic_shapes) == ("dynamo", False, False, None)
    assert c.prefer_deferred_runtime_asserts_over_guards is False
    o = OnnxConfig()
    assert (o.export_format, o.output_path, o.opset_version, o.external_data, o.optimize) == (
        "onnx",
        None,
        None,
        True,
        True,
    )
    assert (o.export_params, o.keep_initializers_as_inputs) == (True, False)
    e = ExecutorchConfig()
    assert (
        e.export_format,
        e.backend,
        e.alloc_graph_input,
        e.alloc_graph_output,
        e.alloc_mutable_buffers,
    ) == ("executorch", "xnnpack", True, True, True)


def test_round_trip_with_dims_keeps_name_min_max():
    batch = Dim("batch", min=1, max=32)
    config = OnnxConfig(
        dynamic_shapes={
            "input_ids": {0: batch, 1: Dim("seq", min=1, max=2048)},
            "attention_mask": {0: batch, 1: Dim.AUTO},
        },
        opset_version=20,
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    text = config.to_json_string()
    data = json.loads(text)
    assert data["dynamic_shapes"]["input_ids"]["__int_keys__"][0] == [
        0,
        {"__dim__": {"name": "batch", "min": 1, "max": 32}},
    ]
    back = AutoExportConfig.from_dict(data)
    assert isinstance(back, OnnxConfig)
    dims = back.dynamic_shapes["input_ids"]
    assert (dims[0].__name__, dims[0].min, dims[0].max) == ("batch", 1, 32)
    assert (dims[1].__name__, dims[1].min, dims[1].max) == ("seq", 1, 2048)
    assert back.dynamic_shapes["attention_mask"][1] == Dim.AUTO
    assert back.to_dict() == config.to_dict()


def test_unbounded_dim_round_trips_to_unbounded(tmp_path):
    config = DynamoConfig(dynamic_shapes={"x": (Dim("n"), None)})
    path = tmp_path / "export_config.json"
    config.to_json_file(path)
    back = DynamoConfig.from_json_file(path)
    (n, none) = back.dynamic_shapes["x"]
    assert none is None and n.__name__ == "n" and n.min == 0
    assert json.loads(path.read_text())["dynamic_shapes"]["x"]["__tuple__"][0]["__dim__"]["max"] is None


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (DynamoConfig, {"dynamic": "yes"}, "dynamic"),
        (DynamoConfig, {"atol": -1.0}, "atol"),
        (DynamoConfig, {"dynamic_shapes": 3}, "dynamic_shapes"),
        (OnnxConfig, {"opset_version": 11}, "opset_version"),
        (ExecutorchConfig, {"backend": "vulkan"}, "backend"),
        (ExecutorchConfig, {"max_dynamic_bytes": 0}, "max_dynamic_bytes"),
    ],
)
def test_invalid_values_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        cls(**kwargs)
    assert "allowed" in str(info.value)


def test_unknown_key_lists_known_fields():
    with pytest.raises(ValueError, match=r"unknown OnnxConfig field\(s\) \['opset'\]"):
        OnnxConfig.from_dict({"opset": 18})


def test_auto_config_dispatch_and_errors():
    assert isinstance(AutoExportConfig.from_dict({"export_format": "executorch"}), ExecutorchConfig)
    assert isinstance(AutoExportConfig.from_dict({"export_format": ExportFormat.ONNX}), OnnxConfig)
    with pytest.raises(ValueError, match="export_format is missing"):
        AutoExportConfig.from_dict({"dynamic": True})
    with pytest.raises(ValueError, match="'tflite' is not known"):
        AutoExportConfig.from_dict({"export_format": "tflite"})
    with pytest.raises(ValueError, match="has export_format='onnx', got 'dynamo'"):
        OnnxConfig(export_format="dynamo")


def test_precision_fields_round_trip_and_refuse_bad_values():
    from hfexport.config import OnnxConfig, QuantizationConfig

    config = OnnxConfig(
        dtype="float16", quantization="int8-dynamic", ort_fusions="cpu", quality_gates={"cosine": 0.98}
    )
    assert config.quantization == QuantizationConfig(method="int8-dynamic")
    assert OnnxConfig.from_json_string(config.to_json_string()) == config
    for bad, message in [
        ({"dtype": "fp16"}, "dtype='fp16' is invalid; allowed: None (auto), float32, float16, bfloat16"),
        ({"quantization": {"method": "x", "bits": 3}}, "unknown quantization field(s) ['bits']"),
        ({"quantization": {"method": "8da4w", "group_size": 0}}, "quantization.group_size=0 is invalid"),
        ({"quantization": {"method": "8da4w", "embedding_bits": 2}}, "embedding_bits=2 is invalid"),
        ({"ort_fusions": "npu"}, "ort_fusions='npu' is invalid; allowed: None, 'cpu', 'cuda'"),
        ({"quality_gates": {"cosine": float("nan")}}, "quality_gates['cosine']=nan is invalid"),
    ]:
        with pytest.raises(ValueError) as info:
            OnnxConfig(**bad)
        assert message in str(info.value)


def test_quantization_method_declares_the_options_it_reads_and_the_config_checks_them():
    from hfexport.config import QUANTIZATION_OPTIONS, QuantizationConfig, QuantizationMethod

    grouped = QuantizationMethod(
        "4-bit", options={"group_size", "exclude"}, options_if={"per_channel": ("embedding_bits", 8)}
    )
    dynamic = QuantizationMethod(
        "int8", options={"per_channel", "embedding_bits"}, options_if={"group_size": ("embedding_bits", 4)}
    )
    methods = {"g4": grouped, "d8": dynamic, "legacy": "a plain description declares no options"}
    assert grouped.options == frozenset({"group_size", "exclude"}) and str(grouped) == "4-bit"
    assert grouped.describe_options() == "group_size, exclude, per_channel (with embedding_bits=8)"
    assert QuantizationMethod("bare").describe_options() == "none"
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['bits'\]; allowed: " + ", ".join(QUANTIZATION_OPTIONS)
    ):
        QuantizationMethod("x", options={"bits"})

    # phase and apply: declared together, a known phase, prepare only before a later phase
    with pytest.raises(ValueError, match="phase='compile' is invalid; allowed: source, program, artifact"):
        QuantizationMethod("x", phase="compile", apply=print)
    with pytest.raises(ValueError, match="needs phase and apply together"):
        QuantizationMethod("x", phase="source")
    with pytest.raises(ValueError, match="needs phase and apply together"):
        QuantizationMethod("x", apply="pkg.mod:fn")
    with pytest.raises(ValueError, match="give the source function as apply="):
        QuantizationMethod("x", phase="source", apply=print, prepare=print)
    with pytest.raises(ValueError, match="stage='' is invalid"):
        QuantizationMethod("x", phase="program", apply=print, stage="")
    lazy = QuantizationMethod("x", phase="program", apply="json:dumps", prepare="json:loads")
    import json

    assert lazy.resolve_apply() is json.dumps and lazy.source_function() is json.loads
    assert QuantizationMethod("x", phase="source", apply="json:dumps").source_function() is json.dumps
    assert QuantizationMethod("x", phase="artifact", apply=print).source_function() is None
    assert QuantizationMethod("bare").resolve_apply() is None and lazy.stage == "quantize"

    # given = set away from the default, in QUANTIZATION_OPTIONS order
    assert QuantizationConfig("d8").given_options() == []
    config = QuantizationConfig("d8", per_channel=False, calibration="p.txt", num_calibration_samples=4)
    assert config.given_options() == ["per_channel", "calibration", "num_calibration_samples"]

    QuantizationConfig("g4", group_size=64, exclude=("lm_head",)).check_options(methods, "toy")
    QuantizationConfig("d8", embedding_bits=4, group_size=64).check_options(
        methods, "toy"
    )  # 4-bit embeddings
    QuantizationConfig("legacy", group_size=8, calibration="p.txt").check_options(
        methods, "toy"
    )  # not declared
    QuantizationConfig("unknown", group_size=8).check_options(methods, "toy")  # the exporter refuses the name
    with pytest.raises(ValueError) as info:
        QuantizationConfig("d8", embedding_bits=8, group_size=64).check_options(methods, "toy")
    assert str(info.value) == (
        "quantization.group_size=64 is not read by the toy quantization method 'd8' and would be ignored; "
        "allowed with 'd8': embedding_bits, per_channel, group_size (with embedding_bits=4) (group_size is read "
        "by: g4); drop it or choose a method that reads it"
    )
    with pytest.raises(
        ValueError, match=r"^quantization\.calibration='p\.txt' .*\(no other toy method reads calibration\)"
    ):
        QuantizationConfig("g4", calibration="p.txt").check_options(methods, "toy")


def test_quality_gates_apply_only_where_quality_gates_validate():
    for gated in (
        DynamoConfig(dtype="bfloat16", quality_gates={"cosine": 0.98}),
        ExecutorchConfig(quantization="8da4w", quality_gates={"top1_agreement": 0.8}),
        OnnxConfig(quality_gates={}),  # nothing overridden: harmless
    ):
        assert AutoExportConfig.from_dict(gated.to_dict()) == gated
    with pytest.raises(
        ValueError, match=r"^quality_gates=\{'cosine': 0\.98\} cannot apply: .*allowed: quality_gates=None, "
    ):
        OnnxConfig(ort_fusions="cpu", dtype="float32", quality_gates={"cosine": 0.98})
    with pytest.raises(ValueError, match="cannot apply"):  # a recipe file refuses it as well
        AutoExportConfig.from_dict(
            {"export_format": "dynamo", "dtype": "float32", "quality_gates": {"cosine": 0.98}}
        )
    # dtype auto: whether gates apply depends on the model, so the export decides (before capture)
    assert DynamoConfig(quality_gates={"cosine": 0.98}).dtype is None
    with pytest.raises(ValueError, match="cannot apply"):
        DynamoConfig(dtype="float16", quality_gates={"cosine": 0.9}).replace(dtype="float32")


def test_exporter_refuses_dtype_and_method_it_does_not_have_before_capture():
    import torch

    from hfexport.config import DynamoConfig
    from hfexport.exporter import HfExporter

    class Minimal(HfExporter):
        export_format = "dynamo"
        config_class = DynamoConfig

        def _export(self, model, inputs, config, report):  # pragma: no cover - never reached
            raise AssertionError("capture must not start")

        def runner(self, artifact):  # pragma: no cover
            raise NotImplementedError

        def save(self, artifact, path):  # pragma: no cover
            raise NotImplementedError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"dtype='bfloat16' is not supported by the dynamo backend here; allowed: float32"
    ):
        Minimal().export(model, {"input": torch.ones(1, 2)}, DynamoConfig(dtype="bfloat16"))
    with pytest.raises(
        ValueError, match=r"quantization method '8da4w' .* allowed: none \(this backend does not quantize\)"
    ):
        Minimal().export(model, {"input": torch.ones(1, 2)}, DynamoConfig(quantization="8da4w"))


def test_aoti_is_a_dynamo_option_only():
    assert DynamoConfig(aoti=True).aoti is True
    with pytest.raises(TypeError, match="unexpected keyword argument 'aoti'"):
        OnnxConfig(aoti=True)
    # a recipe of hfexport 0.x, when OnnxConfig inherited aoti=False from DynamoConfig, still reads
    old = OnnxConfig(dynamic=True).to_dict() | {"aoti": False}
    assert OnnxConfig.from_dict(old) == OnnxConfig(dynamic=True)
    assert AutoExportConfig.from_dict(old) == OnnxConfig(dynamic=True)
    with pytest.raises(ValueError, match="aoti=True applies to the dynamo format only, not onnx"):
        OnnxConfig.from_dict(old | {"aoti": True})


def test_backend_configs_share_the_capture_config_and_only_dynamo_has_aoti():
    from hfexport import CaptureConfig

    shared = {f.name for f in dataclasses.fields(CaptureConfig)}
    assert {
        "dynamic",
        "dynamic_shapes",
        "strict",
        "validate",
        "atol",
        "rtol",
        "dtype",
        "quantization",
    } <= shared
    assert "aoti" not in shared
    for cls in (OnnxConfig, ExecutorchConfig, OpenvinoConfig):
        assert cls.__mro__[1] is CaptureConfig, cls
        assert not issubclass(cls, DynamoConfig), cls
        assert "aoti" not in cls().to_dict(), cls
    assert issubclass(DynamoConfig, CaptureConfig) and DynamoConfig().to_dict()["aoti"] is False
    assert CaptureConfig.declared_format() is None


def test_one_task_table_feeds_checkpoints_the_zoo_and_the_cli():
    from hfexport import checkpoints, cli, tasks
    from hfexport.testing import zoo

    assert checkpoints.TASK_AUTO_CLASSES is tasks.TASK_AUTO_CLASSES
    assert cli.GENERATION_TASKS is tasks.GENERATION_TASKS
    assert set(tasks.GENERATION_TASKS) <= set(tasks.TASK_AUTO_CLASSES)
    assert {t: tasks.TASK_AUTO_CLASSES[t] for t in zoo.TASK_TO_AUTO_CLASS} == zoo.TASK_TO_AUTO_CLASS
    assert {task for _, task in tasks.ARCHITECTURE_SUFFIX_TASKS} <= set(tasks.TASK_AUTO_CLASSES)
    assert tasks.auto_class_name("token-classification") == "AutoModelForTokenClassification"
    with pytest.raises(ValueError, match=r"unknown task 'translate'; allowed: auto, feature-extraction, "):
        tasks.auto_class_name("translate")
