"""FNet's Fourier token mixing without complex tensors, for backends whose lowering has none.

FNet (transformers ``models/fnet``) mixes tokens with ``torch.fft.fftn(hidden_states, dim=(1, 2)).real``:
the real part of the two-dimensional discrete Fourier transform over the sequence and hidden axes. The
captured program holds ``aten._fft_c2c`` on a complex64 copy of the hidden states and
``aten.view_as_real``; ExecuTorch's edge dialect refuses complex64 tensors (``SpecViolationError``) and
OpenVINO's ``torch.export`` frontend has no rule for ``aten._fft_c2c`` / ``aten.view_as_real`` (its
TorchScript frontend's FFT rules were not carried over).

:func:`real_fourier_mixing` computes the same real part with four real matrix products: with ``C_n`` and
``S_n`` the ``n x n`` cosine and sine matrices ``cos(2 pi j k / n)`` and ``sin(2 pi j k / n)``, the DFT
matrix is ``C_n - i S_n`` and ``Re(F_s X F_h) = C_s X C_h - S_s X S_h`` for each ``[s, h]`` slice ``X``.
The sequence matrices are built from ``torch.arange`` of the (dynamic) sequence length inside the
program, so the export stays dynamic on it. ``O(s^2 h + s h^2)`` per row instead of ``O(s h log(s h))``.

:func:`register_real_fourier_mixing` registers the patch of ``FNetBasicFourierTransform.forward`` under
a backend's key, naming its upstream issue; the TPU path (``use_tpu_fourier_optimizations``, DFT
matrices from SciPy) is left as it is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.registry import register_patch

__all__ = ["FNET_FOURIER_TARGETS", "real_fourier_mixing", "register_real_fourier_mixing"]

#: the forward whose ``torch.fft.fftn(...).real`` the patch replaces (transformers 5.x)
FNET_FOURIER_TARGETS = ("transformers.models.fnet.modeling_fnet.FNetBasicFourierTransform.forward",)
_TRANSFORMERS = {"transformers": ">=5.0,<6"}


def _cos_sin(n: Any, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``2 pi (j k mod n) / n``, each ``[n, n]`` of ``dtype``; ``n`` may be
    a symbolic size. The product is reduced modulo ``n`` in int64 first, so the angles stay in
    ``[0, 2 pi)`` and float32 keeps them to ~1e-7."""
    steps = torch.arange(n, device=device, dtype=torch.int64)
    turns = (steps[:, None] * steps[None, :]) % n
    angles = turns.to(torch.float64 if dtype == torch.float64 else torch.float32) * (2 * math.pi) / n
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def real_fourier_mixing(hidden_states: torch.Tensor) -> torch.Tensor:
    """``torch.fft.fftn(hidden_states, dim=(1, 2)).real`` in real arithmetic.

    Args:
        hidden_states: ``[batch, seq, hidden]`` real floating point tensor (float32, float16,
            bfloat16 or float64); ``seq`` may be a dynamic size of a captured program.

    Returns:
        ``[batch, seq, hidden]`` of ``hidden_states``' dtype: ``C_s X C_h - S_s X S_h`` per row (see
        the module docstring); float32 agrees with the FFT within ~1e-6 relative to the largest value
        for the sizes FNet uses (seq and hidden up to 512 / 1024).

    Raises:
        TypeError: ``hidden_states`` is not a real floating point tensor.
        ValueError: ``hidden_states`` is not 3-D.
    """
    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        raise TypeError(
            "real_fourier_mixing takes a real floating point tensor, got "
            f"{getattr(hidden_states, 'dtype', type(hidden_states))}"
        )
    if hidden_states.dim() != 3:
        raise ValueError(
            f"real_fourier_mixing takes [batch, seq, hidden] hidden states, got shape {tuple(hidden_states.shape)}"
        )
    compute = torch.float32 if hidden_states.dtype in (torch.float16, torch.bfloat16) else hidden_states.dtype
    x = hidden_states.to(compute)
    cos_s, sin_s = _cos_sin(x.shape[1], compute, x.device)
    cos_h, sin_h = _cos_sin(x.shape[2], compute, x.device)
    mixed = torch.matmul(torch.matmul(cos_s, x), cos_h) - torch.matmul(torch.matmul(sin_s, x), sin_h)
    return mixed.to(hidden_states.dtype)


def _is_fftn_over_tokens_and_features(transform: Any) -> bool:
    """Whether FNet's ``fourier_transform`` is the plain ``partial(torch.fft.fftn, dim=(1, 2))``."""
    return (
        isinstance(transform, functools.partial)
        and transform.func is torch.fft.fftn
        and not transform.args
        and tuple(transform.keywords.get("dim", ())) == (1, 2)
        and set(transform.keywords) == {"dim"}
    )


def register_real_fourier_mixing(backend: str, *, issue: str, versions: Mapping[str, str]) -> None:
    """Register, under ``backend``, FNet's Fourier mixing as :func:`real_fourier_mixing`.

    The patched ``FNetBasicFourierTransform.forward`` returns ``(real_fourier_mixing(hidden_states),)``
    when the module's transform is ``partial(torch.fft.fftn, dim=(1, 2))`` (the default,
    ``use_tpu_fourier_optimizations=False``) and runs the original otherwise. Installed by
    ``apply_patches(backend)`` around the capture.

    Args:
        backend: the registry key (``"executorch"``, ``"openvino"``).
        issue: the upstream issue of that backend's missing complex / FFT support.
        versions: the backend's version range the patch is needed in.

    Raises:
        ValueError: ``backend`` is not a valid registry key, ``issue`` not an http(s) URL or
            ``versions`` invalid (:func:`hfexport.registry.register_patch`).
    """

    def fourier_mixing_in_real_arithmetic(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(self: Any, hidden_states: torch.Tensor) -> Any:
            if _is_fftn_over_tokens_and_features(getattr(self, "fourier_transform", None)):
                return (real_fourier_mixing(hidden_states),)
            return original(self, hidden_states)

        return forward

    fourier_mixing_in_real_arithmetic.__qualname__ = f"fourier_mixing_in_real_arithmetic[{backend}]"
    register_patch(
        backend,
        *FNET_FOURIER_TARGETS,
        description=(
            "fnet: the token mixing fftn(x, dim=(1, 2)).real as cosine/sine matrix products "
            "(the lowering takes no complex64 tensors / FFT operators)"
        ),
        issue=issue,
        versions={**_TRANSFORMERS, **versions},
    )(fourier_mixing_in_real_arithmetic)
