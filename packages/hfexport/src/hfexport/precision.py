"""The export dtype: which one an export computes in, and casting to it without changing the user's model.

The dtype of an export is a decision (:class:`DtypeDecision`): ``config.dtype=None`` (auto) takes
the checkpoint's dtype when the backend's runtime computes it well on CPU
(``HfExporter.native_dtypes``) and the backend's first native dtype (float32) otherwise, e.g. a
bfloat16 checkpoint exports to ONNX in float32, since ONNX Runtime's CPU provider has no bfloat16
kernels; an explicit ``config.dtype`` is used as given (or refused before capture when the backend
cannot run it). The *reference* the artifact is validated against is the eager model in float32
when the export is float32 (a bfloat16 checkpoint is cast up for the export, exactly: every
bfloat16 value is a float32 value), else the eager model in its own dtype: a bfloat16 program of
a bfloat16 checkpoint is compared with the bfloat16 eager model, by quality gates
(:mod:`hfexport.quality`), not by float32 tolerances.

:func:`model_in_dtype` swaps every floating point parameter and buffer of the model for a cast
copy (new ``Parameter`` objects, tied weights stay tied) for the ``with`` body and puts the
original objects back afterwards, also when the body raises. The user's fp32 weights are never
round-tripped through fp16: the very same tensors come back. The captured program keeps the cast
copies, so restoring the model does not touch it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from hfexport.config import is_quality_gated  # the one rule; torch-free, so configs use it too

__all__ = [
    "DtypeDecision",
    "decide_dtype",
    "is_quality_gated",
    "model_dtype",
    "model_in_dtype",
    "torch_dtype",
]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype holding most of ``model``'s floating point parameters and buffers (by element
    count; each shared tensor once), ``torch.float32`` for a model without any.

    A checkpoint that keeps a few tensors in float32 beside bfloat16 weights (norms, router
    weights) reads as bfloat16.
    """
    counts: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and id(tensor) not in seen and tensor.device.type != "meta":
            seen.add(id(tensor))
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a name is returned as is)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DtypeDecision:
    """The dtypes of one export, as recorded in the report (``ExportReport.dtype``).

    Attributes:
        export: the dtype the artifact computes in (``"float32"`` ...).
        model: the dtype of the model as given (:func:`model_dtype`; for a folder loaded by the
            CLI, the checkpoint's dtype).
        reference: the dtype of the eager model the artifact is compared with: ``"float32"`` for a
            float32 export, else ``model``.
        requested: ``config.dtype`` as given (``None``: auto).
        reason: why ``export`` was chosen, for the report and the CLI line.
    """

    export: str
    model: str
    reference: str
    requested: str | None
    reason: str

    @property
    def upcasts(self) -> bool:
        """True when the model is cast up to float32 for the export (and the reference)."""
        return self.reference == "float32" and self.model != "float32"

    @property
    def gated(self) -> bool:
        """True when the artifact computes in another dtype than its reference (quality gates)."""
        return self.export != self.reference

    def to_dict(self) -> dict[str, object]:
        """JSON-safe fields plus ``upcasts`` and ``gated``."""
        return {**asdict(self), "upcasts": self.upcasts, "gated": self.gated}

    def summary(self) -> str:
        """One line: ``float32 (checkpoint bfloat16; ONNX Runtime's CPU provider ...)``."""
        if self.export == self.model:
            return f"{self.export} (the checkpoint's; {self.reason})"
        return f"{self.export} (checkpoint {self.model}; {self.reason})"


def decide_dtype(
    model: torch.nn.Module | torch.dtype | str,
    requested: str | None,
    native: tuple[str, ...],
    runtime: str,
) -> DtypeDecision:
    """The dtype an export computes in, and its reference.

    Args:
        model: the model (its :func:`model_dtype` is used) or the checkpoint's dtype.
        requested: ``config.dtype`` (``None``: auto).
        native: the dtypes the backend's runtime computes well on CPU, preferred first
            (``HfExporter.native_dtypes``); auto keeps a model dtype found here, else takes
            ``native[0]``.
        runtime: the runtime's name for the reason (``"ONNX Runtime's CPU provider"``).

    Returns:
        The :class:`DtypeDecision`.
    """
    current = dtype_name(model if isinstance(model, (torch.dtype, str)) else model_dtype(model))
    if requested is not None:
        export, reason = str(requested), "requested"
    elif current in native:
        export, reason = current, f"{runtime} computes {current}"
    else:
        export = native[0]
        reason = f"{runtime} computes {' and '.join(native)} well here, not {current}"
    reference = "float32" if export == "float32" else current
    return DtypeDecision(
        export=export, model=current, reference=reference, requested=requested, reason=reason
    )


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
