"""Decompose a captured program with the table OpenVINO's own frontend uses, before our node fixes.

``openvino.convert_model(ExportedProgram)`` first retraces the program with
``run_decompositions`` (core ATen decompositions minus the ops its frontend converts directly).
That retrace can put nodes in the graph that were not in the captured program: decompositions
of ``matmul`` over symbolic batch axes, for example, rebuild a size such as ``(h // 2) ** 2``
from its sympy expression as Python's ``operator.pow`` on SymInts, which the frontend then has
no rule for. Our node fixes (:mod:`hfexport_openvino.workarounds.fx_fixes`) can only rewrite
what they see, so the exporter decomposes first, with the frontend's table, and fixes the
result; the frontend's own retrace of an already decomposed program has nothing left to expand.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["decompose_like_openvino"]

logger = logging.getLogger(__name__)


def decompose_like_openvino(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Return ``program`` decomposed the way ``openvino.convert_model`` decomposes it.

    The table mirrors ``TorchFXPythonDecoder.from_exported_program`` (OpenVINO 2026.x, torch >= 2.6):
    ``torch.export``'s default decomposition table without the ops that
    ``ops_to_not_decompose()`` lists.

    Args:
        program: a captured ``ExportedProgram`` (any dtype, any dynamic shapes).

    Returns:
        A new ``ExportedProgram`` with the same inputs, outputs and range constraints; ``program``
        itself when this OpenVINO has no such table (the frontend then decomposes on its own, as
        before).

    Raises:
        Whatever ``ExportedProgram.run_decompositions`` raises for a program it cannot retrace (a
        data-dependent guard, for example): the same error ``openvino.convert_model`` would raise.
    """
    try:
        from openvino.frontend.pytorch.torchdynamo.export_decompositions import ops_to_not_decompose
        from torch.export.decomp_utils import CustomDecompTable
    except ImportError as exc:  # an OpenVINO without the table: leave decomposition to it
        logger.debug("OpenVINO decomposition table unavailable (%s); convert_model decomposes", exc)
        return program
    table = CustomDecompTable()
    for op in ops_to_not_decompose():
        if op in table:
            table.pop(op)
    return program.run_decompositions(table)
