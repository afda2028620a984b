"""Package wiring: entry point, registration, class attributes and the single source of versions."""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

from hfexport.auto import AutoHfExporter, get_hf_exporter
from hfexport.config import ExecutorchConfig
from hfexport_executorch import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS, ExecutorchExporter

_PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_entry_point_and_registry_give_the_exporter():
    (ep,) = [e for e in importlib.metadata.entry_points(group="hfexport.exporters") if e.name == "executorch"]
    assert ep.value == "hfexport_executorch.exporter:ExecutorchExporter"
    assert get_hf_exporter("executorch") is ExecutorchExporter
    assert isinstance(AutoHfExporter.from_config({"export_format": "executorch"}), ExecutorchExporter)


def test_class_attributes():
    assert ExecutorchExporter.export_format == "executorch"
    assert ExecutorchExporter.config_class is ExecutorchConfig
    assert ExecutorchExporter.package_name == "hfexport-executorch"
    assert ExecutorchExporter.artifact_filename == "model.pte"
    assert ExecutorchExporter.required_packages == ("torch", "executorch")
    assert ExecutorchExporter.tested_versions == {
        "torch": "2.13.0",
        "transformers": "5.24.0",
        "executorch": "1.4.1",
    }
    assert ExecutorchExporter.min_versions == MIN_VERSIONS


def test_pyproject_pins_match_versions_module():
    project = tomllib.loads(_PYPROJECT.read_text())["project"]
    tested = dict(pin.split("==") for pin in project["optional-dependencies"]["tested"])
    assert tested == TESTED_VERSIONS
    ranges = {
        dep.split(">=")[0]: ">=" + dep.split(">=")[1]
        for dep in project["dependencies"]
        if not dep.startswith("hfexport")
    }
    assert ranges == SUPPORTED
    assert {name: spec.removeprefix(">=") for name, spec in SUPPORTED.items()} == MIN_VERSIONS
