"""A zoo of tiny, seeded, random-weight Hugging Face models for tests.

Any model type transformers knows (``transformers.CONFIG_MAPPING``) gets a tiny model: its default
configuration is shrunk generically (:mod:`hfexport.testing.shrink`), with per-type overrides kept
as data (:mod:`hfexport.testing.presets`). A type whose tiny model cannot be built, or cannot run
eagerly on the derived inputs, raises :class:`TinyModelUnavailable` naming the stage and the reason
(it is not an export failure).

The nineteen hand-written presets (:data:`SUPPORTED_MODEL_TYPES`) are described below; every
supported architecture there gets a *shrunk* configuration (hidden size 32-64, two layers, a
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
import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from hfexport.errors import HfExportError
from hfexport.tasks import TASK_AUTO_CLASSES
from hfexport.testing.presets import PRESETS, Preset
from hfexport.testing.shrink import shrink_overrides, special_token_ids

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TASK_TO_AUTO_CLASS",
    "TinyModelUnavailable",
    "UnknownModelTypeError",
    "auto_class_name",
    "check_runs_eagerly",
    "default_task",
    "known_model_types",
    "make_inputs",
    "modality",
    "shrunk_config",
    "supported_tasks",
    "tiny_model",
]

#: Task name -> name of the ``transformers`` auto class that builds a model for it. A few model
#: types use another class for the same task (wav2vec2 speech recognition is CTC, not
#: sequence-to-sequence); :func:`auto_class_name` resolves those.
#: The tasks the zoo builds tiny models for, a subset of :data:`hfexport.tasks.TASK_AUTO_CLASSES`.
TASK_TO_AUTO_CLASS: dict[str, str] = {
    task: TASK_AUTO_CLASSES[task]
    for task in (
        "text-generation",
        "feature-extraction",
        "fill-mask",
        "text-classification",
        "text2text-generation",
        "image-classification",
        "automatic-speech-recognition",
        "image-text-to-text",
    )
}

# task -> (name of the transformers mapping model_type -> class name, auto class), in lookup order
_TASK_MAPPINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "text-generation": (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),),
    "feature-extraction": (("MODEL_MAPPING_NAMES", "AutoModel"),),
    "fill-mask": (("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),),
    "text-classification": (
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
    ),
    "text2text-generation": (("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),),
    "image-classification": (
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    ),
    "automatic-speech-recognition": (
        ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
        ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    ),
    "image-text-to-text": (("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),),
}

# default task of a type without a preset: the first of these it has a class for
_DEFAULT_TASK_ORDER = (
    "text2text-generation",
    "image-text-to-text",
    "automatic-speech-recognition",
    "image-classification",
    "fill-mask",
    "text-generation",
    "feature-extraction",
    "text-classification",
)

_AUTO_CLASS_OVERRIDES: dict[tuple[str, str], str] = {
    ("wav2vec2", "automatic-speech-recognition"): "AutoModelForCTC",
}

_NUM_LABELS = 3

#: Model types with a hand-written preset (see the module docstring), in a stable order.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(mt for mt, p in PRESETS.items() if p.mode == "replace")


class UnknownModelTypeError(ValueError):
    """``transformers`` knows no such model type; the message lists close matches."""


class TinyModelUnavailable(HfExportError, RuntimeError):
    """The tiny model of a known model type cannot be built or cannot run eagerly.

    Not an export failure: the sweep reports such a type as "unbuildable" or "eager fails".

    Attributes:
        model_type: the model type asked for.
        task: the task asked for.
        stage: ``"config"`` (the shrunk configuration is refused), ``"build"`` (the model class
            cannot be instantiated from it) or ``"eager"`` (the forward pass on the derived
            inputs fails).
        reason: one line: the exception type and the first line of its message.
    """

    def __init__(self, model_type: str, task: str | None, stage: str, reason: str) -> None:
        self.model_type, self.task, self.stage, self.reason = model_type, task, stage, reason
        super().__init__(f"tiny {model_type} model ({task}) unavailable at {stage}: {reason}")


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def _modeling_auto() -> Any:
    from transformers.models.auto import modeling_auto

    return modeling_auto


def _known_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def known_model_types(task: str | None = None) -> list[str]:
    """Model types ``transformers`` knows, sorted; with ``task``, those it has a class for.

    Args:
        task: a key of :data:`TASK_TO_AUTO_CLASS`, or ``None`` for every model type.

    Returns:
        Sorted model-type names (``transformers.CONFIG_MAPPING`` keys).

    Raises:
        ValueError: unknown ``task`` (the message lists the known tasks).
    """
    if task is None:
        return sorted(_known_types())
    _check_task(task)
    auto = _modeling_auto()
    types: set[str] = set()
    for mapping_name, _ in _TASK_MAPPINGS[task]:
        types |= set(getattr(auto, mapping_name, {}))
    return sorted(t for t in types if t in set(_known_types()))


def _check_task(task: str) -> None:
    if task not in TASK_TO_AUTO_CLASS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASK_TO_AUTO_CLASS)}")


def _check_model_type(model_type: str) -> None:
    if model_type in PRESETS:
        return
    known = _known_types()
    if model_type in known:
        return
    close = difflib.get_close_matches(model_type, known, n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "no close match"
    raise UnknownModelTypeError(
        f"unknown model_type {model_type!r} for the tiny-model zoo: transformers "
        f"{transformers.__version__} knows no such model type ({hint}); any model type of "
        f"transformers.CONFIG_MAPPING works, hand-written presets: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _generic_tasks(model_type: str) -> dict[str, str]:
    """task -> auto class name, for the tasks transformers has a class for (default order)."""
    auto = _modeling_auto()
    found: dict[str, str] = {}
    for task in _DEFAULT_TASK_ORDER:
        for mapping_name, auto_cls in _TASK_MAPPINGS[task]:
            if model_type in getattr(auto, mapping_name, {}):
                found[task] = auto_cls
                break
    return found


def supported_tasks(model_type: str) -> tuple[str, ...]:
    """Return the tasks a tiny model of ``model_type`` can be built for, default first.

    A hand-written preset fixes its tasks; any other type has the tasks transformers has an auto
    class for (among :data:`TASK_TO_AUTO_CLASS`), in the order text2text-generation,
    image-text-to-text, automatic-speech-recognition, image-classification, fill-mask,
    text-generation, feature-extraction, text-classification.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no ``model_type``; the message
            lists close matches.
    """
    _check_model_type(model_type)
    preset = PRESETS.get(model_type)
    if preset is not None and preset.tasks is not None:
        return preset.tasks
    return tuple(_generic_tasks(model_type))


def default_task(model_type: str) -> str:
    """Return the task a tiny model of ``model_type`` is built for when none is given.

    Args:
        model_type: a ``transformers`` model type, e.g. ``"llama"``.

    Returns:
        The task name, a key of :data:`TASK_TO_AUTO_CLASS` (``"text-generation"`` for decoder
        language models, ``"feature-extraction"`` for the BERT-like presets, ...).

    Raises:
        UnknownModelTypeError: unknown ``model_type`` (the message lists close matches).
        TinyModelUnavailable: transformers has no class of any zoo task for ``model_type``.
    """
    tasks = supported_tasks(model_type)
    if not tasks:
        raise TinyModelUnavailable(
            model_type,
            None,
            "build",
            f"transformers has no class of the tasks {', '.join(TASK_TO_AUTO_CLASS)}",
        )
    return tasks[0]


def auto_class_name(model_type: str, task: str | None = None) -> str:
    """Return the name of the ``transformers`` auto class building ``model_type`` for ``task``.

    Args:
        model_type: any model type transformers knows.
        task: a key of :data:`TASK_TO_AUTO_CLASS`; ``None`` means :func:`default_task`.

    Returns:
        An attribute name of the ``transformers`` module, e.g. ``"AutoModelForCausalLM"``.

    Raises:
        ValueError: unknown ``model_type`` (:class:`UnknownModelTypeError`, with close matches);
            unknown ``task`` (the message lists the known tasks); a task the model type has no
            class for (the message names the tasks it has).
    """
    _check_model_type(model_type)
    if task is None:
        task = default_task(model_type)
    _check_task(task)
    tasks = supported_tasks(model_type)
    if task not in tasks:
        raise ValueError(
            f"the tiny {model_type} model is not available for task {task!r}; "
            f"its tasks: {', '.join(tasks) or '(none of the zoo tasks)'}"
        )
    if (model_type, task) in _AUTO_CLASS_OVERRIDES:
        return _AUTO_CLASS_OVERRIDES[(model_type, task)]
    generic = _generic_tasks(model_type)
    return generic.get(task, TASK_TO_AUTO_CLASS[task])


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
        model_type: any model type transformers knows; a hand-written preset
            (:data:`SUPPORTED_MODEL_TYPES`) is used as is, any other type's default configuration
            is shrunk generically (:func:`hfexport.testing.shrink.shrink_overrides`) and its overlay
            in :data:`hfexport.testing.presets.PRESETS` (if any) applied.
        **overrides: configuration attributes replacing the zoo's values; a dict given for a
            sub-configuration (``text_config``, ``vision_config``) is merged into the zoo's.

    Returns:
        A fresh ``PretrainedConfig`` from ``AutoConfig.for_model(model_type, ...)``.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no ``model_type``.
        TinyModelUnavailable: (stage ``"config"``) transformers refuses the shrunk configuration.
    """
    _check_model_type(model_type)
    preset: Preset | None = PRESETS.get(model_type)
    if preset is not None and preset.mode == "replace":
        base = {"num_labels": _NUM_LABELS, **preset.config}
        return AutoConfig.for_model(model_type, **_merge(base, overrides))
    try:
        default = AutoConfig.for_model(model_type)
        base = {"num_labels": _NUM_LABELS, **shrink_overrides(default)}
        if preset is not None:
            base = _merge(base, preset.config)
        return AutoConfig.for_model(model_type, **_merge(base, overrides))
    except Exception as exc:  # transformers raises many types here; all mean "no tiny config"
        raise TinyModelUnavailable(model_type, None, "config", _one_line(exc)) from exc


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


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _image_token_id(config: PretrainedConfig) -> int | None:
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def modality(model: PreTrainedModel, task: str | None = None) -> str:
    """The kind of input a model takes, from its ``main_input_name`` and forward signature.

    ``task`` other than ``None``/``"image-text-to-text"`` keeps a text model text-only even when
    its forward also takes images (gemma3's causal LM).

    Returns:
        ``"text"`` (``input_ids``), ``"image"`` (``pixel_values``), ``"image+text"``
        (``input_ids`` with ``pixel_values`` and an image token id in the config), ``"audio"``
        (raw ``input_values``) or ``"audio-features"`` (``input_features``, e.g. mel spectrograms);
        ``"other"`` for anything else.
    """
    main = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model)
    if main == "input_ids":
        if (
            task in (None, "image-text-to-text")
            and "pixel_values" in params
            and _image_token_id(model.config) is not None
        ):
            return "image+text"
        return "text"
    return {"pixel_values": "image", "input_values": "audio", "input_features": "audio-features"}.get(
        main, "other"
    )


