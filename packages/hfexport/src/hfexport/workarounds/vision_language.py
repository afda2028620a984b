"""Capture workarounds of vision-language models (key ``"capture.vision_language"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` only when the captured module holds a module of one of the modeling
files of :data:`VISION_LANGUAGE_MODULES` (:func:`capture_key`), and puts the original back
afterwards; the eager model the exporter validates against runs the original code.

- :func:`packed_vision_attention_as_one_masked_call`: Qwen2.5-VL's (and Qwen2.5-Omni's, EXAONE
  4.5's) vision attention over packed windows and images is one SDPA call with a block-diagonal mask
  (:func:`block_diagonal_mask`) instead of a Python loop over ``torch.split(lengths.tolist())``,
  so the image encoder's program serves any window count.
- :func:`window_index_counts_merged_patches`: the window index of those towers has one entry per
  merged patch (a ``torch._check``), so the permuted patch count is traced as a bounded polynomial.
- :func:`packed_vision_attention_with_out_proj`: the same for MiniMax-M3-VL's vision attention
  (separate q / k / v projections, ``out_proj``, a ``(output, weights)`` result), whose per-image
  loop left unbacked sizes that ExecuTorch's memory planning could not guard on.
- :func:`image_batch_without_padding_filter`: Idefics2's, Idefics3's and SmolVLM's
  ``get_image_features`` encode every image of ``pixel_values`` ``[batch, images, ...]`` instead of
  boolean-indexing the non-padding ones and splitting the features with ``.tolist()``; the
  exported image encoder takes real images only (no all-zero padding images).
- :func:`tiles_without_padding_filter`: Granite-Docling's ``get_image_features`` the same way for
  its tiles (``pixel_attention_mask`` ``[batch, tiles]`` all True).
- :func:`naflex_tokens_without_padding_filter`: LFM2-VL's ``get_image_features`` gathers every
  image's downsampled tokens for images that fill their patch grid, without boolean-indexing the
  padding token slots and splitting per image with ``.tolist()``.
- :func:`projected_grid_features_unsplit`: HyperCLOVAX-Vision-V2's ``get_image_features``
  returns the projected features of all images as one tensor instead of splitting them per
  image with ``.tolist()`` of ``image_grid_thw``.
- :func:`image_codes_of_unpadded_batch`: Apertus 1.5's ``get_image_features`` tokenizes the image
  batch in one call instead of cropping each image to its ``image_sizes`` in a Python loop, for
  images that fill ``pixel_values`` (no padding).
- :func:`small_constants_keep_their_values` (key :data:`FIXED_GRID_KEY`, a scope of :data:`KEY`,
  chosen for an image encoder exported for one patch grid,
  :class:`hfexport.generation.multimodal.SizedGridImageFeatures`): the fake tensors of
  ``torch.export`` keep the values of small constant tensors (the grid ``[1, 3]`` and what is
  computed from it), so a tower that reads its grid with ``.tolist()`` / ``int()`` gets Python
  ints instead of unbacked symbols.
- :func:`key_pools_padded_to_the_selection`: GLM-5-Next's sparse-attention indexer scores keys
  pooled in blocks of ``index_kpool``; its pools are padded with never-selectable ones up to
  the selection budget and not filtered by value, so one graph serves prompts of one pool and of
  many (the sample's single pool was specialised: ``Guard failed: inputs_embeds.size()[1] <= 16``).
- :func:`merged_grid_features_unsplit`: MiniMax-M3-VL's ``get_image_features`` returns the
  projected features of all images as one tensor instead of splitting them per image with
  ``.tolist()`` of ``image_grid_thw``.
- :func:`rotary_grid_from_the_image_shape`: Step3p7's vision tower computes its 2-D rotary
  position ids from the patch grid of ``pixel_values``' shape, not from a ``grid_thw`` tensor it
  builds and reads back with ``.tolist()`` (unbacked sizes ExecuTorch's memory planning cannot
  guard on).
- :func:`bidirectional_prompt_mask_as_eager_runs_it`: PaliGemma's Gemma language model attends
  bidirectionally (``use_bidirectional_attention``) but builds a causal mask, which eager SDPA
  skips on an unpadded prompt (its attention then sees every key) and the trace always keeps; the
  traced mask now makes the same choice in the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "BIDIRECTIONAL_PROMPT_MODULES",
    "CAPTURE",
    "FIXED_GRID_KEY",
    "KEY",
    "VISION_LANGUAGE_MODULES",
    "bidirectional_prompt_mask_as_eager_runs_it",
    "block_diagonal_mask",
    "capture_key",
    "drop_constant_reads",
    "grid_position_ids",
    "image_batch_without_padding_filter",
    "image_codes_of_unpadded_batch",
    "key_pools_padded_to_the_selection",
    "merged_grid_features_unsplit",
    "naflex_tokens_without_padding_filter",
    "packed_vision_attention_as_one_masked_call",
    "packed_vision_attention_with_out_proj",
    "projected_grid_features_unsplit",
    "rotary_grid_from_the_image_shape",
    "small_constants_keep_their_values",
    "tiles_without_padding_filter",
    "window_index_counts_merged_patches",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.vision_language"
BACKEND = KEY
#: Registry key of the patches for an image encoder exported for one patch grid (a scope of :data:`KEY`).
FIXED_GRID_KEY = f"{KEY}.fixed_grid"
#: Elements up to which a tensor built from constants keeps its values while capturing under
#: :data:`FIXED_GRID_KEY` (torch keeps 1): a grid ``[images, 3]`` and the sizes derived from it.
SMALL_CONSTANT_NUMEL = 64

#: transformers modeling modules whose models the capture patches of this module concern
VISION_LANGUAGE_MODULES: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}"
    for name in (
        "qwen2_5_vl",
        "qwen2_5_omni",
        "idefics2",
        "idefics3",
        "smolvlm",
        "granite_docling",
        "lfm2_vl",
        "exaone4_5",
        "hyperclovax_vision_v2",
        "apertus1p5",
        "minimax_m3_vl",
        "glm5_next",
        "step3p7",
    )
)


#: modeling modules whose causal mask a bidirectional configuration (PaliGemma's language model,
#: ``use_bidirectional_attention=True``) runs through :func:`bidirectional_prompt_mask_as_eager_runs_it`
BIDIRECTIONAL_PROMPT_MODULES: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}" for name in ("paligemma", "gemma", "gemma2")
)


def _bidirectional_language_model(module: torch.nn.Module) -> bool:
    """A submodule of :data:`BIDIRECTIONAL_PROMPT_MODULES` whose config attends bidirectionally."""
    return any(
        type(sub).__module__ in BIDIRECTIONAL_PROMPT_MODULES
        and bool(getattr(getattr(sub, "config", None), "use_bidirectional_attention", False))
        for sub in module.modules()
    )


def capture_key(module: torch.nn.Module) -> str:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, a component, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.vision_language"``: the ``"capture"`` entries and this module's)
        when ``module`` or one of its submodules is defined in one of
        :data:`VISION_LANGUAGE_MODULES`, or is a module of :data:`BIDIRECTIONAL_PROMPT_MODULES`
        configured with ``use_bidirectional_attention`` (PaliGemma's language model);
        :data:`FIXED_GRID_KEY` when ``module`` holds an image encoder exported for one patch grid
        (:class:`hfexport.generation.multimodal.SizedGridImageFeatures`); ``"capture"`` otherwise,
        so other models' reports do not list these patches.
    """
    if _holds_fixed_grid_features(module):
        return FIXED_GRID_KEY
    if holds_module_from(module, VISION_LANGUAGE_MODULES) or _bidirectional_language_model(module):
        return KEY
    return CAPTURE


