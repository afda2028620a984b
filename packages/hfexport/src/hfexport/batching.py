"""Tracing a batch-1 sample as batch 2, so a ``dynamic=True`` export keeps a dynamic batch axis.

``torch.export`` specialises every axis whose sample size is 0 or 1 (the "0/1 specialisation",
pytorch/pytorch#157621), and backends that re-trace the program (ExecuTorch's ``to_edge``) do the
same. A model exported from one real example (one sentence, one image, one audio clip) would
then only run at batch 1. Repeating the rows of every batch-carrying input once gives the batch
axis a sample size of 2 without changing what the program computes; the exporter still validates
the program on the caller's batch-1 inputs. This works on every torch release, unlike the
size-oblivious tracing flag (:func:`hfexport.workarounds.torch_export.keep_size_one_batch_dynamic`),
which is still applied to batch-1 samples with explicit ``dynamic_shapes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfexport.conventions import batch_keys, input_role

__all__ = ["BATCH_KEYS", "widen_unit_batch"]

#: Forward kwargs whose axis 0 is the batch at their usual rank (from the input-role table,
#: :func:`hfexport.conventions.batch_keys`), the ones a sample may widen.
BATCH_KEYS = batch_keys()


def widen_unit_batch(inputs: Mapping[str, Any], config: Any) -> tuple[dict[str, Any], str]:
    """Sample inputs of batch 1 with their rows repeated to batch 2, to trace a dynamic export.

    Widening happens only when all of these hold, else the inputs come back unchanged:

    - ``config.dynamic`` is true and ``config.dynamic_shapes`` is empty (explicit dimensions are
      the caller's decision);
    - every top-level tensor whose role (:mod:`hfexport.conventions.roles`, at its rank) has the
      batch on axis 0 has size 1 there; a role with the batch on another axis (an M-RoPE
      ``position_ids`` ``[3, batch, seq]``) stops it;
    - every other top-level tensor has a leading size other than 1 (``image_grid_thw`` ``[1, 3]``
      is ambiguous, and stops it).

    Then every leaf tensor of size 1 on axis 0 (top-level inputs and the tensors inside caches or
    ``encoder_outputs``, ``[1, ...]``) is repeated along axis 0 to ``[2, ...]``; the values are
    the same rows twice, so the traced computation is the same.

    Args:
        inputs: forward kwargs (tensors, caches, nested outputs, ``None``, Python scalars).
        config: an export config with ``dynamic`` and ``dynamic_shapes``.

    Returns:
        ``(inputs to trace with, reason)``: a new dict and a one-line description for the report,
        or a copy of ``inputs`` and ``""`` when nothing was widened. ``inputs`` is not modified.
    """
    from hfexport.tensors import get_leaf_tensors, set_leaf_tensors

    unchanged = dict(inputs), ""
    if not getattr(config, "dynamic", False) or getattr(config, "dynamic_shapes", None):
        return unchanged
    top = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    roles = {k: input_role(k, v.dim(), present=top) for k, v in top.items()}
    if any(r is not None and r.batch_axis not in (None, 0) for r in roles.values()):
        return unchanged
    batch_carrying = [k for k, r in roles.items() if r is not None and r.batch_axis == 0]
    if not batch_carrying or any(top[k].shape[0] != 1 for k in batch_carrying):
        return unchanged
    if any(top[k].shape[0] == 1 for k in top if k not in batch_carrying):
        return unchanged
    widened = {
        path: tensor.repeat(2, *([1] * (tensor.dim() - 1)))
        for path, tensor in get_leaf_tensors(dict(inputs)).items()
        if tensor.dim() > 0 and tensor.shape[0] == 1
    }
    traced = set_leaf_tensors(dict(inputs), widened)
    return (
        traced,
        f"batch 1 repeated to 2 for tracing ({', '.join(sorted(widened))}): a size-1 axis would be specialised",
    )
