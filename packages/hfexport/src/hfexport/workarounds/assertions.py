"""Runtime assertions of a captured program, for the backends that drop them anyway.

``torch.export`` keeps a check on data computed at run time as a runtime assertion: ``torch._check``
on an unbacked symbol and ``torch._check_tensor_all`` on a tensor become ``aten._assert_scalar`` /
``aten._assert_async.msg`` nodes, fed by the computation of the condition. transformers 5.x
writes its input checks that way (``transformers.utils.import_utils.torch_compilable_check``, used
by the image/video/audio placeholder merges of llava, llava_next, paligemma, idefics, qwen-vl,
gemma3, ... and a few detection heads): under tracing a tensor condition becomes
``torch._check_tensor_all(cond)``, captured as
``aten._is_all_true(cond) -> aten.item -> sym_ite -> aten._assert_scalar`` (llava:
``n_image_tokens * hidden == image_features.numel()``).

ONNX and ExecuTorch programs cannot run assertions: torch.onnx erases the assertion nodes after
decomposition and ExecuTorch's ``RemoveGraphAssertsPass`` erases them in ``to_executorch``. Both
erase the assertion only, not the computation that fed it, which is dead from then on but still
reaches translation (``aten._is_all_true`` has no ONNX function) and the edge dialect verifier
(``aten._is_all_true`` is not core ATen) first. :func:`drop_runtime_assertions` does what those
passes do, earlier and completely: it erases the assertion nodes, then removes the computation
that only fed them (FX dead-code elimination) and the range constraints of the unbacked symbols
that computation defined. A backend registers it with
:func:`hfexport.registry.register_fx_program_fix` under its own key, naming its upstream cause.

Why here and not by patching ``torch_compilable_check`` at capture: the program fix leaves eager
PyTorch and the transformers source alone, keeps the assertions in the programs whose runtime runs
them (a ``.pt2`` still raises on a prompt whose image tokens do not match its images), and covers
every runtime assertion whatever wrote it (``torch._check`` in model code, torch's own
decompositions), where a capture patch would have to replace the name in every modeling module
that imported it and would remove the check for every backend. Values are unchanged: an assertion
returns nothing, and only computation with no other user is removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

__all__ = ["ASSERTION_TARGETS", "DroppedAssertions", "drop_runtime_assertions"]

logger = logging.getLogger(__name__)

#: The runtime-assertion operators :func:`drop_runtime_assertions` erases (the ones torch.onnx's
#: ``remove_assertion_nodes`` and ExecuTorch's ``RemoveGraphAssertsPass`` erase later).
ASSERTION_TARGETS: frozenset[object] = frozenset(
    {
        torch.ops.aten._assert_async.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten._assert_scalar.default,
    }
)


@dataclass
class DroppedAssertions:
    """What :func:`drop_runtime_assertions` removed from a program.

    Attributes:
        assertions: assertion nodes erased.
        dead_nodes: nodes removed by dead-code elimination afterwards (the conditions' computation).
        symbols: names of the unbacked symbols whose range constraint was removed, sorted.
    """

    assertions: int = 0
    dead_nodes: int = 0
    symbols: list[str] = field(default_factory=list)


def _graph_modules(exported_program: torch.export.ExportedProgram) -> list[torch.fx.GraphModule]:
    return [m for m in exported_program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]


def _unbacked_symbols_in_use(modules: list[torch.fx.GraphModule]) -> set[object]:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    used: set[object] = set()
    for module in modules:
        for node in module.graph.nodes:
            for leaf in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
                    used |= free_unbacked_symbols(leaf)
    return used


def drop_runtime_assertions(exported_program: torch.export.ExportedProgram) -> DroppedAssertions:
    """Erase the runtime assertions of ``exported_program`` and the computation only they used, in place.

    Every ``aten._assert_async`` (both overloads) and ``aten._assert_scalar`` node of the program's
    graph and of its nested graph modules (control-flow branches) is erased; each graph module is
    then dead-code eliminated (``torch.fx.Graph.eliminate_dead_code``: nodes with no user that are
    not side-effectful, so other assertions such as ``_assert_tensor_metadata``, in-place ops and
    random ops stay) and recompiled. Range constraints of unbacked symbols (``u0``, from ``item``)
    that no remaining node refers to are removed, so later passes (bounds, memory planning) do not
    see symbols without a definition. Inputs, outputs, the graph signature and the values computed
    are unchanged.

    Args:
        exported_program: a captured program (ATen dialect, before backend lowering).

    Returns:
        A :class:`DroppedAssertions` with the counts (all zero when the program had no assertion;
        the graph is then left untouched).
    """
    modules = _graph_modules(exported_program)
    dropped = DroppedAssertions()
    for module in modules:
        for node in list(module.graph.nodes):
            if node.op == "call_function" and node.target in ASSERTION_TARGETS and not node.users:
                module.graph.erase_node(node)
                dropped.assertions += 1
    if not dropped.assertions:
        return dropped
    for module in modules:
        before = len(module.graph.nodes)
        module.graph.eliminate_dead_code()
        dropped.dead_nodes += before - len(module.graph.nodes)
        module.recompile()
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    in_use = _unbacked_symbols_in_use(modules)
    constraints = exported_program.range_constraints
    for symbol in list(constraints):
        if free_unbacked_symbols(symbol) and symbol not in in_use:
            del constraints[symbol]
            dropped.symbols.append(str(symbol))
    dropped.symbols.sort()
    logger.debug(
        "dropped %d runtime assertion(s), %d dead node(s), unbacked symbol(s) %s",
        dropped.assertions,
        dropped.dead_nodes,
        dropped.symbols,
    )
    return dropped
