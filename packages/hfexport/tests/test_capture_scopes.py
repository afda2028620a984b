"""The capture scopes: one family's capture patches for a model of that family, "capture" otherwise."""

from __future__ import annotations

import pytest
import torch

from hfexport.capture import CAPTURE_SCOPES, capture_patch_key
from hfexport.workarounds import (
    dense_prediction,
    detection,
    text_classification,
    text_encoders,
    text_to_audio,
    time_series,
    vision_language,
)
from hfexport.workarounds.scopes import holds_module_from


def _module_from(modeling_module: str) -> torch.nn.Module:
    cls = type("FromThere", (torch.nn.Module,), {"__module__": modeling_module})
    return cls()


@pytest.mark.parametrize(
    ("scope", "modeling"),
    [
        (dense_prediction, dense_prediction.DENSE_PREDICTION_MODULES),
        (detection, detection.DETECTOR_MODULES),
        (time_series, time_series.FORECASTER_MODULES),
        (text_to_audio, text_to_audio.TEXT_TO_AUDIO_MODULES),
        (text_encoders, text_encoders.TEXT_ENCODER_MODULES),
        (vision_language, vision_language.VISION_LANGUAGE_MODULES),
    ],
)
def test_a_model_of_a_family_gets_its_scope_also_inside_a_wrapper(scope, modeling):
    inner = _module_from(modeling[0])
    assert capture_patch_key(inner) == scope.KEY == f"capture.{scope.__name__.rsplit('.', 1)[-1]}"
    assert capture_patch_key(torch.nn.Sequential(torch.nn.Linear(2, 2), inner)) == scope.KEY
    assert holds_module_from(inner, modeling) and not holds_module_from(torch.nn.Linear(2, 2), modeling)


def test_other_models_get_the_shared_capture_patches_and_every_scope_is_listed():
    assert capture_patch_key(torch.nn.Linear(2, 2)) == "capture"
    assert capture_patch_key(_module_from("transformers.models.llama.modeling_llama")) == "capture"
    assert [s.KEY for s in CAPTURE_SCOPES] == [
        "capture.dense_prediction",
        "capture.detection",
        "capture.time_series",
        "capture.text_to_audio",
        "capture.text_encoders",
        "capture.text_classification",
        "capture.vision_language",
    ]


def test_text_classification_scope_takes_the_eos_pooled_heads_only():
    # a module of bart's modeling file is not enough: only the sequence-classification head is patched
    modeling = text_classification.TEXT_CLASSIFICATION_MODULES[0]
    assert capture_patch_key(_module_from(modeling)) == "capture"
    head = type("BartForSequenceClassification", (torch.nn.Module,), {"__module__": modeling})()
    assert capture_patch_key(torch.nn.Sequential(head)) == text_classification.KEY
    assert holds_module_from(head, text_classification.TEXT_CLASSIFICATION_MODULES)
