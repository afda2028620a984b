"""The size plan of the second validation shape (hfexport.verify.sizes) and its one fill path.

A second shape is planned per axis group (which input axes move together and the new size of
each) and then filled by input role (hfexport.verify.fill): checked here on a decode step with a
KV cache, a prefill with an empty cache, an image model, declared ``dynamic_shapes`` and the
plain ``dynamic=True`` rule, with the sizes and members asserted.
"""

from __future__ import annotations

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.generation import decompose_prefill_decode
from hfexport.inputs import prepare_for_export
from hfexport.testing import tiny_model
from hfexport.verify.fill import fill_second_inputs
from hfexport.verify.second_shape import derive_second_inputs
from hfexport.verify.sizes import PAST_LENGTH, AxisGroup, AxisMember, SizePlan, plan_second_shape


class _Toy(torch.nn.Module):
    """A model whose config has no position limit (the plan reads ``model.config``)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {})()


def _groups(plan: SizePlan) -> dict[str, tuple[int, int, list[tuple[str, int, int]]]]:
    """``{meaning: (sample, size, [(input, axis, offset)])}`` (cache layers after the first left out)."""
    return {
        g.meaning: (
            g.sample,
            g.size,
            [
                (m.input, m.axis, m.offset)
                for m in g.members
                if ".layers." not in m.input or ".layers.0." in m.input
            ],
        )
        for g in plan.groups
    }


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _component(model, inputs, name):
    module, kwargs = decompose_prefill_decode(model, inputs, multi_token_decode=True)[name]
    _, prepared, _ = prepare_for_export(module, kwargs)
    return module, prepared


def test_a_decode_step_plans_the_batch_and_the_past_length_its_cache_and_mask_share(llama) -> None:
    model, inputs = llama
    module, sample = _component(model, inputs, "decode")
    assert tuple(sample["input_ids"].shape) == (2, 2) and int(sample["cache"].get_seq_length()) == 8
    plan, reason = plan_second_shape(module, sample, config=DynamoConfig(dynamic=True))
    assert reason == "" and plan is not None
    assert (plan.source, plan.cache_key, plan.cache_kind) == ("cache", "cache", "dynamic")
    groups = _groups(plan)
    assert list(groups) == ["batch", PAST_LENGTH]
    sample_b, size_b, members_b = groups["batch"]
    assert (sample_b, size_b) == (2, 3)
    assert ("input_ids", 0, 0) in members_b and ("attention_mask", 0, 0) in members_b
    assert ("cache.layers.0.keys", 0, 0) in members_b and ("cache.layers.0.values", 0, 0) in members_b
    # the mask covers past + 2 new tokens: it carries the past length with offset 2
    assert groups[PAST_LENGTH] == (
        8,
        17,
        [("attention_mask", 1, 2), ("cache.layers.0.keys", 2, 0), ("cache.layers.0.values", 2, 0)],
    )
    assert (plan.new_past(), plan.past_shift()) == (17, 9)
    assert plan.shape("attention_mask", sample["attention_mask"]) == (3, 19)
    assert plan.shape("input_ids", sample["input_ids"]) == (3, 2)  # the query length stays
    # the program's ranges bound the groups: a static batch stays, the past stays inside its range
    axes = [
        {"input": "input_ids", "axis": 0, "status": "static", "min": 2, "max": 2},
        {"input": "attention_mask", "axis": 1, "status": "dynamic", "min": 3, "max": 14},
    ]
    bounded, _ = plan_second_shape(module, sample, config=DynamoConfig(dynamic=True), program_axes=axes)
    assert bounded is not None
    batch = bounded.group("batch")
    assert (batch.sample, batch.size, batch.note) == (2, 2, "the program holds input_ids axis 0 static")
    assert (bounded.past.sample, bounded.past.size) == (8, 12)  # 14 - 2 new tokens


def test_a_prefill_plans_like_plain_inputs_and_cache_position_follows_the_prompt(llama) -> None:
    model, inputs = llama
    module, sample = _component(model, inputs, "prefill")
    plan, reason = plan_second_shape(module, sample)
    assert reason == "" and plan is not None
    assert (plan.source, plan.cache_key, plan.cache_kind, plan.past) == ("dynamic", "cache", "empty", None)
    groups = _groups(plan)
    assert groups["batch"][:2] == (2, 3)
    sample_s, size_s, members_s = groups["sequence"]
    assert (sample_s, size_s) == (8, 65)
    assert members_s == [("input_ids", 1, 0), ("position_ids", 1, 0), ("attention_mask", 1, 0)]
    # a cache_position next to the prompt joins its sequence group and counts the new prompt
    with_position = {**sample, "cache_position": torch.arange(8)}
    plan, reason = plan_second_shape(module, with_position)
    assert reason == "" and plan is not None
    assert _groups(plan)["sequence"][2][-1] == ("cache_position", 0, 0)
    second, _ = fill_second_inputs(with_position, plan)
    assert second is not None and second["cache_position"].tolist() == list(range(65))
    assert second["cache"] is not sample["cache"] and int(second["cache"].get_seq_length()) == 0


def test_an_image_model_plans_one_height_and_one_width_for_pixels_and_mask() -> None:
    pixels = torch.randn(2, 3, 32, 24)
    mask = torch.ones(2, 32, 24, dtype=torch.long)
    plan, reason = plan_second_shape(torch.nn.Conv2d(3, 4, 3), {"pixel_values": pixels, "pixel_mask": mask})
    assert reason == "" and plan is not None and plan.source == "dynamic"
    assert _groups(plan) == {
        "batch": (2, 3, [("pixel_values", 0, 0), ("pixel_mask", 0, 0)]),
        "image height": (32, 64, [("pixel_values", 2, 0), ("pixel_mask", 1, 0)]),
        "image width": (24, 48, [("pixel_values", 3, 0), ("pixel_mask", 2, 0)]),
    }
    # a program that fixes the height and bounds the width (ViT-like)
    axes = [
        {"input": "pixel_values", "axis": 2, "status": "static", "min": 32, "max": 32},
        {"input": "pixel_values", "axis": 3, "status": "dynamic", "min": 2, "max": 40},
    ]
    plan, _ = plan_second_shape(torch.nn.Conv2d(3, 4, 3), {"pixel_values": pixels}, program_axes=axes)
    assert plan is not None
    assert (plan.group("image height").size, plan.group("image width").size) == (32, 40)


def test_declared_dynamic_shapes_group_axes_by_role_and_dim_name() -> None:
    from torch.export import Dim

    batch, seq = Dim("batch"), Dim("seq", max=40)
    inputs = {
        "input_ids": torch.randint(3, 50, (2, 8)),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "x": torch.randn(2, 16),
    }
    spec = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "x": {1: 2 * seq}}
    plan, reason = plan_second_shape(_Toy(), inputs, config=DynamoConfig(dynamic_shapes=spec))
    assert reason == "" and plan is not None and plan.source == "dynamic_shapes"
    by_dim = {
        g.dim: (g.meaning, g.sample, g.size, [(m.input, m.axis) for m in g.members]) for g in plan.groups
    }
    assert by_dim["batch"] == ("batch", 2, 3, [("input_ids", 0), ("attention_mask", 0)])
    assert by_dim["seq"][:3] == ("sequence", 8, 40)  # max(2 * 8, 65) capped at the declared max
    assert sorted(by_dim["seq"][3]) == [("attention_mask", 1), ("input_ids", 1)]
    # a derived Dim follows its root: x's axis 1 is 2 * seq
    derived = [g for g in plan.groups if g.members == (AxisMember("x", 1),)]
    assert [(g.sample, g.size, g.note) for g in derived] == [(16, 80, "derived from Dim 'seq'")]
    second, _ = fill_second_inputs(inputs, plan)
    assert second is not None
    assert tuple(second["x"].shape) == (2, 80) and tuple(second["input_ids"].shape) == (3, 40)


def test_declared_token_axes_stay_below_the_end_of_a_model_bounded_program_range() -> None:
    """A forward looping over the sample's chunk count (Qwen3.5's gated delta rule) serves fewer
    tokens than declared: ExecuTorch's vision-language language model declares 512 and takes 4..63,
    and its second shape was planned at 65 tokens (error 0x12 in the runtime)."""
    from torch.export import Dim

    length = Dim.AUTO(min=1, max=512)
    inputs = {"inputs_embeds": torch.randn(1, 12, 4), "attention_mask": torch.ones(1, 12, dtype=torch.long)}
    spec = {"inputs_embeds": {1: length}, "attention_mask": {1: length}}
    config = DynamoConfig(dynamic_shapes=spec)
    unbounded, _ = plan_second_shape(_Toy(), inputs, config=config)
    assert unbounded is not None and [g.size for g in unbounded.groups] == [65]
    axes = [
        {
            "input": "inputs_embeds",
            "axis": 1,
            "status": "dynamic",
            "min": 4,
            "max": 63,
            "note": "model-bounded",
        },
        {
            "input": "attention_mask",
            "axis": 1,
            "status": "dynamic",
            "min": 2,
            "max": 63,
            "note": "model-bounded",
        },
    ]
    plan, reason = plan_second_shape(_Toy(), inputs, config=config, program_axes=axes)
    assert reason == "" and plan is not None
    assert [(g.meaning, g.sample, g.size) for g in plan.groups] == [("sequence", 12, 62)]
    # a static entry does not bound the group (a specialised sequence still fails its second shape)
    static = [dict(a, status="static", min=12, max=12) for a in axes]
    plan, _ = plan_second_shape(_Toy(), inputs, config=config, program_axes=static)
    assert plan is not None and [g.size for g in plan.groups] == [65]


def test_one_fill_path_gives_the_same_values_for_plain_and_declared_plans() -> None:
    """The same sizes planned by the plain rule and by declared Dims fill the same values."""
    from torch.export import Dim

    inputs = {
        "input_ids": torch.randint(3, 50, (2, 8)),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "position_ids": torch.arange(8).expand(2, 8).clone(),
    }
    plain, _ = plan_second_shape(_Toy(), inputs)
    batch, seq = Dim("batch"), Dim("seq")
    spec = {key: {0: batch, 1: seq} for key in inputs}
    declared, _ = plan_second_shape(_Toy(), inputs, config=DynamoConfig(dynamic_shapes=spec))
    assert plain is not None and declared is not None
    assert (
        plain.sizes()
        == declared.sizes()
        == {
            **{(k, 0): 3 for k in inputs},
            **{(k, 1): 65 for k in inputs},
        }
    )
    a, _ = fill_second_inputs(inputs, plain, seed=3)
    b, _ = fill_second_inputs(inputs, declared, seed=3)
    assert a is not None and b is not None
    for key in inputs:
        assert torch.equal(a[key], b[key]), key
    assert a["position_ids"].tolist() == [list(range(65))] * 3
    # derive_second_inputs is exactly plan + fill
    derived, _ = derive_second_inputs(_Toy(), inputs, seed=3)
    assert derived is not None and torch.equal(derived["input_ids"], a["input_ids"])


def test_a_plan_refuses_with_the_reason_and_fill_refuses_inputs_without_a_value_rule() -> None:
    plan, reason = plan_second_shape(
        _Toy(), {"input_ids": torch.ones(2, 3, dtype=torch.long), "grid": torch.ones(2)}
    )
    assert plan is None and reason == "no rule to derive a second shape for input 'grid' (2,)"
    grid = torch.tensor([[1, 4, 4]])
    made = SizePlan("dynamic", [AxisGroup("axis 0", (AxisMember("image_grid_thw", 0),), 1, 2)])
    second, reason = fill_second_inputs({"image_grid_thw": grid}, made)
    assert (
        second is None
        and reason == "no rule to derive the values of 'image_grid_thw' (1, 3) at another shape"
    )
