"""ExecuTorch lowering: edge dialect with delegation, then memory planning and emission.

- :func:`lower_to_edge`: ``executorch.exir.to_edge_transform_and_lower`` with the backend's
  partitioners; returns the ``EdgeProgramManager``.
- :func:`delegation_summary`: how much of the program the delegate took (for the report).
- :func:`plan_memory`: ``EdgeProgramManager.to_executorch`` with a ``MemoryPlanningPass`` built
  from the config's ``alloc_graph_input``, ``alloc_graph_output`` and ``alloc_mutable_buffers``,
  after the registered edge passes (:mod:`hfexport_executorch.workarounds.edge_passes`);
  returns the ``ExecutorchProgramManager``.
- :func:`planned_memory_bytes`: the size of the memory-planned arena of the emitted program.
"""

from __future__ import annotations

import collections
import logging
import operator
from typing import Any

import torch
from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, ExecutorchProgramManager
from executorch.exir import to_edge_transform_and_lower as _to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass

__all__ = [
    "CONSTANT_METHODS_ATTR",
    "constant_methods_of",
    "delegation_summary",
    "lower_to_edge",
    "memory_planning_pass",
    "plan_memory",
    "planned_memory_bytes",
]

logger = logging.getLogger(__name__)

# Nodes that move values around without computing: not counted on either side of the share.
_BOOKKEEPING = {operator.getitem}


#: Attribute a module to export may carry: ``{method name: value}`` written as constant methods of
#: the program (see :func:`lower_to_edge`); the ``llm-runner`` layout's program declares the
#: runner's metadata (``get_max_seq_len`` ...) this way.
CONSTANT_METHODS_ATTR = "executorch_constant_methods"


def constant_methods_of(model: Any) -> dict[str, Any] | None:
    """The constant methods ``model`` declares (:data:`CONSTANT_METHODS_ATTR`), or ``None``."""
    found = getattr(model, CONSTANT_METHODS_ATTR, None)
    return dict(found) if found else None


def lower_to_edge(
    ep: torch.export.ExportedProgram,
    partitioners: list[Any],
    constant_methods: dict[str, Any] | None = None,
) -> EdgeProgramManager:
    """Convert ``ep`` to the ExecuTorch edge dialect and delegate what ``partitioners`` claim.

    Args:
        ep: the captured program.
        partitioners: the backend's partitioners.
        constant_methods: ``{method name: value}`` (an int, float, bool or a list of them) that
            become methods of the program returning that value (ExecuTorch's LLM runner reads its
            metadata this way, e.g. ``get_max_seq_len``); ``None`` for none.

    Raises:
        Whatever ``to_edge_transform_and_lower`` raises (the caller's report stage names it).
    """
    return _to_edge_transform_and_lower(
        ep,
        partitioner=list(partitioners),
        constant_methods=dict(constant_methods) if constant_methods else None,
    )


def _compute_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target in _BOOKKEEPING:
            continue
        name = str(node.target)
        if name.startswith("aten.sym_") or name.startswith("<built-in function") or "_assert" in name:
            continue
        out.append(node)
    return out


def delegation_summary(edge: EdgeProgramManager, method: str = "forward") -> dict[str, Any]:
    """Count the operator nodes a delegate took over versus those left to portable kernels.

    Args:
        edge: the lowered edge program.
        method: the method to inspect.

    Returns:
        ``{"partitions": int, "delegated_nodes": int, "portable_nodes": int, "delegated_share":
        float (0..1, 1.0 for an empty graph), "backends": {backend id: partitions},
        "portable_ops": {op name: count}}``. Operator nodes exclude ``getitem``, symbolic-size
        arithmetic and runtime asserts.
    """
    program = edge.exported_program(method)
    gm = program.graph_module
    delegated = 0
    partitions = 0
    backends: collections.Counter[str] = collections.Counter()
    portable: collections.Counter[str] = collections.Counter()
    for node in _compute_nodes(gm.graph):
        if getattr(node.target, "__name__", "") == "executorch_call_delegate":
            lowered = getattr(gm, node.args[0].target)
            partitions += 1
            backends[str(getattr(lowered, "backend_id", "?"))] += 1
            original = getattr(lowered, "original_module", None)
            inner = original.graph if original is not None else None
            delegated += len(_compute_nodes(inner)) if inner is not None else 1
        else:
            name = getattr(node.target, "__name__", str(node.target))
            portable[name] += 1
    total_portable = sum(portable.values())
    total = delegated + total_portable
    return {
        "partitions": partitions,
        "delegated_nodes": delegated,
        "portable_nodes": total_portable,
        "delegated_share": round(delegated / total, 4) if total else 1.0,
        "backends": dict(backends),
        "portable_ops": dict(portable.most_common()),
    }


def memory_planning_pass(config: Any) -> MemoryPlanningPass:
    """The ``MemoryPlanningPass`` for ``config`` (``alloc_graph_input``, ``alloc_graph_output``,
    ``alloc_mutable_buffers``; see ``hfexport.config.ExecutorchConfig``)."""
    return MemoryPlanningPass(
        alloc_graph_input=bool(config.alloc_graph_input),
        alloc_graph_output=bool(config.alloc_graph_output),
        alloc_mutable_buffers=bool(config.alloc_mutable_buffers),
    )


def plan_memory(
    edge: EdgeProgramManager, config: Any, *, quant_fusion: bool = False
) -> ExecutorchProgramManager:
    """Run the registered edge passes, then ExecuTorch memory planning and emission on ``edge``.

    Args:
        edge: the lowered edge program.
        config: an ``ExecutorchConfig``; its ``alloc_*`` flags reach the ``MemoryPlanningPass``:
            ``alloc_graph_input=False`` leaves input memory to the caller,
            ``alloc_graph_output=False`` output memory, ``alloc_mutable_buffers=False`` the memory of
            mutable buffers (KV caches), instead of placing them in the planned arena.
        quant_fusion: run ExecuTorch's quant fusion and constant propagation
            (``do_quant_fusion_and_const_prop``): ``torchao.dequantize_affine`` + ``embedding`` left
            outside the delegate become ``quantized_decomposed.embedding_4bit`` / ``embedding_byte``,
            which the runtime's quantized kernels run (the portable kernels have no
            ``dequantize_affine``).

    Returns:
        The ``ExecutorchProgramManager``.
    """
    from hfexport_executorch.workarounds.edge_passes import edge_passes

    backend = getattr(config, "backend", None)
    backend_config = ExecutorchBackendConfig(
        passes=edge_passes(f"executorch.{backend}" if backend else "executorch"),
        memory_planning_pass=memory_planning_pass(config),
        do_quant_fusion_and_const_prop=quant_fusion,
    )
    return edge.to_executorch(backend_config)


def planned_memory_bytes(manager: ExecutorchProgramManager, method: str = "forward") -> int:
    """Bytes of the memory-planned arena(s) of ``method`` (what the runtime allocates at load)."""
    for plan in manager.executorch_program.execution_plan:
        if plan.name == method:
            return int(sum(plan.non_const_buffer_sizes))
    return 0
