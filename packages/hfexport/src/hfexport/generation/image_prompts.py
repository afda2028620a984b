"""Image + prompt inputs of another shape, for checking generation from exported components.

A component graph exported with ``dynamic=True`` must serve other prompts than its sample: more
images, other prompt lengths and, for models with a patch grid (Qwen2-VL), other image sizes and
so another number of image tokens. :func:`other_image_prompt` builds such generate-style inputs
for a tiny vision-language model, with the image placeholder tokens kept consistent with the
images, so that a test or the zoo sweep can run greedy generation at a second shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["other_image_prompt", "text_only_prompt"]


def _grid_prompt(
    model: torch.nn.Module, inputs: Mapping[str, Any], seed: int, same_size: bool = False
) -> dict[str, torch.Tensor]:
    """One image of another patch grid inside a longer prompt (``image_grid_thw`` models: Qwen-VL,
    GLM-4V, Kimi-K2.5, HunYuan-VL), its image tokens counted by the vision tower itself (HunYuan-VL
    adds row separators to the merged patches) and wrapped in the start/end ids where the config
    has them; with ``same_size``, two images of the sample's first grid instead."""
    from hfexport.sample_inputs import _count_image_tokens, _merge_side, grid_image_ids

    config = model.config
    merge = _merge_side(config.vision_config)
    grid = inputs["image_grid_thw"]
    old_h, old_w = (int(v) for v in grid[0, 1:])
    # a taller and wider image (another image token count), or two of the sample's size
    thw = (1, old_h, old_w) if same_size else (1, old_h + 2 * merge, old_w + merge)
    images = 2 if same_size else 1
    patches = thw[0] * thw[1] * thw[2]
    gen = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(images * patches, *inputs["pixel_values"].shape[1:], generator=gen)
    grid_thw = torch.tensor([thw] * images, dtype=torch.int64)
    tokens = _count_image_tokens(model, pixel_values[:patches], {"image_grid_thw": grid_thw[:1]}, images=1)
    if not tokens:
        tokens = patches // (merge * merge)
    image_ids = grid_image_ids(config, tokens)
    special = {
        int(getattr(config, name))
        for name in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "image_start_token_id",
            "image_end_token_id",
        )
        if getattr(config, name, None) is not None
    }
    vocab = int(config.get_text_config().vocab_size)
    high = min([t for t in special if t >= 3] + [vocab])
    before, after, between = 5, 4, 2  # text between two images keeps their blocks apart
    text = torch.randint(3, high, (1, before + after + between * (images - 1)), generator=gen)
    pieces = [text[:, :before], torch.tensor([image_ids])]
    for i in range(images - 1):
        pieces += [text[:, before + i * between : before + (i + 1) * between], torch.tensor([image_ids])]
    ids = torch.cat([*pieces, text[:, before + between * (images - 1) :]], dim=1)
    out = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixel_values,
        "image_grid_thw": grid_thw,
    }
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = (ids == int(config.image_token_id)).to(torch.int64)
    return out


#: the image input of an encoder-decoder prompted with an image alone: VisionEncoderDecoder's
#: pixels, Pix2Struct's flattened patches (issue 28)
IMAGE_PROMPT_KEYS = ("pixel_values", "flattened_patches")


