"""Generic tiny presets: any model type transformers knows gets a tiny model (hfexport.testing.zoo).

SAMPLE is a fixed sample of causal-LM and encoder types *outside* the nineteen hand-written presets;
each must build a model of < 5M parameters that runs eagerly on the derived inputs. Types of the
sample whose tiny model cannot be built or run are listed in UNAVAILABLE with the stage and the
reason, so a change in either direction (a new failure, or a fix) fails here instead of being
silently skipped.
"""

from __future__ import annotations

import time

import pytest
import torch

from hfexport.checkpoints import load_model
from hfexport.testing import (
    TinyModelUnavailable,
    UnknownModelTypeError,
    known_model_types,
    make_inputs,
    modality,
    shrunk_config,
    supported_tasks,
    tiny_model,
)

# ---- the sample (model_type, task): 22 causal LMs, 10 masked-LM encoders
SAMPLE_CAUSAL = (
    "granite", "olmo", "olmo2", "phi", "starcoder2", "stablelm", "gemma", "gemma3_text", "cohere",
    "gptj", "codegen", "gpt_bigcode", "gpt_neo", "bloom", "falcon", "qwen2_moe", "qwen3_moe",
    "deepseek_v3", "mamba", "mamba2", "jamba", "bamba",
)  # fmt: skip
SAMPLE_ENCODERS = (
    "albert", "electra", "deberta-v2", "camembert", "xlm-roberta", "mpnet", "roformer", "modernbert",
    "big_bird", "esm",
)  # fmt: skip
SAMPLE = [(mt, "text-generation") for mt in SAMPLE_CAUSAL] + [(mt, "fill-mask") for mt in SAMPLE_ENCODERS]

#: sample types whose tiny model is unavailable in transformers 5.24: (stage, words of the reason)
UNAVAILABLE: dict[str, tuple[str, str]] = {
    # esm built since its overlay (hfexport.tiny.presets: the ESM-2 vocabulary; test_zoo_heads.py)
}


def test_sample_is_outside_the_hand_written_presets_and_known_to_transformers():
    from hfexport.testing import SUPPORTED_MODEL_TYPES

    assert len(SAMPLE) >= 30
    assert not {mt for mt, _ in SAMPLE} & set(SUPPORTED_MODEL_TYPES)
    for mt, task in SAMPLE:
        assert mt in known_model_types(task), (mt, task)


@pytest.mark.parametrize(("model_type", "task"), SAMPLE, ids=[mt for mt, _ in SAMPLE])
def test_generic_tiny_model_builds_small_and_runs_eagerly(model_type, task):
    if model_type in UNAVAILABLE:
        stage, words = UNAVAILABLE[model_type]
        with pytest.raises(TinyModelUnavailable) as info:
            tiny_model(model_type, task, check_eager=True)
        assert (info.value.stage, info.value.model_type, info.value.task) == (stage, model_type, task)
        assert words in info.value.reason
        return
    start = time.perf_counter()
    model, inputs = tiny_model(model_type, task, check_eager=True)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    assert params < 5_000_000, params
    assert seconds < 30, seconds  # < 1 s on an idle core; generous for a loaded CI machine
    assert not model.training
    assert {k: tuple(v.shape) for k, v in inputs.items()} in (
        {"input_ids": (2, 8), "attention_mask": (2, 8)},
        {"input_ids": (2, 8)},  # forwards without an attention mask (mamba, ...)
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    vocab = model.config.get_text_config().vocab_size
    assert vocab <= 256
    assert tuple(logits.shape) == (2, 8, vocab) and torch.isfinite(logits).all()
    # random ids avoid every special token (kept in range, at 0..2 or at the top of the vocabulary)
    ids = inputs["input_ids"]
    assert int(ids.min()) >= 3 and int(ids.max()) < vocab
    text = model.config.get_text_config()
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, attr, None)
        for token in value if isinstance(value, list) else [value]:
            assert token is None or 0 <= token < vocab, (attr, token)
            assert token is None or not bool((ids == token).any()), (attr, token)
    # deterministic: same weights, same inputs
    again, inputs_again = tiny_model(model_type, task)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert all(torch.equal(inputs[k], inputs_again[k]) for k in inputs)


