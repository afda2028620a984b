"""Capture in a reduced compute dtype (``config.dtype``) without changing the user's model.

:func:`model_in_dtype` swaps every floating point parameter and buffer of the model for a cast
copy (new ``Parameter`` objects, tied weights stay tied) for the ``with`` body and puts the
original objects back afterwards, also when the body raises. The user's fp32 weights are never
round-tripped through fp16: the very same tensors come back. The captured program keeps the cast
copies, so restoring the model does not touch it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hfexport.config import is_quality_gated  # the one rule; torch-free, so configs use it too

__all__ = ["is_quality_gated", "model_in_dtype", "torch_dtype"]


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float16"`` -> ``torch.float16`` (a ``torch.dtype`` is returned as is).

    Raises:
        ValueError: not a floating point dtype name.
    """
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"dtype={name!r} is not a floating point torch dtype; allowed: float32, float16, bfloat16"
        )
    return value


@contextlib.contextmanager
def model_in_dtype(model: torch.nn.Module, dtype: str | torch.dtype) -> Iterator[torch.nn.Module]:
    """Cast ``model``'s floating point parameters and buffers to ``dtype`` for the ``with`` body.

    Args:
        model: any ``nn.Module``; modified in place for the body only.
        dtype: target dtype (``"float16"``, ``torch.bfloat16`` ...). ``float32`` on an fp32 model
            changes nothing.

    Yields:
        The same model object, its float tensors in ``dtype`` (``model.config.dtype`` too, for
        transformers models).

    On exit every module gets its original ``Parameter``/buffer objects back (weights dtype,
    values, identity and ``requires_grad`` included) and the config its original dtype.
    """
    target = torch_dtype(dtype)
    saved: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
    replaced: dict[int, torch.Tensor] = {}
    config = getattr(model, "config", None)
    had_dtype = config is not None and "dtype" in vars(config)
    old_dtype = vars(config).get("dtype") if had_dtype else None
    try:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                store = getattr(module, kind)
                for name, tensor in list(store.items()):
                    if tensor is None or not tensor.is_floating_point() or tensor.dtype == target:
                        continue
                    saved.append((module, kind, name, tensor))
                    new = replaced.get(id(tensor))
                    if new is None:
                        if kind == "_parameters":
                            new = torch.nn.Parameter(
                                tensor.detach().to(target), requires_grad=tensor.requires_grad
                            )
                        else:
                            new = tensor.detach().to(target)
                        replaced[id(tensor)] = new
                    store[name] = new
        if config is not None and had_dtype:
            config.dtype = target
        yield model
    finally:
        for module, kind, name, tensor in reversed(saved):
            getattr(module, kind)[name] = tensor
        if config is not None and had_dtype:
            config.__dict__["dtype"] = old_dtype
