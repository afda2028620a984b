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
