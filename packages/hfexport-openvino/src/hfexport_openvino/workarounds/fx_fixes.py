"""Workarounds for OpenVINO conversion faults, applied to the captured program (key ``"openvino"``).

- :func:`drop_empty_cat_operands`: ``aten.cat`` operands that are 1-D empty tensors are removed.
  PyTorch keeps the legacy rule that such tensors are skipped whatever ``dim`` says (transformers'
  ``DynamicCache`` starts every layer as ``torch.tensor([])`` and concatenates the first keys onto
  it); OpenVINO's PyTorch frontend builds a ``Concat`` over all operands and fails
  ("Axis -2 out of the tensor rank range [-1, 0]").
- the core's dense mixture-of-experts forward (:mod:`hfexport.workarounds.moe`) for every
  implementation: OpenVINO has no conversion for ``torch._grouped_mm``, and the ``"eager"`` loop
  depends on the routing of the sample (``nonzero()``).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.registry import register_fx_node_fix
from hfexport.workarounds.moe import register_dense_experts

__all__ = ["BACKEND", "drop_empty_cat_operands"]

#: Registry key of this backend's workarounds.
BACKEND = "openvino"


def _is_legacy_empty(value: Any) -> bool:
    val = getattr(value, "meta", {}).get("val") if isinstance(value, torch.fx.Node) else value
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 1
        and isinstance(val.shape[0], int)
        and val.shape[0] == 0
    )


@register_fx_node_fix(
    BACKEND,
    description=(
        "drop 1-D empty operands of aten.cat (PyTorch's legacy skip rule, hit by DynamicCache's lazy "
        "torch.tensor([]) layers), which OpenVINO's Concat rejects as an axis out of range"
    ),
    issue="https://github.com/pytorch/pytorch/issues/185535",
    versions={"openvino": ">=2026.0"},
)
def drop_empty_cat_operands(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.cat([empty_1d, x, ...], dim)`` as ``aten.cat([x, ...], dim)``.

    Only operands whose traced value is exactly 1-D with 0 elements are dropped, and only when
    another operand has more dimensions (PyTorch skips exactly those). Returns True when the node
    was rewritten.
    """
    if node.target is not torch.ops.aten.cat.default or not node.args:
        return False
    operands = node.args[0]
    if not isinstance(operands, (list, tuple)):
        return False
    kept = [x for x in operands if not _is_legacy_empty(x)]
    if len(kept) == len(operands) or not kept:
        return False
    if not any(getattr(x, "meta", {}).get("val", torch.empty(0)).dim() > 1 for x in kept):
        return False
    node.args = (kept, *node.args[1:])
    return True


# OpenVINO converts no torch._grouped_mm; the "eager" loop specialises on the sample routing
register_dense_experts(BACKEND, every_implementation=True)