def _id_range(config: PretrainedConfig, vocab: int) -> tuple[int, int]:
    """``[3, high)``: below every special id >= 3 (the generic shrink puts those at the top)."""
    specials = [i for i in special_token_ids(config) if 3 <= i < vocab]
    high = min(specials, default=vocab)
    return (3, high) if high > 3 else (3, vocab)


def _sub(config: PretrainedConfig, name: str) -> Any:
    return getattr(config, name, None) or config


def _image_shape(config: PretrainedConfig) -> tuple[int, int]:
    vision = _sub(config, "vision_config")
    size = getattr(vision, "image_size", None) or getattr(config, "image_size", None) or 32
    if isinstance(size, list | tuple):
        size = size[-1]
    if isinstance(size, Mapping):
        size = next(iter(size.values()))
    channels = getattr(vision, "num_channels", None) or getattr(config, "num_channels", None) or 3
    return int(channels), int(size)


def _count_image_tokens(model: PreTrainedModel, pixel_values: torch.Tensor) -> int | None:
    """Image tokens per image the model's vision tower produces, by running it once."""
    getter = getattr(model, "get_image_features", None)
    if getter is None and hasattr(model, "model"):
        getter = getattr(model.model, "get_image_features", None)
    if getter is None:
        return None
    with torch.no_grad():
        try:
            out = getter(pixel_values=pixel_values)
        except Exception:
            return None
    if hasattr(out, "pooler_output") and out.pooler_output is not None:
        out = out.pooler_output
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    if isinstance(out, list | tuple):
        rows = sum(int(t.reshape(-1, t.shape[-1]).shape[0]) for t in out)
    elif isinstance(out, torch.Tensor):
        rows = int(out.reshape(-1, out.shape[-1]).shape[0])
    else:
        return None
    return rows // pixel_values.shape[0]


