"""The attention switch: an attention implementation torch.export can trace, for the ``with`` body."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from transformers.configuration_utils import PreTrainedConfig

from hfexport.errors import UnsupportedModelError
from hfexport.inputs.config_undo import ConfigChanges, model_configs

__all__ = ["attention_for_export"]

logger = logging.getLogger(__name__)

# Attention implementations that torch.export cannot trace (custom kernels, flex's
# higher-order op, paged attention with its own cache).
_UNTRACEABLE_ATTENTION_PREFIXES: tuple[str, ...] = ("flash_attention", "flex_attention", "paged|", "paged_")


def _is_untraceable_attention(implementation: Any) -> bool:
    if not isinstance(implementation, str) or implementation in ("eager", "sdpa"):
        return False
    # Hub kernels are named "org/repo[:kernel]".
    return implementation.startswith(_UNTRACEABLE_ATTENTION_PREFIXES) or "/" in implementation


def _attention_tree(config: PreTrainedConfig) -> dict[str, Any]:
    """Nested ``set_attn_implementation`` request: sdpa where untraceable, unchanged elsewhere."""
    current = config._attn_implementation
    tree: dict[str, Any] = {"": "sdpa" if _is_untraceable_attention(current) else current}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig):
            tree[key] = _attention_tree(sub)
    return tree


@contextlib.contextmanager
def attention_for_export(model: Any) -> Iterator[None]:
    """Switch untraceable attention implementations to ``sdpa`` for the ``with`` body.

    ``torch.export`` traces ``eager`` and ``sdpa`` attention; flash attention kernels
    (``flash_attention_2/3/4``), ``flex_attention``, paged attention and hub kernels do not
    trace. Configs (the model's, its sub-configs', its sub-models') using one of those are
    switched to ``sdpa`` through ``model.set_attn_implementation``; configs on ``eager`` or
    ``sdpa`` are left alone, so a model with nothing to switch is not touched. On exit, also
    when the body raises, every config gets its exact previous implementation back (written
    directly, so restoring a flash implementation does not need flash-attn installed).

    Args:
        model: a ``PreTrainedModel``; other objects are passed through untouched.

    Yields:
        Nothing; inside the body every attention implementation is ``eager`` or ``sdpa``.

    Raises:
        UnsupportedModelError: an untraceable implementation is set and the model (or one of
            its sub-models) cannot switch to sdpa: no sdpa support (``_supports_sdpa`` is
            False), or no dynamic switching. The message says to load the model with
            ``attn_implementation="sdpa"`` or ``"eager"``.
    """
    configs = model_configs(model)
    untraceable = {
        type(config).__name__: config._attn_implementation
        for config in configs
        if _is_untraceable_attention(getattr(config, "_attn_implementation", None))
    }
    if not untraceable:
        yield
        return

    def unsupported(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{type(model).__name__} uses attention {untraceable}, which torch.export cannot trace, and it "
            f"cannot be switched to sdpa: {reason}. Export needs sdpa or eager attention: load the model with "
            f'from_pretrained(..., attn_implementation="sdpa") or, if sdpa is not supported, '
            f'attn_implementation="eager".'
        )

    if not getattr(model, "_supports_sdpa", False):
        raise unsupported(f"{type(model).__name__} does not support sdpa")
    set_attn_implementation = getattr(model, "set_attn_implementation", None)
    if set_attn_implementation is None:
        raise unsupported(f"{type(model).__name__} has no set_attn_implementation")

    changes = ConfigChanges()
    try:
        before = {id(config): dict(vars(config)) for config in configs}
        try:
            set_attn_implementation(_attention_tree(model.config))
        except (ValueError, ImportError) as error:
            raise unsupported(str(error)) from error
        finally:
            for config in configs:
                changes.capture(config, before[id(config)])
        still = [
            type(config).__name__
            for config in configs
            if _is_untraceable_attention(getattr(config, "_attn_implementation", None))
        ]
        if still:
            raise unsupported(f"the switch did not apply to {still} (no dynamic attention dispatch)")
        logger.info("attention %s switched to sdpa for export", untraceable)
        yield
    finally:
        changes.undo()
