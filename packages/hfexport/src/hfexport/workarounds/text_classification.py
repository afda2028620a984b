"""Capture workarounds of text-classification heads (key ``"capture.text_classification"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for the capture, but only when the captured
module holds a module of one of :data:`TEXT_CLASSIFICATION_MODULES` (:func:`capture_key`), and puts
the original back afterwards (also when the capture fails); the eager model the exporter validates
against runs the original code.

- :func:`pool_last_eos_by_position`: the sequence-classification heads of the encoder-decoders
  (BART, mBART, PLBart, MVP, BigBird-Pegasus, T5, mT5, UMT5) pool the decoder state at the last
  ``</s>`` of ``input_ids`` with a boolean-mask index, ``hidden[input_ids == eos]``, reshaped to
  ``[batch, -1, hidden]``: a result whose size depends on the token values. ``torch.export`` keeps
  it as an unbacked size, and the backends do not all run it: OpenVINO's CPU plugin refuses the
  program at its first inference (``Squeeze node ... Can not clone with new dims``). The patch picks
  the same state by position: the index of the last ``</s>`` per row,
  ``argmax(arange(seq) * (input_ids == eos))``, gathered with ``hidden[arange(batch), index]``.
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
    "EOS_POOLED_TARGETS",
    "KEY",
    "TEXT_CLASSIFICATION_MODULES",
    "capture_key",
    "last_token_positions",
    "pool_last_eos_by_position",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.text_classification"
BACKEND = KEY

_TRANSFORMERS = {"transformers": ">=5.23,<6"}
# the boolean-mask pooling ONNX export cannot follow; the PR changing it to an index_select was closed
_EOS_POOLING_ISSUE = "https://github.com/huggingface/transformers/pull/8564"

#: (modeling module, sequence-classification class) of the heads pooled at the last ``</s>``
_EOS_POOLED: tuple[tuple[str, str], ...] = (
    ("transformers.models.bart.modeling_bart", "BartForSequenceClassification"),
    ("transformers.models.mbart.modeling_mbart", "MBartForSequenceClassification"),
    ("transformers.models.plbart.modeling_plbart", "PLBartForSequenceClassification"),
    ("transformers.models.mvp.modeling_mvp", "MvpForSequenceClassification"),
    (
        "transformers.models.bigbird_pegasus.modeling_bigbird_pegasus",
        "BigBirdPegasusForSequenceClassification",
    ),
    ("transformers.models.t5.modeling_t5", "T5ForSequenceClassification"),
    ("transformers.models.mt5.modeling_mt5", "MT5ForSequenceClassification"),
    ("transformers.models.umt5.modeling_umt5", "UMT5ForSequenceClassification"),
)
#: the forwards :func:`pool_last_eos_by_position` replaces
EOS_POOLED_TARGETS: tuple[str, ...] = tuple(f"{module}.{cls}.forward" for module, cls in _EOS_POOLED)
#: transformers modeling modules whose models the capture patches of this module concern
TEXT_CLASSIFICATION_MODULES: tuple[str, ...] = tuple(module for module, _ in _EOS_POOLED)
_EOS_POOLED_CLASSES = frozenset(cls for _, cls in _EOS_POOLED)


def capture_key(module: torch.nn.Module) -> str | None:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.text_classification"``: the ``"capture"`` entries and this
        module's) when ``module`` or one of its submodules is one of the sequence-classification
        heads of :data:`EOS_POOLED_TARGETS`; ``None`` otherwise (the same architectures' generation
        models included), so other models' reports do not list these patches.
    """
    if not holds_module_from(module, TEXT_CLASSIFICATION_MODULES):
        return None
    return KEY if any(type(sub).__name__ in _EOS_POOLED_CLASSES for sub in module.modules()) else None


def last_token_positions(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """The position of the last ``token_id`` in each row of ``input_ids``.

    Args:
        input_ids: ``[batch, seq]`` integer token ids.
        token_id: the id looked for (``eos_token_id``).

    Returns:
        ``[batch]`` int64 positions in ``[0, seq)``; a row without ``token_id`` gives 0 (the
        original head refuses such a row with a ``ValueError``).

    Raises:
        ValueError: ``input_ids`` is not 2-D.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    steps = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.int64)
    return (steps * input_ids.eq(token_id).to(torch.int64)).argmax(dim=-1)


@register_patch(
    BACKEND,
    *EOS_POOLED_TARGETS,
    description=(
        "BART/T5-family sequence classification: the decoder state at the last </s> is gathered by "
        "position instead of a boolean-mask index whose size depends on the token values"
    ),
    issue=_EOS_POOLING_ISSUE,
    versions=_TRANSFORMERS,
)
def pool_last_eos_by_position(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace the ``forward`` of the heads in :data:`EOS_POOLED_TARGETS` while capturing.

    For a call with ``input_ids``, no ``labels`` and no ``encoder_outputs`` the replacement runs
    the head's base model (``model`` for BART-likes, ``transformer`` for T5-likes; the T5-likes'
    decoder ids are ``input_ids`` shifted right, as their head does), pools the decoder's
    ``[batch, seq, hidden]`` states at :func:`last_token_positions` of ``eos_token_id``, applies
    ``classification_head`` and returns a ``Seq2SeqSequenceClassifierOutput`` with the base
    model's other outputs, as the original does. Where every row holds the same number (>= 1) of
    ``</s>``, which the original requires, the pooled state is the one the original selects, so
    the logits are equal. Any other call runs the original.
    """
    from transformers.modeling_outputs import Seq2SeqSequenceClassifierOutput

    @functools.wraps(original)
    def forward(
        self: Any,
        input_ids: Any = None,
        attention_mask: Any = None,
        decoder_input_ids: Any = None,
        decoder_attention_mask: Any = None,
        encoder_outputs: Any = None,
        inputs_embeds: Any = None,
        decoder_inputs_embeds: Any = None,
        labels: Any = None,
        use_cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        base = getattr(self, "transformer", None) or getattr(self, "model", None)
        if (
            not isinstance(input_ids, torch.Tensor)
            or labels is not None
            or encoder_outputs is not None
            or base is None
        ):
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask,
                encoder_outputs=encoder_outputs,
                inputs_embeds=inputs_embeds,
                decoder_inputs_embeds=decoder_inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                **kwargs,
            )
        if decoder_input_ids is None and decoder_inputs_embeds is None and hasattr(self, "_shift_right"):
            decoder_input_ids = self._shift_right(input_ids)  # the T5-likes' head shifts; BART's model does
        outputs = base(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs[0]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        positions = last_token_positions(input_ids, int(self.config.eos_token_id)).to(hidden.device)
        logits = self.classification_head(hidden[rows, positions])
        rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return Seq2SeqSequenceClassifierOutput(logits=logits, **rest)

    return forward