def _generic_inputs(
    model: PreTrainedModel, task: str | None, b: int, s: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Inputs of a type without a hand-written preset, from its modality and forward signature."""
    config = model.config
    params = _forward_params(model)
    kind = modality(model, task)
    inputs: dict[str, torch.Tensor] = {}
    if kind == "image" or kind == "image+text":
        channels, size = _image_shape(config)
        inputs["pixel_values"] = torch.randn(b, channels, size, size, generator=gen, dtype=torch.float32)
    if kind == "audio":
        if getattr(config, "conv_kernel", None) and getattr(config, "conv_stride", None):
            n = _wav2vec2_samples(config, s)
        else:
            n = 320 * s + 80
        inputs["input_values"] = torch.randn(b, n, generator=gen, dtype=torch.float32)
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(b, n, dtype=torch.int64)
    if kind == "audio-features":
        if getattr(config, "num_mel_bins", None) and getattr(config, "max_source_positions", None):
            shape = (b, int(config.num_mel_bins), 2 * int(config.max_source_positions))  # whisper-like
            frames = shape[2]
        else:
            feat = (
                getattr(config, "input_feat_per_channel", None) or getattr(config, "feature_size", None) or 80
            )
            feat *= getattr(config, "input_channels", 1) or 1
            frames = 4 * s
            shape = (b, frames, int(feat))
        inputs["input_features"] = torch.randn(*shape, generator=gen, dtype=torch.float32)
        if "attention_mask" in params and shape[1] == frames:
            inputs["attention_mask"] = torch.ones(b, frames, dtype=torch.int64)
    if kind in ("text", "image+text"):
        text = config.get_text_config()
        vocab = int(getattr(text, "vocab_size", None) or 256)
        low, high = _id_range(config, vocab)
        input_ids = _random_ids(gen, (b, s), low, high)
        if kind == "image+text":
            n = _count_image_tokens(model, inputs["pixel_values"])
            image_token = _image_token_id(config)
            if n:
                image_ids = torch.full((b, n), int(image_token), dtype=torch.int64)
                input_ids = torch.cat([input_ids[:, :1], image_ids, input_ids[:, 1:]], dim=1)
        inputs["input_ids"] = input_ids
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(input_ids)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        vocab = int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 256))
        low, high = _id_range(config, vocab)
        decoder_input_ids = _random_ids(gen, (b, s), low, high)
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(config, "pad_token_id", None) or 0
        decoder_input_ids[:, 0] = int(start)
        inputs["decoder_input_ids"] = decoder_input_ids
    return inputs


def make_inputs(
    model: PreTrainedModel,
    task: str | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Build deterministic forward kwargs for an already-built zoo model.

    Random values come from a ``torch.Generator`` seeded with ``seed``, so equal arguments give
    equal tensors; the global RNG is not touched. Token ids are int64 in ``[3, vocab_size)``,
    attention masks are int64 ones, floating inputs are float32 standard normal.

    What ``batch_size`` (``b``) and ``seq_len`` (``s``) mean for the hand-written presets:

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

    Any other model type gets inputs from its :func:`modality` and forward signature:

    * ``"text"``: ``input_ids`` ``[b, s]`` int64 in ``[3, lowest special id >= 3)``, plus
      ``attention_mask`` ``[b, s]`` int64 ones when ``forward`` takes one;
    * ``"image"``: ``pixel_values`` ``[b, num_channels, image_size, image_size]`` float32 (sizes
      from the config or its ``vision_config``; ``s`` is ignored);
    * ``"image+text"``: ``pixel_values`` as for images and ``input_ids`` ``[b, s + n]`` whose
      positions ``1 .. n`` hold the image token, ``n`` being the number of image features the
      vision tower produces per image (found by running ``get_image_features`` once);
    * ``"audio"``: ``input_values`` ``[b, n]`` float32 with ``n`` the shortest length giving ``s``
      frames after the conv feature encoder (``320 * s + 80`` without one), ``attention_mask``
      ``[b, n]`` when taken;
    * ``"audio-features"``: ``input_features`` ``[b, num_mel_bins, 2 * max_source_positions]``
      (whisper-like) or ``[b, 4 * s, features]`` (speech-to-text-like);
    * encoder-decoders also get ``decoder_input_ids`` ``[b, s]`` starting with the decoder start
      token (``pad_token_id`` or 0 when the config has none).

    Args:
        model: a model built by :func:`tiny_model` (any model type transformers knows).
        task: checked against the model type's tasks when given; the inputs do not depend on it.
        batch_size: rows in the batch, >= 1.
        seq_len: sequence length (see above), >= 1.
        seed: seed of the generator producing the random values.

    Returns:
        A dict of CPU tensors such that ``model(**inputs)`` runs.

    Raises:
        ValueError: unknown model type, unknown task or one the type has no class for, or a
            non-positive ``batch_size``/``seq_len``.
    """
    config = model.config
    model_type = config.model_type
    if model_type in SUPPORTED_MODEL_TYPES:
        auto_class_name(model_type, task)  # validates model type and task
    elif task is not None:
        _check_task(task)  # a composite type's model may carry its sub-config's model_type
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    gen = _generator(seed)
    b, s = batch_size, seq_len

    if model_type not in SUPPORTED_MODEL_TYPES:
        return _generic_inputs(model, task, b, s, gen)
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
    preset = PRESETS.get(model_type)
    if model_type in SUPPORTED_MODEL_TYPES:  # hand-written: built exactly as always
        if attn_implementation is None:
            attn_implementation = preset.attn_implementation or "sdpa"
        torch.manual_seed(seed)
        return auto_cls.from_config(config, attn_implementation=attn_implementation).eval()
    chosen = attn_implementation or (preset.attn_implementation if preset else None) or "sdpa"
    try:
        torch.manual_seed(seed)
        try:
            model = auto_cls.from_config(config, attn_implementation=chosen)
        except ValueError as exc:
            message = str(exc).lower()
            if (
                attn_implementation is not None
                or chosen != "sdpa"
                or "attention implementation" not in message
            ):
                raise
            torch.manual_seed(seed)  # no SDPA path in this architecture: eager attention
            model = auto_cls.from_config(config, attn_implementation="eager")
    except Exception as exc:  # any failure to instantiate means "no tiny model", with the reason
        raise TinyModelUnavailable(model_type, task, "build", _one_line(exc)) from exc
    _redraw_zero_matrices(model, seed)
    return model.eval()


def _redraw_zero_matrices(model: torch.nn.Module, seed: int) -> list[str]:
    """Draw every all-zero weight matrix of ``model`` (2-D or more, floating) from N(0, std), std =
    the config's ``initializer_range`` (0.02 without one), with a generator seeded by ``seed``.

    Some architectures zero-initialise a weight matrix, notably MoE routers (afmoe's
    ``router.gate``): every token then scores every expert equally, and which experts top-k picks
    among exact ties is left to the kernel (torch's CPU topk and ONNX Runtime's TopK pick
    different ones), so an exported model "differs" from eager for no fault of the export, and
    routing covers only one expert set. A trained checkpoint never has such a matrix. Vectors
    (norm weights, biases, zero-initialised gates) are left alone.

    Returns:
        The names of the redrawn parameters, in module order.
    """
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    gen = torch.Generator().manual_seed(seed + 1)
    redrawn = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and param.is_floating_point() and param.numel() and not param.any():
                param.copy_(
                    torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype) * std
                )
                redrawn.append(name)
    return redrawn


