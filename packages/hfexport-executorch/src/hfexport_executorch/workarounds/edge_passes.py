"""Graph passes run on the lowered edge program, before ExecuTorch's own ``to_executorch`` passes.

Some nodes only appear once ``to_edge`` has re-traced the captured program, so a fix of the
captured program (:mod:`hfexport_executorch.workarounds.fx_fixes`) cannot reach them. Entries of
the registry kind :data:`KIND` are ``pass_(graph_module) -> int`` (the number of nodes
rewritten); :func:`hfexport_executorch.lowering.plan_memory` runs the active ones first among the
``ExecutorchBackendConfig.passes`` (:func:`edge_passes`). Each names the upstream issue it works
around and the versions in which it is needed.
"""

from __future__ import annotations

import builtins
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult

from hfexport import registry

__all__ = ["KIND", "edge_passes", "symbolic_powers_as_products"]

logger = logging.getLogger(__name__)

#: Registry kind of the passes on the lowered edge program (listed by ``hfexport patches``).
KIND = "executorch_edge_pass"

registry.register_kind(
    KIND,
    description="pass(graph_module) -> int rewriting the lowered edge program before to_executorch (plan_memory)",
)

# ``operator.pow`` and ``builtins.pow`` are distinct objects; both print as "<built-in function pow>"
_POW = (operator.pow, builtins.pow)


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


@registry.register(
    KIND,
    "executorch",
    "operator.pow",
    description=(
        "rewrite symbolic-size powers (x ** k of SymInts, which torch's sympy-to-FX reification emits for an "
        "expression such as MobileViT's (side // 16) ** 2 patches) as products: ExecuTorch's emitter knows no "
        "pow among its symbolic-int prim ops and refused the program ('invalid target for call_function pow')"
    ),
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/passes/executorch_prim_ops_registry.py",
    versions={"executorch": ">=1.3"},
)
def symbolic_powers_as_products(gm: torch.fx.GraphModule) -> int:
    """Replace each ``pow(x, k)`` node of symbolic integers (``k`` a literal int >= 1) by ``x * x * ...``.

    ``to_edge`` re-traces the program and materialises the symbolic sizes its views need from
    their sympy expressions; torch (2.12-2.13) interprets ``Pow`` with ``PythonReferenceAnalysis``,
    which writes ``a ** b``, so the edge graph holds ``operator.pow`` nodes (MobileViT's attention
    over ``num_patches = (((side - 1) // 16) + 1) ** 2`` patches, captured with dynamic image
    sides). ExecuTorch 1.4.1 maps a fixed table of Python symbolic-int operators to its
    ``executorch_prim`` ops (``executorch_prim_ops_registry.py``: add, sub, mul, floordiv, ...,
    no pow), and its emitter raises ``InternalError: invalid target for call_function <built-in
    function pow>`` on anything else. A power with a literal positive integer exponent is a
    product of ``k`` factors, which the table has (``operator.mul``); the value is the same for
    every size. Other powers (symbolic or negative exponents, floats) are left for the emitter to
    refuse as before.

    Args:
        gm: the edge program's graph module (its nested graph modules are rewritten too).

    Returns:
        The number of ``pow`` nodes replaced.
    """
    replaced = 0
    for module in _graph_modules(gm):
        graph = module.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _POW or node.kwargs or len(node.args) != 2:
                continue
            base, exponent = node.args
            if (
                not isinstance(base, torch.fx.Node)
                or isinstance(exponent, bool)
                or not isinstance(exponent, int)
            ):
                continue
            if exponent < 1:
                continue
            base_val = base.meta.get("val")
            product: torch.fx.Node = base
            value: Any = base_val
            with graph.inserting_before(node):
                for _ in range(exponent - 1):
                    product = graph.call_function(operator.mul, (product, base))
                    product.meta = {k: v for k, v in node.meta.items() if k != "val"}
                    if value is not None and base_val is not None:
                        value = value * base_val
                        product.meta["val"] = value
            node.replace_all_uses_with(product)
            graph.erase_node(node)
            replaced += 1
        if replaced:
            graph.lint()
            module.recompile()
    return replaced


def _as_pass(
    func: Callable[[torch.fx.GraphModule], int], name: str
) -> Callable[[torch.fx.GraphModule], PassResult]:
    def run(gm: torch.fx.GraphModule) -> PassResult:
        count = func(gm)
        if count:
            logger.debug("edge pass %s rewrote %d node(s)", name, count)
        return PassResult(gm, bool(count))

    run.__name__ = name.rsplit(".", 1)[-1]
    return run


def edge_passes(backend: str = "executorch") -> list[Callable[[torch.fx.GraphModule], PassResult]]:
    """The active entries of :data:`KIND` for ``backend`` (``"executorch"`` or a scope such as
    ``"executorch.xnnpack"``), wrapped as ``ExecutorchBackendConfig.passes`` (``gm -> PassResult``).

    Raises:
        ValueError: ``backend`` is not a dotted name.
    """
    return [_as_pass(entry.func, entry.name) for entry in registry.active_entries(KIND, backend)]
