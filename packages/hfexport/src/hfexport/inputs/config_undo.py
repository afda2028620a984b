"""Exact undo of config changes: the bookkeeping under every reversible context manager of :mod:`hfexport.inputs`.

Internal to :mod:`hfexport.inputs`: :func:`model_configs` lists every config object of a model and
:class:`ConfigChanges` records raw ``__dict__`` changes to put them back exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

__all__ = ["ConfigChanges", "model_configs"]


def model_configs(model: Any) -> list[PreTrainedConfig]:
    """Every config object of ``model``: its config, nested sub-configs, submodules' configs."""
    found: dict[int, PreTrainedConfig] = {}

    def add(config: Any) -> None:
        if not isinstance(config, PreTrainedConfig) or id(config) in found:
            return
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            add(getattr(config, key, None))

    root = getattr(model, "config", None)
    add(root)
    if isinstance(root, PreTrainedConfig):
        for decoder in (True, False):
            try:
                add(root.get_text_config(decoder=decoder, encoder=not decoder))
            except (AttributeError, TypeError, ValueError):
                pass
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            add(getattr(module, "config", None))
    return list(found.values())


class ConfigChanges:
    """Records raw ``__dict__`` changes made to configs, to undo them exactly.

    Setting a config attribute may go through a property with side effects (setting
    ``output_attentions=True`` may also set ``_attn_implementation``), so what is recorded is
    the difference of the instance dict before and after, not just the attribute set.
    """

    def __init__(self) -> None:
        self._records: list[tuple[PreTrainedConfig, str, bool, Any]] = []

    def capture(self, config: PreTrainedConfig, before: dict[str, Any]) -> None:
        after = vars(config)
        for key in list(before) + [key for key in after if key not in before]:
            if key not in after or key not in before or after[key] is not before[key]:
                self._records.append((config, key, key in before, before.get(key)))

    def setattr(self, config: PreTrainedConfig, name: str, value: Any) -> None:
        before = dict(vars(config))
        try:
            setattr(config, name, value)
        finally:
            self.capture(config, before)

    def undo(self) -> None:
        for config, key, existed, old in reversed(self._records):
            if existed:
                config.__dict__[key] = old
            else:
                config.__dict__.pop(key, None)
        self._records.clear()
