"""FX fixes applied to the captured program before translation (``register_fx_node_fix("onnx")``).

Each fix ``(gm, node) -> bool`` rewrites one node of the captured graph (True = consumed), or
``(exported_program) -> None`` rewrites the whole program, and names the upstream issue it works
around and the version range it is needed for.
"""

from __future__ import annotations

import logging

import torch

from hfexport.registry import register_fx_program_fix
from hfexport.workarounds.assertions import drop_runtime_assertions

__all__ = ["runtime_assertions_dropped_before_translation"]

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
