"""Reversible patches of torch, transformers and ExecuTorch installed during an ExecuTorch export.

Patches are registered with :func:`hfexport.registry.register_patch` under ``"executorch"``
(every ExecuTorch backend) or a scoped key (``"executorch.xnnpack"``, ``"executorch.cuda"``);
the exporter installs ``apply_patches(f"executorch.{backend}")`` (parent key first, then the
scope) around capture and lowering, and the originals come back afterwards, also on error.
One function per upstream issue; each factory receives the original and returns a wrapper.

Mixture-of-experts layers use the core's shared dense experts workaround
(:mod:`hfexport.workarounds.moe`), registered here under ``"executorch.xnnpack"`` for every experts
implementation: XNNPACK has neither a grouped matmul kernel nor data-dependent control flow.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import types
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.fourier import register_real_fourier_mixing
from hfexport.workarounds.moe import register_dense_experts
from hfexport.workarounds.recurrences import (
    register_recurrences,
    register_sliced_transpose_per_consumer,
    register_time_shift_without_crop,
)
from hfexport.workarounds.text_to_audio import register_bernoulli_as_uniform, register_normal_from_uniform
from hfexport.workarounds.time_series import register_lgamma_elementary, register_real_autocorrelation

__all__ = [
    "GATED_DELTA_RULE_MODELS",
    "XNNPACK_MAX_TENSOR_DIMS",
    "bound_views_by_their_base",
    "broadcast_div_stays_portable",
    "circular_pad_as_concat",
    "circular_pad_without_empty",
    "conv1d_with_one_dynamic_dim_only",
    "conv_layout_without_size_guard",
    "dim_order_without_size_guards",
    "edge_verifier_accepts_symbolic_min_max",
    "exact_floor_divisions",
    "exact_quotients_in_upper_bounds",
    "gated_delta_rule_keeps_the_triangular_solve",
    "gelu_tanh_stays_portable",
    "keep_dynamic_dims_in_list_returning_ops",
    "layout_tags_without_size_guards",
    "max_dim_only_over_spatial_axes",
    "node_comparison_cache_per_export",
    "partition_copies_share_the_weights",
    "partition_log_keeps_no_node",
    "patchify_conv3d_as_matmul",
    "prelu_only_over_4d_inputs",
    "provably_dense_in_order",
    "resize_with_own_scale_stays_portable",
    "softmax_takes_nchw_inputs",
    "stride_order_without_data_dependent_guards",
    "tensors_above_six_dims_stay_portable",
    "unsqueeze_with_one_dynamic_dim_only",
    "view_bound_within_base",
    "views_bounded_by_their_base",
    "xnnpack_preprocess_skips_inapplicable_passes",
]

logger = logging.getLogger(__name__)


def _returns_one_tensor_list(target: Any) -> bool:
    returns = list(getattr(getattr(target, "_schema", None), "returns", None) or [])
    return len(returns) == 1 and returns[0].type == torch.ListType.ofTensors()


@register_patch(
    "executorch",
    "executorch.exir.verification.arg_validator.EdgeOpArgValidator.call_function",
    description=(
        "hand the edge dtype validator the whole output list of Tensor[]-returning ops (split, unbind, ...), so it "
        "does not call len() on the first output and specialise its dynamic leading dim (no exact upstream issue found)"
    ),
    issue="https://github.com/pytorch/executorch/issues/1350",
    versions={"executorch": ">=1.3"},
)
def keep_dynamic_dims_in_list_returning_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``EdgeOpArgValidator.call_function`` so Tensor[] outputs keep their dynamic dimensions.

    ``to_edge`` verifies edge-op dtypes by interpreting the graph with ``EdgeOpArgValidator``.
    For an op whose schema returns a single ``Tensor[]`` (``split_with_sizes_copy``,
    ``unbind_copy``, ...), the validator iterates the node's output *list* as if it held one value
    per schema return, so the "list" it then checks is the first output tensor, and
    ``len(tensor)`` evaluates that tensor's leading size. When the size is a dynamic dimension
    (the batch of GPT-2's fused ``c_attn`` output split into q/k/v, of GPT-NeoX's and Phi-3's fused
    projections), the shape environment records a guard and specialises the dimension to its
    sample value for the whole program: the ``.pte`` then fails with "Attempted to resize a static
    tensor" on any other batch size. No upstream issue names this cause; the linked issue shows
    the same runtime failure after a dynamic-batch export.

    The wrapper presents such an output as a one-element tuple holding the list (what the
    validator's own logic expects) for the duration of the call and puts the original value back.
    Other ops go straight to ``original``.
    """

    @functools.wraps(original)
    def call_function(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        node = getattr(self, "node", None)
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, (list, tuple)) or not _returns_one_tensor_list(target):
            return original(self, target, args, kwargs)
        node.meta["val"] = (list(value),)
        try:
            return original(self, target, args, kwargs)
        finally:
            node.meta["val"] = value

    return call_function


def _python_symbolic_functions() -> frozenset[Any]:
    """``torch.sym_max``, ``torch.sym_min``, ... : the Python functions ExecuTorch lowers to its prim ops."""
    from executorch.exir.passes.executorch_prim_ops_registry import _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS

    return frozenset(op for op in _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS if isinstance(op, types.FunctionType))


