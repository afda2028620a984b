"""Tests for hfexport.tensors: leaf paths, copies and casts over real transformers caches."""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, DynamicCache, StaticCache
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionLayer,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from hfexport.tensors import (
    cache_layer_state,
    cast_leaf_tensors,
    duplicate_leaf_tensors,
    get_leaf_tensors,
    register_cache_layer_state,
    set_leaf_tensors,
)

BATCH, SEQ, KV_HEADS, HEAD_DIM = 2, 5, 2, 8


def _llama_config():
    return AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        vocab_size=100,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_llama_config()).eval()


@pytest.fixture(scope="module")
def input_ids():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 100, (BATCH, SEQ), generator=generator)


@pytest.fixture
def llama_output(llama, input_ids):
    with torch.no_grad():
        return llama(input_ids=input_ids, use_cache=True)


@pytest.fixture
def filled_static_cache(llama, input_ids):
    cache = StaticCache(config=llama.config, max_cache_len=16)
    with torch.no_grad():
        llama(input_ids=input_ids, cache=cache, use_cache=True)
    return cache


KV_PATHS = [
    "cache.layers.0.keys",
    "cache.layers.0.values",
    "cache.layers.1.keys",
    "cache.layers.1.values",
]


# ---------------------------------------------------------------------------------------------
# get_leaf_tensors
# ---------------------------------------------------------------------------------------------


def test_forward_kwargs_with_dynamic_cache_from_a_real_forward(llama_output, input_ids):
    cache = llama_output.cache
    assert type(cache) is DynamicCache
    mask = torch.ones_like(input_ids)
    leaves = get_leaf_tensors({"input_ids": input_ids, "attention_mask": mask, "cache": cache})

    assert list(leaves) == ["input_ids", "attention_mask", *KV_PATHS]
    assert leaves["input_ids"] is input_ids
    assert leaves["attention_mask"] is mask
    for index in range(2):
        assert leaves[f"cache.layers.{index}.keys"] is cache.layers[index].keys
        assert leaves[f"cache.layers.{index}.values"] is cache.layers[index].values
    for path in KV_PATHS:
        assert tuple(leaves[path].shape) == (BATCH, KV_HEADS, SEQ, HEAD_DIM)
        assert leaves[path].dtype == torch.float32


def test_model_output_keeps_field_order_and_skips_none_fields(llama, input_ids):
    with torch.no_grad():
        output = llama(input_ids=input_ids, use_cache=True, output_hidden_states=True)
    assert output.loss is None
    leaves = get_leaf_tensors(output)

    hidden = [f"hidden_states.{index}" for index in range(3)]  # embeddings + 2 layers
    assert list(leaves) == ["logits", *KV_PATHS, *hidden]
    assert tuple(leaves["logits"].shape) == (BATCH, SEQ, 100)
    assert all(tuple(leaves[path].shape) == (BATCH, SEQ, 32) for path in hidden)
    assert torch.equal(leaves["hidden_states.0"], llama.model.embed_tokens(input_ids))


def test_prefix_is_prepended(llama_output):
    leaves = get_leaf_tensors(llama_output, prefix="outputs")
    assert list(leaves)[:2] == ["outputs.logits", "outputs.cache.layers.0.keys"]


def test_static_cache_is_lazy_then_exposes_keys_values_and_position_counter(
    llama, input_ids, llama_output, filled_static_cache
):
    empty = StaticCache(config=llama.config, max_cache_len=16)
    assert [layer.is_initialized for layer in empty.layers] == [False, False]
    assert get_leaf_tensors({"cache": empty}) == {}

    leaves = get_leaf_tensors({"cache": filled_static_cache})
    assert list(leaves) == [
        "cache.layers.0.keys",
        "cache.layers.0.values",
        "cache.layers.0.cumulative_length",
        "cache.layers.1.keys",
        "cache.layers.1.values",
        "cache.layers.1.cumulative_length",
    ]
    assert tuple(leaves["cache.layers.0.keys"].shape) == (BATCH, KV_HEADS, 16, HEAD_DIM)
    assert leaves["cache.layers.1.cumulative_length"].item() == SEQ
    # The static cache holds the same keys as the dynamic one for the filled positions, zeros after.
    dynamic = llama_output.cache
    for index in range(2):
        static_keys = leaves[f"cache.layers.{index}.keys"]
        torch.testing.assert_close(static_keys[:, :, :SEQ], dynamic.layers[index].keys)
        assert torch.count_nonzero(static_keys[:, :, SEQ:]) == 0


