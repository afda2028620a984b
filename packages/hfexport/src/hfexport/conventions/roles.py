"""One table of input roles: which forward kwarg carries which axes.

transformers names forward kwargs consistently across models (``input_ids`` ``[batch, seq]``,
``pixel_values`` ``[batch, channels, height, width]``, ...). This table records, per kwarg name,
what each axis of the tensor means, so that every place that needs it (second-shape validation,
batch widening, ExecuTorch bounds, decode-step merging, generation parity, input checks) derives
its key sets from one source instead of keeping its own tuple.

=========================  ========  ===============  =====  =====  ==========  =========
name                       modality  kind             rank   batch  sequence    spatial
=========================  ========  ===============  =====  =====  ==========  =========
input_ids                  text      ids              2      0      1 (text)
inputs_embeds              text      embeds           3      0      1 (text)
attention_mask             text      mask             2 (4)  0      1 (text)
token_type_ids             text      type_ids         2      0      1 (text)
position_ids               text      positions        2 (3)  0 (1)  1 (2) text
mm_token_type_ids          text      modality_types   2      0      1 (text)
moe_mm_token_type_ids      text      modality_types   2      0      1 (text)
visual_pos_masks           text      modality_types   2      0      1 (text)
cache_position             text      cache_positions  1      -      -
pixel_values               image     pixels           4 (5,3,6) 0    -           2, 3 (3, 4; -; 4, 5)
pixel_mask                 image     mask             3      0      -           1, 2
pixel_attention_mask       image     mask             2 (4)  0      -           - (2, 3)
spatial_shapes             image     patch_grid       2      0      -
image_grid_thw             image     grid             2      -      -
image_sizes                image     patch_grid       2      0      -
window_index               image     grid             1      -      -
cu_window_seqlens          image     grid             1      -      -
pixel_values_videos        video     pixels           5      0      -           3, 4
aspect_ratio_ids/_mask     image     tile_layout      2/3    0      -
cross_attention_mask       text      cross_mask       4      0      1 (text)
cross_attention_states     image     image_features   3      0      -
video_grid_thw             video     grid             2      -      -
input_features             audio     features         3      0      -
input_values               audio     signal           2 (3)  0      1 (signal) (-)
decoder_input_ids          text      ids              2 (3)  0      1 (2) decoder
decoder_inputs_embeds      text      embeds           3      0      1 (decoder)
decoder_attention_mask     text      mask             2      0      1 (decoder)
decoder_position_ids       text      positions        2      0      1 (decoder)
encoder_outputs            state     encoder_outputs  -      0
cache, past_key_values     state     cache            -      -
past_values, future_values series    values           2      0      -
past/future_time_features  series    features         3      0      -
past/future_observed_mask  series    mask             2      0      -
static_*_features          series    features         2      0      -
decoder_input_values       audio     features         3      0      1 (decoder)
bbox                       text      boxes            3      0      1 (text)
visual_feats               image     features         3      0      -
visual_pos                 image     boxes            3      0      -
classes/tasks_input_ids    text      ids              2      0      1 (queries)
classes/tasks_attn_mask    text      mask             2      0      1 (queries)
classes_structure          text      class_counts     1      0      -
task_inputs                text      ids              2      0      -
=========================  ========  ===============  =====  =====  ==========  =========

Ranks in parentheses are variants with their own axes: M-RoPE ``position_ids`` ``[3, batch,
seq]``, a 4-D ``attention_mask`` ``[batch, heads, query, key]`` (no single sequence axis),
LLaVA-NeXT ``pixel_values`` ``[batch, patches, channels, height, width]``, Mllama's tiled
``pixel_values`` ``[batch, images, tiles, channels, height, width]``, MusicGen's ``decoder_input_ids``
``[batch, codebooks, seq]``, SigLIP2's patchified
``pixel_values`` ``[batch, patches, patch_dim]`` (no image sides), Idefics3's ``pixel_attention_mask``
``[batch, images, height, width]``, AST's ``input_values`` spectrogram ``[batch, frames, mel]``
(features: the frame count is the config's ``max_length``, no sequence axis). A tensor of a higher
rank without a variant keeps the base axes (extra trailing axes); one of a lower rank has no role
(Qwen2-VL's ``pixel_values`` ``[patches, dim]`` counts patches on axis 0, not batch rows). ``input_features`` has no sequence axis: its frame axis is 2 for whisper
``[batch, mel, frames]`` and 1 for speech2text ``[batch, frames, mel]``, and whisper takes exactly
``2 * max_source_positions`` frames. ``cache_position`` counts the new tokens on axis 0 but claims
no axis: the backends bound it by their own rules.

The *sequence group* names the axes that share one length: ``text`` (encoder tokens),
``decoder`` (decoder tokens), ``signal`` (raw audio samples), ``queries`` (a detector's text
queries: a second shape keeps their length, and varies their batch with the images'). One context rule: a text
``attention_mask`` next to a raw audio input (``input_values``) masks the audio samples, so it
takes the ``signal`` group and the ``audio`` modality (:func:`input_role` with ``present``); one
next to audio features (``input_features``) with no text ids masks their frames: the ``audio``
modality and, as the features, no sequence axis.

Where the old copies disagreed: ``mm_token_type_ids`` is a ``[batch, seq]`` sequence input (the
ExecuTorch bounds and the decode merge had it; validation and batching only half did);
validation still does not invent its values, since they mark where image tokens sit.

A new input name or modality is one :func:`register_input_role` call.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "AUDIO",
    "DECODER",
    "IMAGE",
    "QUERIES",
    "SERIES",
    "SIGNAL",
    "STATE",
    "TEXT",
    "VIDEO",
    "InputRole",
    "batch_axis",
    "batch_keys",
    "input_role",
    "input_roles",
    "is_known_input",
    "modality_of",
    "names_with",
    "register_input_role",
    "sequence_axis",
    "sequence_group",
    "spatial_axes",
]

# modalities
TEXT = "text"
IMAGE = "image"
VIDEO = "video"
AUDIO = "audio"
STATE = "state"  # caches and encoder outputs: nested, their own layout
SERIES = "series"  # time-series forecasting inputs (issue 28)
# sequence groups (TEXT doubles as the encoder token group)
DECODER = "decoder"
SIGNAL = "signal"
#: a detector's text queries (OmDet-Turbo's class names and task prompts): a group of their own,
#: neither the prompt (``text``) a decode step extends nor one a second shape lengthens
QUERIES = "queries"


@dataclasses.dataclass(frozen=True)
class InputRole:
    """What the axes of one forward kwarg mean.

    Attributes:
        name: the forward kwarg name (``input_ids``).
        modality: ``text``, ``image``, ``video``, ``audio``, ``series`` (time-series forecasting)
            or ``state`` (caches, encoder outputs).
        kind: what the values are: ``ids``, ``embeds``, ``mask``, ``type_ids``, ``positions``,
            ``modality_types``, ``cache_positions``, ``pixels``, ``grid``, ``features``,
            ``signal``, ``encoder_outputs``, ``cache``, ``boxes`` (layout coordinates, repeated
            as they are at another shape), ``class_counts`` (OmDet-Turbo's classes per image:
            repeated along the batch at another shape, never generated).
        batch_axis: the axis counting batch rows, or ``None``.
        sequence_axis: the axis counting sequence positions, or ``None``.
        sequence: the sequence group of ``sequence_axis`` (``text``, ``decoder``, ``signal``):
            axes of one group have one length.
        spatial_axes: image height/width axes.
        ndim: the tensor rank these axes hold for; ``None`` for non-tensor inputs.
        primary: the input defines the size of its axes (ids, embeddings, pixels, audio), as
            opposed to masks and positions that follow it; table order is the preference order.
        variants: the same name at another rank, with its own axes.
        named_axes: other axes by what they count, ``((axis, name), ...)`` (Mllama's 6-D
            ``pixel_values``: ``((1, "images"), (2, "tiles"))``); they take no part in the batch,
            sequence or side rules, only in how an axis is described.
    """

    name: str
    modality: str
    kind: str
    batch_axis: int | None = 0
    sequence_axis: int | None = None
    sequence: str | None = None
    spatial_axes: tuple[int, ...] = ()
    ndim: int | None = None
    primary: bool = False
    variants: tuple[InputRole, ...] = ()
    named_axes: tuple[tuple[int, str], ...] = ()

    def for_rank(self, ndim: int | None) -> InputRole | None:
        """This role, or its variant, for a tensor of rank ``ndim``: the variant of that rank if
        there is one, else this role when ``ndim`` is at least its rank (extra trailing axes, e.g.
        a float ``input_ids`` ``[batch, seq, features]`` of a toy model), else ``None``.
        ``ndim=None`` returns the base role."""
        if ndim is None or self.ndim is None or self.ndim == ndim:
            return self
        for variant in self.variants:
            if variant.ndim == ndim:
                return variant
        return self if ndim > self.ndim else None

    def axes(self) -> dict[int, str]:
        """``{axis: "batch" | "sequence" | "spatial"}`` for the axes this role names."""
        out: dict[int, str] = {}
        if self.batch_axis is not None:
            out[self.batch_axis] = "batch"
        if self.sequence_axis is not None:
            out[self.sequence_axis] = "sequence"
        for axis in self.spatial_axes:
            out[axis] = "spatial"
        return out

    def axis_name(self, axis: int) -> str | None:
        """What ``axis`` counts by :attr:`named_axes` (``"images"``, ``"tiles"``), or ``None``."""
        return dict(self.named_axes).get(axis)


def _variant(base: InputRole, **changes: Any) -> InputRole:
    return dataclasses.replace(base, variants=(), **changes)


def _text(name: str, kind: str, ndim: int = 2, *, sequence: str = TEXT, primary: bool = False) -> InputRole:
    return InputRole(name, TEXT, kind, 0, 1, sequence, (), ndim, primary)


def _builtin_roles() -> list[InputRole]:
    position_ids = _text("position_ids", "positions")
    position_ids = dataclasses.replace(
        position_ids, variants=(_variant(position_ids, ndim=3, batch_axis=1, sequence_axis=2),)
    )
    attention_mask = _text("attention_mask", "mask")
    attention_mask = dataclasses.replace(
        attention_mask, variants=(_variant(attention_mask, ndim=4, sequence_axis=None, sequence=None),)
    )
    pixel_values = InputRole("pixel_values", IMAGE, "pixels", 0, None, None, (2, 3), 4, primary=True)
    pixel_values = dataclasses.replace(
        pixel_values,
        variants=(
            _variant(pixel_values, ndim=5, spatial_axes=(3, 4)),
            # NaViT-style patches (SigLIP2): [batch, patches, channels * patch * patch], no sides
            _variant(pixel_values, ndim=3, spatial_axes=()),
            # Mllama's tiled images [batch, images, tiles, channels, tile height, tile width]
            # (issue 28): every tile is resized to the model's tile size
            _variant(pixel_values, ndim=6, spatial_axes=(4, 5), named_axes=((1, "images"), (2, "tiles"))),
        ),
    )
    # the patches' mask: SigLIP2 [batch, patches]; Idefics3 / SmolVLM [batch, images, height, width]
    pixel_attention_mask = InputRole("pixel_attention_mask", IMAGE, "mask", 0, None, None, (), 2)
    pixel_attention_mask = dataclasses.replace(
        pixel_attention_mask, variants=(_variant(pixel_attention_mask, ndim=4, spatial_axes=(2, 3)),)
    )
    # MusicGen's audio codes per codebook [batch, codebooks, seq] (issue 28): the decoder reshapes
    # its [batch * codebooks, seq] ids to this form, which keeps the batch on axis 0
    decoder_input_ids = _text("decoder_input_ids", "ids", sequence=DECODER, primary=True)
    decoder_input_ids = dataclasses.replace(
        decoder_input_ids, variants=(_variant(decoder_input_ids, ndim=3, sequence_axis=2),)
    )
    # raw audio [batch, samples]; the Audio Spectrogram Transformer's (AST) spectrogram [batch, frames,
    # mel bins] under the same name: features whose frame count is the config's max_length (its
    # position table is sized for it), so, like input_features, no sequence axis (issue 28)
    input_values = InputRole("input_values", AUDIO, "signal", 0, 1, SIGNAL, (), 2, primary=True)
    input_values = dataclasses.replace(
        input_values,
        variants=(_variant(input_values, ndim=3, kind="features", sequence_axis=None, sequence=None),),
    )
    # Order matters: primary inputs come first, in the order that picks the batch size.
    return [
        _text("input_ids", "ids", primary=True),
        _text("inputs_embeds", "embeds", 3, primary=True),
        InputRole("input_features", AUDIO, "features", 0, None, None, (), 3, primary=True),
        input_values,
        pixel_values,
        decoder_input_ids,
        _text("decoder_inputs_embeds", "embeds", 3, sequence=DECODER, primary=True),
        attention_mask,
        _text("token_type_ids", "type_ids"),
        position_ids,
        _text("mm_token_type_ids", "modality_types"),
        _text("moe_mm_token_type_ids", "modality_types"),
        # Qwen3-VL's DeepStack: where the image tokens sit, bool [batch, seq] (issue 28)
        _text("visual_pos_masks", "modality_types"),
        InputRole("cache_position", TEXT, "cache_positions", None, None, None, (), 1),
        # InstructBLIP's Q-Former instruction [batch, instruction length] (issue 28): a text of its
        # own, read by the image features only, whose length varies apart from the prompt's
        InputRole("qformer_input_ids", TEXT, "ids", 0, 1, QUERIES, (), 2),
        InputRole("qformer_attention_mask", TEXT, "mask", 0, 1, QUERIES, (), 2),
        _text("decoder_attention_mask", "mask", sequence=DECODER),
        _text("decoder_position_ids", "positions", sequence=DECODER),
        InputRole("pixel_mask", IMAGE, "mask", 0, None, None, (1, 2), 3),
        pixel_attention_mask,
        # SigLIP2's patch grid per image [batch, (rows, columns)]: values, repeated with the batch
        InputRole("spatial_shapes", IMAGE, "patch_grid", 0, None, None, (), 2),
        InputRole("image_grid_thw", IMAGE, "grid", None, None, None, (), 2),
        # each image's (height, width) in pixels [images, 2] (LLaVA-NeXT's anyres tiling, Pixtral;
        # issue 28): values, repeated with the images at another shape
        InputRole("image_sizes", IMAGE, "patch_grid", 0, None, None, (), 2),
        # a windowed Qwen2.5-VL vision encoder's window permutation [merged patches] and window
        # boundaries [windows + 1], precomputed from grid_thw (hfexport.generation.vision_inputs;
        # issue 28): values derived from the grid, as the grid itself
        InputRole("window_index", IMAGE, "grid", None, None, None, (), 1),
        InputRole("cu_window_seqlens", IMAGE, "grid", None, None, None, (), 1),
        InputRole("pixel_values_videos", VIDEO, "pixels", 0, None, None, (3, 4), 5),
        # Mllama's tile layout of each image (issue 28): aspect_ratio_ids [batch, images] (which of
        # the supported tile arrangements) and aspect_ratio_mask [batch, images, tiles] (1 on the
        # image's real tiles): values, repeated with the batch at another shape
        InputRole(
            "aspect_ratio_ids", IMAGE, "tile_layout", 0, None, None, (), 2, named_axes=((1, "images"),)
        ),
        InputRole(
            "aspect_ratio_mask",
            IMAGE,
            "tile_layout",
            0,
            None,
            None,
            (),
            3,
            named_axes=((1, "images"), (2, "tiles")),
        ),
        # which image tiles each prompt token cross-attends to, [batch, seq, images, tiles] (Mllama;
        # issue 28): token-aligned, so its length is the prompt's; a decode step takes its last row
        InputRole(
            "cross_attention_mask",
            TEXT,
            "cross_mask",
            0,
            1,
            TEXT,
            (),
            4,
            named_axes=((2, "images"), (3, "tiles")),
        ),
        # the projected image features a cross-attending language model reads (Mllama's
        # cross_attention_states, [batch, images, tiles, patches, hidden] or [batch, image tokens,
        # hidden]; issue 28): one row per prompt, their token count the vision tower's
        InputRole("cross_attention_states", IMAGE, "image_features", 0, None, None, (), 3),
        # DeepSeek-VL hybrid's second view of each image, for its high-resolution SAM tower
        # [images, channels, height, width] (issue 28): images as pixel_values, sides the tower's
        InputRole("high_res_pixel_values", IMAGE, "pixels", 0, None, None, (2, 3), 4),
        InputRole("video_grid_thw", VIDEO, "grid", None, None, None, (), 2),
        InputRole("encoder_outputs", STATE, "encoder_outputs", 0, None, None, (), None),
        InputRole("cache", STATE, "cache", None, None, None, (), None),
        InputRole("past_key_values", STATE, "cache", None, None, None, (), None),
        # time-series forecasters (issue 28): the batch varies; the time axis is the config's
        # context (plus lags) or horizon length, fixed by the model, so it claims no sequence axis
        InputRole("past_values", SERIES, "values", 0, None, None, (), 2, primary=True),
        InputRole("past_time_features", SERIES, "features", 0, None, None, (), 3),
        InputRole("past_observed_mask", SERIES, "mask", 0, None, None, (), 2),
        InputRole("future_values", SERIES, "values", 0, None, None, (), 2),
        InputRole("future_time_features", SERIES, "features", 0, None, None, (), 3),
        InputRole("future_observed_mask", SERIES, "mask", 0, None, None, (), 2),
        InputRole("static_categorical_features", SERIES, "features", 0, None, None, (), 2),
        InputRole("static_real_features", SERIES, "features", 0, None, None, (), 2),
        # speecht5's teacher-forced spectrogram frames [batch, frames, mel bins] (issue 28)
        InputRole("decoder_input_values", AUDIO, "features", 0, 1, DECODER, (), 3, primary=True),
        # document layout models (LayoutLM, LayoutLMv3, LiLT, BROS; issue 28): one box per token
        # [batch, seq, 4] (BROS also [batch, seq, 8], its quadrilaterals); values are coordinates,
        # so a second shape repeats the sample's boxes
        _text("bbox", "boxes", 3),
        # LXMERT's detected regions [batch, regions, features] and their boxes [batch, regions, 4]
        # (issue 28): the region count is the detector's, so it claims no sequence axis
        InputRole("visual_feats", IMAGE, "features", 0, None, None, (), 3),
        InputRole("visual_pos", IMAGE, "boxes", 0, None, None, (), 3),
        # OmDet-Turbo's zero-shot queries (issue 28): class names and a task prompt per image, and
        # the number of classes of each image (values, repeated with the batch)
        _text("classes_input_ids", "ids", sequence=QUERIES),
        _text("classes_attention_mask", "mask", sequence=QUERIES),
        _text("tasks_input_ids", "ids", sequence=QUERIES),
        _text("tasks_attention_mask", "mask", sequence=QUERIES),
        InputRole("classes_structure", TEXT, "class_counts", 0, None, None, (), 1),
        # OneFormer's task prompt ("the task is semantic") [batch, task_seq_len] token ids (issue 28):
        # read as one float vector by an MLP of task_seq_len inputs, so its length is the model's
        InputRole("task_inputs", TEXT, "ids", 0, None, None, (), 2),
    ]


_ROLES: dict[str, InputRole] = {role.name: role for role in _builtin_roles()}


def register_input_role(role: InputRole, *, replace: bool = False) -> InputRole:
    """Add a forward kwarg to the table (a new modality is one call).

    Args:
        role: the :class:`InputRole`; its axes must lie inside ``ndim`` when ``ndim`` is given.
        replace: allow replacing an existing entry of the same name.

    Returns:
        ``role``.

    Raises:
        ValueError: the name is already in the table and ``replace`` is false, or an axis is out
            of range for ``ndim``.
    """
    if not isinstance(role, InputRole):
        raise TypeError(f"register_input_role takes an InputRole, got {type(role).__name__}")
    if role.name in _ROLES and not replace and _ROLES[role.name] != role:
        raise ValueError(f"an input role named {role.name!r} is already registered; pass replace=True")
    for r in (role, *role.variants):
        if r.ndim is not None and any(not 0 <= axis < r.ndim for axis in r.axes()):
            raise ValueError(f"input role {r.name!r}: axes {sorted(r.axes())} do not fit rank {r.ndim}")
    _ROLES[role.name] = role
    return role


def input_roles() -> Mapping[str, InputRole]:
    """A read-only view of the table, in table order."""
    return types.MappingProxyType(_ROLES)


def is_known_input(name: str) -> bool:
    """True when ``name`` has an entry in the table."""
    return name in _ROLES


def _present_names(present: Iterable[str] | Mapping[str, Any] | None) -> set[str]:
    if present is None:
        return set()
    if isinstance(present, Mapping):
        return {k for k, v in present.items() if v is not None}
    return set(present)


def input_role(
    name: str, ndim: int | None = None, *, present: Iterable[str] | Mapping[str, Any] | None = None
) -> InputRole | None:
    """The role of forward kwarg ``name``.

    Args:
        name: the kwarg name.
        ndim: the tensor's rank; a rank the role does not list gives ``None``.
        present: the other kwargs of the call (names, or the kwargs dict: ``None`` values count as
            absent), for the context rules: a text mask next to a raw audio input takes the
            ``signal`` group and the ``audio`` modality; next to ``input_features`` (and no
            ``input_ids`` / ``inputs_embeds``) the ``audio`` modality and no sequence axis.

    Returns:
        The :class:`InputRole`, or ``None`` for a name not in the table (or a rank it lacks).
    """
    role = _ROLES.get(name)
    if role is None:
        return None
    role = role.for_rank(ndim)
    if role is None:
        return None
    if role.kind == "mask" and role.sequence == TEXT and present is not None:
        names = _present_names(present)
        if any(_ROLES[k].sequence == SIGNAL for k in names if k in _ROLES and k != name):
            role = dataclasses.replace(role, modality=AUDIO, sequence=SIGNAL)
        elif "input_features" in names and not names & {"input_ids", "inputs_embeds"}:
            # the mask of audio features (Wav2Vec2-BERT: [batch, frames]) follows their frames,
            # which have no sequence group: it changes with the batch only, as they do
            role = dataclasses.replace(role, modality=AUDIO, sequence=None, sequence_axis=None)
    return role


def batch_axis(name: str, ndim: int | None = None) -> int | None:
    """The batch axis of ``name`` (at rank ``ndim``), or ``None``."""
    role = input_role(name, ndim)
    return role.batch_axis if role is not None else None


def sequence_axis(name: str, ndim: int | None = None) -> int | None:
    """The sequence axis of ``name`` (at rank ``ndim``), or ``None``."""
    role = input_role(name, ndim)
    return role.sequence_axis if role is not None else None


def sequence_group(
    name: str, ndim: int | None = None, *, present: Iterable[str] | Mapping[str, Any] | None = None
) -> str | None:
    """The sequence group (``text``, ``decoder``, ``signal``) of ``name``'s sequence axis, or ``None``."""
    role = input_role(name, ndim, present=present)
    return role.sequence if role is not None and role.sequence_axis is not None else None


