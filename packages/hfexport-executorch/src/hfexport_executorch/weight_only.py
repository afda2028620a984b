"""Weight-only quantized linears (``4w`` / ``8w``) that run on ExecuTorch's quantized kernels.

XNNPACK (executorch 1.4.1) has no GEMM for float activations times integer weights: given torchao's
weight-only form (``dequantize_affine`` feeding a float ``linear``) its partitioner decomposes the
linear, takes the dequantize along and then skips it, so the program multiplies the raw integers
(measurements in docs/backends/executorch.md and the comment above
:data:`hfexport_executorch.quantize.WEIGHT_ONLY_METHODS`; closest upstream
issue https://github.com/pytorch/executorch/issues/9855). The runtime's quantized kernel library does
have the operation: ``quantized_decomposed::mixed_linear.out`` (``kernels/quantized/cpu/op_mixed_linear.cpp``)
computes ``x @ (w_int8 * scales).T`` for a rank-2 float or half ``x``, an int8 ``[out, in]`` weight
and per-row (``[out]``) or per-group (``[out, in / group]``) scales, symmetric (no zero points).

:class:`WeightOnlyLinear` calls that operator directly, so the captured graph holds it as one node
that no partitioner claims, its weight stays int8 in the ``.pte`` (ExecuTorch's constant propagation
never folds it into a float tensor) and the runtime runs it on the quantized kernels. 4-bit values
are stored one per byte (the kernel reads int8), so a ``4w`` program is the size of an ``8w`` one;
it trades accuracy for nothing on disk and exists to match ExecuTorch's LLM export names. For 4-bit
storage use ``8da4w``.

The operator is defined by ExecuTorch (``executorch.exir.passes._quant_patterns_and_replacements``)
without a PyTorch kernel; :func:`ensure_mixed_linear` registers a CPU kernel (the same arithmetic, for
eager validation of the quantized copy) and a fake kernel (for capture) when none is registered.
"""

from __future__ import annotations

import torch

__all__ = ["WeightOnlyLinear", "ensure_mixed_linear", "weight_only_linear"]

_OP = "quantized_decomposed::mixed_linear"


def _expand_scales(scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """Per-element scales ``[out, in]`` from per-row ``[out]`` or per-group ``[out, groups]`` scales,
    grouping as the runtime kernel does (group size ``ceil(in / groups)``)."""
    if scales.dim() == 1:
        return scales[:, None].expand(-1, in_features)
    group = -(-in_features // scales.shape[1])
    return scales.repeat_interleave(group, dim=1)[:, :in_features]


def _mixed_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    weight_zero_points: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The runtime kernel's arithmetic in tensor ops: registered as the CPU kernel (eager validation of
    the quantized copy) and as the fake kernel (the same ops on fake tensors give the output shape)."""
    if weight_zero_points is not None:
        raise ValueError(
            "quantized_decomposed.mixed_linear: zero points are not supported (the runtime kernel has none)"
        )
    dequantized = weight.to(weight_scales.dtype) * _expand_scales(weight_scales, weight.shape[1])
    out = x @ dequantized.to(x.dtype).T
    return out.to(dtype) if dtype is not None else out


def ensure_mixed_linear() -> torch._ops.OpOverloadPacket:
    """Make ``torch.ops.quantized_decomposed.mixed_linear`` callable and capturable; returns it.

    Imports ExecuTorch's definition of the operator and its quantized kernel library (which registers
    the ``mixed_linear.out`` variant that ``to_executorch`` maps the node to), then registers a CPU
    kernel and a fake (meta) kernel unless ExecuTorch or PyTorch already registered one. Idempotent.

    Raises:
        RuntimeError: the installed ExecuTorch does not define the operator (executorch 1.4.1, the
            tested version, does); install one that does or use ``8da4w``.
    """
    import executorch.exir.passes._quant_patterns_and_replacements  # defines the op
    import executorch.kernels.quantized  # noqa: F401  (registers its out variant, which to_executorch needs)

    try:
        packet = torch.ops.quantized_decomposed.mixed_linear
        packet.default  # noqa: B018  (resolves the overload or raises)
    except (AttributeError, RuntimeError) as error:
        raise RuntimeError(
            f"{_OP} is not defined by the installed executorch ({error}); the 4w/8w methods need it: "
            "install the tested executorch (1.4.1) or use quantization method '8da4w'"
        ) from error
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CPU"):
        torch.library.impl(_OP, "CPU")(_mixed_linear_reference)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "Meta"):
        torch.library.register_fake(_OP)(_mixed_linear_reference)
    return packet


def weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (weight * scales).T + bias`` through ``quantized_decomposed.mixed_linear``.

    Args:
        x: activations ``[..., in]``, float32 or float16 (the kernel's two dtypes).
        weight: int8 ``[out, in]``.
        scales: ``[out]`` or ``[out, in / group]``, the dtype of ``x``.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]`` in the dtype of ``x``.

    Raises:
        AttributeError / NotImplementedError: :func:`ensure_mixed_linear` was not called first (the
            operator is undefined or has no kernel); :class:`WeightOnlyLinear` calls it.
    """
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.quantized_decomposed.mixed_linear.default(flat, weight, scales, None, None)
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