def check_runs_eagerly(
    model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], task: str | None = None
) -> Any:
    """Run ``model(**inputs)`` without gradients and return its output.

    Raises:
        TinyModelUnavailable: (stage ``"eager"``) the forward pass raised (the reason is the
            exception's type and first line), or every floating-point output value is below
            :data:`DEGENERATE_MAX_ABS` in magnitude: activations vanished through the random layers,
            and a parity check against such a model compares zeros, so it proves nothing (the fix is
            a per-type overlay in :mod:`hfexport.testing.presets`, e.g. a larger ``initializer_range``).
    """
    try:
        with torch.no_grad():
            output = model(**inputs)
    except Exception as exc:  # any eager failure makes the type unavailable, not an export failure
        raise TinyModelUnavailable(model.config.model_type, task, "eager", _one_line(exc)) from exc
    floats = [t for t in _output_tensors(output) if t.is_floating_point() and t.numel()]
    if floats and max(float(t.abs().max()) for t in floats) < DEGENERATE_MAX_ABS:
        peak = max(float(t.abs().max()) for t in floats)
        raise TinyModelUnavailable(
            model.config.model_type,
            task,
            "eager",
            f"degenerate outputs: every value is below {DEGENERATE_MAX_ABS:g} in magnitude (max {peak:.1e}); the "
            "activations vanish through the random layers, so parity with eager would compare zeros "
            "(add an overlay with a larger initializer_range in hfexport.testing.presets)",
        )
    return output


