"""Vision-language generation components exported to dynamo with ``dynamic=True`` generate like
``model.generate`` at two image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest

from hfexport.config import DynamoConfig
from hfexport.testing.generation import check_vision_language_case
from hfexport_dynamo import DynamoExporter

# --- generation from exported components (issue 28) -----------------------------------------------
# the cases (components, shapes at the sample and the second image + prompt) are shared by every
# backend: hfexport.testing.generation.VISION_LANGUAGE_CASES


def test_llava_components_generate_like_generate_at_two_image_prompt_shapes(tmp_path):
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation from the dynamo components
    # equals model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    result = check_vision_language_case(DynamoExporter(), DynamoConfig(dynamic=True), "llava")
    _check_hfexport_generate_with_image_inputs(result["parts"], tmp_path)


def _check_hfexport_generate_with_image_inputs(parts, tmp_path):
    # `hfexport generate` had no image input: a vision-language folder could not be run from the CLI.
    # --inputs FILE.safetensors gives the image processor's tensors; without it the prompt is text only.
    import torch
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from hfexport.cli import app
    from hfexport.generation import save_components
    from hfexport.generation.image_prompts import text_only_prompt
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("llava")  # the case's model: same seed, same weights
    save_components(DynamoExporter(), parts, tmp_path / "out", model=model)
    ids = inputs["input_ids"][:1]
    pixels = inputs["pixel_values"][: inputs["pixel_values"].shape[0] // inputs["input_ids"].shape[0]]
    save_file({"pixel_values": pixels.contiguous()}, tmp_path / "image.safetensors")
    text = text_only_prompt({"input_ids": ids}, [int(t) for t in parts.plan.features])["input_ids"]
    for prompt, extra in ((ids, ["--inputs", str(tmp_path / "image.safetensors")]), (text, [])):
        with torch.no_grad():
            expected = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=4,
                do_sample=False,
                **({"pixel_values": pixels} if extra else {}),
            )[0, prompt.shape[1] :].tolist()
        args = ["generate", str(tmp_path / "out"), "--input-ids", ",".join(map(str, prompt[0].tolist()))]
        result = CliRunner().invoke(app, [*args, "--max-new-tokens", "4", *extra])
        assert result.exit_code == 0, result.output
        assert "tokens: " + " ".join(map(str, expected)) in result.output
    save_file({"input_ids": ids.contiguous()}, tmp_path / "ids.safetensors")
    result = CliRunner().invoke(app, [*args[:3], "1,2", "--inputs", str(tmp_path / "ids.safetensors")])
    assert result.exit_code == 2 and "the prompt comes from --prompt or --input-ids" in result.output


@pytest.mark.extended
def test_qwen2_vl_components_generate_like_generate_at_two_image_sizes():
    # another image size: 4 image tokens at export, 12 in a longer prompt at run time (M-RoPE positions)
    check_vision_language_case(DynamoExporter(), DynamoConfig(dynamic=True), "qwen2_vl")


@pytest.mark.extended
@pytest.mark.parametrize("model_type", ["idefics", "mllama"])
def test_cross_attending_language_model_components_generate_like_generate(model_type):
    # issue 28: the language model takes token ids and cross-attends to the image (IDEFICS'
    # image_encoder_embeddings at every step, Mllama's cross_attention_states at prefill then its
    # cross-attention K/V in the cache); was: decompose "no multimodal submodules found in
    # IdeficsForVisionText2Text", generate "component 'language_model' takes input 'input_ids',
    # which the runner cannot supply" (Mllama). The steps are the model's own forward, given the
    # image features in place of the image inputs, and the per-token row of the cross-attention mask
    # (~55 s each on a loaded machine: the split and its eager parity run by default in
    # hfexport's test_vlm_tiny_and_generation.py)
    from hfexport.testing import tiny_model
    from hfexport.testing.generation import check_image_text_generation

    model, inputs = tiny_model(model_type, "image-text-to-text")
    result = check_image_text_generation(
        DynamoExporter(), DynamoConfig(dynamic=True), model, inputs, max_new_tokens=4
    )
    parts = result["parts"]
    assert list(parts)[-2:] == ["prefill", "decode"]
    mask = "cross_attention_mask" if model_type == "mllama" else "image_attention_mask"
    source = dict(parts.plan.step_inputs["decode"][mask])
    # Mllama's steps take zero image features and masks for a text-only turn (IDEFICS' do not)
    assert ("without_image" in source) == (model_type == "mllama")
    source.pop("without_image", None)
    assert source == {"from": "prompt", "key": mask, "last": True}
    assert result["shapes"]["second"]["input_ids"] != result["shapes"]["sample"]["input_ids"]
    assert ("text" in result["max_logit_diff"]) == (model_type == "mllama")
    assert max(result["max_logit_diff"].values()) <= 1e-4
