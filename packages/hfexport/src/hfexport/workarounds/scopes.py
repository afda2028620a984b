"""Capture scopes: which model families get a scope of ``"capture"`` patches of their own.

A family's capture patches (time-series forecasters, text-to-audio models, object detectors, dense
prediction heads) are registered under a key ``"capture.<family>"`` so that only an export of such a
model installs them and lists them in its report. Each family module says which modeling files
make a model one of its own (its ``*_MODULES`` tuple); :func:`holds_module_from` is the test they
share, and :func:`hfexport.capture.capture` picks the first family whose test holds.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["holds_module_from"]


def holds_module_from(module: torch.nn.Module, modeling_modules: Collection[str]) -> bool:
    """Whether ``module`` or one of its submodules is a class defined in ``modeling_modules``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).
        modeling_modules: dotted Python module names (``type(sub).__module__``), e.g.
            ``"transformers.models.dpt.modeling_dpt"``.

    Returns:
        True at the first submodule (``module.modules()`` order, ``module`` itself first) whose class
        comes from one of them; False when none does.
    """
    return any(type(sub).__module__ in modeling_modules for sub in module.modules())
