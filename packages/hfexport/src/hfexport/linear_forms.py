"""Module rewrites that quantizers need, shared by the backends that quantize weights.

Weight quantizers (torchao's ``quantize_``) match ``nn.Linear`` and ``nn.Embedding`` modules.
Transformers' GPT-2 family (gpt2, gpt_neo's ancestors, IgLM ...) computes its projections with
``transformers.pytorch_utils.Conv1D`` instead; :func:`conv1d_as_linear` turns those into
equivalent ``nn.Linear`` modules. :func:`matches_any` is the ``QuantizationConfig.exclude`` test and
:func:`weight_bytes` the size of a model's weights (the "before" of a size comparison),
:func:`eager_float32_bytes` the same counted as float32.

Everything here changes the module it is given: call it on a copy of the user's model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch

__all__ = ["conv1d_as_linear", "matches_any", "weight_bytes"]


def conv1d_as_linear(model: torch.nn.Module) -> list[str]:
    """Replace every ``transformers.pytorch_utils.Conv1D`` in ``model`` (in place) by an ``nn.Linear``.

    ``Conv1D(nf, nx)`` computes ``x @ weight + bias`` with ``weight`` ``[nx, nf]``; the replacement
    ``nn.Linear(nx, nf)`` holds ``weight.T`` ``[nf, nx]`` (same dtype) and the same bias, so outputs
    agree up to float reassociation.

    Args:
        model: any module; modules of other types are left alone.

    Returns:
        The qualified names of the replaced modules, in module order.
    """
    from transformers.pytorch_utils import Conv1D

    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not Conv1D:
                continue
            weight = child.weight.detach()
            linear = torch.nn.Linear(
                weight.shape[0], weight.shape[1], bias=child.bias is not None, dtype=weight.dtype
            )
            with torch.no_grad():
                linear.weight.copy_(weight.t())
                if child.bias is not None:
                    linear.bias.copy_(child.bias.detach())
            linear.train(child.training)
            setattr(module, child_name, linear)
            replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """True when the qualified module ``name`` equals, or ``fnmatch``-matches, one of ``patterns``."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def eager_float32_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s floating point parameters and buffers counted as float32 (each tensor
    once, tied ones once): the eager fp32 size a reduced-precision or quantized artifact is compared
    with, whatever dtype the model is in (a bf16 checkpoint counts 4 bytes per element)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * 4
    return total


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage counted once (tied weights once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
