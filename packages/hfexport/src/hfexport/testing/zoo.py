"""A zoo of tiny, seeded, random-weight Hugging Face models for tests.

Every supported architecture gets a *shrunk* configuration (hidden size 32-64, two layers, a
vocabulary of 256 tokens, a handful of heads, small images and audio) so that a model builds in a
fraction of a second and has well under two million parameters, while keeping the structural
features that make exporting it interesting: grouped-query attention, sliding windows, partial
rotary embeddings, mixture-of-experts routing, relative position buckets, learned position
offsets, multimodal rotary positions.

Shape limits that matter to callers:

* every text model accepts sequences of at least 256 tokens (``max_position_embeddings`` and
  friends are >= 448 wherever the architecture has such a limit);
* gemma2 keeps its alternating sliding/full attention with ``sliding_window = 32``: sequences up
  to 32 tokens never reach the window, longer ones exercise the sliding mask;
* mistral keeps its default ``sliding_window = 4096``, so the window never applies in tests;
* whisper's encoder takes exactly ``2 * max_source_positions = 64`` mel frames of 16 bins; its
  decoder accepts up to 448 tokens;
* vit takes 32x32 RGB images cut into 8x8 patches (16 patches plus the class token);
* wav2vec2's raw audio length is derived from the requested number of output frames;
* qwen2_vl always gets one image of 4x4 patches (four merged image tokens) in a 12-token prompt;
* classification heads have 3 labels (so their output never looks like a batch of 2);
* mixtral keeps transformers' default experts implementation (``grouped_mm`` in 5.24).

Special token ids are kept inside the vocabulary (pad 0, bos 1, eos 2 for most models; the
architecture's own small defaults where they already fit), and random token ids are drawn from
``[3, vocab_size)`` so that the sample inputs never contain special tokens by accident.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TASK_TO_AUTO_CLASS",
    "auto_class_name",
    "default_task",
    "make_inputs",
    "shrunk_config",
    "supported_tasks",
    "tiny_model",
]

#: Task name -> name of the ``transformers`` auto class that builds a model for it. A few model
#: types use another class for the same task (wav2vec2 speech recognition is CTC, not
#: sequence-to-sequence); :func:`auto_class_name` resolves those.
TASK_TO_AUTO_CLASS: dict[str, str] = {
    "text-generation": "AutoModelForCausalLM",
    "feature-extraction": "AutoModel",
    "fill-mask": "AutoModelForMaskedLM",
    "text-classification": "AutoModelForSequenceClassification",
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
}

_AUTO_CLASS_OVERRIDES: dict[tuple[str, str], str] = {
    ("wav2vec2", "automatic-speech-recognition"): "AutoModelForCTC",
}

_VOCAB = 256
_NUM_LABELS = 3
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

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

_CONFIGS: dict[str, dict[str, Any]] = {
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

_CAUSAL_LMS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "gpt_neox", "opt", "mixtral")
_ENCODERS = ("bert", "roberta", "distilbert")

_TASKS: dict[str, tuple[str, ...]] = {
    **{mt: ("text-generation", "feature-extraction", "text-classification") for mt in _CAUSAL_LMS},
    **{mt: ("feature-extraction", "fill-mask", "text-classification") for mt in _ENCODERS},
    "t5": ("text2text-generation", "feature-extraction"),
    "bart": ("text2text-generation", "feature-extraction"),
    "vit": ("image-classification", "feature-extraction"),
    "whisper": ("automatic-speech-recognition", "feature-extraction"),
    "wav2vec2": ("automatic-speech-recognition", "feature-extraction"),
    "qwen2_vl": ("image-text-to-text",),
}

# Architectures whose model classes in transformers 5.24 do not implement SDPA attention.
_EAGER_ONLY = frozenset({"gemma2"})

#: Model types :func:`tiny_model` can build, in a stable order.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_CONFIGS)


def _check_model_type(model_type: str) -> None:
    if model_type not in _CONFIGS:
        raise ValueError(
            f"unknown model_type {model_type!r} for the tiny-model zoo; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def default_task(model_type: str) -> str:
    """Return the task a tiny model of ``model_type`` is built for when none is given.

    Args:
        model_type: a ``transformers`` model type, e.g. ``"llama"``.

    Returns:
        The task name, a key of :data:`TASK_TO_AUTO_CLASS` (``"text-generation"`` for decoder
        language models, ``"feature-extraction"`` for BERT-like encoders, ...).

    Raises:
        ValueError: ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`.
    """
    _check_model_type(model_type)
    return _TASKS[model_type][0]


def supported_tasks(model_type: str) -> tuple[str, ...]:
    """Return the tasks a tiny model of ``model_type`` can be built for, default first.

    Raises:
        ValueError: ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`.
    """
    _check_model_type(model_type)
    return _TASKS[model_type]


def auto_class_name(model_type: str, task: str | None = None) -> str:
    """Return the name of the ``transformers`` auto class building ``model_type`` for ``task``.

    Args:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
        task: a key of :data:`TASK_TO_AUTO_CLASS`; ``None`` means :func:`default_task`.

    Returns:
        An attribute name of the ``transformers`` module, e.g. ``"AutoModelForCausalLM"``.

    Raises:
        ValueError: unknown ``model_type``; unknown ``task`` (the message lists the known tasks);
            a known task the zoo does not build for this model type (the message lists those
            it does).
    """
    _check_model_type(model_type)
    if task is None:
        task = default_task(model_type)
    if task not in TASK_TO_AUTO_CLASS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASK_TO_AUTO_CLASS)}")
    if task not in _TASKS[model_type]:
        raise ValueError(
            f"the tiny {model_type} model is not available for task {task!r}; "
            f"its tasks: {', '.join(_TASKS[model_type])}"
        )
    return _AUTO_CLASS_OVERRIDES.get((model_type, task), TASK_TO_AUTO_CLASS[task])


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-copy ``base`` and apply ``overrides``; nested dicts (sub-configs) merge key by key."""
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def shrunk_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """Build the zoo's small configuration for ``model_type``.

    Args:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
        **overrides: configuration attributes replacing the zoo's values; a dict given for a
            sub-configuration (``text_config``, ``vision_config``) is merged into the zoo's.

    Returns:
        A fresh ``PretrainedConfig`` from ``AutoConfig.for_model(model_type, ...)``.

    Raises:
        ValueError: ``model_type`` is not in :data:`SUPPORTED_MODEL_TYPES`.
    """
    _check_model_type(model_type)
    base = {"num_labels": _NUM_LABELS, **_CONFIGS[model_type]}
    return AutoConfig.for_model(model_type, **_merge(base, overrides))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_ids(gen: torch.Generator, shape: tuple[int, ...], low: int, high: int) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64)


