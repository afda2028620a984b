"""Vision-language towers that read their patch grid as values, and GLM-5-Next's pooled indexer (issue 28)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hfexport.capture import capture_patch_key
from hfexport.generation.image_prompts import other_image_prompt
from hfexport.generation.multimodal import (
    _image_features_component,
    find_multimodal_layout,
    sized_grid_image_features,
)
from hfexport.generation.runner import GenerationRunner
from hfexport.registry import apply_patches
from hfexport.testing import tiny_model
from hfexport.workarounds import vision_language

TASK = "image-text-to-text"


class _Pixels(torch.nn.Module):
    """The one-grid image-features component with a named input."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values=pixel_values)


def test_tower_reading_its_grid_exports_for_one_grid():
    # Cosmos3-Edge resizes its learned position grid to each image's grid with F.interpolate(size=
    # grid.tolist()): a graph taking image_grid_thw failed ("Could not guard on data-dependent
    # expression u1 > 0"); the one-grid component holds the grid as a constant, whose values the
    # fixed_grid patch lets the fake tensors keep
    model, inputs = tiny_model("cosmos3_edge", TASK)
    module, kwargs, settings, _ = _image_features_component(
        model, find_multimodal_layout(model), inputs, precompute=False
    )
    assert settings is None
    component, one, grid = sized_grid_image_features(module, kwargs)
    assert grid == [int(v) for v in inputs["image_grid_thw"][0]]
    assert list(one) == ["pixel_values"] and one["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]
    assert capture_patch_key(component) == vision_language.FIXED_GRID_KEY
    with torch.no_grad():
        expected = module(**kwargs)  # the model's own features of the sample (one image)
        assert torch.equal(component(**one), expected)
    with pytest.raises(Exception, match="data-dependent"), torch.no_grad():
        torch.export.export(_Pixels(component), (), one)  # without the fixed_grid patch
    with apply_patches(capture_patch_key(component)), torch.no_grad():
        program = torch.export.export(_Pixels(component), (), one)
    gen = torch.Generator().manual_seed(3)
    other = {"pixel_values": torch.randn(one["pixel_values"].shape, generator=gen)}
    with torch.no_grad():
        for given in (one, other):
            torch.testing.assert_close(program.module()(**given), component(**given), atol=1e-5, rtol=1e-5)


def test_runner_calls_a_one_grid_encoder_per_image_and_refuses_another_grid():
    runner = GenerationRunner.__new__(GenerationRunner)
    runner.plan = SimpleNamespace(per_image={"image_encoder": {"image_grid_thw": [1, 2, 3]}})
    calls = []

    def call(component, values, extra):
        calls.append(values["pixel_values"].shape[0])
        return {"": values["pixel_values"].sum(-1, keepdim=True)}

    runner._call = call
    pixels = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)
    out = runner._call_per_image(
        "image_encoder", {"pixel_values": pixels}, {"image_grid_thw": [[1, 2, 3]] * 2}
    )
    assert calls == [6, 6]
    torch.testing.assert_close(out[""], pixels.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match=r"grid \[1, 2, 3\].*\[\[1, 4, 4\]\]; resize"):
        runner._call_per_image("image_encoder", {"pixel_values": pixels}, {"image_grid_thw": [[1, 4, 4]]})
    with pytest.raises(ValueError, match="has 12 rows; 1 images of grid"):
        runner._call_per_image("image_encoder", {"pixel_values": pixels}, {"image_grid_thw": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="needs image_grid_thw"):
        runner._call_per_image("image_encoder", {"pixel_values": pixels}, {})


def test_newline_column_mrope_positions_match_hy_v4_vl():
    # HunYuan-V4-VL ends each merged row with a newline token and lays the image block out as a
    # Qwen2-VL grid one column wider; the runner's Qwen2-VL layout refused its blocks ("an image
    # block of 6 tokens does not match its grid 1x4x4 (merge 2 -> 4 tokens)")
    from hfexport.generation.multimodal import _mrope_layout
    from hfexport.generation.vision_inputs import mrope_position_ids

    model, inputs = tiny_model("hy_v4_vl", TASK)
    merge = model.config.vision_config.spatial_merge_size
    for prompt in (inputs, other_image_prompt(model, inputs, same_image_size=True)):
        expected, deltas = model.model.get_rope_index(
            prompt["input_ids"],
            mm_token_type_ids=prompt["mm_token_type_ids"],
            image_grid_thw=prompt["image_grid_thw"],
            attention_mask=prompt["attention_mask"],
        )
        got, got_deltas = mrope_position_ids(
            prompt["input_ids"],
            prompt["mm_token_type_ids"],
            prompt["image_grid_thw"],
            merge,
            prompt["attention_mask"],
            newline_columns=1,
        )
        assert torch.equal(got[1:], expected) and torch.equal(got_deltas, deltas)
        layout = _mrope_layout(prompt, expected, {"spatial_merge_size": merge, "channels": 3}, {})
        assert layout == "newline_column"
        with pytest.raises(ValueError, match="does not match its grid"):
            mrope_position_ids(
                prompt["input_ids"], prompt["mm_token_type_ids"], prompt["image_grid_thw"], merge
            )


def test_same_size_grid_prompt_has_two_images_of_the_sample_grid():
    model, inputs = tiny_model("cosmos3_edge", TASK)
    other = other_image_prompt(model, inputs, same_image_size=True)
    assert other["image_grid_thw"].tolist() == [inputs["image_grid_thw"][0].tolist()] * 2
    assert other["pixel_values"].shape[0] == 2 * inputs["pixel_values"].shape[0]
    image = int(model.config.image_token_id)
    assert int((other["input_ids"] == image).sum()) == 2 * int((inputs["input_ids"] == image).sum())
    assert other["input_ids"].shape[1] > inputs["input_ids"].shape[1]
    with torch.no_grad():  # the model accepts it: the image tokens match the features
        model.generate(**other, max_new_tokens=1, do_sample=False)


def _indexer(topk: int, pool: int):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = Glm5NextTextConfig(
        hidden_size=32,
        q_lora_rank=16,
        index_n_heads=4,
        index_head_dim=8,
        index_topk=topk,
        index_kpool=pool,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    indexer = Glm5NextTextIndexer(config, layer_idx=0).eval()
    for parameter in indexer.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    with torch.no_grad():  # positive head weights (with positive hidden states): no ties of pools
        indexer.weights_proj.weight.abs_()  # scored 0 among the best, whose order is topk's choice
    return indexer


class _Indexer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, q_resid, attention_mask):
        return self.inner(hidden_states, q_resid, attention_mask, None)


def _indexer_inputs(indexer, length: int, padding: int = 0):
    gen = torch.Generator().manual_seed(length)
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[:, :padding] = False
    return (
        torch.randn(1, length, indexer.hidden_size, generator=gen).abs(),
        torch.randn(1, length, indexer.q_lora_rank, generator=gen),
        mask,
    )


def _selected(indices: torch.Tensor) -> list[list[int]]:
    return [sorted(set(row.tolist()) - {-1}) for row in indices.reshape(-1, indices.shape[-1])]


def test_pooled_indexer_serves_one_pool_and_many():
    # GLM-5-Next's sparse-attention indexer: a sample of one key pool (12 tokens, pools of 4)
    # specialised the pool count ("Guard failed: inputs_embeds.size()[1] <= 16" at the language
    # model's second shape); padded pools keep it symbolic, and the selected keys stay those of
    # eager (budget 8 tokens = 2 pools: 40 tokens select among 10 pools)
    from torch.export import Dim

    indexer = _indexer(topk=8, pool=4)
    wrapped = _Indexer(indexer)
    length = Dim("length", min=2, max=256)
    shapes = ({1: length}, {1: length}, {1: length})
    sample = _indexer_inputs(indexer, 4)
    with pytest.raises(Exception, match="Constraints violated"), torch.no_grad():
        torch.export.export(wrapped, sample, dynamic_shapes=shapes)  # without the patch
    with apply_patches(capture_patch_key(indexer)), torch.no_grad():
        program = torch.export.export(wrapped, sample, dynamic_shapes=shapes)
    with torch.no_grad():
        for size, padding in ((4, 0), (12, 0), (40, 0), (40, 5), (97, 0)):
            given = _indexer_inputs(indexer, size, padding)
            expected, got = wrapped(*given), program.module()(*given)
            assert got.shape == expected.shape
            assert _selected(got) == _selected(expected), (size, padding)
            if size >= 40:
                assert max(len(row) for row in _selected(expected)) < size  # a sparse selection
