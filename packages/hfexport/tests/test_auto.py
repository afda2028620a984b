"""Auto dispatch through entry points, explicit registration, and the missing-backend error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hfexport import auto
from hfexport.auto import (
    AutoHfExporter,
    get_hf_exporter,
    register_export_config,
    register_exporter,
    supports_export_format,
)
from hfexport.config import DynamoConfig
from hfexport.errors import MissingBackendError
from hfexport.exporter import HfExporter


class _Toy(HfExporter):
    export_format = "toy"
    config_class = DynamoConfig
    required_packages = ("torch",)

    def _export(self, model, inputs, config, report):
        return "artifact"

    def runner(self, artifact):
        return lambda inputs: {}

    def save(self, artifact, path):
        pass


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(auto, "_EXPORTERS", {})
    monkeypatch.setattr(auto, "_entry_points", lambda: {})


def test_register_exporter_and_lookup(clean_registry):
    register_exporter("toy")(_Toy)
    assert get_hf_exporter("toy") is _Toy
    assert supports_export_format("toy")
    assert not supports_export_format("onnx")


def test_register_wrong_base_raises_type_error(clean_registry):
    with pytest.raises(TypeError, match="expects an HfExporter subclass"):
        register_exporter("bad")(object)
    with pytest.raises(TypeError, match="expects an ExportConfigMixin subclass"):
        register_export_config("bad")(dict)


def test_overwriting_warns(clean_registry):
    register_exporter("toy")(_Toy)
    other = type("OtherToy", (_Toy,), {})
    with pytest.warns(UserWarning, match="replaced by OtherToy"):
        register_exporter("toy")(other)


def test_missing_backend_error_names_pip_command(clean_registry):
    with pytest.raises(MissingBackendError, match="pip install hfexport-executorch") as info:
        AutoHfExporter.from_config({"export_format": "executorch"})
    assert isinstance(info.value, ImportError)


def test_from_pretrained_reads_local_recipe(clean_registry, tmp_path, monkeypatch):
    register_exporter("dynamo")(_Toy)
    DynamoConfig(dynamic=True).to_json_file(tmp_path / "export_config.json")
    exporter, config = AutoHfExporter.from_pretrained(tmp_path)
    assert isinstance(exporter, _Toy) and config.dynamic is True
    with pytest.raises(FileNotFoundError, match=r"export_config\.json"):
        AutoHfExporter.from_pretrained(tmp_path / "nowhere")


def test_import_hfexport_loads_no_backend():
    code = textwrap.dedent(
        """
        import sys, hfexport
        hfexport.DynamoConfig, hfexport.AutoHfExporter, hfexport.register_patch
        bad = [m for m in sys.modules if m.split('.')[0] in
               ('onnx', 'onnxscript', 'onnxruntime', 'executorch', 'hfexport_onnx', 'hfexport_dynamo', 'hfexport_executorch')]
        print(bad)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
