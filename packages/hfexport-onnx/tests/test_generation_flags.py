"""A generation component's ONNX graph takes the kwargs it was exported with (issue 26): the output
flags (``use_cache``, ``return_dict``) are no graph inputs, so the runner checks them against the
values recorded in the graph's metadata and drops them; another value is refused, naming the flag."""

from __future__ import annotations

import onnx

from hfexport.config import OnnxConfig
from hfexport.testing.generation import check_component_takes_exported_kwargs
from hfexport_onnx import OnnxExporter
from hfexport_onnx.io_names import OUTPUT_FLAGS_KEY


def test_an_onnx_component_takes_the_kwargs_it_was_exported_with(tmp_path):
    result = check_component_takes_exported_kwargs(OnnxExporter(), OnnxConfig(), tmp_path)
    assert result["output_flags"] == {"use_cache": True, "return_dict": True}
    graph = onnx.load(str(tmp_path / "prefill.onnx"), load_external_data=False)
    assert [i.name for i in graph.graph.input] == [
        "input_ids",
        "position_ids",
        "attention_mask",
    ]  # no flag inputs
    props = {p.key: p.value for p in graph.metadata_props}
    assert props[OUTPUT_FLAGS_KEY] == '{"use_cache": true, "return_dict": true}'
