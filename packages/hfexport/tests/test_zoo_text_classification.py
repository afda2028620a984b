"""The text-classification family (issue 28): tiny builders, sample inputs and second shapes of the
sequence-classification heads, and the capture patch of the BART/T5-family heads. Builds and eager
forwards of tiny models only; the exports are in tests-integration/test_zoo_families.py.

- decoder-only LMs pool the last token that is not ``pad_token_id`` and refuse a batch of two
  without one: the tiny builder gives them pad 0 (an id the sample inputs never draw);
- the encoder-decoders (BART, T5 and their kin) pool the decoder state at the last ``</s>`` of
  ``input_ids`` and refuse rows without one: every sample row ends with ``eos_token_id``, the model
  shifts the ids into its decoder ids itself, and the second validation shape keeps the ``</s>`` at
  the end of every row;
- their boolean-mask pooling becomes a gather by position while capturing.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from hfexport.capture import capture_patch_key
from hfexport.conventions import input_role
from hfexport.registry import apply_patches, entries
from hfexport.testing import supported_tasks, tiny_model
from hfexport.tiny.models import CLASSIFICATION_PAD_TOKEN_ID
from hfexport.verify.fill import sentence_end_token
from hfexport.verify.second_shape import derive_second_inputs
from hfexport.workarounds import text_classification

TASK = "text-classification"


@pytest.mark.parametrize("model_type", ["arcee", "gpt_neo"])
def test_decoder_lm_heads_get_a_pad_token_and_pool_the_last_token(model_type):
    # transformers' default configs leave pad_token_id None: eager raised "Cannot handle batch sizes > 1
    # if no padding token is defined"
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    assert model.config.get_text_config().pad_token_id == CLASSIFICATION_PAD_TOKEN_ID == 0
    assert not bool((inputs["input_ids"] == 0).any())  # no pad in the sample: the last token is pooled
    with torch.no_grad():
        logits = model(**inputs).logits
        alone = model(**{k: v[1:] for k, v in inputs.items()}).logits
    assert tuple(logits.shape) == (2, 3)
    torch.testing.assert_close(logits[1:], alone, atol=1e-5, rtol=1e-4)


def test_a_given_pad_token_is_kept():
    model, _ = tiny_model("arcee", TASK, pad_token_id=5)
    assert model.config.pad_token_id == 5
    model, _ = tiny_model("bloom", "text-generation")  # other tasks: the configuration as it was
    assert model.config.pad_token_id != CLASSIFICATION_PAD_TOKEN_ID or model.config.pad_token_id is None


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_encoder_decoder_heads_get_rows_ending_with_eos_and_no_decoder_ids(model_type):
    assert TASK in supported_tasks(
        model_type
    )  # bart and t5 are hand-written presets: offered after their own
    model, inputs = tiny_model(model_type, TASK, check_eager=True)
    eos = model.config.eos_token_id
    ids = inputs["input_ids"]
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert bool((ids[:, -1] == eos).all()) and not bool((ids[:, :-1] == eos).any())
    with torch.no_grad():
        assert tuple(model(**inputs).logits.shape) == (2, 3)


def test_second_shape_keeps_the_sentence_end_and_draws_none_elsewhere():
    model, inputs = tiny_model("bart", TASK)
    eos = model.config.eos_token_id
    assert sentence_end_token(inputs["input_ids"], input_role("input_ids", 2)) == eos
    second, reason = derive_second_inputs(model, inputs)
    assert reason == ""
    ids = second["input_ids"]
    assert tuple(ids.shape) == (3, 65)
    assert bool((ids[:, -1] == eos).all()) and not bool((ids[:, :-1] == eos).any())
    with torch.no_grad():  # the original head runs on them (it refused the drawn ids before)
        assert tuple(model(**second).logits.shape) == (3, 3)
    reused, _ = derive_second_inputs(model, inputs, token_values="sample")
    assert bool((reused["input_ids"][:, -1] == eos).all())
    assert not bool((reused["input_ids"][:, :-1] == eos).any())


def test_ids_without_a_common_special_end_are_not_taken_for_a_sentence_end():
    role = input_role("input_ids", 2)
    assert sentence_end_token(torch.tensor([[5, 6, 2], [7, 8, 3]]), role) is None  # ends differ
    assert sentence_end_token(torch.tensor([[5, 2, 2], [7, 8, 2]]), role) is None  # also elsewhere
    assert sentence_end_token(torch.tensor([[5, 6, 9], [7, 8, 9]]), role) is None  # not below the others
    assert sentence_end_token(torch.tensor([[5, 6, 2]]), role) is None  # one row proves nothing
    assert sentence_end_token(torch.tensor([[5, 6, 2], [7, 8, 2]]), role) == 2


def test_capture_patch_is_registered_and_scoped_to_the_classification_heads():
    (entry,) = [e for e in entries(text_classification.KEY) if e.name.endswith("pool_last_eos_by_position")]
    assert entry.issue.startswith("https://github.com/huggingface/transformers/")
    assert entry.versions == {"transformers": ">=5.23,<6"}
    assert not entry.unresolved
    model, _ = tiny_model("bart", TASK)
    assert capture_patch_key(model) == text_classification.KEY == "capture.text_classification"
    generator, _ = tiny_model("bart")
    assert capture_patch_key(generator) == "capture"


def test_pooling_by_position_gives_the_original_logits():
    model, inputs = tiny_model("bart", TASK)
    mask = inputs["attention_mask"]
    twice = inputs["input_ids"].clone()
    twice[:, 3] = model.config.eos_token_id  # two </s> per row: the last one is pooled
    with torch.no_grad():
        expected = model(input_ids=twice, attention_mask=mask).logits
        with apply_patches(text_classification.KEY):
            patched = model(input_ids=twice, attention_mask=mask)
    torch.testing.assert_close(patched.logits, expected, atol=1e-6, rtol=1e-5)
    assert patched.encoder_last_hidden_state is not None  # the base model's other outputs are kept


@pytest.mark.extended  # a torch.export of the tiny bart: ~5 s on an idle core
def test_pooling_by_position_exports_without_a_data_dependent_size():
    model, inputs = tiny_model("bart", TASK)
    auto = torch.export.Dim.AUTO
    shapes = {"input_ids": {0: auto, 1: auto}, "attention_mask": {0: auto, 1: auto}, "use_cache": None}
    with torch.no_grad(), apply_patches(text_classification.KEY):
        program = torch.export.export(model, (), {**inputs, "use_cache": False}, dynamic_shapes=shapes)
    # the boolean-mask index and its checks left sizes of unknown value (unbacked) in the program
    assert not [n.name for n in program.graph.nodes if free_unbacked_symbols(n.meta.get("val"))]
    second, _ = derive_second_inputs(model, inputs)
    with torch.no_grad():
        expected = model(**second, use_cache=False).logits
        got = program.module()(**second, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_perceiver_gets_text_inputs_and_a_small_latent_array():
    # its forward's main input is `inputs` (any modality): the sample was empty and eager failed on
    # embedding(None); the default latent array made the tiny model 270M parameters
    model, inputs = tiny_model("perceiver", TASK, check_eager=True)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {"input_ids": (2, 8), "attention_mask": (2, 8)}
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with torch.no_grad():
        logits = model(**inputs).logits
        again = model(inputs=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert tuple(logits.shape) == (2, 3)
    torch.testing.assert_close(logits, again, atol=0, rtol=0)  # input_ids are the text preprocessor's inputs
