"""Capture workarounds of text encoders (key ``"capture.text_encoders"``, issue 28).

Encoders behind the masked-LM, token/sequence-classification, question-answering and
sentence-embedding heads whose forward keeps the sample's sequence length in the program. Each
entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for it, but only when the captured module
holds a module of one of :data:`TEXT_ENCODER_MODULES` (:func:`capture_key`), and puts the original
back afterwards (also when the capture fails); the eager model the exporter validates against runs
the original code.

- :func:`funnel_relative_positions_from_sizes`: the Funnel Transformer's relative-shift attention
  builds its relative positions from ``list(range(seq_len))``, Python ints, so ``torch.export``
  evaluates the symbolic sequence length to the sample's (guard ``Eq(seq, 8)`` in
  ``get_position_embeds``) and the program refuses every other length. The patch computes the
  same ``arange`` bounds from the sizes (:class:`PooledPositions`), which stay symbolic.
- :func:`funnel_upsample_always_sliced`: the Funnel decoder cuts its upsampled states to the input
  length with a slice that is a no-op at some lengths (8 with two pooling blocks) and not at
  others; ``torch.export`` records "the slice kept every row" as a stride guard (``Guard failed:
  192 + 256 * ((-1 + seq) // 4) == -64 + 64 * seq``). The patch pads one more row first, so the
  slice always drops rows and the guard holds at every length.
- :func:`funnel_relative_shift_by_index`: the relative-shift attention aligns its scores by
  reshaping ``[.., seq, rel]`` to ``[.., rel, seq]``, dropping ``shift`` rows and reshaping back; the
  ExecuTorch lowering infers the last size of those views as a quotient of products (``(s**2 *
  (R // s)) // R``) whose interval bound is ~1e11 at a 1024-token bound, and serialising the planned
  program failed (``memory_planning: TypeError: bad number 81326039495 for type int32``). The patch
  selects the same scores with one ``index_select`` over the flattened last two axes (indices
  computed from the sizes), whose output sizes are the query and context lengths themselves.
- :func:`sliding_window_records_global_slots`, :func:`sliding_window_records_cls_global_mask` and
  :func:`sliding_window_attention_with_static_sizes`: Longformer's and LED's encoders decide
  whether to run the global-attention path from the values of the attention mask
  (``(mask > 0).any().item()``), a data-dependent branch ``torch.export`` refuses
  (``GuardOnDataDependentSymNode: Eq(u1, 1)``), size the global tensors by ``nonzero`` counts, and
  cut the sliding windows with a ``view`` / ``as_strided`` sized by ``torch.div`` tensors (unbacked
  sizes ExecuTorch's memory planning cannot bound). The attention layers run
  :func:`sliding_window_self_attention` instead: the window by blocks of ``w`` queries against
  their block and its neighbours (slices and ``cat``), the global attention over static slots
  masked by the global mask (none without a ``global_attention_mask``, position 0 for the
  sequence-classification head's own ``<s>`` mask, every position for a given mask), the
  original's values at every input.
  :func:`sliding_window_pads_to_a_window_multiple` pads the tokens to
  ``window * ceil(seq / window)``, a length ``torch.export`` sees is a multiple of the window (the
  original's ``seq + (window - seq % window) % window`` left divisibility guards that ExecuTorch's
  named dims were solved against: ``Cannot create Dim with inconsistent min=1, max=1``).
- :func:`canine_local_attention_in_blocks`: CANINE's character encoder attends within windows it
  lists in a Python loop over ``range(0, seq_len, stride)``, which ``torch.export`` evaluates to the
  sample's length (guard ``Eq(seq, 8)`` in ``CanineAttention.forward``; ``Guard failed:
  attention_mask.size()[1] == 8``). The patch runs the same windows as one batch of zero-padded
  blocks (:func:`canine_block_local_attention`) whose count is computed from the symbolic length.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "CANINE_LOCAL_ATTENTION_TARGETS",
    "FUNNEL_POSITION_TARGETS",
    "FUNNEL_SHIFT_TARGETS",
    "FUNNEL_UPSAMPLE_TARGETS",
    "KEY",
    "SLIDING_WINDOW_ATTENTION_TARGETS",
    "SLIDING_WINDOW_CLS_HEAD_TARGETS",
    "SLIDING_WINDOW_MODEL_TARGETS",
    "SLIDING_WINDOW_PAD_TARGETS",
    "TEXT_ENCODER_MODULES",
    "PooledPositions",
    "canine_block_local_attention",
    "canine_local_attention_in_blocks",
    "canine_runs_in_blocks",
    "capture_key",
    "funnel_relative_position_embeds",
    "funnel_relative_positions_from_sizes",
    "funnel_relative_shift",
    "funnel_relative_shift_by_index",
    "funnel_upsample",
    "funnel_upsample_always_sliced",
    "sliding_window_attention_with_static_sizes",
    "sliding_window_pads_to_a_window_multiple",
    "sliding_window_records_cls_global_mask",
    "sliding_window_records_global_slots",
    "sliding_window_self_attention",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.text_encoders"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
TEXT_ENCODER_MODULES: tuple[str, ...] = (
    "transformers.models.funnel.modeling_funnel",
    "transformers.models.longformer.modeling_longformer",
    "transformers.models.led.modeling_led",
    "transformers.models.canine.modeling_canine",
)

_TRANSFORMERS = {"transformers": ">=5.23,<6"}


def capture_key(module: torch.nn.Module) -> str | None:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.text_encoders"``: the ``"capture"`` entries and this module's) when
        ``module`` or one of its submodules is defined in one of :data:`TEXT_ENCODER_MODULES`;
        ``None`` otherwise, so other models' reports do not list these patches.
    """
    return KEY if holds_module_from(module, TEXT_ENCODER_MODULES) else None


