"""docs/extending.md runs as written: a third-party backend, a quantization method and a workaround.

The backend package is the one the page shows (the blocks marked ``<!-- example-file: PATH -->``):
the test writes it into ``tmp_path``, builds its wheel with setuptools (no network: no build
isolation), installs the wheel with pip into a fresh venv, and there exports through
``AutoHfExporter.from_config``, ``hfexport export myformat`` and ``hfexport env``. torch,
transformers and hfexport itself come from the running environment through a ``.pth`` file (the
core is not rebuilt: its build backend, hatchling, is not needed at test time), so only the
plugin is installed; it imports nothing from hfexport's own backends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest
import torch

import hfexport

DOC = Path(__file__).resolve().parents[3] / "docs" / "extending.md"
_BLOCK = re.compile(r"<!-- (example-file|example): (\S+) -->\n```[a-z]*\n(.*?)\n```", re.S)


def doc_examples() -> tuple[dict[str, str], dict[str, str]]:
    """``({relative_path: text}, {example_name: python source})`` of the marked blocks."""
    files: dict[str, str] = {}
    examples: dict[str, str] = {}
    for kind, name, body in _BLOCK.findall(DOC.read_text(encoding="utf-8")):
        (files if kind == "example-file" else examples)[name] = body + "\n"
    return files, examples


def test_doc_has_the_examples_the_tests_run():
    files, examples = doc_examples()
    assert set(files) == {"pyproject.toml", "src/hfexport_myformat/__init__.py"}
    assert set(examples) == {"backend-usage", "workaround", "quantization-method"}
    assert '[project.entry-points."hfexport.exporters"]' in files["pyproject.toml"]
    # the plugin is built on the core only
    assert not re.search(r"hfexport_(dynamo|onnx|executorch)", files["src/hfexport_myformat/__init__.py"])


def _module_from(source: str, name: str, monkeypatch) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def test_workaround_example_runs_and_is_listed(monkeypatch, capsys):
    from hfexport import registry

    _, examples = doc_examples()
    with registry.isolated_registry():
        _module_from(examples["workaround"], "docs_extending_workaround", monkeypatch)
        (entry,) = registry.entries("myformat")
        assert entry.kind == "patch"
        assert entry.paths == ("docs_extending_workaround.Scaler.factor",)
        assert entry.unresolved == ()
        assert entry.versions == {"torch": ">=2.0"}
        assert entry.issue.startswith("https://github.com/pytorch/pytorch/issues/")
    assert capsys.readouterr().out.split() == [entry.issue, "{'torch':", "'>=2.0'}", "True"]
    with registry.isolated_registry():
        assert registry.entries("myformat") == []  # isolated: nothing leaked


def test_quantization_method_example_is_one_function_plus_one_registration(monkeypatch, capsys):
    """The page's method, registered for dynamo, runs in the shared capture step's ``quantize``
    stage: the captured program holds weights on the int8 grid, the model keeps its own, the
    facts land in ``report.quantization``; the registration is gone after the isolated block."""
    pytest.importorskip("hfexport_dynamo", reason="the example registers its method for the dynamo backend")
    from hfexport.quantization import isolated_quantization_methods, registered_quantization_methods
    from hfexport_dynamo import DynamoExporter

    _, examples = doc_examples()
    with isolated_quantization_methods():
        module = _module_from(examples["quantization-method"], "docs_extending_quantization", monkeypatch)
        assert set(registered_quantization_methods("dynamo")) == {"int8-grid"}
        assert DynamoExporter.quantization_methods["int8-grid"].phase == "source"
        model, exporter, program = module.model, module.exporter, module.program
        report = exporter.last_report
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        rounded = [n for n in linears if not n.startswith("pooler.")]
        assert len(rounded) == len(linears) - 1 > 0
        assert report.quantization["method"] == "int8-grid"
        assert report.quantization["rounded_linear"] == len(rounded)
        assert report.quantization["weight_bytes_before"] > 0
        assert report.applied["quantize"] == ["int8-grid"]
        names = [s.name for s in report.stages]
        assert names.index("patches") < names.index("quantize") < names.index("capture")
        assert (
            next(s for s in report.stages if s.name == "quantize").detail
            == f"{len(rounded)} linear module(s)"
        )
        assert capsys.readouterr().out.split() == ["int8-grid", str(len(rounded))]
        # the program's weights are on the grid (and differ from the model's), the model's are not
        state = program.state_dict
        for name in rounded:
            eager = model.get_submodule(name).weight.detach()
            captured = state[f"{name}.weight"]
            scale = eager.abs().amax(dim=1, keepdim=True) / 127
            steps = captured / scale
            assert torch.allclose(steps, steps.round(), atol=1e-3), name
            assert not torch.equal(captured, eager), name
        pooler = model.get_submodule("pooler.dense").weight.detach()
        assert torch.equal(state["pooler.dense.weight"], pooler)  # excluded: left float
        assert all(row["ok"] for row in report.validation["sample"]) and report.quality_gates
    assert registered_quantization_methods("dynamo") == {}
    assert "int8-grid" not in DynamoExporter.quantization_methods


@pytest.fixture
def in_process_plugin(monkeypatch):
    """The page's backend module, registered by decorator (no package, no entry point)."""
    from hfexport import auto

    files, _ = doc_examples()
    monkeypatch.setattr(auto, "_EXPORTERS", dict(auto._EXPORTERS))
    monkeypatch.setattr(auto, "_CONFIGS", dict(auto._CONFIGS))
    module = _module_from(files["src/hfexport_myformat/__init__.py"], "hfexport_myformat", monkeypatch)
    auto.register_export_config("myformat")(module.MyFormatConfig)
    auto.register_exporter("myformat")(module.MyFormatExporter)
    return module


