"""Bounded dynamic axes of generation components (issue 28): a sparse-attention indexer's 3-D
``indexer_keys`` cache grows on its positions axis like the 4-D keys and values (dots3_note's
decode was planned at the sample's 12 positions and refused 13)."""

from __future__ import annotations

import torch

from hfexport.config import ExecutorchConfig
from hfexport.generation.plan import GenerationPlan
from hfexport_executorch.generation import component_config


class _LanguageModel(torch.nn.Module):
    def forward(self, inputs_embeds: torch.Tensor, cache: dict) -> torch.Tensor:
        layer = cache["layers"][0]
        return inputs_embeds.sum() + layer["keys"].sum() + layer["indexer_keys"].sum()


def test_indexer_keys_grow_on_the_positions_axis():
    cache = {
        "layers": [
            {
                "keys": torch.randn(2, 4, 12, 8),
                "values": torch.randn(2, 4, 12, 8),
                "indexer_keys": torch.randn(2, 12, 16),
                "conv_state": torch.randn(2, 6, 3),
            }
        ]
    }
    kwargs = {"inputs_embeds": torch.randn(2, 12, 8), "cache": cache}
    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    config = component_config(
        "language_model", _LanguageModel(), kwargs, plan, ExecutorchConfig(dynamic=True)
    )
    layer = config.dynamic_shapes["cache"]["layers"][0]
    assert sorted(layer["indexer_keys"]) == [0, 1]
    assert layer["indexer_keys"][1].max == layer["keys"][2].max > 12
    assert sorted(layer["keys"]) == [0, 2]
    assert layer["conv_state"] is None  # another 3-D state: no positions axis


class _Step(torch.nn.Module):
    def forward(self, input_ids, attention_mask, image_embeds, image_embeds_position_mask):
        return image_embeds.sum() + input_ids.sum() + attention_mask.sum() + image_embeds_position_mask.sum()


def test_linear_attention_states_vary_along_the_batch_only():
    # MiniCPM-V 4.6 / MiniCPM-o OCR (Qwen3.5 language model): the conv states had no rule and held the
    # decode's batch at the sample's 2 rows; the recurrent states' axis 2 is the key dim, not positions
    cache = {
        "layers": [
            {"conv_states": [torch.randn(2, 24, 4)], "recurrent_states": [torch.randn(2, 4, 8, 8)]},
            {"keys": torch.randn(2, 2, 12, 8), "values": torch.randn(2, 2, 12, 8)},
        ]
    }
    kwargs = {"inputs_embeds": torch.randn(2, 3, 8), "cache": cache}  # a prompt chunk over a filled cache
    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    config = component_config(
        "language_model", _LanguageModel(), kwargs, plan, ExecutorchConfig(dynamic=True)
    )
    states, attention = config.dynamic_shapes["cache"]["layers"]
    conv, recurrent = states["conv_states"][0], states["recurrent_states"][0]
    assert sorted(conv) == sorted(recurrent) == [0]
    assert conv[0].max == recurrent[0].max == attention["keys"][0].max > 2
    assert sorted(attention["keys"]) == [0, 2]


def test_image_features_taken_by_a_prefill_vary_with_the_batch_and_the_prompt():
    # Kosmos-2's prefill takes image_embeds [batch, image tokens, hidden] and the token-aligned
    # image_embeds_position_mask [batch, seq] as inputs of its own (BLIP's steps: the cross-attended
    # encoder_hidden_states): they have no role, and were planned at the sample's batch of 2, so a
    # prompt of 3 images failed at run time (issue 28)
    kwargs = {
        "input_ids": torch.ones(2, 24, dtype=torch.int64),
        "attention_mask": torch.ones(2, 24, dtype=torch.int64),
        "image_embeds": torch.randn(2, 16, 8),
        "image_embeds_position_mask": torch.ones(2, 24, dtype=torch.int64),
    }
    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    plan.step_inputs = {
        "prefill": {
            "image_embeds": {
                "from": "component",
                "component": "image_encoder",
                "output": "",
                "drop_first": False,
            },
            "image_embeds_position_mask": {"from": "prompt", "key": "image_embeds_position_mask"},
        }
    }
    shapes = component_config("prefill", _Step(), kwargs, plan, ExecutorchConfig(dynamic=True)).dynamic_shapes
    assert sorted(shapes["image_embeds"]) == [0] and shapes["image_embeds"][0].max > 2
    mask, ids = shapes["image_embeds_position_mask"], shapes["input_ids"]
    assert sorted(mask) == [0, 1] and mask[1].max == ids[1].max > 24
    # no second shape derived by rule: the features' batch would grow apart from the prompt's
    assert (
        component_config(
            "prefill", _Step(), kwargs, plan, ExecutorchConfig(dynamic=True)
        ).validate_second_shape
        is False
    )


