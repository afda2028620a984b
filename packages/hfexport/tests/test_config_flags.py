"""Command-line flags declared on config fields (issue 26): a third-party config gets its
``hfexport export FORMAT`` options from its field metadata, without a CLI edit."""

from __future__ import annotations

import dataclasses
from dataclasses import field

import pytest
from typer.testing import CliRunner

from hfexport import auto
from hfexport.cli import app
from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.config_flags import CLI, CliFlag, FlagError, config_from_flags, declared_flags, flag_for_field
from hfexport.testing.eager_backend import EagerModuleExporter

runner = CliRunner()
PLUGIN = "cliplugin"


@dataclasses.dataclass
class _PluginConfig(DynamoConfig):
    """A plugin's config: the dynamo fields plus one of its own, with its flag."""

    export_format: str = PLUGIN
    temperature: float = field(
        default=1.0,
        metadata={CLI: CliFlag("--temperature", "Plugin softmax temperature (cliplugin).", type="float")},
    )
    mode: str = field(
        default="fast",
        metadata={CLI: CliFlag("--mode", "Plugin mode.", choices=("fast", "exact"))},
    )

    def validate_fields(self) -> None:
        super().validate_fields()
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid; allowed: a positive float")


class _PluginExporter(EagerModuleExporter):
    export_format = PLUGIN
    config_class = _PluginConfig


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.setitem(auto._EXPORTERS, PLUGIN, _PluginExporter)
    monkeypatch.setitem(auto._CONFIGS, PLUGIN, _PluginConfig)


def _text(output: str) -> str:
    for ch in "│╭╮╰╯─":
        output = output.replace(ch, " ")
    return " ".join(output.split())


def _stop_at_config(monkeypatch) -> list:
    """Make ``AutoHfExporter.from_config`` record the config and stop the export."""
    seen: list = []

    def capture(config):
        seen.append(config)
        raise RuntimeError("stop after the config")

    monkeypatch.setattr(auto.AutoHfExporter, "from_config", staticmethod(capture))
    return seen


def test_a_plugin_configs_flag_is_in_its_formats_help_only(plugin):
    result = runner.invoke(app, ["export", PLUGIN, "--help"], env={"COLUMNS": "240", "NO_COLOR": "1"})
    text = _text(result.output)
    assert result.exit_code == 0, result.output
    assert "--temperature <float> Plugin softmax temperature (cliplugin)." in text
    assert "--mode <fast|exact> Plugin mode." in text
    assert "cliplugin options" in text  # its own help section
    assert "--atol" in text and "--static" in text  # the inherited fields' flags
    # its exporter declares no quantization method: --quantize and its options are not offered
    assert "--quantize" not in text and "--group-size" not in text
    # dynamo's --aoti is for the dynamo format only; onnx's and executorch's flags are not shown
    for other in ("--aoti", "--opset", "--backend", "--ort-fusions"):
        assert other not in text, other
    onnx = _text(runner.invoke(app, ["export", "onnx", "--help"], env={"COLUMNS": "240"}).output)
    assert "--temperature" not in onnx and "--opset" in onnx and "--aoti" not in onnx


def test_a_plugin_configs_flag_reaches_its_config(plugin, tmp_path, monkeypatch):
    seen = _stop_at_config(monkeypatch)
    args = ["export", PLUGIN, str(tmp_path / "out"), "--model", "tiny:bert", "--temperature", "0.25"]
    result = runner.invoke(app, [*args, "--mode", "exact", "--static"])
    assert result.exit_code == 1 and "stop after the config" in _text(result.output), result.output
    (config,) = seen
    assert type(config) is _PluginConfig
    assert (config.temperature, config.mode, config.dynamic, config.export_format) == (
        0.25,
        "exact",
        False,
        PLUGIN,
    )

    seen.clear()  # not given: the config's defaults; the CLI's default of dynamic shapes
    result = runner.invoke(app, ["export", PLUGIN, str(tmp_path / "out"), "--model", "tiny:bert"])
    assert result.exit_code == 1, result.output
    assert (seen[0].temperature, seen[0].mode, seen[0].dynamic) == (1.0, "fast", True)