def test_decorator_registered_format_works_through_auto_classes(in_process_plugin):
    from hfexport import AutoExportConfig, AutoHfExporter, available_export_formats, get_hf_exporter

    plugin = in_process_plugin
    assert "myformat" in available_export_formats()
    config = AutoExportConfig.from_dict({"export_format": "myformat", "comment": "hi", "dynamic": True})
    assert type(config) is plugin.MyFormatConfig and config.comment == "hi" and config.dynamic is True
    assert plugin.MyFormatConfig().export_format == "myformat"
    assert type(AutoHfExporter.from_config(config)) is plugin.MyFormatExporter
    assert get_hf_exporter("myformat") is plugin.MyFormatExporter
    assert AutoExportConfig.from_dict(json.loads(config.to_json_string())) == config
    with pytest.raises(ValueError, match="has export_format='myformat', got 'onnx'"):
        plugin.MyFormatConfig(export_format="onnx")
    with pytest.raises(ValueError, match=r"unknown MyFormatConfig field\(s\) \['opset'\]"):
        AutoExportConfig.from_dict({"export_format": "myformat", "opset": 18})


def test_unknown_format_lists_the_available_ones(in_process_plugin):
    from hfexport import AutoExportConfig, AutoHfExporter, get_hf_exporter
    from hfexport.errors import MissingBackendError

    with pytest.raises(ValueError, match="'tflite' is not known; available: ") as info:
        AutoExportConfig.from_dict({"export_format": "tflite"})
    assert "myformat" in str(info.value) and "dynamo" in str(info.value)
    with pytest.raises(MissingBackendError, match="no exporter for export_format='tflite'") as info:
        get_hf_exporter("tflite")
    assert "myformat" in str(info.value)
    with pytest.raises(ValueError, match="export_format is missing"):
        AutoHfExporter.from_config({"comment": "x"})


def test_unknown_format_error_names_the_package_of_a_missing_builtin(in_process_plugin, monkeypatch):
    from hfexport import auto

    monkeypatch.setattr(auto, "_entry_points", lambda: {})  # no backend package installed
    monkeypatch.setattr(auto, "_EXPORTERS", {"myformat": in_process_plugin.MyFormatExporter})
    with pytest.raises(ValueError) as info:
        auto.AutoExportConfig.from_dict({"export_format": "tflite"})
    assert str(info.value) == (
        "export_format='tflite' is not known; available: myformat, dynamo (pip install hfexport-dynamo), "
        "onnx (pip install hfexport-onnx), executorch (pip install hfexport-executorch), "
        "openvino (pip install hfexport-openvino)"
    )


def test_config_registered_without_an_exporter_says_so(monkeypatch):
    from dataclasses import dataclass

    from hfexport import auto
    from hfexport.config import ExportConfigMixin
    from hfexport.errors import MissingBackendError

    monkeypatch.setattr(auto, "_CONFIGS", dict(auto._CONFIGS))

    @auto.register_export_config("halfway")
    @dataclass
    class HalfwayConfig(ExportConfigMixin):
        level: int = 1

    assert HalfwayConfig().export_format == "halfway"  # the decorator named the format
    config = auto.AutoExportConfig.from_dict({"export_format": "halfway", "level": 2})
    assert type(config) is HalfwayConfig and config.level == 2
    with pytest.raises(MissingBackendError, match="no exporter for export_format='halfway'"):
        auto.AutoHfExporter.from_config(config)
    with pytest.raises(ValueError, match="declares export_format='halfway'"):
        auto.register_export_config("other")(HalfwayConfig)