def _image_encoder_decoder(model: torch.nn.Module, inputs: Mapping[str, Any]) -> str | None:
    """The image input's name for an encoder-decoder whose prompt is an image alone
    (:data:`IMAGE_PROMPT_KEYS`, optionally a decoder prompt: VisionEncoderDecoder, Pix2Struct),
    else ``None``."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return None
    return next((k for k in IMAGE_PROMPT_KEYS if isinstance(inputs.get(k), torch.Tensor)), None)


def other_image_prompt(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, seed: int = 1, same_image_size: bool = False
) -> dict[str, torch.Tensor]:
    """Generate-style inputs of another shape than ``inputs`` for the same vision-language model.

    - a model with ``image_grid_thw`` (Qwen2-VL, GLM-4V, Kimi-K2.5 and alike): one image with a patch grid
      ``2 * merge`` patches taller and ``merge`` wider than the sample's first image (so another
      number of image tokens), inside a prompt of other length (batch 1); with
      ``same_image_size`` (an image encoder exported for one grid,
      :attr:`hfexport.generation.plan.GenerationPlan.per_image`), two images of the sample's grid;
    - an encoder-decoder prompted with an image alone (VisionEncoderDecoder, Pix2Struct): one more image and
      a decoder prompt 2 tokens longer;
    - any other model: :func:`hfexport.sample_inputs.make_inputs` with one more row (one more
      image) and a prompt 5 text tokens longer, i.e. the same image size, more images, a longer
      prompt.

    Args:
        model: the tiny ``PreTrainedModel`` the sample ``inputs`` were made for.
        inputs: its sample generate-style inputs (``input_ids`` ``[batch, seq]``, ``pixel_values``
            ``[images, channels, height, width]`` or ``[patches, patch_dim]``, ...).
        seed: seed of the random ids and pixel values.
        same_image_size: keep the sample's image size (patch-grid models only; the others keep it
            anyway).

    Returns:
        A dict of CPU tensors with the same keys as ``inputs`` that ``model.generate`` accepts.

    Raises:
        ValueError: ``inputs`` has no ``input_ids`` (not a text prompt) and is not an image-only
            encoder-decoder prompt.
    """
    from hfexport.sample_inputs import make_inputs

    image_key = _image_encoder_decoder(model, inputs) if "input_ids" not in inputs else None
    if image_key is not None:
        # an image-only prompt (VisionEncoderDecoder, Pix2Struct): one more image, a longer decoder prompt
        batch = int(inputs[image_key].shape[0])
        decoder = inputs.get("decoder_input_ids")
        length = int(decoder.shape[1]) + 2 if isinstance(decoder, torch.Tensor) else 8
        other = make_inputs(model, "image-text-to-text", batch_size=batch + 1, seq_len=length, seed=seed)
        return {k: v for k, v in other.items() if k in inputs}
    if "input_ids" not in inputs:
        raise ValueError(
            f"inputs {sorted(inputs)} hold no input_ids; pass the generate-style inputs of a prompt"
        )
    from hfexport.sample_inputs import _has_patch_grid

    if "image_grid_thw" in inputs and _has_patch_grid(model.config):
        return _grid_prompt(model, inputs, seed, same_size=same_image_size)
    batch, seq = (int(v) for v in inputs["input_ids"].shape)
    images = inputs.get("pixel_values")
    text_len = seq
    if isinstance(images, torch.Tensor) and images.dim() >= 1 and images.shape[0] == batch:
        image_token = getattr(model.config, "image_token_id", None) or getattr(
            model.config, "image_token_index", None
        )
        if image_token is not None:
            text_len = seq - int((inputs["input_ids"][0] == int(image_token)).sum())
    other = make_inputs(
        model, "image-text-to-text", batch_size=batch + 1, seq_len=max(text_len, 1) + 5, seed=seed
    )
    return {k: v for k, v in other.items() if k in inputs} if set(inputs) <= set(other) else other


def text_only_prompt(
    inputs: Mapping[str, Any], placeholder_ids: list[int] | set[int]
) -> dict[str, torch.Tensor]:
    """The text part of an image + prompt sample: a prompt that carries no image.

    Each placeholder token is replaced by the first other token of its row (so the prompt keeps
    its length and padding) and every image input (``pixel_values``, ``image_grid_thw``,
    ``image_sizes``, ``mm_token_type_ids`` ...) is dropped: what a user sends for a text-only turn
    of a vision-language chat, which ``model.generate`` runs through the language model alone.

    Args:
        inputs: generate-style inputs with int64 ``input_ids [batch, seq]`` and optionally
            ``attention_mask [batch, seq]``.
        placeholder_ids: the image placeholder token ids (``GenerationPlan.features``' keys).

    Returns:
        ``{"input_ids": [batch, seq], "attention_mask": [batch, seq]}`` (int64).

    Raises:
        ValueError: ``inputs`` hold no ``input_ids``, or a row holds placeholder tokens only.
    """
    if inputs.get("input_ids") is None:
        raise ValueError(
            "the sample holds no input_ids: a text-only prompt needs a text prompt to start from"
        )
    ids = torch.as_tensor(inputs["input_ids"]).clone()
    placeholders = torch.zeros_like(ids, dtype=torch.bool)
    for token in placeholder_ids:
        placeholders |= ids == int(token)
    for row in range(ids.shape[0]):
        others = ids[row][~placeholders[row]]
        if others.numel() == 0:
            raise ValueError(f"row {row} of input_ids holds image placeholder tokens only")
        ids[row][placeholders[row]] = others[0]
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).clone()
    return {"input_ids": ids, "attention_mask": mask}
