"""Custom aten -> ONNX translations handed to ``torch.onnx.export(custom_translation_table=...)``.

A translation is an ONNX Script function (``onnxscript.opset18`` ops called on its inputs) that
replaces torch.onnx's own translation of one or more aten overloads. Each one is a workaround
for a missing or wrong translation upstream and is registered with
:func:`register_translation`, naming the upstream issue and the version range it is needed for;
:func:`custom_translation_table` builds the table from the active ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from hfexport import registry

__all__ = [
    "COMPLEX_ATTR",
    "KIND",
    "custom_translation_table",
    "register_translation",
    "translation_entries",
]

logger = logging.getLogger(__name__)

#: Registry kind of custom aten -> ONNX translations (applied by the ONNX exporter).
KIND = "onnx_translation"
#: Registry key they are registered under.
KEY = "onnx"
#: Attribute marking a translation of complex-valued inputs (see ``register_translation(complex_inputs=True)``).
COMPLEX_ATTR = "_hfexport_complex_inputs"

_F = TypeVar("_F", bound=Callable[..., Any])

registry.register_kind(
    KIND,
    description="ONNX Script function replacing torch.onnx's translation of aten overloads (custom_translation_table)",
    targets="operators",
)


def register_translation(
    *targets: Any,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
    complex_inputs: bool = False,
) -> Callable[[_F], _F]:
    """Register an ONNX Script translation for the aten overloads ``targets``.

    An entry of kind :data:`KIND` under the ``"onnx"`` key of :mod:`hfexport.registry`, with the
    same metadata as every other workaround.

    Args:
        *targets: ``torch.ops.<namespace>.<op>.<overload>`` objects, or their names as strings
            (``"transformers::grouped_mm_fallback.default"``) for operators registered by a
            library at import time; a name that does not resolve when the table is built (the
            library does not define that operator) is skipped.
        description: one line saying what the translation fixes.
        issue: URL of the upstream issue (missing/wrong translation in torch.onnx or onnxscript).
        versions: distribution -> specifier set in which the translation is needed.
        complex_inputs: the translation serves nodes with complex-valued inputs (torch.onnx passes
            them as real tensors with a trailing axis of 2, real and imaginary part) and only
            those; torch.onnx's own translation keeps serving real inputs. Needs the ONNX patch
            :func:`hfexport_onnx.workarounds.patches.custom_translations_may_take_complex_inputs`.

    Returns:
        A decorator registering the function (idempotent per qualified name) and returning it.

    Raises:
        ValueError: no target, or invalid metadata (see :func:`hfexport.registry.register_patch`).
    """
    if not targets:
        raise ValueError(
            "register_translation needs at least one aten overload, e.g. torch.ops.aten.erf.default"
        )
    register = registry.register(KIND, KEY, *targets, description=description, issue=issue, versions=versions)
    if not complex_inputs:
        return register

    def mark(func: _F) -> _F:
        setattr(func, COMPLEX_ATTR, True)
        return register(func)

    return mark


def translation_entries() -> list[registry.RegistryEntry]:
    """Every registered translation, active or not, in registration order."""
    return registry.entries(KEY, kind=KIND)


def custom_translation_table() -> tuple[dict[Any, Callable[..., Any]], list[str]]:
    """Build the ``custom_translation_table`` for ``torch.onnx.export`` from the active translations.

    Returns:
        ``(table, names)``: ``{aten overload: onnxscript function}`` and the qualified names of
        the translations used (for the report). A later registration for the same overload wins.
    """
    table: dict[Any, Callable[..., Any]] = {}
    names: list[str] = []
    for entry in registry.active_entries(KIND, KEY):
        resolved = [t for t in (_resolve(target) for target in entry.targets) if t is not None]
        for target in resolved:
            table[target] = entry.func
        if resolved:
            names.append(entry.name)
    return table, names


def _resolve(target: Any) -> Any:
    """An operator overload from itself or from ``"namespace::op.overload"``; ``None`` if undefined."""
    if not isinstance(target, str):
        return target
    namespace, _, rest = target.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        logger.debug("operator %s is not defined here; its translation is not used", target)
        return None


# --------------------------------------------------------------------------------------------------
# Translations
# --------------------------------------------------------------------------------------------------


@register_translation(
    "transformers::grouped_mm_fallback.default",
    description=(
        "translate transformers' grouped matmul fallback (mixture-of-experts layers) as every expert's "
        "matmul followed by a per-row selection"
    ),
    issue="https://github.com/microsoft/onnxscript/issues/2795",
    versions={"torch": ">=2.12", "onnxscript": ">=0.5", "transformers": ">=5.0,<6"},
)
def grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:
    """ONNX for ``torch.ops.transformers.grouped_mm_fallback(input, weight, offs)``.

    transformers' mixture-of-experts layers sort the (token, expert) rows by expert and multiply
    each group of rows by its expert's weight. Under ``torch.export`` with float32 weights they
    call the opaque custom op ``transformers::grouped_mm_fallback``, for which torch.onnx has no
    translation (the same gap as for ``aten._grouped_mm``, microsoft/onnxscript#2795; ONNX has no
    grouped matmul operator, onnx/onnx#7589).

    Args:
        input: ``[S, K]`` rows sorted by expert.
        weight: ``[E, K, N]`` one matrix per expert.
        offs: ``[E]`` int32/int64 cumulative row counts: rows ``offs[e-1] <= r < offs[e]`` belong
            to expert ``e``.

    Returns:
        ``[S, N]``: ``input[r] @ weight[e(r)]``; rows at or after ``offs[-1]`` are 0, as in
        transformers' fallback.

    Every expert multiplies every row (``[E, S, N]``) and ``Where`` keeps each row's own expert,
    so all experts stay in the graph whatever the sample's routing was, at the price of ``E``
    times the matmul work of an ideal grouped kernel.
    """
    from onnxscript import opset18 as op

    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    rows = op.Squeeze(op.Shape(input, start=0, end=1))
    experts = op.Squeeze(op.Shape(weight, start=0, end=1))
    row_index = op.Range(zero, rows, one)  # [S]
    bounds = op.Cast(offs, to=7)  # INT64 [E]
    # expert of each row = number of bounds at or below the row index
    passed = op.Cast(op.GreaterOrEqual(op.Unsqueeze(row_index, [1]), op.Unsqueeze(bounds, [0])), to=7)
    expert_of_row = op.ReduceSum(passed, [1], keepdims=0)  # [S], E for rows past the last bound
    selected = op.Equal(
        op.Unsqueeze(op.Range(zero, experts, one), [1]), op.Unsqueeze(expert_of_row, [0])
    )  # [E, S]
    every = op.MatMul(op.Unsqueeze(input, [0]), weight)  # [E, S, N]
    kept = op.Where(op.Unsqueeze(selected, [2]), every, op.CastLike(zero, every))
    return op.ReduceSum(kept, [0], keepdims=0)


# no upstream issue found for either gap: the URL names torchlib's complex registrations (none for unsqueeze)
_TORCHLIB_COMPLEX = (
    "https://github.com/microsoft/onnxscript/blob/main/onnxscript/function_libs/torch_lib/ops/core.py"
)


@register_translation(
    torch.ops.aten.unsqueeze.default,
    description="unsqueeze a complex tensor (held as real with a trailing axis of 2; torchlib has no complex unsqueeze)",
    issue=_TORCHLIB_COMPLEX,
    versions={"torch": ">=2.12", "onnxscript": ">=0.5"},
    complex_inputs=True,
)
def unsqueeze_complex(self: Any, dim: int) -> Any:
    """ONNX for ``aten.unsqueeze(self, dim)`` with complex ``self`` (no upstream issue found:
    torchlib 0.5/0.6 registers no complex variant of ``aten::unsqueeze``, so torch.onnx fails with
    "No decompositions registered for the complex-valued input"; deepseek_v2's and llama4's
    ``freqs_cis.unsqueeze(1)`` in rotary embeddings).

    Args:
        self: ``[..., 2]`` real view of a complex tensor of rank ``r`` (ONNX rank ``r + 1``).
        dim: the torch axis, ``-r - 1 <= dim <= r``.

    Returns:
        ``[..., 2]`` real view with the new axis; a negative ``dim`` counts from before the
        trailing real/imaginary axis.
    """
    from onnxscript import opset18 as op

    axis = dim - 1 if dim < 0 else dim
    return op.Unsqueeze(self, [axis])


@register_translation(
    torch.ops.aten.mul.Tensor,
    description="multiply a complex tensor by a real scalar (torchlib's complex mul slices the scalar as complex)",
    issue=_TORCHLIB_COMPLEX,
    versions={"torch": ">=2.12", "onnxscript": ">=0.5"},
    complex_inputs=True,
)
def mul_complex(self: Any, other: Any) -> Any:
    """ONNX for ``aten.mul.Tensor(self, other)`` with a complex operand (no upstream issue found:
    torchlib's ``aten_mul_complex`` takes both operands as ``[..., 2]`` complex views and slices
    ``other[..., 0]`` / ``other[..., 1]``, which fails for a real scalar, e.g. deepseek_v2's
    ``freqs_cis * self.attention_scaling``).

    Args:
        self: ``[..., 2]`` real view of a complex tensor.
        other: a real scalar (0-d), or a ``[..., 2]`` real view of a complex tensor.

    Returns:
        ``[..., 2]``: the scaled tensor, or the complex product ``(ac - bd) + (ad + bc)i``.
    """
    from onnxscript import opset18 as op

    shape = getattr(other, "shape", None)
    if not hasattr(other, "shape") or (shape is not None and len(shape) == 0):
        return op.Mul(self, op.CastLike(other, self))
    a, b = op.Slice(self, [0], [1], [-1]), op.Slice(self, [1], [2], [-1])
    c, d = op.Slice(other, [0], [1], [-1]), op.Slice(other, [1], [2], [-1])
    real = op.Sub(op.Mul(a, c), op.Mul(b, d))
    imag = op.Add(op.Mul(a, d), op.Mul(b, c))
    return op.Concat(real, imag, axis=-1)
