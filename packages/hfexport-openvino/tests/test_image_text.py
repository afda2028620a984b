"""Vision-language generation components exported to openvino with ``dynamic=True`` generate like
``model.generate`` at two image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest

from hfexport.config import OpenvinoConfig
from hfexport.testing.generation import check_vision_language_case
from hfexport_openvino import OpenvinoExporter

# --- generation from exported components (issue 28) -----------------------------------------------
# the cases (components, shapes at the sample and the second image + prompt) are shared by every
# backend: hfexport.testing.generation.VISION_LANGUAGE_CASES


def test_llava_components_generate_like_generate_at_two_image_prompt_shapes():
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation from the openvino components
    # equals model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    check_vision_language_case(OpenvinoExporter(), OpenvinoConfig(dynamic=True, stateful=False), "llava")


@pytest.mark.extended
def test_qwen2_vl_components_generate_like_generate_at_two_image_sizes():
    # another image size: 4 image tokens at export, 12 in a longer prompt at run time (M-RoPE positions)
    check_vision_language_case(OpenvinoExporter(), OpenvinoConfig(dynamic=True, stateful=False), "qwen2_vl")
