"""Model state (training flags, ``requires_grad``, config attributes) put back after an export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hfexport.input_checks import check_model
from hfexport.inputs.config_undo import ConfigChanges, model_configs

__all__ = ["restore_model_state"]


@contextlib.contextmanager
def restore_model_state(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put the model in eval mode for the ``with`` body, then restore what may have changed.

    Snapshots every submodule's ``training`` flag, every parameter's ``requires_grad`` flag and
    the attributes of every config of the model; restores them on exit, also when the body
    raises (config attributes added inside are deleted, changed ones get their old object
    back). Weights are not copied: export must never modify them.

    Args:
        model: the model (any ``torch.nn.Module``).

    Yields:
        The same model, in eval mode.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    check_model(model)
    training = [(module, module.training) for module in model.modules()]
    requires_grad = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    configs = model_configs(model)
    snapshots = [(config, dict(vars(config))) for config in configs]
    try:
        model.eval()
        yield model
    finally:
        for module, flag in training:
            module.training = flag
        for parameter, flag in requires_grad:
            if parameter.requires_grad != flag:
                parameter.requires_grad_(flag)
        changes = ConfigChanges()
        for config, snapshot in snapshots:
            changes.capture(config, snapshot)
        changes.undo()