def _text_vocab(config: PretrainedConfig) -> int:
    return int(config.get_text_config().vocab_size)


def _wav2vec2_samples(config: PretrainedConfig, frames: int) -> int:
    """Shortest raw-audio length whose feature encoder output has ``frames`` frames."""
    length = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


def _qwen2_vl_inputs(config: PretrainedConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One image of a 2m x 2m patch grid (m = spatial merge size) inside a 12-token prompt."""
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    grid = (1, 2 * merge, 2 * merge)
    num_patches = grid[0] * grid[1] * grid[2]
    num_image_tokens = num_patches // (merge * merge)
    patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    special = (
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    seq_len = 12
    start = 3
    input_ids = _random_ids(gen, (1, seq_len), 3, min(min(special), _text_vocab(config)))
    input_ids[0, start] = config.vision_start_token_id
    input_ids[0, start + 1 : start + 1 + num_image_tokens] = config.image_token_id
    input_ids[0, start + 1 + num_image_tokens] = config.vision_end_token_id
    pixel_values = torch.randn(num_patches, patch_dim, generator=gen, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([grid], dtype=torch.int64),
        "mm_token_type_ids": (input_ids == config.image_token_id).to(torch.int64),
    }


def make_inputs(
    model: PreTrainedModel,
    task: str | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Build deterministic forward kwargs for an already-built model of a supported type.

    Random values come from a ``torch.Generator`` seeded with ``seed``, so equal arguments give
    equal tensors; the global RNG is not touched. Token ids are int64 in ``[3, vocab_size)``,
    attention masks are int64 ones, floating inputs are float32 standard normal.

    What ``batch_size`` (``b``) and ``seq_len`` (``s``) mean per architecture:

    * decoder LMs and BERT-like encoders: ``input_ids``, ``attention_mask`` ``[b, s]``;
    * t5, bart: also ``decoder_input_ids`` ``[b, s]`` starting with the decoder start token;
    * vit: ``pixel_values`` ``[b, num_channels, image_size, image_size]`` (``s`` is ignored);
    * whisper: ``input_features`` ``[b, num_mel_bins, 2 * max_source_positions]`` and
      ``decoder_input_ids`` ``[b, s]`` starting with the decoder start token;
    * wav2vec2: ``input_values`` ``[b, n]`` float32 and ``attention_mask`` ``[b, n]``, with ``n``
      the shortest audio length giving ``s`` output frames (logits ``[b, s, vocab]``);
    * qwen2_vl: always one image, whatever ``b`` and ``s``: ``input_ids``, ``attention_mask``,
      ``mm_token_type_ids`` ``[1, 12]`` (vision start at 3, four image tokens at 4..7, vision end
      at 8; ``mm_token_type_ids`` is 1 on image tokens), ``pixel_values`` ``[16, 1176]``,
      ``image_grid_thw`` ``[[1, 4, 4]]`` (for the zoo's vision config).

    Args:
        model: a model whose ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`.
        task: checked against the model type's tasks when given; the inputs do not depend on it.
        batch_size: rows in the batch, >= 1.
        seq_len: sequence length (see above), >= 1.
        seed: seed of the generator producing the random values.

    Returns:
        A dict of CPU tensors such that ``model(**inputs)`` runs.

    Raises:
        ValueError: unsupported model type, unknown or unsupported task, or a non-positive
            ``batch_size``/``seq_len``.
    """
    config = model.config
    model_type = config.model_type
    auto_class_name(model_type, task)  # validates model type and task
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    gen = _generator(seed)
    b, s = batch_size, seq_len

    if model_type == "qwen2_vl":
        return _qwen2_vl_inputs(config, gen)
    if model_type == "vit":
        size = int(config.image_size)
        return {
            "pixel_values": torch.randn(
                b, int(config.num_channels), size, size, generator=gen, dtype=torch.float32
            )
        }
    if model_type == "wav2vec2":
        n = _wav2vec2_samples(config, s)
        return {
            "input_values": torch.randn(b, n, generator=gen, dtype=torch.float32),
            "attention_mask": torch.ones(b, n, dtype=torch.int64),
        }
    if model_type == "whisper":
        frames = 2 * int(config.max_source_positions)
        features = torch.randn(b, int(config.num_mel_bins), frames, generator=gen, dtype=torch.float32)
        decoder_input_ids = _random_ids(gen, (b, s), 3, int(config.vocab_size))
        decoder_input_ids[:, 0] = int(config.decoder_start_token_id)
        return {"input_features": features, "decoder_input_ids": decoder_input_ids}

    vocab = _text_vocab(config)
    input_ids = _random_ids(gen, (b, s), 3, vocab)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones(b, s, dtype=torch.int64)}
    if getattr(config, "is_encoder_decoder", False):
        decoder_input_ids = _random_ids(gen, (b, s), 3, vocab)
        decoder_input_ids[:, 0] = int(config.decoder_start_token_id)
        inputs["decoder_input_ids"] = decoder_input_ids
    return inputs


