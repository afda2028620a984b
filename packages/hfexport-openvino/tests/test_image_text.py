"""Vision-language generation components exported to openvino with ``dynamic=True`` generate like
``model.generate`` at two image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest

from hfexport.config import OpenvinoConfig
from hfexport.testing import tiny_model
from hfexport.testing.generation import check_image_text_generation
from hfexport_openvino import OpenvinoExporter

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
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation in OpenVINO equals
    # model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    model, inputs = tiny_model("llava")
    result = check_image_text_generation(
        OpenvinoExporter(), OpenvinoConfig(dynamic=True, stateful=False), model, inputs
    )
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
    result = check_image_text_generation(
        OpenvinoExporter(), OpenvinoConfig(dynamic=True, stateful=False), model, inputs
    )
    parts = result["parts"]
    assert list(parts) == QWEN2_VL_PARTS
    assert parts.plan.mrope == {"spatial_merge_size": 2, "channels": 4}
    shapes = result["shapes"]
    assert shapes["sample"]["pixel_values"] == (16, 1176) and shapes["sample"]["input_ids"] == (1, 12)
    assert shapes["second"]["pixel_values"] == (48, 1176) and shapes["second"]["input_ids"] == (1, 23)