def test_cli_exports_a_decorator_registered_format(in_process_plugin, tmp_path):
    from typer.testing import CliRunner

    from hfexport.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "myformat", str(out), "--model", "tiny:bert", "--static"])
    assert result.exit_code == 0, result.output
    header, program = in_process_plugin.load(out / "model.myformat")
    assert header["format"] == "myformat" and "input_ids" in header["inputs"]
    assert type(program).__name__ == "ExportedProgram"
    report = json.loads((out / "export_report.json").read_text())
    assert report["export_format"] == "myformat"
    assert report["report"]["export_format"] == "myformat"
    assert all(row["ok"] for row in report["report"]["validation"]["sample"])
    # the plugin's GenerationSupport described the artifact in the folder
    assert report["artifact"]["metadata"] == {"inputs": header["inputs"]}
    result = CliRunner().invoke(app, ["export", "tflite", str(tmp_path / "x"), "--model", "tiny:bert"])
    assert result.exit_code != 0
    assert "FORMAT must be one of dynamo, onnx, executorch, openvino, myformat" in " ".join(
        result.output.split()
    )


# --------------------------------------------------------------------------------------------------
# The real thing: the plugin's own wheel in a fresh venv
# --------------------------------------------------------------------------------------------------
def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: int = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """``(venv python, env, work dir)``: a fresh venv with the page's plugin installed from its wheel."""
    files, _ = doc_examples()
    root = tmp_path_factory.mktemp("plugin")
    src = root / "hfexport-myformat"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"  # never the network
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = root / "dist"
    build = (
        "import os, sys; from setuptools import build_meta; os.chdir(sys.argv[1]); "
        "print(build_meta.build_wheel(sys.argv[2]))"
    )
    wheel = dist / _run([sys.executable, "-c", build, str(src), str(dist)], cwd=root, env=env).split()[-1]
    assert wheel.name.startswith("hfexport_myformat-0.1.0-") and wheel.suffix == ".whl"

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=env)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=root,
            env=env,
        ).strip()
    )
    # torch, transformers and hfexport from this environment, in this process's order (so the
    # hfexport under test wins over any other copy); the venv's own site-packages comes first.
    ours = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    lines = [p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) not in ours]
    lines.append(sysconfig.get_paths()["purelib"])
    (purelib / "_hfexport_test_env.pth").write_text("\n".join(dict.fromkeys(lines)) + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=root, env=env)
    return python, env, root


@pytest.mark.slow
def test_plugin_wheel_in_fresh_venv_exports_through_auto_classes(plugin_venv):
    python, env, root = plugin_venv
    probe = (
        "import hfexport, importlib.metadata as md; print(hfexport.__file__); "
        "print(md.distribution('hfexport-myformat').locate_file('').resolve())"
    )
    core_file, plugin_site = _run([str(python), "-c", probe], cwd=root, env=env).split()
    assert Path(core_file).resolve() == Path(hfexport.__file__).resolve()  # the hfexport under test
    assert Path(plugin_site).is_relative_to((root / "venv").resolve())  # installed in the venv

    _, examples = doc_examples()
    work = root / "usage"
    work.mkdir()
    (work / "usage.py").write_text(examples["backend-usage"])
    out = _run([str(python), "usage.py"], cwd=work, env=env).split()
    assert out[-3:] == ["myformat", "sample", "second_shape"]  # validated at two shapes
    assert (work / "model.myformat").read_bytes().startswith(b"MYFORMAT1\n")


@pytest.mark.slow
def test_plugin_wheel_in_fresh_venv_cli_export_and_env(plugin_venv):
    python, env, root = plugin_venv
    out = root / "cli-out"
    _run(
        [str(python), "-m", "hfexport.cli", "export", "myformat", str(out), "--model", "tiny:bert"],
        cwd=root,
        env=env,
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.sha256",
        "config.json",
        "export_report.json",
        "model.myformat",
    ]
    assert (out / "model.myformat").read_bytes().startswith(b"MYFORMAT1\n")
    report = json.loads((out / "export_report.json").read_text())
    assert report["export_format"] == "myformat"
    assert report["versions"]["hfexport-myformat"] == "0.1.0"
    assert all(row["ok"] for rows in report["report"]["validation"].values() for row in rows)

    data = json.loads(_run([str(python), "-m", "hfexport.cli", "env", "--json"], cwd=root, env=env))
    rows = {b["format"]: b for b in data["backends"]}
    assert rows["myformat"]["package"] == "hfexport-myformat"
    assert rows["myformat"]["version"] == "0.1.0"
    assert rows["myformat"]["error"] is None
