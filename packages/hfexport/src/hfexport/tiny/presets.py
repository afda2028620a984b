"""Per-model-type overrides of the tiny-model zoo, kept as data: one entry per type that needs one.

Every model type transformers knows gets a tiny configuration by the generic shrink of
:mod:`hfexport.tiny.shrink`. An entry here changes that for one type:

* ``mode="replace"``: the entry's ``config`` *is* the tiny configuration (the nineteen hand-written
  presets; their shapes are relied on by tests across the repository, so they never go through the
  generic shrink);
* ``mode="overlay"``: the entry's ``config`` is merged over the generic shrink (nested dicts key by
  key), for types the generic rules get wrong.

``tasks`` (optional) fixes the tasks the tiny model is offered for, default first; without it the
tasks come from transformers' auto mappings. ``attn_implementation`` (optional) replaces the
default ``"sdpa"``. ``init="variance_preserving"`` (optional) redraws the built model's weight
matrices at fan-in scale and sets its batch-norm scales to 1 (:func:`hfexport.tiny.models.
variance_preserving_init`), for types whose upstream initializer makes the activations vanish
through deep convolution stacks (or grow, as DepthPro's fusion stages and head do). ``reason`` says why the entry exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["PRESETS", "Preset"]


@dataclass(frozen=True)
class Preset:
    """One per-type override of the zoo.

    Attributes:
        config: configuration attributes (sub-configurations as nested dicts).
        reason: why the type needs an entry (one sentence).
        mode: ``"replace"`` (``config`` is the whole tiny configuration) or ``"overlay"`` (merged
            over the generic shrink).
        tasks: the tasks offered, default first; ``None`` = from transformers' auto mappings.
        attn_implementation: the attention implementation the model is built with when the caller
            gives none; ``None`` = ``"sdpa"`` (with a fallback to ``"eager"`` where SDPA is missing).
        init: ``"config"`` (the weights transformers' initializer draws, from the configuration's
            ``initializer_range``) or ``"variance_preserving"`` (then redrawn by
            :func:`hfexport.tiny.models.variance_preserving_init` after the build).
    """

    config: dict[str, Any]
    reason: str
    mode: Literal["replace", "overlay"] = "overlay"
    tasks: tuple[str, ...] | None = None
    attn_implementation: str | None = None
    init: Literal["config", "variance_preserving"] = "config"


_VOCAB = 256
_NUM_LABELS = 3
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# fastspeech2_conformer's model widths, alone and under the HiFi-GAN wrapper (issue 28, text-to-audio)
_FASTSPEECH2_CONFORMER: dict[str, Any] = {
    "encoder_linear_units": 128,
    "decoder_linear_units": 128,
    "speech_decoder_postnet_units": 32,
    "duration_predictor_channels": 32,
    "energy_predictor_channels": 32,
    "pitch_predictor_channels": 32,
}

# Decoder-only language models share one skeleton; each entry only adds what differs.
_DECODER_BASE: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    **_SPECIAL_IDS,
}

_ENCODER_BASE: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}

_HAND_WRITTEN: dict[str, dict[str, Any]] = {
    "llama": {**_DECODER_BASE, "head_dim": 16},
    "qwen2": {**_DECODER_BASE},
    "qwen3": {**_DECODER_BASE, "head_dim": 16},
    "mistral": {**_DECODER_BASE, "head_dim": 16},
    "gemma2": {**_DECODER_BASE, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32},
    "phi3": {**_DECODER_BASE, "original_max_position_embeddings": 512},
    "gpt2": {
        "vocab_size": _VOCAB,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 128,
        "n_positions": 512,
        **_SPECIAL_IDS,
    },
    "gpt_neox": {
        **{k: v for k, v in _DECODER_BASE.items() if k != "num_key_value_heads"},
        "rotary_pct": 0.25,
    },
    "opt": {
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "word_embed_proj_dim": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
    },
    "mixtral": {
        **_DECODER_BASE,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "bert": {**_ENCODER_BASE, "pad_token_id": 0},
    # roberta offsets positions by pad_token_id + 1, hence the two extra positions.
    "roberta": {
        **_ENCODER_BASE,
        "max_position_embeddings": 514,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
    "distilbert": {
        "vocab_size": _VOCAB,
        "dim": 64,
        "hidden_dim": 128,
        "n_layers": 2,
        "n_heads": 4,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
    },
    "t5": {
        "vocab_size": _VOCAB,
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    },
    "bart": {
        "vocab_size": _VOCAB,
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_position_embeddings": 512,
        "bos_token_id": 0,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
        "forced_eos_token_id": 2,
    },
    "vit": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
        "encoder_stride": 8,
    },
    "whisper": {
        "vocab_size": _VOCAB,
        "num_mel_bins": 16,
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_source_positions": 32,
        "max_target_positions": 448,
        **_SPECIAL_IDS,
        "decoder_start_token_id": 1,
        # real checkpoints suppress "space" and end-of-text at the first step; ids must fit the vocab
        "begin_suppress_tokens": [2],
    },
    "wav2vec2": {
        "vocab_size": 32,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": [32, 32],
        "conv_kernel": [10, 3],
        "conv_stride": [5, 2],
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
        "feat_extract_norm": "layer",
        "do_stable_layer_norm": True,
        "layerdrop": 0.0,
        "mask_time_prob": 0.0,
        **_SPECIAL_IDS,
    },
    "qwen2_vl": {
        "image_token_id": 250,
        "video_token_id": 251,
        "vision_start_token_id": 252,
        "vision_end_token_id": 253,
        "text_config": {
            "vocab_size": _VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
            **_SPECIAL_IDS,
        },
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "in_channels": 3,
        },
    },
}


_CAUSAL = ("text-generation", "feature-extraction", "text-classification")
_ENCODER = ("feature-extraction", "fill-mask", "text-classification")
_HAND_WRITTEN_TASKS: dict[str, tuple[str, ...]] = {
    **{
        mt: _CAUSAL
        for mt in (
            "llama",
            "qwen2",
            "qwen3",
            "mistral",
            "gemma2",
            "phi3",
            "gpt2",
            "gpt_neox",
            "opt",
            "mixtral",
        )
    },
    **{mt: _ENCODER for mt in ("bert", "roberta", "distilbert")},
    "t5": ("text2text-generation", "feature-extraction"),
    "bart": ("text2text-generation", "feature-extraction"),
    "vit": ("image-classification", "feature-extraction"),
    "whisper": ("automatic-speech-recognition", "feature-extraction"),
    "wav2vec2": ("automatic-speech-recognition", "feature-extraction"),
    "qwen2_vl": ("image-text-to-text",),
}

_HAND_WRITTEN_REASONS: dict[str, str] = {
    "llama": "hand-written preset (GQA 4/2 heads, head_dim 16); its shapes are relied on by the zoo tests",
    "qwen2": "hand-written preset (GQA, biased q/k/v); its shapes are relied on by the zoo tests",
    "qwen3": "hand-written preset (q/k norms, head_dim 16); its shapes are relied on by the zoo tests",
    "mistral": "hand-written preset keeping the default 4096-token sliding window (never reached in tests)",
    "gemma2": "hand-written preset: alternating sliding/full attention with a 32-token window; no SDPA path",
    "phi3": "hand-written preset: original_max_position_embeddings must match the shrunk positions",
    "gpt2": "hand-written preset (n_* attribute names, learned positions)",
    "gpt_neox": "hand-written preset: partial rotary embeddings (rotary_pct 0.25), no kv heads",
    "opt": "hand-written preset: learned positions offset by 2, its own pad/bos/eos ids",
    "mixtral": "hand-written preset: 4 experts, top-2 routing (grouped_mm experts)",
    "bert": "hand-written preset; its shapes are relied on by the zoo tests and the CLI tests",
    "roberta": "hand-written preset: positions offset by pad_token_id + 1, hence 514 positions",
    "distilbert": "hand-written preset (dim/hidden_dim/n_* attribute names)",
    "t5": "hand-written preset: relative position buckets (8 buckets, distance 32)",
    "bart": "hand-written preset: its own bos/pad/eos/decoder-start ids",
    "vit": "hand-written preset: 32x32 images in 8x8 patches",
    "whisper": "hand-written preset: 64 mel frames of 16 bins, begin_suppress_tokens inside the vocab",
    "wav2vec2": "hand-written preset: a two-layer conv feature encoder, CTC head",
    "qwen2_vl": "hand-written preset: mrope sections, one image of 4x4 patches in a 12-token prompt",
}

_EAGER_ONLY = frozenset({"gemma2"})  # no SDPA implementation in transformers 5.24

#: model_type -> its override (see the module docstring).
PRESETS: dict[str, Preset] = {
    mt: Preset(
        config=cfg,
        reason=_HAND_WRITTEN_REASONS[mt],
        mode="replace",
        tasks=_HAND_WRITTEN_TASKS[mt],
        attn_implementation="eager" if mt in _EAGER_ONLY else None,
    )
    for mt, cfg in _HAND_WRITTEN.items()
}

# Overlays over the generic shrink, for types its rules get wrong.
PRESETS.update(
    {
        "deepseek_v2": Preset(
            config={"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1},
            reason="the default config leaves num_experts_per_tok None, which its router cannot use",
        ),
        "dbrx": Preset(
            config={"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
            reason=(
                "transformers 5.24 DbrxAttention.__init__ reads attn_config.rope_theta, which "
                "DbrxAttentionConfig no longer defines (rotary base moved to rope_parameters; the "
                "attribute is stored, never used), and its clamp needs clip_qkv set (None gives "
                "clamp(min=None, max=None)); no upstream issue found"
            ),
        ),
        "dots1": Preset(
            config={"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
            reason=(
                "the default config leaves n_routed_experts, num_experts_per_tok and n_shared_experts "
                "None; its experts cannot be built"
            ),
        ),
        "dots3_note_text": Preset(
            config={"per_layer_config": {"1": {"head_dim": 24}}},
            reason=(
                "its sliding layers need head_dim == qk_nope_head_dim + qk_rope_head_dim (16 + 8), "
                "its global MLA layers head_dim == qk_rope_head_dim (8)"
            ),
        ),
        "dory": Preset(
            config={
                # DoryConfig.to_dict() (what the shrink reads) and its constructor count every layer
                # twice (attention + "mlp" block), and __post_init__ halves them again
                "num_hidden_layers": 6,
                "n_input_layers": 2,
                "n_recurrent_layers": 2,
                "n_output_layers": 2,
                "layer_types": [
                    "sliding_attention",
                    "mlp",
                    "full_attention",
                    "mlp",
                    "sliding_attention",
                    "mlp",
                ],
            },
            reason=(
                "input + recurrent + output layers must add up to the layers (the generic two layers left "
                "n_recurrent_layers at -7: eager broke past the 32-token window); one of each, a full "
                "attention layer in the loop"
            ),
        ),
        "granitemoehybrid": Preset(
            config={"layer_types": ["linear_attention", "attention"]},
            reason=(
                "the default layer_types are all linear_attention (mamba), and the hybrid cache's "
                "get_seq_length fails eagerly without an attention layer"
            ),
        ),
        "gpt_neo": Preset(
            config={"attention_types": [[["global", "local"], 1]]},
            reason="attention_types expands to one entry per layer and must match the two layers",
        ),
        "hunyuan_v1_moe": Preset(
            config={"num_experts": 4, "moe_topk": 2},
            reason=(
                "the default config has one expert routed top-1 (released checkpoints have many): its "
                "grouped_mm offsets call histc(bins=1, min=0, max=0), a data-range histogram torchlib "
                "does not translate"
            ),
        ),
        "lfm2_moe": Preset(
            config={"layer_types": ["conv", "full_attention"]},
            reason="the default config leaves layer_types None, which its decoder layers index; one conv, one attention layer",
        ),
        "mamba2": Preset(
            config={"num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2},
            reason="num_heads * head_dim must equal expand * hidden_size (2 * 64)",
        ),
        # Deep convolution stacks with few channels: weights drawn at the default initializer_range
        # (0.02) shrink the activations at every layer, and the logits vanish (measured max |logit|:
        # mobilevit 0.0, efficientnet 0.0, mobilenet_v1 1e-29, mobilenet_v2 6e-23, pp_lcnet 6e-37), so a parity check
        # against eager compares zeros. The ranges below give logits of 0.1-30.
        "mobilevit": Preset(
            config={"initializer_range": 0.2},
            reason="at initializer_range 0.02 the logits vanish to exactly 0 (max |logit| 0.13 at 0.2)",
        ),
        "efficientnet": Preset(
            config={"initializer_range": 0.4},
            reason="at initializer_range 0.02 the logits vanish to exactly 0 (max |logit| 0.51 at 0.4; 0.3 still 2e-8)",
        ),
        "mobilenet_v1": Preset(
            config={"initializer_range": 0.2},
            reason="at initializer_range 0.02 the logits vanish to 1e-29 (max |logit| 0.11 at 0.2)",
        ),
        "pp_lcnet": Preset(
            config={"initializer_range": 0.35},
            reason="at initializer_range 0.02 the outputs vanish to 6e-37 (max 1.4 at 0.35; 0.25 still 2e-5)",
        ),
        "mobilenet_v2": Preset(
            config={"initializer_range": 0.2},
            reason="at initializer_range 0.02 the logits vanish to 6e-23 (max |logit| 34 at 0.2)",
        ),
        # --- issue 28: dense prediction (segmentation, depth) ---
        "dpt": Preset(
            config={"num_hidden_layers": 4, "backbone_out_indices": [0, 1, 2, 3], "initializer_range": 0.08},
            reason="the neck reassembles 4 taps of the ViT (backbone_out_indices [2, 5, 8, 11] of 12 "
            "layers by default); 4 layers tapped at each keep the neck whole; at initializer_range "
            "0.02 the heads' outputs vanish (max 3e-7) through the tiny neck, at 0.2 they explode (max "
            "1.6e8: float32 runtimes then differ from eager by hundreds in absolute); 0.08 gives max 1.4 "
            "(depth) and 3.8 (segmentation logits)",
        ),
        # BEiT-style semantic segmentation: the FPN reads 4 encoder taps (out_indices, 1-based);
        # the shrunk 2-layer stack keeps beit's single default tap [12] -> [2] (the head refuses it)
        # or data2vec-vision's [3, 5, 7, 11] past its last layer (the FPN then gets 2 feature maps)
        **{
            mt: Preset(
                config={
                    "num_hidden_layers": 4,
                    "out_indices": [1, 2, 3, 4],
                    "out_features": ["stage1", "stage2", "stage3", "stage4"],
                },
                reason="the semantic-segmentation FPN reads 4 encoder taps (out_indices); 4 layers tapped "
                "at each keep it whole",
            )
            for mt in ("beit", "data2vec-vision")
        },
        "detr": Preset(
            config={"encoder_attention_heads": 8},
            reason="the segmentation mask head's input is d_model + encoder heads channels, which its "
            "GroupNorm(8) needs divisible by 8 (64 + 4 = 68 is refused); 8 heads of 8 give 72",
        ),
        # MaskFormer / OneFormer (issue 28): their pixel decoders and transformer heads read widths the
        # generic shrink does not know by name (fpn_feature_size, conv_dim, hidden_dim, ...)
        "maskformer": Preset(
            config={"fpn_feature_size": 64, "mask_feature_size": 64},
            reason="the pixel decoder's FPN and mask features keep the default 256 channels (3.1M of the "
            "tiny model's parameters in 3x3 convolutions); 64 channels (a multiple of its GroupNorm(32)) "
            "make it 0.66M",
        ),
        "oneformer": Preset(
            config={
                "conv_dim": 64,
                "mask_dim": 64,
                "hidden_dim": 64,
                "encoder_feedforward_dim": 128,
                "dim_feedforward": 128,
                "task_seq_len": 16,
            },
            reason="the pixel decoder, query decoder and task encoder keep the default 256 channels, "
            "1024/2048-wide feed-forwards and a 77-token task prompt (7.5M parameters); 64 channels (a "
            "multiple of its GroupNorm(32)), 128-wide feed-forwards and a 16-token task prompt make it 0.61M "
            "(the text encoder is built for training only, is_training=False)",
        ),
        # EoMT: the queries join the token sequence at layer num_hidden_layers - num_blocks; with the
        # default 4 blocks over the 2-layer stack that index is negative, no query is ever added, and
        # the mask prediction slices 0 patch tokens
        **{
            mt: Preset(
                config={"num_blocks": 1, "num_queries": 10},
                reason="the queries join the tokens num_blocks (default 4) layers before the end, which "
                "the 2-layer tiny stack does not have: one block keeps them joining (at layer 1); 10 "
                "queries, as the other query heads' tiny models",
            )
            for mt in ("eomt", "eomt_dinov3")
        },
        "depth_pro": Preset(
            config={"intermediate_hook_ids": [1, 0]},
            reason="the patch encoder taps hidden states intermediate_hook_ids (default [11, 5] of 24 "
            "layers), past the 2-layer tiny stack (IndexError); the tiny stack's layers 1 and 0. Weights "
            "redrawn variance-preserving: with the configured draw the fusion stages and the head grow "
            "the activations to a depth of 813 (std 101) on 32x32 noise, where float32 reordering alone "
            "(torch's own run_decompositions) moves near-zero depths by 1.4e-3, over the 1e-4 atol; "
            "redrawn, the depth peaks at 0.61 and the same reordering moves it by 5e-7",
            init="variance_preserving",
        ),
        "sapiens2": Preset(
            config={
                "num_key_value_heads_per_layer": [4, 4],
                "head_config": {"upsample_out_channels": [32, 16], "conv_out_channels": [16]},
            },
            reason="the default head_config has no upsample blocks (upsample_out_channels None: the "
            "segmentation head cannot be built) and the per-layer key/value heads keep the default 16 "
            "over 4 tiny heads; two upsample blocks (32, 16 channels) and one 16-channel refinement conv",
        ),
        "mobilevitv2": Preset(
            config={"image_size": 64, "initializer_range": 0.2},
            reason="at 32x32 the last stage's feature map is 1x1, smaller than the 2x2 patches its "
            "unfold cuts (eager fails); 64x64 images keep it 2x2; at initializer_range 0.02 the outputs "
            "vanish to 0 (max 5.8 for segmentation, 3.2 for classification at 0.2)",
        ),
        "zoedepth": Preset(
            config={"fusion_hidden_size": 256},
            reason="the metric-bins head builds 256-wide layers whatever the neck's fusion width "
            "(the generic shrink makes it 64), so the fusion width stays at the default 256",
        ),
        "yolos": Preset(
            config={"image_size": [32, 32], "num_detection_tokens": 10},
            reason="the default image_size [512, 864] (a list, which the generic shrink keeps) makes "
            "11765 patches; 32x32 images and 10 detection tokens keep the tiny detector small",
        ),
        # --- issue 28: text-to-audio ---
        "vits": Preset(
            config={
                "noise_scale": 0.0,
                "noise_scale_duration": 0.0,
                "flow_size": 32,
                "spectrogram_bins": 33,
                "upsample_initial_channel": 32,
                "upsample_rates": [4, 4],
                "upsample_kernel_sizes": [8, 8],
                "resblock_kernel_sizes": [3],
                "resblock_dilation_sizes": [[1, 3]],
                "duration_predictor_filter_channels": 32,
                "duration_predictor_num_flows": 2,
                "prior_encoder_num_flows": 2,
                "prior_encoder_num_wavenet_layers": 2,
                "posterior_encoder_num_wavenet_layers": 2,
            },
            reason="VITS draws its durations and latents with torch.randn scaled by noise_scale and "
            "noise_scale_duration, so two eager runs differ: 0 makes the forward deterministic (the "
            "mean durations and latents); the vocoder and flows shrink from 16M parameters",
        ),
        "speecht5": Preset(
            config={"speech_decoder_prenet_dropout": 0.0},
            reason="the speech decoder prenet applies its dropout (torch.bernoulli, p=0.5) in eval mode "
            "too, so two eager runs differ; 0 makes the teacher-forced forward deterministic",
        ),
        **{
            mt: Preset(
                config={"audio_encoder": {"num_filters": 2, "codebook_size": 256}},
                reason="the EnCodec audio codec doubles 32 filters over four downsampling stages into "
                "512-wide LSTMs (14M of the 14.7M parameters at the generic shrink, unused by the "
                "decoder forward); 2 filters end at 32",
            )
            for mt in ("musicgen", "musicgen_melody")
        },
        "fastspeech2_conformer": Preset(
            config=_FASTSPEECH2_CONFORMER,
            reason="the conformer's feed-forwards (encoder/decoder_linear_units 1536), the variance "
            "predictors and the postnet keep 256-1536 widths the generic shrink does not name (7.9M "
            "parameters); these make it 0.3M",
        ),
        "fastspeech2_conformer_with_hifigan": Preset(
            config={
                "model_config": {
                    **_FASTSPEECH2_CONFORMER,
                    # the layer dicts derived from the flat fields at init are passed back as given
                    "encoder_config": {"layers": 2, "linear_units": 128},
                    "decoder_config": {"layers": 2, "linear_units": 128},
                },
                "vocoder_config": {"upsample_initial_channel": 32},
            },
            reason="fastspeech2_conformer's widths (see its entry; its encoder_config/decoder_config "
            "dicts, derived at init, come back as the default 4-6 layers of 1536 units when the "
            "sub-configuration is rebuilt from its dict) and the HiFi-GAN vocoder's 512 initial channels "
            "(26.8M parameters in all) shrink",
        ),
        **{
            mt: Preset(
                config={"flow_head_config": {"condition_dim": 64}},
                reason="the flow head is conditioned on the backbone's hidden state, and the config "
                "refuses a condition_dim other than hidden_size, which the generic shrink makes 64 "
                "while condition_dim is not a width it names",
            )
            for mt in ("pocket_tts", "gradium_phonon_tts")
        },
        "csm": Preset(
            config={
                "text_vocab_size": 256,
                "depth_decoder_config": {"backbone_hidden_size": 64},
                "codec_config": {
                    "num_filters": 4,
                    "codebook_size": 256,
                    "codebook_dim": 32,
                    "vector_quantization_hidden_dimension": 32,
                },
            },
            reason="the text embedding keeps Llama 3's 128256 tokens, the depth decoder's input "
            "projection the 2048-wide backbone and the Mimi codec doubles 64 filters over four "
            "upsampling stages with 2048-entry codebooks (48.8M parameters at the generic shrink); "
            "these make 1.5M",
        ),
        "vibevoice": Preset(
            config={"audio_config": {"num_filters": 2}, "semantic_model_config": {"num_filters": 2}},
            reason="the acoustic tokenizers double 32 filters over six downsampling stages (2048 "
            "channels, 258M parameters at the generic shrink); 2 filters end at 128",
        ),
        **{
            mt: Preset(
                config={
                    "t2u_vocab_size": 256,
                    "unit_hifi_gan_vocab_size": 256,
                    "unit_embed_dim": 64,
                    "upsample_initial_channel": 32,
                    "t2u_encoder_ffn_dim": 128,
                    "t2u_decoder_ffn_dim": 128,
                    "speech_encoder_intermediate_size": 128,
                },
                reason="the text-to-unit model and the unit vocoder keep 10k-token vocabularies and "
                "8192-wide feed-forwards the generic shrink does not name (55M parameters)",
            )
            for mt in ("seamless_m4t", "seamless_m4t_v2")
        },
        # --- issue 28: time series (forecasting heads) ---
        # transformers leaves prediction/context lengths unset (None): the model refuses to build
        **{
            mt: Preset(
                config={
                    "prediction_length": 4,
                    "context_length": 8,
                    "lags_sequence": [1, 2, 3],
                    "num_time_features": 1,
                    **({"label_length": 4, "moving_average": 3} if mt == "autoformer" else {}),
                },
                reason="the default config has no prediction_length (the model refuses to build); a short "
                "horizon, context and lag list keep the tiny model small",
            )
            for mt in ("informer", "autoformer", "time_series_transformer")
        },
        "informer": Preset(
            config={
                "prediction_length": 4,
                "context_length": 8,
                "lags_sequence": [1, 2, 3],
                "num_time_features": 1,
                "attention_type": "full",
            },
            reason="no default prediction_length (see above); and ProbSparse attention (the default "
            "attention_type 'prob') samples keys with torch.randint on every forward, so two eager runs "
            "differ and no export can match one: the tiny model uses the full attention",
        ),
        "patchtst": Preset(
            config={"patch_length": 8, "patch_stride": 8, "prediction_length": 8},
            reason="the default 1-step patches make 32 patches of the 32-step context; 8-step patches make 4",
        ),
        "patchtsmixer": Preset(
            config={"prediction_length": 8},
            reason="a short horizon (the default 16) keeps the tiny head small",
        ),
        "timesfm": Preset(
            config={"context_length": 64, "horizon_length": 32, "patch_length": 32},
            reason="the default 512-step context makes a 16-patch input; 64 steps make 2",
        ),
        "timesfm2_5": Preset(
            config={"context_length": 64},
            reason="the default 16384-step context makes a 512-patch input; 64 steps make 2",
        ),
    }
)

# Dual encoders of zero-shot image classification (issue 28): the text and image embeddings are
# compared by a matrix product, so both projections must end at the same width.
PRESETS.update(
    {
        "align": Preset(
            config={
                "projection_dim": 80,
                "initializer_range": 0.4,
                "vision_config": {
                    "width_coefficient": 0.25,
                    "depth_coefficient": 0.25,
                    "initializer_range": 0.4,
                },
            },
            reason="the default EfficientNet-B7 tower (width 2.0, depth 3.1) makes a 62M-parameter model whose "
            "image features vanish to 1e-28 at initializer_range 0.02 (NaN logits); width and depth 0.25 "
            "give 0.2M parameters, 0.4 gives features of 0.6, and the text projection must end at the "
            "tower's 80-wide output",
        ),
        "siglip": Preset(
            config={"text_config": {"projection_size": 64}},
            reason="the text head projects to projection_size (768 by default), which must equal the "
            "shrunk vision hidden size (64) for the image-text logits",
        ),
        "siglip2": Preset(
            config={"text_config": {"projection_size": 64}},
            reason="the text head projects to projection_size (768 by default), which must equal the "
            "shrunk vision hidden size (64) for the image-text logits",
        ),
    }
)

# Audio classification (issue 28)
PRESETS["audio-spectrogram-transformer"] = Preset(
    config={"max_length": 64, "num_mel_bins": 32},
    reason="the default 1024 x 128 spectrogram makes 1212 patches; 64 frames x 32 bins make 10",
)

# Token classification and question answering (issue 28): encoders whose default configuration the
# generic shrink cannot build or run (their masked-LM models share the fix)
PRESETS.update(
    {
        "esm": Preset(
            config={
                "vocab_size": 33,
                "pad_token_id": 1,
                "mask_token_id": 32,
                "position_embedding_type": "rotary",
                "emb_layer_norm_before": False,
                "token_dropout": True,
            },
            reason="EsmConfig leaves vocab_size, pad_token_id and mask_token_id None (the embedding cannot be "
            "built); the ESM-2 checkpoints' values: 33 amino-acid tokens, pad 1, mask 32, rotary positions, "
            "token dropout rescaling",
        ),
        "funnel": Preset(
            config={"block_sizes": [1, 1], "block_repeats": [1, 1], "num_decoder_layers": 1},
            reason="the default three blocks of four layers (12 + 2 decoder layers, 1.4M parameters) pool the "
            "8-token sample to <cls> + 1 position, and torch.export specialises that size-1 axis (Eq((seq - 1) // 4, 1)): "
            "the program took lengths 5-8 only; two one-layer blocks pool it to <cls> + 3 and keep both pooling "
            "paths (separate <cls>, truncated sequence) and the decoder's upsampling",
        ),
        "canine": Preset(
            config={"downsampling_rate": 2},
            reason="the default downsampling rate 4 turns the 8-character sample into <cls> + 1 molecule, and "
            "torch.export specialises that size-1 axis (Eq(seq // 4 - 1, 1)): the program took lengths 8-11 only; "
            "rate 2 gives <cls> + 3 molecules and keeps the remainder path of the molecules' upsampling",
        ),
        "xmod": Preset(
            config={"default_language": "en_XX"},
            reason="without lang_ids the forward picks the adapter of config.default_language, which XmodConfig "
            "leaves None (ValueError 'Input language unknown'); the one shrunk adapter is en_XX",
        ),
        "mistral4": Preset(
            config={"qk_nope_head_dim": 8, "qk_head_dim": 16, "head_dim": 16},
            reason="its rotary embedding spans head_dim * partial_rotary_factor (0.5) channels, which must be "
            "the qk_rope_head_dim (8) channels it rotates; the default head_dim 128 is qk_nope 64 + qk_rope 64, "
            "so the shrunk head keeps that split: 8 + 8 = 16 (the generic MLA shrink makes head_dim 8, and "
            "eager failed on 4 rotary channels against 8)",
        ),
        "layoutlmv3": Preset(
            config={"coordinate_size": 10, "shape_size": 12},
            reason="the text embedding concatenates four coordinate and two shape embeddings (4 x 128 + 2 x 128 "
            "= 768, the default hidden size) and adds them to the token embedding: 4 x 10 + 2 x 12 = 64, the "
            "shrunk hidden size",
        ),
        "lilt": Preset(
            config={"hidden_size": 48},
            reason="the layout embedding concatenates six hidden_size // 6 wide coordinate embeddings and "
            "projects them with a hidden_size-wide linear layer, so hidden_size must divide by 6 (64 gives "
            "60 columns into a 64-wide layer); 48 also divides by the 4 heads of the 48 / 4 = 12-wide "
            "layout stream (channel_shrink_ratio 4)",
        ),
        "reformer": Preset(
            config={
                "axial_pos_embds_dim": [32, 32],
                "axial_pos_shape": [16, 32],
                "local_attn_chunk_length": 4,
                "lsh_attn_chunk_length": 4,
                "num_buckets": 4,
                "hash_seed": 0,
                "feed_forward_size": 128,
            },
            reason="the default axial position dims (64, 192) must sum to the shrunk hidden size (64); 4-token "
            "chunks make the 8-token sample two chunks (64 would pad it to one), num_buckets set so the "
            "forward does not pick (and store) it from the first sequence length, hash_seed so the LSH "
            "rotations are the same in every forward",
        ),
    }
)


# --- issue 28: object detection whose default configuration does not build -----------------------


def _intraclass_blocks() -> dict[str, list[Any]]:
    """PP-OCR's intra-class block: 1x1 reduce/return convolutions, then vertical (k x 1),
    horizontal (1 x k) and square (k x k) convolutions for k = 7, 5, 3 ("long", "mid", "short"),
    "same" padded, stride 1 (``[kernel, stride, padding]`` per entry, as the modeling code reads)."""
    blocks: dict[str, list[Any]] = {"reduce_channel": [1, 1, 0], "return_channel": [1, 1, 0]}
    for ratio, k in (("longratio", 7), ("midratio", 5), ("shortratio", 3)):
        p = k // 2
        blocks[f"vertical_long_to_small_conv_{ratio}"] = [[k, 1], [1, 1], [p, 0]]
        blocks[f"horizontal_small_to_long_conv_{ratio}"] = [[1, k], [1, 1], [0, p]]
        blocks[f"symmetric_conv_long_{ratio}"] = [[k, k], [1, 1], [p, p]]
    return blocks


#: a detection form of pp_lcnet_v4 (its default is the recognition form: one tap, stride (2, 1)
#: blocks): four 16-channel stages, each halving the image, all four tapped for the neck
_LCNET_V4_DETECTION: dict[str, Any] = {
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
    "out_indices": [1, 2, 3, 4],
    "stem_channels": [3, 16, 16],
    "stage_out_channels": [16, 16, 16, 16],
    "block_configs": [[[3, 16, 16, stride, False]] for stride in (1, 2, 2, 2)],
}
#: what the PP-OCR server/medium detectors' default configs leave None (their __init__ indexes it)
_OCR_DET_NECK: dict[str, Any] = {
    "intraclass_block_config": _intraclass_blocks(),
    "scale_factor_list": [1, 2, 4, 8],
    "kernel_list": [3, 2, 2],
    "neck_out_channels": 32,
}

#: why the RT-DETR family's tiny models redraw their weights (measured at the tiny size, seed 0)
_RT_DETR_INIT_REASON = (
    "upstream draws every batch-norm scale and convolution weight from N(0, initializer_range = 0.01), "
    "so the hybrid encoder's conv/batch-norm stacks shrink its features to 1e-6..1e-18 and every "
    "encoder class score equals the prior bias (-1.0986): the top-k query selection then picks among "
    "exact ties, which eager and the runtimes break differently (ONNX/OpenVINO 'mismatches' of 4.2 in "
    "the logits); fan-in weights and unit batch-norm scales give features of 0.5-1 and distinct "
    "scores (gap at the k-th query >= 1e-3, between neighbours >= 4e-5)"
)

PRESETS.update(
    {
        "lw_detr": Preset(
            config={
                "projector_scale_factors": [1.0],
                "backbone_config": {"num_windows": 4, "num_windows_side": 2},
            },
            reason="the default config projects no feature level (projector_scale_factors [], so the "
            "decoder concatenates an empty list) and its ViT's 16 windows do not tile a 32x32 image "
            "(transformers refuses it); one level at scale 1 and 2x2 windows of 2x2 patches",
        ),
        "omdet-turbo": Preset(
            config={
                "apply_layernorm_after_vision_backbone": False,
                "text_config": {"hidden_size": 32},
                "text_projection_in_dim": 32,
                "text_projection_out_dim": 32,
                "class_embed_dim": 32,
                "vision_features_channels": [64, 64, 64],
                "decoder_hidden_dim": 64,
                "decoder_num_layers": 2,
                "decoder_dim_feedforward": 128,
                "encoder_dim_feedforward": 128,
                "task_encoder_hidden_dim": 128,
            },
            reason="the layer norms after the backbone read timm swin's channel-last features (the "
            "tiny resnet standing in for timm gives channel-first ones); the class/task embedding "
            "width must be the text tower's, the vision feature channels the encoder's; and the "
            "text width must differ from the decoder's: with equal widths transformers 5.24 builds "
            "no task_project yet reads it (AttributeError)",
        ),
        # --- issue 28: vision-language ---
        **{
            mt: Preset(
                config={"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}},
                reason="the default config sets no mrope_section, and the rotary embedding falls back "
                "to [16, 24, 24] (a 128-wide head) in code; the tiny 16-wide head needs sections "
                "adding up to its 8 frequencies, in the same 2:3:3 ratio",
            )
            for mt in ("qwen2_5_vl", "paddleocr_vl")
        },
        **{
            mt: Preset(
                config={
                    "vision_start_token_id": start,
                    "vision_end_token_id": start - 1,
                    **(
                        {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}} if sections else {}
                    ),
                },
                reason="the thinker's get_rope_index reads config.vision_start_token_id, which the default "
                "thinker config does not define (released checkpoints carry it): AttributeError; ids "
                "below the shrunk special ids" + (", and mrope sections as qwen2_5_vl's" if sections else ""),
            )
            for mt, start, sections in (
                ("qwen2_5_omni_thinker", 249, True),
                ("qwen3_omni_moe_thinker", 250, False),
            )
        },
        "step3p7": Preset(
            config={
                "text_config": {
                    "sliding_window": 32,
                    "layer_types": ["sliding_attention", "full_attention"],
                }
            },
            reason="the text model always builds a sliding-window mask (create_sliding_window_causal_mask "
            "raises without a window) while the default config leaves sliding_window None and every layer "
            "full attention; one sliding (32-token window) and one full layer, as the checkpoints mix them",
        ),
        "tipsv2_dpt": Preset(
            config={},
            reason="upstream's _init_weights draws every Linear and Conv weight, the ViT backbone's "
            "included, kaiming-normal (fan_out, ReLU gain), which grows the activations layer by layer: "
            "the tiny model's segmentation logits reached 538 and float32 runtimes (ONNX, OpenVINO, "
            "ExecuTorch) missed eager beyond tolerance; weights redrawn variance-preserving",
            init="variance_preserving",
        ),
        "pp_doclayout_v2": Preset(
            config={"class_thresholds": [0.5] * _NUM_LABELS, "class_order": list(range(_NUM_LABELS))},
            reason="the forward looks up a score threshold and a reading-order category per class in "
            "class_thresholds / class_order, which the default config leaves None (checkpoints set them); "
            f"weights redrawn variance-preserving: {_RT_DETR_INIT_REASON}",
            init="variance_preserving",
        ),
        # the RT-DETR family's two-stage query selection: top-k of the encoder's class scores
        **{
            mt: Preset(config={}, reason=_RT_DETR_INIT_REASON, init="variance_preserving")
            for mt in ("rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v3", "pp_doclayout_v4")
        },
        "pp_ocrv5_server_det": Preset(
            config=_OCR_DET_NECK,
            reason="the default config leaves intraclass_block_config, scale_factor_list and "
            "kernel_list None, which the neck and head index at construction (checkpoints set them)",
        ),
        "pp_ocrv6_medium_det": Preset(
            config={**_OCR_DET_NECK, "backbone_config": _LCNET_V4_DETECTION},
            reason="as pp_ocrv5_server_det (intra-class blocks None), and its default pp_lcnet_v4 backbone "
            "is the recognition form: one tapped stage and (2, 1) strides, where the neck fuses four "
            "stages at 2x steps",
        ),
        "pp_ocrv6_small_det": Preset(
            config={
                "layer_list_out_channels": [16, 16, 16, 16],
                "neck_out_channels": 32,
                "backbone_config": _LCNET_V4_DETECTION,
            },
            reason="the default config does not build at any size: its neck takes four taps of "
            "[12, 18, 42, 360] channels while the default pp_lcnet_v4 backbone taps one stage of 384 "
            "channels with (2, 1) strides; a four-stage detection backbone and a neck reading its "
            "16-channel taps",
        ),
    }
)


# --- issue 28: vision-language ---
#: GLM-4V's multimodal rotary sections (temporal, height, width) when the config gives none: the
#: model falls back to [8, 12, 12] (half of a 64-wide rotary part); the tiny head's rotary half
#: (head_dim 16: 8; glm4v_moe's partial_rotary_factor 0.5: 4) split the same way
_GLM4V_MROPE = (
    "the text config gives no mrope_section and the model falls back to [8, 12, 12], sized for the "
    "default 128-wide heads; the tiny 16-wide heads' rotary half needs sections that add up to it"
)
PRESETS.update(
    {
        **{
            mt: Preset(
                config={"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}},
                reason=_GLM4V_MROPE,
            )
            for mt in ("glm4v", "glm46v", "glm_ocr", "glmga")
        },
        "hunyuan_vl": Preset(
            config={"text_config": {"rope_parameters": {"mrope_section": [2, 2, 2, 2]}}},
            reason="the default config gives no mrope_section, which its text model needs (at least 3 "
            "multimodal rotary axes, 'got 0'); four axes of 2 cover the tiny heads' rotary half (8), as "
            "released checkpoints' four sections cover theirs",
        ),
        "apertus1p5": Preset(
            config={
                "audio_config": {
                    "codebook_dim": 64,
                    "codebook_size": 64,
                    "decoder_hidden_size": 64,
                    "decoder_intermediate_size": 128,
                },
                "vision_config": {"codebook_size": 64, "base_channels": 32, "latent_channels": 32},
                "image_token_offset": 96,
                "audio_token_offset": 160,
            },
            reason="its WavTokenizer audio encoder has no projection around the quantizer (codebook_dim "
            "must equal the shrunk hidden size, 64), and the visual and audio code ranges (offsets "
            "131272 and 262344, codebooks of 131072 and 4096) must lie inside the 256-token "
            "vocabulary, one after the other: visual codes 96-159, audio codes 160-223; the VQ image "
            "tokenizer's 256 channels and the audio decoder's 768 gave 191M parameters",
        ),
        "dots3_note": Preset(
            config={"text_config": {"per_layer_config": {"1": {"head_dim": 24}}}},
            reason="its text model is dots3_note_text's (see that entry): the sliding layers need "
            "head_dim == qk_nope_head_dim + qk_rope_head_dim (16 + 8)",
        ),
        **{
            mt: Preset(
                config={"image_token_index": 250, "num_query_tokens": 4},
                reason="the default config has no image_token_index (released checkpoints set one): the "
                "forward cannot place the Q-Former's query outputs in the prompt; a special id at the "
                "top of the tiny vocabulary, and 4 queries instead of 32 (4 image tokens per image)",
            )
            for mt in ("blip-2", "instructblip")
        },
        "instructblipvideo": Preset(
            config={"video_token_index": 250, "num_query_tokens": 4},
            reason="the default config has no video_token_index (released checkpoints set one), the id "
            "its forward places the Q-Former's query outputs at (it reads no image token): a special id "
            "at the top of the tiny vocabulary, and 4 queries instead of 32 (4 tokens per frame)",
        ),
        "deepseek_vl_hybrid": Preset(
            config={"high_res_vision_config": {"global_attn_indexes": [1]}},
            reason="the high-resolution SAM tower's features are read at the layer global_attn_indexes[0] "
            "(2 of [2, 5, 8, 11]), past the 2-layer tiny tower (IndexError); its last layer, global",
        ),
        "vision-encoder-decoder": Preset(
            config={"decoder_start_token_id": 0, "pad_token_id": 0},
            reason="the composite config names no decoder start (released checkpoints such as TrOCR set "
            "one), so generate() cannot start the decoder; the padding id 0 starts it, as T5's does, "
            "and is the first id of the sample decoder prompt (issue 28)",
        ),
        **{
            mt: Preset(
                config={"latent_query_num": 16, "text_config": {"layers": 2, "attention_heads": 4}},
                reason="the text config names its depth and heads layers / attention_heads, which the "
                "generic shrink does not know (24 layers of 32 or 16 two-wide heads); and the image's "
                "latent queries are its tokens in the prompt: Kosmos-2.5's 2048 made a prompt of over "
                "2048 tokens (16, as Kosmos-2's 64 shrunk)",
            )
            for mt in ("kosmos-2", "kosmos-2.5")
        },
        "aria": Preset(
            config={"projector_patch_to_query_dict": {16: 4}},
            reason="its projector maps the vision tower's patch count to a query count through "
            "projector_patch_to_query_dict, whose defaults know only 1225 and 4900 patches (980 and "
            "980x2 pixel images); the tiny 32x32 image in 8x8 patches has 16: 4 queries",
        ),
        **{
            mt: Preset(
                config={"insert_layer_id": 0},
                reason="the window-attention merger sits after vision layer insert_layer_id (6), which the "
                "2-layer tiny tower never reaches, while get_image_features halves target_sizes as if it "
                "had run: the merger then read a quarter of the patches per image and the second image's "
                "features from the first image's patches; the merger after the first layer, as the "
                "checkpoints place it inside their 27 layers",
            )
            for mt in ("minicpm_ocr", "minicpmv4_6", "minicpmv4_7")
        },
        "mllama": Preset(
            config={
                "vision_config": {
                    "num_global_layers": 1,
                    "intermediate_layers_indices": [0, 1],
                    "vision_output_dim": 64 * 3,
                },
                "text_config": {"cross_attention_layers": [1]},
            },
            reason="the vision tower reads intermediate layers [3, 7, 15, 23, 30] and the text model puts "
            "cross-attention at layers [3, 8, ..., 38], past the 2-layer tiny towers (IndexError), with 8 "
            "global vision layers; the projector's input, vision_output_dim, is the tower's width times "
            "the intermediate layers plus one (7680 = 1280 * 6): one global layer, layers 0 and 1 read "
            "(64 * 3 wide) and the second text layer cross-attending",
        ),
        "nemotron_h_omni": Preset(
            config={"vision_hidden_size": 64, "projector_hidden_size": 128},
            reason="the projector's width comes from the top-level vision_hidden_size (1280) and "
            "projector_hidden_size (4096), not from the vision config the generic shrink narrows to 64 "
            "channels: the projector's norm (1280 * 4 wide) refused the tiny tower's pixel-shuffled "
            "features (256 wide); the tower's 64 channels and a 128-wide projector",
        ),
        "glm4v_moe": Preset(
            config={"text_config": {"rope_parameters": {"mrope_section": [1, 1, 2]}}},
            reason=_GLM4V_MROPE + " (partial_rotary_factor 0.5: a rotary half of 4)",
        ),
    }
)

# Text classification (issue 28): Perceiver's latent array is not one of the widths the generic shrink knows
PRESETS["perceiver"] = Preset(
    config={
        "num_latents": 16,
        "d_latents": 64,
        "num_self_attends_per_block": 2,
        "num_self_attention_heads": 4,
        "num_cross_attention_heads": 4,
    },
    reason="the default latent array (256 latents of 1280 channels, 26 self-attention layers) kept the tiny "
    "model at 270M parameters (a 1 GB program); 16 latents of 64 channels and 2 layers",
)
