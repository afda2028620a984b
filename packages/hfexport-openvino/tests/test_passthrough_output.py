"""An output that is an input returned unchanged (issue 28: OmDet-Turbo returns its
``classes_structure`` input) keeps the input's name (it is the input's tensor), so the runner feeds
the input and reads the output back (before: the output name ``classes_structure.out`` replaced the
input's, the compiled model had no ``classes_structure`` port, nothing was fed and the output came
back empty: 0 values where eager has 2)."""

from __future__ import annotations

import pytest
import torch

ov = pytest.importorskip("openvino")

from hfexport_openvino.naming import name_model_io  # noqa: E402
from hfexport_openvino.runtime import OpenvinoRunner  # noqa: E402


class _EchoesCounts(torch.nn.Module):
    def forward(self, x: torch.Tensor, classes_structure: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": x * 2.0, "classes_structure": classes_structure}


def test_pass_through_output_keeps_its_input_fed():
    x, counts = torch.randn(2, 3), torch.tensor([1, 1])
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(
        _EchoesCounts(),
        (),
        {"x": x, "classes_structure": counts},
        dynamic_shapes={"x": {0: batch}, "classes_structure": {0: batch}},
        strict=False,
    )
    model = ov.convert_model(program)
    names = name_model_io(model, program)
    assert names.inputs == {"x": "x", "classes_structure": "classes_structure"}
    # the output is the input's tensor: one name for both
    assert names.outputs == {"logits": "logits", "classes_structure": "classes_structure"}
    runner = OpenvinoRunner(model)
    x3, counts3 = torch.randn(3, 3), torch.tensor([1, 2, 1])
    out = runner({"x": x3, "classes_structure": counts3})
    assert torch.equal(out["classes_structure"], counts3)
    torch.testing.assert_close(out["logits"], x3 * 2.0)


class _RepeatedOutput(torch.nn.Module):
    """Returns one tensor under two names, as OneFormer does with its class and mask logits."""

    def forward(self, x):
        y = x * 2
        return {"a": y, "b": y, "c": y + 1, "m": y > 0, "n": y > 0}


def test_a_node_returned_twice_converts_after_repeated_outputs_as_copies():
    # issue 28: OpenVINO's FX frontend refused it with "Check 'is_number(name)' failed" (OneFormer)
    import openvino as ov
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    from hfexport_openvino.workarounds.fx_fixes import repeated_outputs_as_copies

    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(_RepeatedOutput(), (x,))
    with pytest.raises(Exception, match="is_number"):
        ov.convert_model(TorchFXPythonDecoder(program.run_decompositions().module(), dynamic_shapes=True))
    repeated_outputs_as_copies(program)
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    assert len(set(outputs)) == len(outputs) == 5
    assert [s.arg.name for s in program.graph_signature.output_specs] == [n.name for n in outputs]
    decoder = TorchFXPythonDecoder(program.run_decompositions().module(), dynamic_shapes=True)
    compiled = ov.compile_model(ov.convert_model(decoder), "CPU")
    got = [torch.from_numpy(v) for v in compiled([x.numpy()]).values()]
    want = (x * 2, x * 2, x * 2 + 1, x > 0, x > 0)
    for value, expected in zip(got, want, strict=True):
        assert value.dtype == expected.dtype and torch.equal(value, expected)
