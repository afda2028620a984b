"""The tiny builders, sample inputs and input rules of the issue-28 families: object detection,
zero-shot detection, image segmentation, depth estimation, time-series forecasting, text-to-audio
(configuration-level checks and a few seconds-fast builds; the exports are in
tests-integration/test_zoo_families_vision.py)."""

from __future__ import annotations

import pytest

from hfexport.errors import UnsupportedInputError
from hfexport.inputs.prepare import prepare_for_export
from hfexport.tasks import TASK_AUTO_CLASSES
from hfexport.testing import known_model_types, shrunk_config, supported_tasks, tiny_model
from hfexport.tiny import TASK_TO_AUTO_CLASS, auto_class_name, default_task

NEW_TASKS = (
    "object-detection",
    "zero-shot-object-detection",
    "image-segmentation",
    "depth-estimation",
    "time-series-forecasting",
    "text-to-audio",
)


def test_new_tasks_are_known_to_the_cli_and_the_zoo():
    for task in NEW_TASKS:
        assert task in TASK_AUTO_CLASSES and task in TASK_TO_AUTO_CLASS
    assert {"detr", "rt_detr", "yolos", "table-transformer"} <= set(known_model_types("object-detection"))
    assert {"segformer", "mask2former", "upernet"} <= set(known_model_types("image-segmentation"))
    assert {"dpt", "glpn", "depth_anything"} <= set(known_model_types("depth-estimation"))
    assert {"owlvit", "owlv2"} <= set(known_model_types("zero-shot-object-detection"))
    assert {"speecht5", "vits", "musicgen"} <= set(known_model_types("text-to-audio"))
    forecasters = {"patchtst", "patchtsmixer", "informer", "autoformer", "time_series_transformer"}
    assert forecasters <= set(known_model_types("time-series-forecasting"))


def test_heads_without_an_auto_class_resolve_to_their_class():
    assert auto_class_name("patchtst", "time-series-forecasting") == "PatchTSTForPrediction"
    assert auto_class_name("informer", "time-series-forecasting") == "InformerForPrediction"
    assert auto_class_name("mask2former", "image-segmentation") == "AutoModelForUniversalSegmentation"
    assert auto_class_name("speecht5", "text-to-audio") == "AutoModelForTextToSpectrogram"
    # the new tasks come after the old ones: no type's default task changed
    assert default_task("detr") == "feature-extraction"
    assert supported_tasks("detr")[-2:] == ("object-detection", "image-segmentation")


def test_detection_backbones_are_timm_free_and_the_neck_follows_them():
    detr = shrunk_config("detr")
    assert detr.backbone_config.model_type == "resnet"
    assert detr.backbone_config.out_features == ["stage1", "stage2", "stage3", "stage4"]
    assert detr.num_queries == 10
    rt = shrunk_config("rt_detr")
    picked = [rt.backbone_config.hidden_sizes[i - 1] for i in rt.backbone_config.out_indices]
    assert rt.encoder_in_channels == picked == [32, 64, 128]


def test_transformer_backbones_keep_their_taps():
    depth = shrunk_config("depth_anything")
    assert depth.backbone_config.num_hidden_layers == 4
    assert depth.backbone_config.out_features == ["stage1", "stage2", "stage3", "stage4"]
    swin = shrunk_config("mask2former").backbone_config
    assert swin.num_layers == len(swin.depths) == 4  # stages stay, each one block deep
    assert swin.depths == [1, 1, 1, 1]


def test_forecaster_inputs_follow_the_config():
    model, inputs = tiny_model("informer", "time-series-forecasting")
    config = model.config
    past = config.context_length + max(config.lags_sequence)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "past_values": (2, past),
        "past_time_features": (2, past, 1),
        "past_observed_mask": (2, past),
        "future_values": (2, config.prediction_length),
        "future_time_features": (2, config.prediction_length, 1),
    }
    assert float(inputs["past_values"].min()) >= 1.0  # positive: the mean scaler divides by it
    model, inputs = tiny_model("patchtst", "time-series-forecasting", batch_size=3)
    assert tuple(inputs["past_values"].shape) == (3, model.config.context_length, 1)


def test_future_values_is_a_decoder_input_only_where_the_forward_decodes_from_it():
    model, inputs = tiny_model("informer", "time-series-forecasting")
    _, prepared, _ = prepare_for_export(model, inputs)
    assert "future_values" in prepared
    model, inputs = tiny_model("patchtst", "time-series-forecasting")
    inputs["future_values"] = inputs["past_values"][:, :8]
    with pytest.raises(UnsupportedInputError, match="future_values"):
        prepare_for_export(model, inputs)


def test_text_to_audio_and_zero_shot_inputs():
    model, inputs = tiny_model("speecht5", "text-to-audio", seq_len=5)
    assert tuple(inputs["decoder_input_values"].shape) == (2, 5, model.config.num_mel_bins)
    assert model.config.speech_decoder_prenet_dropout == 0.0  # the prenet drops out in eval too
    model, inputs = tiny_model("owlvit", "zero-shot-object-detection")
    assert tuple(inputs["input_ids"].shape) == (2, 4)  # one query per image
    assert inputs["pixel_values"].shape[0] == 2


def test_oneformer_gets_its_task_prompt():
    """issue 28: OneFormer's main_input_name is a list (pixel_values, task_inputs), which the modality
    lookup could not hash (tiny model 'unavailable at eager: TypeError: unhashable type: list'); it
    now gets pixel values and its task prompt's token ids, and runs."""
    import torch

    from hfexport.conventions.roles import input_role
    from hfexport.sample_inputs import modality

    model, inputs = tiny_model("oneformer", "image-segmentation", check_eager=True)
    assert modality(model, "image-segmentation") == "image"
    assert set(inputs) == {"pixel_values", "task_inputs"}
    assert inputs["task_inputs"].dtype == torch.int64
    assert tuple(inputs["task_inputs"].shape) == (2, model.config.task_seq_len)
    role = input_role("task_inputs", 2)
    assert role.batch_axis == 0 and role.sequence_axis is None  # the batch varies; the length is the model's
    with torch.no_grad():
        out = model(**inputs)
    assert tuple(out.class_queries_logits.shape) == (2, model.config.num_queries, model.config.num_labels + 1)


def test_tipsv2_dpt_tiny_weights_keep_the_logits_in_float32_range():
    """issue 28: upstream's kaiming-normal (fan_out) init of every Linear and Conv, the ViT backbone's
    included, grew the tiny model's segmentation logits to 538, and ONNX, OpenVINO and ExecuTorch
    missed eager on them; the preset redraws the weights variance-preserving."""
    import torch

    from hfexport.tiny.presets import PRESETS

    assert PRESETS["tipsv2_dpt"].init == "variance_preserving"
    model, inputs = tiny_model("tipsv2_dpt", "image-segmentation", check_eager=True)
    with torch.no_grad():
        logits = model(**inputs).logits
        reference = model.double()(pixel_values=inputs["pixel_values"].double()).logits
    assert tuple(logits.shape) == (2, model.config.num_labels, 32, 32)
    assert 0.1 < float(logits.abs().max()) < 10.0  # was 538
    assert float((logits.double() - reference).abs().max()) < 1e-4  # float32 rounding stays small
