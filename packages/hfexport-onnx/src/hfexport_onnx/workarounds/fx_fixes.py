"""FX fixes applied to the captured program before translation (``register_fx_node_fix("onnx")``).

Each fix ``(gm, node) -> bool`` rewrites one node of the captured graph (True = consumed), or
``(exported_program) -> None`` rewrites the whole program, and names the upstream issue it works
around and the version range it is needed for.
"""

from __future__ import annotations

import logging

import torch

from hfexport.registry import register_fx_node_fix, register_fx_program_fix
from hfexport.workarounds.assertions import drop_runtime_assertions

__all__ = [
    "repeat_interleave_without_output_size",
    "runtime_assertions_dropped_before_translation",
    "scalar_minus_integer_tensor_in_float",
    "squeeze_of_a_non_unit_axis_dropped",
]

logger = logging.getLogger(__name__)


@register_fx_program_fix(
    "onnx",
    description=(
        "erase runtime assertions (torch._check / transformers' torch_compilable_check) and the computation only "
        "they use before translation: torch.onnx erases the assertions after decomposition without dead-code "
        "elimination, so their condition (aten._is_all_true, no ONNX function) still reaches translation"
    ),
    issue="https://github.com/pytorch/pytorch/pull/150206",
    versions={"torch": ">=2.12"},  # still needed on torch 2.13 (torch/onnx/_internal/exporter/_core.py)
)
def runtime_assertions_dropped_before_translation(exported_program: torch.export.ExportedProgram) -> None:
    """Erase the program's runtime assertions and their dead condition chain before translation.

    ``torch.onnx.export(dynamo=True)`` cannot express an assertion in ONNX and erases
    ``aten._assert_async`` / ``aten._assert_scalar`` in ``remove_assertion_nodes``, after
    decomposition and without dead-code elimination (pytorch/pytorch#150206 proposed moving it
    before decomposition; torch 2.13 still runs it after), so the computation of the condition
    stays and is translated. transformers 5.24's ``torch_compilable_check`` on a tensor condition
    (llava's "Image features and image tokens do not match" check, the same in many
    image-text models) is captured as ``aten._is_all_true -> item -> _assert_scalar``, and
    ``aten._is_all_true`` has no ONNX function (``DispatchError``). The ONNX model does not
    check anything either way; this fix only removes the dead condition first
    (:func:`hfexport.workarounds.assertions.drop_runtime_assertions`). Values are unchanged.
    """
    dropped = drop_runtime_assertions(exported_program)
    if dropped.assertions:
        logger.info(
            "ONNX cannot run runtime assertions: dropped %d (and %d node(s) computing their conditions)",
            dropped.assertions,
            dropped.dead_nodes,
        )