def _holds_fixed_grid_features(module: torch.nn.Module) -> bool:
    from hfexport.generation.multimodal import SizedGridImageFeatures

    return any(isinstance(sub, SizedGridImageFeatures) for sub in module.modules())


def drop_constant_reads(program: Any) -> int:
    """Remove the nodes of ``program`` whose results nothing uses, after a capture under
    :data:`FIXED_GRID_KEY` (called by :func:`hfexport.capture.capture`).

    The grid's values were read at capture (``.tolist()``: ``aten.unbind`` and ``aten.item`` of
    the constant grid), which leaves those reads in the graph with unused results. A later
    retrace of the program (the ONNX translation's decompositions) fakes the constant again
    without its values and fails on them (``Could not extract specialized integer``); without
    the reads the constant is read by nothing.

    Args:
        program: the ``torch.export.ExportedProgram`` just captured (changed in place).

    Returns:
        The number of nodes removed.
    """
    graph = program.graph_module.graph
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return before - len(graph.nodes)


@register_patch(
    FIXED_GRID_KEY,
    "torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT",
    "torch.fx.experimental.proxy_tensor.CONSTANT_NUMEL_LIMIT",
    description=(
        "fake and proxy tensors keep the values of constant tensors up to 64 elements (torch keeps 1), so an "
        "image tower exported for one patch grid reads the grid's values instead of unbacked symbols"
    ),
    issue="https://github.com/pytorch/pytorch/issues/136642",
    versions={"torch": ">=2.5"},
)
def small_constants_keep_their_values(original: int) -> int:
    """The constant-propagation limit of fake (and proxy) tensors while capturing an image encoder
    exported for one patch grid (:class:`hfexport.generation.multimodal.SizedGridImageFeatures`).

    Such a component builds its grid (``[1, 3]``: temporal, height and width patches) from Python
    constants and hands it to the model's ``get_image_features``; HunYuan-V4-VL, Cosmos3-Edge and
    Kimi-K2.5 read it with ``.tolist()`` to size ``F.interpolate`` of their learned position grid,
    a per-image merger or a split. torch's fake tensors keep the values of a constant tensor of one
    element only, so the reads became unbacked symbols (``Could not extract specialized integer
    from data-dependent expression u0``, issue 28). With a limit of :data:`SMALL_CONSTANT_NUMEL`
    elements the grid and the sizes computed from it keep their values: the graph is specialised
    to that grid, as the component is meant to be. Values computed from the inputs are not
    constants and stay symbolic.

    Returns:
        ``max(original, SMALL_CONSTANT_NUMEL)``.
    """
    return max(int(original), SMALL_CONSTANT_NUMEL)


