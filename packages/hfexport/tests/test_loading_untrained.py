"""``load_model`` refuses a task whose class needs weights the checkpoint does not have (they would be
randomly initialized): e.g. ``--task text-generation`` on an encoder-only checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from hfexport.checkpoints import load_model
from hfexport.errors import UntrainedWeightsError


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)  # config.architectures = ["BertModel"]
    return folder


def test_a_fresh_lm_head_is_refused_with_the_task_that_fits(bert_folder):
    with pytest.raises(UntrainedWeightsError) as info:
        load_model(str(bert_folder), "text-generation")
    message = str(info.value)
    assert message.startswith("--task text-generation loads BertLMHeadModel, but ")
    assert "no trained weights for cls.predictions." in message
    assert "the checkpoint's own architecture is BertModel (task feature-extraction)" in message.replace(
        "The checkpoint", "the checkpoint"
    )
    assert "pass --task feature-extraction or --task auto" in message
    assert isinstance(info.value, ValueError)


def test_a_fresh_classifier_is_refused_too(bert_folder):
    with pytest.raises(
        UntrainedWeightsError, match=r"no trained weights for classifier\.bias, classifier\.weight"
    ):
        load_model(str(bert_folder), "text-classification")


def test_the_checkpoints_own_task_loads_and_allow_untrained_opts_in(bert_folder):
    loaded = load_model(str(bert_folder), "auto")
    assert loaded.task == "feature-extraction" and type(loaded.model).__name__ == "BertModel"
    forced = load_model(str(bert_folder), "text-classification", allow_untrained=True)
    assert type(forced.model).__name__ == "BertForSequenceClassification"
    assert not forced.model.training
