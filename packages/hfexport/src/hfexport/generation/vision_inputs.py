"""Export-input preparers for vision-language models (registered by input marker).

``torch.export`` cannot trace values computed with ``.tolist()``/``.item()`` loops over the
*contents* of an input. Two such computations recur in Qwen-style vision-language models:

- the vision encoder derives its rotary position ids, the packed-attention boundaries
  (``cu_seqlens``) and, with windowed attention, the window permutation from ``grid_thw``;
- the language model derives multimodal rotary (M-RoPE) position ids from ``input_ids``,
  ``mm_token_type_ids`` and ``image_grid_thw`` with ``get_rope_index``, a method that lives on the
  inner ``.model`` of ``...ForConditionalGeneration`` classes.

The preparers below (input-preparer entries of the workaround registry,
:mod:`hfexport.workarounds.input_preparers`) compute them eagerly so the exported graph receives them as inputs; the
standalone functions are also what the generation runner calls at run time, when no eager model
is around (:func:`vision_grid_inputs`, :func:`mrope_position_ids`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.workarounds.input_preparers import register_export_input_preparer

__all__ = [
    "find_rope_index_owner",
    "mrope_position_ids",
    "prepare_mrope_position_ids",
    "prepare_vision_grid_inputs",
    "row_separated_mrope_position_ids",
    "vision_grid_inputs",
    "vision_grid_settings",
]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _forward_reads(cls: type) -> frozenset[str]:
    """Names of the ``transformers.vision_utils`` helpers ``cls.forward`` calls (they pop precomputed kwargs)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return frozenset()
    helpers = (
        "get_vision_position_ids",
        "get_vision_attention_seqlens",
        "get_vision_cu_seqlens",
        "get_vision_window_index",
    )
    return frozenset(h for h in helpers if h in source)


def vision_grid_settings(module: Any) -> dict[str, Any] | None:
    """What a Qwen-style vision encoder needs precomputed, or ``None`` when ``module`` is not one.

    Returns:
        ``{"spatial_merge_size": int, "window_size": int | None, "patch_size": int | None,
        "position_ids": bool, "cu_seqlens": bool, "window_index": bool}``: the booleans say which
        precomputed kwargs the encoder's ``forward`` reads (through the ``transformers.vision_utils``
        helpers, which pop them from ``**kwargs`` when given). A tower whose ``include_temporal`` /
        ``merge_temporal`` attribute is True (MiniMax-M3-VL: ``[patches, 3]`` rotary ids with the
        frame index, one attention segment per clip) adds that key set to True.
    """
    reads = _forward_reads(type(module))
    if not reads:
        return None
    config = getattr(module, "config", None)
    merge = getattr(module, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None)
    if merge is None:
        return None
    window = getattr(module, "window_size", None) or getattr(config, "window_size", None)
    patch = getattr(module, "patch_size", None) or getattr(config, "patch_size", None)
    settings = {
        "spatial_merge_size": int(merge),
        "window_size": int(window) if window is not None else None,
        "patch_size": int(patch) if patch is not None else None,
        "position_ids": "get_vision_position_ids" in reads,
        "cu_seqlens": bool({"get_vision_attention_seqlens", "get_vision_cu_seqlens"} & reads),
        "window_index": "get_vision_window_index" in reads and window is not None and patch is not None,
    }
    # MiniMax-M3-VL's tower: rotary ids with a temporal column, one attention segment per clip
    for flag in ("include_temporal", "merge_temporal"):
        if getattr(module, flag, False) is True:
            settings[flag] = True
    return settings


