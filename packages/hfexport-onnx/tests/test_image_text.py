"""Image-text plain forwards (LLaVA) export to ONNX and validate at two shapes (issue 15); their
generation components, exported with ``dynamic=True``, generate like ``model.generate`` at two
image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest
from torch.export import Dim

from hfexport.config import OnnxConfig
from hfexport.testing import tiny_model
from hfexport.testing.generation import check_vision_language_case
from hfexport_onnx import OnnxExporter

DROP = "hfexport_onnx.workarounds.fx_fixes.runtime_assertions_dropped_before_translation"


def _check_llava(model, exporter, second_batch):
    report = exporter.last_report
    stages = {s.name: s.status for s in report.stages}
    assert stages["translate"] == stages["validate"] == stages["validate_second_shape"] == "ok"
    # transformers' torch_compilable_check on the image-token count left aten._is_all_true, which has
    # no ONNX function (ConversionError in translate), before the fix erased it with its assertions
    assert DROP in report.applied["fx_program_fixes"]
    vocab = model.config.text_config.vocab_size
    for label, shape in (("sample", (2, 24, vocab)), ("second_shape", (second_batch, 65, vocab))):
        rows = {row["name"]: row for row in report.validation[label]}
        assert tuple(rows["logits"]["shape"]) == shape
        assert all(row["ok"] for row in rows.values()), label
        assert max(row["max_abs_diff"] for row in rows.values()) < 1e-4, label


def test_llava_exports_with_a_dynamic_prompt_length_and_validates_at_two_shapes():
    model, inputs = tiny_model("llava")
    assert (inputs["input_ids"] == model.config.image_token_id).sum(-1).tolist() == [16, 16]
    sequence = Dim("sequence", min=2, max=128)
    config = OnnxConfig(dynamic_shapes={"input_ids": {1: sequence}, "attention_mask": {1: sequence}})
    exporter = OnnxExporter()
    exporter.export(model, inputs, config)
    _check_llava(model, exporter, second_batch=2)
    assert exporter.last_report.dynamic_axes_summary == [
        "input_ids sequence: dynamic [2, 128]",
        "attention_mask sequence: dynamic [2, 128]",
    ]


@pytest.mark.extended
def test_llava_exports_with_dynamic_true_keeping_the_model_fixed_image_batch():
    # the sweep's configuration: transformers 5.24 returns one feature tensor per image, so the capture
    # fixes the image batch; the second shape keeps the batch and grows the prompt with its image tokens
    model, inputs = tiny_model("llava")
    exporter = OnnxExporter()
    exporter.export(model, inputs, OnnxConfig(dynamic=True))
    _check_llava(model, exporter, second_batch=2)
    summary = exporter.last_report.dynamic_axes_summary
    assert "pixel_values batch: static 2 (model-fixed)" in summary
    assert "input_ids sequence: dynamic [2, inf]" in summary


# --- generation from exported components (issue 28) -----------------------------------------------
# the cases (components, shapes at the sample and the second image + prompt) are shared by every
# backend: hfexport.testing.generation.VISION_LANGUAGE_CASES


def test_llava_components_generate_like_generate_at_two_image_prompt_shapes():
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation from the onnx components
    # equals model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    check_vision_language_case(OnnxExporter(), OnnxConfig(dynamic=True), "llava")


@pytest.mark.extended
def test_qwen2_vl_components_generate_like_generate_at_two_image_sizes():
    # another image size: 4 image tokens at export, 12 in a longer prompt at run time (M-RoPE positions)
    check_vision_language_case(OnnxExporter(), OnnxConfig(dynamic=True), "qwen2_vl")
