"""Attribute lookups on transformers configs, written once.

Configs name the same fact differently (``max_position_embeddings``, GPT-2's ``n_positions``,
whisper's ``max_source_positions`` / ``max_target_positions``, ``n_ctx``), and composite models
keep it in a nested text config. Every place that needs such a fact asks here.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DECODER_POSITION_ATTRIBUTES",
    "ENCODER_POSITION_ATTRIBUTES",
    "PLACEHOLDER_TOKEN_ATTRIBUTES",
    "max_positions",
    "placeholder_token_ids",
]

#: Attributes giving the maximum number of positions of the (encoder) input sequence, in order.
ENCODER_POSITION_ATTRIBUTES: tuple[str, ...] = (
    "max_position_embeddings",
    "n_positions",
    "max_source_positions",
    "n_ctx",
)
#: Attributes giving the maximum number of decoder positions, in order.
DECODER_POSITION_ATTRIBUTES: tuple[str, ...] = (
    "max_target_positions",
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
)

#: Attributes giving the token id that stands for one embedding of another modality in the
#: prompt (LLaVA's ``<image>`` tokens: the vision tower's features replace them), by modality.
PLACEHOLDER_TOKEN_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "image": ("image_token_id", "image_token_index"),
    "video": ("video_token_id", "video_token_index"),
    "audio": ("audio_token_id", "audio_token_index"),
}


def placeholder_token_ids(config: Any) -> dict[str, int]:
    """The placeholder token id of each modality a (multimodal) config declares.

    Args:
        config: a transformers config, or ``None``.

    Returns:
        ``{modality: token id}`` for the modalities of :data:`PLACEHOLDER_TOKEN_ATTRIBUTES` whose
        attribute is a non-negative int on the config; ``{}`` for a text-only model.
    """
    out: dict[str, int] = {}
    if config is None:
        return out
    for modality, names in PLACEHOLDER_TOKEN_ATTRIBUTES.items():
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out[modality] = value
                break
    return out


def _text_configs(config: Any, decoder: bool) -> list[Any]:
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            # decoder: the text output end; encoder: whatever text config there is. (transformers'
            # get_text_config(decoder=False) searches encoder-only names and misses ``text_config``.)
            text = get_text(decoder=True) if decoder else get_text()
        except (TypeError, ValueError):
            text = None
        if text is not None and text is not config:
            configs.append(text)
    return configs


def max_positions(config: Any, *, decoder: bool = False) -> tuple[int | None, str]:
    """The maximum number of positions a model config declares, and the attribute it came from.

    The config itself is searched first, then its text config (``get_text_config()``, or
    ``get_text_config(decoder=True)`` for the decoder), each through
    :data:`ENCODER_POSITION_ATTRIBUTES` or :data:`DECODER_POSITION_ATTRIBUTES` in order.

    Args:
        config: a transformers config, or ``None``.
        decoder: look for the decoder's limit (``max_target_positions`` first).

    Returns:
        ``(limit, "config.<attribute>")`` with ``limit`` a positive int, or ``(None, "")`` when
        the config declares none (or is ``None``).
    """
    if config is None:
        return None, ""
    names = DECODER_POSITION_ATTRIBUTES if decoder else ENCODER_POSITION_ATTRIBUTES
    for cfg in _text_configs(config, decoder):
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"config.{name}"
    return None, ""
