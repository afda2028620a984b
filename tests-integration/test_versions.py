"""Tested pins are written once per backend: the constant, the ``tested`` extra and uv.lock agree.

Also: every registered workaround names its upstream issue and the versions it applies to.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["dynamo", "onnx", "executorch", "openvino"]


def _lock_versions() -> dict[str, str]:
    data = tomllib.loads((ROOT / "uv.lock").read_text())
    return {p["name"]: p["version"] for p in data["package"] if "version" in p}


def _tested_extra(backend: str) -> dict[str, str]:
    meta = tomllib.loads((ROOT / "packages" / f"hfexport-{backend}" / "pyproject.toml").read_text())
    pins = {}
    for line in meta["project"]["optional-dependencies"]["tested"]:
        req = Requirement(line)
        (spec,) = list(req.specifier)
        assert spec.operator == "==", f"the tested extra of hfexport-{backend} must pin exactly: {line}"
        pins[req.name] = spec.version
    return pins


@pytest.mark.parametrize("backend", BACKENDS)
def test_tested_pins_agree_everywhere(backend):
    versions = importlib.import_module(f"hfexport_{backend}.versions")
    constant = dict(versions.TESTED_VERSIONS)
    extra = _tested_extra(backend)
    assert extra == constant, f"hfexport-{backend}: tested extra {extra} != TESTED_VERSIONS {constant}"
    lock = _lock_versions()
    locked = {name: lock.get(name) for name in constant}
    assert locked == constant, f"uv.lock resolves {locked}, hfexport-{backend} is tested with {constant}"
    exporter = importlib.import_module(f"hfexport_{backend}.exporter")
    cls = getattr(
        exporter,
        {
            "dynamo": "DynamoExporter",
            "onnx": "OnnxExporter",
            "executorch": "ExecutorchExporter",
            "openvino": "OpenvinoExporter",
        }[backend],
    )
    assert dict(cls.tested_versions) == constant


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_declares_ranges_not_pins(backend):
    meta = tomllib.loads((ROOT / "packages" / f"hfexport-{backend}" / "pyproject.toml").read_text())
    for line in meta["project"]["dependencies"]:
        req = Requirement(line)
        assert all(s.operator != "==" for s in req.specifier), (
            f"hfexport-{backend} pins {line}: declare a range"
        )
    core = [Requirement(d) for d in meta["project"]["dependencies"] if d.startswith("hfexport")]
    assert len(core) == 1 and "0.1.0" in core[0].specifier and "0.2.0" not in core[0].specifier
    others = {f"hfexport-{b}" for b in BACKENDS} - {f"hfexport-{backend}"}
    assert not any(Requirement(d).name in others for d in meta["project"]["dependencies"])


def test_every_workaround_names_issue_and_range():
    from hfexport import registry

    for backend in BACKENDS:
        importlib.import_module(f"hfexport_{backend}")
    importlib.import_module("hfexport_onnx.fusions")  # registers its rewrites on first import
    entries = registry.entries()
    assert entries, "the backends register no workaround at all"
    for entry in entries:
        if entry.kind == "ort_fusion" and entry.issue is None:
            # an optimization of ours, not a workaround of an upstream bug: it says so instead
            assert "our rewrite" in entry.description, f"{entry.name} has no upstream issue link"
            continue
        assert (entry.issue or "").startswith("https://"), f"{entry.name} has no upstream issue link"
        assert entry.versions, f"{entry.name} declares no version range"
        assert entry.description.strip(), f"{entry.name} has no description"
