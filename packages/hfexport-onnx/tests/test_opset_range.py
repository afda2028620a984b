"""The exact opset check (issue 14 item 10): the range the installed onnxscript and onnx support,
checked when the exporter is built and when an export starts, before capture."""

from __future__ import annotations

import onnx.defs
import pytest
from onnxscript.version_converter import _version_converter

import hfexport_onnx.exporter as onnx_exporter
from hfexport.config import OnnxConfig
from hfexport_onnx import OnnxExporter


def test_supported_range_is_the_converters_capped_by_onnx():
    lowest, highest, source = onnx_exporter.supported_opset_range()
    expected = min(_version_converter.SUPPORTED_MAX_ONNX_OPSET, onnx.defs.onnx_opset_version())
    assert (lowest, highest) == (18, expected)
    assert source.startswith("onnxscript ") and f"converts to opset {expected}" in source


def test_opset_beyond_the_backend_range_fails_at_construction_and_before_capture(monkeypatch, tiny_encoder):
    # an onnx that knows fewer opsets than the onnxscript converter targets
    monkeypatch.setattr(onnx_exporter, "supported_opset_range", lambda: (18, 21, "test: onnx knows 21"))
    config = OnnxConfig(opset_version=23)  # within the core's (onnxscript) range
    with pytest.raises(ValueError) as info:
        OnnxExporter(config)
    assert str(info.value).startswith(
        "opset_version=23 is invalid; allowed: an int from 18 to 21 (test: onnx knows 21) or None"
    )
    model, inputs = tiny_encoder
    exporter = OnnxExporter()
    with pytest.raises(ValueError, match=r"^opset_version=23 is invalid; allowed: an int from 18 to 21"):
        exporter.export(model, inputs, config)
    assert exporter.last_report is None  # refused before any stage ran
    assert OnnxExporter(OnnxConfig(opset_version=21)).config.opset_version == 21