def test_shrunk_generic_configs_are_consistent():
    granite = shrunk_config("granite")
    assert (granite.hidden_size, granite.num_hidden_layers, granite.intermediate_size) == (64, 2, 128)
    assert (granite.num_attention_heads, granite.num_key_value_heads, granite.vocab_size) == (4, 4, 256)
    assert granite.hidden_size % granite.num_attention_heads == 0
    qwen3_moe = shrunk_config("qwen3_moe")
    assert (qwen3_moe.num_experts, qwen3_moe.num_experts_per_tok) == (4, 2)
    assert qwen3_moe.num_attention_heads % qwen3_moe.num_key_value_heads == 0
    assert qwen3_moe.hidden_size // qwen3_moe.num_attention_heads == 16
    gemma3 = shrunk_config("gemma3_text")  # 5:1 sliding/full pattern: both kinds kept in two layers
    assert gemma3.layer_types == ["sliding_attention", "full_attention"]
    assert gemma3.sliding_window == 32 and gemma3.head_dim == 16
    olmo2 = shrunk_config("olmo2")  # eos 50279 moved to the top of the 256-token vocabulary
    assert (olmo2.pad_token_id, olmo2.eos_token_id, olmo2.vocab_size) == (1, 255, 256)
    starcoder = shrunk_config("gpt_bigcode")  # multi-query attention stays multi-query
    assert starcoder.multi_query and starcoder.n_head == 4
    deepseek = shrunk_config("deepseek_v3")  # MLA: qk head dim = nope + rope
    assert (deepseek.qk_nope_head_dim, deepseek.qk_rope_head_dim, deepseek.qk_head_dim) == (16, 8, 24)
    assert deepseek.first_k_dense_replace == 1 and deepseek.n_routed_experts == 4
    assert shrunk_config("olmo2", num_hidden_layers=3).num_hidden_layers == 3  # overrides still apply


@pytest.mark.parametrize(
    ("model_type", "task", "kind", "shapes"),
    [
        ("convnext", "image-classification", "image", {"pixel_values": (2, 3, 32, 32)}),
        # hubert: conv kernels (10,3,3,3,3,2,2), strides (5,2,2,2,2,2,2) -> 2640 samples for 8 frames
        (
            "hubert",
            "automatic-speech-recognition",
            "audio",
            {"input_values": (2, 2640), "attention_mask": (2, 2640)},
        ),
        (
            "speech_to_text",
            "automatic-speech-recognition",
            "audio-features",
            {"input_features": (2, 32, 80), "attention_mask": (2, 32), "decoder_input_ids": (2, 8)},
        ),
        # llava: 32x32 image, 8x8 patches -> 16 image tokens inserted after the first text token
        (
            "llava",
            "image-text-to-text",
            "image+text",
            {"pixel_values": (2, 3, 32, 32), "input_ids": (2, 24), "attention_mask": (2, 24)},
        ),
    ],
)
def test_inputs_follow_the_modality(model_type, task, kind, shapes):
    model, inputs = tiny_model(model_type, task, check_eager=True)
    assert modality(model, task) == kind
    assert {k: tuple(v.shape) for k, v in inputs.items()} == shapes
    if kind == "image+text":
        image_token = model.config.image_token_id
        assert (inputs["input_ids"] == image_token).sum(dim=1).tolist() == [16, 16]
        assert inputs["input_ids"][:, 1:17].eq(image_token).all()
    second = make_inputs(model, task, batch_size=1, seq_len=5, seed=1)
    with torch.no_grad():
        model(**second)