class WeightOnlyLinear(torch.nn.Module):
    """An ``nn.Linear`` with symmetric int8-stored weights (8-bit per row or 4-bit per group).

    Args:
        linear: the float module to quantize (not modified).
        bits: 8 (values in [-127, 127], one scale per output row) or 4 (values in [-8, 7], one scale
            per ``group_size`` input columns).
        group_size: elements per scale for ``bits=4``; must divide ``in_features``.
        scales: positive scales to round with instead of the default, float ``[out, in / group_size]``
            for ``bits=4`` (e.g. :func:`hfexport_executorch.quantize.mse_group_scales`, what ``4w``
            uses) or ``[out]`` for ``bits=8``.

    Raises:
        ValueError: ``bits`` is not 4 or 8, ``group_size`` does not divide ``in_features``, or
            ``scales`` has another shape or a scale that is not positive.
        RuntimeError: from :func:`ensure_mixed_linear` (the installed ExecuTorch lacks the operator).

    Without ``scales``, the scale of a row or group is its largest absolute weight over the largest
    positive level (127 or 7), so the largest weight is represented exactly; weights round to the
    nearest level (clipped to the levels when ``scales`` are smaller). Buffers: ``weight`` int8
    ``[out, in]``, ``scales`` float ``[out]`` or ``[out, in / group_size]`` (the linear's dtype);
    ``bias`` stays a float parameter.
    """

    def __init__(
        self,
        linear: torch.nn.Linear,
        bits: int,
        group_size: int | None = None,
        *,
        scales: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        ensure_mixed_linear()
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        if bits == 4:
            if not group_size or in_features % group_size:
                raise ValueError(
                    f"group_size {group_size!r} must divide in_features {in_features} for 4-bit weights"
                )
            grouped = weight.float().reshape(out_features, in_features // group_size, group_size)
        else:
            grouped = weight.float().reshape(out_features, 1, in_features)
        top = 7 if bits == 4 else 127
        if scales is None:
            scales = grouped.abs().amax(dim=-1) / top
            scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        else:
            scales = scales.detach().float().reshape(out_features, -1)
            if tuple(scales.shape) != tuple(grouped.shape[:2]) or not bool((scales > 0).all()):
                expected = (out_features, grouped.shape[1]) if bits == 4 else (out_features,)
                raise ValueError(
                    f"scales must be positive with shape {expected} for {bits}-bit weights of "
                    f"{tuple(weight.shape)}; got {tuple(scales.shape)}"
                )
        levels = torch.clamp(torch.round(grouped / scales[..., None]), -top - 1, top)
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = group_size if bits == 4 else None
        self.register_buffer("weight", levels.reshape(out_features, in_features).to(torch.int8))
        self.register_buffer("scales", (scales if bits == 4 else scales[:, 0]).to(weight.dtype))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in]`` -> ``[..., out]`` in the dtype of ``x``."""
        return weight_only_linear(x, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}"
        )