# --------------------------------------------------------------------------------------------
# Funnel Transformer: relative positions from sizes
# --------------------------------------------------------------------------------------------

#: the method that builds the relative-shift attention's position embeddings of every block
FUNNEL_POSITION_TARGETS: tuple[str, ...] = (
    "transformers.models.funnel.modeling_funnel.FunnelAttentionStructure.get_position_embeds",
)
#: the module function the decoder calls to bring the pooled states back to the input length
FUNNEL_UPSAMPLE_TARGETS: tuple[str, ...] = ("transformers.models.funnel.modeling_funnel.upsample",)
#: no upstream issue found for either Funnel guard; the model's pull request
_FUNNEL_ISSUE = "https://github.com/huggingface/transformers/pull/6908"


@dataclass(frozen=True)
class PooledPositions:
    """The position ids of one Funnel block, ``[head] + [start + step * i for i in range(count)]``.

    Funnel's ``stride_pool_pos`` keeps the ``<cls>`` position apart (a ``head`` of its own) and takes
    every second position of the rest, so the rest stays an arithmetic progression. Its
    ``relative_pos`` reads only the first and last position and the count, which this class gives
    as (possibly symbolic) ints without listing the positions.

    Attributes:
        head: the first position (the ``<cls>`` token's after pooling with ``separate_cls``).
        start: the second position (meaningless when ``count`` is 0).
        step: the distance between the positions after the first.
        count: how many positions follow the first (an int, or a ``SymInt`` while tracing).
    """

    head: Any
    start: Any
    step: Any
    count: Any

    @classmethod
    def of_length(cls, seq_len: Any) -> PooledPositions:
        """The unpooled positions ``0 .. seq_len - 1`` (``seq_len`` >= 1)."""
        return cls(head=0, start=1, step=1, count=seq_len - 1)

    def __len__(self) -> int:
        # only for plain ints; use ``size`` while tracing (len() must return an int)
        return int(self.size)

    @property
    def size(self) -> Any:
        """How many positions there are: ``1 + count``."""
        return 1 + self.count

    @property
    def first(self) -> Any:
        """The first position (``pos[0]``)."""
        return self.head

    @property
    def last(self) -> Any:
        """The last position (``pos[-1]``): the head when nothing follows it.

        Written as arithmetic (``min(count, 1)`` selects), not a branch on ``count > 0``, so a
        symbolic count adds no guard.
        """
        follows = torch.sym_min(self.count, 1)
        return self.head + follows * (self.start + self.step * (self.count - 1) - self.head)

    def pooled(self, block_index: int, separate_cls: bool, truncate_seq: bool) -> PooledPositions:
        """What ``FunnelAttentionStructure.stride_pool_pos(pos, block_index)`` returns for these positions.

        With ``separate_cls``: ``[1 - 2 ** block_index] + (pos[1:-1] if truncate_seq else pos[1:])[::2]``;
        without: ``pos[::2]``.
        """
        if separate_cls:
            rest = torch.sym_max(self.count - 1, 0) if truncate_seq else self.count
            return PooledPositions(
                head=1 - 2**block_index, start=self.start, step=2 * self.step, count=(rest + 1) // 2
            )
        # pos[::2] = [head, start + step, start + 3 * step, ...]
        return PooledPositions(
            head=self.head, start=self.start + self.step, step=2 * self.step, count=self.count // 2
        )


def _relative_pos(
    pos: PooledPositions,
    stride: int,
    pooled_pos: PooledPositions | None = None,
    shift: int = 1,
    device: Any = None,
) -> torch.Tensor:
    """``FunnelAttentionStructure.relative_pos`` on :class:`PooledPositions`: the same ``arange``."""
    if pooled_pos is None:
        pooled_pos = pos
    ref_point = pooled_pos.first - pos.first
    num_remove = shift * pooled_pos.size
    max_dist = ref_point + num_remove * stride
    min_dist = pooled_pos.first - pos.last
    return torch.arange(max_dist, min_dist - 1, -stride, dtype=torch.long, device=device)