def test_unknown_model_type_lists_close_matches():
    with pytest.raises(UnknownModelTypeError, match=r"unknown model_type 'granit'.*close matches: granite"):
        tiny_model("granit")
    with pytest.raises(ValueError, match=r"close matches: olmo2, molmo2, olmo, olmoe, olmo3\)"):
        load_model("tiny:olmo22")
    with pytest.raises(UnknownModelTypeError, match=r"no close match"):
        tiny_model("zzzzqqqq")


def test_task_without_a_class_names_the_tasks_the_type_has():
    assert supported_tasks("granite") == ("text-generation", "feature-extraction")  # no classifier class
    with pytest.raises(
        ValueError,
        match=r"not available for task 'image-classification'; its tasks: text-generation, feature-extraction$",
    ):
        tiny_model("granite", "image-classification")
    with pytest.raises(ValueError, match=r"tiny convnext model is not available for task 'text-generation'"):
        load_model("tiny:convnext", "text-generation")


def test_load_model_tiny_generic_type_uses_its_default_task():
    loaded = load_model("tiny:olmo2")
    assert loaded.task == "text-generation"
    assert type(loaded.model).__name__ == "Olmo2ForCausalLM"
    assert tuple(loaded.inputs["input_ids"].shape) == (2, 8)
    assert load_model("tiny:electra").task == "fill-mask"


def test_unavailable_is_typed_with_stage_and_reason():
    # EsmConfig's own default (no vocabulary size), which the zoo's esm overlay replaces
    with pytest.raises(TinyModelUnavailable) as info:
        tiny_model("esm", "fill-mask", check_eager=True, vocab_size=None, pad_token_id=None)
    assert info.value.stage == "build" and "must be tuple of ints" in info.value.reason
    assert "unavailable at build" in str(info.value)


def test_hybrid_shrink_keeps_an_attention_layer_in_two_layers():
    # jamba (attention every 8th layer from 4) and bamba (no attention layer by default) would hold no
    # attention layer in two layers, and the hybrid cache's get_seq_length fails eagerly without one
    jamba = shrunk_config("jamba")
    assert (jamba.num_hidden_layers, jamba.attn_layer_period, jamba.attn_layer_offset) == (2, 2, 1)
    assert (jamba.expert_layer_period, jamba.expert_layer_offset) == (2, 1)
    assert shrunk_config("bamba").attn_layer_indices == [1]
    for model_type in ("jamba", "bamba"):
        model, inputs = tiny_model(model_type, "text-generation", check_eager=True)
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape == (2, 8, model.config.vocab_size) and torch.isfinite(logits).all()


def test_heterogeneous_per_layer_configs_are_shrunk():
    # transformers >= 5.20 heterogeneous configs raise AmbiguousGlobalPerLayerAttributeError (not an
    # AttributeError) when a per-layer attribute is read globally; the shrink must not read them, and
    # must shrink per_layer_config too (gemma4's default full-attention layers have head_dim 512)
    config = shrunk_config("gemma4_text")
    layer_types = config.to_dict()["layer_types"]
    assert layer_types == ["sliding_attention", "full_attention"]
    assert config.per_layer_config[1].head_dim == 16 and config.per_layer_config[0].head_dim == 16
    assert config.vocab_size_per_layer_input == 256
    # dots3_note_text: sliding layers keep their preset head_dim (qk_nope + qk_rope = 16 + 8)
    dots = shrunk_config("dots3_note_text")
    assert dots.per_layer_config[1].head_dim == 24 and dots.per_layer_config[1].num_attention_heads == 4
    for model_type in ("gemma4_text", "dots3_note_text"):
        model, inputs = tiny_model(model_type, "text-generation", check_eager=True)
        assert sum(p.numel() for p in model.parameters()) < 2_000_000
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape == (2, 8, 256) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "model_type",
    ["dbrx", "dots1", "granitemoehybrid", "hunyuan_v1_dense", "ministral", "nemotron", "lfm2_moe"],
)
def test_overlays_make_broken_defaults_buildable(model_type):
    # dbrx: modeling reads attn_config.rope_theta / clamps with clip_qkv; dots1: None expert counts;
    # granitemoehybrid: no attention layer by default; hunyuan_v1_dense, ministral: head_dim None read as
    # is; nemotron: num_key_value_heads None read as is; lfm2_moe: layer_types None
    model, inputs = tiny_model(model_type, "text-generation", check_eager=True)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (2, 8, 256) and torch.isfinite(logits).all()