def test_a_plugin_flags_bad_value_is_a_usage_error_named_after_the_flag(plugin, tmp_path):
    args = ["export", PLUGIN, str(tmp_path / "out"), "--model", "tiny:bert"]
    result = runner.invoke(app, [*args, "--temperature", "-1"], env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert "Invalid value for --temperature: temperature=-1.0 is invalid; allowed: a positive float" in _text(
        result.output
    )
    result = runner.invoke(app, [*args, "--mode", "slow"], env={"COLUMNS": "240"})
    assert result.exit_code == 2 and "'slow' is not one of 'fast', 'exact'" in _text(result.output)
    # another format's config has no such field: refused, not ignored
    onnx = ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:bert", "--temperature", "2"]
    result = runner.invoke(app, onnx, env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert (
        "Invalid value for --temperature: --temperature is not an option of the onnx format (OnnxConfig has "
        "no field 'temperature'); `hfexport export onnx --help` lists its options"
    ) in _text(result.output)
    assert not (tmp_path / "out").exists()


def test_a_plugin_format_refuses_aoti_as_before(plugin, tmp_path):
    """``--aoti`` is declared for the dynamo format only: a DynamoConfig subclass of another
    format accepts the field but refuses the flag with the dynamo message."""
    args = ["export", PLUGIN, str(tmp_path / "out"), "--model", "tiny:bert", "--aoti"]
    result = runner.invoke(app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 2
    assert "Invalid value: --aoti applies to the dynamo format, not cliplugin" in _text(result.output)


def test_declared_flags_follow_field_order_with_the_quantization_group():
    flags = declared_flags(OnnxConfig)
    assert [d.cli.flag for d in flags] == [
        "--static",
        "--no-validate",
        "--atol",
        "--rtol",
        "--dtype",
        "--quantize",
        "--group-size",
        "--embedding-bits",
        "--per-tensor",
        "--quantize-exclude",
        "--calibration",
        "--calibration-samples",
        "--asymmetric",
        "--accuracy-level",
        "--gate",
        "--opset",
        "--no-optimize",
        "--ort-fusions",
    ]
    by_flag = {d.cli.flag: d for d in flags}
    assert by_flag["--group-size"].path == "quantization.group_size"
    assert by_flag["--group-size"].parent is by_flag["--quantize"].cli
    assert by_flag["--opset"].owner is OnnxConfig and by_flag["--atol"].owner.__name__ == "CaptureConfig"
    assert flag_for_field(flags, "quantization.method") == "--quantize"
    assert flag_for_field(flags, "quantization.per_channel") == "--per-tensor"
    assert flag_for_field(flags, "external_data") is None
    assert [d.cli.flag for d in declared_flags(ExecutorchConfig)][-4:] == [
        "--backend",
        "--max-dynamic-bytes",
        "--no-custom-ops",
        "--kv-cache-dtype",
    ]


def test_config_from_flags_maps_switches_groups_and_parsers(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n", encoding="utf-8")
    given = {
        "--static": True,
        "--no-optimize": True,
        "--quantize": "int8-static",
        "--per-tensor": True,
        "--calibration": prompts,
        "--quantize-exclude": ["lm_head"],
        "--gate": ["cosine=0.9"],
        "--embedding-bits": None,
    }
    config = config_from_flags(OnnxConfig, "onnx", given)
    assert (config.dynamic, config.optimize, config.quality_gates) == (False, False, {"cosine": 0.9})
    assert config.quantization.to_dict() == {
        "method": "int8-static",
        "group_size": None,
        "embedding_bits": None,
        "per_channel": False,
        "exclude": ["lm_head"],
        "calibration": str(prompts),
        "num_calibration_samples": 32,
        "symmetric": None,
        "accuracy_level": None,
    }
    assert config_from_flags(OnnxConfig, "onnx", {}).dynamic is True  # the command line's default


@pytest.mark.parametrize(
    ("cls", "fmt", "given", "message", "flag"),
    [
        (DynamoConfig, "dynamo", {"--opset": 18}, "--opset applies to onnx, not dynamo", None),
        (
            DynamoConfig,
            "dynamo",
            {"--ort-fusions": "cpu"},
            "--ort-fusions applies to onnx, not dynamo",
            "--ort-fusions",
        ),
        (
            ExecutorchConfig,
            "executorch",
            {"--group-size": 32, "--per-tensor": True},
            "--group-size, --per-tensor apply to a quantization; add --quantize METHOD",
            "--quantize",
        ),
        (
            OnnxConfig,
            "onnx",
            {"--gate": ["cosine"]},
            "'cosine' is not METRIC=THRESHOLD; allowed metrics: cosine",
            "--gate",
        ),
        (OnnxConfig, "onnx", {"--atol": -1.0}, "atol=-1.0 is invalid", "--atol"),
        (
            OnnxConfig,
            "onnx",
            {"--quantize": "int8-static", "--calibration-samples": 0},
            "quantization.num_calibration_samples=0 is invalid",
            "--calibration-samples",
        ),
    ],
)
def test_config_from_flags_errors_name_the_flag(cls, fmt, given, message, flag):
    known = [d for c in (DynamoConfig, OnnxConfig, ExecutorchConfig) for d in declared_flags(c)]
    with pytest.raises(FlagError) as info:
        config_from_flags(cls, fmt, given, known)
    assert str(info.value).startswith(message)
    assert info.value.flag == flag


def test_no_optimize_is_ignored_where_there_is_no_optimizer():
    known = declared_flags(OnnxConfig)
    assert config_from_flags(DynamoConfig, "dynamo", {"--no-optimize": True}, known).to_dict() == (
        DynamoConfig(dynamic=True).to_dict()
    )


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="flag='group-size' is invalid; allowed: '--kebab-case'"):
        CliFlag("group-size", "help")
    with pytest.raises(ValueError, match="type='bool' is invalid; allowed: str, int, float, Path"):
        CliFlag("--x", "help", type="bool")

    @dataclasses.dataclass
    class Twice(DynamoConfig):
        export_format: str = "twice"
        a: int = field(default=0, metadata={CLI: CliFlag("--atol", "again", type="int")})

    with pytest.raises(ValueError, match="fields 'atol' and 'a' both declare --atol"):
        declared_flags(Twice)

    @dataclasses.dataclass
    class NotAFlag(DynamoConfig):
        export_format: str = "notaflag"
        b: int = field(default=0, metadata={CLI: "--b"})

    with pytest.raises(TypeError, match="metadata\\['cli'\\] is str"):
        declared_flags(NotAFlag)


@pytest.mark.parametrize(
    ("args", "found"),
    [
        (["onnx", "out"], "onnx"),
        (["--model", "tiny:bert", "--quantize", "8da4w", "executorch", "out"], "executorch"),
        (["--model=tiny:bert", "-v", "--static", "dynamo", "out"], "dynamo"),
        (["--gate", "cosine=0.9", "--gate", "top1_agreement=0.8", "onnx"], "onnx"),
        (["--model", "tiny:bert", "--", "onnx", "out"], "onnx"),
        (["--help"], None),
    ],
)
def test_the_format_is_found_before_click_parses(args, found):
    """FORMAT decides which options exist, so it is read first, skipping the values of options."""
    from hfexport import cli

    command = cli.typer.main.get_command(app).commands["export"]
    assert cli._format_argument(args, command.params, cli._ExportFlags(None)) == found


def test_help_after_options_is_the_formats(tmp_path):
    args = ["export", "--model", "tiny:bert", "executorch", "--help"]
    text = _text(runner.invoke(app, args, env={"COLUMNS": "240"}).output)
    assert "executorch options" in text and "--backend" in text
    assert "--opset" not in text and "--aoti" not in text


def test_a_plugin_flag_named_like_an_export_option_is_refused(monkeypatch, tmp_path):
    @dataclasses.dataclass
    class Clash(DynamoConfig):
        export_format: str = "clash"
        source: str = field(default="", metadata={CLI: CliFlag("--model", "clashes with export's own")})

    monkeypatch.setitem(auto._CONFIGS, "clash", Clash)
    result = runner.invoke(
        app, ["export", "clash", str(tmp_path / "o"), "--model", "tiny:bert"], env={"COLUMNS": "240"}
    )
    assert result.exit_code == 2, result.output
    assert "Clash.source declares --model, an option of `hfexport export` itself" in _text(result.output)
    # other formats are not affected: the clashing flag is left out of theirs
    result = runner.invoke(app, ["export", "dynamo", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0 and "clashes with export's own" not in _text(result.output)


def test_a_formats_help_names_its_own_quantization_methods_and_the_options_they_read():
    """`export dynamo --help` listed every format's methods and options no dynamo method reads."""
    dynamo = _text(runner.invoke(app, ["export", "dynamo", "--help"], env={"COLUMNS": "240"}).output)
    assert "Quantization method of the dynamo format: int8-weight (`hfexport env`" in dynamo
    assert "int4-weight" not in dynamo and "8da4w" not in dynamo
    for unread in ("--group-size", "--embedding-bits", "--calibration", "--accuracy-level", "--asymmetric"):
        assert unread not in dynamo, unread
    assert "--quantize-exclude" in dynamo
    onnx = _text(runner.invoke(app, ["export", "onnx", "--help"], env={"COLUMNS": "240"}).output)
    assert (
        "Quantization method of the onnx format: int8-dynamic, int8-static, int4-weight, int8-weight ("
        in onnx
    )
    assert "--accuracy-level" in onnx and "--calibration" in onnx and "--group-size" in onnx
    # a hidden option is still parsed: it is refused by the method's own message, not "No such option"
    result = runner.invoke(
        app,
        [
            "export",
            "dynamo",
            "/tmp/never-written",
            "--model",
            "tiny:bert",
            "--quantize",
            "int8-weight",
            "--group-size",
            "32",
        ],
        env={"COLUMNS": "240"},
    )
    assert result.exit_code == 2 and "No such option" not in result.output, result.output
    assert "group_size" in _text(result.output)


def test_max_dynamic_bytes_has_a_flag_taking_byte_sizes():
    # the memory budget's remedy (a larger ExecutorchConfig.max_dynamic_bytes) had no command-line form
    for text, size in (
        ("4GiB", 4 * 2**30),
        ("512mib", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1073741824", 2**30),
    ):
        config = config_from_flags(ExecutorchConfig, "executorch", {"--max-dynamic-bytes": text})
        assert config.max_dynamic_bytes == size, text
    assert config_from_flags(ExecutorchConfig, "executorch", {}).max_dynamic_bytes is None
    known = [d for c in (DynamoConfig, ExecutorchConfig) for d in declared_flags(c)]
    for bad in ("4 lots", "0", "-1GiB", "GiB"):
        with pytest.raises(
            FlagError, match=r"is not a positive byte size; allowed: a number of bytes"
        ) as info:
            config_from_flags(ExecutorchConfig, "executorch", {"--max-dynamic-bytes": bad}, known)
        assert info.value.flag == "--max-dynamic-bytes"
    with pytest.raises(FlagError, match="--max-dynamic-bytes applies to executorch, not dynamo"):
        config_from_flags(DynamoConfig, "dynamo", {"--max-dynamic-bytes": "4GiB"}, known)
