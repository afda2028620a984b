"""Capture workarounds of the object detectors (key ``"capture.detection"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for the capture, but only when the captured
module holds a module of one of :data:`DETECTOR_MODULES` (:func:`capture_key`), and puts the
original back afterwards (also when the capture fails); the eager model the exporter validates
against runs the original code.

- :func:`omdet_language_embedding_batched`: OmDet-Turbo embeds its class names and task prompts
  through a least-recently-used cache keyed by each row's token ids (``input_ids[mask !=
  0].tolist()``), regroups the class embeddings per image with a Python loop over the values of
  ``classes_structure`` and cuts the task prompts to the longest one (``mask.sum(1).max().item()``):
  all data-dependent, which ``torch.export`` cannot trace. The patch embeds every row at once, with
  the same number of classes per image.
- :func:`omdet_anchors_uncached`: OmDet-Turbo's decoder memoizes its anchor grid with
  ``functools.lru_cache`` keyed by the feature maps' ``(height, width)``; with dynamic image sides
  those are symbolic ints, which cannot be hashed (``TypeError: unhashable type: non-nested
  SymInt``). The patch computes the grid on every call.
- :func:`omdet_query_selection_symbolic_batch`: its query selection takes the batch size as
  ``len(vision_features)``, which ``torch.export`` specialises to the sample's batch; the patch
  reads the symbolic ``shape[0]`` and gathers the top-k anchors per image.
- :func:`rt_detr_batch_from_shape`: the RT-DETR family's model forward (rt_detr, rt_detr_v2,
  d_fine, deimv2, pp_doclayout_v2/v3) takes its batch size as ``len(source_flatten)``, which
  specialises the batch the same way (``Guard failed: pixel_values.size()[0] == 2``); the patch
  runs the forward with a module-level ``len`` that gives a tensor's symbolic ``shape[0]``.
- :func:`take_along_dim_as_gather`: PP-DocLayout's head sorts its queries with
  ``torch.take_along_dim``, whose broadcast of the indices against the input guards the batch to
  the sample's; with indices of the input's shape it is a ``gather``, which the patch calls.
- :func:`argsort_with_tie_break`: PP-DocLayout-V2 puts its kept queries first by sorting a boolean
  mask, all ties; the patch sorts integer keys with a positional tie-break (a stable sort), so
  every runtime gives the same order.
- :func:`grounding_phrase_masks_without_cumulative_extrema`: Grounding DINO and MM Grounding DINO
  build the text self-attention mask and position ids of each phrase (tokens between special
  tokens) with ``torch.cummax`` / ``torch.cummin`` and ``torch.isin``, which neither ONNX's
  translation (``aten::cummax``/``cummin`` "not yet supported") nor OpenVINO's FX frontend has.
  The patch finds each token's nearest special token before and after it with a masked max/min
  over the ``[length, length]`` token pairs (the text is short: queries, not documents).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "CAPTURE",
    "DETECTOR_MODULES",
    "GROUNDING_MASK_TARGETS",
    "KEY",
    "OMDET_ANCHOR_TARGETS",
    "OMDET_LANGUAGE_TARGETS",
    "OMDET_QUERY_TARGETS",
    "RT_DETR_FORWARD_TARGETS",
    "argsort_with_tie_break",
    "capture_key",
    "grounding_phrase_masks",
    "grounding_phrase_masks_without_cumulative_extrema",
    "omdet_anchors_uncached",
    "omdet_language_embedding_batched",
    "omdet_query_selection_symbolic_batch",
    "rt_detr_batch_from_shape",
    "stable_integer_argsort",
    "symbolic_len",
    "take_along_dim_as_gather",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.detection"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
DETECTOR_MODULES: tuple[str, ...] = (
    "transformers.models.omdet_turbo.modeling_omdet_turbo",
    *(
        f"transformers.models.{name}.modeling_{name}"
        for name in ("rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v2", "pp_doclayout_v3")
    ),
    "transformers.models.grounding_dino.modeling_grounding_dino",
    "transformers.models.mm_grounding_dino.modeling_mm_grounding_dino",
)


def capture_key(module: torch.nn.Module) -> str | None:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.detection"``: the ``"capture"`` entries and this module's) when
        ``module`` or one of its submodules is defined in one of :data:`DETECTOR_MODULES`;
        ``None`` otherwise (the caller picks another key), so other models' reports do not list
        these patches.
    """
    return KEY if holds_module_from(module, DETECTOR_MODULES) else None