def test_dory_layer_sections_add_up_and_run_past_the_window():
    # the generic two layers left dory's recurrent section at -7 layers: eager failed past the 32-token
    # window (and capture with "size of tensor a (s + Min(31, s)) must match ... (s)")
    model, _ = tiny_model("dory", "text-generation", check_eager=True)
    c = model.config
    assert (c.n_input_layers, c.n_recurrent_layers, c.n_output_layers, c.num_hidden_layers) == (1, 1, 1, 3)
    assert c.sliding_window == 32 and "full_attention" in c.layer_types
    with torch.no_grad():
        logits = model(**make_inputs(model, batch_size=2, seq_len=40, seed=0)).logits
    assert logits.shape == (2, 40, 256) and torch.isfinite(logits).all()


def test_zero_initialised_router_is_redrawn_so_top_k_has_no_ties():
    # afmoe zero-initialises router.gate: every expert scored sigmoid(0) = 0.5, and torch's topk and
    # ONNX Runtime's TopK broke the exact ties differently (onnx validate: logits max abs 0.22)
    model, inputs = tiny_model("afmoe", "text-generation")
    router = model.model.layers[1].mlp.router
    assert router.gate.weight.abs().max().item() > 0
    assert all(p.any() for p in model.parameters() if p.dim() >= 2)
    gaps = []
    router.register_forward_hook(
        lambda _m, _a, out: gaps.append(
            (lambda t: (t[:, 1] - t[:, 2]).min())(out[0].sigmoid().topk(3).values)
        )
    )
    with torch.no_grad():
        model(**inputs)
    assert gaps and gaps[0].item() > 1e-6  # the second and third expert scores are never tied
    again, _ = tiny_model("afmoe", "text-generation")  # seeded: the same weights
    assert torch.equal(again.model.layers[1].mlp.router.gate.weight, router.gate.weight)


def test_single_expert_default_gets_real_routing():
    # hunyuan_v1_moe's default one expert top-1 made grouped_mm's histc(bins=1, min=0, max=0), which
    # torchlib refuses ("aten_histc with min == max (0.0) is not supported"): ONNX translate failed
    config = shrunk_config("hunyuan_v1_moe")
    assert (config.num_experts, config.moe_topk) == (4, 2)


def test_a_tiny_model_whose_outputs_vanish_is_reported_degenerate():
    """At the default initializer_range MobileViT's tiny logits are exactly 0: a parity check would
    compare zeros, so check_eager refuses it, naming the fix."""
    with pytest.raises(TinyModelUnavailable, match=r"degenerate outputs: every value is below 1e-06") as info:
        tiny_model("mobilevit", "image-classification", check_eager=True, initializer_range=0.02)
    assert info.value.stage == "eager" and "initializer_range" in info.value.reason


def test_a_tiny_model_whose_outputs_hold_nan_is_refused():
    """A NaN in any eager output makes parity meaningless: check_runs_eagerly names the output."""
    from hfexport.tiny.models import check_runs_eagerly

    model, inputs = tiny_model("bert", "fill-mask")
    with torch.no_grad():
        model.get_output_embeddings().bias[3] = float("nan")
    with pytest.raises(TinyModelUnavailable, match=r"NaN in the eager outputs \(#0 \[") as info:
        check_runs_eagerly(model, inputs, "fill-mask")
    assert info.value.stage == "eager" and "initializer_range" in info.value.reason
    with torch.no_grad():
        model.get_output_embeddings().bias[3] = float("-inf")  # infinities stay allowed
    assert check_runs_eagerly(model, inputs, "fill-mask").logits.isinf().any()


