"""Stage 1 of an ExecuTorch export: prepare the delegate backend.

:func:`prepare_backend` turns the configured backend name into a :class:`BackendPlan`: the
partitioners handed to ``executorch.exir.to_edge_transform_and_lower``, the device the model is
traced on, and the model adaptations the delegate needs, entered on an ``ExitStack`` so they are
undone when the export ends.

Supported backends:

- ``"xnnpack"``: CPU, through ``XnnpackPartitioner``. Mixture-of-experts layers are computed
  densely (the core's shared workaround :mod:`hfexport.workarounds.moe`, registered under
  ``"executorch.xnnpack"`` and installed with the other patches), since XNNPACK has no grouped
  matmul; the plan lists the experts modules it applies to.
- ``"cuda"``: NVIDIA GPUs, through ExecuTorch's AOTInductor-based ``CudaPartitioner``. Needs a
  CUDA build of torch with a visible GPU and the CUDA toolkit (AOTInductor compiles kernels at
  lowering time); running the program needs an ExecuTorch runtime built with the CUDA backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import Any

import torch

__all__ = [
    "SUPPORTED_BACKENDS",
    "BackendPlan",
    "cuda_unavailable_reason",
    "prepare_backend",
    "remember_runtime_backend",
    "runtime_backend",
]

logger = logging.getLogger(__name__)

# the delegate backend each lowered program manager needs at runtime, kept beside the manager
# (ExecuTorch's object) rather than as an attribute set on it; an entry goes with its manager
_RUNTIME_BACKENDS: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def remember_runtime_backend(manager: Any, backend: str | None) -> Any:
    """Record that the lowered program ``manager`` needs the runtime delegate ``backend``.

    Args:
        manager: an ``ExecutorchProgramManager`` the export lowered.
        backend: the runtime backend's name (``"XnnpackBackend"``), or ``None`` for none.

    Returns:
        ``manager``.
    """
    _RUNTIME_BACKENDS[manager] = backend
    return manager


def runtime_backend(manager: Any) -> str | None:
    """The runtime delegate :func:`remember_runtime_backend` recorded for ``manager``; ``None``
    when it needs none or was not lowered by this package (a manager built elsewhere)."""
    try:
        return _RUNTIME_BACKENDS.get(manager)
    except TypeError:  # an object that takes no weak reference was never recorded
        return None


#: Backend names :func:`prepare_backend` accepts.
SUPPORTED_BACKENDS: tuple[str, ...] = ("xnnpack", "cuda")


@dataclasses.dataclass
class BackendPlan:
    """What the lowering stages need from the chosen backend.

    Attributes:
        name: the backend (``"xnnpack"`` or ``"cuda"``).
        registry_key: the scoped registry key of its patches and fixes (``"executorch.xnnpack"``).
        partitioners: partitioner instances for ``to_edge_transform_and_lower``.
        device: device the model and inputs are traced on.
        delegate_id: the ``BackendDetails`` class name the partitioner delegates to
            (``"XnnpackBackend"``, ``"CudaBackend"``), as it appears in lowered modules.
        runtime_backend: name of the runtime backend the program needs registered in
            ``executorch.runtime``.
        adaptations: human-readable list of what was changed on the model for this backend.
    """

    name: str
    registry_key: str
    partitioners: list[Any]
    device: torch.device
    delegate_id: str
    runtime_backend: str
    adaptations: list[str] = dataclasses.field(default_factory=list)


def cuda_unavailable_reason() -> str | None:
    """Say why ``backend="cuda"`` cannot be used here, or return ``None`` when it can.

    Checks that torch sees a CUDA device and that ExecuTorch's CUDA backend imports.
    """
    if not torch.cuda.is_available():
        build = torch.version.cuda
        what = (
            f"this torch is a CUDA {build} build but sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)"
            if build
            else "this torch is a CPU-only build (install a CUDA build of torch)"
        )
        return f"torch.cuda.is_available() is False: {what}"
    try:
        import executorch.backends.cuda.cuda_partitioner  # noqa: F401
    except Exception as exc:  # ImportError or an error raised while the backend registers itself
        return f"executorch.backends.cuda cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _prepare_xnnpack(model: torch.nn.Module, stack: contextlib.ExitStack) -> BackendPlan:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from hfexport.workarounds.moe import find_experts_modules

    plan = BackendPlan(
        name="xnnpack",
        registry_key="executorch.xnnpack",
        partitioners=[XnnpackPartitioner()],
        device=torch.device("cpu"),
        delegate_id="XnnpackBackend",
        runtime_backend="XnnpackBackend",
    )
    switched = [name for name, _ in find_experts_modules(model)]
    if switched:
        plan.adaptations.append(
            f"mixture-of-experts: {len(switched)} experts module(s) computed densely "
            f"(XNNPACK has no grouped matmul): {', '.join(switched)}"
        )
    return plan


def _prepare_cuda(model: torch.nn.Module, stack: contextlib.ExitStack) -> BackendPlan:
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"backend='cuda' cannot be used: {reason}. The ExecuTorch CUDA backend needs a CUDA build of "
            "torch with a visible NVIDIA GPU and the CUDA toolkit (nvcc) for AOTInductor; to run the program, "
            "an ExecuTorch runtime built with EXECUTORCH_BUILD_CUDA=ON. Export for CPU instead with "
            "ExecutorchConfig(backend='xnnpack')."
        )
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

    device = torch.device("cuda")
    original = next((p.device for p in model.parameters()), torch.device("cpu"))
    if original != device:
        model.to(device)
        stack.callback(model.to, original)
    plan = BackendPlan(
        name="cuda",
        registry_key="executorch.cuda",
        partitioners=[CudaPartitioner([CudaBackend.generate_method_name_compile_spec("forward")])],
        device=device,
        delegate_id="CudaBackend",
        runtime_backend="CudaBackend",
    )
    if original != device:
        plan.adaptations.append(f"model moved from {original} to cuda for tracing (moved back afterwards)")
    return plan


def prepare_backend(name: str, model: torch.nn.Module, stack: contextlib.ExitStack) -> BackendPlan:
    """Prepare backend ``name`` for exporting ``model``.

    Args:
        name: ``"xnnpack"`` or ``"cuda"`` (``ExecutorchConfig.backend``).
        model: the model being exported; adaptations (MoE switch, device move) are applied to it
            and registered on ``stack`` to be undone.
        stack: the ``ExitStack`` spanning the export.

    Returns:
        The :class:`BackendPlan`.

    Raises:
        ValueError: ``name`` is not a supported backend (the message lists them).
        RuntimeError: ``name`` is ``"cuda"`` and CUDA is not usable here (the message says what
            is missing and how to export for CPU instead).
    """
    if name == "xnnpack":
        return _prepare_xnnpack(model, stack)
    if name == "cuda":
        return _prepare_cuda(model, stack)
    raise ValueError(
        f"ExecuTorch backend {name!r} is not supported; supported backends: "
        f"{', '.join(map(repr, SUPPORTED_BACKENDS))} (set ExecutorchConfig(backend=...))"
    )
