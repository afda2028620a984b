"""Image-text plain forwards (LLaVA) export to ExecuTorch and validate at two shapes (issue 15); their
generation components, exported with ``dynamic=True``, generate like ``model.generate`` at two
image/prompt shapes (LLaVA; Qwen2-VL under ``extended``; issue 28)."""

from __future__ import annotations

import pytest
from torch.export import Dim

from hfexport.config import ExecutorchConfig
from hfexport.testing import tiny_model
from hfexport.testing.generation import check_vision_language_case
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
# the cases (components, shapes at the sample and the second image + prompt) are shared by every
# backend: hfexport.testing.generation.VISION_LANGUAGE_CASES


def test_llava_components_generate_like_generate_at_two_image_prompt_shapes():
    # exported once with dynamic=True at 2 images + 24 tokens; greedy generation from the executorch components
    # equals model.generate there and at 3 images + 29 tokens (one more image, a longer prompt)
    check_vision_language_case(ExecutorchExporter(), ExecutorchConfig(dynamic=True), "llava")


@pytest.mark.extended
def test_qwen2_vl_components_generate_like_generate_at_two_image_sizes():
    # another image size: 4 image tokens at export, 12 in a longer prompt at run time (M-RoPE positions)
    check_vision_language_case(ExecutorchExporter(), ExecutorchConfig(dynamic=True), "qwen2_vl")


@pytest.mark.extended  # ~2.5 min on 2 cores: four ExecuTorch programs
def test_mllama_components_generate_like_generate_at_a_prompt_longer_than_the_sample_and_text_only():
    # issue 28: the capture's guard scan lengthened input_ids without the cross_attention_mask tied to
    # them, so the prefill's prompt axis read "model-bounded" 2..9 (the sample's 9 tokens) and
    # ExecuTorch planned the prefill at 9 tokens: longer prompts were refused, and a text-only prompt
    # too (the steps need the mask). The mask has the prompt's sequence role now; the prefill is
    # validated at a second shape (65 tokens) and generation runs at 30 tokens and without an image.
    import torch

    from hfexport.generation import GenerationRunner, callers_from_exporter, compare_with_generate
    from hfexport.testing.generation import check_image_text_generation

    model, inputs = tiny_model("mllama", "image-text-to-text")
    exporter = ExecutorchExporter()
    result = check_image_text_generation(
        exporter, ExecutorchConfig(dynamic=True), model, inputs, max_new_tokens=4
    )
    parts = result["parts"]
    assert set(result["max_logit_diff"]) == {"sample", "second", "text"}
    prefill = parts.reports["prefill"]
    second = next(s for s in prefill.stages if s.name == "validate_second_shape")
    assert second.status == "ok" and "sequence 9 -> 65" in second.detail
    assert not any(e.get("note") == "model-bounded" for e in prefill.dynamic_axes)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    one = {k: v[:1] for k, v in inputs.items()}
    reps = 30 // one["input_ids"].shape[1] + 1
    text = one["input_ids"][:, 1:].repeat(1, reps)[:, : 30 - one["input_ids"].shape[1]]
    long = dict(one)
    long["input_ids"] = torch.cat([one["input_ids"], text], 1)  # the image token first, 30 tokens
    long["attention_mask"] = torch.ones_like(long["input_ids"])
    long["cross_attention_mask"] = one["cross_attention_mask"][:, :1].expand(-1, 30, -1, -1).contiguous()
    parity = compare_with_generate(runner, model, long, max_new_tokens=4)
    assert parity.tokens_equal and parity.max_logit_diff <= 1e-4, parity.max_logit_diff