def funnel_relative_position_embeds(
    structure: Any, seq_len: Any, dtype: torch.dtype, device: torch.device
) -> list[list[torch.Tensor | None]]:
    """The relative-shift position embeddings of every Funnel block, from sizes.

    The same tensors as ``FunnelAttentionStructure.get_position_embeds`` with
    ``config.attention_type == "relative_shift"`` (transformers 5.24): per block
    ``[no_pooling, pooling]``, each ``[relative positions, d_model]`` float rows gathered from the
    sinusoid table of ``4 * seq_len`` relative positions (``pooling`` is ``None`` in block 0). The
    positions come from :class:`PooledPositions` instead of Python lists, so a symbolic ``seq_len``
    stays symbolic.

    Args:
        structure: the ``FunnelAttentionStructure`` (its ``config``, ``sin_dropout``, ``cos_dropout``).
        seq_len: the input sequence length (int or ``SymInt``), at least 1.
        dtype: the float dtype of the embeddings.
        device: their device.

    Returns:
        ``config.num_blocks`` pairs ``[position_embeds_no_pooling, position_embeds_pooling]``.
    """
    config = structure.config
    d_model = config.d_model
    freq_seq = torch.arange(0, d_model // 2, 1.0, dtype=torch.int64, device=device).to(dtype)
    inv_freq = 1 / (10000 ** (freq_seq / (d_model // 2)))
    rel_pos_id = torch.arange(-seq_len * 2, seq_len * 2, 1.0, dtype=torch.int64, device=device).to(dtype)
    zero_offset = seq_len * 2
    sinusoid = rel_pos_id[:, None] * inv_freq[None]
    sin_embed = structure.sin_dropout(torch.sin(sinusoid))
    cos_embed = structure.cos_dropout(torch.cos(sinusoid))
    pos_embed = torch.cat([sin_embed, cos_embed], dim=-1)

    pos = PooledPositions.of_length(seq_len)
    pooled_pos = pos
    embeds: list[list[torch.Tensor | None]] = []
    for block_index in range(config.num_blocks):
        pooling = None
        if block_index > 0:
            pooled_pos = pos.pooled(block_index, config.separate_cls, config.truncate_seq)
            rel_pos = _relative_pos(pos, 2 ** (block_index - 1), pooled_pos, shift=2, device=device)
            rel_pos = rel_pos[:, None] + zero_offset
            pooling = torch.gather(pos_embed, 0, rel_pos.expand(rel_pos.size(0), d_model))
        pos = pooled_pos
        rel_pos = _relative_pos(pos, 2**block_index, device=device)
        rel_pos = rel_pos[:, None] + zero_offset
        no_pooling = torch.gather(pos_embed, 0, rel_pos.expand(rel_pos.size(0), d_model))
        embeds.append([no_pooling, pooling])
    return embeds


@register_patch(
    BACKEND,
    *FUNNEL_POSITION_TARGETS,
    description=(
        "Funnel: the relative-shift attention's position embeddings from the sequence length's arithmetic instead "
        "of list(range(seq_len)), which torch.export evaluated to the sample's length (Guard failed: "
        "input_ids.size()[1] == 8)"
    ),
    # no upstream issue found; transformers 5.24 builds the positions as Python lists on purpose (its comment:
    # "so the relative-position arange sizes stay static for export"), which fixes the sequence length
    issue=_FUNNEL_ISSUE,
    versions=_TRANSFORMERS,
)
def funnel_relative_positions_from_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``FunnelAttentionStructure.get_position_embeds`` while capturing.

    For ``attention_type == "relative_shift"`` (the default) the replacement returns
    :func:`funnel_relative_position_embeds`, the same tensors computed from the sequence length
    without a Python list of its positions; the factorized attention (already built from
    ``torch.arange(seq_len)``) runs the original.
    """

    @functools.wraps(original)
    def get_position_embeds(self: Any, seq_len: Any, dtype: torch.dtype, device: torch.device) -> Any:
        if self.config.attention_type == "factorized":
            return original(self, seq_len, dtype, device)
        return funnel_relative_position_embeds(self, seq_len, dtype, device)

    return get_position_embeds


def funnel_upsample(
    x: torch.Tensor, stride: int, target_len: Any, separate_cls: bool = True, truncate_seq: bool = False
) -> torch.Tensor:
    """Funnel's ``upsample`` (transformers 5.24) with one zero row padded before the final slice.

    Repeats each pooled state ``stride`` times along the sequence (``<cls>`` kept apart with
    ``separate_cls``) and cuts the result to ``target_len`` rows (fewer when the repeated states
    are shorter, as the original). The padded row is always cut off, so the values and the shape
    are the original's, and the slice drops at least one row at every length, which
    ``torch.export`` keeps symbolic.

    Args:
        x: ``[batch, pooled_len, d_model]`` pooled hidden states.
        stride: how many input positions each pooled state covers (1 returns ``x``).
        target_len: the input sequence length (int or ``SymInt``).
        separate_cls: the config's ``separate_cls``: the first state is ``<cls>``, not repeated.
        truncate_seq: the config's ``truncate_seq``: the last input position was dropped when
            pooling, so ``stride - 1`` rows are padded back first (as the original does).

    Returns:
        ``[batch, target_len, d_model]``, same dtype as ``x``.
    """
    if stride == 1:
        return x
    cls = None
    if separate_cls:
        cls = x[:, :1]
        x = x[:, 1:]
    output = torch.repeat_interleave(x, repeats=stride, dim=1)
    if cls is not None and truncate_seq:
        output = torch.nn.functional.pad(output, (0, 0, 0, stride - 1, 0, 0))
    wanted = target_len - 1 if cls is not None else target_len
    end = torch.sym_min(wanted, output.shape[1])  # the original slice's end, no guard on which is smaller
    output = torch.nn.functional.pad(output, (0, 0, 0, 1, 0, 0))[:, :end]
    return output if cls is None else torch.cat([cls, output], dim=1)


@register_patch(
    BACKEND,
    *FUNNEL_UPSAMPLE_TARGETS,
    description=(
        "Funnel: the decoder's upsample pads one row before cutting to the input length, so the cut is never a "
        "no-op and torch.export keeps no stride guard tied to the sample's length (Guard failed: 192 + 256 * "
        "((-1 + seq) // 4) == -64 + 64 * seq)"
    ),
    issue=_FUNNEL_ISSUE,
    versions=_TRANSFORMERS,
)
def funnel_upsample_always_sliced(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``transformers.models.funnel.modeling_funnel.upsample`` while capturing with
    :func:`funnel_upsample` (the same values; the slice always shortens)."""

    @functools.wraps(original)
    def upsample(
        x: torch.Tensor, stride: int, target_len: Any, separate_cls: bool = True, truncate_seq: bool = False
    ) -> torch.Tensor:
        return funnel_upsample(x, stride, target_len, separate_cls=separate_cls, truncate_seq=truncate_seq)

    return upsample


# --------------------------------------------------------------------------------------------
# CANINE: the character encoder's local attention in blocks
# --------------------------------------------------------------------------------------------

#: the attention whose local path lists its windows in a Python loop over the sequence length
CANINE_LOCAL_ATTENTION_TARGETS: tuple[str, ...] = (
    "transformers.models.canine.modeling_canine.CanineAttention.forward",
)
#: "CANINE: dynamic ONNX export fixes sequence length to example input" (open; its pull requests
#: #47617 and #47987 were closed unmerged)
_CANINE_ISSUE = "https://github.com/huggingface/transformers/issues/47491"


def canine_runs_in_blocks(
    attention: Any, attention_mask: torch.Tensor | None, output_attentions: Any
) -> bool:
    """Whether :func:`canine_block_local_attention` computes ``attention``'s forward.

    True for a local ``CanineAttention`` whose windows tile the sequence (``attend_from`` and
    ``attend_to`` widths and strides all equal, the only layout ``CanineModel`` builds: every one is
    ``config.local_transformer_stride``), with neither ``always_attend_to_first_position`` nor
    ``first_position_attends_to_all``, given a 3-D ``[batch, seq, seq]`` 0/1 mask (what
    ``CanineModel`` passes) and no request for the attention probabilities.

    Args:
        attention: a ``transformers.models.canine.modeling_canine.CanineAttention``.
        attention_mask: the mask its forward got (``None``, or a 2-D to 4-D float tensor).
        output_attentions: its forward's flag.

    Returns:
        Whether the forward may be replaced; False leaves the call to the original.
    """
    width = attention.attend_from_chunk_width
    return bool(
        attention.local
        and not output_attentions
        and attention_mask is not None
        and attention_mask.ndim == 3
        and not attention.always_attend_to_first_position
        and not attention.first_position_attends_to_all
        and width
        == attention.attend_from_chunk_stride
        == attention.attend_to_chunk_width
        == attention.attend_to_chunk_stride
    )


def canine_block_local_attention(
    attention: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor]:
    """CANINE's local attention (transformers 5.24 ``CanineAttention.forward``, ``local=True``) as one
    batch of blocks.

    The original cuts the sequence into windows of ``width`` positions (the last one shorter) and
    lets each window attend to itself only. Here the states are zero-padded to
    ``ceil(seq / width) + 1`` whole windows and run as a batch of ``[width, hidden]`` blocks; each
    block's mask is the original's diagonal block of ``attention_mask``, turned into the additive mask
    ``CanineSelfAttention`` makes of a 3-D mask (``(1 - mask) * finfo.min``). Padded keys of a window
    holding real positions get ``-inf``, so their weight is exactly 0 even in a row whose every real
    key is masked (there the original spreads the weight evenly over the window's real keys, and so
    does this); the all-padding window's rows (masked with ``finfo.min``, finite) and every padded
    query row are cut off.

    The one window more than needed keeps the window count at 2 or more at every length, so a
    sample shorter than a window does not make ``torch.export`` specialise a size-1 window axis
    (``Eq((seq + 127) // 128, 1)``, which bounded the program to 128 characters), and the final cut
    always drops rows (a cut that keeps every row at some lengths is a stride guard tied to them).

    Args:
        attention: the ``CanineAttention`` (its ``self`` and ``output`` submodules and
            ``attend_from_chunk_width``); :func:`canine_runs_in_blocks` must hold.
        hidden_states: ``[batch, seq, hidden]`` character states.
        attention_mask: ``[batch, seq, seq]`` float mask, 1 where a position may be attended.

    Returns:
        ``(attention_output,)``: ``[batch, seq, hidden]``, the original's values up to float
        summation order (the padded keys add exact zeros to the softmax and value sums).
    """
    width = attention.attend_from_chunk_width
    batch, seq_len = hidden_states.shape[:2]
    windows = (seq_len + width - 1) // width + 1
    padded_len = windows * width
    # split the length into [windows, width] first, then merge batch and windows (no reshape across both)
    states = torch.nn.functional.pad(hidden_states, (0, 0, 0, padded_len - seq_len))
    states = states.unflatten(1, (windows, width)).flatten(0, 1)
    from_len, to_len = attention_mask.shape[1], attention_mask.shape[2]
    mask = torch.nn.functional.pad(attention_mask, (0, padded_len - to_len, 0, padded_len - from_len))
    # each window's rows, then its own columns among them: the diagonal blocks, by gather (OpenVINO's
    # converter refuses aten.diagonal)
    rows = mask.unflatten(1, (windows, width))  # [batch, windows, width (from), padded_len (to)]
    own_keys = torch.arange(padded_len, device=hidden_states.device).reshape(1, windows, 1, width)
    blocks = rows.gather(3, own_keys.expand(batch, windows, width, width))  # [batch, windows, width, width]
    additive = (1.0 - blocks.float()) * torch.finfo(hidden_states.dtype).min
    position = torch.arange(padded_len, device=hidden_states.device)
    padded_key = (position >= seq_len) & (position // width * width < seq_len)  # in a window with real rows
    additive = additive.masked_fill(
        padded_key.unflatten(0, (windows, width))[None, :, None, :], float("-inf")
    )
    additive = (
        additive.unsqueeze(2).flatten(0, 1).to(hidden_states.dtype)
    )  # [batch * windows, 1, width, width]
    context = attention.self(states, states, additive, False)[0]
    context = context.unflatten(0, (batch, windows)).flatten(1, 2)[:, :seq_len]
    return (attention.output(context, hidden_states),)


@register_patch(
    BACKEND,
    *CANINE_LOCAL_ATTENTION_TARGETS,
    description=(
        "CANINE: the character encoder's local attention runs its windows as one batch of zero-padded blocks "
        "instead of a Python loop over range(0, seq_len, stride), which torch.export evaluated to the sample's "
        "length (Guard failed: attention_mask.size()[1] == 8)"
    ),
    issue=_CANINE_ISSUE,
    versions=_TRANSFORMERS,
)
def canine_local_attention_in_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``CanineAttention.forward`` while capturing.

    When :func:`canine_runs_in_blocks` holds (every local attention ``CanineModel`` builds, without
    ``output_attentions``) the replacement returns :func:`canine_block_local_attention`; the global
    attention and the other local layouts run the original.
    """

    @functools.wraps(original)
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
    ) -> Any:
        if canine_runs_in_blocks(self, attention_mask, output_attentions):
            return canine_block_local_attention(self, hidden_states, attention_mask)
        return original(self, hidden_states, attention_mask, output_attentions)

    return forward


#: the module function the relative-shift attention aligns its positional scores with
FUNNEL_SHIFT_TARGETS: tuple[str, ...] = ("transformers.models.funnel.modeling_funnel._relative_shift_gather",)


def funnel_relative_shift(positional_attn: torch.Tensor, context_len: Any, shift: int) -> torch.Tensor:
    """Funnel's ``_relative_shift_gather`` (transformers 5.24) as one ``index_select``.

    The original views ``[batch, heads, seq, rel]`` as ``[batch, heads, rel, seq]``, drops the first
    ``shift`` rows, views the rest as ``[batch, heads, seq, rel - shift]`` and keeps the first
    ``context_len`` columns. In the flattened ``seq * rel`` scores of one head, output ``(i, j)`` is
    therefore element ``shift * seq + i * (rel - shift) + j``; this function gathers exactly those
    elements, so the values are the original's bit for bit.

    Args:
        positional_attn: ``[batch, heads, seq, rel]`` scores (``rel >= context_len + shift``, as
            the model builds them: ``rel = 2 * context_len + shift - 1`` up to pooling).
        context_len: the key length (int or ``SymInt``).
        shift: 1, or 2 when the queries are pooled.

    Returns:
        ``[batch, heads, seq, context_len]``, same dtype and device.
    """
    seq_len, max_rel_len = positional_attn.shape[2], positional_attn.shape[3]
    device = positional_attn.device
    rows = torch.arange(seq_len, device=device)[:, None] * (max_rel_len - shift)
    index = shift * seq_len + rows + torch.arange(context_len, device=device)[None, :]
    selected = positional_attn.flatten(2).index_select(2, index.flatten())
    return selected.unflatten(2, (seq_len, context_len))


@register_patch(
    BACKEND,
    *FUNNEL_SHIFT_TARGETS,
    description=(
        "Funnel: the relative shift of the positional attention scores selects them by index_select instead of "
        "reshape / slice / reshape, whose lowered views ExecuTorch bounded at ~1e11 (memory_planning: TypeError: "
        "bad number 81326039495 for type int32)"
    ),
    issue=_FUNNEL_ISSUE,
    versions=_TRANSFORMERS,
)
def funnel_relative_shift_by_index(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``transformers.models.funnel.modeling_funnel._relative_shift_gather`` while capturing
    with :func:`funnel_relative_shift` (the same values)."""

    @functools.wraps(original)
    def relative_shift_gather(positional_attn: torch.Tensor, context_len: Any, shift: int) -> torch.Tensor:
        return funnel_relative_shift(positional_attn, context_len, shift)

    return relative_shift_gather


# --------------------------------------------------------------------------------------------
# Longformer / LED: sliding-window and global attention with static sizes
# --------------------------------------------------------------------------------------------

#: the forwards that merge ``global_attention_mask`` into the attention mask (Longformer's model,
#: LED's encoder): the replacement records which positions can attend globally
SLIDING_WINDOW_MODEL_TARGETS: tuple[str, ...] = (
    "transformers.models.longformer.modeling_longformer.LongformerModel.forward",
    "transformers.models.led.modeling_led.LEDEncoder.forward",
)
#: the heads that build a global mask of their own when given none (Longformer's sequence
#: classification: global attention on the ``<s>`` token, position 0)
SLIDING_WINDOW_CLS_HEAD_TARGETS: tuple[str, ...] = (
    "transformers.models.longformer.modeling_longformer.LongformerForSequenceClassification.forward",
)
#: the self-attention layers that branch on ``is_global_attn`` (a data-dependent ``.item()``) and
#: size their global tensors by ``nonzero`` counts
SLIDING_WINDOW_ATTENTION_TARGETS: tuple[str, ...] = (
    "transformers.models.longformer.modeling_longformer.LongformerSelfAttention.forward",
    "transformers.models.led.modeling_led.LEDEncoderSelfAttention.forward",
)
#: the (closed, unmerged) pull request about ``if is_global_attn:`` failing torch.onnx.export; no issue
#: filed for torch.export's data-dependent guard
_SLIDING_WINDOW_ISSUE = "https://github.com/huggingface/transformers/pull/33694"

#: Global slots of the attention layers called inside a recorded forward: ``None`` when every
#: position may attend globally (a global mask was given), an int ``n`` when only the first ``n``
#: positions may (0: no global mask, local attention only; 1: the ``<s>`` token of a
#: sequence-classification head that built its own mask).
_GLOBAL_SLOTS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hfexport_global_slots", default=None
)
#: Set by :func:`sliding_window_records_cls_global_mask` while a sequence-classification head runs
#: on the global mask it built itself (only position 0 global).
_HEAD_GLOBAL_PREFIX: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hfexport_head_global_prefix", default=None
)


@register_patch(
    BACKEND,
    *SLIDING_WINDOW_MODEL_TARGETS,
    description=(
        "Longformer / LED: the forward records which positions can attend globally (none without a "
        "global_attention_mask; the partner of sliding_window_attention_with_static_sizes)"
    ),
    issue=_SLIDING_WINDOW_ISSUE,
    versions=_TRANSFORMERS,
)
def sliding_window_records_global_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``LongformerModel.forward`` / ``LEDEncoder.forward`` while capturing.

    The replacement runs the original; while it runs, :data:`_GLOBAL_SLOTS` holds the positions its
    attention layers must give global slots to: 0 when the call gave no ``global_attention_mask``
    (``None`` or absent; the merged mask then holds only "masked" and "local" scores), 1 when the
    mask is the one :func:`sliding_window_records_cls_global_mask` saw a classification head build
    (only position 0 set), ``None`` (every position) for any other mask.
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("global_attention_mask") is not None or _global_mask_in(args)
        token = _GLOBAL_SLOTS.set(_HEAD_GLOBAL_PREFIX.get() if given else 0)
        head = _HEAD_GLOBAL_PREFIX.set(None)  # a nested model forward sees its own mask
        try:
            return original(self, *args, **kwargs)
        finally:
            _HEAD_GLOBAL_PREFIX.reset(head)
            _GLOBAL_SLOTS.reset(token)

    return forward


@register_patch(
    BACKEND,
    *SLIDING_WINDOW_CLS_HEAD_TARGETS,
    description=(
        "Longformer sequence classification: a head that builds its own global mask (the <s> token, "
        "position 0) gives its attention layers one global slot instead of one per position"
    ),
    issue=_SLIDING_WINDOW_ISSUE,
    versions=_TRANSFORMERS,
)
def sliding_window_records_cls_global_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``LongformerForSequenceClassification.forward`` while capturing.

    Called without ``global_attention_mask`` the head sets global attention on position 0 only
    (``global_attention_mask[:, 0] = 1``); the replacement records that (:data:`_HEAD_GLOBAL_PREFIX`
    = 1) for :func:`sliding_window_records_global_slots`, so the layers compute one global slot,
    not one per position. A head given a mask records nothing (every position is a slot).
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("global_attention_mask") is not None or _global_mask_in(args)
        token = _HEAD_GLOBAL_PREFIX.set(None if given else 1)
        try:
            return original(self, *args, **kwargs)
        finally:
            _HEAD_GLOBAL_PREFIX.reset(token)

    return forward


#: the helpers that pad the tokens to a multiple of the attention window (Longformer's model, LED's
#: encoder)
SLIDING_WINDOW_PAD_TARGETS: tuple[str, ...] = (
    "transformers.models.longformer.modeling_longformer.LongformerModel._pad_to_window_size",
    "transformers.models.led.modeling_led.LEDEncoder._pad_to_window_size",
)
#: the pad value of each token-aligned argument of the ``_pad_to_window_size`` helpers (``None``: the
#: call's ``pad_token_id``)
_WINDOW_PAD_VALUES: dict[str, int | None] = {
    "input_ids": None,
    "position_ids": None,
    "token_type_ids": 0,
    "attention_mask": 0,
}


@register_patch(
    BACKEND,
    *SLIDING_WINDOW_PAD_TARGETS,
    description=(
        "Longformer / LED: tokens padded to window * ceil(seq / window), a length torch.export knows to be "
        "a multiple of the window, instead of seq + (window - seq % window) % window (the window views "
        "guarded on its divisibility and ExecuTorch's named dims were solved to seq = 512 * k - 504)"
    ),
    issue=_SLIDING_WINDOW_ISSUE,
    versions=_TRANSFORMERS,
)
def sliding_window_pads_to_a_window_multiple(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``LongformerModel._pad_to_window_size`` / ``LEDEncoder._pad_to_window_size`` while capturing.

    The replacement pads the token-aligned arguments (``input_ids`` and ``position_ids`` with the
    call's ``pad_token_id``, ``token_type_ids`` and ``attention_mask`` with 0) by
    ``window * ceil(seq / window) - seq`` itself, the original's padding written so the padded
    length is a visible multiple of the window, then runs the original on them (which finds nothing
    left to pad) and returns the original's tuple with that padding length first. A call with
    ``inputs_embeds`` runs the original unchanged.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def pad_to_window_size(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        if call.get("inputs_embeds") is not None or call.get("input_ids") is None:
            return original(self, *args, **kwargs)
        window = self.config.attention_window
        window = window if isinstance(window, int) else max(window)
        seq = call["input_ids"].shape[1]
        padding = window * ((seq + window - 1) // window) - seq
        for name, value in _WINDOW_PAD_VALUES.items():
            if call.get(name) is not None:
                fill = call["pad_token_id"] if value is None else value
                call[name] = torch.nn.functional.pad(call[name], (0, padding), value=fill)
        del call["self"]
        result = original(self, **call)
        return (padding, *result[1:])

    return pad_to_window_size


def _global_mask_in(args: tuple[Any, ...]) -> bool:
    """Whether positional arguments reach ``global_attention_mask`` (third of Longformer's and LED's
    forwards, after ``input_ids`` and ``attention_mask``) with a value."""
    return len(args) > 2 and args[2] is not None


@register_patch(
    BACKEND,
    *SLIDING_WINDOW_ATTENTION_TARGETS,
    description=(
        "Longformer / LED: the self-attention computed with sizes from shapes only: local windows as "
        "blocks with their neighbours, global attention over static slots masked by the global mask, "
        "instead of branching on (mask > 0).any().item() and sizing by nonzero counts "
        "(GuardOnDataDependentSymNode: Eq(u1, 1))"
    ),
    issue=_SLIDING_WINDOW_ISSUE,
    versions=_TRANSFORMERS,
)
def sliding_window_attention_with_static_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``LongformerSelfAttention.forward`` / ``LEDEncoderSelfAttention.forward`` while capturing.

    The replacement returns ``(sliding_window_self_attention(...),)`` with the global slots
    :func:`sliding_window_records_global_slots` recorded (every position when the layer is called
    outside a recorded forward): the original's values for every input, with no data-dependent
    branch or size. A call asking for attention probabilities (``output_attentions``, shaped by
    the number of global tokens) runs the original.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        call = bound.arguments
        if call.get("output_attentions"):
            return original(self, *args, **kwargs)
        attention = sliding_window_self_attention(
            self,
            call["hidden_states"],
            call["attention_mask"],
            call["is_index_masked"],
            call["is_index_global_attn"],
            global_slots=_GLOBAL_SLOTS.get(),
        )
        return (attention,)

    return forward


def sliding_window_self_attention(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    is_index_masked: torch.Tensor,
    is_index_global_attn: torch.Tensor,
    *,
    global_slots: int | None = None,
) -> torch.Tensor:
    """Longformer's self-attention (sliding window plus global tokens) with static sizes.

    Every token attends to the ``w`` tokens on each side (``w = layer.one_sided_attn_window_size``)
    and to every global token; a global token attends to every token with the layer's ``*_global``
    projections. Transformers finds the global tokens with ``nonzero`` and sizes its tensors by
    their count; here the candidates are fixed by ``global_slots`` and the ones that are not global
    get the score ``finfo.min`` (exactly as transformers' padding slots do), so their softmax weight
    is 0 and the values equal transformers' up to float rounding. The window is computed on
    blocks of ``w`` queries against their block and its two neighbours (``3w`` keys).

    Args:
        layer: a ``LongformerSelfAttention`` or ``LEDEncoderSelfAttention`` (its ``query``, ``key``,
            ``value``, ``query_global``, ``key_global``, ``value_global``, ``num_heads``,
            ``head_dim``, ``embed_dim``, ``one_sided_attn_window_size``, ``dropout``).
        hidden_states: ``(batch, seq, embed_dim)`` float; ``seq`` a multiple of
            ``one_sided_attn_window_size`` (the models pad to a multiple of the attention window).
        attention_mask: ``(batch, seq)`` float: negative for padding, 0 for local, positive for
            global tokens (the models' merged mask).
        is_index_masked: ``(batch, seq)`` bool, ``attention_mask < 0``.
        is_index_global_attn: ``(batch, seq)`` bool, ``attention_mask > 0``.
        global_slots: ``None``: every position may be global (one slot per position, the
            global part costs ``seq**2``); ``n``: only the first ``n`` positions may be (0: no
            global attention, the local path; 1: the ``<s>`` token of classification heads). A
            global token outside the slots is ignored, so ``n`` must cover every global position.

    Returns:
        ``(batch, seq, embed_dim)`` attention output, the dtype of ``hidden_states`` (before the
        layer's output projection, like the original's first output).

    Raises:
        ValueError: when ``hidden_states`` is not 3-D with ``layer.embed_dim`` features, or
            ``global_slots`` is negative.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != layer.embed_dim:
        raise ValueError(
            f"hidden_states must be (batch, seq, {layer.embed_dim}), got {tuple(hidden_states.shape)}; "
            "pass the layer's input as the model gives it (padded to the attention window)"
        )
    if global_slots is not None and global_slots < 0:
        raise ValueError(f"global_slots must be None or >= 0, got {global_slots}")
    batch, seq, embed = hidden_states.shape
    heads, head_dim, w = layer.num_heads, layer.head_dim, layer.one_sided_attn_window_size
    scale = math.sqrt(head_dim)

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, -1, heads, head_dim)

    query = split(layer.query(hidden_states) / scale)
    key = split(layer.key(hidden_states))
    value = split(layer.value(hidden_states))
    lowest = torch.finfo(query.dtype).min

    # window scores, keys that are padding or global taken out of the window (they get a slot)
    scores = _window_scores(query, key, w)
    removed = (attention_mask != 0).to(query.dtype).masked_fill(attention_mask != 0, lowest)
    ones = removed.new_ones(batch, seq, 1, 1)
    scores = scores + _window_scores(ones, removed.view(batch, seq, 1, 1), w)

    slots = seq if global_slots is None else global_slots
    if global_slots is None:
        slot_global, slot_key, slot_value = is_index_global_attn, key, value
    else:
        slot_global = is_index_global_attn[:, :slots]
        slot_key, slot_value = key[:, :slots], value[:, :slots]
    if global_slots != 0:
        slot_scores = torch.einsum("blhd,bshd->blhs", query, slot_key)
        slot_scores = slot_scores.masked_fill(~slot_global[:, None, None, :], lowest)
        scores = torch.cat((slot_scores, scores), dim=-1)

    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.masked_fill(is_index_masked[:, :, None, None], 0.0).type_as(scores)
    probs = torch.nn.functional.dropout(probs, p=layer.dropout, training=layer.training)

    if global_slots == 0:
        return _window_values(probs, value, w).reshape(batch, seq, embed)
    from_slots = torch.einsum("blhs,bshd->blhd", probs[..., :slots], slot_value)
    output = (from_slots + _window_values(probs[..., slots:], value, w)).reshape(batch, seq, embed)

    # the global tokens' own rows: full attention with the global projections
    global_query = split(layer.query_global(hidden_states[:, :slots]) / scale)
    global_key = split(layer.key_global(hidden_states))
    global_value = split(layer.value_global(hidden_states))
    global_scores = torch.einsum("bshd,blhd->bhsl", global_query, global_key)
    global_scores = global_scores.masked_fill(is_index_masked[:, None, None, :], lowest)
    global_probs = torch.nn.functional.softmax(global_scores, dim=-1, dtype=torch.float32).type_as(
        global_scores
    )
    global_probs = torch.nn.functional.dropout(global_probs, p=layer.dropout, training=layer.training)
    global_output = torch.einsum("bhsl,blhd->bshd", global_probs, global_value).reshape(batch, -1, embed)
    head = torch.where(slot_global[:, :, None], global_output, output[:, :slots])
    return head if global_slots is None else torch.cat((head, output[:, slots:]), dim=1)


def _neighbour_blocks(x: torch.Tensor, w: int) -> torch.Tensor:
    """``(rows, seq, c)`` -> ``(rows, seq // w, 3 * w, c)``: block ``b`` holds positions
    ``b*w - w .. b*w + 2*w - 1`` (zeros outside the sequence), by slices, no ``as_strided``."""
    rows, _, width = x.shape
    blocks = torch.nn.functional.pad(x, (0, 0, w, w)).view(rows, -1, w, width)
    return torch.cat((blocks[:, :-2], blocks[:, 1:-1], blocks[:, 2:]), dim=2)


def _window_scores(query: torch.Tensor, key: torch.Tensor, w: int) -> torch.Tensor:
    """Sliding-window scores ``(batch, seq, heads, 2w + 1)`` of ``(batch, seq, heads, d)`` queries
    and keys: column ``j`` holds the score against position ``i + j - w``, ``-inf`` outside the
    sequence (Longformer's layout)."""
    batch, seq, heads, depth = query.shape
    rows = batch * heads
    query_blocks = query.transpose(1, 2).reshape(rows, -1, w, depth)
    key_blocks = _neighbour_blocks(key.transpose(1, 2).reshape(rows, seq, depth), w)
    block_scores = torch.matmul(query_blocks, key_blocks.transpose(-1, -2))  # (rows, blocks, w, 3w)
    blocks = block_scores.shape[1]
    # skew: row x keeps columns x .. x + 2w (its window) by reading the rows at a stride of 3w + 1
    flat = torch.nn.functional.pad(block_scores.reshape(rows, blocks, w * 3 * w), (0, w))
    band = flat.view(rows, blocks, w, 3 * w + 1)[..., : 2 * w + 1]
    band = band.reshape(batch, heads, seq, 2 * w + 1).transpose(1, 2)
    offsets = torch.arange(seq, device=query.device)[:, None] + torch.arange(-w, w + 1, device=query.device)
    outside = (offsets < 0) | (offsets >= seq)
    return band.masked_fill(outside[None, :, None, :], float("-inf"))


def _window_values(probs: torch.Tensor, value: torch.Tensor, w: int) -> torch.Tensor:
    """``(batch, seq, heads, 2w + 1)`` window weights (layout of :func:`_window_scores`) times
    ``(batch, seq, heads, d)`` values -> ``(batch, seq, heads, d)``."""
    batch, seq, heads, depth = value.shape
    rows = batch * heads
    band = probs.transpose(1, 2).reshape(rows, -1, w, 2 * w + 1)
    blocks = band.shape[1]
    # unskew: row x's weights to columns x .. x + 2w of its block's 3w keys, zeros elsewhere
    flat = torch.nn.functional.pad(band, (0, w)).reshape(rows, blocks, w * (3 * w + 1))
    weights = flat[..., : w * 3 * w].reshape(rows, blocks, w, 3 * w)
    value_blocks = _neighbour_blocks(value.transpose(1, 2).reshape(rows, seq, depth), w)
    return torch.matmul(weights, value_blocks).reshape(batch, heads, seq, depth).transpose(1, 2)