class _DeepstackLanguageModel(torch.nn.Module):
    def forward(
        self, inputs_embeds: torch.Tensor, deepstack_visual_embeds: list, cache: dict
    ) -> torch.Tensor:
        return (
            inputs_embeds.sum()
            + sum(d.sum() for d in deepstack_visual_embeds)
            + cache["layers"][0]["keys"].sum()
        )


def test_deepstack_inputs_are_bounded_like_the_prompt():
    # Granite-Docling's language model was planned at the sample's 2 image-token rows of its
    # DeepStack inputs and refused a second prompt with 3 ("deepstack_visual_embeds.0 dimension 0 is 3,
    # above the upper bound 2")
    cache = {"layers": [{"keys": torch.randn(1, 4, 12, 8), "values": torch.randn(1, 4, 12, 8)}]}
    kwargs = {
        "inputs_embeds": torch.randn(1, 12, 8),
        "deepstack_visual_embeds": [torch.randn(2, 8), torch.randn(2, 8)],
        "cache": cache,
    }
    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    config = component_config(
        "language_model", _DeepstackLanguageModel(), kwargs, plan, ExecutorchConfig(dynamic=True)
    )
    length = config.dynamic_shapes["inputs_embeds"][1]
    for taps in config.dynamic_shapes["deepstack_visual_embeds"]:
        assert sorted(taps) == [0]
        assert taps[0].max == length.max > 12 and taps[0].min == 1


def test_a_decode_step_over_filled_linear_attention_states_mutates_no_input():
    # transformers writes Qwen3.5's gated delta-net (and Nemotron-H's Mamba2) conv and recurrent states
    # with copy_: the runtime returned the mutated cache inputs as two extra outputs and the decode
    # output spec no longer fit ("leaves has length 7 but the spec refers to a pytree that holds 5")
    from hfexport.capture import capture
    from hfexport.generation import decompose_for_generation
    from hfexport.generation.parts import FunctionalCacheModule
    from hfexport.tensors import get_leaf_tensors
    from hfexport.testing import tiny_model
    from hfexport_executorch.generation import prepare_component

    model, inputs = tiny_model("qwen3_5_text", "text-generation")
    parts = decompose_for_generation(model, inputs)
    module, kwargs = parts["decode"]
    prefill_module, prefill_kwargs = parts["prefill"]
    assert prepare_component("prefill", prefill_module, prefill_kwargs, parts.plan) is prefill_module  # empty
    wrapped = prepare_component("decode", module, kwargs, parts.plan)
    assert isinstance(wrapped, FunctionalCacheModule)
    before = {k: v.clone() for k, v in get_leaf_tensors(kwargs["cache"]).items()}
    assert any(".recurrent_states." in k for k in before) and any(".conv_states." in k for k in before)
    program = capture(wrapped, kwargs, ExecutorchConfig())
    assert program.graph_signature.user_inputs_to_mutate == {}
    with torch.no_grad():
        out = get_leaf_tensors(wrapped(**kwargs))
    after = get_leaf_tensors(kwargs["cache"])
    assert all(torch.equal(before[k], after[k]) for k in before)  # the caller's cache is left as it was
    # the updated states come back as outputs: the decode step moved every state past the prompt
    states = {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith("cache.") and "_states." in k}
    assert sorted(states) == sorted(k for k in before if "_states." in k)
    assert all(not torch.equal(states[k], before[k]) for k in states)


def test_a_step_fed_image_features_keeps_its_second_shape_when_they_have_an_input_role():
    # issue 28: every step fed an image component's output was exported without a second shape, and
    # the folder's record read "a static export, or validation is off" (Mllama's prefill); now only a
    # feature input without a role turns it off (BLIP's encoder_hidden_states), with that reason
    from hfexport_executorch.generation import second_shape_skip_reason

    feature = {"from": "component", "component": "multi_modal_projector", "output": "", "drop_first": False}
    ids = torch.ones(2, 9, dtype=torch.long)
    mllama = GenerationPlan(
        architecture="multimodal",
        model_class="MllamaForConditionalGeneration",
        step_inputs={"prefill": {"cross_attention_states": feature}},
    )
    kwargs = {"input_ids": ids, "cross_attention_states": torch.randn(2, 1, 4, 17, 64)}
    assert second_shape_skip_reason("prefill", kwargs, mllama) is None
    blip = GenerationPlan(
        architecture="multimodal",
        model_class="BlipForConditionalGeneration",
        step_inputs={"prefill": {"encoder_hidden_states": {**feature, "component": "image_encoder"}}},
    )
    reason = second_shape_skip_reason(
        "prefill", {"input_ids": ids, "encoder_hidden_states": torch.randn(2, 5, 8)}, blip
    )
    assert reason is not None
    assert (
        "'encoder_hidden_states' (from the image_encoder)" in reason
        and "no entry in the input-role table" in reason
    )


