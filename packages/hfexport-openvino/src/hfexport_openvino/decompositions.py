"""Decompose a captured program with the table OpenVINO's own frontend uses, before our node fixes.

``openvino.convert_model(ExportedProgram)`` first retraces the program with
``run_decompositions`` (core ATen decompositions minus the ops its frontend converts directly).
That retrace can put nodes in the graph that were not in the captured program: decompositions
of ``matmul`` over symbolic batch axes, for example, rebuild a size such as ``(h // 2) ** 2``
from its sympy expression as Python's ``operator.pow`` on SymInts, which the frontend then has
no rule for. Our node fixes (:mod:`hfexport_openvino.workarounds.fx_fixes`) can only rewrite
what they see, so the exporter decomposes first, with the frontend's table, and fixes the
result, then hands the frontend the decomposed graph itself (:func:`frontend_input`), so the
program is retraced once, not twice.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

__all__ = ["decompose_like_openvino", "frontend_input"]

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
    table = CustomDecompTable()  # a fresh table each time: pop() edits it
    for op in ops_to_not_decompose():
        if op in table:
            table.pop(op)
    decomposed = program.run_decompositions(table)
    _DECOMPOSED.add(decomposed)
    return decomposed


#: marks a program this module decomposed (``ExportedProgram`` has no place for our own flags)
_DECOMPOSED: weakref.WeakSet[torch.export.ExportedProgram] = weakref.WeakSet()


def frontend_input(program: torch.export.ExportedProgram) -> Any:
    """What to pass to ``openvino.convert_model`` for ``program``.

    For a program :func:`decompose_like_openvino` decomposed, the frontend's FX decoder over its
    graph module (``TorchFXPythonDecoder(program.module(), dynamic_shapes=True)``, what the
    frontend builds after its own decomposition), so the graph is not retraced a second time; any
    other program (or an OpenVINO without that decoder) is passed as it is.

    Args:
        program: the captured (and possibly decomposed and fixed) ``ExportedProgram``.

    Returns:
        ``openvino.frontend.pytorch.fx_decoder.TorchFXPythonDecoder`` or ``program`` itself.
    """
    if program not in _DECOMPOSED:
        return program
    try:
        from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder
    except ImportError:  # pragma: no cover - every supported OpenVINO has it
        return program
    return TorchFXPythonDecoder(program.module(), dynamic_shapes=True)
