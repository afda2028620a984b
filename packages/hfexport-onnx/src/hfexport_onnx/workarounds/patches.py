"""Patches installed while the ONNX backend captures and translates (``register_patch("onnx", ...)``).

Each patch is a factory ``original -> replacement`` naming the upstream issue it works around and
the version range it is needed for; :class:`~hfexport_onnx.exporter.OnnxExporter` installs the
active ones with ``hfexport.registry.apply_patches("onnx")`` around capture and translation.
Patches of ``torch``/``transformers`` are reported as *torch patches*, patches of ``torch.onnx``,
``onnxscript``, ``onnx_ir``, ``onnx`` or ``onnxruntime`` as *ONNX patches*.

The ``torch.export`` faults every backend meets (the sliding-window cache slice, size-1 dynamic
batch axes) are worked around by the core capture itself, see :mod:`hfexport.workarounds.torch_export`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hfexport.registry import register_patch
from hfexport.workarounds.recurrences import register_recurrences
from hfexport.workarounds.time_series import register_lgamma_elementary

__all__ = [
    "adaptive_avg_pool_over_dynamic_sides",
    "adaptive_bins",
    "custom_translations_may_take_complex_inputs",
    "eager_experts_as_grouped_matmul",
    "identity_constants_match_exactly",
    "reshape_to_zero_size_keeps_its_computed_shape",
    "rewrite_rules_forget_the_graph",
    "split_of_run_time_chunks_not_folded",
]

logger = logging.getLogger(__name__)

# Recurrences (mamba selective scan, RWKV time mixing, RG-LRU): torch's scan higher-order op, which
# torch.onnx translates to an ONNX Scan, instead of a per-token loop that capture unrolls (issue 28)
register_recurrences("onnx", form="scan")

# torch.lgamma (StudentT log_prob of the forecasters' loss, issue 28) from elementary operations:
# ONNX has no Lgamma operator
register_lgamma_elementary("onnx")


@register_patch(
    "onnx",
    "transformers.integrations.moe.ExpertsInterface.get_interface",
    description=(
        "serve the data-dependent 'eager' experts loop of MoE layers with transformers' grouped_mm experts "
        "while exporting, so every expert stays in the graph"
    ),
    issue="https://github.com/huggingface/transformers/issues/38518",
    versions={"transformers": ">=5.0,<6"},
)
def eager_experts_as_grouped_matmul(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``ExpertsInterface.get_interface`` while exporting.

    MoE layers declared with ``@use_experts_implementation`` pick their forward from
    ``config._experts_implementation``. The ``"eager"`` forward loops over the experts the router
    chose (``nonzero()`` of the routing mask): data-dependent, so ``torch.export`` fails with a
    data-dependent guard, or would keep only the experts the sample reached
    (huggingface/transformers#38518). While exporting, ``"eager"`` is served by transformers' own
    ``grouped_mm`` forward (sort rows by expert, one grouped matmul), whose opaque
    ``transformers::grouped_mm_fallback`` operator is translated to ONNX by
    :func:`hfexport_onnx.workarounds.translations.grouped_mm_fallback` with every expert in the graph. Same
    numbers as the eager loop (float32 sums in another order); other implementations are left
    alone.
    """

    def get_interface(
        self: Any, experts_implementation: str | None, default: Callable[..., Any]
    ) -> Callable[..., Any]:
        if experts_implementation in (None, "eager") and "grouped_mm" in self:
            return original(self, "grouped_mm", default)
        return original(self, experts_implementation, default)

    get_interface.__doc__ = original.__doc__
    get_interface.__wrapped__ = original  # type: ignore[attr-defined]
    return get_interface


