"""The tiny object detectors whose default transformers configuration does not build or does not
run (issue 28): the zoo's overlays (:mod:`hfexport.tiny.presets`) and shrink rules
(:mod:`hfexport.tiny.shrink`) that make them build, run eagerly and stay small. Each build takes
about a second."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from hfexport.testing import shrunk_config, tiny_model
from hfexport.tiny.models import variance_preserving_init
from hfexport.tiny.shrink import shrink_overrides

#: model type -> (the output checked, its shape at the sample batch 2, 32x32 images)
DETECTORS = {
    # no projector level and 16 ViT windows over 4x4 patches in the default config
    "lw_detr": ("logits", (2, 10, 3)),
    # class_thresholds / class_order None in the default config
    "pp_doclayout_v2": ("order_logits", (2, 10, 10)),
    # the stride-4 tap is the mask branch's (x4_feat_dim), not an encoder input
    "pp_doclayout_v3": ("out_masks", (2, 10, 8, 8)),
    # intraclass_block_config / scale_factor_list / kernel_list None in the default config
    "pp_ocrv5_server_det": ("last_hidden_state", (2, 1, 32, 32)),
    # as above, and the default pp_lcnet_v4 backbone is the one-tap recognition form
    "pp_ocrv6_medium_det": ("last_hidden_state", (2, 1, 32, 32)),
    "pp_ocrv6_small_det": ("last_hidden_state", (2, 1, 32, 32)),
}


@pytest.mark.parametrize("model_type", sorted(DETECTORS))
def test_detector_builds_and_runs_eagerly(model_type):
    model, inputs = tiny_model(model_type, "object-detection", check_eager=True)
    name, shape = DETECTORS[model_type]
    with torch.no_grad():
        out = model(**inputs)
    assert tuple(out[name].shape) == shape
    assert torch.isfinite(out[name]).all()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_omdet_turbo_gets_its_class_and_task_queries():
    model, inputs = tiny_model("omdet-turbo", "zero-shot-object-detection", check_eager=True)
    shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    assert shapes == {
        "pixel_values": (2, 3, 32, 32),
        "classes_input_ids": (2, 4),  # one class name per image
        "classes_attention_mask": (2, 4),
        "tasks_input_ids": (2, 4),  # one task prompt per image
        "tasks_attention_mask": (2, 4),
        "classes_structure": (2,),
    }
    assert inputs["classes_structure"].tolist() == [1, 1]
    with torch.no_grad():
        out = model(**inputs)
    assert tuple(out.decoder_class_logits.shape) == (2, 10, 1)  # [batch, queries, classes per image]
    assert tuple(out.decoder_coord_logits.shape) == (2, 10, 4)


def test_hybrid_encoder_narrows_with_the_decoder_inputs_reading_it():
    config = shrunk_config("rt_detr")
    assert config.encoder_hidden_dim == 64
    assert list(config.decoder_in_channels) == [64, 64, 64]
    model, _ = tiny_model("rt_detr", "object-detection")
    assert sum(p.numel() for p in model.parameters()) < 1_500_000  # 10.9M at width 256


def test_block_spelled_backbone_keeps_its_channels():
    # pp_lcnet_v4 builds from block_configs; narrowing stage_out_channels alone breaks its first block
    backbone = shrink_overrides(AutoConfig.for_model("pp_ocrv6_small_det"))["backbone_config"]
    assert backbone["stage_out_channels"] == [96, 96, 192, 384]
    # hgnet_v2 (no block_configs) still narrows, hidden_sizes following
    backbone = shrink_overrides(AutoConfig.for_model("d_fine"))["backbone_config"]
    assert backbone["stage_out_channels"] == backbone["hidden_sizes"] == [16, 32, 64, 128]


@pytest.mark.parametrize("model_type", ["rt_detr", "d_fine"])
def test_rt_detr_family_selects_its_queries_among_distinct_scores(model_type):
    """issue 28: with upstream's initializer (conv weights and batch-norm scales from N(0, 0.01)) the
    hybrid encoder's features vanished (max 1e-6 rt_detr, 8e-13 d_fine), every encoder class score
    was the prior bias -1.0986, and top-k picked its queries among exact ties (ONNX and OpenVINO broke
    them differently from eager: logits off by 4.2). The variance-preserving redraw keeps the features
    near 1 and a margin between the k-th and the next score that float32 rounding cannot cross."""
    model, inputs = tiny_model(model_type, "object-detection", check_eager=True)
    with torch.no_grad():
        out = model(**inputs)
    assert max(float(t.abs().max()) for t in out.encoder_last_hidden_state) > 0.3
    k = model.config.num_queries
    scores = out.enc_outputs_class.max(-1).values.sort(-1, descending=True).values  # [batch, positions]
    assert float((scores[:, k - 1] - scores[:, k]).min()) > 1e-4  # the chosen set: no tie at the cut
    assert float((scores[:, : k - 1] - scores[:, 1:k]).min()) > 1e-5  # the chosen order: no tie within


def test_variance_preserving_init_keeps_a_conv_batch_norm_stack_alive():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        conv, norm = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16)
        torch.nn.init.normal_(conv.weight, std=0.01)  # the RT-DETR family's initializer
        torch.nn.init.normal_(norm.weight, std=0.01)
        layers += [conv, norm]
    stack = torch.nn.Sequential(*layers).eval()
    x = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        assert float(stack(x).abs().max()) < 1e-10
        assert variance_preserving_init(stack, seed=0) == 12
        assert torch.equal(stack[1].weight, torch.ones(16))
        assert 0.1 < float(stack(x).std()) < 10.0
        before = [p.clone() for p in stack.parameters()]
        variance_preserving_init(stack, seed=0)  # equal seeds, equal weights
        assert all(torch.equal(a, b) for a, b in zip(before, stack.parameters()))
