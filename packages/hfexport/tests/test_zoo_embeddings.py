"""Tiny builders of the sentence-embedding and question-answering families (issue 28).

Builds only (each well under a second on an idle core); the exports are in
tests-integration/test_zoo_families.py and test_workarounds_text_encoders.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import FunnelConfig

from hfexport.testing import tiny_model
from hfexport.tiny.models import _name_default_architecture


@pytest.mark.parametrize(
    ("model_type", "task", "model_class"),
    [
        # AutoModel maps funnel to (FunnelModel, FunnelBaseModel): from_config raised TypeError 'NoneType'
        # object is not iterable on a config without architectures (transformers 5.24 _get_model_class)
        ("funnel", "feature-extraction", "FunnelModel"),
        # the same tuple entries of AutoModelForImageClassification
        ("deit", "image-classification", "DeiTForImageClassification"),
    ],
)
def test_a_type_the_auto_class_maps_to_several_classes_builds_the_first(model_type, task, model_class):
    model, inputs = tiny_model(model_type, task, check_eager=True)
    assert type(model).__name__ == model_class
    assert model.config.architectures == [model_class]
    with torch.no_grad():
        out = model(**inputs)
    first = out[0]
    assert torch.isfinite(first).all() and float(first.abs().max()) > 1e-4


def test_default_architecture_is_named_only_when_the_config_names_none():
    config = FunnelConfig()
    assert config.architectures is None
    assert _name_default_architecture(transformers.AutoModel, config) == "FunnelModel"
    assert config.architectures == ["FunnelModel"]
    chosen = FunnelConfig(architectures=["FunnelBaseModel"])
    assert _name_default_architecture(transformers.AutoModel, chosen) is None
    assert chosen.architectures == ["FunnelBaseModel"]
    single = transformers.BertConfig()  # one class per config: nothing to name
    assert _name_default_architecture(transformers.AutoModel, single) is None
    assert single.architectures is None
    assert _name_default_architecture(object, FunnelConfig()) is None  # not an Auto class


def test_funnel_overlay_pools_the_sample_to_more_than_one_position():
    model, inputs = tiny_model("funnel", "question-answering", check_eager=True)
    config = model.config
    assert list(config.block_sizes) == [1, 1] and config.num_decoder_layers == 1
    seq_len = inputs["input_ids"].shape[1]
    pooled = 1 + len(list(range(seq_len))[1:-1][::2])  # <cls> + every second truncated position
    assert pooled > 2  # a size-1 pooled axis would be specialised by torch.export
    with torch.no_grad():
        out = model(**inputs)
    assert tuple(out.start_logits.shape) == (2, seq_len)
