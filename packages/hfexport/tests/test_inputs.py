"""Tests for hfexport.inputs: input checks, reversible flags/attention/state patches, preparers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlavaForConditionalGeneration
from transformers.modeling_outputs import CausalLMOutputWithPast

from hfexport.errors import UnsupportedInputError, UnsupportedModelError
from hfexport.inputs import (
    apply_output_flags,
    attention_for_export,
    precompute_export_inputs,
    prepare_for_export,
    register_export_input_preparer,
    registered_export_input_preparers,
    restore_model_state,
    unregister_export_input_preparer,
)
from hfexport.tensors import get_leaf_tensors


def _llama(**kwargs):
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()


@pytest.fixture
def llama():
    return _llama()


@pytest.fixture
def input_ids():
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------
# loss inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["labels", "future_values"])
def test_loss_inputs_are_refused_with_the_key_named(llama, input_ids, key):
    with pytest.raises(UnsupportedInputError) as info:
        prepare_for_export(llama, {"input_ids": input_ids, key: input_ids.clone()})
    message = str(info.value)
    assert f"'{key}'" in message
    assert "loss/training path is not exported" in message
    assert f"Drop '{key}'" in message
    assert isinstance(info.value, ValueError)


def test_return_loss_true_is_refused_and_false_or_none_dropped(llama, input_ids):
    with pytest.raises(UnsupportedInputError, match=r"'return_loss=True'.*Drop 'return_loss'"):
        prepare_for_export(llama, {"input_ids": input_ids, "return_loss": True})
    _, prepared, flags = prepare_for_export(
        llama, {"input_ids": input_ids, "return_loss": False, "labels": None}
    )
    assert list(prepared) == ["input_ids"]
    assert flags == {}


def test_non_mapping_inputs_are_refused(llama, input_ids):
    with pytest.raises(TypeError, match="dict with string keys"):
        prepare_for_export(llama, [input_ids])


# ---------------------------------------------------------------------------------------------
# output flags
# ---------------------------------------------------------------------------------------------


def test_flags_are_popped_not_applied(llama, input_ids):
    inputs = {
        "input_ids": input_ids,
        "use_cache": False,
        "output_hidden_states": True,
        "return_dict": False,
        "output_attentions": None,
    }
    before = llama.config.to_dict()
    model, prepared, flags = prepare_for_export(llama, inputs)

    assert model is llama
    assert list(prepared) == ["input_ids"]
    assert prepared["input_ids"] is input_ids
    assert flags == {"use_cache": False, "output_hidden_states": True, "return_dict": False}
    assert len(inputs) == 5  # the caller's dict is not modified
    assert llama.config.to_dict() == before
    assert llama.config.use_cache is True and llama.config.output_hidden_states is False


def test_apply_output_flags_only_inside_the_with(llama, input_ids):
    before = llama.config.to_dict()
    _, prepared, flags = prepare_for_export(
        llama, {"input_ids": input_ids, "use_cache": False, "output_hidden_states": True}
    )
    with torch.no_grad(), apply_output_flags(llama, flags):
        assert llama.config.use_cache is False
        assert llama.config.output_hidden_states is True
        inside = llama(**prepared)
    assert list(inside.keys()) == ["logits", "hidden_states"]
    assert len(inside.hidden_states) == 3

    assert llama.config.to_dict() == before
    with torch.no_grad():
        after = llama(**prepared)
    assert list(after.keys()) == ["logits", "cache"]
    torch.testing.assert_close(after.logits, inside.logits)


def test_apply_output_flags_restores_after_an_exception(llama):
    before = llama.config.to_dict()
    with (
        pytest.raises(RuntimeError, match="boom"),
        apply_output_flags(llama, {"use_cache": False, "new_flag": 1}),
    ):
        assert llama.config.new_flag == 1
        raise RuntimeError("boom")
    assert llama.config.to_dict() == before
    assert not hasattr(llama.config, "new_flag")


def test_return_dict_false_returns_tuples_inside_only(llama, input_ids):
    with torch.no_grad():
        reference = llama(input_ids=input_ids)
        with apply_output_flags(llama, {"return_dict": False}):
            assert llama.config.return_dict is True  # not written to the shared config
            inside = llama(input_ids=input_ids)
        after = llama(input_ids=input_ids)
    assert type(inside) is tuple and len(inside) == 2
    torch.testing.assert_close(inside[0], reference.logits)
    assert type(inside[1]) is DynamicCache
    assert isinstance(after, CausalLMOutputWithPast)
    assert "forward" not in vars(llama)


def test_output_attentions_needs_eager(llama, input_ids):
    before = llama.config.to_dict()
    with (
        pytest.raises(UnsupportedInputError, match="attn_implementation='eager'"),
        apply_output_flags(llama, {"use_cache": False, "output_attentions": True}),
    ):
        pass
    assert llama.config.to_dict() == before

    eager = _llama(attn_implementation="eager")
    eager_before = eager.config.to_dict()
    with torch.no_grad(), apply_output_flags(eager, {"output_attentions": True}):
        output = eager(input_ids=input_ids)
    assert [tuple(attention.shape) for attention in output.attentions] == [(2, 4, 5, 5)] * 2
    assert eager.config.to_dict() == eager_before


def _tiny_llava():
    config = AutoConfig.for_model(
        "llava",
        text_config={
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
        },
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
        image_token_id=99,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config)


def test_flags_reach_sub_configs_that_have_them():
    model = _tiny_llava()
    text, vision = model.config.text_config, model.config.vision_config
    assert not hasattr(model.config, "use_cache") and not hasattr(vision, "use_cache")
    dicts = (model.config.to_dict(), text.to_dict(), vision.to_dict())

    with apply_output_flags(model, {"use_cache": False, "output_hidden_states": True}):
        assert model.config.use_cache is False  # created on the top config
        assert text.use_cache is False
        assert not hasattr(vision, "use_cache")
        assert (
            model.config.output_hidden_states,
            text.output_hidden_states,
            vision.output_hidden_states,
        ) == (
            True,
            True,
            True,
        )
    assert not hasattr(model.config, "use_cache")
    assert text.use_cache is True
    assert (model.config.to_dict(), text.to_dict(), vision.to_dict()) == dicts


# ---------------------------------------------------------------------------------------------
# dtype / device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_inputs_follow_the_model_dtype(input_ids, dtype):
    model = _llama(dtype=dtype)
    assert model.dtype == dtype
    embeds = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 5, dtype=torch.int64)
    cache = DynamicCache()
    cache.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), 0)
    _, prepared, _ = prepare_for_export(
        model, {"inputs_embeds": embeds, "attention_mask": mask, "input_ids": input_ids, "cache": cache}
    )
    dtypes = {path: tensor.dtype for path, tensor in get_leaf_tensors(prepared).items()}
    assert dtypes == {
        "inputs_embeds": dtype,
        "attention_mask": torch.int64,
        "input_ids": torch.int64,
        "cache.layers.0.keys": dtype,
        "cache.layers.0.values": dtype,
    }
    assert prepared["attention_mask"] is mask
    torch.testing.assert_close(prepared["inputs_embeds"], embeds.to(dtype))
    assert embeds.dtype == torch.float32 and cache.layers[0].keys.dtype == torch.float32

    with torch.no_grad():
        output = model(inputs_embeds=prepared["inputs_embeds"], attention_mask=mask)
    assert output.logits.dtype == dtype


# ---------------------------------------------------------------------------------------------
# preparers
# ---------------------------------------------------------------------------------------------


def _grid_preparer(model, inputs):
    grid = inputs["image_grid_thw"]
    inputs["vision_lengths"] = grid.prod(dim=-1)
    return inputs


@pytest.fixture
def grid_preparer():
    register_export_input_preparer("image_grid_thw")(_grid_preparer)
    yield _grid_preparer
    unregister_export_input_preparer(_grid_preparer)


def test_preparer_runs_only_when_markers_present(llama, input_ids, grid_preparer):
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    _, prepared, _ = prepare_for_export(llama, {"input_ids": input_ids, "image_grid_thw": grid})
    assert list(prepared) == ["input_ids", "image_grid_thw", "vision_lengths"]
    assert prepared["vision_lengths"].tolist() == [24, 8]

    _, without, _ = prepare_for_export(llama, {"input_ids": input_ids})
    assert list(without) == ["input_ids"]
    assert list(precompute_export_inputs(llama, {"image_grid_thw": None})) == ["image_grid_thw"]


def test_preparer_needs_all_markers_and_reregistration_is_idempotent(llama):
    calls = []

    def both(model, inputs):
        calls.append(sorted(inputs))
        return {**inputs, "combined": inputs["a"] + inputs["b"]}

    try:
        register_export_input_preparer("a", "b")(both)
        register_export_input_preparer("a", "b")(both)
        names = [preparer.name for preparer in registered_export_input_preparers()]
        assert names.count(f"{__name__}.{both.__qualname__}") == 1

        assert precompute_export_inputs(llama, {"a": torch.tensor(1)}) == {"a": torch.tensor(1)}
        result = precompute_export_inputs(llama, {"a": torch.tensor(1), "b": torch.tensor(2)})
        assert result["combined"].item() == 3
        assert calls == [["a", "b"]]
    finally:
        assert unregister_export_input_preparer(both)
    assert not unregister_export_input_preparer(both)


def test_preparer_must_return_a_mapping(llama):
    def broken(model, inputs):
        return [inputs]

    register_export_input_preparer("x")(broken)
    try:
        with pytest.raises(TypeError, match="expected a dict of inputs"):
            precompute_export_inputs(llama, {"x": torch.ones(1)})
    finally:
        unregister_export_input_preparer(broken)
    with pytest.raises(ValueError, match="input key names"):
        register_export_input_preparer()


# ---------------------------------------------------------------------------------------------
# attention implementation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_untraceable_attention_is_switched_to_sdpa_inside_only(llama, input_ids, implementation):
    with torch.no_grad():
        reference = llama(input_ids=input_ids).logits
    llama.config._attn_implementation = implementation  # forced: never run outside the with
    before = llama.config.to_dict()

    with torch.no_grad(), attention_for_export(llama):
        assert llama.config._attn_implementation == "sdpa"
        assert llama.model.config._attn_implementation == "sdpa"
        inside = llama(input_ids=input_ids).logits
    torch.testing.assert_close(inside, reference)
    assert llama.config._attn_implementation == implementation
    assert llama.config.to_dict() == before

    with pytest.raises(RuntimeError, match="boom"), attention_for_export(llama):
        assert llama.config._attn_implementation == "sdpa"
        raise RuntimeError("boom")
    assert llama.config._attn_implementation == implementation


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_traceable_attention_is_left_alone(llama, monkeypatch, implementation):
    llama.set_attn_implementation(implementation)

    def fail(*args, **kwargs):
        raise AssertionError("set_attn_implementation must not be called")

    monkeypatch.setattr(llama, "set_attn_implementation", fail)
    with attention_for_export(llama):
        assert llama.config._attn_implementation == implementation
    assert llama.config._attn_implementation == implementation


def test_only_the_sub_config_with_untraceable_attention_is_switched():
    model = _tiny_llava()
    model.set_attn_implementation("eager")
    model.config.vision_config._attn_implementation = "flash_attention_2"
    before = model.config.to_dict()

    def implementations():
        return (
            model.config._attn_implementation,
            model.config.text_config._attn_implementation,
            model.model.vision_tower.config._attn_implementation,
        )

    assert implementations() == ("eager", "eager", "flash_attention_2")
    with attention_for_export(model):
        assert implementations() == ("eager", "eager", "sdpa")
    assert implementations() == ("eager", "eager", "flash_attention_2")
    assert model.config.to_dict() == before


def test_model_without_sdpa_is_refused(llama):
    llama.config._attn_implementation = "flex_attention"
    llama._supports_sdpa = False
    with pytest.raises(UnsupportedModelError) as info, attention_for_export(llama):
        pass
    message = str(info.value)
    assert "flex_attention" in message
    assert 'attn_implementation="sdpa"' in message and 'attn_implementation="eager"' in message
    assert isinstance(info.value, ValueError)
    assert llama.config._attn_implementation == "flex_attention"


# ---------------------------------------------------------------------------------------------
# model state
# ---------------------------------------------------------------------------------------------


def test_restore_model_state_after_an_exception(llama):
    llama.train()
    llama.lm_head.eval()
    llama.model.embed_tokens.weight.requires_grad_(False)
    before = llama.config.to_dict()
    training = {name: module.training for name, module in llama.named_modules()}
    grads = {name: parameter.requires_grad for name, parameter in llama.named_parameters()}
    assert training[""] is True and training["lm_head"] is False

    with pytest.raises(RuntimeError, match="boom"), restore_model_state(llama) as model:
        assert model is llama
        assert not any(module.training for module in llama.modules())
        for parameter in llama.parameters():
            parameter.requires_grad_(not parameter.requires_grad)
        llama.config.use_cache = False
        llama.config.scratch = "x"
        raise RuntimeError("boom")

    assert {name: module.training for name, module in llama.named_modules()} == training
    assert {name: parameter.requires_grad for name, parameter in llama.named_parameters()} == grads
    assert llama.config.to_dict() == before
    assert not hasattr(llama.config, "scratch")


# ---------------------------------------------------------------------------------------------
# heads that never generate are exported without their KV cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "task", "expected"),
    [
        ("llama", "text-classification", {"use_cache": False}),
        ("bart", "text-classification", {"use_cache": False}),
        ("gpt2", "token-classification", {"use_cache": False}),
        ("llama", "question-answering", {}),  # its forward takes no use_cache (returns no cache)
        ("bert", "text-classification", {}),  # no cache in its forward: nothing to turn off
        ("llama", "text-generation", {}),  # a generating head keeps its cache
    ],
)
def test_scoring_heads_turn_the_cache_off_unless_the_inputs_set_it(model_type, task, expected):
    from hfexport.tiny import tiny_model

    model, inputs = tiny_model(model_type, task)
    before = model.config.to_dict()
    _, prepared, flags = prepare_for_export(model, inputs)
    assert flags == expected
    assert "use_cache" not in prepared
    assert model.config.to_dict() == before  # the flag is applied later, inside apply_output_flags
    if expected:
        _, _, explicit = prepare_for_export(model, {**inputs, "use_cache": True})
        assert explicit == {"use_cache": True}  # the caller's choice wins