def vision_grid_inputs(grid_thw: torch.Tensor, settings: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Precompute the data-dependent inputs of a Qwen-style vision encoder from ``grid_thw``.

    Args:
        grid_thw: int64 ``[num_images, 3]``: temporal, height and width patches per image.
        settings: as returned by :func:`vision_grid_settings` (JSON-safe, stored in generation
            manifests).

    Returns:
        A subset of ``{"position_ids": int64 [num_patches, 2] ([num_patches, 3] with
        ``include_temporal``), "cu_seqlens": int32 [segments + 1],
        "window_index": int64 [num_merged_patches], "cu_window_seqlens": int32 [windows + 1]}``,
        as the encoder's ``forward`` reads them (computed with ``transformers.vision_utils``).
    """
    from transformers import vision_utils

    out: dict[str, torch.Tensor] = {}
    merge = int(settings["spatial_merge_size"])
    if settings.get("position_ids"):
        out["position_ids"] = vision_utils.get_vision_position_ids(
            grid_thw, merge, include_temporal=bool(settings.get("include_temporal", False))
        )
    if settings.get("cu_seqlens"):
        out["cu_seqlens"] = vision_utils.get_vision_cu_seqlens(
            grid_thw, merge_temporal=bool(settings.get("merge_temporal", False))
        )
    if settings.get("window_index"):
        index, cu_window = vision_utils.get_vision_window_index(
            grid_thw,
            spatial_merge_size=merge,
            window_size=int(settings["window_size"]),
            patch_size=int(settings["patch_size"]),
        )
        out["window_index"] = index
        out["cu_window_seqlens"] = cu_window
    return out


@register_export_input_preparer(
    "grid_thw",
    description=(
        "precompute a Qwen-style vision encoder's rotary position ids, cu_seqlens and window index from "
        "grid_thw, which the encoder computes with .tolist()/.item() loops torch.export cannot trace"
    ),
    issue="https://github.com/pytorch/pytorch/issues/158786",
    versions={"transformers": ">=5.0,<6"},
)
def prepare_vision_grid_inputs(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Preparer for Qwen-style vision encoders (marker ``grid_thw``).

    Adds the rotary ``position_ids``, ``cu_seqlens`` and (windowed encoders) ``window_index`` /
    ``cu_window_seqlens`` the encoder would compute from ``grid_thw`` with ``.tolist()`` loops; the
    encoder pops them from ``**kwargs`` instead. Inputs already given are kept. A module that does
    not read them is left alone.
    """
    settings = vision_grid_settings(model)
    if settings is None:
        return inputs
    for key, value in vision_grid_inputs(inputs["grid_thw"], settings).items():
        inputs.setdefault(key, value.to(inputs["grid_thw"].device))
    return inputs


def find_rope_index_owner(model: Any) -> Any | None:
    """The module holding ``get_rope_index`` (the model itself, ``model.model`` or the base model)."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "base_model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


def _text_positions(
    attention_mask: torch.Tensor | None, batch: int, length: int, device: Any
) -> torch.Tensor:
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length).clone()
    mask = attention_mask.to(torch.int64)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


@register_export_input_preparer(
    "input_ids",
    "image_grid_thw",
    "mm_token_type_ids",
    description=(
        "precompute M-RoPE position ids with the model's get_rope_index, a data-dependent loop over the "
        "token types that torch.export cannot trace"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def prepare_mrope_position_ids(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Preparer for M-RoPE models given processor-style inputs (markers ``input_ids``,
    ``image_grid_thw``, ``mm_token_type_ids``).

    When ``position_ids`` is not given, computes them with the model's own ``get_rope_index``
    wherever it lives (on ``...ForConditionalGeneration`` it is on the inner ``.model``) and passes
    ``[4, batch, seq]``: the text positions, then the temporal/height/width positions, the layout
    ``generate`` uses at prefill. Models without ``get_rope_index`` are left alone.
    """
    if inputs.get("position_ids") is not None:
        return inputs
    owner = find_rope_index_owner(model)
    if owner is None:
        return inputs
    input_ids = inputs["input_ids"]
    kwargs = {
        k: inputs[k]
        for k in ("image_grid_thw", "video_grid_thw", "attention_mask", "mm_token_type_ids")
        if inputs.get(k) is not None
    }
    with torch.no_grad():
        vision, _ = owner.get_rope_index(input_ids, **kwargs)
    text = _text_positions(
        inputs.get("attention_mask"), input_ids.shape[0], input_ids.shape[1], input_ids.device
    )
    inputs["position_ids"] = torch.cat([text[None].to(vision.dtype), vision], dim=0)
    return inputs


def mrope_position_ids(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    spatial_merge_size: int,
    attention_mask: torch.Tensor | None = None,
    newline_columns: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids of a prompt with images (Qwen2-VL layout), without the model.

    Text tokens advance all three axes by one; an image block of ``t x h x w`` merged patches gets
    temporal index ``t``, row ``h`` and column ``w`` offset by the position where it starts, and the
    text after it resumes at ``start + max(h, w)`` (grid sizes divided by ``spatial_merge_size``).
    Padded positions (mask 0) are skipped and get 0.

    Args:
        input_ids: int64 ``[batch, seq]``.
        mm_token_type_ids: ``[batch, seq]``: 0 for text, 1 for image tokens (videos, 2, are not
            supported here).
        image_grid_thw: int64 ``[num_images, 3]`` (patch grid per image, before merging), images in
            the order they appear over ``(batch, seq)``.
        spatial_merge_size: the vision encoder's merge size.
        attention_mask: ``[batch, seq]`` padding mask or ``None``.
        newline_columns: columns the image block has past its merged grid's width: 1 for
            HunYuan-V4-VL, whose merger ends each merged row with a newline token, so an image of
            ``h x w`` merged patches spans ``h x (w + 1)`` tokens laid out as a grid of that width
            (issue 28); 0 (Qwen2-VL) otherwise.

    Returns:
        ``(position_ids, deltas)``: int64 ``[4, batch, seq]`` (row 0: text positions from the mask,
        rows 1-3: temporal/height/width) and ``[batch, 1]``, the offset between M-RoPE and text
        positions after the prompt (decode positions are ``text_position + delta`` on rows 1-3).

    Raises:
        ValueError: video tokens; more image blocks than ``image_grid_thw`` rows; an image block
            whose length does not match its grid.
    """
    batch, length = input_ids.shape
    device = input_ids.device
    out = torch.zeros(3, batch, length, dtype=torch.int64, device=device)
    deltas = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    grids = [tuple(int(x) for x in row) for row in image_grid_thw.tolist()]
    grid_iter = iter(grids)
    merge = int(spatial_merge_size)
    for b in range(batch):
        keep = (
            attention_mask[b].bool() if attention_mask is not None else torch.ones(length, dtype=torch.bool)
        )
        types = mm_token_type_ids[b][keep].tolist()
        if any(t == 2 for t in types):
            raise ValueError(
                "mrope_position_ids handles image tokens only; the prompt has video tokens (type 2)"
            )
        pieces: list[torch.Tensor] = []
        pos = 0
        i = 0
        while i < len(types):
            j = i
            while j < len(types) and types[j] == types[i]:
                j += 1
            if types[i] == 0:
                n = j - i
                pieces.append(torch.arange(pos, pos + n, device=device).expand(3, n))
                pos += n
            else:
                try:
                    t, h, w = next(grid_iter)
                except StopIteration:
                    raise ValueError("the prompt has more image blocks than image_grid_thw rows") from None
                gh, gw = h // merge, w // merge + int(newline_columns)
                if t * gh * gw != j - i:
                    raise ValueError(
                        f"an image block of {j - i} tokens does not match its grid {t}x{h}x{w} "
                        f"(merge {merge} -> {t * gh * gw} tokens)"
                    )
                tt, hh, ww = torch.meshgrid(
                    torch.arange(t, device=device),
                    torch.arange(gh, device=device),
                    torch.arange(gw, device=device),
                    indexing="ij",
                )
                pieces.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
                pos += max(gh, gw)
            i = j
        positions = (
            torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64, device=device)
        )
        out[:, b, keep] = positions
        deltas[b, 0] = (int(positions.max()) + 1 if positions.numel() else 0) - len(types)
    text = _text_positions(attention_mask, batch, length, device)
    return torch.cat([text[None], out], dim=0), deltas


#: config attributes naming the marker tokens of a canvas M-RoPE prompt (MiniCPM-V 4.7), in the
#: order :func:`canvas_mrope_position_ids` takes them
CANVAS_MARKERS: tuple[str, ...] = (
    "slice_start_id",
    "slice_end_id",
    "image_start_id",
    "image_end_id",
    "newline_id",
)


def canvas_markers(config: Any) -> dict[str, int]:
    """The canvas marker ids a config defines (:data:`CANVAS_MARKERS` without their ``_id``),
    looked up on the config and its text config; those it leaves unset are left out."""
    found: dict[str, int] = {}
    sources = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        sources.append(get_text())
    for name in CANVAS_MARKERS:
        value = next((getattr(c, name, None) for c in sources if getattr(c, name, None) is not None), None)
        if value is not None:
            found[name[: -len("_id")]] = int(value)
    return found


def _canvas_axis(origin: int, extent: int, tokens: int) -> torch.Tensor:
    """``tokens`` positions spread evenly (rounded) over ``extent`` canvas cells from ``origin``."""
    return torch.linspace(0, extent - 1, tokens).round().to(torch.int64) + origin


def canvas_mrope_position_ids(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    target_sizes: torch.Tensor,
    merge: int,
    attention_mask: torch.Tensor | None = None,
    markers: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """M-RoPE position ids of MiniCPM-V 4.7's canvas layout, without the model (issue 28).

    Every image is a *frame*: a thumbnail crop, optionally followed by detail slices (crops whose
    previous token is the ``slice_start`` marker) tiling the image row by row. The frame is laid out
    on a canvas of ``rows * slice_h x cols * slice_w`` merged patches (the thumbnail's own grid
    without slices) starting at position ``o``: every token of the frame gets temporal index ``o``;
    the thumbnail is stretched over the whole canvas (its rows and columns spread evenly over it),
    each slice covers its tile (``o + tile offset + arange``), the marker before the thumbnail sits
    just outside the canvas (``o - 1``), the ``image_end`` marker after the thumbnail at its far
    corner, each slice's markers at its corners, and the tokens of the gap ending a row of slices
    past the row's right edge. The text after the frame resumes at ``o + max(height, width) + 1``.
    Frames separated by markers alone share a group; text between frames of a group advances one
    more. Padded positions (mask 0) get 0.

    Args:
        input_ids: int64 ``[batch, seq]``.
        mm_token_type_ids: ``[batch, seq]``: 0 text, 1 image.
        target_sizes: int ``[crops, 2]``: the patch grid ``(height, width)`` of every crop, in the
            order the crops appear over ``(batch, seq)``.
        merge: patches per merged token along each side (4 for MiniCPM-V's ``"16x"`` mode, 2 for
            ``"4x"``).
        attention_mask: ``[batch, seq]`` padding mask or ``None``.
        markers: ``{"slice_start" | "slice_end" | "image_start" | "image_end" | "newline": id}``
            (:func:`canvas_markers`); markers left out match no token.

    Returns:
        int64 ``[4, batch, seq]``: row 0 the text positions from the mask, rows 1-3 temporal,
        height and width. After the prompt every row continues from its last token's position.

    Raises:
        ValueError: video tokens (type 2), or more crops than ``target_sizes`` rows.
    """
    markers = dict(markers or {})
    marker_ids = set(markers.values())
    slice_start = markers.get("slice_start")
    batch, length = input_ids.shape
    out = torch.zeros(3, batch, length, dtype=torch.int64)
    grids = iter([(int(h), int(w)) for h, w in target_sizes.reshape(-1, 2).tolist()])

    def next_grid() -> tuple[int, int]:
        try:
            return next(grids)
        except StopIteration:
            raise ValueError("the prompt has more image crops than target_sizes rows") from None

    for b in range(batch):
        keep = (
            attention_mask[b].bool() if attention_mask is not None else torch.ones(length, dtype=torch.bool)
        )
        ids = input_ids[b][keep].tolist()
        types = mm_token_type_ids[b][keep].tolist()
        if 2 in types:
            raise ValueError(
                "canvas_mrope_position_ids handles image crops only; the prompt has video tokens"
            )
        n = len(ids)
        # crops: maximal runs of image tokens, [start, end)
        crops: list[tuple[int, int]] = []
        i = 0
        while i < n:
            if types[i] == 0:
                i += 1
                continue
            j = i
            while j < n and types[j] != 0:
                j += 1
            crops.append((i, j))
            i = j
        # frames [thumbnail, slices], grouped when only markers lie between them
        groups: list[list[list[tuple[int, int]]]] = []
        previous_end = 0
        for start, end in crops:
            if groups and slice_start is not None and ids[start - 1] == slice_start:
                groups[-1][-1].append((start, end))
            elif groups and all(t in marker_ids for t in ids[previous_end : start - 1]):
                groups[-1].append([(start, end)])
            else:
                groups.append([[(start, end)]])
            previous_end = end
        positions = torch.arange(n, dtype=torch.int64).expand(3, n).clone()
        pos = 0
        cursor = 0

        for group in groups:
            group_start = group[0][0][0] - 1
            if group_start > cursor:
                positions[:, cursor:group_start] = torch.arange(pos, pos + group_start - cursor)
                pos += group_start - cursor
            cursor = group_start
            for frame in group:
                (thumb_start, thumb_end), slices = frame[0], frame[1:]
                frame_start = thumb_start - 1
                if frame_start > cursor:
                    positions[:, cursor:frame_start] = torch.arange(pos, pos + frame_start - cursor)
                    pos += frame_start - cursor + 1
                frame_end = frame[-1][1]
                while frame_end < n and ids[frame_end] in marker_ids:
                    frame_end += 1
                origin = pos
                thumb = next_grid()
                canvas_h, canvas_w = thumb[0] // merge, thumb[1] // merge
                cols = rows = slice_h = slice_w = 0
                if slices:
                    # a gap of more than the two slice markers ends a row of slices
                    cols = next(
                        (k + 1 for k in range(len(slices) - 1) if slices[k + 1][0] - slices[k][1] > 2),
                        len(slices),
                    )
                    rows = len(slices) // cols
                    if rows * cols != len(slices):
                        rows, cols = 1, len(slices)
                    tiles = [next_grid() for _ in slices]
                    slice_h, slice_w = tiles[0][0] // merge, tiles[0][1] // merge
                    canvas_h, canvas_w = rows * slice_h, cols * slice_w
                positions[:, frame_start:frame_end] = origin
                positions[1:, frame_start] = max(origin - 1, 0)
                if thumb_end < frame_end:
                    positions[1, thumb_end] = origin + canvas_h
                    positions[2, thumb_end] = origin + canvas_w
                hh, ww = torch.meshgrid(
                    _canvas_axis(origin, canvas_h, thumb[0] // merge),
                    _canvas_axis(origin, canvas_w, thumb[1] // merge),
                    indexing="ij",
                )
                positions[1, thumb_start:thumb_end] = hh.flatten()
                positions[2, thumb_start:thumb_end] = ww.flatten()
                for k, (start, end) in enumerate(slices):
                    top, left = origin + (k // cols) * slice_h, origin + (k % cols) * slice_w
                    tile_h, tile_w = tiles[k][0] // merge, tiles[k][1] // merge
                    if start - 1 >= frame_start:
                        positions[1, start - 1], positions[2, start - 1] = top, left
                    if end < frame_end:
                        positions[1, end], positions[2, end] = top + tile_h - 1, left + tile_w - 1
                    hh, ww = torch.meshgrid(
                        torch.arange(tile_h) + top, torch.arange(tile_w) + left, indexing="ij"
                    )
                    positions[1, start:end] = hh.flatten()
                    positions[2, start:end] = ww.flatten()
                    if k + 1 < len(slices) and slices[k + 1][0] - end > 2:
                        # the row-ending gap between </slice> and the next <slice>
                        positions[1, end + 1 : slices[k + 1][0] - 1] = origin + (k // cols + 1) * slice_h - 1
                        positions[2, end + 1 : slices[k + 1][0] - 1] = origin + cols * slice_w
                pos = origin + max(canvas_h, canvas_w) + 1
                cursor = frame_end
        if cursor < n:
            positions[:, cursor:n] = torch.arange(pos, pos + n - cursor)
        out[:, b, keep] = positions
    text = _text_positions(attention_mask, batch, length, torch.device("cpu"))
    return torch.cat([text[None], out], dim=0)


def row_separated_mrope_position_ids(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    spatial_merge_size: int,
    attention_mask: torch.Tensor | None = None,
    channels: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids of a prompt with images in HunYuan-VL's layout, without the model.

    Every axis starts at the token's sequence position (padded positions skipped, 0). Inside an
    image block the last three axes are overwritten with the merged grid's column, row and the
    image's ordinal in the prompt: the vision merger ends each of the ``h`` merged rows with a
    separator token, so the grid spans ``h x (w + 1)`` tokens, optionally wrapped in a begin and
    an end token (a block of ``h * (w + 1) + 2`` tokens), which keep their sequence positions.
    Text after an image continues at its sequence position, so the decode offset is 0.

    Args:
        input_ids: int64 ``[batch, seq]``.
        mm_token_type_ids: ``[batch, seq]``: 0 for text, 1 for image tokens.
        image_grid_thw: int64 ``[num_images, 3]`` (patch grid per image, before merging), images in
            prompt order.
        spatial_merge_size: the vision encoder's merge size.
        attention_mask: ``[batch, seq]`` padding mask or ``None``.
        channels: the number of rotary axes the language model takes (at least 3).

    Returns:
        ``(position_ids, deltas)``: int64 ``[channels, batch, seq]`` and ``[batch, 1]`` (the offset
        between the largest position and the prompt length, 0 unless an image ends the prompt).

    Raises:
        ValueError: fewer than 3 channels; more image blocks than ``image_grid_thw`` rows; an image
            block whose length is neither ``h * (w + 1)`` nor that plus 2.
    """
    if channels < 3:
        raise ValueError(f"row-separated M-RoPE needs at least 3 rotary axes, got channels={channels}")
    batch, length = input_ids.shape
    device = input_ids.device
    out = torch.zeros(channels, batch, length, dtype=torch.int64, device=device)
    deltas = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    grids = iter([tuple(int(x) for x in row) for row in image_grid_thw.tolist()])
    merge = int(spatial_merge_size)
    image = 0
    for b in range(batch):
        keep = (
            attention_mask[b].bool() if attention_mask is not None else torch.ones(length, dtype=torch.bool)
        )
        types = mm_token_type_ids[b][keep].tolist()
        count = len(types)
        rows = torch.arange(count, device=device).expand(channels, count).clone()
        i = 0
        while i < count:
            j = i
            while j < count and types[j] == types[i]:
                j += 1
            if types[i] == 1:
                try:
                    _, h, w = next(grids)
                except StopIteration:
                    raise ValueError("the prompt has more image blocks than image_grid_thw rows") from None
                gh, gw = h // merge, w // merge
                tokens = gh * (gw + 1)
                if j - i not in (tokens, tokens + 2):
                    raise ValueError(
                        f"an image block of {j - i} tokens does not match its grid {h}x{w} (merge {merge} -> "
                        f"{gh} rows of {gw} tokens and a separator: {tokens}, or {tokens + 2} with begin/end)"
                    )
                start = i + (j - i - tokens) // 2
                row, column = torch.meshgrid(
                    torch.arange(gh, device=device), torch.arange(gw + 1, device=device), indexing="ij"
                )
                rows[channels - 3, start : start + tokens] = column.flatten()
                rows[channels - 2, start : start + tokens] = row.flatten()
                rows[channels - 1, start : start + tokens] = image
                image += 1
            i = j
        out[:, b, keep] = rows
        deltas[b, 0] = (int(rows.max()) + 1 if count else 0) - count
    return out, deltas