def _build(
    model_type: str,
    task: str | None,
    seed: int,
    attn_implementation: str | None,
    overrides: Mapping[str, Any],
) -> PreTrainedModel:
    auto_cls = getattr(transformers, auto_class_name(model_type, task))
    config = shrunk_config(model_type, **overrides)
    if attn_implementation is None:
        attn_implementation = "eager" if model_type in _EAGER_ONLY else "sdpa"
    torch.manual_seed(seed)
    model = auto_cls.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def tiny_model(
    model_type: str,
    task: str | None = None,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 8,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """Build a tiny seeded random-weight model in eval mode and matching forward kwargs.

    ``torch.manual_seed(seed)`` runs right before the model is built, so equal arguments give
    equal weights; the inputs come from :func:`make_inputs` with the same seed.

    ``model_type`` may also name a shared case, ``"case:C09-left-padding"`` (or a unique prefix
    such as ``"case:C09"``): the case's own model and sample inputs are returned (see
    :func:`hfexport.testing.cases.tiny_model_from_case`); no other argument may then be given.

    Args:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`, or ``"case:<name>"``.
        task: a task of the model type (see :func:`supported_tasks`); ``None`` = default task.
        seed: seed for the weights and the inputs.
        batch_size: batch size of the sample inputs.
        seq_len: sequence length of the sample inputs (meaning per architecture in
            :func:`make_inputs`).
        attn_implementation: ``"sdpa"``, ``"eager"``, ...; ``None`` picks ``"sdpa"`` where
            the architecture supports it in transformers 5.24 and ``"eager"`` otherwise (gemma2).
        **overrides: configuration overrides, see :func:`shrunk_config`.

    Returns:
        ``(model, sample_inputs)``: a ``PreTrainedModel`` in eval mode on CPU in float32, and a
        dict of tensors such that ``model(**sample_inputs)`` runs.

    Raises:
        ValueError: unknown model type (the message lists the supported ones), unknown task (the
            message lists the tasks), or extra arguments given with a ``"case:"`` name.
    """
    if model_type.startswith("case:"):
        if task is not None or overrides or attn_implementation is not None:
            raise ValueError("tiny_model('case:...') takes no task, attn_implementation or config overrides")
        from hfexport.testing.cases import load_case, tiny_model_from_case

        return tiny_model_from_case(load_case(model_type.removeprefix("case:")))
    model = _build(model_type, task, seed, attn_implementation, overrides)
    return model, make_inputs(model, task, batch_size=batch_size, seq_len=seq_len, seed=seed)