@register_patch(
    "executorch",
    "executorch.exir.verification.verifier.EXIREdgeDialectVerifier",
    "executorch.exir.program._program.EXIREdgeDialectVerifier",
    description=(
        "let the edge-dialect verifier accept torch.sym_max/sym_min/... nodes (shapes with Min/Max, e.g. sliding "
        "windows), which ExecuTorch itself lowers to executorch_prim ops after verification"
    ),
    issue="https://github.com/pytorch/executorch/issues/11988",
    versions={"executorch": ">=1.3"},
)
def edge_verifier_accepts_symbolic_min_max(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the ``EXIREdgeDialectVerifier`` factory so symbolic ``min``/``max`` nodes pass verification.

    When a traced size is a ``Min``/``Max`` expression (a sliding-window cache keeps
    ``min(length, window - 1)`` positions: see the core capture workaround
    ``hfexport.workarounds.torch_export.sliding_window_update_keeps_dynamic_length``, which Gemma-2 needs),
    ``torch.export`` materialises it as a ``torch.sym_min``/``torch.sym_max`` call node. ExecuTorch knows these: its
    ``EdgeToBackendOpsPass`` turns them into ``executorch_prim::sym_min/sym_max`` (added by
    https://github.com/pytorch/executorch/pull/12037), and the runtime implements them. But the edge
    verifier, which runs first (inside ``to_edge``), accepts Python functions only if they are
    named ``alloc`` and fails with a bare ``AssertionError``
    (https://github.com/pytorch/executorch/issues/11988, open). The wrapper returns a subclass of the
    verifier whose op check lets exactly those Python symbolic functions through and leaves every
    other check as it was.
    """
    accepted = _python_symbolic_functions()
    signature = inspect.signature(original)

    @functools.wraps(original)
    def make_verifier(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        class_only = bool(bound.arguments.get("class_only", False))
        bound.arguments["class_only"] = True
        base = original(*bound.args, **bound.kwargs)

        class _EdgeVerifierWithSymbolicMinMax(base):  # type: ignore[misc, valid-type]
            dialect = base.dialect

            def __init__(self) -> None:
                super().__init__()
                strict = self.check_valid_op

                def check_valid_op(op: Any) -> None:
                    if op in accepted:
                        return
                    strict(op)

                self.check_valid_op = check_valid_op

        return _EdgeVerifierWithSymbolicMinMax if class_only else _EdgeVerifierWithSymbolicMinMax()

    return make_verifier


def tighter_upper_bound(expr: Any, var_to_range: Any) -> int | None:
    """An upper bound of the size expression ``expr`` no looser than ``bound_sympy``'s, or ``None``.

    ``bound_sympy`` bounds a quotient ``FloorDiv(base, divisor)`` by ``max(base) // min(divisor)``
    even when ``divisor`` divides ``base`` symbolically: SEW-D's attention scores viewed as ``[-1,
    heads, frames, frames]`` have a leading size ``(8 * batch * frames**2) // (2 * frames**2)`` bounded
    at ``4 * 8 * 749**2`` instead of ``4 * 8``, a 10 TB planned buffer; XLNet's relative shift traces
    ``(s**2)//s``, bounded at 130560 instead of 511 (a 34 GB arena). Each such exact quotient is
    replaced by the cancelled polynomial (:func:`exact_floor_divisions`: an identical value for every
    positive size), and the rewritten expression is bounded again.

    Args:
        expr: a sympy size expression over the program's symbols.
        var_to_range: ``{symbol: ValueRanges}`` (the shape env's).

    Returns:
        The rewritten expression's finite upper bound when it is smaller than the original's, else
        ``None`` (nothing to rewrite, no gain, or an expression ``bound_sympy`` refuses: FastSpeech 2
        has sizes whose interval analysis raises ``ValueRangeError: Invalid ranges [0:-1]``).
    """
    import sympy
    from torch.utils._sympy.value_ranges import bound_sympy

    try:
        rewritten = exact_floor_divisions(expr)
        if rewritten is expr or rewritten == expr:
            return None
        before, after = bound_sympy(expr, var_to_range).upper, bound_sympy(rewritten, var_to_range).upper
    except Exception:  # an expression the interval analysis refuses (ValueRangeError): no tighter bound
        return None
    if not isinstance(after, sympy.Integer):
        return None
    if isinstance(before, sympy.Integer) and int(before) <= int(after):
        return None
    return int(after)


@register_patch(
    "executorch",
    "executorch.exir.sym_util.eval_upper_bound",
    "executorch.exir.passes.sym_shape_eval_pass.eval_upper_bound",
    description=(
        "memory planning sizes a tensor at bound_sympy of its shape, which bounds an exact symbolic quotient "
        "(a view's -1 size: (8*b*t**2)//(2*t**2); an einsum's (s**2)//s) by max(numerator) // min(denominator): "
        "the quotients are cancelled first (SEW-D planned a 10 TB buffer, XLNet's relative shift 34 GB, and "
        "both failed to load)"
    ),
    # no executorch issue filed; the bound comes from torch's interval analysis of FloorDiv
    # (simplifying FloorDiv of divisible expressions was discussed in pytorch/pytorch#95076, closed unmerged)
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/sym_util.py",
    versions={"executorch": ">=1.0"},
)
def exact_quotients_in_upper_bounds(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``eval_upper_bound`` (ExecuTorch's size of a symbolic dimension at its upper bound).

    The wrapper returns the smaller of the original bound and :func:`tighter_upper_bound` of the
    dimension's expression; an int, or an expression without an exact quotient, gets the original
    answer. Sound: the rewritten expression equals the original at every size the program takes.

    Returns:
        A function of one ``int | torch.SymInt`` returning an int.
    """

    @functools.wraps(original)
    def eval_upper_bound(maybe_symint: Any) -> int:
        bound = original(maybe_symint)
        if isinstance(maybe_symint, torch.SymInt):
            node = maybe_symint.node
            tighter = tighter_upper_bound(node.expr, node.shape_env.var_to_range)
            if tighter is not None and tighter < bound:
                return tighter
        return bound

    return eval_upper_bound


def view_bound_within_base(view_bound: list[int], base_numel: int) -> list[int]:
    """An upper-bound shape of the view's rank holding exactly ``base_numel`` elements.

    Each axis but the first keeps the largest divisor of the elements still to place that its
    own bound allows (``gcd(bound, remaining)``), from the last axis inwards; the first axis takes
    the rest. The product is ``base_numel`` for any input, so a view planned at this shape ends
    where its base ends.

    Args:
        view_bound: the view's per-axis upper bounds (non-negative ints, rank >= 1).
        base_numel: elements of the base at its upper bound (>= 0).

    Returns:
        A list of ints of ``len(view_bound)`` whose product is ``base_numel``.

    Raises:
        ValueError: ``view_bound`` is empty or ``base_numel`` is negative.
    """
    if not view_bound:
        raise ValueError("view_bound must have at least one axis (a 0-d view has nothing to bound)")
    if base_numel < 0:
        raise ValueError(f"base_numel must be >= 0, got {base_numel}")
    shape = list(view_bound)
    remaining = base_numel
    for axis in range(len(shape) - 1, 0, -1):
        shape[axis] = math.gcd(shape[axis], remaining) if remaining else 0
        remaining = remaining // shape[axis] if shape[axis] else 0
    shape[0] = remaining
    return shape


def bound_views_by_their_base(graph_module: torch.fx.GraphModule) -> int:
    """Re-plan each dynamic ``memory.view`` whose upper-bound shape holds more elements than its base.

    Runs after ExecuTorch has evaluated every tensor spec at its per-axis upper bounds. A view
    shares its base's planned storage (``ReplaceViewCopyWithViewPass``), but its bound is the
    product of per-axis bounds of its own sizes: axes that trade size against each other (RF-DETR's
    and Donut-Swin's window partition ``[b, n, w, n // w, w, 64 // w]`` with ``w = side // 32``) are
    each bounded at their largest, and the view is planned past its base's buffer (33.5 MB inside
    0.5 MB); the runtime then refuses the method (``MemoryAllocationFailed``, 0x21). A view has as
    many elements as its base at every size, and the runtime sizes a dynamic tensor by its element
    count (``TensorImpl`` checks ``numel <= numel_bound`` on resize, not each axis; see
    pytorch/executorch#20546), so the view's bound becomes a shape of the same rank holding exactly
    the base's elements (:func:`view_bound_within_base`).

    Args:
        graph_module: the program after ``ConstraintBasedSymShapeEvalPass`` (specs hold ints).

    Returns:
        The number of views re-bounded.
    """
    from executorch.exir import memory
    from executorch.exir.tensor import TensorSpec, contiguous_stride_from_shape

    rebounded = 0
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target is not memory.view:
                continue
            spec = node.meta.get("spec")
            base = getattr(spec, "_base", None)
            if not isinstance(base, TensorSpec) or not spec.shape:
                continue
            view_shape, base_shape = list(spec.shape), list(base.shape)
            if not all(isinstance(s, int) for s in view_shape + base_shape):
                continue
            base_numel = math.prod(base_shape)
            if math.prod(view_shape) <= base_numel:
                continue
            bounded = view_bound_within_base(view_shape, base_numel)
            logger.debug(
                "view %s bounded at %s (was %s) by its base %s", node.name, bounded, view_shape, base_shape
            )
            spec.shape = bounded
            spec.stride = contiguous_stride_from_shape(torch.Size(bounded))
            rebounded += 1
    return rebounded


@register_patch(
    "executorch",
    "executorch.exir.passes.sym_shape_eval_pass.ConstraintBasedSymShapeEvalPass.call",
    description=(
        "a dynamic view shares its base's planned buffer but is bounded axis by axis: a window partition whose "
        "axes trade size ([b, n, w, n//w, w, 64//w]) was planned at 33.5 MB inside its base's 0.5 MB and the "
        "method did not load (0x21); the view's bound is re-shaped to hold exactly its base's elements"
    ),
    # no executorch issue filed; views take their base's storage in ReplaceViewCopyWithViewPass while their
    # spec keeps the per-axis upper bounds ConstraintBasedSymShapeEvalPass gives every tensor
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/passes/replace_view_copy_with_view_pass.py",
    versions={"executorch": ">=1.0"},
)
def views_bounded_by_their_base(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ConstraintBasedSymShapeEvalPass.call`` (the upper bounds of every tensor spec before
    memory planning) so that :func:`bound_views_by_their_base` runs on its result.

    Returns:
        A ``call(self, graph_module) -> PassResult`` with the original's result.
    """

    @functools.wraps(original)
    def call(self: Any, graph_module: torch.fx.GraphModule) -> Any:
        result = original(self, graph_module)
        bound_views_by_their_base(graph_module)
        return result

    return call


def _stride_order(first: Any, second: Any) -> int:
    """-1 when stride ``first`` is known to be larger than ``second`` (it goes first in a dim order),
    1 when known smaller, 0 when known equal or undecided by these rules; guards on nothing.

    Both strides are non-zero (ExecuTorch checks that before sorting), so a stride that is a known
    multiple of the other is at least as large: ``u * s`` against ``s`` is decided although ``u``
    has no range (an unbacked output length).
    """
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    if guard_or_false(first == second):
        return 0
    if guard_or_false(first > second) or guard_or_false(first % second == 0):
        return -1
    if guard_or_false(first < second) or guard_or_false(second % first == 0):
        return 1
    return 0


@register_patch(
    "executorch",
    # (exir.tensor's own binding, the one TensorSpec calls, is dim_order_without_size_guards'
    # target, which orders symbolic strides without any guard; these are the modules that
    # imported the function by name)
    "executorch.exir.tensor_layout.dim_order_from_stride",
    "executorch.exir.emit._emitter.dim_order_from_stride",
    "executorch.exir.passes.replace_view_copy_with_view_pass.dim_order_from_stride",
    description=(
        "order strides holding an unbacked size by divisibility both ways: ExecuTorch's stride sort decides "
        "s < u*s but guards on u*s < s (VITS's predicted frame count: 'Could not guard on data-dependent "
        "expression 8*u70 < 8' in memory planning)"
    ),
    # executorch 1.4.1 exir/tensor.py: the comparison of pytorch/executorch#19516 tries divisibility one way only
    issue="https://github.com/pytorch/executorch/pull/19516",
    versions={"executorch": ">=1.3"},
)
def stride_order_without_data_dependent_guards(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``dim_order_from_stride`` (strides -> dim order, largest stride first) for unbacked sizes.

    ExecuTorch's comparator of two strides ``a < b`` answers a statically known inequality, then
    "``a`` divides ``b`` and they differ" as true, and otherwise evaluates ``a < b``, which guards.
    With an unbacked size ``u`` (VITS's frame count, the ``.item()`` of the predicted durations' sum)
    a contiguous ``[batch, u, s]`` tensor has strides ``(u*s, s, 1)``; the sort asks ``u*s < s`` as
    well as ``s < u*s``, and the first raises ``GuardOnDataDependentSymNode`` in memory planning.
    The wrapper calls the original and, only when it raises that error, sorts again with
    :func:`_stride_order` (a stable sort, largest stride first; divisibility counts both ways,
    which is sound because ExecuTorch refuses zero strides); strides it cannot order re-raise the
    original error.

    Returns:
        A function of a stride tuple returning the dim order (a tuple of ints).
    """
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    @functools.wraps(original)
    def dim_order_from_stride(stride: Any) -> Any:
        try:
            return original(stride)
        except GuardOnDataDependentSymNode:
            strides = list(stride)
            for i, first in enumerate(strides):
                for second in strides[i + 1 :]:
                    if _stride_order(first, second) == 0 and not _known_equal(first, second):
                        raise
            order = sorted(
                range(len(strides)),
                key=functools.cmp_to_key(lambda i, j: _stride_order(strides[i], strides[j])),
            )
            return tuple(order)

    return dim_order_from_stride


def _known_equal(first: Any, second: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(first == second))


def _dynamic_dims(node: Any) -> int:
    value = node.meta.get("val") if hasattr(node, "meta") else None
    if not isinstance(value, torch.Tensor):
        return 0
    return sum(1 for size in value.shape if isinstance(size, torch.SymInt) and size.node.expr.free_symbols)


@register_patch(
    "executorch",
    "torch._C._conv_determine_backend_memory_format",
    description=(
        "fake-tensor convolutions on symbolic sizes leave their output layout undecided instead of asking the "
        "eager layout rule, which guards on the sizes: a dynamic image side whose last feature map is 1x1 in "
        "the sample (ConvNeXt traced on 32x32) was narrowed to [32, 63] when to_edge re-traced the program"
    ),
    issue="https://github.com/pytorch/pytorch/issues/157621",
    versions={"torch": ">=2.12"},
)
def conv_layout_without_size_guard(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch._C._conv_determine_backend_memory_format`` for symbolic sizes.

    torch's fake-tensor convolution (``torch._subclasses.fake_impls.conv``, torch 2.12-2.13) asks
    the eager layout rule which memory format the output has whenever every size has a hint; the
    rule compares sizes with 1 (a 1x1 map is both contiguous and channels-last), which on
    symbolic sizes installs guards. ``torch.export`` itself traces through the meta kernel and
    keeps the range, but ExecuTorch's ``to_edge`` decomposition re-runs the fake convolution, so
    a ConvNeXt captured on 32x32 images with sides in [32, 128] came out of lowering with sides in
    [32, 63] (the last stage's map, ``side // 32``, pinned to 1: the 0/1 specialisation of
    pytorch/pytorch#157621), and the ``.pte`` refused a 64x64 image. For inputs or weights with a
    symbolic size the wrapper returns ``None``, the "layout undecided" answer torch's own code gives
    for unhinted sizes (the output keeps the strides the kernel produced: contiguous); concrete
    sizes get the original rule. ExecuTorch fixes every tensor's dim order itself, so nothing it
    plans depends on the answer.
    """

    @functools.wraps(original)
    def determine(input_: Any, weight: Any, backend: Any) -> Any:
        sizes = (*getattr(input_, "shape", ()), *getattr(weight, "shape", ()))
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return None
        return original(input_, weight, backend)

    return determine


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.gemm_configs.ConvolutionConfig.check_constraints",
    description=(
        "keep 1-D convolutions whose input has more than one dynamic dimension out of XNNPACK: its conv1d path "
        "reshapes through static_reshape, which takes one dynamic dimension, and fails at preprocess otherwise"
    ),
    issue="https://github.com/pytorch/executorch/issues/11449",
    versions={"executorch": ">=1.3"},
)
def conv1d_with_one_dynamic_dim_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ConvolutionConfig.check_constraints`` to decline 1-D convolutions XNNPACK cannot build.

    XNNPACK runs a 1-D convolution as a 2-D one: its ``Conv1dUnsqueezePass`` inserts an
    ``unsqueeze_copy`` before and a ``squeeze_copy`` after, serialised as XNNPACK
    ``static_reshape``, which supports a single dynamic dimension
    (https://github.com/pytorch/executorch/issues/11449, open: move squeeze/unsqueeze to
    ``expand_dims``/``fuse_dims``). The partitioner does not check this, so a convolution over a
    dynamic batch *and* a dynamic length (wav2vec2's feature encoder) is claimed and then fails at
    preprocess with "XNNPACK reshape only supports 1 dynamic dimension". The wrapper declines those
    nodes (they run on ExecuTorch's portable convolution); every other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        stride = node.args[3] if len(node.args) > 3 else ()
        source = node.args[0] if node.args else None
        if len(stride) == 1 and source is not None and _dynamic_dims(source) > 1:
            logger.debug("conv1d %s stays on portable kernels: more than one dynamic dimension", node.name)
            return False
        return True

    return check_constraints


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.node_configs.BatchNormConfig.check_constraints",
    description=(
        "keep 1-D batch norms whose input has more than one dynamic dimension out of XNNPACK: they become 1-D "
        "convolutions at preprocess, reshaped through static_reshape, which takes one dynamic dimension"
    ),
    issue="https://github.com/pytorch/executorch/issues/11449",
    versions={"executorch": ">=1.3"},
)
def batch_norm_1d_with_one_dynamic_dim_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``BatchNormConfig.check_constraints`` to decline 1-D batch norms XNNPACK cannot build.

    XNNPACK's preprocess turns a claimed batch norm into a 1x1 convolution (``DecomposeBatchNorm``,
    or folded into the convolution before it by ``FuseBatchNormPass``); over ``[batch, channels,
    length]`` that is a 1-D convolution, run as a 2-D one between ``unsqueeze_copy`` and
    ``squeeze_copy`` nodes serialised as ``static_reshape``, which supports a single dynamic
    dimension (https://github.com/pytorch/executorch/issues/11449). The partitioner does not check
    this, so SpeechT5's speech-decoder postnet (``BatchNorm1d`` over a dynamic batch *and* a dynamic
    frame count, issue 28) fails at preprocess with "XNNPACK reshape only supports 1 dynamic
    dimension". The wrapper declines those nodes (they run on ExecuTorch's portable kernel); every
    other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        value = source.meta.get("val") if source is not None else None
        if isinstance(value, torch.Tensor) and value.dim() == 3 and _dynamic_dims(source) > 1:
            logger.debug(
                "batch norm %s stays on portable kernels: more than one dynamic dimension", node.name
            )
            return False
        return True

    return check_constraints


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.generic_node_configs.UnsqueezeCopyConfig.check_constraints",
    description=(
        "keep unsqueeze_copy nodes whose output has more than one dynamic dimension out of XNNPACK: they are "
        "serialised as static_reshape, which takes one dynamic dimension, and fail at preprocess otherwise"
    ),
    issue="https://github.com/pytorch/executorch/issues/11449",
    versions={"executorch": ">=1.3"},
)
def unsqueeze_with_one_dynamic_dim_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``UnsqueezeCopyConfig.check_constraints`` to decline unsqueezes XNNPACK cannot build.

    XNNPACK serialises ``unsqueeze_copy`` (trailing dimension) as ``static_reshape``, whose new
    shape may hold a single dynamic (0) entry (https://github.com/pytorch/executorch/issues/11449,
    open: move squeeze/unsqueeze to ``expand_dims``/``fuse_dims``). Unlike ``ViewCopyConfig``, the
    unsqueeze config does not check this, so an unsqueeze of a tensor with a dynamic batch *and* a
    dynamic sequence (GPT-J's and Cohere's interleaved rotary embedding, ``stack`` of ``[b, s, h, d]``
    halves; Swin's window partition) is claimed and then fails at preprocess with "XNNPACK reshape
    only supports 1 dynamic dimension". The wrapper declines those nodes (they run on ExecuTorch's
    portable kernel, a copy); every other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        if _dynamic_dims(node) > 1:
            logger.debug("unsqueeze %s stays on portable kernels: more than one dynamic dimension", node.name)
            return False
        return True

    return check_constraints


def _xnnpack_has_approximate_gelu() -> bool:
    """The installed XNNPACK delegate serialises tanh GELU as its own node (pytorch/executorch#22851)."""
    from executorch.backends.xnnpack.serialization import xnnpack_graph_schema

    return hasattr(xnnpack_graph_schema, "XNNApproxGelu")


def _gelu_approximation(node: Any) -> str:
    if "approximate" in node.kwargs:
        return str(node.kwargs["approximate"])
    return str(node.args[1]) if len(node.args) > 1 else "none"


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.generic_node_configs.GeluConfig.check_constraints",
    description=(
        "keep gelu(approximate='tanh') out of XNNPACK: its GELU node ignores the approximation and computes exact "
        "(erf) GELU, so models using gelu_pytorch_tanh (SigLIP, Gemma) drift from eager; ExecuTorch's portable "
        "gelu kernel honours 'tanh' (GPT-2's gelu_new is written out with torch.tanh and is unaffected)"
    ),
    issue="https://github.com/pytorch/executorch/pull/22851",
    versions={"executorch": ">=0.4"},
)
def gelu_tanh_stays_portable(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GeluConfig.check_constraints`` to decline tanh-approximated GELU nodes.

    XNNPACK's ``GeluVisitor`` serialises every ``aten.gelu`` as ``XNNGelu`` without looking at
    ``approximate``, so ``gelu(x, approximate="tanh")`` (``gelu_pytorch_tanh``, SigLIP's vision and
    text towers) runs as exact GELU once delegated: up to ~5e-4 apart per activation, enough to put
    every output of a tiny SigLIP past the validation tolerance. The partitioner does not check
    this either. pytorch/executorch#22851 (merged 2026-09-15, not in executorch 1.4.1) adds an
    ``XNNApproxGelu`` node; until the installed delegate has it, the wrapper declines these nodes
    (they run on ExecuTorch's portable ``gelu.out``, which computes the tanh form) and stands down
    by itself once ``xnnpack_graph_schema.XNNApproxGelu`` exists. Exact GELU and every other
    decision are the original's.
    """
    fixed = _xnnpack_has_approximate_gelu()

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        if not fixed and _gelu_approximation(node) != "none":
            logger.debug("gelu %s stays on portable kernels: XNNPACK ignores approximate='tanh'", node.name)
            return False
        return True

    return check_constraints


def _max_dim_arguments(node: Any) -> tuple[Any, bool]:
    """``(dim, keepdim)`` of an ``aten.max.dim`` node, from its arguments or keyword arguments."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dim, bool(keepdim)


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass.ChannelsLastTaggedReshapePass.requires_nchw_inputs",
    description=(
        "give XNNPACK's softmax its input in NCHW: the layout pass lets a softmax over the last axis take an "
        "NHWC-tagged input (scores plus a convolution's position bias) and XNNPACK then normalises over the "
        "channels; PP-DocLayoutV2's reading-order attention was off by up to 11.8 (order_logits by 1.16)"
    ),
    # no upstream issue found; executorch 1.4.1's ChannelsLastTaggedReshapePass lists view_copy, squeeze,
    # unsqueeze and linear as NCHW-only, and op_softmax.py serializes the softmax's dim as the last axis
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/_passes/channels_last_tagged_reshape_pass.py",
    versions={"executorch": ">=1.3"},
)
def softmax_takes_nchw_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ChannelsLastTaggedReshapePass.requires_nchw_inputs`` to also answer True for softmax.

    The pass keeps tensors produced by a convolution in NHWC inside the delegate and lets ops it
    does not list take either layout ("all inputs in the same format"). ``_softmax`` is not
    listed, but XNNPACK's softmax (``op_softmax.py``; the partitioner admits only the last axis)
    normalises over the innermost physical axis, which for an NHWC-tagged ``[b, C, H, W]`` tensor is
    C, not W. PP-DocLayoutV2's reading-order attention adds a 1x1 convolution's output (the box
    relation bias, ``[b, heads, n, n]``) to its scores before the softmax: the sum is tagged NHWC and
    the softmax ran over the heads. With the wrapper the pass converts the softmax's input back to
    NCHW first (a copy inside the delegate), and the softmax's output is NCHW as its dim assumes.

    Returns:
        A ``requires_nchw_inputs(self, node) -> bool``.
    """
    from executorch.exir.dialects._ops import ops as exir_ops

    softmaxes = {exir_ops.edge.aten._softmax.default, exir_ops.edge.aten._log_softmax.default}

    @functools.wraps(original)
    def requires_nchw_inputs(self: Any, node: Any) -> bool:
        return bool(original(self, node)) or getattr(node, "target", None) in softmaxes

    return requires_nchw_inputs


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.node_configs.PreluConfig.check_constraints",
    description=(
        "keep a PReLU whose input is not 4-D out of XNNPACK: the delegate's layout pass converts every claimed "
        "prelu's input to NHWC and raises 'Attempting to convert non-NHWC compatible node to NHWC' on a 3-D "
        "[batch, sequence, hidden] input (DAB-DETR's encoder feed-forward); declined, it is decomposed as usual"
    ),
    issue="https://github.com/pytorch/executorch/pull/18624",
    versions={
        "executorch": ">=1.3"
    },  # executorch 1.4.1: ChannelsLastTaggedReshapePass still lists prelu as NHWC
)
def prelu_only_over_4d_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PreluConfig.check_constraints`` to decline a PReLU over an input that is not 4-D.

    XNNPACK's ``ChannelsLastTaggedReshapePass`` counts ``aten.prelu`` among the ops that take an
    NHWC input, and converts only 4-D tensors (``can_be_converted_to_nhwc``); the partitioner claims
    a prelu of any rank, so DAB-DETR's ``PReLU`` after the encoder's first linear (``[batch,
    sequence, hidden]``) made preprocess raise and the whole lowering failed
    (pytorch/executorch#18624 leaves non-4-D inputs alone; closed unmerged, still so in 1.4.1). The
    partitioner's decomposition filter asks the same ``check_constraints``, so a declined prelu is
    decomposed into elementwise ops (which XNNPACK may still take) instead of staying a prelu node.
    Every other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        value = source.meta.get("val") if source is not None else None
        if isinstance(value, torch.Tensor) and value.dim() != 4:
            logger.debug(
                "prelu %s is decomposed: its %d-D input is not NHWC-convertible", node.name, value.dim()
            )
            return False
        return True

    return check_constraints


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.node_configs.MaxDimConfig.check_constraints",
    description=(
        "keep max.dim out of XNNPACK unless it reduces axis 2 or 3 of a 4-D input with keepdim=True: the "
        "partitioner claims every 4-D max.dim, but its serializer (op_max_dim.py, a max pooling) raises "
        "'amax.default only supports dim == 2 or dim == 3' / 'keep_dim == True' for the rest and the whole "
        "lowering fails (MoE routers of gpt_oss, hy_v4, mimo_v2_flash take the max over the last axis, -1)"
    ),
    # no upstream issue found; the same partitioner/serializer mismatch was fixed for mean.dim in
    # pytorch/executorch#19206. executorch 1.4.1: node_configs.MaxDimConfig checks rank and dtypes only
    issue="https://github.com/pytorch/executorch/pull/19206",
    versions={"executorch": ">=1.3"},
)
def max_dim_only_over_spatial_axes(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``MaxDimConfig.check_constraints`` to decline what XNNPACK's ``MaxDim`` visitor refuses.

    The visitor serialises ``max.dim`` (as ``amax``) as a 2-D max pooling over NHWC height or width,
    so it accepts the literal ``dim`` 2 or 3 with ``keepdim=True`` only; ``dim=-1`` is refused too,
    although it names axis 3. The partitioner checks the rank and dtypes but not these, and a
    refused node raises at preprocess time, failing the export instead of staying on the portable
    ``max.dim_max`` kernel. Declined nodes run there; every other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        dim, keepdim = _max_dim_arguments(node)
        if dim not in (2, 3) or not keepdim:
            logger.debug(
                "max.dim %s stays on portable kernels: XNNPACK pools over dim 2 or 3 with keepdim only",
                node.name,
            )
            return False
        return True

    return check_constraints


def _broadcasts_over_a_dynamic_size(node: Any) -> bool:
    """True when the operands of ``node`` have the same rank, one has a symbolic size, and one is
    broadcast along an axis (size 1 against another size: ``[b, 1, 1, C] / [b, 1, 1, 1]``)."""
    shapes = []
    for arg in node.args[:2]:
        value = arg.meta.get("val") if hasattr(arg, "meta") else None
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(value.shape))
    if len(shapes) != 2:
        return False
    symbolic = any(isinstance(size, torch.SymInt) for shape in shapes for size in shape)

    def is_one(size: Any) -> bool:  # a literal 1: no guard on symbolic sizes
        return isinstance(size, int) and size == 1

    if not symbolic or len(shapes[0]) != len(shapes[1]) or not shapes[0]:
        return False  # a scalar or lower-rank divisor (x / sqrt(d)) is not the partition the bug needs
    return any(is_one(a) != is_one(b) for a, b in zip(shapes[0], shapes[1], strict=True))


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.generic_node_configs.DivConfig.check_constraints",
    description=(
        "keep a broadcasting div.Tensor over dynamic sizes out of XNNPACK: after the loaded method runs a smaller "
        "input, a partition chaining it into a broadcast mul returns values 1e-3 off at a larger one (ConvNeXt V2's "
        "global response norm at the 64 px second shape; a freshly loaded method is exact)"
    ),
    # no upstream issue found; bisected on executorch 1.4.1: every XNNPACK config but DivConfig is exact, div and
    # mul each alone are exact, div + mul in one partition are not (after a reshape to a larger input only)
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/partition/config/generic_node_configs.py",
    versions={"executorch": ">=1.3"},
)
def broadcast_div_stays_portable(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DivConfig.check_constraints`` to decline a broadcasting division over dynamic sizes.

    ConvNeXt V2's global response norm divides the per-channel norms ``[batch, 1, 1, C]`` by their
    mean ``[batch, 1, 1, 1]`` and multiplies the ``[batch, H, W, C]`` features by the quotient. XNNPACK
    puts the div and the mul in one partition; run first at the 32 px sample and then at 64 px, the
    loaded method's logits are 1.2e-3 off eager (fp32 eager is 1.6e-7 off float64), while a method
    loaded fresh at 64 px, portable kernels, and partitions holding the div or the mul alone are exact.
    The wrapper leaves such a div to the portable kernel; every other decision is the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        if _broadcasts_over_a_dynamic_size(node):
            logger.debug("div %s stays on portable kernels: it broadcasts over a dynamic size", node.name)
            return False
        return True

    return check_constraints


def _edge_op_names(graph: torch.fx.Graph) -> frozenset[str]:
    """``{"aten.cat.default", "dim_order_ops._clone_dim_order.default", ...}``: the call targets of ``graph``."""
    return frozenset(
        str(getattr(node.target, "__name__", node.target))
        for node in graph.nodes
        if node.op == "call_function"
    )


def _has_any(*names: str) -> Callable[[frozenset[str]], bool]:
    return lambda ops: any(name in ops for name in names)


def _has_all(*names: str) -> Callable[[frozenset[str]], bool]:
    return lambda ops: all(name in ops for name in names)


def _has_quant_nodes(ops: frozenset[str]) -> bool:
    # XNNPACK's is_quant/is_dequant match quantize_*/dequantize_* ops of any namespace
    return any("quantize" in name for name in ops)


def _has_linear_rewrite(ops: frozenset[str]) -> bool:
    # ConvertToLinearPass turns the [add]mm / bmm of a linear's source partition into linear, then
    # (addmm_mm_to_linear) any [add]mm into linear and drops the view_copy around a linear
    return _has_any("aten.mm.default", "aten.addmm.default", "aten.bmm.default")(ops) or _has_all(
        "aten.linear.default", "aten.view_copy.default"
    )(ops)


def _has_dim_order_ops(ops: frozenset[str]) -> bool:
    # DimOrderOpsRevertPass turns dim_order_ops (_to_dim_order_copy, _empty_dim_order,
    # _clone_dim_order) back into their memory-format ops and re-traces every other op as it is
    return any(name.startswith("dim_order_ops.") for name in ops)


#: XNNPACK preprocess pass (class name) -> "may this pass change a graph holding these ops?". Each
#: predicate is a necessary condition read off the pass's own source (executorch 1.3-1.4): the op
#: it rewrites, or every op of the pattern graphs it matches (``SubgraphMatcher`` matches a pattern
#: only where each of its call targets occurs). Passes not listed always run.
_XNNPACK_PASS_NEEDS: dict[str, Callable[[frozenset[str]], bool]] = {
    # matches sdpa.get_graphs() (built by exporting a module at first use: ~2 s); both
    # patterns hold _softmax and bmm
    "ConvertToSDPAPass": _has_all("aten._softmax.default", "aten.bmm.default"),
    # matches bilinear_2d.get_graphs_dict() (four exports at first use: ~3 s), upsample_bilinear2d
    "ConvertToUpsampleBilinear2d": _has_any("aten.upsample_bilinear2d.vec"),
    "FuseBatchNormPass": _has_any(
        "aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"
    ),
    "DecomposeBatchNorm": _has_any(
        "aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"
    ),
    "Conv1dUnsqueezePass": _has_any("aten.convolution.default"),
    "PReLUReshapePass": _has_any("aten._prelu_kernel.default"),
    "FuseActivationPass": _has_any("aten.relu.default", "aten.hardtanh.default"),
    "DecomposeConcatenate": _has_any("aten.cat.default"),
    "RemoveGetItemPass": _has_any("aten.max_pool2d_with_indices.default", "aten.max.dim"),
    "PropagateCustomMetaPass": _has_quant_nodes,
    "ConvertToLinearPass": _has_linear_rewrite,
    "DimOrderOpsRevertPass": _has_dim_order_ops,
}


def _has_symbolic_layout(tensor: Any) -> bool:
    if not isinstance(tensor, torch.Tensor):
        return False
    return any(isinstance(size, torch.SymInt) for size in (*tensor.shape, *tensor.stride()))


def provably_dense_in_order(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    """True when ``tensor``'s strides are dense with axes ``order`` from innermost to outermost for
    every size in the shape env's ranges, decided with ``statically_known_true`` (no guard).

    Axes of size 1 (provably) are skipped, as in torch's contiguity rules; an axis whose size or
    stride is not provably what the order needs answers False. ``order`` ``(3, 2, 1, 0)`` is NCHW
    contiguity of a 4-D tensor, ``(1, 3, 2, 0)`` channels-last (NHWC).
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    expected: Any = 1
    for axis in order:
        size = tensor.shape[axis]
        if statically_known_true(size == 1):
            continue
        if not statically_known_true(tensor.stride()[axis] == expected):
            return False
        expected = expected * size
    return True


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass.ChannelsLastTaggedReshapePass._is_nhwc_tensor",
    description=(
        "XNNPACK's ChannelsLastTaggedReshapePass asks tensor.is_contiguous(channels_last) of symbolic tensors, which "
        "guards on the sample sizes: a PP-OCR detector traced on 32x32 images left lowering with its image sides "
        "narrowed from [1, 128] to [1, 32] (1x1 stride-32 map) and its .pte refused a 64x64 image; decided without guards"
    ),
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/_passes/channels_last_tagged_reshape_pass.py",
    versions={"executorch": ">=1.3"},
)
def layout_tags_without_size_guards(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``ChannelsLastTaggedReshapePass._is_nhwc_tensor`` (a static method) for symbolic tensors.

    The pass (executorch 1.3-1.4.1) tags each node of an XNNPACK partition NCHW or NHWC by asking
    its fake value ``is_contiguous(memory_format=torch.channels_last)`` and ``is_contiguous()``.
    On symbolic sizes both answers are guarded at the trace hints and the guards refine the shape
    env's ranges: the size-1 tests of a stride-32 feature map that is 1x1 in a 32x32 sample install
    ``(side - 1) // 32 + 1 == 1``, i.e. ``side <= 32``. Memory planning then evaluates every
    upper bound in that narrowed shape env, so a program exported for image sides in [1, 128]
    (PP-OCRv5/v6 text detectors, ``pixel_values`` planned ``[8, 3, 32, 32]``) refused a 64x64
    image at run time, although ``range_constraints`` still said 128. (Inductor's concat layout
    check hit the same guard, https://github.com/pytorch/pytorch/pull/181845; torch's
    ``*_or_false`` contiguity helpers still guard on backed sizes, so they do not help here.) For a
    4-D tensor with a symbolic size or stride the wrapper decides both layouts with
    :func:`provably_dense_in_order` (``statically_known_true`` only: no guard is installed, the
    ranges stay), and "both layouts" still reads as NCHW; concrete tensors and other ranks get the
    original rule. A layout that cannot be proven for every size is read as not NHWC: the pass then
    converts where an NHWC operator needs it, which is correct for either layout.

    Returns:
        The replacement ``(tensor) -> bool``: True when ``tensor`` is channels-last (NHWC) and not
        also contiguous (NCHW).
    """

    @functools.wraps(original)
    def is_nhwc_tensor(tensor: torch.Tensor) -> bool:
        if not _has_symbolic_layout(tensor) or tensor.dim() != 4:
            return bool(original(tensor))
        nhwc = provably_dense_in_order(tensor, (1, 3, 2, 0))
        nchw = provably_dense_in_order(tensor, (3, 2, 1, 0))
        return nhwc and not nchw

    return is_nhwc_tensor


def _stride_order_without_guards(stride: Any) -> tuple[int, ...]:
    """Axes sorted by decreasing stride, comparing with ``statically_known_true`` only: strides not
    provably different keep their order (Python's sort is stable), as equal strides do upstream."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    def smaller(a: Any, b: Any) -> bool:
        return bool(statically_known_true(a < b))

    order = list(range(len(stride)))
    # insertion sort by decreasing stride: stable, and only proven comparisons move an axis
    for i in range(1, len(order)):
        j = i
        while j > 0 and smaller(stride[order[j - 1]], stride[order[j]]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    return tuple(order)


@register_patch(
    "executorch",
    "executorch.exir.tensor.dim_order_from_stride",
    description=(
        "ExecuTorch's TensorSpec derives a dim order by sorting symbolic strides with guard_or_true comparisons, "
        "which guard at the sample: SpecPropPass narrowed a PP-OCR detector's image width from [1, 128] to "
        "[1, 32] (a 1x1 stride-32 map) before memory planning; strides are ordered without guards"
    ),
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/tensor.py",
    versions={"executorch": ">=1.3"},
)
def dim_order_without_size_guards(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``executorch.exir.tensor.dim_order_from_stride`` for symbolic strides.

    ``to_executorch`` runs ``SpecPropPass`` first, which builds a ``TensorSpec`` for every node;
    its dim order comes from sorting the strides with a comparator that ends in
    ``guard_or_true(a != b)`` and ``a < b`` (executorch 1.3-1.4.1). On backed symbolic strides
    these guard at the trace hints: the contiguous strides ``(C*h*w, h*w, w, 1)`` of a map that is
    1x1 in the sample compare ``w`` with ``1`` and install ``w == 1``, i.e. the image width
    ``<= 32`` for a stride-32 map of a 32x32 sample. Memory planning then bounds every size in
    that narrowed range (PP-OCR text detectors: ``pixel_values`` planned ``[8, 3, 32, 32]``
    although the program was captured for sides up to 128) and the ``.pte`` refuses larger images.
    For strides with a symbolic entry the wrapper orders axes by decreasing stride using proven
    comparisons only (``statically_known_true``), keeping the given order where no order is
    proven, which is what upstream's stable sort returns for equal strides; concrete strides get
    the original. A dim order is only a layout tag here: tensors outside delegates are contiguous
    in the edge program, for which both answers agree.

    Returns:
        The replacement ``(stride) -> tuple`` of axis indices, outermost first.
    """

    @functools.wraps(original)
    def dim_order_from_stride(stride: Any) -> Any:
        if not any(isinstance(value, torch.SymInt) for value in stride):
            return original(stride)
        return _stride_order_without_guards(stride)

    return dim_order_from_stride


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack._passes._transform",
    description=(
        "XNNPACK preprocess: skip the passes that cannot change a delegated partition (no op they rewrite, no op "
        "of the patterns they match): each one re-traces the partition, and the SDPA/bilinear ones first build "
        "their pattern graphs by exporting modules (~5 s per process); the result is byte-identical"
    ),
    issue="https://github.com/pytorch/executorch/pull/1893",
    versions={"executorch": ">=1.3"},
)
def xnnpack_preprocess_skips_inapplicable_passes(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the ``_transform`` that ``XNNPACKPassManager.transform`` applies each pass with.

    ``XnnpackBackend.preprocess`` runs all 17 XNNPACK passes on every partition; each pass ends
    by re-tracing the partition with fake tensors (symbolic sizes under dynamic shapes), whether
    it changed anything or not, and ``ConvertToSDPAPass`` / ``ConvertToUpsampleBilinear2d`` build
    their pattern graphs with ``torch.export`` + ``to_edge`` on first use. A tiny 2-layer llama
    exported with dynamic batch and sequence has 27 partitions: 459 pass runs, ~5 s of pattern
    building and ~0.5 s per pass, for passes that find nothing to do. The XNNPACK authors named
    the problem ("XNNPACK preprocess is very very slow due to running many transform passes ...
    we dont run unrelated transform passes", https://github.com/pytorch/executorch/pull/1893,
    closed unmerged).

    The wrapper checks, just before a listed pass would run, whether the partition's current
    graph holds an op the pass acts on (:data:`_XNNPACK_PASS_NEEDS`); if not, the program is
    passed on unchanged. The next pass that runs re-traces the graph anyway (the always-run
    ``ChannelsLastTaggedReshapePass`` and ``RemoveRedundantCopyPass`` come last), so the
    serialized delegate is the same: the ``.pte`` of the tiny llama, BERT and ViT exports is
    byte-identical with and without the wrapper. Unlisted passes and calls with several passes
    go to ``original``. ``ConvertToLinearPass`` and ``DimOrderOpsRevertPass`` re-trace every
    partition they see too, and rewrite only [add]mm / bmm (or a linear with a view_copy) and
    dim_order ops: skipping them elsewhere took 6% / 10% of the ``lower`` stage's CPU time off
    tiny BERT / ViT exports (mean of two interleaved runs: 8.6 -> 8.0 s, 6.2 -> 5.5 s; tiny llama
    unchanged at 11.5 s, its partitions hold the matmuls), with the same ``.pte`` bytes (tiny BERT,
    ViT, and llama's prefill and decode).
    """

    @functools.wraps(original)
    def transform(exported_program: Any, *passes: Any, **kwargs: Any) -> Any:
        if len(passes) == 1 and not kwargs:
            needs = _XNNPACK_PASS_NEEDS.get(type(passes[0]).__name__)
            if needs is not None and not needs(_edge_op_names(exported_program.graph)):
                logger.debug("XNNPACK preprocess: %s skipped (nothing to act on)", type(passes[0]).__name__)
                return exported_program
        return original(exported_program, *passes, **kwargs)

    return transform


def _patch_sized(conv: torch.nn.Conv3d, x: torch.Tensor) -> bool:
    """A Conv3d applied to exactly one kernel-sized patch per row (a patch embedding)."""
    padding = conv.padding if isinstance(conv.padding, tuple) else (conv.padding,) * 3
    return (
        x.dim() == 5
        and tuple(conv.stride) == tuple(conv.kernel_size)
        and tuple(conv.dilation) == (1, 1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and all(p == 0 for p in padding)
        and all(isinstance(s, int) and s == k for s, k in zip(x.shape[2:], conv.kernel_size))
    )


@register_patch(
    "executorch",
    "torch.nn.Conv3d.forward",
    description=(
        "compute a patch-embedding Conv3d (one kernel-sized patch per row) as a matmul, since the portable "
        "ExecuTorch convolution kernel rejects 5-D inputs and XNNPACK does not take Conv3d"
    ),
    issue="https://github.com/pytorch/executorch/issues/11704",
    versions={"executorch": ">=0.4"},
)
def patchify_conv3d_as_matmul(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``Conv3d.forward`` by an exact matmul form when each input row is one patch.

    Vision encoders of video-capable models (Qwen2-VL's ``PatchEmbed``) embed ``t x p x p`` patches
    with a ``Conv3d`` whose kernel and stride equal the input's spatial size. ExecuTorch's
    portable ``aten::convolution.out`` checks for 3-D/4-D inputs and fails at run time on 5-D ones
    (pytorch/executorch#11704; the portable Conv3d support of PR 19977 was reverted in PR 20888),
    and no CPU delegate takes it. Such a convolution is a matrix product: ``[n, c, t, p, p]``
    flattened to ``[n, c*t*p*p]`` times the weight seen as ``[out, c*t*p*p]``, plus the bias,
    reshaped to ``[n, out, 1, 1, 1]``. Any other Conv3d (several patches per row, padding,
    dilation, groups, symbolic spatial sizes) keeps the original forward.
    """

    @functools.wraps(original)
    def forward(self: torch.nn.Conv3d, input: torch.Tensor) -> torch.Tensor:
        if not _patch_sized(self, input):
            return original(self, input)
        flat = input.reshape(input.shape[0], -1)
        out = flat @ self.weight.reshape(self.out_channels, -1).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(input.shape[0], self.out_channels, 1, 1, 1)

    return forward


#: transformers 5.24 models whose ``torch_chunk_gated_delta_rule`` unrolls its triangular solve under export
GATED_DELTA_RULE_MODELS = ("lara_mini", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp")


@register_patch(
    "executorch",
    *(
        f"transformers.models.{name}.modeling_{name}.is_torchdynamo_exporting"
        for name in GATED_DELTA_RULE_MODELS
    ),
    description=(
        "keep torch.linalg.solve_triangular in the gated delta rule of qwen3_next-style models under torch.export "
        "instead of its unrolled n-1 row updates, which make the ExecuTorch lowering of a tiny model take over ten "
        "minutes; the FX node fix unit_lower_triangular_solve_as_matmuls then turns the solve into matmuls"
    ),
    issue="https://github.com/huggingface/transformers/pull/47808",
    versions={"transformers": ">=5.20"},
)
def gated_delta_rule_keeps_the_triangular_solve(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace the modeling module's ``is_torchdynamo_exporting`` with a function returning False.

    In each module of :data:`GATED_DELTA_RULE_MODELS` (transformers 5.24) the name is read once, by
    ``torch_chunk_gated_delta_rule``, to choose between ``torch.linalg.solve_triangular`` (eager)
    and a forward substitution unrolled over the chunk (``chunk_size - 1`` = 63 sliced in-place
    updates per linear-attention layer, added by transformers PR 47808 for export targets without
    the solver). The unrolled form captures (a tiny olmo_hybrid: about 40 s) but ExecuTorch's
    lowering of it ran for more than ten minutes on 2 cores; with the solver the captured graph has
    377 nodes and captures in 14 s. The solver has no ExecuTorch kernel:
    :func:`hfexport_executorch.workarounds.fx_fixes.unit_lower_triangular_solve_as_matmuls`
    rewrites it. Other readers of the name in these modules: none (checked for transformers 5.24).
    """

    @functools.wraps(original)
    def is_torchdynamo_exporting() -> bool:
        return False

    return is_torchdynamo_exporting


register_dense_experts("executorch.xnnpack", every_implementation=True)

# Recurrences (mamba selective scan, RWKV time mixing, RG-LRU): the loop-free chunked form instead of a
# per-token loop that capture unrolls (issue 28)
register_recurrences("executorch", form="chunked")
# RWKV's token shift crops with a negative padding width, which the portable kernel refuses (0x12)
register_time_shift_without_crop("executorch", versions={"executorch": ">=1.0"})
# RecurrentGemma: XNNPACK refuses a delegated lone transpose whose one value it returns twice
register_sliced_transpose_per_consumer("executorch.xnnpack", versions={"executorch": ">=1.0"})
# torch.lgamma (StudentT log_prob of the forecasters' loss, issue 28) from elementary operations:
# aten.lgamma is outside the core ATen opset (SpecViolationError at to_edge)
register_lgamma_elementary("executorch")
# autoformer's FFT auto-correlation (issue 28) as real DFT matrix products: the edge dialect refuses
# complex64 tensors (SpecViolationError on the complex aten.mul of the spectra)
register_real_autocorrelation(
    "executorch", issue="https://github.com/pytorch/executorch/issues/1362", versions={"executorch": ">=1.3"}
)
# SpeechT5's eval-mode prenet dropout (issue 28): aten.bernoulli.p has no ExecuTorch kernel, aten.rand has one;
# no upstream issue filed; the portable kernel table lists rand.out and no bernoulli
register_bernoulli_as_uniform(
    "executorch",
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/kernels/portable/functions.yaml",
    versions={"executorch": ">=1.3"},
)
# VITS's noise (issue 28): aten.randn_like is outside the core ATen opset (SpecViolationError at to_edge)
register_normal_from_uniform(
    "executorch",
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/kernels/portable/functions.yaml",
    versions={"executorch": ">=1.3"},
)
# fnet's token mixing fftn(x, dim=(1, 2)).real (issue 28) as cosine/sine matrix products: the edge dialect
# refuses the complex64 copy of the hidden states (SpecViolationError)
register_real_fourier_mixing(
    "executorch", issue="https://github.com/pytorch/executorch/issues/1362", versions={"executorch": ">=1.3"}
)


def circular_pad_as_concat(input: torch.Tensor, pad: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``torch.nn.functional.pad(input, pad, mode="circular")`` as slices and ``torch.cat``.

    ``pad`` lists ``(before, after)`` pairs from the last axis backwards, as ``F.pad`` takes
    them; each axis gets its last ``before`` steps in front and its first ``after`` steps behind
    (the periodic extension), the same values as ``F.pad``.

    Args:
        input: a tensor of any dtype with at least ``len(pad) // 2`` axes.
        pad: an even number of non-negative ints, each at most the size of its axis.

    Returns:
        ``input`` padded: each padded axis ``before + size + after`` long.

    Raises:
        ValueError: ``pad`` has an odd length, a negative width, more pairs than ``input`` has
            axes, or a width larger than its axis (``F.pad`` refuses those as well).
    """
    widths = [int(w) for w in pad]
    if len(widths) % 2 or any(w < 0 for w in widths) or len(widths) // 2 > input.dim():
        raise ValueError(
            f"circular_pad_as_concat takes non-negative (before, after) pairs for at most {input.dim()} axes, "
            f"got {tuple(pad)}"
        )
    out = input
    for pair in range(len(widths) // 2):
        axis = input.dim() - 1 - pair
        before, after = widths[2 * pair], widths[2 * pair + 1]
        size = out.shape[axis]
        if before > size or after > size:
            raise ValueError(
                f"circular padding of ({before}, {after}) is larger than axis {axis} of size {size}; "
                "pad at most the axis size"
            )
        parts = []
        if before:
            parts.append(out.narrow(axis, size - before, before))
        parts.append(out)
        if after:
            parts.append(out.narrow(axis, 0, after))
        out = torch.cat(parts, dim=axis) if len(parts) > 1 else out
    return out


@register_patch(
    "executorch",
    "torch.nn.functional.pad",
    description=(
        "circular padding (autoformer's trend projection, Conv1d(padding_mode='circular')) as slices and "
        "torch.cat: its decomposition allocates with aten.empty, which to_edge's dim-order pass turns into "
        "_empty_dim_order with int sizes, fixing the dynamic batch at the sample's (the program then refuses "
        "batch 3)"
    ),
    issue="https://github.com/pytorch/executorch/issues/11704",
    versions={"executorch": ">=1.3"},
)
def circular_pad_without_empty(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.nn.functional.pad`` while exporting: ``mode="circular"`` with non-negative
    widths for every axis after batch and channel (what ``F.pad`` accepts in that mode), each at
    most its axis size, runs :func:`circular_pad_as_concat`; every other call runs the original
    (which computes, or refuses, as before)."""

    @functools.wraps(original)
    def pad(input: Any, pad: Any, mode: str = "constant", value: Any = None) -> Any:
        if (
            mode == "circular"
            and isinstance(input, torch.Tensor)
            and all(isinstance(w, int) and w >= 0 for w in pad)
            and len(pad)
            == 2 * (input.dim() - 2)  # F.pad's circular mode pads every axis after batch, channel
            and all(
                pad[2 * i] <= input.shape[-1 - i] and pad[2 * i + 1] <= input.shape[-1 - i]
                for i in range(len(pad) // 2)
            )
        ):
            return circular_pad_as_concat(input, pad)
        return original(input, pad, mode, value)

    return pad


@register_patch(
    "executorch",
    "executorch.exir.backend.utils.WhyNoPartition.__call__",
    description=(
        "the partitioners' 'why no partition' logger keeps the name of the last node it explained, not the "
        "node: its module-level instance held the node, hence the lowered program and its weights, forever"
    ),
    # no upstream issue found: the URL names the attribute assignment that keeps the node
    issue="https://github.com/pytorch/executorch/blob/main/exir/backend/utils.py",
    versions={"executorch": ">=0.7"},
)
def partition_log_keeps_no_node(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``WhyNoPartition.__call__`` while exporting.

    ``WhyNoPartition`` (``why = WhyNoPartition(logger)``, module-level in XNNPACK's partitioner
    configs) stores the last node it was asked about and logs itself at debug level. That node
    belongs to the edge graph being partitioned, so after the export the module global keeps the
    graph, its ``LoweredBackendModule`` children (each with its partition's original program and
    weights) and the delegates' serialized data alive: measured on a 218M-parameter Qwen3 (fp32,
    0.87 GB of weights), 1.3 GB still resident after the program was dropped. The replacement logs
    the same line and keeps only the node's name (``str(node)``, what the message prints).
    """

    def __call__(self: Any, node: Any, reason: str) -> None:
        original(self, node, reason)
        self.node = str(node)

    __call__.__doc__ = original.__doc__
    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


@register_patch(
    "executorch",
    "executorch.exir.backend.utils.is_same_node",
    description=(
        "memoize the node comparisons of delegate lowering for one export only: the module-level unbounded "
        "lru_cache kept every compared graph node, hence the lowered program and its weights, forever"
    ),
    # no upstream issue found: the URL names the @lru_cache(maxsize=None) on is_same_node
    issue="https://github.com/pytorch/executorch/blob/main/exir/backend/utils.py",
    versions={"executorch": ">=0.7"},
)
def node_comparison_cache_per_export(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``is_same_node`` while exporting with the same function memoized in a cache of its own.

    ``executorch.exir.backend.utils.is_same_node`` (used while lowering to delegates) is an
    unbounded ``lru_cache`` keyed by FX nodes: after an export it keeps the edge graph, its lowered
    modules and their weights alive for the rest of the process (measured on a 218M-parameter
    Qwen3: 55 ``LoweredBackendModule`` and 1.3 GB still resident after the program was dropped).
    While the patch is installed the comparisons are memoized the same way in a fresh cache, which
    is dropped with the patch when the export ends.
    """
    import functools

    return functools.lru_cache(maxsize=None)(getattr(original, "__wrapped__", original))


class _WeightSharingCopy:
    """The ``copy`` module as ExecuTorch's delegate lowering sees it while the patch is installed:
    ``deepcopy`` of an ``ExportedProgram`` copies its graph and metadata and shares its weights
    (state dict and constants); every other name is the real ``copy`` module's."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def deepcopy(self, value: Any, memo: dict[int, Any] | None = None) -> Any:
        import torch

        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Module):
            return value  # a weight duplicated for another partition: the same tensor serves both
        memo = {} if memo is None else memo
        if isinstance(value, torch.export.ExportedProgram):
            for tensor in [*value.state_dict.values(), *value.constants.values()]:
                if isinstance(tensor, torch.Tensor):
                    memo[id(tensor)] = tensor
        return self._module.deepcopy(value, memo)


@register_patch(
    "executorch",
    "executorch.exir.backend.backend_api.copy",
    "executorch.exir.backend.canonical_partitioners.duplicate_constant_node_pass.copy",
    description=(
        "delegate lowering copies each partition's program before the backend preprocesses it, and each "
        "weight a second partition uses, graph and metadata only: the weights are shared, not copied"
    ),
    # no upstream issue found: the URL names the deepcopy of every partition's program ("in case
    # backends change graph inside preprocess method") in lower_all_submodules_to_backend; the
    # weight copies are duplicate_constant_node's copy.deepcopy of the constant
    issue="https://github.com/pytorch/executorch/blob/main/exir/backend/backend_api.py",
    versions={"executorch": ">=1.0"},
)
def partition_copies_share_the_weights(original: Any) -> Any:
    """Replace the ``copy`` module that delegate lowering uses while exporting.

    ``lower_all_submodules_to_backend`` deep-copies every partition's ``ExportedProgram`` at once
    before handing them to the backend's ``preprocess``, weights included, and
    ``duplicate_constant_node`` deep-copies a weight that a second partition uses (a tied
    embedding: the portable gather and the XNNPACK LM head). Measured on a 218M-parameter Qwen3
    (0.87 GB of weights): the weight copies took resident memory from 0.93 GB to 2.19 GB before the
    first partition was preprocessed. XNNPACK's ``preprocess`` reads the weights (it serializes them
    into its own blobs) and replaces graph values rather than mutating tensors, so the copies share
    the weight tensors (a tensor deep-copies to itself; a program's copy gets a memo pre-filled with
    its weights) and still copy the graph the backend may change.
    """
    return _WeightSharingCopy(original)


def exact_floor_divisions(expr: Any) -> Any:
    """``expr`` with every ``FloorDiv(a, b)`` whose divisor divides its dividend as polynomials
    replaced by the quotient: ``(s**2)//s`` becomes ``s``, ``((2*s - 1)*((s**2)//s))//s`` becomes
    ``2*s - 1`` (innermost first). Inner floor divisions that remain count as integer generators:
    ``(X**2 * Y**2)//(X*Y)`` with ``X = (s - 1)//16 + 1`` becomes ``X*Y``. A quotient that is a
    polynomial with integer coefficients is an integer for every integer value of its generators, so
    the floor changes nothing and the rewrite is exact; any other ``FloorDiv`` (``s//2``,
    ``(s + 1)//s``) is kept.

    Args:
        expr: a sympy expression of size symbols (a ``SymInt``'s ``node.expr``).

    Returns:
        The rewritten expression (``expr`` itself when it has no exact floor division).
    """
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    def quotient(division: Any) -> Any:
        base, divisor = division.args
        if divisor == 0:
            return division
        # inner floor divisions are integers: cancel over them as opaque integer generators, so
        # MobileViT's (X**2 * Y**2)//(X*Y) with X = (side - 1)//16 + 1 cancels to X*Y too
        inner = base.atoms(FloorDiv) | divisor.atoms(FloorDiv)
        generators = {atom: sympy.Dummy(integer=True) for atom in inner}
        value = sympy.cancel(base.xreplace(generators) / divisor.xreplace(generators))
        symbols = sorted(value.free_symbols, key=str)
        if not symbols:
            return value if value.is_Integer else division
        if not value.is_polynomial(*symbols):
            return division
        if not all(coefficient.is_Integer for coefficient in sympy.Poly(value, *symbols).coeffs()):
            return division
        return value.xreplace({dummy: atom for atom, dummy in generators.items()})

    if not expr.has(FloorDiv):
        return expr
    return expr.replace(lambda node: isinstance(node, FloorDiv), quotient)


def _resize_scales_differ(node: Any) -> bool:
    """True when an ``aten.upsample_bilinear2d.vec`` node samples with explicit ``scale_factors``
    that are not its output/input size ratios (``F.interpolate(scale_factor=(h + 0.1) / edge)``:
    the output size is floored, the source coordinates use the given factor)."""
    scales = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_factors")
    source = node.args[0] if node.args else None
    value, out = getattr(source, "meta", {}).get("val"), node.meta.get("val")
    if not scales or not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    for scale, size_in, size_out in zip(scales, value.shape[-2:], out.shape[-2:], strict=False):
        if isinstance(size_in, torch.SymInt) or isinstance(size_out, torch.SymInt):
            return True  # not provably the ratio
        if abs(float(scale) - int(size_out) / int(size_in)) > 1e-9:
            return True
    return False


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.generic_node_configs.UpsampleBilinear2dConfig.check_constraints",
    description=(
        "keep a bilinear resize whose scale_factor is not its output/input size ratio out of XNNPACK: the delegate's "
        "static_resize_bilinear_2d derives its sampling grid from the sizes alone and ignores the given scale, so "
        "HunYuan-V4-VL's position grid, resized by (side + 0.1) / edge, came out up to 0.47 off eager; the portable "
        "upsample_bilinear2d kernel samples with the given scale"
    ),
    # no upstream issue found; executorch 1.4.1 op_static_resize_bilinear_2d.py serializes the output size and
    # align_corners only (the scale_factors argument is dropped)
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/operators/op_static_resize_bilinear_2d.py",
    versions={"executorch": ">=1.3"},
)
def resize_with_own_scale_stays_portable(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``UpsampleBilinear2dConfig.check_constraints`` to decline a resize sampled with its own scale.

    ``F.interpolate(x, scale_factor=s, mode="bilinear", align_corners=False)`` makes the output
    ``floor(size * s)`` and maps output pixel ``i`` to source ``(i + 0.5) / s - 0.5``; when ``s``
    is not ``out / in`` (HunYuan-V4-VL resizes its learned position grid of side ``edge`` by
    ``(side + 0.1) / edge`` "to shift the sampling grid"), that differs from
    ``(i + 0.5) * in / out - 0.5``, which XNNPACK's static bilinear resize computes from the
    sizes. The partitioner does not look at the scale; declined nodes run on the portable
    ``upsample_bilinear2d.vec_out`` kernel, which takes ``scale_factors`` into account. Resizes to a
    size (or a scale that is the ratio) and every other decision are the original's.
    """

    @functools.wraps(original)
    def check_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        if _resize_scales_differ(node):
            logger.debug(
                "upsample %s stays on portable kernels: XNNPACK ignores its scale_factors", node.name
            )
            return False
        return True

    return check_constraints


#: Most dimensions an XNNPACK tensor may have (``XNN_MAX_TENSOR_DIMS`` in xnnpack.h).
XNNPACK_MAX_TENSOR_DIMS = 6


def _rank_above_xnnpack_limit(node: Any) -> bool:
    """True when ``node``'s result or one of its tensor arguments has more than
    :data:`XNNPACK_MAX_TENSOR_DIMS` dimensions."""
    import torch.utils._pytree as pytree

    values = [node.meta.get("val")]
    for arg in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(arg, torch.fx.Node):
            values.append(arg.meta.get("val"))
    return any(
        isinstance(v, torch.Tensor) and v.dim() > XNNPACK_MAX_TENSOR_DIMS for v in pytree.tree_leaves(values)
    )


@register_patch(
    "executorch.xnnpack",
    "executorch.backends.xnnpack.partition.config.xnnpack_config.XNNPartitionerConfig.check_common_constraints",
    description=(
        "keep nodes with a tensor of more than 6 dimensions out of XNNPACK: the partitioner does not check the "
        "rank, and the delegate refuses such a tensor when the method loads ('Failed to define tensor 0 with code: "
        "xnn_status_unsupported_parameter', error 0x1); Inkling's vision encoder folds space-time into depth "
        "through an 8-D reshape and permute"
    ),
    # no upstream issue found for XNNPACK; the same check was added for Cortex-M's transpose in
    # pytorch/executorch#22571. executorch 1.4.1 xnnpack_config.py checks precision and dtypes only
    issue="https://github.com/pytorch/executorch/pull/22571",
    versions={"executorch": ">=1.3"},
)
def tensors_above_six_dims_stay_portable(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``XNNPartitionerConfig.check_common_constraints`` (every XNNPACK node config calls it)
    to decline a node whose result or tensor arguments have more than
    :data:`XNNPACK_MAX_TENSOR_DIMS` dimensions.

    XNNPACK defines tensors of at most 6 dimensions (``XNN_MAX_TENSOR_DIMS``); the ExecuTorch
    partitioner claims a ``permute_copy`` or ``view_copy`` of any rank, the ``.pte`` is written, and
    loading the method fails in ``XNNCompiler::compileModel`` (``xnn_status_unsupported_parameter``,
    ``Failed to load method forward, error: 0x1``). Inkling's vision encoder reshapes
    ``[B, T, H, W, C]`` to 8 dimensions and permutes them to fold time and space into channels
    (issue 28). Declined nodes run on the portable kernels, which take any rank; every other decision
    is the original's.
    """

    @functools.wraps(original)
    def check_common_constraints(self: Any, node: Any, ep: Any) -> bool:
        if not original(self, node, ep):
            return False
        if _rank_above_xnnpack_limit(node):
            logger.debug("%s stays on portable kernels: a tensor has more than 6 dimensions", node.name)
            return False
        return True

    return check_common_constraints
