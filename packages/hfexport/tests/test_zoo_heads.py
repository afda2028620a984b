"""Tiny builders and sample inputs of the token-classification and question-answering families
(issue 28): the per-type overlays that make transformers' default configurations buildable, the
layout boxes and region features some heads need next to ``input_ids``, and the input roles that let
a dynamic export of them be validated at a second shape. Builds only (each well under a second on an
idle core); the exports are in tests-integration/test_zoo_families.py.
"""

from __future__ import annotations

import pytest
import torch

from hfexport.conventions import input_role
from hfexport.testing import tiny_model
from hfexport.verify.second_shape import derive_second_inputs


@pytest.mark.parametrize(
    ("model_type", "task", "output", "shape"),
    [
        # EsmConfig leaves vocab_size / pad / mask None: the embedding could not be built
        ("esm", "token-classification", "logits", (2, 8, 3)),
        # XmodConfig leaves default_language None: eager raised "Input language unknown"
        ("xmod", "token-classification", "logits", (2, 8, 3)),
        ("xmod", "question-answering", "start_logits", (2, 8)),
        # axial position dims (64, 192) did not sum to the shrunk hidden size
        ("reformer", "question-answering", "start_logits", (2, 8)),
        # head_dim * partial_rotary_factor (4 channels) did not match qk_rope_head_dim (8)
        ("mistral4", "token-classification", "logits", (2, 8, 3)),
        # 4 x 128 + 2 x 128 coordinate/shape widths did not add up to the shrunk hidden size
        ("layoutlmv3", "token-classification", "logits", (2, 8, 3)),
        # six hidden // 6 wide coordinate embeddings (60) fed a 64-wide linear layer
        ("lilt", "question-answering", "start_logits", (2, 8)),
    ],
)
def test_overlays_make_head_types_buildable(model_type, task, output, shape):
    model, inputs = tiny_model(model_type, task, check_eager=True)
    with torch.no_grad():
        first = model(**inputs)[output]
        torch.manual_seed(1234)  # a forward drawing random numbers (reformer's LSH rotations) would change
        second = model(**inputs)[output]
    assert tuple(first.shape) == shape
    assert torch.isfinite(first).all() and float(first.abs().max()) > 1e-4
    assert torch.equal(first, second)  # deterministic: parity with eager means something


def test_esm_overlay_keeps_sample_ids_off_its_special_tokens():
    model, inputs = tiny_model("esm", "token-classification")
    config = model.config
    assert (config.vocab_size, config.pad_token_id, config.mask_token_id) == (33, 1, 32)
    ids = inputs["input_ids"]
    assert int(ids.min()) >= 3 and int(ids.max()) < 32  # never pad, eos or mask


def test_layout_models_get_one_integer_box_per_token():
    model, inputs = tiny_model("layoutlm", "token-classification", check_eager=True)
    boxes = inputs["bbox"]
    assert tuple(boxes.shape) == (2, 8, 4) and boxes.dtype == torch.int64
    assert int(boxes.min()) >= 0 and int(boxes.max()) <= 1000
    assert bool((boxes[..., 0] <= boxes[..., 2]).all() and (boxes[..., 1] <= boxes[..., 3]).all())
    # the boxes reach the model: other boxes, other logits
    with torch.no_grad():
        moved = model(**{**inputs, "bbox": 1000 - boxes.flip(-1)}).logits
        logits = model(**inputs).logits
    assert float((moved - logits).abs().max()) > 1e-5


def test_bros_gets_normalised_float_boxes_it_cannot_run_without():
    model, inputs = tiny_model("bros", "token-classification", check_eager=True)
    boxes = inputs["bbox"]
    assert tuple(boxes.shape) == (2, 8, 4) and boxes.dtype == torch.float32
    assert float(boxes.min()) >= 0.0 and float(boxes.max()) <= 1.0
    with pytest.raises(ValueError, match="specify bbox"):
        model(**{k: v for k, v in inputs.items() if k != "bbox"})


def test_lxmert_gets_region_features_and_boxes():
    model, inputs = tiny_model("lxmert", "question-answering", check_eager=True)
    assert tuple(inputs["visual_feats"].shape) == (2, 4, model.config.visual_feat_dim)
    assert tuple(inputs["visual_pos"].shape) == (2, 4, 4)
    assert inputs["visual_feats"].dtype == inputs["visual_pos"].dtype == torch.float32


def test_boxes_and_regions_have_input_roles():
    bbox = input_role("bbox", 3)
    assert (bbox.kind, bbox.batch_axis, bbox.sequence_axis, bbox.sequence) == ("boxes", 0, 1, "text")
    for name in ("visual_feats", "visual_pos"):
        role = input_role(name, 3)
        assert (role.batch_axis, role.sequence_axis) == (0, None), name


def test_second_shape_repeats_the_sample_boxes_along_batch_and_tokens():
    model, inputs = tiny_model("layoutlm", "token-classification")
    second, reason = derive_second_inputs(model, inputs, seed=1)
    assert second is not None, reason
    b, s = second["input_ids"].shape
    assert (b, s) != tuple(inputs["input_ids"].shape)
    assert tuple(second["bbox"].shape) == (b, s, 4)
    # coordinates are repeated, not drawn: the sample's boxes, row by row and token by token
    assert torch.equal(second["bbox"][:2, :8], inputs["bbox"])
    assert torch.equal(second["bbox"][:, 8:16], second["bbox"][:, :8])


def test_second_shape_of_region_inputs_keeps_the_region_count():
    model, inputs = tiny_model("lxmert", "question-answering")
    second, reason = derive_second_inputs(model, inputs, seed=1)
    assert second is not None, reason
    b = second["input_ids"].shape[0]
    assert b == 3
    assert tuple(second["visual_feats"].shape) == (b, 4, model.config.visual_feat_dim)
    assert tuple(second["visual_pos"].shape) == (b, 4, 4)