def test_encoder_decoder_cache_from_a_real_t5_forward():
    config = AutoConfig.for_model(
        "t5", d_model=16, d_kv=4, num_heads=2, num_layers=2, num_decoder_layers=2, d_ff=32, vocab_size=100
    )
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        output = model(
            input_ids=torch.randint(0, 100, (2, 7)),
            decoder_input_ids=torch.randint(0, 100, (2, 3)),
            use_cache=True,
        )
    assert type(output.cache) is EncoderDecoderCache
    leaves = get_leaf_tensors(output)

    expected = ["logits"]
    for part in ("self_attention_cache", "cross_attention_cache"):
        for index in range(2):
            expected += [f"cache.{part}.layers.{index}.keys", f"cache.{part}.layers.{index}.values"]
    expected.append("encoder_last_hidden_state")
    assert list(leaves) == expected
    # self attention over the 3 decoder tokens, cross attention over the 7 encoder tokens
    assert tuple(leaves["cache.self_attention_cache.layers.1.values"].shape) == (2, 2, 3, 4)
    assert tuple(leaves["cache.cross_attention_cache.layers.0.keys"].shape) == (2, 2, 7, 4)
    assert (
        leaves["cache.cross_attention_cache.layers.0.keys"]
        is output.cache.cross_attention_cache.layers[0].keys
    )


class _Mode(enum.Enum):
    FAST = 1


class _Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclasses.dataclass
class _Record:
    weight: torch.Tensor
    mode: _Mode
    extra: list


def test_containers_paths_and_skipped_values():
    a, b, c, d, e = (torch.full((1,), float(value)) for value in range(5))
    tree = {
        "record": _Record(weight=a, mode=_Mode.FAST, extra=[b, 3, "text", None]),
        "pair": _Pair(first=c, second=2.5),
        "nested": OrderedDict(inner=(d, (e,))),
        "flag": True,
        "dtype": torch.float16,
        "none": None,
    }
    leaves = get_leaf_tensors(tree)
    assert list(leaves) == [
        "record.weight",
        "record.extra.0",
        "pair.first",
        "nested.inner.0",
        "nested.inner.1.0",
    ]
    assert [leaf.item() for leaf in leaves.values()] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_single_tensor_gets_the_prefix_as_path():
    tensor = torch.zeros(2)
    assert get_leaf_tensors(tensor, prefix="x") == {"x": tensor}


def test_colliding_paths_raise():
    with pytest.raises(ValueError, match="share the path '1'"):
        get_leaf_tensors({1: torch.zeros(1), "1": torch.ones(1)})


def test_sliding_window_layer_exposes_only_keys_and_values():
    config = AutoConfig.for_model(
        "mistral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        sliding_window=4,
    )
    cache = DynamicCache(config=config)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer] * 2
    keys = torch.arange(1 * 2 * 6 * 8, dtype=torch.float32).reshape(1, 2, 6, 8)
    cache.update(keys, keys + 1, 0)

    leaves = get_leaf_tensors(cache)
    # layer 1 was never updated: lazily uninitialised, no state
    assert list(leaves) == ["layers.0.keys", "layers.0.values"]
    # the window keeps sliding_window - 1 tokens; the window size tensor is config, not state
    torch.testing.assert_close(leaves["layers.0.keys"], keys[:, :, -3:])
    assert cache.layers[0]._sliding_window_tensor.item() == 4


def test_linear_attention_and_dummy_layers():
    linear = LinearAttentionLayer(number_of_states=2)
    conv = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4)
    recurrent = torch.ones(1, 3, 5)
    linear.update_conv_state(conv, state_idx=1)
    linear.update_recurrent_state(recurrent, state_idx=1)
    cache = Cache(layers=[linear, DummyLayer()])

    leaves = get_leaf_tensors(cache)
    assert list(leaves) == ["layers.0.conv_states.1", "layers.0.recurrent_states.1"]
    torch.testing.assert_close(leaves["layers.0.conv_states.1"], conv)
    torch.testing.assert_close(leaves["layers.0.recurrent_states.1"], recurrent)


