"""FX program and node fixes applied to the captured program before ExecuTorch lowering.

Each fix is registered with :mod:`hfexport.registry` under the ``"executorch"`` key (every
ExecuTorch backend) or a scoped key (``"executorch.xnnpack"``), names the upstream issue it works
around and the versions in which it is needed. The exporter applies them in its
``fx_program_fixes`` and ``fx_node_fixes`` stages.
"""

from __future__ import annotations

import logging
import operator

import torch

from hfexport.registry import register_fx_node_fix, register_fx_program_fix
from hfexport.workarounds.assertions import drop_runtime_assertions
from hfexport_executorch import bounds

__all__ = [
    "BOUNDED_META_KEY",
    "BOUNDS_META_KEY",
    "bound_unbounded_dynamic_ranges",
    "contiguous_attention_outputs",
    "runtime_assertions_dropped_before_edge",
]

logger = logging.getLogger(__name__)

#: ``ep.graph_module.meta`` key where the exporter leaves ``{symbol name: upper bound}`` for the
#: symbols that were captured without one (derived from the axis roles and the model config).
BOUNDS_META_KEY = "hfexport_executorch_bounds"
#: ``ep.graph_module.meta`` key where :func:`bound_unbounded_dynamic_ranges` records what it set.
BOUNDED_META_KEY = "hfexport_executorch_bounded"


@register_fx_program_fix(
    "executorch",
    description=(
        "erase runtime assertions (torch._check / transformers' torch_compilable_check) and the computation only "
        "they use before to_edge: ExecuTorch erases the assertions only in to_executorch, after the edge verifier "
        "has refused their condition (aten._is_all_true is not core ATen)"
    ),
    issue="https://github.com/pytorch/executorch/pull/1319",
    versions={"executorch": ">=1.3"},  # still needed on executorch 1.4.1 (exir/program/_program.py)
)
def runtime_assertions_dropped_before_edge(exported_program: torch.export.ExportedProgram) -> None:
    """Erase the program's runtime assertions and their dead condition chain before ``to_edge``.

    The ExecuTorch runtime does not run assertions: ``RemoveGraphAssertsPass`` erases
    ``aten._assert_async.msg`` / ``aten._assert_scalar`` among the ``to_executorch`` passes
    (pytorch/executorch#1319 proposed moving it to the ATen-to-edge passes; not merged, still so in
    executorch 1.4.1). ``to_edge`` verifies the program first, condition included, and
    transformers 5.24's ``torch_compilable_check`` on a tensor condition (llava's "Image features
    and image tokens do not match" check, the same in many image-text models) is captured as
    ``aten._is_all_true -> item -> _assert_scalar``: ``SpecViolationError: aten._is_all_true is not
    in Core ATen opset``. This fix erases the assertions before lowering and removes the
    computation only they used (:func:`hfexport.workarounds.assertions.drop_runtime_assertions`),
    and the range constraints of the unbacked symbols it defined, so the bounds fix after it does
    not see them. The ``.pte`` checks nothing either way; values are unchanged.
    """
    dropped = drop_runtime_assertions(exported_program)
    if dropped.assertions:
        logger.info(
            "ExecuTorch cannot run runtime assertions: dropped %d (and %d node(s) computing their conditions)",
            dropped.assertions,
            dropped.dead_nodes,
        )


