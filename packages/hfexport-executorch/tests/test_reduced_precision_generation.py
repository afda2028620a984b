"""Reduced-precision generation export on ExecuTorch (tiny llama, XNNPACK): prefill and decode programs captured
in ``config.dtype``, scored against the fp32 model by the quality gates, saved, and generating from
the folder; the manifest records the graphs' float dtype. The XNNPACK runtime runs both float16 and
bfloat16 programs on CPU (``ExecutorchExporter.supported_dtypes``)."""

from __future__ import annotations

import pytest

from hfexport.config import ExecutorchConfig
from hfexport.testing.generation import check_reduced_precision_generation
from hfexport_executorch import ExecutorchExporter


# about 2 minutes each (lowering to XNNPACK, validation in the ExecuTorch runtime): extended
@pytest.mark.extended
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision_generation_export_gates_and_generates(tmp_path, dtype):
    check_reduced_precision_generation(
        ExecutorchExporter(), ExecutorchConfig(dynamic=True, dtype=dtype), tmp_path
    )