class _IndexLayer(DynamicLayer):
    """A model-file layer with an extra buffer, like the sparse attention layers of some models."""

    def __init__(self) -> None:
        super().__init__()
        self.idx_keys: torch.Tensor | None = None
        self._scratch = torch.zeros(1)


class _RegisteredLayer(DynamicLayer):
    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.zeros(3)
        self.hidden = torch.ones(1)


def test_unregistered_layer_attributes_holding_tensors_are_state():
    layer = _IndexLayer()
    layer.update(torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    layer.idx_keys = torch.full((1, 2, 3), 7.0)
    assert list(cache_layer_state(layer, "cache.layers.3")) == [
        "cache.layers.3.keys",
        "cache.layers.3.values",
        "cache.layers.3.idx_keys",
    ]


def test_registered_layer_state_order():
    register_cache_layer_state(_RegisteredLayer, "positions")
    layer = _RegisteredLayer()
    layer.update(torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert list(cache_layer_state(layer)) == ["keys", "values", "positions", "hidden"]
    with pytest.raises(ValueError, match="at least one attribute"):
        register_cache_layer_state(_RegisteredLayer)


# ---------------------------------------------------------------------------------------------
# duplicate_leaf_tensors
# ---------------------------------------------------------------------------------------------


def test_duplicate_dynamic_cache_is_independent(llama, llama_output):
    original = llama_output.cache
    before = {path: tensor.clone() for path, tensor in get_leaf_tensors(original).items()}
    copy = duplicate_leaf_tensors(original)

    assert type(copy) is DynamicCache
    assert copy is not original and copy.layers is not original.layers
    assert all(new is not old for new, old in zip(copy.layers, original.layers))
    copied = get_leaf_tensors(copy)
    assert list(copied) == list(before)
    for path, tensor in copied.items():
        assert torch.equal(tensor, before[path])
        assert tensor.data_ptr() != get_leaf_tensors(original)[path].data_ptr()

    copy.layers[0].keys.add_(1.0)
    with torch.no_grad():
        llama(input_ids=torch.tensor([[3], [4]]), cache=copy, use_cache=True)
    assert copy.get_seq_length() == SEQ + 1
    assert original.get_seq_length() == SEQ
    for path, tensor in get_leaf_tensors(original).items():
        assert torch.equal(tensor, before[path])


def test_duplicate_static_cache_clones_the_position_counter(llama, filled_static_cache):
    original = filled_static_cache
    copy = duplicate_leaf_tensors(original)
    assert type(copy) is StaticCache
    assert [type(layer) for layer in copy.layers] == [type(layer) for layer in original.layers]

    with torch.no_grad():
        llama(input_ids=torch.tensor([[3], [4]]), cache=copy, use_cache=True)
    assert copy.layers[0].cumulative_length.item() == SEQ + 1
    assert original.layers[0].cumulative_length.item() == SEQ
    assert torch.count_nonzero(copy.layers[0].keys[:, :, SEQ]) > 0
    assert torch.count_nonzero(original.layers[0].keys[:, :, SEQ]) == 0


def test_duplicate_model_output_and_encoder_decoder_cache():
    self_cache, cross_cache = DynamicCache(), DynamicCache()
    self_cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    cross_cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    output = CausalLMOutputWithPast(
        logits=torch.randn(1, 3, 10), cache=EncoderDecoderCache(self_cache, cross_cache)
    )

    copy = duplicate_leaf_tensors(output)
    assert type(copy) is CausalLMOutputWithPast
    assert list(copy.keys()) == ["logits", "cache"]
    assert type(copy.cache) is EncoderDecoderCache
    assert copy.cache.cross_attention_cache is not cross_cache
    assert (
        copy.cache.is_updated == output.cache.is_updated
        and copy.cache.is_updated is not output.cache.is_updated
    )
    copy.cache.cross_attention_cache.layers[0].values.fill_(9.0)
    copy.logits.zero_()
    assert torch.count_nonzero(cross_cache.layers[0].values) == 0
    assert torch.count_nonzero(output.logits) > 0


def test_duplicate_keeps_aliasing_and_grad_flags():
    shared = torch.ones(2)
    leaf = torch.ones(2, requires_grad=True)
    computed = leaf * 2
    copy = duplicate_leaf_tensors({"a": shared, "b": shared, "leaf": leaf, "computed": computed, "n": 3})
    assert copy["a"] is copy["b"] and copy["a"] is not shared
    assert copy["leaf"].requires_grad and copy["leaf"].is_leaf
    assert not copy["computed"].requires_grad
    assert torch.equal(copy["computed"], torch.full((2,), 2.0))
    assert copy["n"] == 3


# ---------------------------------------------------------------------------------------------
# cast_leaf_tensors
# ---------------------------------------------------------------------------------------------


def test_cast_changes_floating_tensors_only(llama_output):
    ids = torch.tensor([[1, 2]])
    mask = torch.tensor([[True, False]])
    tree = {"ids": ids, "mask": mask, "x": torch.ones(2), "cache": llama_output.cache}

    cast = cast_leaf_tensors(tree, dtype=torch.float16)
    dtypes = {path: tensor.dtype for path, tensor in get_leaf_tensors(cast).items()}
    assert dtypes == {"ids": torch.int64, "mask": torch.bool, "x": torch.float16} | dict.fromkeys(
        KV_PATHS, torch.float16
    )
    assert cast["ids"] is ids and cast["mask"] is mask
    assert type(cast["cache"]) is DynamicCache and cast["cache"] is not llama_output.cache
    torch.testing.assert_close(
        cast["cache"].layers[1].values.float(), llama_output.cache.layers[1].values, atol=1e-3, rtol=1e-3
    )
    # the input is untouched
    assert llama_output.cache.layers[0].keys.dtype == torch.float32
    assert tree["x"].dtype == torch.float32


def test_cast_all_dtypes_when_not_floating_only():
    cast = cast_leaf_tensors(
        {"ids": torch.tensor([1, 2]), "x": torch.ones(1)}, torch.float64, floating_only=False
    )
    assert cast["ids"].dtype == torch.float64 and cast["x"].dtype == torch.float64
    assert cast["ids"].tolist() == [1.0, 2.0]


def test_cast_device_moves_every_tensor_and_cache_bookkeeping(filled_static_cache):
    tree = {"ids": torch.tensor([1]), "cache": filled_static_cache}
    moved = cast_leaf_tensors(tree, device="meta")
    assert {tensor.device.type for tensor in get_leaf_tensors(moved).values()} == {"meta"}
    assert moved["cache"].layers[0].device == torch.device("meta")
    assert moved["cache"].layers[0].keys.dtype == torch.float32
    assert filled_static_cache.layers[0].device == torch.device("cpu")
    assert filled_static_cache.layers[0].keys.device.type == "cpu"


def test_cast_rejects_non_dtype():
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        cast_leaf_tensors({"x": torch.ones(1)}, dtype="float16")


# ---------------------------------------------------------------------------------------------
# set_leaf_tensors
# ---------------------------------------------------------------------------------------------


def test_set_leaf_tensors_replaces_by_path(llama_output):
    replacement = torch.zeros(BATCH, KV_HEADS, SEQ, HEAD_DIM)
    new = set_leaf_tensors({"cache": llama_output.cache}, {"cache.layers.1.values": replacement})
    assert new["cache"].layers[1].values is replacement
    assert new["cache"].layers[0].values is llama_output.cache.layers[0].values
    assert llama_output.cache.layers[1].values is not replacement

    with pytest.raises(KeyError, match=r"cache\.layers\.2\.keys"):
        set_leaf_tensors({"cache": llama_output.cache}, {"cache.layers.2.keys": replacement})
    with pytest.raises(TypeError, match="not a tensor"):
        set_leaf_tensors({"x": torch.ones(1)}, {"x": 1.0})


def test_contiguous_leaf_tensors_gives_row_major_strides_on_size_one_axes():
    from hfexport.tensors import contiguous_leaf_tensors

    # torch calls a permuted 1x1 map contiguous and .contiguous() keeps its strides; ExecuTorch reads
    # them as channels-last (pytorch/executorch#22520, issue 28)
    permuted = torch.randn(2, 1, 1, 8).permute(0, 3, 1, 2)
    plain = torch.randn(2, 8, 1, 1)
    out = contiguous_leaf_tensors({"a": permuted, "b": plain, "c": permuted.transpose(0, 1)})
    assert out["a"].stride() == (8, 1, 1, 1) and torch.equal(out["a"], permuted)
    assert out["b"] is plain  # already row-major: shared, not copied
    assert out["c"].stride() == (2, 1, 1, 1) and torch.equal(out["c"], permuted.transpose(0, 1))
