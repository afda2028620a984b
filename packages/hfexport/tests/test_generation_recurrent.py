"""hfexport.generation.recurrent: the prefill/decode wrappers of recurrent-state models, eagerly.

The wrappers run the model's own forward with the state as named tensors; run by the greedy runner
(each component called eagerly, no export) they must reproduce ``model.generate`` token for token
and logit for logit. The exported components are checked in tests-integration/test_recurrences.py.
"""

from __future__ import annotations

import pytest
import torch

from hfexport.generation import GenerationRunner
from hfexport.generation.decompose import decompose_for_generation
from hfexport.generation.export import check_generation_cache
from hfexport.generation.recurrent import (
    RWKV_STATE_NAMES,
    RecurrentStateComponent,
    decompose_recurrent,
    is_recurrent_state_model,
    recurrent_state_names,
)
from hfexport.testing import tiny_model
from hfexport.testing.generation import check_greedy_parity, eager_component_callers

NEW_TOKENS = 6


@pytest.mark.parametrize("model_type", ["mamba", "rwkv", "recurrent_gemma"])
def test_the_wrappers_generate_what_generate_does(model_type):
    model, inputs = tiny_model(model_type, "text-generation", seed=0)
    decomposition = decompose_for_generation(model, inputs)
    assert list(decomposition) == ["prefill", "decode"]
    assert all(isinstance(m, RecurrentStateComponent) for m, _ in decomposition.values())
    names = [f"cache.{n}" for n in recurrent_state_names(model)]
    extra = ["position_ids"] if model_type == "recurrent_gemma" else []  # its RG-LRU resets at position 0
    assert decomposition.plan.io["decode"].tensor_paths == ["input_ids", *names, *extra]
    assert decomposition.plan.io["decode"].outputs == ["logits", *names]
    runner = GenerationRunner(decomposition.plan, eager_component_callers(decomposition))
    check_greedy_parity(runner, model, (3, 9), new_tokens=NEW_TOKENS, atol=1e-5)


def test_the_decode_step_continues_the_state_rather_than_restarting_it():
    # a decode step on the prompt's state differs from one on a zero state: the state is carried
    model, inputs = tiny_model("mamba", "text-generation", seed=0)
    decomposition = decompose_recurrent(model, inputs)
    decode, kwargs = decomposition["decode"]
    zero = {k: torch.zeros_like(v) for k, v in kwargs["cache"].items()}
    with torch.no_grad():
        carried = decode(input_ids=kwargs["input_ids"], cache=kwargs["cache"])["logits"]
        restarted = decode(input_ids=kwargs["input_ids"], cache=zero)["logits"]
        plain = model(input_ids=kwargs["input_ids"], use_cache=False).logits
    assert (carried - restarted).abs().max().item() > 1e-3
    torch.testing.assert_close(restarted, plain, atol=1e-5, rtol=1e-5)
    # the inputs are not written in place (the model updates its cache with copy_)
    before = {k: v.clone() for k, v in kwargs["cache"].items()}
    with torch.no_grad():
        decode(input_ids=kwargs["input_ids"], cache=kwargs["cache"])
    assert all(torch.equal(before[k], kwargs["cache"][k]) for k in before)


def test_state_names_follow_the_cache_layers():
    mamba, _ = tiny_model("mamba", "text-generation", seed=0)
    layers = mamba.config.num_hidden_layers
    assert recurrent_state_names(mamba) == [
        f"layers.{i}.{kind}" for i in range(layers) for kind in ("conv_states", "recurrent_states")
    ]
    rwkv, _ = tiny_model("rwkv", "text-generation", seed=0)
    assert recurrent_state_names(rwkv) == list(RWKV_STATE_NAMES)


def test_bad_arguments_raise_typed_errors_that_say_what_to_do():
    model, inputs = tiny_model("mamba", "text-generation", seed=0)
    with pytest.raises(ValueError, match="one token at a time"):
        decompose_recurrent(model, inputs, multi_token_decode=True)
    with pytest.raises(ValueError, match="input_ids"):
        decompose_recurrent(model, {"inputs_embeds": torch.zeros(1, 2, 3)})
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        RecurrentStateComponent(model, "encode")
    with pytest.raises(ValueError, match="previous call's cache"):
        RecurrentStateComponent(model, "decode")(input_ids=inputs["input_ids"][:, :1])
    llama, _ = tiny_model("llama")
    assert not is_recurrent_state_model(llama)
    with pytest.raises(ValueError, match="supported: "):
        recurrent_state_names(llama)


def test_every_recurrent_type_is_carried_now():
    from hfexport.generation.export import RECURRENT_STATE_TYPES
    from hfexport.generation.recurrent import RECURRENT_GENERATION_TYPES

    assert RECURRENT_STATE_TYPES <= RECURRENT_GENERATION_TYPES
    for model_type in ("mamba", "recurrent_gemma"):
        model, _ = tiny_model(model_type, "text-generation", seed=0)
        check_generation_cache(model)  # no refusal


def test_recurrent_gemma_state_names_and_its_module_states_restored():
    model, inputs = tiny_model("recurrent_gemma", "text-generation", seed=0)
    names = recurrent_state_names(model)
    assert names == ["layers.0.conv_states", "layers.0.recurrent_states", "layers.1.keys", "layers.1.values"]
    block = model.model.layers[0].temporal_block
    before = (block.conv1d_state, block.rg_lru.recurrent_states)
    decomposition = decompose_recurrent(model, inputs)
    # the wrappers put back the module-held states they replaced
    assert block.conv1d_state is before[0] and block.rg_lru.recurrent_states is before[1]
    prefill, kwargs = decomposition["prefill"]
    with pytest.raises(ValueError, match="position_ids"):
        prefill(input_ids=kwargs["input_ids"])


def test_a_recurrent_type_without_components_would_be_refused_up_front(monkeypatch):
    # no such type today; the refusal stays for the next one (its message says what to export instead)
    import hfexport.generation.export as export_module
    from hfexport.errors import UnsupportedModelError

    llama, _ = tiny_model("llama")
    monkeypatch.setattr(export_module, "RECURRENT_STATE_TYPES", frozenset({"llama"}))
    with pytest.raises(UnsupportedModelError, match=r"llama's generation state is a recurrence.*--task auto"):
        check_generation_cache(llama)