# --------------------------------------------------------------------------------------------
# OmDet-Turbo: class and task embeddings without the token-keyed cache
# --------------------------------------------------------------------------------------------

#: the method embedding OmDet-Turbo's class names and task prompts (through its caches)
OMDET_LANGUAGE_TARGETS: tuple[str, ...] = (
    "transformers.models.omdet_turbo.modeling_omdet_turbo.OmDetTurboPreTrainedModel.get_language_embedding",
)


@register_patch(
    BACKEND,
    *OMDET_LANGUAGE_TARGETS,
    description=(
        "omdet-turbo: class names and task prompts embedded as one batch each (no cache keyed by token ids "
        "via .tolist(), no Python regrouping over classes_structure values, no .item() cut of the prompts), "
        "the same number of classes per image"
    ),
    # the language cache (OmDetTurboLRUCache) keys on input_ids[...].tolist(); no transformers issue
    # filed for exporting it; torch.export's side: data-dependent Tensor.tolist (open)
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.23,<6"},
)
def omdet_language_embedding_batched(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``OmDetTurboPreTrainedModel.get_language_embedding`` while capturing.

    transformers' method runs each class-name row and task-prompt row through an LRU cache keyed by
    the row's unmasked token ids (a Python tuple from ``.tolist()``), pads each image's classes to
    the largest count in ``classes_structure`` with a loop over that tensor's values, and cuts the
    prompts to the longest unmasked length (``.item()``); ``torch.export`` can trace none of it
    (the values of inputs decide the Python control flow and the output shapes).

    The replacement computes the same embeddings without the cache (which only stores what the
    language tower computes):

    * class embeddings: the tower's ``"class"`` encoding of every row of ``classes_input_ids``
      ``[b * c, s]`` at once, regrouped ``[c, b, class_embed_dim]`` by reshaping: image ``i``'s
      classes are rows ``i * c .. i * c + c - 1``, the processor's layout when every image has ``c``
      classes (``c = classes_input_ids.shape[0] // b``, ``b = classes_structure.shape[0]``);
    * task embeddings: the text tower's hidden states of ``tasks_input_ids`` ``[b, s]`` as
      ``[s, b, hidden]`` with ``tasks_attention_mask`` unchanged as the mask. Eager cuts both to
      the longest prompt; the masked tail positions here are excluded as keys by the decoder's
      padding mask. With unpadded prompts (all-ones mask) the two are the same computation.

    Images with different class counts (``classes_structure`` not all ``c``) are outside what the
    captured program computes: the program asserts equal counts at run time
    (``torch._assert_async``), on the runtimes that keep assertions.

    Raises:
        RuntimeError: (at run time of the eager-patched call) ``classes_input_ids`` has a row count
            that is not a multiple of the image count.
    """

    @functools.wraps(original)
    def get_language_embedding(
        self: Any,
        classes_input_ids: torch.Tensor,
        classes_attention_mask: torch.Tensor,
        tasks_input_ids: torch.Tensor,
        tasks_attention_mask: torch.Tensor,
        classes_structure: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images = classes_structure.shape[0]
        rows = classes_input_ids.shape[0]
        torch._check(rows % images == 0, lambda: f"{rows} class rows for {images} images")
        per_image = rows // images
        torch._assert_async(
            torch.all(classes_structure == per_image),
            "omdet-turbo export: every image must have the same number of classes",
        )
        backbone = self.language_backbone
        classes = backbone(classes_input_ids, encode_type="class")  # [b * c, class_embed_dim]
        classes = classes.reshape(images, per_image, classes.shape[-1]).transpose(0, 1)
        tasks = backbone.model(tasks_input_ids)[0]  # [b, s, hidden]
        return classes, tasks.transpose(0, 1), tasks_attention_mask

    return get_language_embedding


# --------------------------------------------------------------------------------------------
# OmDet-Turbo: anchors without the lru_cache
# --------------------------------------------------------------------------------------------

#: the decoder method building the anchor grid (wrapped in ``functools.lru_cache`` upstream)
OMDET_ANCHOR_TARGETS: tuple[str, ...] = (
    "transformers.models.omdet_turbo.modeling_omdet_turbo.OmDetTurboDecoder.generate_anchors",
)


@register_patch(
    BACKEND,
    *OMDET_ANCHOR_TARGETS,
    description=(
        "omdet-turbo: the decoder's anchor grid computed on every call instead of through functools.lru_cache, "
        "whose key (the feature maps' heights and widths) holds unhashable symbolic ints under dynamic image sides"
    ),
    # SymInt.__hash__ refuses non-constant symbols (torch 2.13 still); rt_detr's copy of this method uses
    # transformers' export-aware cache, omdet-turbo's the plain functools one
    issue="https://github.com/pytorch/pytorch/issues/135099",
    versions={"transformers": ">=5.23,<6"},
)
def omdet_anchors_uncached(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``OmDetTurboDecoder.generate_anchors`` by the function ``lru_cache`` wraps.

    The anchors are a pure function of the feature-map sizes (a grid of cell centres and sizes per
    level, in logit space, with ``inf`` outside the valid range), so computing them on every call
    gives the cached values; while ``torch.export`` traces, the grid becomes part of the program,
    following the symbolic image sides.

    Returns:
        ``original.__wrapped__`` (the undecorated method); ``original`` itself when it is not a
        ``functools`` cache wrapper (a transformers version without the cache).
    """
    return getattr(original, "__wrapped__", original)


# --------------------------------------------------------------------------------------------
# OmDet-Turbo: query selection on a symbolic batch
# --------------------------------------------------------------------------------------------

#: the decoder method selecting the top-scoring anchors as queries (reads ``len(vision_features)``)
OMDET_QUERY_TARGETS: tuple[str, ...] = (
    "transformers.models.omdet_turbo.modeling_omdet_turbo.OmDetTurboDecoder._get_decoder_input",
)


def _take_rows(values: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """``values[i, picked[i, j], :]`` for every batch row ``i`` and pick ``j``: ``[b, n, d]`` from
    ``values`` ``[b, m, d]`` and ``picked`` ``[b, n]`` int64 (a ``gather`` on axis 1)."""
    return values.gather(1, picked.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


@register_patch(
    BACKEND,
    *OMDET_QUERY_TARGETS,
    description=(
        "omdet-turbo: the decoder's query selection reads the batch from vision_features.shape[0] and gathers "
        "the top-k anchors per image, instead of len(vision_features), which specialises the batch to the sample's"
    ),
    # len() of a tensor must return a Python int, so the symbolic batch is guarded to its sample value;
    # no upstream issue filed (the method's first line at transformers 5.24)
    issue=(
        "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/omdet_turbo/"
        "modeling_omdet_turbo.py"
    ),
    versions={"transformers": ">=5.23,<6"},
)
def omdet_query_selection_symbolic_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``OmDetTurboDecoder._get_decoder_input`` (the two-stage query selection).

    Upstream takes the batch size as ``len(vision_features)``; Python's ``len`` needs an int, so
    ``torch.export`` guards the batch to the sample's (``Eq(s, 2)``) and the program refuses any
    other batch. The replacement computes the same selection with the batch left symbolic:

    * features outside the valid anchors zeroed, projected (``encoder_vision_features``), scored
      against the projected class embeddings (``get_class_similarity``), boxes regressed onto the
      anchors (``encoder_bbox_head(...) + anchors``);
    * the ``num_queries`` best-scoring positions per image (top-k of the per-position maximum
      class score) taken with ``gather`` along the position axis (upstream: advanced indexing with
      a flattened batch index), for the reference boxes, the class scores and, unless the model
      learns its initial queries, the query embeddings.

    Shapes: ``vision_features`` ``[b, positions, d]``; returns the query embeddings ``[b,
    num_queries, d]``, reference boxes (logits) ``[b, num_queries, 4]``, their sigmoid, the class
    scores ``[b, num_queries, classes]`` and the anchors ``[1, positions, 4]``, as upstream (with
    denoising queries, when given, in front).
    """
    from transformers.models.omdet_turbo import modeling_omdet_turbo as omdet

    @functools.wraps(original)
    def _get_decoder_input(
        self: Any,
        vision_features: torch.Tensor,
        vision_shapes: Any,
        class_features: torch.Tensor,
        denoise_embeddings: torch.Tensor | None = None,
        denoise_bboxes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        batch = vision_features.shape[0]
        anchors, valid = self.generate_anchors(
            vision_shapes, device=vision_features.device, dtype=vision_features.dtype
        )
        zero = torch.zeros((), dtype=vision_features.dtype, device=vision_features.device)
        features = self.encoder_vision_features(torch.where(valid, vision_features, zero))
        classes = self.encoder_class_head(class_features).permute(1, 2, 0)
        scores = omdet.get_class_similarity(self.class_distance_type, features, classes)
        boxes = self.encoder_bbox_head(features) + anchors
        best = torch.topk(scores.max(-1).values, self.num_queries, dim=1).indices  # [b, num_queries]
        reference = _take_rows(boxes, best)
        encoder_boxes = reference.sigmoid()
        if denoise_bboxes is not None:
            reference = torch.cat([denoise_bboxes, reference], 1)
        if self.training:
            reference = reference.detach()
        picked_scores = _take_rows(scores, best)
        if self.learn_initial_query:
            queries = self.tgt_embed.weight.unsqueeze(0).repeat(batch, 1, 1)
        else:
            queries = _take_rows(features, best)
            if self.training:
                queries = queries.detach()
        if denoise_embeddings is not None:
            queries = torch.cat([denoise_embeddings, queries], 1)
        return queries, reference, encoder_boxes, picked_scores, anchors

    return _get_decoder_input


# --------------------------------------------------------------------------------------------
# RT-DETR family: the batch size from the symbolic shape
# --------------------------------------------------------------------------------------------

#: the model forwards reading their batch size as ``len(source_flatten)``
RT_DETR_FORWARD_TARGETS: tuple[str, ...] = tuple(
    f"transformers.models.{module}.modeling_{module}.{cls}.forward"
    for module, cls in (
        ("rt_detr", "RTDetrModel"),
        ("rt_detr_v2", "RTDetrV2Model"),
        ("d_fine", "DFineModel"),
        ("deimv2", "Deimv2Model"),
        ("pp_doclayout_v2", "PPDocLayoutV2Model"),
        ("pp_doclayout_v3", "PPDocLayoutV3Model"),
    )
)


def symbolic_len(obj: Any) -> Any:
    """``len(obj)``, except for a tensor of rank >= 1: its ``shape[0]`` as is (a ``SymInt`` for a
    dynamic axis while ``torch.export`` traces), where the builtin would force a Python int and so
    guard the axis to its sample size.

    Raises:
        TypeError: ``obj`` has no length (as the builtin), a 0-d tensor included.
    """
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        return obj.shape[0]
    return len(obj)


@register_patch(
    BACKEND,
    *RT_DETR_FORWARD_TARGETS,
    description=(
        "rt_detr family (rt_detr, rt_detr_v2, d_fine, deimv2, pp_doclayout_v2/v3): the model forward runs with a "
        "module-level len giving a tensor's symbolic shape[0], so batch_size = len(source_flatten) keeps the "
        "batch dynamic instead of guarding it to the sample's"
    ),
    # len() must return a Python int, so torch.export guards the symbolic batch (no upstream issue filed; the
    # line at transformers 5.24)
    issue=(
        "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/rt_detr/"
        "modeling_rt_detr.py"
    ),
    versions={"transformers": ">=5.23,<6"},
)
def rt_detr_batch_from_shape(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the RT-DETR family's ``Model.forward`` so that ``len`` in its modeling module is
    :func:`symbolic_len` for the duration of the call.

    The forward flattens the feature maps into ``source_flatten`` ``[batch, positions, d_model]``
    and takes ``batch_size = len(source_flatten)`` for the anchor and query selection; the builtin
    turns the symbolic batch into an int and ``torch.export`` pins it (the program refuses any
    other batch). Name lookup in the module's code finds a module global ``len`` before the
    builtin, so the wrapper sets one (and removes it afterwards, also when the forward raises);
    every other ``len`` call of the module (lists, tuples, config values) behaves as the builtin.
    """
    # the forward under transformers' decorators (can_return_tuple, ...): its own module's globals
    namespace = inspect.unwrap(original).__globals__

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        had = "len" in namespace
        previous = namespace.get("len")
        namespace["len"] = symbolic_len
        try:
            return original(*args, **kwargs)
        finally:
            if had:
                namespace["len"] = previous
            else:
                namespace.pop("len", None)

    return forward


# --------------------------------------------------------------------------------------------
# take_along_dim without the broadcast (PP-DocLayout's query sort)
# --------------------------------------------------------------------------------------------


@register_patch(
    BACKEND,
    "torch.take_along_dim",
    description=(
        "detectors (pp_doclayout's query sort): torch.take_along_dim with indices of the input's shape runs as "
        "gather, whose trace keeps the batch symbolic (the broadcast check of take_along_dim pinned it to the sample's)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/140011",
    versions={"torch": ">=2.12"},
)
def take_along_dim_as_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.take_along_dim`` while a detector is captured (key ``capture.detection``).

    ``take_along_dim(x, indices, dim)`` broadcasts ``indices`` against ``x`` (all axes but
    ``dim``) before gathering; under ``torch.export`` that broadcast check of two equal symbolic
    batches guards the batch to its sample value (PP-DocLayout v2/v3 sort their queries by score
    with ``argsort`` + ``take_along_dim``: ``Guard failed: pixel_values.size()[0] == 2``). When
    ``indices`` has the rank of ``x`` and provably the same size on every other axis, the result is
    ``x.gather(dim, indices)``: same values, no broadcast. Any other call (no ``dim``, a rank or
    size that needs broadcasting, or sizes not known equal without a guard) runs the original.
    """
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    @functools.wraps(original)
    def take_along_dim(
        input: torch.Tensor, indices: torch.Tensor, dim: int | None = None, **kwargs: Any
    ) -> Any:
        if dim is None or kwargs or input.dim() != indices.dim():
            return original(input, indices, dim, **kwargs)
        axis = dim % input.dim()
        same = all(
            guard_or_false(a == b) for i, (a, b) in enumerate(zip(input.shape, indices.shape)) if i != axis
        )
        if not same:
            return original(input, indices, dim)
        return input.gather(axis, indices)

    return take_along_dim


# --------------------------------------------------------------------------------------------
# argsort of integer keys with a tie-break (PP-DocLayout's kept-queries-first sort)
# --------------------------------------------------------------------------------------------


def stable_integer_argsort(input: torch.Tensor, dim: int = -1, descending: bool = False) -> torch.Tensor:
    """``torch.argsort(input, dim, descending, stable=True)`` for an integer or boolean ``input``,
    computed as a plain sort of unique keys: ``input * n + position`` (``n - 1 - position`` when
    descending), ``n`` the size of ``dim``, so equal values keep their original order whichever
    sort a runtime implements.

    Shapes: ``input`` any shape; returns int64 indices of the same shape.

    Raises:
        ValueError: ``input`` is a floating-point or complex tensor (its ties are not exact; use
            ``torch.argsort``).
    """
    if input.is_floating_point() or input.is_complex():
        raise ValueError(f"stable_integer_argsort takes integer or boolean keys, got {input.dtype}")
    axis = dim % input.dim()
    n = input.shape[axis]
    shape = [1] * input.dim()
    shape[axis] = n
    position = torch.arange(n, device=input.device, dtype=torch.int64).reshape(shape)
    tie_break = (n - 1 - position) if descending else position
    keys = input.to(torch.int64) * n + tie_break
    return torch.sort(keys, dim=axis, descending=descending).indices  # not argsort: the patch replaces it


@register_patch(
    BACKEND,
    "torch.argsort",
    description=(
        "detectors (pp_doclayout_v2's kept-queries-first sort of a boolean mask): torch.argsort of integer or "
        "boolean keys sorts with a positional tie-break (a stable sort), so every runtime orders the tied "
        "queries alike instead of each sort implementation picking its own order"
    ),
    # an unstable sort's order among equal keys is unspecified (torch.sort docs); ONNX TopK and OpenVINO's
    # sort break ties their own way; the call at transformers 5.24
    issue=(
        "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/pp_doclayout_v2/"
        "modeling_pp_doclayout_v2.py"
    ),
    versions={"transformers": ">=5.23,<6"},
)
def argsort_with_tie_break(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.argsort`` while a detector is captured (key ``capture.detection``).

    PP-DocLayout-V2 puts the queries that pass their class threshold first with
    ``torch.argsort(mask.int(), dim=1, descending=True)``: every key is 0 or 1, so the order among
    the queries of each group is whatever the sort implementation does with ties (PyTorch's CPU sort
    keeps the original order for 16 or fewer elements and not beyond; OpenVINO's sort gave another
    order: the tiny model's ``logits``/``pred_boxes`` came back permuted). Integer and boolean keys
    are sorted by :func:`stable_integer_argsort` (the original order among ties: what eager gives
    at the tiny model's 10 queries, and a defined order at any size); floating-point keys, and calls
    with ``stable=`` given, run the original.
    """

    @functools.wraps(original)
    def argsort(input: torch.Tensor, dim: int = -1, descending: bool = False, **kwargs: Any) -> Any:
        if kwargs or input.is_floating_point() or input.is_complex() or input.dim() == 0:
            return original(input, dim=dim, descending=descending, **kwargs)
        return stable_integer_argsort(input, dim, descending)

    return argsort


# --------------------------------------------------------------------------------------------
# Grounding DINO: phrase masks without cumulative max/min
# --------------------------------------------------------------------------------------------

#: the module-level functions building Grounding DINO's phrase masks (called by the model forward)
GROUNDING_MASK_TARGETS: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}.generate_masks_with_special_tokens_and_transfer_map"
    for name in ("grounding_dino", "mm_grounding_dino")
)


def grounding_phrase_masks(
    input_ids: torch.Tensor, special_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phrase masks of a text split by special tokens, from elementwise ops and masked max/min only.

    A phrase is the run of tokens up to and including the next special token; a token attends to
    the tokens of its phrase (and to itself), except in the runs closed by a special token at the
    first or last position or by none (those attend to themselves only); its position id counts
    the tokens since the special token before it, 0 outside a phrase. This is what transformers'
    ``generate_masks_with_special_tokens_and_transfer_map`` returns (checked on random token mixes
    in the tests), without ``cummax``/``cummin``/``isin``.

    Args:
        input_ids: ``[batch, length]`` token ids (int64).
        special_tokens: ``[k]`` ids of the tokens that close phrases.

    Returns:
        ``(attention_mask, position_ids)``: ``[batch, length, length]`` bool and ``[batch, length]``
        int64.
    """
    length = input_ids.shape[1]
    device = input_ids.device
    special = (input_ids.unsqueeze(-1) == special_tokens.to(device)).any(-1)  # [batch, length]
    index = torch.arange(length, device=device)
    query, key = index.unsqueeze(1), index.unsqueeze(0)  # [length, 1] token i, [1, length] token j
    hit = special.unsqueeze(1)  # [batch, 1, length]: token j is special
    previous = torch.where(hit & (key < query), key, -1).amax(-1)  # last special strictly before i
    following = torch.where(hit & (key >= query), key, length).amin(-1)  # first special at or after i
    in_phrase = (following != 0) & (following != length - 1) & (following != length)
    mask = (following.unsqueeze(2) == following.unsqueeze(1)) & in_phrase.unsqueeze(1)
    mask = mask | torch.eye(length, device=device, dtype=torch.bool)
    offsets = torch.where(in_phrase, index - previous - 1, torch.zeros_like(previous))
    return mask, offsets.clamp(min=0).to(torch.long)


@register_patch(
    BACKEND,
    *GROUNDING_MASK_TARGETS,
    description=(
        "grounding-dino, mm-grounding-dino: the text phrase masks and position ids computed with a masked "
        "max/min over token pairs instead of torch.cummax/torch.cummin/torch.isin, which ONNX's translation "
        "and OpenVINO's FX frontend do not convert"
    ),
    # torch.onnx lists aten::cummax / aten::cummin as not supported (onnxscript's torch_lib has neither,
    # nor aten::isin, at 0.7.2); OpenVINO 2026.4's PyTorch frontend has no cummax/cummin either
    issue="https://github.com/pytorch/pytorch/pull/84496",
    versions={"transformers": ">=5.23,<6"},
)
def grounding_phrase_masks_without_cumulative_extrema(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``generate_masks_with_special_tokens_and_transfer_map`` of Grounding DINO and MM
    Grounding DINO by :func:`grounding_phrase_masks` while a detector is captured (key
    ``capture.detection``); same arguments and results."""

    @functools.wraps(original)
    def masks(input_ids: torch.Tensor, special_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grounding_phrase_masks(input_ids, special_tokens)

    return masks
