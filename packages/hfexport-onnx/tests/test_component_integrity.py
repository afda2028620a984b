"""load_component checks the graph and its external data against checksums.sha256 before ONNX Runtime."""

from __future__ import annotations

import re

import pytest

from hfexport.errors import IntegrityError
from hfexport.integrity import write_checksums
from hfexport_onnx import OnnxExporter


@pytest.mark.parametrize("damaged", ["prefill.onnx", "prefill.onnx.data"])
def test_a_changed_graph_or_weights_file_is_refused_before_loading(tmp_path, damaged):
    (tmp_path / "prefill.onnx").write_bytes(b"graph bytes")
    (tmp_path / "prefill.onnx.data").write_bytes(b"weight bytes")
    write_checksums(tmp_path)
    (tmp_path / damaged).write_bytes(b"changed bytes")
    with pytest.raises(IntegrityError, match=re.escape(damaged) + " does not match its checksum"):
        OnnxExporter().generation_support.load_component(tmp_path / "prefill.onnx", {})