#: a tiny model whose every floating-point output is below this (absolute) is degenerate
DEGENERATE_MAX_ABS = 1e-6


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (ModelOutput, tuple, dict, cache objects skipped)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _output_tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for value in output for t in _output_tensors(value)]
    return []


def tiny_model(
    model_type: str,
    task: str | None = None,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 8,
    attn_implementation: str | None = None,
    check_eager: bool = False,
    **overrides: Any,
) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """Build a tiny seeded random-weight model in eval mode and matching forward kwargs.

    ``torch.manual_seed(seed)`` runs right before the model is built, so equal arguments give
    equal weights; the inputs come from :func:`make_inputs` with the same seed.

    ``model_type`` may also name a shared case, ``"case:C09-left-padding"`` (or a unique prefix
    such as ``"case:C09"``): the case's own model and sample inputs are returned (see
    :func:`hfexport.testing.cases.tiny_model_from_case`); no other argument may then be given.

    Args:
        model_type: any model type transformers knows (:func:`known_model_types`; the nineteen of
            :data:`SUPPORTED_MODEL_TYPES` have hand-written presets), or ``"case:<name>"``.
        task: a task of the model type (see :func:`supported_tasks`); ``None`` = default task.
        seed: seed for the weights and the inputs.
        batch_size: batch size of the sample inputs.
        seq_len: sequence length of the sample inputs (meaning per architecture in
            :func:`make_inputs`).
        attn_implementation: ``"sdpa"``, ``"eager"``, ...; ``None`` picks ``"sdpa"`` where
            the architecture supports it in transformers 5.24 and ``"eager"`` otherwise (gemma2,
            and any generic type whose model class refuses SDPA).
        check_eager: run the model once on the sample inputs (:func:`check_runs_eagerly`).
        **overrides: configuration overrides, see :func:`shrunk_config`.

    Returns:
        ``(model, sample_inputs)``: a ``PreTrainedModel`` in eval mode on CPU in float32, and a
        dict of tensors such that ``model(**sample_inputs)`` runs.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no such model type; the
            message lists close matches.
        ValueError: unknown task (the message lists the tasks), a task the type has no class for
            (the message names the tasks it has), or extra arguments given with a ``"case:"`` name.
        TinyModelUnavailable: the tiny configuration or model cannot be built (stage
            ``"config"``/``"build"``), or, with ``check_eager=True``, the forward pass on the
            sample inputs fails (stage ``"eager"``).
    """
    if model_type.startswith("case:"):
        if task is not None or overrides or attn_implementation is not None:
            raise ValueError("tiny_model('case:...') takes no task, attn_implementation or config overrides")
        from hfexport.testing.cases import load_case, tiny_model_from_case

        return tiny_model_from_case(load_case(model_type.removeprefix("case:")))
    model = _build(model_type, task, seed, attn_implementation, overrides)
    try:
        inputs = make_inputs(model, task, batch_size=batch_size, seq_len=seq_len, seed=seed)
    except ValueError:
        raise
    except Exception as exc:  # deriving inputs ran into the model (e.g. its vision tower)
        raise TinyModelUnavailable(model_type, task, "eager", _one_line(exc)) from exc
    if check_eager:
        check_runs_eagerly(model, inputs, task)
    return model, inputs