@pytest.mark.parametrize(
    ("model_type", "least"),
    [
        ("mobilevit", 0.1),
        ("efficientnet", 0.5),
        ("mobilenet_v1", 0.1),
        ("mobilenet_v2", 30.0),
        ("pp_lcnet", 1.0),
    ],
)
def test_deep_conv_overlays_give_outputs_worth_comparing(model_type, least):
    model, inputs = tiny_model(model_type, "image-classification", check_eager=True)
    with torch.no_grad():
        peak = float(model(**inputs)[0].abs().max())
    assert least <= peak < 1e3, peak


@pytest.mark.parametrize("task", ["depth-estimation", "image-segmentation"])
def test_dpt_overlay_gives_dense_outputs_worth_comparing(task):
    """issue 28: at initializer_range 0.2 DPT's heads gave 1.6e8 (ONNX, ExecuTorch and OpenVINO then
    missed eager by 304 in absolute), at 0.02 they vanish: the overlay's range keeps them near 1."""
    model, inputs = tiny_model("dpt", task, check_eager=True)
    with torch.no_grad():
        out = model(**inputs)
    dense = out.predicted_depth if task == "depth-estimation" else out.logits
    assert 0.1 <= float(dense.abs().max()) < 1e2


@pytest.mark.parametrize(
    ("model_type", "outputs"),
    [
        # the FPN's 4 taps (out_indices) inside the tiny stack: beit refused its single tap, data2vec-vision's
        # [3, 5, 7, 11] ran past 2 layers (a 128-channel map met a 256-channel conv)
        ("beit", {"logits": (2, 3, 16, 16)}),
        ("data2vec-vision", {"logits": (2, 3, 16, 16)}),
        # d_model + encoder heads = 72 channels for the mask head's GroupNorm(8) (68 was refused)
        ("detr", {"pred_masks": (2, 10, 8, 8), "logits": (2, 10, 4)}),
        # one query block inside the 2-layer stack (4 never joined the queries: 0 patch tokens left)
        ("eomt", {"masks_queries_logits": (2, 10, 16, 16), "class_queries_logits": (2, 10, 4)}),
        ("eomt_dinov3", {"masks_queries_logits": (2, 10, 16, 16), "class_queries_logits": (2, 10, 4)}),
        # the default head_config has no upsample blocks (unbuildable)
        ("sapiens2", {"logits": (2, 3, 16, 16)}),
        # 64x64 images (32x32 left a 1x1 map under 2x2 unfold patches), initializer_range 0.2 (outputs were 0)
        ("mobilevitv2", {"logits": (2, 3, 2, 2)}),
        # 64-channel pixel decoders and heads (the defaults' 256 channels made 3.1M / 7.5M parameters)
        ("maskformer", {"masks_queries_logits": (2, 10, 8, 8), "class_queries_logits": (2, 10, 4)}),
        ("oneformer", {"masks_queries_logits": (2, 10, 8, 8), "class_queries_logits": (2, 10, 4)}),
    ],
)
def test_segmentation_overlays_build_heads_that_run(model_type, outputs):
    """issue 28: image-segmentation types the generic shrink left unbuildable or failing eagerly."""
    model, inputs = tiny_model(model_type, "image-segmentation", check_eager=True)
    side = 64 if model_type == "mobilevitv2" else 32
    assert tuple(inputs["pixel_values"].shape) == (2, 3, side, side)
    if model_type in ("maskformer", "oneformer"):  # swin backbone + 64-channel heads, not the 256 defaults
        assert sum(p.numel() for p in model.parameters()) < 700_000
    with torch.no_grad():
        out = model(**inputs)
    for name, shape in outputs.items():
        assert tuple(out[name].shape) == shape, name
        assert float(out[name].abs().max()) > 1e-3, name


