"""The shared regression cases that list the ONNX backend (``/work/shared/cases/*.toml``).

Each case is exported as its file says (dynamic or not), validated by the exporter itself (sample
shape, and a derived second shape for dynamic exports), then run on the case's own second input
in ONNX Runtime; what the case's ``expect`` table asks must hold.
"""

from __future__ import annotations

import pytest
import torch

from hfexport.config import OnnxConfig
from hfexport.testing import list_cases
from hfexport.testing.backend_suite import KnownFailure, assert_stages_ok, export_unless_known_failure
from hfexport.validation import validate_artifact

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CASES = list_cases("onnx")

SKIPS = {
    "C04-qwen2vl-vision-grid": KnownFailure(
        "the plain forward of Qwen2-VL cannot be traced: Qwen2VLVisionAttention splits q/k/v by "
        "cu_seqlens.tolist() and get_image_features splits by image_grid_thw.tolist() (data-dependent "
        "torch.split, pytorch/pytorch#126685); the case is met by the generation decomposition "
        "(export_for_generation exports image_encoder / language_model / lm_head / decode with the grid "
        "inputs precomputed: tests-integration/test_generation_onnx.py::test_qwen2_vl_with_one_image_matches_generate)"
    ),  # strict: once the capture works, the test fails and the skip must go
}

# Cases whose padded encoder/decoder batch must keep its mask as a graph input (not baked in).
MASK_INPUTS = {
    "C09-left-padding": ["attention_mask"],
    "C12-t5-padded": ["attention_mask"],
}


@pytest.fixture(scope="module")
def exporter():
    from hfexport_onnx import OnnxExporter

    return OnnxExporter()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, exporter):
    atol = float(case.expect.get("atol", 1e-4))
    model = case.build_model()
    inputs = case.sample_inputs(model)
    program = export_unless_known_failure(
        lambda: exporter.export(model, inputs, OnnxConfig(dynamic=case.dynamic, atol=atol)),
        SKIPS.get(case.name),
    )
    assert_stages_ok(exporter.last_report, second_shape=case.dynamic)

    graph_inputs = [v.name for v in program.model.graph.inputs]
    for name in MASK_INPUTS.get(case.name, []):
        assert name in graph_inputs, f"{name} was pruned or baked into the graph: {graph_inputs}"

    second = case.second_inputs(model)
    if second is not None:
        rows = validate_artifact(
            model, exporter.runner(program), second, atol=atol, label="case second input"
        )
        by_name = {r.name: r for r in rows}
        logits = by_name["logits"]
        assert logits.ok and logits.max_abs_diff <= atol
        mask = second.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            # only the positions where attention_mask == 1 are compared (C09: left padding)
            assert logits.compared == int(mask.sum()) * logits.shape[-1]


def test_moe_with_the_eager_experts_loop(exporter):
    """C01's kind of fault with the experts implementation that loops over ``nonzero()`` of the routing."""
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("mixtral", experts_implementation="eager")
    assert model.config._experts_implementation == "eager"
    exporter.export(model, inputs, OnnxConfig(dynamic=True))
    report = exporter.last_report
    assert "hfexport_onnx.workarounds.patches.eager_experts_as_grouped_matmul" in report.applied["patches"]
    assert (
        "hfexport_onnx.workarounds.translations.grouped_mm_fallback" in report.applied["custom_translations"]
    )
    assert model.config._experts_implementation == "eager"  # the model is left as it was
    for row in report.validation["sample"] + report.validation["second_shape"]:
        assert row["ok"] and float(row["max_abs_diff"]) <= 1e-4, row
