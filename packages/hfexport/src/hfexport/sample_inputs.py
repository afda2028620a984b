"""Deterministic sample forward kwargs for a Hugging Face model: :func:`make_inputs`.

Used for ``tiny:`` models (:func:`hfexport.tiny.tiny_model`) and for real checkpoint folders that
have no tokenizer to encode the sample sentences with (:func:`hfexport.checkpoints.load_model`).
The inputs follow the model's :func:`modality` and forward signature; the hand-written tiny presets
(:data:`hfexport.tiny.SUPPORTED_MODEL_TYPES`) have fixed shapes, listed in :func:`make_inputs`.

Special token ids are kept out of the random ids: they are drawn from ``[3, lowest special id >= 3)``
(the tiny configurations keep pad 0, bos 1, eos 2 and move every other special id to the top of the
vocabulary), so the sample inputs never contain special tokens by accident.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from hfexport.tiny.catalog import SUPPORTED_MODEL_TYPES, auto_class_name, check_task
from hfexport.tiny.shrink import special_token_ids

__all__ = ["make_inputs", "modality"]


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
    channels = getattr(vision, "in_channels", None) or vision.num_channels  # MiniMax-M3-VL: num_channels
    patch_dim = int(channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    special = [
        getattr(config, name, None)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ]
    seq_len = 12
    start = 3
    input_ids = _random_ids(gen, (1, seq_len), 3, min(min(i for i in special if i), _text_vocab(config)))
    begin, end = special[2], special[3]
    if begin is not None:  # Qwen2.5-Omni's thinker has no vision start/end tokens (issue 28)
        input_ids[0, start] = begin
    input_ids[0, start + 1 : start + 1 + num_image_tokens] = config.image_token_id
    if end is not None:
        input_ids[0, start + 1 + num_image_tokens] = end
    pixel_values = torch.randn(num_patches, patch_dim, generator=gen, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([grid], dtype=torch.int64),
        "mm_token_type_ids": (input_ids == config.image_token_id).to(torch.int64),
    }


def _merge_side(vision: PretrainedConfig) -> int | None:
    """Patches merged per side into one image token: ``spatial_merge_size`` (Qwen-VL, GLM-4V,
    HunYuan-VL) or the first of ``merge_kernel_size`` (Kimi-K2.5)."""
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is None and isinstance(getattr(vision, "merge_kernel_size", None), list | tuple):
        merge = vision.merge_kernel_size[0]
    return int(merge) if isinstance(merge, int) and not isinstance(merge, bool) else None


def _has_patch_grid(config: PretrainedConfig) -> bool:
    """A Qwen-style vision config: flattened patches described by ``image_grid_thw`` (a patch size,
    a merge size and an image token id; the vision start/end ids and the temporal patch size are
    optional: GLM-4V names them ``image_start_token_id``/``image_end_token_id``, HunYuan-VL has
    neither)."""
    vision = getattr(config, "vision_config", None)
    return (
        vision is not None
        and getattr(vision, "patch_size", None) is not None
        and _merge_side(vision) is not None
        and getattr(config, "image_token_id", None) is not None
    )


def _grid_special_ids(config: PretrainedConfig) -> tuple[int | None, int | None]:
    """The ids wrapping an image's tokens: ``vision_start/end_token_id`` (Qwen-VL, Kimi-K2.5) or
    ``image_start/end_token_id`` (GLM-4V); ``(None, None)`` when the config has no such pair."""
    for prefix in ("vision", "image"):
        start = getattr(config, f"{prefix}_start_token_id", None)
        end = getattr(config, f"{prefix}_end_token_id", None)
        if start is not None and end is not None:
            return int(start), int(end)
    return None, None


def grid_image_ids(config: PretrainedConfig, tokens: int) -> list[int]:
    """The prompt ids of one image of ``tokens`` image tokens in a patch-grid model: the image
    token ``tokens`` times, wrapped in the start/end ids where the config has them
    (:func:`_grid_special_ids`)."""
    start, end = _grid_special_ids(config)
    ids = [int(config.image_token_id)] * tokens
    return ids if start is None else [start, *ids, end]


def grid_pixel_layout(model: PreTrainedModel) -> tuple[tuple[int, ...], int] | None:
    """The per-patch shape of ``pixel_values`` in a patch-grid model and the image tokens one image
    of a ``1 x 2m x 2m`` patch grid (``m`` the merge side) gets, found by running
    ``get_image_features`` once per candidate layout: ``(channels * temporal_patch_size *
    patch_size**2,)`` (Qwen-VL, GLM-4V, HunYuan-VL), else ``(channels, patch_size, patch_size)``
    (Kimi-K2.5's Conv2d patch embedding). The token count is what the vision tower returns, which
    is more than the ``4`` merged patches where it adds row or image separators (HunYuan-VL).

    Returns:
        ``(per-patch shape, image tokens)``, or ``None`` when the tower takes neither layout.
    """
    vision = model.config.vision_config
    merge = _merge_side(vision)
    side = int(vision.patch_size)
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3)
    temporal = int(getattr(vision, "temporal_patch_size", None) or 1)
    grid = torch.tensor([[1, 2 * merge, 2 * merge]], dtype=torch.int64)
    patches = 4 * merge * merge
    for tail in ((channels * temporal * side * side,), (channels, side, side)):
        candidate = torch.zeros(patches, *tail, dtype=torch.float32)
        tokens = _count_image_tokens(model, candidate, {"image_grid_thw": grid}, images=1)
        if tokens:
            return tail, tokens
    return None


def _grid_inputs(model: PreTrainedModel, gen: torch.Generator) -> dict[str, torch.Tensor] | None:
    """Inputs of a model whose vision tower takes flattened patches and ``image_grid_thw`` (issue 28),
    as qwen2_vl's: always one image of a ``1 x 2m x 2m`` patch grid (``m`` the merge side,
    :func:`_merge_side`: four image tokens, or as many as the vision tower returns) inside a
    12-token prompt, from position 3, wrapped in the vision start/end tokens where the config has
    them (:func:`grid_image_ids`).

    ``pixel_values`` has the layout of :func:`grid_pixel_layout`, ``image_grid_thw`` is ``[1, 3]``,
    plus ``mm_token_type_ids`` ``[1, 12]`` (1 on image tokens) when the forward takes it.

    Returns:
        The inputs, or ``None`` when the vision tower takes neither pixel layout.
    """
    config = model.config
    merge = _merge_side(config.vision_config)
    grid = (1, 2 * merge, 2 * merge)
    patches = grid[0] * grid[1] * grid[2]
    layout = grid_pixel_layout(model)
    if layout is None:
        return None
    tail, tokens = layout
    image_ids = grid_image_ids(config, tokens)
    seq_len, start = 12, 3
    low, high = _id_range(config, _text_vocab(config))
    seq_len = max(seq_len, start + len(image_ids) + 1)
    input_ids = _random_ids(gen, (1, seq_len), low, high)
    input_ids[0, start : start + len(image_ids)] = torch.tensor(image_ids)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(patches, *tail, generator=gen, dtype=torch.float32),
        "image_grid_thw": torch.tensor([grid], dtype=torch.int64),
    }
    if "mm_token_type_ids" in _forward_params(model):
        inputs["mm_token_type_ids"] = (input_ids == int(config.image_token_id)).to(torch.int64)
    return inputs


def _forward_params_of(function: Any) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _image_token_id(config: PretrainedConfig) -> int | None:
    """The image placeholder id, else the video one (InstructBLIP-Video places its frames' features
    at ``video_token_index`` only); ``None`` when the config has neither."""
    for attr in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def modality(model: PreTrainedModel, task: str | None = None) -> str:
    """The kind of input a model takes, from its ``main_input_name`` and forward signature.

    ``task`` other than ``None``/``"image-text-to-text"`` keeps a text model text-only even when
    its forward also takes images (gemma3's causal LM); ``task="image-text-to-text"`` makes any
    forward taking ``pixel_values`` and ``input_ids`` ``"image+text"``, with or without an image
    token (GIT prepends the image, BLIP's main input is the image).

    Returns:
        ``"text"`` (``input_ids``; also a Perceiver whose ``inputs`` may be given as ``input_ids``),
        ``"image"`` (``pixel_values``), ``"image+text"``
        (``input_ids`` with ``pixel_values`` and an image token id in the config), ``"audio"``
        (raw ``input_values``) or ``"audio-features"`` (``input_features``, e.g. mel spectrograms);
        ``"other"`` for anything else.
    """
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):  # OneFormer: ["pixel_values", "task_inputs"], the first is the data
        main = main[0] if main else "input_ids"
    params = _forward_params(model)
    if task == "image-text-to-text" and "flattened_patches" in params:
        # Pix2Struct (an image-to-text encoder-decoder) and Kosmos-2.5 take their images as
        # flattened patches, as their processor lays them out (issue 28)
        return "image+text" if "input_ids" in params else "image"
    if task == "image-text-to-text" and {"pixel_values", "input_ids"} <= params:
        # asked for explicitly: images and a prompt, also where the image is the main input (BLIP,
        # BLIP-2, InstructBLIP) or no placeholder token marks it (GIT prepends the image; issue 28)
        return "image+text"
    if main == "input_ids":
        if (
            task in (None, "image-text-to-text")
            and "pixel_values" in params
            and _image_token_id(model.config) is not None
        ):
            return "image+text"
        return "text"
    if main == "inputs" and "input_ids" in params and "pixel_values" not in params:
        return "text"  # Perceiver's any-modality forward, text preprocessor: input_ids stand for inputs
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


def _count_image_tokens(
    model: PreTrainedModel,
    pixel_values: torch.Tensor,
    extra: Mapping[str, torch.Tensor] | None = None,
    images: int | None = None,
    *,
    patches: bool = False,
    always: tuple[str, ...] = (),
    getter_name: str = "get_image_features",
) -> int | None:
    """Image tokens per image the model's vision tower produces, by running it once (with the
    image inputs of ``extra``, e.g. ``image_sizes``, that the feature getter takes, and those named
    in ``always`` even where the getter only forwards ``**kwargs``: MiniCPM-V's); ``images`` is
    the image count when ``pixel_values``' first axis is not (flattened patches); ``patches``
    passes the images as ``flattened_patches`` (Pix2Struct-style towers: Kosmos-2.5);
    ``getter_name`` the feature getter (``get_video_features`` for a video-only model:
    InstructBLIP-Video)."""
    getter = getattr(model, getter_name, None)
    if getter is None and hasattr(model, "model"):
        getter = getattr(model.model, getter_name, None)
    if getter is None:
        return None
    with torch.no_grad():
        try:
            params = _forward_params_of(getter)
            taken = {
                k: v for k, v in (extra or {}).items() if k != "pixel_values" and (k in params or k in always)
            }
            image = {"flattened_patches" if patches else "pixel_values": pixel_values}
            out = getter(**image, **taken)
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
    return rows // (images or pixel_values.shape[0])


def _anyres_tiles(config: PretrainedConfig, size: int) -> int:
    """Tiles per ``size`` x ``size`` image of an "anyres" model: the base tile plus one per
    ``size`` x ``size`` cell of the ``image_grid_pinpoints`` resolution its processor picks (the one
    keeping the most of the image, then wasting the least)."""
    best: tuple[int, int] | None = None
    kept_best, wasted_best = 0, float("inf")
    for height, width in config.image_grid_pinpoints:
        scale = min(width / size, height / size)
        kept = min(int(size * scale) * int(size * scale), size * size)
        wasted = width * height - kept
        if kept > kept_best or (kept == kept_best and wasted < wasted_best):
            best, kept_best, wasted_best = (int(height), int(width)), kept, wasted
    if best is None:
        return 1
    return 1 + -(-best[0] // size) * -(-best[1] // size)


def _ids_config(config: PretrainedConfig) -> PretrainedConfig:
    """The (sub-)configuration whose vocabulary ``input_ids`` index: ``get_text_config()``, or the
    text encoder's where transformers finds two text configs (musicgen: ``text_encoder`` and
    ``decoder``, issue 28), or, when that has no ``vocab_size``, its first sub-configuration that
    has one (fastspeech2_conformer_with_hifigan's ``model_config``)."""
    try:
        text = config.get_text_config()
    except ValueError:
        return getattr(config, "text_encoder", None) or config
    if getattr(text, "vocab_size", None) is None:
        # a wrapper config around its text model's (fastspeech2_conformer_with_hifigan: model_config
        # next to vocoder_config; issue 28): the first sub-configuration with a vocabulary
        for key, value in text.to_dict().items():
            sub = getattr(text, key, None) if isinstance(value, Mapping) else None
            if isinstance(sub, PretrainedConfig) and getattr(sub, "vocab_size", None):
                return sub
    return text


#: the task whose models take images and texts side by side (CLIP-like dual encoders)
ZERO_SHOT_IMAGE_TASK = "zero-shot-image-classification"


def _image_text_pair_inputs(
    model: PreTrainedModel, b: int, s: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A dual encoder's inputs: ``b`` images and ``b`` texts of ``s`` tokens, scored each against each.

    The image sides come from ``vision_config``; the token ids from ``text_config`` (below its
    special ids). ``attention_mask`` is given when the forward takes one.
    """
    config = model.config
    channels, size = _image_shape(config)
    text = config.get_text_config()
    vocab = int(getattr(text, "vocab_size", None) or 256)
    low, high = _id_range(text, vocab)
    input_ids = _random_ids(gen, (b, s), low, high)
    inputs = {"input_ids": input_ids}
    if "attention_mask" in _forward_params(model):
        inputs["attention_mask"] = torch.ones_like(input_ids)
    vision = _sub(config, "vision_config")
    if "spatial_shapes" in _forward_params(model) and getattr(vision, "patch_size", None):
        # NaFlex (siglip2): the processor's output, images cut into a grid of flattened patches
        side = int(vision.patch_size)
        grid = (4, 4)
        patches = grid[0] * grid[1]
        shape = (b, patches, channels * side * side)
        inputs["pixel_values"] = torch.randn(*shape, generator=gen, dtype=torch.float32)
        inputs["pixel_attention_mask"] = torch.ones(b, patches, dtype=torch.int64)
        inputs["spatial_shapes"] = torch.tensor([grid] * b, dtype=torch.int64)
        return inputs
    inputs["pixel_values"] = torch.randn(b, channels, size, size, generator=gen, dtype=torch.float32)
    return inputs


def _qformer_inputs(
    config: PretrainedConfig, inputs: dict[str, torch.Tensor], b: int, s: int, gen: torch.Generator
) -> None:
    """InstructBLIP's instruction for its Q-Former (issue 28): ``qformer_input_ids`` ``[b, s]`` in
    ``[3, qformer vocabulary)`` and ``qformer_attention_mask`` ``[b, s]`` int64 ones. Changes
    ``inputs`` in place."""
    qformer = getattr(config, "qformer_config", None) or config
    vocab = int(getattr(qformer, "vocab_size", None) or 256)
    ids = _random_ids(gen, (b, s), 3, vocab)
    inputs["qformer_input_ids"] = ids
    inputs["qformer_attention_mask"] = torch.ones_like(ids)


#: patches per side of the images given as flattened patches (a 32x32 image in 8x8 patches)
FLAT_PATCH_GRID = (4, 4)


def _flat_patch_inputs(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> int | None:
    """Images as flattened patches, for vision towers that embed patches with a linear layer
    (issue 28); on success replaces ``inputs["pixel_values"]`` (and adds the inputs below) and
    returns the image tokens per image, else leaves ``inputs`` alone and returns ``None``.

    * a NaFlex tower (the forward takes ``spatial_shapes``: SigLIP2 under LFM2-VL): ``pixel_values``
      ``[b, 16, channels * patch_size**2]``, ``pixel_attention_mask`` ``[b, 16]`` int64 ones and
      ``spatial_shapes`` ``[b, 2]`` (a 4x4 grid per image), as its processor lays them out;
    * otherwise (Fuyu): ``pixel_values`` ``[b, 16, channels * patch_size**2]``.
    """
    config = model.config
    params = _forward_params(model)
    vision = _sub(config, "vision_config")
    side = getattr(vision, "patch_size", None) or getattr(config, "patch_size", None)
    if isinstance(side, list | tuple):
        side = side[0]
    if not isinstance(side, int) or isinstance(side, bool):
        return None
    channels, _ = _image_shape(config)
    patches = FLAT_PATCH_GRID[0] * FLAT_PATCH_GRID[1]
    pixel_values = torch.randn(b, patches, channels * side * side, generator=gen, dtype=torch.float32)
    extra: dict[str, torch.Tensor] = {}
    if "spatial_shapes" in params:
        extra = {
            "pixel_attention_mask": torch.ones(b, patches, dtype=torch.int64),
            "spatial_shapes": torch.tensor([FLAT_PATCH_GRID] * b, dtype=torch.int64),
        }
    n = _count_image_tokens(model, pixel_values, extra)
    if not n:
        return None
    inputs["pixel_values"] = pixel_values
    inputs.update(extra)
    return n


def _flattened_patches(config: PretrainedConfig, b: int, gen: torch.Generator) -> torch.Tensor | None:
    """Pix2Struct-style images (Pix2Struct, Kosmos-2.5; issue 28): ``flattened_patches`` float32
    ``[b, 16, 2 + patch_embed_hidden_size]``, a 4x4 grid of patches per image, each row its
    1-based row and column index (0 marks padding) then the patch's pixels, as the Pix2Struct image
    processor lays them out; ``None`` when the vision config names no patch width."""
    vision = _sub(config, "vision_config")
    width = getattr(vision, "patch_embed_hidden_size", None)
    if not isinstance(width, int) or isinstance(width, bool):
        return None
    rows, cols = FLAT_PATCH_GRID
    index = torch.stack(
        torch.meshgrid(torch.arange(1, rows + 1), torch.arange(1, cols + 1), indexing="ij"), dim=-1
    ).reshape(1, rows * cols, 2)
    pixels = torch.randn(b, rows * cols, width, generator=gen, dtype=torch.float32)
    return torch.cat([index.to(torch.float32).expand(b, -1, -1), pixels], dim=-1)


#: the inputs giving each packed image's patch grid ``(height, width)``, with the layout of the
#: packed ``pixel_values`` the model's image processor gives next to them (issue 28)
PACKED_GRID_INPUTS: dict[str, str] = {
    # MiniCPM-V 4.6 / 4.7, MiniCPM-o OCR: the images' patches side by side along the last axis of one
    # row, [1, channels, patch, patches * patch] (NaViT packing), grids int32 [images, 2]
    "target_sizes": "row",
    # Nemotron-H Omni (RADIO): the images' flattened patches one after the other,
    # [patches, channels * patch**2], grids int64 [images, 2]
    "image_grid_hw": "flat",
}


def _packed_grid_inputs(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> int | None:
    """Images as their processor packs them, each described by its patch grid (issue 28): one image
    per prompt of a ``2k x 2k`` patch grid, ``k`` the config's ``image_size // patch_size`` (an image
    of twice the configured side, so the window and merge steps of the tower have more than one
    window per side), in the layout of :data:`PACKED_GRID_INPUTS`:

    * ``target_sizes`` (MiniCPM-V): ``pixel_values`` ``[1, channels, patch, b * 4k**2 * patch]``
      float32, ``target_sizes`` ``[b, 2]`` int32;
    * ``image_grid_hw`` (Nemotron-H Omni): ``pixel_values`` ``[b * 4k**2, channels * patch**2]``
      float32, ``image_grid_hw`` ``[b, 2]`` int64.

    On success replaces ``inputs["pixel_values"]``, adds the grid input and returns the image tokens
    per image the vision tower gives for that grid; else leaves ``inputs`` alone and returns ``None``.
    """
    params = _forward_params(model)
    name = next((k for k in PACKED_GRID_INPUTS if k in params), None)
    if name is None:
        return None
    vision = _sub(model.config, "vision_config")
    side = getattr(vision, "patch_size", None)
    if isinstance(side, list | tuple):
        side = side[0]
    if not isinstance(side, int) or isinstance(side, bool) or side < 1:
        return None
    channels, size = _image_shape(model.config)
    grid = 2 * max(size // side, 1)
    patches = grid * grid
    if PACKED_GRID_INPUTS[name] == "row":
        pixel_values = torch.randn(1, channels, side, b * patches * side, generator=gen, dtype=torch.float32)
        sizes = torch.tensor([[grid, grid]] * b, dtype=torch.int32)
    else:
        pixel_values = torch.randn(b * patches, channels * side * side, generator=gen, dtype=torch.float32)
        sizes = torch.tensor([[grid, grid]] * b, dtype=torch.int64)
    n = _count_image_tokens(model, pixel_values, {name: sizes}, images=b, always=(name,))
    if not n:
        return None
    inputs["pixel_values"] = pixel_values
    inputs[name] = sizes
    return n


#: frames per video of the sample prompts of video-language models (InstructBLIP-Video's processor
#: samples 4 frames per video)
VIDEO_FRAMES = 4


def _video_inputs(
    model: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    b: int,
    gen: torch.Generator,
    extra: Mapping[str, Any],
) -> int | None:
    """Images as the 5-D ``pixel_values`` of a tower that reads frames or tubelets (issue 28), tried
    in this order (the first the model's feature getter runs on is kept):

    * frames (InstructBLIP-Video): ``[b, 4, channels, size, size]`` float32, one 4-frame video per
      prompt (:data:`VIDEO_FRAMES`), through ``get_image_features`` or ``get_video_features``;
    * tubelets (Inkling): ``[16 * b, temporal_patch_size, patch_size, patch_size, channels]`` float32,
      a 4x4 patch grid per image with each patch repeated over the temporal axis's frames and channels
      last (the layout its image processor gives).

    ``extra`` holds the other inputs the getter takes (InstructBLIP's Q-Former instruction). On
    success replaces ``inputs["pixel_values"]`` and returns the image tokens per prompt; else leaves
    ``inputs`` alone and returns ``None``.
    """
    channels, size = _image_shape(model.config)
    frames = torch.randn(b, VIDEO_FRAMES, channels, size, size, generator=gen, dtype=torch.float32)
    for getter in ("get_image_features", "get_video_features"):
        n = _count_image_tokens(model, frames, extra, getter_name=getter)
        if n:
            inputs["pixel_values"] = frames
            return n
    vision = _sub(model.config, "vision_config")
    side = getattr(vision, "patch_size", None)
    temporal = getattr(vision, "temporal_patch_size", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (side, temporal)):
        return None
    patches = FLAT_PATCH_GRID[0] * FLAT_PATCH_GRID[1]
    one = torch.randn(b * patches, 1, side, side, channels, generator=gen, dtype=torch.float32)
    tubelets = one.expand(-1, temporal, -1, -1, -1).contiguous()
    n = _count_image_tokens(model, tubelets, extra, images=b)
    if not n:
        return None
    inputs["pixel_values"] = tubelets
    return n


def _aspect_ratio_tile_inputs(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> bool:
    """Mllama's tiled images (issue 28), as its processor gives them for one image of the tile
    size per prompt: ``pixel_values`` ``[b, 1, max_num_tiles, channels, size, size]`` float32 (the
    first tile the image, the others padding), ``aspect_ratio_ids`` ``[b, 1]`` int64 (1: the
    1x1 ratio, the first of ``supported_aspect_ratios``) and ``aspect_ratio_mask`` ``[b, 1,
    max_num_tiles]`` int64 (1 on the first tile). The prompt's ``cross_attention_mask`` is added by
    :func:`_cross_attention_mask` once the prompt's length is known. Returns whether the forward
    takes such inputs (``inputs`` is changed in place then)."""
    params = _forward_params(model)
    vision = _sub(model.config, "vision_config")
    tiles = getattr(vision, "max_num_tiles", None)
    if "aspect_ratio_ids" not in params or not isinstance(tiles, int):
        return False
    channels, size = _image_shape(model.config)
    inputs["pixel_values"] = torch.randn(
        b, 1, tiles, channels, size, size, generator=gen, dtype=torch.float32
    )
    inputs["aspect_ratio_ids"] = torch.ones(b, 1, dtype=torch.int64)
    mask = torch.zeros(b, 1, tiles, dtype=torch.int64)
    mask[..., 0] = 1
    inputs["aspect_ratio_mask"] = mask
    return True


def _cross_attention_mask(inputs: dict[str, torch.Tensor]) -> None:
    """Mllama's ``cross_attention_mask`` ``[b, seq, 1, max_num_tiles]`` int64: every token attends
    to the image's real tiles (``aspect_ratio_mask``), as its processor marks a prompt whose image
    token comes first. Changes ``inputs`` in place."""
    tiles = inputs["aspect_ratio_mask"]  # [b, 1, tiles]
    seq = int(inputs["input_ids"].shape[1])
    inputs["cross_attention_mask"] = tiles[:, None].expand(-1, seq, -1, -1).contiguous()


def _second_resolution_inputs(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> None:
    """A second view of each image at another resolution, for forwards that take one (issue 28):
    ``<prefix>_pixel_values`` ``[b, channels, size, size]`` float32 with the sides of the
    configuration's ``<prefix>_vision_config`` (DeepSeek-VL hybrid: ``high_res_pixel_values`` for
    its SAM tower next to the SigLIP tower's ``pixel_values``; its processor gives both views of
    every image). Changes ``inputs`` in place."""
    config = model.config
    for name in sorted(_forward_params(model)):
        prefix = name[: -len("_pixel_values")] if name.endswith("_pixel_values") else None
        sub = getattr(config, f"{prefix}_vision_config", None) if prefix else None
        if sub is None or name in inputs:
            continue
        channels, size = _image_shape(sub)
        inputs[name] = torch.randn(b, channels, size, size, generator=gen, dtype=torch.float32)


def _generic_inputs(
    model: PreTrainedModel, task: str | None, b: int, s: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Inputs of a type without a hand-written preset, from its modality and forward signature."""
    config = model.config
    params = _forward_params(model)
    if task == ZERO_SHOT_IMAGE_TASK:
        return _image_text_pair_inputs(model, b, s, gen)
    kind = modality(model, task)
    inputs: dict[str, torch.Tensor] = {}
    patches = _flattened_patches(config, b, gen) if "flattened_patches" in params else None
    if patches is not None and kind in ("image", "image+text"):
        inputs["flattened_patches"] = patches
        if kind == "image" and "attention_mask" in params:
            # Pix2Struct: the mask is over the patches (the decoder prompt has its own)
            inputs["attention_mask"] = torch.ones(b, patches.shape[1], dtype=torch.int64)
    elif kind == "image" or kind == "image+text":
        channels, size = _image_shape(config)
        inputs["pixel_values"] = torch.randn(b, channels, size, size, generator=gen, dtype=torch.float32)
    if kind == "image" and "task_inputs" in params and getattr(config, "task_seq_len", None):
        # OneFormer's task prompt ("the task is semantic"), token ids padded to task_seq_len (issue 28)
        vocab = int(getattr(config, "text_encoder_vocab_size", None) or 256)
        inputs["task_inputs"] = _random_ids(gen, (b, int(config.task_seq_len)), *_id_range(config, vocab))
    if kind == "audio" and getattr(config, "num_mel_bins", None) and getattr(config, "max_length", None):
        # a spectrogram transformer (AST): input_values are [b, frames, mel bins], fixed frames
        shape = (b, int(config.max_length), int(config.num_mel_bins))
        inputs["input_values"] = torch.randn(*shape, generator=gen, dtype=torch.float32)
    elif kind == "audio":
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
            # wav2vec2-bert stacks frames in its feature extractor: the model takes the stacked width
            feat = getattr(config, "feature_projection_input_dim", None) or feat
            frames = 4 * s
            shape = (b, frames, int(feat))
        inputs["input_features"] = torch.randn(*shape, generator=gen, dtype=torch.float32)
        if "attention_mask" in params and shape[1] == frames:
            inputs["attention_mask"] = torch.ones(b, frames, dtype=torch.int64)
    if kind in ("text", "image+text"):
        text = _ids_config(config)
        vocab = int(getattr(text, "vocab_size", None) or 256)
        low, high = _id_range(config, vocab)
        input_ids = _random_ids(gen, (b, s), low, high)
        if kind == "image+text":
            if "qformer_input_ids" in params:
                _qformer_inputs(config, inputs, b, s, gen)
            queries = {k: v for k, v in inputs.items() if k.startswith("qformer_")}
            _second_resolution_inputs(model, inputs, b, gen)
            queries.update({k: v for k, v in inputs.items() if k.endswith("_pixel_values")})
            n = None
            if "flattened_patches" in inputs:
                # Kosmos-2.5: its latent queries are the image's tokens, whatever the patch count
                n = _count_image_tokens(model, inputs["flattened_patches"], patches=True)
            if not n:
                n = _packed_grid_inputs(model, inputs, b, gen)
            tiled = not n and _aspect_ratio_tile_inputs(model, inputs, b, gen)
            if tiled:
                # cross-attended, not merged: one image token per image marks where it goes (Mllama)
                n = 1
            elif not n and "image_attention_mask" in params:
                # IDEFICS: images grouped per prompt, [batch, images, channels, h, w], cross-attended
                # by the tokens image_attention_mask marks (set below); no placeholder id to insert
                inputs["pixel_values"] = inputs["pixel_values"][:, None]
                n = 1
            if (
                not n
                and "image_sizes" in params
                and isinstance(getattr(config, "image_grid_pinpoints", None), list)
            ):
                # "anyres" (LLaVA-NeXT, -Video, -OneVision): each image a base tile and the tiles of
                # its best-fitting grid resolution, [batch, tiles, channels, size, size] (issue 28)
                channels, size = _image_shape(config)
                tiles = _anyres_tiles(config, size)
                tiled = torch.randn(b, tiles, channels, size, size, generator=gen, dtype=torch.float32)
                sizes = {"image_sizes": torch.tensor([[size, size]] * b, dtype=torch.int64)}
                n = _count_image_tokens(model, tiled, sizes)
                if n:
                    inputs.update(pixel_values=tiled, **sizes)
            if not n and "pixel_values" in inputs:
                n = _count_image_tokens(model, inputs["pixel_values"], queries)
            if not n and "image_sizes" in params:
                # a vision tower that needs each image's (height, width) (Mistral3 / Pixtral; issue 28)
                channels, size = _image_shape(config)
                sizes = {"image_sizes": torch.tensor([[size, size]] * b, dtype=torch.int64)}
                n = _count_image_tokens(model, inputs["pixel_values"], sizes)
                if n:
                    inputs.update(sizes)
            if not n and "pixel_attention_mask" in params and "spatial_shapes" not in params:
                # Idefics2/3, SmolVLM: images grouped per prompt, [batch, images, channels, h, w] (issue 28)
                grouped = inputs["pixel_values"][:, None]
                n = _count_image_tokens(model, grouped)
                if n:
                    inputs["pixel_values"] = grouped
                else:
                    # granite_docling: the mask is required and marks the real tiles, [batch, tiles]
                    tiles = {"pixel_attention_mask": torch.ones(b, 1, dtype=torch.bool)}
                    n = _count_image_tokens(model, grouped, tiles)
                    if n:
                        inputs["pixel_values"] = grouped
                        inputs.update(tiles)
            if not n and "pixel_values" in inputs:
                # a tower taking each image as a sequence of flattened patches (issue 28)
                n = _flat_patch_inputs(model, inputs, b, gen)
            if not n:
                # a tower reading frames or tubelets: 5-D pixel_values (issue 28)
                n = _video_inputs(model, inputs, b, gen, queries)
            image_token = _image_token_id(config)
            if n and image_token is not None:
                image_ids = torch.full((b, n), int(image_token), dtype=torch.int64)
                input_ids = torch.cat([input_ids[:, :1], image_ids, input_ids[:, 1:]], dim=1)
            elif n and "image_embeds_position_mask" in params:
                # Kosmos-2: no image token id; a mask marks the n positions the image features
                # take (issue 28)
                image_ids = _random_ids(gen, (b, n), low, high)
                input_ids = torch.cat([input_ids[:, :1], image_ids, input_ids[:, 1:]], dim=1)
                mask = torch.zeros_like(input_ids)
                mask[:, 1 : 1 + n] = 1
                inputs["image_embeds_position_mask"] = mask
        inputs["input_ids"] = input_ids
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(input_ids)
        if "aspect_ratio_mask" in inputs and "cross_attention_mask" in params:
            _cross_attention_mask(inputs)
        if kind == "image+text" and "image_attention_mask" in params and inputs["pixel_values"].dim() == 5:
            # IDEFICS: every token attends to the prompt's image, [batch, seq, images] int64 ones (its
            # processor marks the tokens from the image's on)
            images = int(inputs["pixel_values"].shape[1])
            inputs["image_attention_mask"] = torch.ones(b, int(input_ids.shape[1]), images, dtype=torch.int64)
        image_token = _image_token_id(config)
        if kind == "image+text" and "mm_token_type_ids" in params and image_token is not None:
            # the processor's modality per token (1 on image tokens), which multimodal rotary
            # positions read (MiniCPM-V 4.7; issue 28)
            inputs["mm_token_type_ids"] = (input_ids == int(image_token)).to(torch.int64)
        if kind == "text":
            _layout_extras(model, inputs, b, s, gen)
    eos = getattr(config, "eos_token_id", None)
    if (
        task == "text-classification"
        and getattr(config, "is_encoder_decoder", False)
        and "input_ids" in inputs
    ):
        # issue 28: an encoder-decoder's sequence-classification head (BART, T5 and their kin) pools
        # the decoder state at the last <eos> of input_ids and refuses rows without one, as its
        # tokenizer ends every sentence with </s>; the decoder ids are the model's own shift of
        # input_ids (what the text-classification pipeline passes), so no decoder_input_ids
        if isinstance(eos, int) and not isinstance(eos, bool):
            inputs["input_ids"][:, -1] = eos
        return inputs
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


#: the coordinate range of layout models' boxes (LayoutLM's processors scale pages to 0..1000)
LAYOUT_COORDINATE_MAX = 1000
#: regions per image of the region-feature models (LXMERT's detector gives 36; any count runs)
VISUAL_REGIONS = 4


def _boxes(gen: torch.Generator, b: int, n: int, high: float, integer: bool) -> torch.Tensor:
    """``[b, n, 4]`` boxes ``(x0, y0, x1, y1)`` with ``0 <= x0 <= x1 <= high`` (same for y): int64
    when ``integer``, else float32."""
    if integer:
        corners = torch.randint(0, int(high) + 1, (b, n, 2, 2), generator=gen, dtype=torch.int64)
    else:
        corners = torch.rand(b, n, 2, 2, generator=gen, dtype=torch.float32) * high
    low, top = corners.min(dim=2).values, corners.max(dim=2).values  # [b, n, (x, y)] each
    return torch.cat([low, top], dim=-1).contiguous()


def _layout_extras(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, s: int, gen: torch.Generator
) -> None:
    """Layout and region inputs some text forwards need next to ``input_ids`` (issue 28), per their
    signature; changes ``inputs`` in place.

    * ``bbox`` ``[b, s, 4]``, one ``(x0, y0, x1, y1)`` box per token: int64 in ``[0, 1000]`` for
      models that look coordinates up in embedding tables (``max_2d_position_embeddings`` in the
      config: LayoutLM, LayoutLMv3, LiLT), float32 in ``[0, 1]`` otherwise (BROS embeds normalised
      coordinates sinusoidally);
    * ``visual_feats`` ``[b, 4, visual_feat_dim]`` float32 and ``visual_pos`` ``[b, 4, 4]`` float32
      boxes in ``[0, 1]`` (LXMERT: the detector's region features and their boxes).
    """
    config = model.config
    params = _forward_params(model)
    if "bbox" in params:
        table = getattr(config, "max_2d_position_embeddings", None)
        if table:
            inputs["bbox"] = _boxes(gen, b, s, min(LAYOUT_COORDINATE_MAX, int(table) - 1), integer=True)
        else:
            inputs["bbox"] = _boxes(gen, b, s, 1.0, integer=False)
    feat_dim = getattr(config, "visual_feat_dim", None)
    if "visual_feats" in params and "visual_pos" in params and feat_dim:
        inputs["visual_feats"] = torch.randn(
            b, VISUAL_REGIONS, int(feat_dim), generator=gen, dtype=torch.float32
        )
        inputs["visual_pos"] = _boxes(gen, b, VISUAL_REGIONS, 1.0, integer=False)


# --- issue 28: time series, detection/segmentation/depth, text-to-audio --------------------------


def _time_series_inputs(model: PreTrainedModel, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Inputs of a forecasting head (``main_input_name == "past_values"``), per its forward.

    * patchtst / patchtsmixer: ``past_values`` ``[b, context_length, num_input_channels]``;
    * informer / autoformer / time_series_transformer: ``past_values`` ``[b, context_length +
      max(lags_sequence)]``, ``past_time_features`` ``[b, same, num_time_features]``,
      ``past_observed_mask`` ``[b, same]`` (ones), and the horizon teacher-forced:
      ``future_values`` ``[b, prediction_length]`` and ``future_time_features`` ``[b,
      prediction_length, num_time_features]``; without ``future_values`` their forward decodes
      nothing (the forecast itself is drawn by sampling in ``generate``), so the deterministic
      prediction output is the distribution parameters ``params`` of the horizon;
    * timesfm-like (``past_values`` a batch of series): ``past_values`` ``[b, context_length]``.

    Values are positive (``1 + |N(0, 1)|``): the mean scalers divide by the mean absolute value.
    """
    config = model.config
    params = _forward_params(model)

    def values(*shape: int) -> torch.Tensor:
        return 1.0 + torch.randn(*shape, generator=gen, dtype=torch.float32).abs()

    context = int(getattr(config, "context_length", None) or 32)
    if "past_time_features" in params:
        past = context + max(getattr(config, "lags_sequence", None) or [0])
        horizon = int(config.prediction_length)
        feats = int(getattr(config, "num_time_features", 0) or 0) + int(
            getattr(config, "num_dynamic_real_features", 0) or 0
        )
        inputs = {
            "past_values": values(b, past),
            "past_time_features": torch.randn(b, past, feats, generator=gen, dtype=torch.float32),
            "past_observed_mask": torch.ones(b, past, dtype=torch.float32),
            "future_values": values(b, horizon),
            "future_time_features": torch.randn(b, horizon, feats, generator=gen, dtype=torch.float32),
        }
        return inputs
    channels = getattr(config, "num_input_channels", None)
    if channels is None:
        return {"past_values": values(b, context)}
    return {"past_values": values(b, context, int(channels))}


def _text_to_audio_extras(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, s: int, gen: torch.Generator
) -> None:
    """Decoder inputs of the text-to-audio models whose forward teacher-forces a decoder: speecht5's
    ``decoder_input_values`` ``[b, s, num_mel_bins]`` (float32) and musicgen's ``decoder_input_ids``
    ``[b, num_codebooks, s]`` (audio codes in ``[0, decoder vocab)``; the decoder reshapes the
    documented ``[b * num_codebooks, s]`` form to this one, the same logits, and this form keeps the
    batch on axis 0 with the text inputs'). Changes ``inputs`` in place."""
    config = model.config
    params = _forward_params(model)
    if "decoder_input_values" in params and getattr(config, "num_mel_bins", None):
        inputs["decoder_input_values"] = torch.randn(
            b, s, int(config.num_mel_bins), generator=gen, dtype=torch.float32
        )
    decoder = getattr(config, "decoder", None)
    if "decoder_input_ids" in params and getattr(decoder, "num_codebooks", None):
        codes = int(decoder.vocab_size)
        ids = _random_ids(gen, (b, int(decoder.num_codebooks), s), 0, codes)
        ids[..., 0] = int(
            getattr(decoder, "pad_token_id", None) or getattr(config, "decoder_start_token_id", 0) or 0
        )
        inputs["decoder_input_ids"] = ids


#: class names per image in the zero-shot detectors' sample inputs that take a list of classes: one,
#: so that every input's leading axis counts images (what the second-shape validation varies)
DETECTION_CLASSES_PER_IMAGE = 1


def _omdet_queries(
    config: PretrainedConfig, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> None:
    """OmDet-Turbo's text inputs, as its processor lays them out: ``classes_input_ids`` /
    ``classes_attention_mask`` ``[b * c, 4]`` (``c`` 4-token class names per image, images' classes
    one after the other; ``c`` is :data:`DETECTION_CLASSES_PER_IMAGE`), ``classes_structure``
    ``[b]`` (``c``: the classes of each image) and ``tasks_input_ids`` / ``tasks_attention_mask``
    ``[b, 4]`` (one task prompt per image). Changes ``inputs`` in place."""
    text = getattr(config, "text_config", None) or config
    vocab = int(getattr(text, "vocab_size", None) or 256)
    low, high = _id_range(config, vocab)
    per_image = DETECTION_CLASSES_PER_IMAGE
    classes = _random_ids(gen, (b * per_image, 4), low, high)
    tasks = _random_ids(gen, (b, 4), low, high)
    inputs["classes_input_ids"] = classes
    inputs["classes_attention_mask"] = torch.ones_like(classes)
    inputs["tasks_input_ids"] = tasks
    inputs["tasks_attention_mask"] = torch.ones_like(tasks)
    inputs["classes_structure"] = torch.full((b,), per_image, dtype=torch.int64)


def _zero_shot_detection_extras(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], b: int, gen: torch.Generator
) -> None:
    """Images and text queries of a zero-shot detector (owlvit, owlv2, grounding-dino):
    ``pixel_values`` as for images when the main input is ``input_ids`` (owl-vit), and
    ``input_ids``/``attention_mask`` ``[b, 4]``: one 4-token query per image, so that the image
    and text batches grow together at the second shape (owl-vit reads ``len(input_ids) /
    len(pixel_values)`` queries per image). Changes ``inputs`` in place."""
    config = model.config
    params = _forward_params(model)
    if "pixel_values" in params and "pixel_values" not in inputs:  # main input is input_ids (owl-vit)
        channels, size = _image_shape(config)
        inputs["pixel_values"] = torch.randn(b, channels, size, size, generator=gen, dtype=torch.float32)
    if "classes_input_ids" in params:  # omdet-turbo: class names and a task prompt per image
        _omdet_queries(config, inputs, b, gen)
        return
    if "input_ids" not in params:
        return
    text = getattr(config, "text_config", None) or config
    vocab = int(getattr(text, "vocab_size", None) or 256)
    low, high = _id_range(config, vocab)
    ids = _random_ids(gen, (b, 4), low, high)
    inputs["input_ids"] = ids
    if "attention_mask" in params:
        inputs["attention_mask"] = torch.ones_like(ids)


def make_inputs(
    model: PreTrainedModel,
    task: str | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Build deterministic forward kwargs for an already-built model.

    Random values come from a ``torch.Generator`` seeded with ``seed``, so equal arguments give
    equal tensors; the global RNG is not touched. Token ids are int64 in ``[3, vocab_size)``,
    attention masks are int64 ones, floating inputs are float32 standard normal.

    What ``batch_size`` (``b``) and ``seq_len`` (``s``) mean for the hand-written presets:

    * decoder LMs and BERT-like encoders: ``input_ids``, ``attention_mask`` ``[b, s]``;
    * t5, bart: also ``decoder_input_ids`` ``[b, s]`` starting with the decoder start token;
    * vit: ``pixel_values`` ``[b, num_channels, image_size, image_size]`` (``s`` is ignored);
    * whisper: ``input_features`` ``[b, num_mel_bins, 2 * max_source_positions]`` and
      ``decoder_input_ids`` ``[b, s]`` starting with the decoder start token (``input_features``
      only for task ``"audio-classification"``);
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
      from the config or its ``vision_config``; ``s`` is ignored); a forward taking ``task_inputs``
      (OneFormer) also gets its task prompt's token ids ``[b, task_seq_len]`` int64;
    * ``"image+text"``: ``pixel_values`` as for images and ``input_ids`` ``[b, s + n]`` whose
      positions ``1 .. n`` hold the image token, ``n`` being the number of image features the
      vision tower produces per image (found by running ``get_image_features`` once); when that
      fails without them, ``image_sizes`` ``[b, 2]`` (Mistral3 / Pixtral) or images grouped per
      prompt, ``pixel_values`` ``[b, 1, channels, size, size]`` (Idefics2/3, SmolVLM: forwards
      taking ``pixel_attention_mask``), or flattened patches ``[b, 16, channels * patch_size**2]``
      (Fuyu; with ``pixel_attention_mask`` ``[b, 16]`` and ``spatial_shapes`` ``[b, 2]`` for a
      NaFlex tower, LFM2-VL; :func:`_flat_patch_inputs`); a patch-grid vision config (a patch size,
      a merge size and an image token id: Qwen-VL, GLM-4V, Kimi-K2.5, HunYuan-VL) gets qwen2_vl's
      form, one image of 2m x 2m patches in a 12-token prompt (:func:`_grid_inputs`); with
      ``task="image-text-to-text"`` also image-first forwards (BLIP family: InstructBLIP adds its
      Q-Former instruction ``qformer_input_ids`` / ``qformer_attention_mask`` ``[b, s]``), forwards
      without a placeholder token (GIT: no image tokens inserted) and Kosmos-2 (its ``n`` latent
      query positions random ids marked by ``image_embeds_position_mask`` ``[b, s + n]``);
    * text forwards taking ``bbox`` (document layout models) also get one box per token, ``bbox``
      ``[b, s, 4]`` (int64 in ``[0, 1000]``, or float32 in ``[0, 1]`` without a 2-D position
      table: BROS), and those taking ``visual_feats``/``visual_pos`` (LXMERT) 4 regions per row,
      ``[b, 4, visual_feat_dim]`` and ``[b, 4, 4]`` float32 (:func:`_layout_extras`);
    * ``"audio"``: ``input_values`` ``[b, n]`` float32 with ``n`` the shortest length giving ``s``
      frames after the conv feature encoder (``320 * s + 80`` without one), ``attention_mask``
      ``[b, n]`` when taken; a spectrogram transformer (``num_mel_bins`` and ``max_length`` in its
      config, AST) gets ``input_values`` ``[b, max_length, num_mel_bins]``;
    * ``"audio-features"``: ``input_features`` ``[b, num_mel_bins, 2 * max_source_positions]``
      (whisper-like) or ``[b, 4 * s, features]`` (speech-to-text-like; ``features`` is
      ``feature_projection_input_dim`` where the config has one, wav2vec2-bert);
    * encoder-decoders also get ``decoder_input_ids`` ``[b, s]`` starting with the decoder start
      token (``pad_token_id`` or 0 when the config has none), except for task
      ``"text-classification"``: there every row of ``input_ids`` ends with ``eos_token_id`` (the
      head pools the decoder state at the last ``</s>``) and the model shifts ``input_ids`` into
      its decoder ids itself;
    * forecasting heads (``main_input_name == "past_values"``): see :func:`_time_series_inputs`
      (``s`` is ignored: the context length is the config's);
    * ``text-to-audio``: ``input_ids`` as for text, plus speecht5's ``decoder_input_values`` ``[b,
      s, num_mel_bins]`` or musicgen's ``decoder_input_ids`` ``[b, num_codebooks, s]``;
    * ``zero-shot-object-detection``: ``pixel_values`` as for images plus text queries
      ``input_ids``/``attention_mask`` ``[b, 4]`` (one query per image); omdet-turbo (a forward
      taking ``classes_input_ids``) instead one class name per image ``classes_input_ids`` /
      ``classes_attention_mask`` ``[b, 4]``, ``classes_structure`` ``[b]`` (1s) and one task
      prompt per image ``tasks_input_ids`` / ``tasks_attention_mask`` ``[b, 4]``.
    * task ``"zero-shot-image-classification"`` (CLIP-like dual encoders): ``input_ids`` ``[b, s]``
      (and ``attention_mask`` ``[b, s]`` when taken) and ``pixel_values``
      ``[b, num_channels, image_size, image_size]``: ``b`` texts and ``b`` images (a NaFlex model,
      siglip2, gets its processor's form: ``pixel_values`` ``[b, 16, num_channels * patch_size**2]``,
      a 4x4 patch grid, ``pixel_attention_mask`` ``[b, 16]`` ones and ``spatial_shapes`` ``[b, 2]``);
    * whisper with task ``"audio-classification"``: ``input_features`` only.

    Args:
        model: a model of any type transformers knows (a :func:`hfexport.tiny.tiny_model` or a
            loaded checkpoint).
        task: checked against the model type's tasks when given; it changes the inputs of
            zero-shot image classification and whisper's audio classification (see above).
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
        check_task(task)  # a composite type's model may carry its sub-config's model_type
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    gen = _generator(seed)
    b, s = batch_size, seq_len

    if model_type not in SUPPORTED_MODEL_TYPES:
        if _has_patch_grid(config) and modality(model, task) == "image+text":
            # Qwen2.5-VL, Qwen3-VL, GLM-4V, Kimi-K2.5 ...: flattened patches and image_grid_thw
            # (issue 28)
            grid_inputs = _grid_inputs(model, gen)
            if grid_inputs is not None:
                return grid_inputs
        if getattr(model, "main_input_name", None) == "past_values":  # forecasting heads (issue 28)
            return _time_series_inputs(model, b, gen)
        inputs = _generic_inputs(model, task, b, s, gen)
        if task == "text-to-audio":
            _text_to_audio_extras(model, inputs, b, s, gen)
        if task == "zero-shot-object-detection":
            _zero_shot_detection_extras(model, inputs, b, gen)
        return inputs
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
        if task == "audio-classification":  # the encoder and a classifier: no decoder inputs
            return {"input_features": features}
        decoder_input_ids = _random_ids(gen, (b, s), 3, int(config.vocab_size))
        decoder_input_ids[:, 0] = int(config.decoder_start_token_id)
        return {"input_features": features, "decoder_input_ids": decoder_input_ids}

    vocab = _text_vocab(config)
    input_ids = _random_ids(gen, (b, s), 3, vocab)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones(b, s, dtype=torch.int64)}
    if task == "text-classification" and getattr(config, "is_encoder_decoder", False):
        input_ids[:, -1] = int(config.eos_token_id)  # t5, bart: pooled at the last </s> (see above)
        return inputs
    if getattr(config, "is_encoder_decoder", False):
        decoder_input_ids = _random_ids(gen, (b, s), 3, vocab)
        decoder_input_ids[:, 0] = int(config.decoder_start_token_id)
        inputs["decoder_input_ids"] = decoder_input_ids
    return inputs
