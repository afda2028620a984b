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
    "KEY",
    "VISION_LANGUAGE_MODULES",
    "bidirectional_prompt_mask_as_eager_runs_it",
    "block_diagonal_mask",
    "capture_key",
    "packed_vision_attention_as_one_masked_call",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.vision_language"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
VISION_LANGUAGE_MODULES: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}" for name in ("qwen2_5_vl", "qwen2_5_omni")
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
        configured with ``use_bidirectional_attention`` (PaliGemma's language model); ``"capture"``
        otherwise, so other models' reports do not list these patches.
    """
    if holds_module_from(module, VISION_LANGUAGE_MODULES) or _bidirectional_language_model(module):
        return KEY
    return CAPTURE


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