def spatial_axes(name: str, ndim: int | None = None) -> tuple[int, ...]:
    """The spatial (height, width) axes of ``name`` (at rank ``ndim``); ``()`` when none."""
    role = input_role(name, ndim)
    return role.spatial_axes if role is not None else ()


def modality_of(name: str) -> str | None:
    """The modality of ``name`` (``text``, ``image``, ``video``, ``audio``, ``state``), or ``None``."""
    role = _ROLES.get(name)
    return role.modality if role is not None else None


def names_with(
    *,
    modality: str | Iterable[str] | None = None,
    kind: str | Iterable[str] | None = None,
    sequence: str | Iterable[str] | None = None,
    has_batch: bool | None = None,
    primary: bool | None = None,
) -> tuple[str, ...]:
    """Kwarg names whose base role matches every given filter, in table order.

    Each filter is one value or several (any of them matches); ``None`` does not filter.
    """

    def match(value: Any, wanted: str | Iterable[str] | None) -> bool:
        if wanted is None:
            return True
        return value == wanted if isinstance(wanted, str) else value in tuple(wanted)

    return tuple(
        role.name
        for role in _ROLES.values()
        if match(role.modality, modality)
        and match(role.kind, kind)
        and match(role.sequence, sequence)
        and (has_batch is None or (role.batch_axis is not None) == has_batch)
        and (primary is None or role.primary == primary)
    )


def batch_keys() -> tuple[str, ...]:
    """Kwargs whose axis 0 is the batch (at their base rank), in table order."""
    return tuple(role.name for role in _ROLES.values() if role.batch_axis == 0)
