"""Greedy generation over ExecuTorch components (XNNPACK, ExecuTorch runtime) matches ``model.generate``.

Each tiny decoder (gemma2 with a sliding window of 6, smaller than the 8-token prompt plus 20 new
tokens) with a dynamic cache exports ``prefill`` and a multi-token ``decode`` graph (the runtime
cannot take a 0-position cache, so the decode graph cannot serve the prefill), with a static
cache one multi-token ``decode`` graph that also serves the prefill on a zeroed cache (static-cache
components take the cache and return the updated one: the runtime does not write mutated inputs
back). 20 greedy tokens equal ``model.generate(do_sample=False)`` and every step's logits are within
atol 1e-4. Qwen2-VL with one image (case C04) and the padded T5 batch (case C12) export all their
components. On real weights (``extended``), SmolLM2-135M-Instruct's static-cache decode program
continues "The capital of France is" with the 12 tokens of ``model.generate`` (" Paris." first).
"""

from __future__ import annotations

import time

import pytest
import torch

from hfexport.config import ExecutorchConfig
from hfexport.generation import (
    GenerationRunner,
    callers_from_exporter,
    compare_with_generate,
    generate_from_dir,
    save_components,
)
from hfexport.testing import tiny_model
from hfexport.testing.generation import (
    check_decoder_second_shapes,
    check_smollm2_generation,
    generation_config_for,
    worst_validation,
)

pytestmark = [pytest.mark.integration]

NEW_TOKENS = 20
ATOL = 1e-4
DECODERS = ("llama", "qwen3", "mistral", "gemma2", "phi3", "gpt2")
OVERRIDES = {"gemma2": {"sliding_window": 6}}
# The default run keeps one decoder (llama) per backend; the rest of the sweep is the long tail
# (marker `extended`, run by `nox -s integration`; see README).
DECODER_PARAMS = [pytest.param(m, marks=() if m == "llama" else pytest.mark.extended) for m in DECODERS]


@pytest.fixture(scope="module")
def exporter():
    from hfexport_executorch import ExecutorchExporter

    return ExecutorchExporter()


def test_patch_embedding_conv3d_as_matmul_is_exact():
    from hfexport.registry import apply_patches
    from hfexport_executorch.generation import patchify_conv3d_as_matmul

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=True)
    x = torch.randn(5, 3, 2, 4, 4)
    with torch.no_grad():
        want = conv(x)
        with apply_patches("executorch.xnnpack") as installed:
            assert patchify_conv3d_as_matmul.__qualname__ in {e.name.rsplit(".", 1)[-1] for e in installed}
            got = conv(x)
            overlapping = torch.nn.Conv3d(3, 8, kernel_size=3, padding=1)
            assert torch.equal(
                overlapping(x), torch.nn.functional.conv3d(x, overlapping.weight, overlapping.bias, padding=1)
            )
    assert got.shape == want.shape == (5, 8, 1, 1, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_only_export_with_a_growing_cache_is_refused(exporter):
    model, inputs = tiny_model("llama")
    with pytest.raises(ValueError, match="cannot run a decode graph on an empty growing cache"):
        exporter.export_for_generation(
            model, inputs, ExecutorchConfig(dynamic=True), multi_token_decode=True, components=["decode"]
        )


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model_type", DECODER_PARAMS)
def test_decoder_generation_matches_generate(exporter, model_type, cache, tmp_path):
    model, inputs = tiny_model(model_type, **OVERRIDES.get(model_type, {}))
    config = generation_config_for(cache)
    start = time.perf_counter()
    parts = exporter.export_for_generation(
        model,
        inputs,
        ExecutorchConfig(dynamic=True),
        generation_config=config,
        multi_token_decode=True,
        components=["decode"] if cache == "static" else None,
    )
    seconds = time.perf_counter() - start
    worst = worst_validation(parts)
    assert {"decode.decode_q1", "decode.decode_q4"} <= set(worst)
    check_decoder_second_shapes(parts, static_cache_len=32 if cache == "static" else None)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    parity = compare_with_generate(runner, model, inputs, max_new_tokens=NEW_TOKENS, generation_config=config)
    parity.check(ATOL)
    if model_type == "llama":
        save_components(exporter, parts, tmp_path, model=model)
        prompt = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            want = model.generate(
                input_ids=torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                generation_config=config,
            )
        assert (
            generate_from_dir(tmp_path, prompt, max_new_tokens=NEW_TOKENS) == want[0, len(prompt) :].tolist()
        )
    print(f"{model_type} {cache}: export {seconds:.1f}s, max logit diff {parity.max_logit_diff:.2e}")


@pytest.mark.slow
@pytest.mark.extended
def test_smollm2_real_weights_generate_like_generate(exporter, smollm2):
    # one static-cache decode program (it also prefills, on a zeroed cache): one XNNPACK lowering
    model, tokenizer, inputs = smollm2
    config = generation_config_for("static")
    start = time.perf_counter()
    parts = exporter.export_for_generation(
        model,
        inputs,
        ExecutorchConfig(dynamic=True),
        generation_config=config,
        multi_token_decode=True,
        components=["decode"],
    )
    seconds = time.perf_counter() - start
    assert {"decode.decode_q1", "decode.decode_q4"} <= set(worst_validation(parts))
    check_decoder_second_shapes(parts, past_length=(5, 11), static_cache_len=32)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    parity = check_smollm2_generation(
        runner, model, tokenizer, inputs, max_new_tokens=12, generation_config=config
    )
    print(f"smollm2 executorch: export {seconds:.1f}s, max logit diff {parity.max_logit_diff:.2e}")


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_qwen2_vl_with_one_image_matches_generate(exporter, cache):
    model, inputs = tiny_model("case:C04-qwen2vl-vision-grid")
    config = generation_config_for(cache)
    parts = exporter.export_for_generation(
        model, inputs, ExecutorchConfig(dynamic=True), generation_config=config
    )
    assert list(parts) == ["image_encoder", "embed_tokens", "language_model", "lm_head", "decode"]
    worst_validation(parts)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    compare_with_generate(runner, model, inputs, max_new_tokens=NEW_TOKENS, generation_config=config).check(
        ATOL
    )


@pytest.mark.slow
@pytest.mark.extended
def test_t5_padded_batch_matches_generate(exporter):
    model, inputs = tiny_model("case:C12-t5-padded")
    prompt = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    parts = exporter.export_for_generation(
        model, prompt, ExecutorchConfig(dynamic=True), multi_token_decode=True
    )
    assert list(parts) == ["encoder", "prefill", "decode"]
    worst_validation(parts)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    compare_with_generate(runner, model, prompt, max_new_tokens=NEW_TOKENS).check(ATOL)
    # a prompt longer than the sample's: the prefill's and decode's encoder outputs were planned at
    # the sample's source length ("encoder_outputs.last_hidden_state dimension 1 is 17, above the
    # upper bound 8"); they now share the source mask's bound
    ids = inputs["input_ids"]
    longer = torch.cat([ids[:1], ids[:1, 1:]], dim=1)[:, : 2 * ids.shape[1] - 1]
    assert longer.shape[1] > ids.shape[1]
    longer_prompt = {"input_ids": longer, "attention_mask": torch.ones_like(longer)}
    compare_with_generate(runner, model, longer_prompt, max_new_tokens=NEW_TOKENS).check(ATOL)
