"""Multi-token decode: merging single-token decode steps, and deriving decode inputs of other lengths."""

from __future__ import annotations

import pytest
import torch

from hfexport.generation.decode import decode_inputs_for_query_length, merge_decode_steps, query_length


def _step(token: int, pos: int, mask_len: int, batch: int = 2) -> dict:
    return {
        "input_ids": torch.full((batch, 1), token),
        "position_ids": torch.full((batch, 1), pos),
        "cache_position": torch.tensor([pos]),
        "attention_mask": torch.ones(batch, mask_len, dtype=torch.int64),
        "use_cache": True,
    }


def test_merge_concatenates_tokens_positions_and_takes_widest_2d_mask() -> None:
    merged = merge_decode_steps([_step(5, 8, 9), _step(6, 9, 10)])
    assert merged["input_ids"].tolist() == [[5, 6], [5, 6]]
    assert merged["position_ids"].tolist() == [[8, 9], [8, 9]]
    assert merged["cache_position"].tolist() == [8, 9]
    assert merged["attention_mask"].shape == (2, 10)
    assert merged["use_cache"] is True
    assert query_length(merged) == 2


def test_merge_keeps_the_first_steps_cache_object() -> None:
    first, second = object(), object()
    a, b = _step(1, 3, 4), _step(2, 4, 5)
    a["cache"], b["cache"] = first, second
    assert merge_decode_steps([a, b])["cache"] is first


def test_merge_mrope_positions_on_last_dim() -> None:
    a = {"input_ids": torch.tensor([[7]]), "position_ids": torch.tensor([[[10]], [[11]], [[12]], [[13]]])}
    b = {"input_ids": torch.tensor([[8]]), "position_ids": torch.tensor([[[11]], [[12]], [[13]], [[14]]])}
    merged = merge_decode_steps([a, b])
    assert merged["position_ids"].shape == (4, 1, 2)
    assert merged["position_ids"][:, 0, :].tolist() == [[10, 11], [11, 12], [12, 13], [13, 14]]


def test_merge_4d_masks_on_query_axis_padding_narrow_key_axes_as_masked() -> None:
    neg = torch.finfo(torch.float32).min
    a = {"input_ids": torch.tensor([[1]]), "attention_mask": torch.zeros(1, 1, 1, 3)}
    b = {"input_ids": torch.tensor([[2]]), "attention_mask": torch.zeros(1, 1, 1, 4)}
    mask = merge_decode_steps([a, b])["attention_mask"]
    assert mask.shape == (1, 1, 2, 4)
    # the first query must not see the second token
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, 0.0, neg]
    assert mask[0, 0, 1].tolist() == [0.0, 0.0, 0.0, 0.0]
    bool_a = {"input_ids": torch.tensor([[1]]), "attention_mask": torch.ones(1, 1, 1, 3, dtype=torch.bool)}
    bool_b = {"input_ids": torch.tensor([[2]]), "attention_mask": torch.ones(1, 1, 1, 4, dtype=torch.bool)}
    merged_bool = merge_decode_steps([bool_a, bool_b])["attention_mask"]
    assert merged_bool[0, 0, 0].tolist() == [True, True, True, False]


def test_merge_dict_masks_key_by_key() -> None:
    def step(width: int) -> dict:
        return {
            "input_ids": torch.tensor([[1]]),
            "attention_mask": {
                "full_attention": torch.ones(1, 1, 1, width, dtype=torch.bool),
                "sliding_attention": torch.ones(1, 1, 1, width, dtype=torch.bool),
            },
        }

    mask = merge_decode_steps([step(5), step(6)])["attention_mask"]
    assert set(mask) == {"full_attention", "sliding_attention"}
    assert mask["full_attention"].shape == (1, 1, 2, 6)
    assert mask["sliding_attention"][0, 0, 0, -1].item() is False


def test_merge_rejects_differing_unknown_kwargs_and_mismatched_steps() -> None:
    a, b = _step(1, 3, 4), _step(2, 4, 5)
    a["encoder_hidden_states"] = torch.zeros(2, 3, 4)
    b["encoder_hidden_states"] = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match="'encoder_hidden_states' differs between steps"):
        merge_decode_steps([a, b])
    b.pop("encoder_hidden_states")
    with pytest.raises(ValueError, match="decode step 1 has kwargs"):
        merge_decode_steps([a, b])
    with pytest.raises(ValueError, match="at least one decode step"):
        merge_decode_steps([])
    c, d = _step(1, 3, 4), _step(2, 4, 5)
    c["attention_mask"] = torch.ones(2, 1, 4, dtype=torch.int64)
    d["attention_mask"] = torch.ones(2, 1, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot merge 3-D masks"):
        merge_decode_steps([c, d])


def test_identical_constant_inputs_are_kept_once() -> None:
    a, b = _step(1, 3, 4), _step(2, 4, 5)
    enc = torch.randn(2, 3, 4)
    a["encoder_hidden_states"], b["encoder_hidden_states"] = enc, enc.clone()
    assert torch.equal(merge_decode_steps([a, b])["encoder_hidden_states"], enc)


def test_decode_inputs_for_other_query_lengths() -> None:
    base = merge_decode_steps([_step(5, 8, 9), _step(6, 9, 10)])
    four = decode_inputs_for_query_length(base, 4)
    assert four["input_ids"].shape == (2, 4)
    assert four["position_ids"].tolist() == [[8, 9, 10, 11], [8, 9, 10, 11]]
    assert four["cache_position"].tolist() == [8, 9, 10, 11]
    # no cache in these kwargs: the past is 0, so the mask covers the 4 new tokens
    assert four["attention_mask"].shape == (2, 4)
    with pytest.raises(ValueError, match="q must be >= 1"):
        decode_inputs_for_query_length(base, 0)
    base["attention_mask"] = torch.zeros(2, 1, 2, 10)
    with pytest.raises(ValueError, match="only 2-D masks"):
        decode_inputs_for_query_length(base, 1)