# issue 28: the task heads, dual encoders and audio classifiers of the new sweep families
@pytest.mark.parametrize(
    ("model_type", "task", "shapes", "outputs"),
    [
        (
            "clip",
            "zero-shot-image-classification",
            {"input_ids": (2, 8), "attention_mask": (2, 8), "pixel_values": (2, 3, 32, 32)},
            {"logits_per_image": (2, 2), "text_embeds": (2, 64), "image_embeds": (2, 64)},
        ),
        # the text head's projection_size overlay (768 by default) meets the vision width
        (
            "siglip",
            "zero-shot-image-classification",
            {"input_ids": (2, 8), "attention_mask": (2, 8), "pixel_values": (2, 3, 32, 32)},
            {"logits_per_image": (2, 2), "text_embeds": (2, 64), "image_embeds": (2, 64)},
        ),
        # EfficientNet tower at width/depth 0.25 and initializer_range 0.4: finite logits, 80-wide embeddings
        (
            "align",
            "zero-shot-image-classification",
            {"input_ids": (2, 8), "attention_mask": (2, 8), "pixel_values": (2, 3, 32, 32)},
            {"logits_per_image": (2, 2), "text_embeds": (2, 80), "image_embeds": (2, 80)},
        ),
        # NaFlex: a 4x4 grid of flattened 8x8 RGB patches, as siglip2's processor gives them
        (
            "siglip2",
            "zero-shot-image-classification",
            {
                "input_ids": (2, 8),
                "attention_mask": (2, 8),
                "pixel_values": (2, 16, 192),
                "pixel_attention_mask": (2, 16),
                "spatial_shapes": (2, 2),
            },
            {"logits_per_image": (2, 2)},
        ),
        (
            "audio-spectrogram-transformer",
            "audio-classification",
            {"input_values": (2, 64, 32)},
            {"logits": (2, 3)},
        ),
        # stacked frames: feature_projection_input_dim 160 = 2 x 80 mel bins
        (
            "wav2vec2-bert",
            "audio-classification",
            {"input_features": (2, 32, 160), "attention_mask": (2, 32)},
            {"logits": (2, 3)},
        ),
        ("whisper", "audio-classification", {"input_features": (2, 16, 64)}, {"logits": (2, 3)}),
        (
            "bert",
            "question-answering",
            {"input_ids": (2, 8), "attention_mask": (2, 8)},
            {"start_logits": (2, 8)},
        ),
        (
            "electra",
            "token-classification",
            {"input_ids": (2, 8), "attention_mask": (2, 8)},
            {"logits": (2, 8, 3)},
        ),
    ],
)
def test_new_family_tasks_build_with_their_inputs_and_outputs(model_type, task, shapes, outputs):
    model, inputs = tiny_model(model_type, task, check_eager=True)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == shapes
    with torch.no_grad():
        out = model(**inputs)
    for name, shape in outputs.items():
        assert tuple(out[name].shape) == shape, name
        assert torch.isfinite(out[name]).all(), name
    assert float(out[next(iter(outputs))].abs().max()) > 0


def test_question_answering_heads_have_two_labels_unless_overridden():
    model, _ = tiny_model("roberta", "question-answering")
    assert model.config.num_labels == 2 and model.qa_outputs.out_features == 2
    with pytest.raises(ValueError, match="num_labels should be 2"):
        tiny_model("distilbert", "question-answering", num_labels=3)


@pytest.mark.parametrize("model_type", ["mllama", "llava"])
def test_sub_configurations_get_three_labels_without_a_transformers_warning(model_type):
    """A sub-configuration's default two-label maps are dropped with its new count, so transformers
    no longer warns "You passed `num_labels=3` which is incompatible to the `id2label` map of
    length `2`" (printed twice on every ``tiny:mllama`` CLI load; fresh-user trial)."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    source = logging.getLogger("transformers.configuration_utils")
    handler = Keep(level=logging.WARNING)
    source.addHandler(handler)
    try:
        config = shrunk_config(model_type)
    finally:
        source.removeHandler(handler)
    assert [r.getMessage() for r in records if "num_labels" in r.getMessage()] == []
    for sub in (config.vision_config, config.text_config):
        assert sub.num_labels == 3 and sub.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