def block_diagonal_mask(cu_seqlens: torch.Tensor, length: Any) -> torch.Tensor:
    """Bool ``[length, length]``: True where query and key rows lie in the same packed segment.

    ``cu_seqlens`` holds the segment boundaries ``[0, b1, ..., length]`` (int); a row's segment is
    the number of boundaries at or below it: a 1 scattered at every boundary (into ``length + 1``
    slots, so the closing boundary lands in the last, dropped slot), summed cumulatively. No
    ``.tolist()``, no ``searchsorted``, no broadcast against the boundaries, and no slice of them
    that is empty for a one-segment sample (``cu_seqlens[1:-1]`` of ``[0, length]`` made
    ``torch.export`` specialise the boundary count to 2: ExecuTorch planned Qwen2.5-VL's
    ``cu_window_seqlens`` for one window and refused 4, issue 28), so it traces on a dynamic
    segment count and every runtime has its operators.
    """
    bounds = cu_seqlens.to(torch.int64)
    marks = torch.zeros(length + 1, dtype=torch.int64, device=cu_seqlens.device)
    segment = marks.scatter_add(0, bounds, torch.ones_like(bounds)).cumsum(0)[:length]
    return segment[:, None] == segment[None, :]


@register_patch(
    KEY,
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention.forward",
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionAttention.forward",
    "transformers.models.exaone4_5.modeling_exaone4_5.Exaone4_5_VisionAttention.forward",
    description=(
        "a windowed vision encoder's attention over packed windows is one SDPA call with a block-diagonal mask "
        "instead of a Python loop over torch.split(lengths.tolist()), which keeps the sample's window count"
    ),
    issue="https://github.com/pytorch/pytorch/issues/158786",
    versions={"transformers": ">=5.0,<6"},
)
def packed_vision_attention_as_one_masked_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace Qwen2.5-VL's (and Qwen2.5-Omni's, EXAONE 4.5's) vision attention ``forward`` while capturing.

    Without flash attention, transformers splits the packed ``[patches, hidden]`` sequence at
    ``cu_seqlens`` (images, or 2x2-merged-patch windows in the windowed layers) with
    ``torch.split(tensor, lengths.tolist())`` and attends per piece in a Python loop: the captured
    program unrolls the loop for the sample's piece count and refuses another image size
    (``Guard failed: -1 + cu_window_seqlens.size()[0] == 1``, issue 28). The replacement attends
    over the whole sequence once, masked to :func:`block_diagonal_mask`: each row sees exactly the
    keys of its own piece, as in the loop (the values differ by float rounding only). Flash
    attention, which already takes ``cu_seqlens``, runs the original.
    """
    from transformers.utils.generic import is_flash_attention_requested

    rotary = original.__globals__["apply_rotary_pos_emb_vision"]

    @functools.wraps(original)
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if is_flash_attention_requested(self.config) or position_embeddings is None:
            return original(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        length = hidden_states.shape[0]
        if hasattr(self, "qkv") and hasattr(self, "q_dim"):  # EXAONE 4.5: fused, grouped-query
            query, key, value = (
                t.reshape(length, -1, self.head_dim)
                for t in self.qkv(hidden_states).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            )
        elif hasattr(self, "qkv"):  # Qwen2.5-VL: one fused projection
            qkv = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
            query, key, value = qkv.unbind(0)
        else:  # Qwen2.5-Omni: q, k and v projections
            query, key, value = (
                proj(hidden_states).reshape(length, self.num_heads, -1) for proj in (self.q, self.k, self.v)
            )
        cos, sin = position_embeddings
        query, key = rotary(query, key, cos, sin)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # each key/value head serves `groups` consecutive query heads (repeat_kv)
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = block_diagonal_mask(cu_seqlens, length)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scaling
        )
        return self.proj(out.transpose(1, 2).reshape(length, -1))

    return forward


@register_patch(
    KEY,
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLVisionAttention.forward",
    description=(
        "MiniMax-M3-VL's vision attention over packed images is one SDPA call with a block-diagonal mask instead "
        "of a Python loop over torch.split(lengths.tolist()), whose unbacked per-image sizes ExecuTorch's memory "
        "planning could not guard on (u223 < 1)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/158786",
    versions={"transformers": ">=5.0,<6"},
)
def packed_vision_attention_with_out_proj(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace MiniMax-M3-VL's vision attention ``forward`` while capturing.

    As in :func:`packed_vision_attention_as_one_masked_call`: without flash attention transformers
    attends per image in a loop over ``torch.split(tensor, lengths.tolist())``; the capture reads
    every length as an unbacked symbol (``u223``) and ExecuTorch's memory planning fails on them
    ("Could not guard on data-dependent expression u223 < 1", issue 28). The replacement attends once
    over the packed ``[patches, hidden]`` sequence masked to :func:`block_diagonal_mask` and returns
    ``(output, None)`` like the original without attention weights (the values differ by float
    rounding only). Flash attention runs the original.
    """
    from transformers.utils.generic import is_flash_attention_requested

    rotary = original.__globals__["apply_rotary_pos_emb_vision"]

    @functools.wraps(original)
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if is_flash_attention_requested(self.config):
            return original(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        length = hidden_states.shape[0]
        query, key, value = (
            proj(hidden_states).view(length, self.num_heads, self.head_dim)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = position_embeddings
        query, key = rotary(query, key, cos, sin)
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = block_diagonal_mask(cu_seqlens, length)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scaling
        )
        return self.out_proj(out.transpose(1, 2).reshape(length, -1)), None

    return forward


@register_patch(
    KEY,
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLModel.get_image_features",
    description=(
        "return MiniMax-M3-VL's projected image features of all images as one tensor instead of splitting them "
        "per image with .tolist() of image_grid_thw (an unbacked size ExecuTorch's memory planning could not "
        "guard on: u91 < 1)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def merged_grid_features_unsplit(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace MiniMax-M3-VL's ``get_image_features`` while capturing.

    transformers splits the projected, spatially merged features per image with sizes read from
    ``image_grid_thw`` (``.tolist()``): the capture reads each size as an unbacked symbol and
    ExecuTorch's memory planning fails on it ("Could not guard on data-dependent expression
    u91 < 1", issue 28). The replacement returns the features unsplit, as a one-element
    ``pooler_output`` tuple (the concatenation of transformers' pieces, what the model scatters
    into the prompt and the generation runner consumes); the vision tower's other outputs are
    unchanged.
    """
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def get_image_features(
        self: Any, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Any
    ) -> Any:
        outputs = self.vision_tower(pixel_values=pixel_values, grid_thw=image_grid_thw, **kwargs)
        outputs.pooler_output = (self.multi_modal_projector(outputs.last_hidden_state.squeeze(0)),)
        return outputs

    return functools.wraps(original)(get_image_features)


def grid_position_ids(height: Any, width: Any, device: Any = None) -> torch.Tensor:
    """Int64 ``[height * width, 2]``: the (row, column) of each patch of a ``height x width`` grid in
    raster order, what ``transformers.vision_utils.get_vision_position_ids`` returns for one image
    of one frame with ``spatial_merge_size=1``; ``height`` and ``width`` may be symbolic sizes."""
    rows = torch.arange(height, device=device)[:, None].expand(height, width)
    columns = torch.arange(width, device=device)[None, :].expand(height, width)
    return torch.stack([rows.reshape(-1), columns.reshape(-1)], dim=-1)


@register_patch(
    KEY,
    "transformers.models.step3p7.modeling_step3p7.Step3p7VisionModel.forward",
    description=(
        "Step3p7's vision tower takes its 2-D rotary position ids from the patch grid of pixel_values' shape instead "
        "of a grid_thw tensor built from that shape and read back with .tolist(), whose unbacked sizes ExecuTorch's "
        "memory planning could not guard on (u68 < 1)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def rotary_grid_from_the_image_shape(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Step3p7VisionModel.forward`` while capturing.

    The tower builds ``grid_thw = torch.tensor([[1, grid_h, grid_w]])`` from ``pixel_values``'
    height and width and hands it to ``get_vision_position_ids``, which reads it back with
    ``.tolist()``: the capture turns the grid sides into unbacked symbols (``u1 x u2`` position
    ids), and ExecuTorch's memory planning fails on them ("Could not guard on data-dependent
    expression u68 < 1", issue 28). During the call the wrapper gives the modeling module a
    ``get_vision_position_ids`` that returns :func:`grid_position_ids` of the grid read from
    ``pixel_values``' shape (symbolic sizes, the same ids: the tower always asks for one image
    with ``spatial_merge_size=1``), and puts the helper back afterwards. Any other call (several
    grid rows, a merge size above 1, precomputed ids in ``kwargs``) goes to the helper.
    """
    import importlib

    modeling = importlib.import_module("transformers.models.step3p7.modeling_step3p7")

    @functools.wraps(original)
    def forward(self: Any, pixel_values: torch.Tensor, **kwargs: Any) -> Any:
        helper = modeling.get_vision_position_ids
        patch = self.embeddings.patch_size
        grid_h, grid_w = pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch

        def position_ids(
            grid_thw: torch.Tensor,
            spatial_merge_size: Any = 1,
            include_temporal: bool = False,
            kwargs: dict | None = None,
        ) -> torch.Tensor:
            precomputed = kwargs is not None and kwargs.get("position_ids") is not None
            if precomputed or include_temporal or spatial_merge_size != 1 or grid_thw.shape[0] != 1:
                return helper(grid_thw, spatial_merge_size, include_temporal=include_temporal, kwargs=kwargs)
            return grid_position_ids(grid_h, grid_w, device=grid_thw.device)

        modeling.get_vision_position_ids = position_ids
        try:
            return original(self, pixel_values, **kwargs)
        finally:
            modeling.get_vision_position_ids = helper

    return forward


@register_patch(
    KEY,
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel.permute_input_for_window_attn",
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder.permute_input_for_window_attn",
    "transformers.models.exaone4_5.modeling_exaone4_5.Exaone4_5_VisionModel.permute_input_for_window_attn",
    description=(
        "tell the capture that a windowed vision tower's window index has one entry per merged patch "
        "(torch._check(len(window_index) * merge unit == patches)): otherwise the permuted patch count is traced as "
        "s98*(s47//(s47//4)), which bound_sympy cannot bound (a divisor that reaches 0), and ExecuTorch planned "
        "every window buffer at the sample's size"
    ),
    issue="https://github.com/pytorch/executorch/issues/8766",
    versions={"transformers": ">=5.0,<6"},
)
def window_index_counts_merged_patches(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Qwen2.5-VL's (and Qwen2.5-Omni's, EXAONE 4.5's) ``permute_input_for_window_attn``
    while capturing.

    The tower reorders its ``[patches, hidden]`` rows window by window:
    ``x.reshape(patches // unit, unit, -1)[window_index].reshape(patches, -1)`` (``unit`` the
    ``spatial_merge_size ** 2`` patches of one merged token). The precomputed ``window_index``
    input has one entry per merged token, but nothing in the graph says so: the trace writes the
    permuted row count as ``windows * (patches // (patches // 4))``, whose interval bound is
    unbounded (``patches // 4`` reaches 0 at the lower end of its range), so ExecuTorch's memory
    planning fell back to the sample's size for every tensor of that length and the second
    prompt's image failed (``aten::full.out``: "Failed to resize output tensor", error 0x12,
    issue 28). ``torch._check(len(window_index) * unit == patches)`` states the invariant; the
    capture then writes the patch count as ``unit * windows`` and every size is a polynomial with
    a finite bound. In eager mode the check holds and costs nothing.
    """

    @functools.wraps(original)
    def permute_input_for_window_attn(
        self: Any, input_tensor: torch.Tensor, window_index: torch.Tensor, seq_len: Any
    ) -> torch.Tensor:
        unit = int(self.spatial_merge_unit)
        torch._check(window_index.shape[0] * unit == input_tensor.shape[0])
        return original(self, input_tensor, window_index, seq_len=seq_len)

    return permute_input_for_window_attn


#: the Idefics-family modeling file whose patch mask keeps only fully unpadded patches (the others
#: keep a patch with any unpadded pixel), and whose connector (perceiver resampler) takes that mask
_FULL_PATCH_RULE = "transformers.models.idefics2.modeling_idefics2"


@register_patch(
    KEY,
    "transformers.models.idefics2.modeling_idefics2.Idefics2Model.get_image_features",
    "transformers.models.idefics3.modeling_idefics3.Idefics3Model.get_image_features",
    "transformers.models.smolvlm.modeling_smolvlm.SmolVLMModel.get_image_features",
    description=(
        "encode every image of pixel_values [batch, images, ...] instead of boolean-indexing the non-padding "
        "images and splitting per row with .tolist(), which fixes the sample's image batch; no padding images"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def image_batch_without_padding_filter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace Idefics2's / Idefics3's / SmolVLM's ``get_image_features`` while capturing.

    transformers drops all-zero padding images with ``pixel_values[real_images_inds]`` (a
    data-dependent image count) and splits the connector's output per batch row with
    ``.split(counts.tolist())``: the captured image encoder keeps the sample's batch
    (``Guard failed: pixel_values.size()[0] == 2``, issue 28). The replacement flattens
    ``[batch, images, channels, height, width]`` to ``[batch * images, ...]`` and encodes every
    image, returning the features of all of them as one ``[images * tokens, hidden]`` tensor
    (``pooler_output``, a one-element list). For inputs without padding images (what the
    processor returns for one image per row, and every prompt the generation runner builds) this
    is the same computation; a prompt with padding images gets feature rows for them too, which
    the runner refuses (its placeholder count no longer matches).
    """
    from transformers.utils.generic import can_return_tuple

    full_patches = original.__module__ == _FULL_PATCH_RULE

    @can_return_tuple
    def get_image_features(
        self: Any,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        batch, images, channels, height, width = pixel_values.shape
        pixel_values = pixel_values.to(dtype=self.dtype).reshape(batch * images, channels, height, width)
        if pixel_attention_mask is None:
            pixel_attention_mask = torch.ones(
                (batch * images, height, width), dtype=torch.bool, device=pixel_values.device
            )
        else:
            pixel_attention_mask = pixel_attention_mask.reshape(batch * images, height, width)
        patch = self.config.vision_config.patch_size
        subgrid = pixel_attention_mask.unfold(1, patch, patch).unfold(2, patch, patch).sum(dim=(-1, -2))
        patch_mask = (subgrid == patch * patch) if full_patches else (subgrid > 0)
        outputs = self.vision_model(
            pixel_values=pixel_values, patch_attention_mask=patch_mask, return_dict=True, **kwargs
        )
        hidden = outputs.last_hidden_state
        if full_patches:
            features = self.connector(hidden, attention_mask=patch_mask.reshape(batch * images, -1))
        else:
            features = self.connector(hidden)
        outputs.pooler_output = [features.reshape(-1, features.shape[-1])]
        return outputs

    return functools.wraps(original)(get_image_features)


@register_patch(
    KEY,
    "transformers.models.granite_docling.modeling_granite_docling.GraniteDoclingModel.get_image_features",
    description=(
        "encode every tile of pixel_values [batch, tiles, ...] instead of boolean-indexing the real tiles and "
        "splitting per row with .tolist(), which fixes the sample's batch; no padding tiles"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def tiles_without_padding_filter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace Granite-Docling's ``get_image_features`` while capturing.

    transformers selects the real tiles with ``pixel_values[pixel_attention_mask]`` and splits the
    features per batch row with ``torch.split(sizes.tolist())``: the captured image encoder keeps
    the sample's batch (``Guard failed: pixel_attention_mask.size()[0] == 2``, issue 28). The
    replacement encodes every tile of ``[batch, tiles, channels, height, width]`` and returns the
    features (and each DeepStack feature) as one tensor over all tiles: the same computation when
    ``pixel_attention_mask`` is all True (one image per row, what the generation runner builds).
    A model with a density router (its routing reads per-row tile counts) runs the original.
    """
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def get_image_features(
        self: Any,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
        tile_fine_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.density_router is not None:
            return original(self, pixel_values, pixel_attention_mask, tile_fine_mask, **kwargs)
        fine = tile_fine_mask is not None
        outputs = self.vision_model(
            pixel_values=pixel_values.flatten(0, 1).to(self.dtype), fine=fine, return_dict=True, **kwargs
        )
        outputs.pooler_output = (outputs.pooler_output,)
        if outputs.deepstack_features is not None:
            outputs.deepstack_features = [(features,) for features in outputs.deepstack_features]
        return outputs

    return functools.wraps(original)(get_image_features)


@register_patch(
    KEY,
    "transformers.models.lfm2_vl.modeling_lfm2_vl.Lfm2VlModel.get_image_features",
    description=(
        "gather every image's downsampled NaFlex tokens without boolean-indexing the padding slots and "
        "splitting per image with .tolist(), which fixes the sample's image count; images fill their patch grid"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def naflex_tokens_without_padding_filter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace LFM2-VL's ``get_image_features`` while capturing.

    transformers lays every image's ``factor x factor`` patch blocks side by side in one grid for
    the projector's pixel unshuffle, then drops the padding token slots with a boolean index (a
    data-dependent count) and splits per image with ``.tolist()``: the captured image encoder keeps
    the sample's image count (``Guard failed: spatial_shapes.size()[0] == 2``, issue 28). The
    replacement builds the same grid from ``spatial_shapes`` with tensor index arithmetic, token
    ``t`` of image ``i`` reading the patch rows ``(t // (w_i / factor)) * factor + dy`` and
    columns ``(t % (w_i / factor)) * factor + dx``, and returns the projector's rows for every
    slot as one ``[images * tokens, hidden]`` tensor. That equals transformers' result when each
    image fills its patch grid (``h_i * w_i`` = the padded patch count, ``pixel_attention_mask``
    all ones: every image of one size, as the generation runner's prompts have); a batch with
    padded images gets rows for the padding slots, which the runner refuses (placeholder count).
    """
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def get_image_features(
        self: Any,
        pixel_values: torch.Tensor,
        spatial_shapes: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
        **kwargs: Any,
    ) -> Any:
        outputs = self.vision_tower(
            pixel_values=pixel_values,
            spatial_shapes=spatial_shapes,
            pixel_attention_mask=pixel_attention_mask,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        images, patches, width = hidden.shape
        factor = int(self.config.downsample_factor)
        device = hidden.device
        columns = spatial_shapes[:, 1].to(torch.int64)  # patch columns of each image [images]
        per_row = columns // factor  # token blocks per patch row
        token = torch.arange(patches // (factor * factor), device=device)
        offset = torch.arange(factor, device=device)
        top = ((token[None] // per_row[:, None]) * factor)[..., None] + offset  # [images, tokens, dy]
        left = ((token[None] % per_row[:, None]) * factor)[..., None] + offset  # [images, tokens, dx]
        index = top[..., :, None] * columns[:, None, None, None] + left[..., None, :]
        index = index + (torch.arange(images, device=device) * patches)[:, None, None, None]
        grid = hidden.reshape(-1, width)[index.permute(2, 0, 1, 3).reshape(factor, -1)]
        features = self.multi_modal_projector(grid.unsqueeze(0))
        outputs.pooler_output = [features.reshape(-1, features.shape[-1])]
        return outputs

    return functools.wraps(original)(get_image_features)


@register_patch(
    KEY,
    "transformers.models.hyperclovax_vision_v2.modeling_hyperclovax_vision_v2.HyperCLOVAXVisionV2Model.get_image_features",
    description=(
        "return the projected image features of all images as one tensor instead of splitting them per image "
        "with .tolist() of image_grid_thw, which torch.export cannot trace"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def projected_grid_features_unsplit(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace HyperCLOVAX-Vision-V2's ``get_image_features`` while capturing.

    transformers splits the projected features per image with sizes read from ``image_grid_thw``
    (``.tolist()``, data-dependent: ``Could not extract specialized integer``, issue 28). The
    replacement returns them unsplit, as a one-element ``pooler_output`` tuple: the concatenation
    of transformers' pieces, which is what the model and the generation runner consume. The
    precomputed-kwargs handling (``image_``-prefixed names) and ``return_dict`` stay as upstream.
    """
    from transformers.utils.generic import accepts_precomputed_kwargs, can_return_tuple

    @accepts_precomputed_kwargs(modality="image")
    @can_return_tuple
    def get_image_features(
        self: Any, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Any
    ) -> Any:
        outputs = self.vision_model(pixel_values, grid_thw=image_grid_thw, return_dict=True, **kwargs)
        outputs.pooler_output = (self.projector(outputs.pooler_output),)
        return outputs

    return functools.wraps(original)(get_image_features)


@register_patch(
    KEY,
    "transformers.models.apertus1p5.modeling_apertus1p5.Apertus1p5Model.get_image_features",
    description=(
        "tokenize the image batch in one vision-tokenizer call instead of cropping each image to image_sizes "
        "(.tolist()) in a Python loop, which fixes the image count and size; images fill pixel_values"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.0,<6"},
)
def image_codes_of_unpadded_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace Apertus 1.5's ``get_image_features`` while capturing.

    transformers crops each image of ``pixel_values`` ``[images, channels, height, width]`` to its
    ``image_sizes`` row (``.tolist()``) and runs the VQ tokenizer once per image: the crop sizes
    are data-dependent (``Could not guard on data-dependent expression Eq(u4*u5, 1)`` in the
    tokenizer's GroupNorm) and the loop keeps the sample's image count (issue 28). The replacement
    tokenizes the whole batch at once (the tokenizer's convolutions and group norms work per
    image, so each image's codes are those of its own call) and embeds the codes of all images as
    one ``[images * codes, hidden]`` tensor (a one-element ``pooler_output``). That is
    transformers' result when every image fills ``pixel_values`` (``image_sizes`` equal to its
    height and width, one image size per prompt); padded images would be tokenized with their
    padding. The whole-model prefill that runs it drops ``image_outputs`` from its output
    (:class:`hfexport.generation.parts.WithoutModalityOutputs`).
    """
    import importlib

    from transformers.utils.generic import can_return_tuple

    # ``original`` is wrapped by transformers' decorators: the output class from its modeling file
    output_class = importlib.import_module(original.__module__).Apertus1p5VisionTokenizerModelOutput

    @can_return_tuple
    def get_image_features(
        self: Any, pixel_values: torch.Tensor, image_sizes: torch.Tensor, **kwargs: Any
    ) -> Any:
        codes = self.vision_tokenizer.encode(pixel_values).image_tokens
        tokens = codes.reshape(-1) + self.config.image_token_offset
        return output_class(image_tokens=[tokens], pooler_output=(self.get_input_embeddings()(tokens),))

    return functools.wraps(original)(get_image_features)


@register_patch(
    KEY,
    "transformers.models.gemma.modeling_gemma.create_causal_mask",
    "transformers.models.gemma2.modeling_gemma2.create_causal_mask",
    "transformers.models.paligemma.modeling_paligemma.create_causal_mask",
    description=(
        "a language model configured with use_bidirectional_attention (PaliGemma's) builds a causal mask that eager "
        "SDPA skips on an unpadded prompt (is_causal=False: every key is seen) and a trace always materialises; the "
        "traced mask takes every key where the prompt has no padding, as eager does"
    ),
    # the same construct as Gemma 4's: use_bidirectional_attention without config.is_causal=False, so the
    # mask helpers build a causal mask for non-causal attention layers
    issue="https://github.com/huggingface/transformers/issues/46077",
    versions={"transformers": ">=5.0,<6"},
)
def bidirectional_prompt_mask_as_eager_runs_it(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``create_causal_mask`` in the Gemma / Gemma 2 / PaliGemma modeling files while capturing.

    PaliGemma's configuration sets its text model's ``use_bidirectional_attention`` (the image and
    prompt prefix attend both ways), so the attention layers run with ``is_causal=False``; the
    language model still builds its mask with ``create_causal_mask``. Eager SDPA drops that mask
    when nothing is padded and the query spans the keys (``_ignore_causal_mask_sdpa``) and then
    attends to every key, bidirectionally; with padding it applies the causal mask. A trace never
    drops the mask (the check reads the mask's values), so the exported language model was causal
    where ``model.generate`` is bidirectional (0.63 apart on the tiny model, issue 28). The
    replacement returns, for such a configuration under SDPA and a query of 1 or of every key,
    ``the causal mask | no padding`` (every key when nothing is padded): eager's choice made in the
    graph. Any other configuration, implementation, or mask form runs the original's result as is.
    """

    @functools.wraps(original)
    def create_causal_mask(
        config: Any, inputs_embeds: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        mask = original(config, inputs_embeds, attention_mask, *args, **kwargs)
        if (
            not getattr(config, "use_bidirectional_attention", False)
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or not isinstance(mask, torch.Tensor)
            or mask.dtype != torch.bool
            or mask.dim() != 4
        ):
            return mask
        if attention_mask is not None and not (
            isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        ):
            return mask
        query, keys = inputs_embeds.shape[1], mask.shape[-1]
        if not (query == 1 or query == keys):  # eager materialises the mask here too
            return mask
        if attention_mask is None:
            return torch.ones_like(mask)
        # an or, not a where: onnxruntime has no Where kernel for bool tensors
        return mask | attention_mask.bool().all()

    return create_causal_mask


@register_patch(
    KEY,
    "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextIndexer.get_pooled_states",
    description=(
        "the sparse-attention indexer's key pools are padded with never-selectable pools up to its selection "
        "budget and not filtered by value, so the pool count is never 1 (specialised) nor data-dependent"
    ),
    issue="https://github.com/pytorch/pytorch/issues/126685",
    versions={"transformers": ">=5.24,<6"},
)
def key_pools_padded_to_the_selection(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace GLM-5-Next's ``Glm5NextTextIndexer.get_pooled_states`` while capturing.

    The indexer (DeepSeek sparse attention over key pools) groups the keys from the first real one
    into pools of ``index_kpool`` tokens, scores the pools and keeps the best
    ``index_topk // index_kpool``. Upstream returns ``ceil(length / index_kpool)`` pools, then
    drops those invalid in every batch row (``pool_keys[:, keep]``, a size read from values). A
    sample prompt of one pool (up to ``index_kpool`` tokens) made that count 1, which
    ``torch.export`` specialises: the language model refused a longer prompt (``Guard failed:
    inputs_embeds.size()[1] <= 16``, issue 28).

    The replacement returns ``ceil(length / index_kpool) + index_topk // index_kpool`` pools: the
    real ones, then pools wholly past the last key (all their slots invalid: index ``-1``, zero
    key, never valid), and drops none. The pool count is then at least the selection budget, so
    the indexer's ``min(budget, pools)`` is the budget whatever the length. An invalid pool is
    never selectable upstream either (its score is masked, its indices become ``-1``), so the
    selected keys are the same (up to the order ``topk`` gives pools of exactly equal scores);
    only the ``-1`` padding of the index list moves (the attention mask built from it is the same).

    Returns:
        ``(pool_keys [batch, pools, head_dim], pool_indices int64 [batch, pools, index_kpool],
        pool_valid bool [batch, pools])``, as upstream.
    """

    @functools.wraps(original)
    def get_pooled_states(
        self: Any, packed_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys, gate_scores, valid = packed_states.split([self.head_dim, self.head_dim, 1], dim=-1)
        valid = valid.squeeze(-1).bool()
        batch, length = keys.shape[0], keys.shape[1]
        size = int(self.index_kpool)
        pools = (length + size - 1) // size + int(self.index_topk) // size
        device = keys.device
        # pools start at each row's first valid key (left padding skipped); none valid: past the end
        first = torch.where(
            valid.any(-1),
            valid.long().argmax(-1),
            torch.full((batch,), length, dtype=torch.long, device=device),
        )
        # slot j of pool i is first + i * size + j (an outer sum, not a view of a flat range, whose
        # divisibility guard torch.export cannot prove for a symbolic pool count)
        offsets = (
            torch.arange(pools, device=device)[:, None] * size + torch.arange(size, device=device)[None, :]
        )
        slots = first[:, None, None] + offsets[None]
        rows = torch.arange(batch, device=device)[:, None, None]
        clamped = slots.clamp(0, length - 1)
        filled = valid[rows, clamped] & (slots < length)
        pool_valid = filled.all(-1)
        # a learned softmax gate over each pool's valid slots; pools of no valid slot weigh nothing
        gate = gate_scores[rows, clamped].float() + self.index_kpool_compress_ape.float()[None, None]
        gate = gate.masked_fill(~filled[..., None], float("-inf"))
        weights = torch.nan_to_num(gate.softmax(dim=2)).to(keys.dtype)
        pool_keys = (weights * keys[rows, clamped]).sum(dim=2)
        return pool_keys, slots.masked_fill(~filled, -1), pool_valid

    return get_pooled_states
