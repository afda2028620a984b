"""The input-role table and the config lookups, and that the old call sites derive from them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig

from hfexport import batching
from hfexport.conventions import (
    AUDIO,
    DECODER,
    SIGNAL,
    TEXT,
    InputRole,
    batch_axis,
    batch_keys,
    input_role,
    input_roles,
    max_positions,
    modality_of,
    names_with,
    register_input_role,
    sequence_axis,
    sequence_group,
    spatial_axes,
)
from hfexport.conventions import roles as roles_module
from hfexport.generation import decode, parity


def test_text_inputs_are_batch_by_sequence():
    for name in ("input_ids", "attention_mask", "token_type_ids", "position_ids", "mm_token_type_ids"):
        assert (batch_axis(name, 2), sequence_axis(name, 2), sequence_group(name, 2)) == (0, 1, TEXT), name
        assert modality_of(name) == TEXT
    assert (batch_axis("inputs_embeds", 3), sequence_axis("inputs_embeds", 3)) == (0, 1)
    assert sequence_group("decoder_input_ids") == DECODER
    assert sequence_group("decoder_attention_mask") == DECODER


def test_rank_variants_have_their_own_axes():
    # M-RoPE position ids [3, batch, seq]
    assert (batch_axis("position_ids", 3), sequence_axis("position_ids", 3)) == (1, 2)
    # a 4-D mask [batch, heads, q, kv] has no single sequence axis
    assert (batch_axis("attention_mask", 4), sequence_axis("attention_mask", 4)) == (0, None)
    # images: [b, c, h, w]; LLaVA-NeXT [b, patches, c, h, w]; Qwen2-VL's [patches, dim] has no role
    assert spatial_axes("pixel_values", 4) == (2, 3)
    assert spatial_axes("pixel_values", 5) == (3, 4)
    assert input_role("pixel_values", 2) is None
    # extra trailing axes keep the base axes (a toy's float input_ids [b, s, features])
    assert input_role("input_ids", 3).sequence_axis == 1


def test_audio_mask_follows_the_signal():
    plain = input_role("attention_mask", 2, present=["input_ids", "attention_mask"])
    audio = input_role("attention_mask", 2, present={"input_values": torch.zeros(1, 4), "attention_mask": 1})
    assert (plain.sequence, plain.modality) == (TEXT, TEXT)
    assert (audio.sequence, audio.modality) == (SIGNAL, AUDIO)
    # a None value counts as absent
    assert input_role("attention_mask", 2, present={"input_values": None}).sequence == TEXT


def test_audio_features_mask_follows_the_frames_not_the_text():
    """Wav2Vec2-BERT's [batch, frames] mask next to input_features: no text group, so a second shape
    does not grow it to 65 tokens while the features keep their frames (eager then fails 31 vs 32)."""
    mask = input_role("attention_mask", 2, present=["input_features", "attention_mask"])
    assert (mask.sequence, mask.sequence_axis, mask.modality, mask.batch_axis) == (None, None, AUDIO, 0)
    # with text ids beside the features the mask is the text's
    both = input_role("attention_mask", 2, present=["input_features", "input_ids", "attention_mask"])
    assert (both.sequence, both.sequence_axis) == (TEXT, 1)


def test_audio_features_and_their_mask_keep_one_frame_count_in_the_second_shape():
    from hfexport.testing import tiny_model
    from hfexport.verify.second_shape import derive_second_inputs

    model, inputs = tiny_model("wav2vec2-bert", "audio-classification")
    second, why = derive_second_inputs(model, inputs)
    assert why == "" and second is not None
    assert tuple(second["input_features"].shape[:2]) == (3, inputs["input_features"].shape[1])
    assert tuple(second["attention_mask"].shape) == tuple(second["input_features"].shape[:2])
    with torch.no_grad():
        model(**second)  # the eager reference runs on it


def test_input_features_claim_no_sequence_axis_and_grids_no_batch():
    assert input_role("input_features", 3).sequence_axis is None
    assert batch_axis("image_grid_thw") is None and batch_axis("cache_position") is None
    assert input_role("nothing_we_know") is None and modality_of("nothing_we_know") is None


def test_names_with_filters_in_table_order():
    assert names_with(primary=True)[:5] == (
        "input_ids",
        "inputs_embeds",
        "input_features",
        "input_values",
        "pixel_values",
    )
    assert names_with(kind="cache") == ("cache", "past_key_values")
    assert set(names_with(modality="image")) == {
        "pixel_values",
        "pixel_mask",
        "image_grid_thw",
        # SigLIP2's patch mask and grid, Idefics3's per-image mask
        "pixel_attention_mask",
        "spatial_shapes",
        # LXMERT's region features and boxes (issue 28)
        "visual_feats",
        "visual_pos",
        # issue 28: LLaVA-NeXT's / Pixtral's image sizes, Qwen2.5-VL's window permutation and bounds
        "image_sizes",
        "window_index",
        "cu_window_seqlens",
        # issue 28: DeepSeek-VL hybrid's second, high-resolution view of each image
        "high_res_pixel_values",
        # issue 28: Mllama's tile layout and the image features its language model cross-attends to
        "aspect_ratio_ids",
        "aspect_ratio_mask",
        "cross_attention_states",
    }


def test_max_positions_lookup_order_and_text_config():
    llama = AutoConfig.for_model("llama", max_position_embeddings=77)
    assert max_positions(llama) == (77, "config.max_position_embeddings")
    whisper = AutoConfig.for_model("whisper", max_source_positions=32, max_target_positions=48)
    assert max_positions(whisper) == (32, "config.max_source_positions")
    assert max_positions(whisper, decoder=True) == (48, "config.max_target_positions")
    gpt2 = AutoConfig.for_model("gpt2", n_positions=64)
    assert max_positions(gpt2)[0] == 64
    # composite model: the limit sits in text_config, which get_text_config(decoder=False) misses
    vlm = AutoConfig.for_model("llava", text_config={"model_type": "llama", "max_position_embeddings": 99})
    assert max_positions(vlm) == (99, "config.max_position_embeddings")
    assert max_positions(None) == (None, "")


def test_old_call_sites_agree_with_the_table():
    # the sets each site kept by hand before the table existed
    assert set(batching.BATCH_KEYS) == {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "position_ids",
        "inputs_embeds",
        "mm_token_type_ids",
        "decoder_input_ids",
        "decoder_attention_mask",
        "decoder_position_ids",
        "decoder_inputs_embeds",
        "input_values",
        "input_features",
        "pixel_values",
        "pixel_mask",
        "encoder_outputs",
        # new in the table, batch on axis 0 as well
        "moe_mm_token_type_ids",
        "pixel_values_videos",
        # issue 28: DeepSeek-VL hybrid's second, high-resolution view of each image
        "high_res_pixel_values",
        # issue 28: time-series forecasters and speecht5's teacher-forced frames
        "past_values",
        "past_time_features",
        "past_observed_mask",
        "future_values",
        "future_time_features",
        "future_observed_mask",
        "static_categorical_features",
        "static_real_features",
        "decoder_input_values",
        # SigLIP2 / Idefics3 patch masks, SigLIP2's patch grid per image
        "pixel_attention_mask",
        "spatial_shapes",
        # issue 28: layout boxes (LayoutLM-likes), LXMERT's region features and boxes
        "bbox",
        "visual_feats",
        "visual_pos",
        # issue 28: OmDet-Turbo's class names, task prompts and classes per image
        "classes_input_ids",
        "classes_attention_mask",
        "tasks_input_ids",
        "tasks_attention_mask",
        "classes_structure",
        # issue 28: OneFormer's task prompt
        "task_inputs",
        # issue 28: image sizes per image (LLaVA-NeXT, Pixtral), Qwen3-VL's DeepStack placeholder mask
        "image_sizes",
        "visual_pos_masks",
        # issue 28: InstructBLIP's Q-Former instruction
        "qformer_input_ids",
        "qformer_attention_mask",
        # issue 28: Mllama's tile layout, cross-attention mask and cross-attended image features
        "aspect_ratio_ids",
        "aspect_ratio_mask",
        "cross_attention_mask",
        "cross_attention_states",
    }
    assert batch_keys() == batching.BATCH_KEYS
    assert set(decode.TOKEN_KEYS) == {
        "input_ids",
        "inputs_embeds",
        "decoder_input_ids",
        "decoder_inputs_embeds",
        "token_type_ids",
        "mm_token_type_ids",
        "moe_mm_token_type_ids",
        "visual_pos_masks",
    }
    assert decode.POSITION_KEYS == ("position_ids", "decoder_position_ids")
    assert decode.MASK_KEYS == ("attention_mask", "decoder_attention_mask")
    assert decode.CACHE_KEYS == ("cache", "past_key_values")
    assert parity._PROMPT_KEYS == ("input_ids", "attention_mask")
    for name in decode.TOKEN_KEYS:
        assert sequence_axis(name) == 1 and batch_axis(name) == 0


def test_a_new_modality_is_one_entry(monkeypatch):
    monkeypatch.setattr(roles_module, "_ROLES", dict(roles_module._ROLES))
    depth = InputRole("depth_values", "depth", "pixels", 0, None, None, (2, 3), 4, primary=True)
    register_input_role(depth)
    assert input_roles()["depth_values"] is depth
    assert "depth_values" in batch_keys() and spatial_axes("depth_values", 4) == (2, 3)
    assert modality_of("depth_values") == "depth"
    with pytest.raises(ValueError, match="already registered"):
        register_input_role(dataclasses.replace(depth, batch_axis=None))
    with pytest.raises(ValueError, match="do not fit rank 2"):
        register_input_role(InputRole("flat", "depth", "pixels", 0, None, None, (2, 3), 2), replace=True)
    # widening a batch-1 sample now knows the new input
    from hfexport.config import DynamoConfig

    widened, reason = batching.widen_unit_batch(
        {"depth_values": torch.zeros(1, 1, 4, 4)}, DynamoConfig(dynamic=True)
    )
    assert widened["depth_values"].shape == (2, 1, 4, 4) and "depth_values" in reason


def test_patchified_images_grow_their_batch_with_their_mask_and_grid():
    """SigLIP2's [batch, patches, dim] pixel_values, [batch, patches] mask and [batch, 2] grid: a
    second shape adds a batch row to all three (the grid's rows repeated exactly) and eager runs it."""
    from hfexport.testing import tiny_model
    from hfexport.verify.second_shape import derive_second_inputs

    assert input_role("pixel_values", 3).spatial_axes == () and input_role("pixel_values", 3).batch_axis == 0
    assert input_role("pixel_attention_mask", 4).spatial_axes == (2, 3)
    model, inputs = tiny_model("siglip2", "zero-shot-image-classification")
    second, why = derive_second_inputs(model, inputs)
    assert why == "" and second is not None
    assert tuple(second["pixel_values"].shape) == (3, *inputs["pixel_values"].shape[1:])
    assert tuple(second["pixel_attention_mask"].shape) == (3, inputs["pixel_attention_mask"].shape[1])
    assert second["spatial_shapes"].tolist() == [inputs["spatial_shapes"][0].tolist()] * 3
    with torch.no_grad():
        model(**second)


def test_ast_spectrogram_keeps_its_frame_count_in_the_second_shape():
    """AST's input_values is a [batch, frames, mel] spectrogram whose frame count is the config's
    max_length (its position table): the second shape adds a batch row only, and eager runs it
    (the raw-audio rule, samples grown by half, made eager fail: size of tensor a (29) must match
    the size of tensor b (20))."""
    from hfexport.testing import tiny_model
    from hfexport.verify.second_shape import derive_second_inputs

    role = input_role("input_values", 3)
    assert role.kind == "features" and role.sequence_axis is None and role.batch_axis == 0
    assert input_role("input_values", 2).sequence_axis == 1  # raw audio keeps its signal axis
    model, inputs = tiny_model("audio-spectrogram-transformer", "audio-classification")
    second, why = derive_second_inputs(model, inputs)
    assert why == "" and second is not None
    assert tuple(second["input_values"].shape) == (3, model.config.max_length, model.config.num_mel_bins)
    with torch.no_grad():
        assert model(**second).logits.shape == (3, model.config.num_labels)
