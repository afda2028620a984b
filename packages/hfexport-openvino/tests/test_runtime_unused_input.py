"""An exported program's input that the converted OpenVINO model has no Parameter for (nothing reads
it: the converter drops it) is checked but not fed (issue 28: OmDet-Turbo's ``classes_structure``,
read only by a run-time assertion the OpenVINO lowering erases)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

ov = pytest.importorskip("openvino")

from hfexport.errors import UnsupportedInputError  # noqa: E402
from hfexport_openvino.naming import RT_INFO_KEY  # noqa: E402
from hfexport_openvino.runtime import OpenvinoRunner  # noqa: E402


def _relu_model_recording_an_unused_input():
    from openvino import opset13 as ops

    x = ops.parameter([2, 3], np.float32, name="x")
    x.output(0).set_names({"x"})
    out = ops.relu(x)
    out.output(0).set_names({"y"})
    model = ov.Model([out], [x], "relu")
    record = {"inputs": {"x": "x", "classes_structure": "classes_structure"}, "outputs": {"y": "y"}}
    model.set_rt_info(json.dumps(record), [RT_INFO_KEY, "io"])
    return model


def test_input_without_a_parameter_is_checked_not_fed():
    runner = OpenvinoRunner(_relu_model_recording_an_unused_input())
    x = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    out = runner({"x": x, "classes_structure": torch.ones(2, dtype=torch.int64)})
    torch.testing.assert_close(out["y"], x.clamp(min=0))
    with pytest.raises(UnsupportedInputError, match="classes_structure"):
        runner({"x": x})  # still one of the program's inputs: the caller must give it