@register_fx_program_fix(
    "executorch",
    description=(
        "give every unbounded dynamic dimension a finite upper bound (axis role rule, see hfexport_executorch.bounds); "
        "ExecuTorch plans memory at upper bounds and otherwise silently plans the traced size (still open upstream)"
    ),
    issue="https://github.com/pytorch/executorch/issues/8766",
    versions={"executorch": ">=1.3"},
)
def bound_unbounded_dynamic_ranges(exported_program: torch.export.ExportedProgram) -> None:
    """Bound every symbol of ``exported_program`` whose range has no finite upper end.

    ExecuTorch memory planning needs a concrete upper bound for each dynamic size
    (https://github.com/pytorch/executorch/issues/8766: unbounded dynamic memory is not
    supported). Since https://github.com/pytorch/executorch/pull/20834 an unbounded size is
    planned at its trace-time value instead of failing, so the program breaks at run time on any
    larger input. This fix sets the upper bound to the value the exporter left in
    ``graph_module.meta[BOUNDS_META_KEY]`` (from the axis role and the model config), or else to
    the role bound of the first user input axis the symbol sizes (model-independent defaults),
    or :data:`hfexport_executorch.bounds.DEFAULT_MAX_SEQUENCE` for a symbol sizing no input.

    Records ``{symbol: upper}`` in ``graph_module.meta[BOUNDED_META_KEY]``.
    """
    planned: dict[str, int] = exported_program.graph_module.meta.get(BOUNDS_META_KEY, {})
    infos = {info.symbol: info for info in bounds.collect_symbols(exported_program)}
    done: dict[str, int] = {}
    for symbol, value_range in list(exported_program.range_constraints.items()):
        if not bounds.is_unbounded(value_range.upper):
            continue
        upper = planned.get(str(symbol))
        if upper is None:
            info = infos.get(symbol)
            if info is not None:
                upper, _ = bounds.role_bound(info.role, info.hint, None)
            else:
                upper = bounds.DEFAULT_MAX_SEQUENCE
        lower = int(value_range.lower) if value_range.lower.is_finite else 0
        upper = max(int(upper), lower)
        bounds.set_symbol_upper_bound(exported_program, symbol, upper)
        done[str(symbol)] = upper
    if done:
        logger.debug("bounded dynamic ranges: %s", done)
    exported_program.graph_module.meta[BOUNDED_META_KEY] = done


_ATTENTION_OPS = (
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
# Ops through which the layout of an attention output flows unchanged or transposed.
_LAYOUT_OPS = (
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    operator.getitem,
)
_TRANSPOSE_OPS = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def _comes_from_attention(node: torch.fx.Node, depth: int = 8) -> bool:
    current = node
    for _ in range(depth):
        if not current.args or not isinstance(current.args[0], torch.fx.Node):
            return False
        current = current.args[0]
        if current.op != "call_function":
            return False
        if current.target in _ATTENTION_OPS:
            return True
        if current.target not in _LAYOUT_OPS:
            return False
    return False


@register_fx_node_fix(
    "executorch",
    description=(
        "copy the transposed scaled_dot_product_attention output to contiguous memory (the model's .contiguous() "
        "is elided at capture), so views stay valid once to_edge decomposes SDPA (still reproduces on torch 2.13)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/136543",
    versions={"torch": ">=2.12"},
)
def contiguous_attention_outputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Insert ``aten.clone(memory_format=contiguous_format)`` after a transpose of an attention output.

    At capture time the CPU SDPA output has the strides of the fused kernel, for which
    ``out.transpose(1, 2)`` is already contiguous, so the model's ``.contiguous()`` is a no-op
    and is not recorded, and the following ``reshape`` is captured as a view. ExecuTorch's
    ``to_edge`` later decomposes SDPA into matmuls whose output is contiguous *before* the
    transpose, and the view that merges the transposed axes then fails with "Cannot view a
    tensor with shape ... and strides ..." (https://github.com/pytorch/pytorch/issues/136543;
    the SDPA stride fix proposed in https://github.com/pytorch/pytorch/pull/169732 was closed
    unmerged). GPT-2's ``Conv1D`` (``x.view(-1, x.size(-1))``) hits it with dynamic shapes.
    The inserted clone restores what ``.contiguous()`` meant; the values are unchanged.

    Applies to ``aten.transpose``/``aten.permute`` nodes whose input comes from a
    ``scaled_dot_product_attention`` output through layout ops only, and that do not already
    feed a clone.

    Returns:
        True when a clone was inserted.
    """
    if node.target not in _TRANSPOSE_OPS or not _comes_from_attention(node):
        return False
    if any(user.target is torch.ops.aten.clone.default for user in node.users):
        return False
    val = node.meta.get("val")
    with gm.graph.inserting_after(node):
        clone = gm.graph.call_function(
            torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
        )
    node.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
    clone.meta = {k: v for k, v in node.meta.items() if k != "val"}
    if isinstance(val, torch.Tensor):
        clone.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    return True