@register_fx_node_fix(
    "onnx",
    description=(
        "scalar - integer tensor (aten.rsub.Scalar, e.g. XLNet's 1.0 - attention_mask) computes on the tensor cast "
        "to the result's float dtype first: torch.onnx's type-promotion pass failed on it (ConversionError: Cannot "
        "find a compatible OpOverload for aten.sub)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/194381",
    versions={"torch": ">=2.13"},  # a regression of torch 2.13.0; 2.12 exported it
)
def scalar_minus_integer_tensor_in_float(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Cast the tensor operand of ``aten.rsub.Scalar(x, s)`` (``s - x``) to the result's dtype when ``x`` is an
    integer or bool tensor and the result is floating point.

    ``1.0 - mask`` on an int64 mask gives float32 (type promotion); torch 2.13's ONNX type-promotion pass
    rebuilds it as ``aten.sub(1.0, ...)``, which no overload accepts (pytorch/pytorch#194381). Casting ``x``
    first gives the same values (the integers are exact in the float dtype up to its mantissa, as promotion
    casts them anyway) and an ``rsub`` on a float tensor, which exports.

    Returns:
        True when the node was rewritten; any other node, or an ``rsub`` whose operand is already floating
        point or whose result is not, is left alone (False).
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.rsub.Scalar or not node.args:
        return False
    operand = node.args[0]
    operand_val = getattr(operand, "meta", {}).get("val")
    result_val = node.meta.get("val")
    if not isinstance(operand_val, torch.Tensor) or not isinstance(result_val, torch.Tensor):
        return False
    if operand_val.is_floating_point() or operand_val.is_complex() or not result_val.is_floating_point():
        return False
    graph = node.graph
    with graph.inserting_before(node):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (operand,), {"dtype": result_val.dtype})
    cast.meta["val"] = operand_val.to(result_val.dtype)
    node.replace_input_with(operand, cast)
    logger.debug(
        "rsub.Scalar on %s: operand cast to %s before translation", operand_val.dtype, result_val.dtype
    )
    return True


@register_fx_node_fix(
    "onnx",
    description=(
        "aten.squeeze.dim of an axis whose size is known and not 1 (a no-op in PyTorch: Mistral3's "
        "image_features.squeeze(0) on [tokens, hidden]) is removed: onnxscript translates it to an ONNX Squeeze, "
        "which requires the axis to be 1 (onnxruntime: ShapeInferenceError 'Dimension of input 0 must be 1')"
    ),
    issue="https://github.com/onnx/onnx/issues/3764",
    versions={"onnxscript": ">=0.5"},  # aten_squeeze_dim of onnxscript 0.7.2 still emits Squeeze as is
)
def squeeze_of_a_non_unit_axis_dropped(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.squeeze.dim(x, d)`` (or ``squeeze.dims``) by ``x`` when none of the squeezed
    axes can be 1.

    PyTorch's ``squeeze(d)`` leaves a tensor whose axis ``d`` is not 1 unchanged; ONNX's Squeeze
    refuses it (onnx/onnx#3764), and onnxscript's ``aten_squeeze_dim`` emits Squeeze without
    looking at the size. An axis whose size is a symbol (not known to be >= 2) is left to the
    translation.

    Returns:
        True when the node was removed (its users take ``x``); False for any other node, or when an
        axis may be 1.
    """
    targets = (torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims)
    if node.op != "call_function" or node.target not in targets or len(node.args) < 2:
        return False
    source = node.args[0]
    value = getattr(source, "meta", {}).get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    for dim in dims:
        size = value.shape[int(dim) % value.dim()]
        if not isinstance(size, int) or size == 1:
            return False
    node.replace_all_uses_with(source)
    node.graph.erase_node(node)
    logger.debug(
        "squeeze of axes %s of a %s tensor: a no-op, removed before translation", dims, tuple(value.shape)
    )
    return True


@register_fx_node_fix(
    "onnx",
    description=(
        "aten.repeat_interleave(..., output_size=n) loses its output_size hint (the result is the same): "
        "onnxscript's aten_repeat_interleave_Tensor takes no such argument (Kimi-K2.5's position-embedding "
        "interpolation indices: TypeError: got an unexpected keyword argument 'output_size')"
    ),
    issue="https://github.com/microsoft/onnxscript/issues/2687",
    versions={"onnxscript": ">=0.5"},
)
def repeat_interleave_without_output_size(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Drop the ``output_size`` keyword of ``aten.repeat_interleave.Tensor(repeats, output_size=n)``
    (and of ``.self_Tensor`` / ``.self_int``, which the translation's decompositions turn into it).

    ``output_size`` only tells PyTorch the total ``repeats.sum()`` in advance (no device sync); the
    values are the same without it. onnxscript's translation of the overload has no such parameter
    and raised ``TypeError`` (an image tower exported for one patch grid computes its interpolation
    indices with it, ``transformers.vision_utils.get_vision_interpolation_indices_and_weights``).

    Returns:
        True when the keyword was removed; False for any other node.
    """
    overloads = (
        torch.ops.aten.repeat_interleave.Tensor,
        torch.ops.aten.repeat_interleave.self_Tensor,  # decomposed into .Tensor(..., output_size)
        torch.ops.aten.repeat_interleave.self_int,
    )
    if node.op != "call_function" or node.target not in overloads:
        return False
    if "output_size" not in node.kwargs:
        return False
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}
    logger.debug("repeat_interleave.Tensor: output_size dropped before translation")
    return True
