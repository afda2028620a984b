"""A generation component's ExecuTorch program takes the kwargs it was exported with (issue 26):
the output flags (``use_cache``, ``return_dict``) are constant inputs of the program, which the
runtime requires; the runner fills them in when a caller leaves them out (the generation loop) and
refuses another value, naming the flag. A saved ``.pte`` gets their values from its metadata."""

from __future__ import annotations

from hfexport.config import ExecutorchConfig
from hfexport.testing.generation import check_component_takes_exported_kwargs
from hfexport_executorch import ExecutorchExporter


def test_an_executorch_component_takes_the_kwargs_it_was_exported_with(tmp_path):
    result = check_component_takes_exported_kwargs(ExecutorchExporter(), ExecutorchConfig(), tmp_path)
    assert result["output_flags"] == {"use_cache": True, "return_dict": True}
    assert result["metadata"]["output_flags"] == {"use_cache": True, "return_dict": True}
