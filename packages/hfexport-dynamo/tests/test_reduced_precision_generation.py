"""Reduced-precision generation export on dynamo (tiny llama): prefill and decode programs captured
in ``config.dtype``, scored against the fp32 model by the quality gates, saved, and generating from
the folder; the manifest records the graphs' float dtype."""

from __future__ import annotations

import pytest

from hfexport.config import DynamoConfig
from hfexport.testing.generation import check_reduced_precision_generation
from hfexport_dynamo import DynamoExporter


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.extended)])
def test_reduced_precision_generation_export_gates_and_generates(tmp_path, dtype):
    check_reduced_precision_generation(DynamoExporter(), DynamoConfig(dynamic=True, dtype=dtype), tmp_path)