class _CrossStep(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return encoder_hidden_states.sum(1) + input_ids.sum()


def test_a_second_shape_the_generation_support_turned_off_is_recorded_with_its_reason():
    # the export folder's record of such a step read "a static export, or validation is off"
    from types import SimpleNamespace

    from hfexport.folder.writer import second_shape_record
    from hfexport.generation.export import _record_second_shape_turned_off
    from hfexport.report import ExportReport
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    report = ExportReport(export_format="executorch")
    exporter_view = SimpleNamespace(
        last_report=report, export_format="executorch", generation_support=exporter.generation_support
    )
    asked = ExecutorchConfig(dynamic=True)
    plan = GenerationPlan(
        architecture="multimodal",
        model_class="BlipForConditionalGeneration",
        step_inputs={
            "prefill": {"encoder_hidden_states": {"from": "component", "component": "image_encoder"}}
        },
    )
    kwargs = {"input_ids": torch.ones(2, 9, dtype=torch.long), "encoder_hidden_states": torch.randn(2, 5, 8)}
    step = _CrossStep()
    _record_second_shape_turned_off(
        exporter_view,
        "prefill",
        step,
        kwargs,
        plan,
        asked,
        asked.replace(validate_second_shape=False),
    )
    record = second_shape_record(report)
    assert record["status"] == "skipped" and "'encoder_hidden_states'" in record["reason"]
    # asked off by the caller, or a static export: nothing recorded (the folder's own reason stands)
    report = ExportReport(export_format="executorch")
    exporter_view.last_report = report
    off = asked.replace(validate_second_shape=False)
    _record_second_shape_turned_off(exporter_view, "prefill", step, kwargs, plan, off, off)
    assert second_shape_record(report) == {
        "status": "not run",
        "reason": "a static export, or validation is off",
    }


class _PatchTower(torch.nn.Module):
    """An owner of ``get_image_features`` over patch rows ``[patches, t, h, w, c]`` (Inkling's layout)."""

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values.flatten(1)


def test_image_features_patch_rows_grow_past_the_sample():
    # Inkling's image encoder takes pixel_values [patches, 2, 8, 8, 3]: axis 0 took the batch role
    # (bound 8, never below the sample), so it was planned at the sample's 32 patch rows and a second
    # prompt of 48 was refused at run time (issue 28)
    from hfexport.generation.export import _encoder_shapes
    from hfexport.generation.multimodal import ImageFeatures
    from hfexport_executorch.bounds import DEFAULT_MAX_BATCH, plan_dynamic_shapes

    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    module = ImageFeatures(_PatchTower(), {}, ["pixel_values"])
    kwargs = {"pixel_values": torch.randn(32, 2, 8, 8, 3)}
    config = _encoder_shapes("image_encoder", module, kwargs, plan, ExecutorchConfig(dynamic=True))
    config = component_config("image_encoder", module, kwargs, plan, config)
    rows = config.dynamic_shapes["pixel_values"][0]
    assert (rows.min, rows.max) == (1, DEFAULT_MAX_BATCH * 32)
    planned = {(a.path, a.axis): a.max for a in plan_dynamic_shapes(module, kwargs, config).axes}
    assert planned[("pixel_values", 0)] == 256

    # an image axis within the batch bound ([images, c, h, w]) keeps the backend's batch bound
    images = {"pixel_values": torch.randn(2, 3, 8, 8)}
    config = _encoder_shapes("image_encoder", module, images, plan, ExecutorchConfig(dynamic=True))
    config = component_config("image_encoder", module, images, plan, config)
    assert config.dynamic_shapes["pixel_values"][0].max is None
    planned = {(a.path, a.axis): a.max for a in plan_dynamic_shapes(module, images, config).axes}
    assert planned[("pixel_values", 0)] == DEFAULT_MAX_BATCH


def test_a_vision_tower_taking_patch_rows_grows_past_the_sample():
    # Inkling's image encoder is its vision tower itself (no get_image_features component): with
    # dynamic=True alone the backend planned its 32 patch rows as a batch, at the sample's size
    from hfexport_executorch.bounds import plan_dynamic_shapes

    class Tower(torch.nn.Module):
        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return pixel_values.flatten(1)

    plan = GenerationPlan(architecture="multimodal", model_class="Toy", cache_kind="dynamic")
    kwargs = {"pixel_values": torch.randn(32, 2, 8, 8, 3)}
    config = component_config("image_encoder", Tower(), kwargs, plan, ExecutorchConfig(dynamic=True))
    planned = {(a.path, a.axis): a.max for a in plan_dynamic_shapes(Tower(), kwargs, config).axes}
    assert planned[("pixel_values", 0)] == 256
    # one image of a few rows: the backend's own rule, nothing declared
    few = {"pixel_values": torch.randn(2, 3, 8, 8)}
    assert (
        component_config("image_encoder", Tower(), few, plan, ExecutorchConfig(dynamic=True)).dynamic_shapes
        is None
    )
