"""Capture workarounds of vision-language models (key ``"capture.vision_language"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` only when the captured module holds a module of one of the modeling
files of :data:`VISION_LANGUAGE_MODULES` (:func:`capture_key`), and puts the original back
afterwards; the eager model the exporter validates against runs the original code.

- :func:`packed_vision_attention_as_one_masked_call`: Qwen2.5-VL's (and Qwen2.5-Omni's) vision
  attention over packed windows and images is one SDPA call with a block-diagonal mask
  (:func:`block_diagonal_mask`) instead of a Python loop over ``torch.split(lengths.tolist())``,
  so the image encoder's program serves any window count.
- :func:`packed_vision_attention_with_out_proj`: the same for MiniMax-M3-VL's vision attention
  (separate q / k / v projections, ``out_proj``, a ``(output, weights)`` result), whose per-image
  loop left unbacked sizes that ExecuTorch's memory planning could not guard on.
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
    "CAPTURE",
    "KEY",
    "VISION_LANGUAGE_MODULES",
    "block_diagonal_mask",
    "capture_key",
    "packed_vision_attention_as_one_masked_call",
    "packed_vision_attention_with_out_proj",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.vision_language"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
VISION_LANGUAGE_MODULES: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}" for name in ("qwen2_5_vl", "qwen2_5_omni", "minimax_m3_vl")
)


def capture_key(module: torch.nn.Module) -> str:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, a component, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.vision_language"``: the ``"capture"`` entries and this module's)
        when ``module`` or one of its submodules is defined in one of
        :data:`VISION_LANGUAGE_MODULES`; ``"capture"`` otherwise, so other models' reports do not
        list these patches.
    """
    return KEY if holds_module_from(module, VISION_LANGUAGE_MODULES) else CAPTURE


def block_diagonal_mask(cu_seqlens: torch.Tensor, length: Any) -> torch.Tensor:
    """Bool ``[length, length]``: True where query and key rows lie in the same packed segment.

    ``cu_seqlens`` holds the segment boundaries ``[0, b1, ..., length]`` (int); a row's segment is
    the number of inner boundaries at or below it: a 1 scattered at each inner boundary, summed
    cumulatively. No ``.tolist()``, no ``searchsorted``, and no broadcast against the boundaries
    (whose count is 0 or 1 for a one-window sample, which ``torch.export`` would specialise), so it
    traces on a dynamic segment count and every runtime has its operators.
    """
    inner = cu_seqlens[1:-1].to(torch.int64)
    starts = torch.zeros(length, dtype=torch.int64, device=cu_seqlens.device)
    segment = starts.scatter_add(0, inner, torch.ones_like(inner)).cumsum(0)
    return segment[:, None] == segment[None, :]


@register_patch(
    KEY,
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention.forward",
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionAttention.forward",
    description=(
        "a windowed vision encoder's attention over packed windows is one SDPA call with a block-diagonal mask "
        "instead of a Python loop over torch.split(lengths.tolist()), which keeps the sample's window count"
    ),
    issue="https://github.com/pytorch/pytorch/issues/158786",
    versions={"transformers": ">=5.0,<6"},
)
def packed_vision_attention_as_one_masked_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace Qwen2.5-VL's (and Qwen2.5-Omni's) vision attention ``forward`` while capturing.

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
        if hasattr(self, "qkv"):  # Qwen2.5-VL: one fused projection
            qkv = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
            query, key, value = qkv.unbind(0)
        else:  # Qwen2.5-Omni: q, k and v projections
            query, key, value = (
                proj(hidden_states).reshape(length, self.num_heads, -1) for proj in (self.q, self.k, self.v)
            )
        cos, sin = position_embeddings
        query, key = rotary(query, key, cos, sin)
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
