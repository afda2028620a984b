"""A generation component's ``ExportedProgram`` takes the kwargs it was exported with (issue 26):
the output flags are constant inputs of the program (``torch.export`` guards them), also in the
flat-input ``.pt2``; the runner fills them in when left out and refuses another value."""

from __future__ import annotations

from hfexport.config import DynamoConfig
from hfexport.inputs.flags import program_output_flags
from hfexport.testing.generation import check_component_takes_exported_kwargs
from hfexport_dynamo import DynamoExporter, load


def test_a_dynamo_component_takes_the_kwargs_it_was_exported_with(tmp_path):
    result = check_component_takes_exported_kwargs(DynamoExporter(), DynamoConfig(), tmp_path)
    assert result["output_flags"] == {"use_cache": True, "return_dict": True}
    assert program_output_flags(load(tmp_path / "prefill.pt2")) == {"use_cache": True, "return_dict": True}