@register_patch(
    "onnx",
    "torch.onnx._internal.exporter._registration.ONNXRegistry.register_op",
    description=(
        "let custom translations marked for complex-valued inputs serve them (torch.onnx registers every "
        "custom_translation_table entry as real-only)"
    ),
    # no upstream issue found: the URL names the TODO "Support complex inputs with annotations"
    issue="https://github.com/pytorch/pytorch/blob/main/torch/onnx/_internal/exporter/_compat.py",
    versions={"torch": ">=2.12"},
)
def custom_translations_may_take_complex_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``ONNXRegistry.register_op`` while exporting.

    ``torch.onnx.export(custom_translation_table=...)`` registers each entry with
    ``is_complex=False``, and the dispatcher offers only ``is_complex`` translations to a node with
    complex inputs, so no custom translation can serve one. A function marked by
    ``register_translation(..., complex_inputs=True)`` (attribute
    :data:`hfexport_onnx.workarounds.translations.COMPLEX_ATTR`) is registered as complex instead;
    every other registration is unchanged.
    """
    from hfexport_onnx.workarounds.translations import COMPLEX_ATTR

    def register_op(self: Any, target: Any, function: Callable[..., Any], is_complex: bool = False) -> None:
        return original(
            self, target, function, is_complex=is_complex or bool(getattr(function, COMPLEX_ATTR, False))
        )

    register_op.__doc__ = original.__doc__
    register_op.__wrapped__ = original  # type: ignore[attr-defined]
    return register_op


@register_patch(
    "onnx",
    "onnxscript.rewriter._matcher.SimplePatternMatcher.match",
    description=(
        "a rewrite rule's pattern matcher forgets the graph it matched once the match returns, so the "
        "exported model (every initializer, i.e. the weights) is freed when the export drops it"
    ),
    # no upstream issue found: the URL names the attribute assignment that keeps the graph
    issue="https://github.com/microsoft/onnxscript/blob/main/onnxscript/rewriter/_matcher.py",
    versions={"onnxscript": ">=0.5"},
)
def rewrite_rules_forget_the_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``SimplePatternMatcher.match`` while exporting.

    ``SimplePatternMatcher.match`` stores the graph it is matching (and the current node, the
    tracer, the match in progress) on the matcher; the matchers of the default rewrite rules live
    in module-level rule objects (``onnxscript.rewriter.rules.common``), so after the optimizer ran
    they pin the last graph they saw, with every initializer, for the rest of the process. With
    external weights (``TorchTensor`` initializers sharing the model's parameters) a model freed
    after the export stayed resident: measured on a 218M-parameter Qwen3 (4 layers, fp32), 0.87 GB
    held after ``model.to("meta")``. The wrapper clears that state when ``match`` returns; the
    returned ``MatchResult`` is untouched.
    """

    def match(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            for name in ("_graph", "_current_node", "_tracer", "_match"):
                if name in vars(self):
                    setattr(self, name, None)

    match.__doc__ = original.__doc__
    match.__wrapped__ = original  # type: ignore[attr-defined]
    return match


#: the constants a rewrite pattern names as the identity of an operation (``x + 0``, ``x * 1``):
#: the no-op rules drop the operation, which is exact only when the graph's constant is that value
IDENTITY_CONSTANTS: frozenset[float] = frozenset({0.0, 1.0})


@register_patch(
    "onnx",
    "onnxscript.rewriter._matcher.SimplePatternMatcher._match_constant",
    description=(
        "a rewrite pattern's constant 0 or 1 matches only exactly 0 or 1, not within the default abs_tol 1e-8 / "
        "rel_tol 1e-5: the no-op rule Add(x, 0) -> x dropped CHMv2's `+ 1e-8` shift and its depth moved by 5.6e-2"
    ),
    # no upstream issue found: the URL names the tolerances of the pattern constant
    issue="https://github.com/microsoft/onnxscript/blob/main/onnxscript/rewriter/_pattern_ir.py",
    versions={"onnxscript": ">=0.5"},
)
def identity_constants_match_exactly(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``SimplePatternMatcher._match_constant`` so an identity constant matches exactly.

    A pattern's scalar constant (``onnxscript.rewriter._pattern_ir.Constant``) matches a graph
    constant within ``math.isclose(rel_tol=1e-5, abs_tol=1e-8)``. For the optimizer's no-op rules
    (``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` -> ``x``, run by ``ONNXProgram.optimize()``) that
    removes operations that are not no-ops: CHMv2's depth head adds ``1e-8`` to its shift so a
    pixel whose bin logits are all 0 gets uniform weights; with the ``Add`` dropped the weights
    are ``0 / 0`` clamped, and the depth moved by 5.6e-2 (2.1e-3 relative) on the tiny model while
    the translated graph matched eager to 3e-5. When the pattern's value (every element of a list
    value) is 0 or 1 (:data:`IDENTITY_CONSTANTS`) and the original accepted the graph constant,
    the wrapper also requires the graph constant to equal it exactly; other constants keep the
    original's tolerance (fusion patterns that name 0.044715 or sqrt(2) still match).
    """

    @functools.wraps(original)
    def match_constant(self: Any, pattern_constant: Any, value: Any) -> bool:
        if not original(self, pattern_constant, value):
            return False
        expected = pattern_constant.value
        wanted = list(expected) if isinstance(expected, (list, tuple)) else [expected]
        if not all(isinstance(v, (int, float)) and float(v) in IDENTITY_CONSTANTS for v in wanted):
            return True
        got = np.asarray(value.const_value.numpy()).reshape(-1)
        if got.size != len(wanted) or any(float(g) != float(w) for g, w in zip(got, wanted, strict=True)):
            return self.fail(f"Constant value mismatch: expected exactly {expected}, got {got.tolist()}.")
        return True

    return match_constant


@register_patch(
    "onnx",
    # the rule object's condition: RewriteRuleClassBase.rule() binds the instance's check at import
    "onnxscript.rewriter.rules.common._materialize_reshape_shape.materialize_reshape_shape_rule._condition_function",
    description=(
        "the optimizer does not replace a Reshape's computed shape by a constant with -1 for its one symbolic "
        "dim when another dim is 0: onnxruntime cannot infer -1 for a zero-size tensor (GLM-5-Next's decode, "
        "whose NoPE attention layers hold [batch, 1, seq, 0] rotary keys: Invalid Target shape product of 0)"
    ),
    # the runtime refuses -1 with a 0 by design (onnxruntime#9940); the rule's check ignores 0 dims
    issue="https://github.com/microsoft/onnxruntime/issues/9940",
    versions={"onnxscript": ">=0.7"},
)
def reshape_to_zero_size_keeps_its_computed_shape(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the condition of onnxscript's ``MaterializeReshapeShape`` rule (run by ``ONNXProgram.optimize()``).

    The rule replaces a Reshape's run-time shape (a ``Shape -> Gather -> Concat`` chain) by a
    constant when shape inference knows the output shape up to one symbolic dim, writing ``-1``
    for that dim (with ``allowzero=1``). When the output has a dim of size 0 the tensor is empty
    and the ``-1`` cannot be inferred: onnxruntime refuses the model at load ("Invalid Target shape
    product of 0. Product cannot be 0 in combination with -1"; by design, onnxruntime#9940).
    GLM-5-Next's DSA attention layers have no rotary part (``qk_rope_head_dim`` 0), so its
    ``k_rot.view(batch, 1, seq, 0)`` is such a reshape; in the decode the batch is the only
    symbolic dim. The wrapper refuses the match in that case (the computed shape stays, exact);
    any other match is the original's.

    Returns:
        The original's ``MatchResult``, or a failed one when the materialized shape would hold
        both ``-1`` and ``0``.
    """

    @functools.wraps(original)
    def check(context: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(context, *args, **kwargs)
        dims = getattr(getattr(original, "__self__", None), "_new_dims", None)
        if result and dims is not None and -1 in dims and 0 in dims:
            from onnxscript.rewriter._basics import MatchResult

            return MatchResult().fail("the output is zero-size: -1 cannot be inferred next to a 0 dim")
        return result

    return check


def _is_unknown_scalar_split(node: Any) -> bool:
    """True for a ``SplitToSequence`` whose ``split`` input is a scalar (or of unknown rank) with no
    constant value: a chunk size computed at run time (``x.split(batch_size)`` on a dynamic batch)."""
    from onnxscript.optimizer import _constant_folding

    if len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    split = node.inputs[1]
    if _constant_folding._get_numpy_value(split) is not None:
        return False
    shape = split.shape
    return not (shape is not None and shape.is_static() and len(shape) == 1)


@register_patch(
    "onnx",
    "onnxscript.optimizer._constant_folding.PartialEvaluatorRegistry.lookup_evaluators",
    description=(
        "the optimizer's SplitToSequence folding leaves a split into chunks of a run-time size alone instead "
        "of failing on it (AttributeError: 'NoneType' object has no attribute 'ndim'; ZoeDepth's "
        "hidden_states.split(batch_size) on a dynamic batch failed stage 'optimize')"
    ),
    # the scalar-split branch reads split_value.ndim when only the (scalar) shape of split is known, since
    # microsoft/onnxscript#2544; no issue filed for the crash
    issue="https://github.com/microsoft/onnxscript/pull/2544",
    versions={"onnxscript": ">=0.5"},
)
def split_of_run_time_chunks_not_folded(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``PartialEvaluatorRegistry.lookup_evaluators`` while exporting.

    ``torch.onnx`` translates ``x.split(n, dim)`` with a symbolic ``n`` (ZoeDepth's reassemble stage
    splits its stacked stages by the batch size) to ``SplitToSequence(x, n)`` with a scalar ``n``
    computed in the graph. onnxscript's constant folding of ``SplitToSequence`` (which would turn it
    into ``Split`` + ``SequenceConstruct`` when the chunk count is known) then takes the branch of a
    1-D split and reads ``.ndim`` of the missing constant value: the optimizer raises and the export
    fails in stage ``optimize``. The evaluators returned for ``SplitToSequence`` are wrapped so that
    such a node is not folded (returns ``None``, as the folding does for every case it cannot
    decide); the node stays a ``SplitToSequence``, which ONNX Runtime runs. Every other node and
    every other op's evaluators are the original's.
    """

    def guarded(evaluator: Callable[..., Any]) -> Callable[..., Any]:
        def evaluate(node: Any, op: Any, state: Any) -> Any:
            if _is_unknown_scalar_split(node):
                return None
            return evaluator(node, op, state)

        evaluate.__wrapped__ = evaluator  # type: ignore[attr-defined]
        return evaluate

    def lookup_evaluators(self: Any, domain: str, opname: str, version: int) -> Any:
        found = original(self, domain, opname, version)
        if opname != "SplitToSequence" or domain not in ("", "ai.onnx"):
            return found
        return [guarded(evaluator) for evaluator in found]

    lookup_evaluators.__doc__ = original.__doc__
    lookup_evaluators.__wrapped__ = original  # type: ignore[attr-defined]
    return lookup_evaluators


def adaptive_bins(size: Any, bins: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[bins, size]`` averaging matrix of adaptive average pooling along one axis.

    Row ``i`` averages positions ``floor(i * size / bins)`` to ``ceil((i + 1) * size / bins) - 1``, the
    window ``torch.nn.functional.adaptive_avg_pool2d`` uses (windows overlap when ``bins`` does not
    divide ``size``, and repeat positions when ``bins > size``).

    Args:
        size: the input length along the axis (an int, or a ``SymInt`` while tracing).
        bins: the output length (> 0).
        dtype: floating dtype of the matrix.
        device: its device.

    Returns:
        A ``[bins, size]`` tensor whose rows sum to 1.
    """
    index = torch.arange(bins, device=device)
    start = torch.div(index * size, bins, rounding_mode="floor")
    end = torch.div((index + 1) * size + bins - 1, bins, rounding_mode="floor")
    position = torch.arange(size, device=device)
    inside = (position[None, :] >= start[:, None]) & (position[None, :] < end[:, None])
    return inside.to(dtype) / (end - start)[:, None].to(dtype)


@register_patch(
    "onnx",
    "torch.nn.functional.adaptive_avg_pool2d",
    description=(
        "adaptive average pooling to a size above 1 over dynamic image sides is captured as two averaging matrix "
        "products; torch.onnx fixed its AveragePool window at the sample's sides (PSP heads of BEiT / UperNet "
        "gave other shapes and values at a second image size)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/147720",
    versions={"torch": ">=2.12"},
)
def adaptive_avg_pool_over_dynamic_sides(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.nn.functional.adaptive_avg_pool2d`` while exporting.

    torch.onnx translates ``adaptive_avg_pool2d(x, n)`` with ``n > 1`` to an ``AveragePool`` whose
    kernel and stride are computed from the traced input sides, which are the sample's: on an input
    whose sides are dynamic the ONNX model then pools other windows, and returns another output
    size, at any other image size (pytorch/pytorch#147720; measured: ``adaptive_avg_pool2d(x, 2)``
    traced on 4x4 maps returned 4x4 instead of 2x2 on 8x8 maps, ``(x, 3)`` differed by 0.4). The
    pyramid pooling of BEiT, Data2VecVision and UperNet segmentation heads pools to 1, 2, 3 and 6.
    When a side is symbolic (a dynamic capture) and an output size is above 1, the replacement
    computes ``A_h @ x @ A_w^T`` with the averaging matrices of :func:`adaptive_bins`, which is the
    same windows and the same averages (up to float summation order) at every size. An output size
    of 1 (a global mean, which translates to a ``ReduceMean``), ``None`` entries, static sides and
    eager calls run the original.
    """

    def adaptive_avg_pool2d(input: torch.Tensor, output_size: Any) -> torch.Tensor:
        sizes = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
        symbolic = any(isinstance(side, torch.SymInt) for side in input.shape[-2:])
        if (
            not symbolic
            or len(sizes) != 2
            or not all(isinstance(s, int) for s in sizes)
            or sizes == (1, 1)
            or input.dim() not in (3, 4)
            or not input.is_floating_point()
        ):
            return original(input, output_size)
        rows = adaptive_bins(input.shape[-2], sizes[0], input.dtype, input.device)
        cols = adaptive_bins(input.shape[-1], sizes[1], input.dtype, input.device)
        return torch.matmul(torch.matmul(rows, input), cols.transpose(0, 1))

    adaptive_avg_pool2d.__doc__ = original.__doc__
    adaptive_avg_pool2d.__wrapped__ = original  # type: ignore[attr-defined]
    return adaptive_avg_pool2d
