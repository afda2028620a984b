"""Image-text plain forwards (LLaVA) export to ExecuTorch and validate at two shapes (issue 15); their
generation components, exported with ``dynamic=True``, generate like ``model.generate`` at two
image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest
from torch.export import Dim

from hfexport.config import ExecutorchConfig
from hfexport.testing import tiny_model
from hfexport.testing.generation import check_image_text_generation
from hfexport_executorch import ExecutorchExporter

DROP = "hfexport_executorch.workarounds.fx_fixes.runtime_assertions_dropped_before_edge"


@pytest.mark.extended  # 1-2.5 min on 2 cores
def test_llava_exports_with_a_dynamic_prompt_length_and_validates_at_two_shapes():
    model, inputs = tiny_model("llava")
    assert (inputs["input_ids"] == model.config.image_token_id).sum(-1).tolist() == [16, 16]
    sequence = Dim("sequence", min=2, max=128)
    config = ExecutorchConfig(dynamic_shapes={"input_ids": {1: sequence}, "attention_mask": {1: sequence}})
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, config)
    report = exporter.last_report
    stages = {s.name: s.status for s in report.stages}
    assert stages["lower"] == stages["validate"] == stages["validate_second_shape"] == "ok"
    # transformers' torch_compilable_check on the image-token count left aten._is_all_true (not core
    # ATen: SpecViolationError in lower) before the fix erased it with its assertions
    assert DROP in report.applied["fx_program_fixes"]
    vocab = model.config.text_config.vocab_size
    for label, length in (("sample", 24), ("second_shape", 65)):
        rows = {row["name"]: row for row in report.validation[label]}
        assert tuple(rows["logits"]["shape"]) == (2, length, vocab)
        assert all(row["ok"] for row in rows.values()), label
        assert max(row["max_abs_diff"] for row in rows.values()) < 1e-4, label
    assert report.dynamic_axes_summary == [
        "input_ids sequence: dynamic [2, 128]",
        "attention_mask sequence: dynamic [2, 128]",
    ]


# --- generation from exported components (issue 28) -----------------------------------------------

LLAVA_PARTS = [
    "image_encoder",
    "multi_modal_projector",
    "embed_tokens",
    "language_model",
    "lm_head",
    "decode",
]
QWEN2_VL_PARTS = ["image_encoder", "embed_tokens", "language_model", "lm_head", "decode"]


def test_llava_components_generate_like_generate_at_two_image_prompt_shapes():
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation in the ExecuTorch runtime equals
    # model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    model, inputs = tiny_model("llava")
    result = check_image_text_generation(ExecutorchExporter(), ExecutorchConfig(dynamic=True), model, inputs)
    assert list(result["parts"]) == LLAVA_PARTS
    shapes = result["shapes"]
    assert shapes["sample"]["pixel_values"] == (2, 3, 32, 32) and shapes["sample"]["input_ids"] == (2, 24)
    assert shapes["second"]["pixel_values"] == (3, 3, 32, 32) and shapes["second"]["input_ids"] == (3, 29)
    assert set(result["max_logit_diff"]) == {"sample", "second"}


@pytest.mark.extended
def test_qwen2_vl_components_generate_like_generate_at_two_image_sizes():
    # another image size: a 4x4 patch grid (4 image tokens) at export, an 8x6 grid (12 image tokens)
    # in a longer prompt at run time; M-RoPE position ids [4, batch, seq] (text positions first) computed by the runner
    model, inputs = tiny_model("qwen2_vl", "image-text-to-text")
    result = check_image_text_generation(ExecutorchExporter(), ExecutorchConfig(dynamic=True), model, inputs)
    parts = result["parts"]
    assert list(parts) == QWEN2_VL_PARTS
    assert parts.plan.mrope == {"spatial_merge_size": 2, "channels": 4}
    shapes = result["shapes"]
    assert shapes["sample"]["pixel_values"] == (16, 1176) and shapes["sample"]["input_ids"] == (1, 12)
    assert shapes["second"]["pixel_values"] == (48, 1176) and shapes["second"]["input_ids"] == (1, 23)
