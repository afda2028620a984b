"""Environment validation with faked metadata: one pass, all problems, drift warned once."""

from __future__ import annotations

import warnings

import pytest

from hfexport import environment
from hfexport.environment import VersionDriftWarning, public_version, torch_older_than
from hfexport.exporter import HfExporter

FAKE = {"torch": "2.13.0+cpu", "onnx": "1.10.0", "transformers": "5.24.0"}


@pytest.fixture
def fake_versions(monkeypatch):
    monkeypatch.setattr(environment, "installed_version", lambda name: FAKE.get(name))
    monkeypatch.setattr(environment, "_DRIFT_WARNED", set())


def _exporter_class(**attrs):
    body = {
        "export_format": "fake",
        "package_name": "hfexport-fake",
        "_export": lambda self, *a: None,
        "runner": lambda self, a: None,
        "save": lambda self, a, p: None,
        **attrs,
    }
    return type("FakeExporter", (HfExporter,), body)


def test_missing_and_outdated_are_reported_together(fake_versions):
    cls = _exporter_class(
        required_packages=("torch", "onnx", "onnxscript"),
        min_versions={"onnx": "1.18", "torch": "2.12"},
        tested_versions={"torch": "2.13.0", "onnx": "1.23.2", "onnxscript": "0.7.2"},
    )
    with pytest.raises(ImportError) as info:
        cls()
    msg = str(info.value)
    assert "onnxscript is not installed" in msg
    assert "onnx 1.10.0 is older than the minimum 1.18" in msg
    assert "torch" not in msg.split("\n")[1:-1][0]  # torch 2.13.0+cpu satisfies >=2.12
    assert "pip install 'hfexport-fake[tested]'" in msg and "'onnxscript==0.7.2'" in msg


def test_drift_warns_once_per_class_and_ignores_local_suffix(fake_versions):
    cls = _exporter_class(tested_versions={"torch": "2.13.0", "transformers": "5.23.0"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls()
        cls()
    drift = [w for w in caught if issubclass(w.category, VersionDriftWarning)]
    assert len(drift) == 1
    text = str(drift[0].message)
    assert "transformers 5.24.0 (tested 5.23.0)" in text
    assert "torch" not in text  # 2.13.0+cpu == 2.13.0 once the suffix is dropped
    assert "behaviour may differ from what was validated" in text


def test_no_warning_when_versions_match(fake_versions):
    cls = _exporter_class(tested_versions={"torch": "2.13.0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls()


def test_version_helpers(fake_versions):
    assert public_version("2.13.0+cu126") == public_version("2.13.0")
    assert torch_older_than("2.14") is True
    assert torch_older_than("2.13") is False
