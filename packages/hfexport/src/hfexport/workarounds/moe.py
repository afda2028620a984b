"""Mixture-of-experts layers in a form XNNPACK can run.

transformers 5.x computes the experts of MoE layers (Mixtral, Qwen-MoE, ...) through its
experts interface (``transformers.integrations.moe``): by default ``grouped_mm``
(``torch._grouped_mm``), or a Python loop over the experts the router hit (``eager``), whose
trip count depends on the data. Neither lowers to XNNPACK: ExecuTorch has no grouped matmul
kernel, and the loop is data-dependent control flow.

:func:`dense_experts` swaps, for the duration of a ``with`` block, the forward of every experts
module for :func:`dense_experts_forward`: every expert is applied to every token as one batched
matmul over the stacked expert weights, and the router's top-k weights, scattered into a dense
``[tokens, experts]`` matrix (zero for experts a token was not routed to), combine the results.
All experts stay in the graph, whatever the routing of the sample inputs, and the output equals
the sparse computation up to float summation order. The cost is ``num_experts / top_k`` times the
expert FLOPs of a sparse kernel, the price of having no grouped matmul on the target.

Background: the experts interface and its ``grouped_mm``/``batched_mm`` implementations came with
https://github.com/huggingface/transformers/pull/42697.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator

import torch

__all__ = ["dense_experts", "dense_experts_forward", "find_experts_modules"]

logger = logging.getLogger(__name__)

# Attributes the transformers ``use_experts_implementation`` decorator gives every experts module.
_EXPERTS_MARKERS = ("has_gate", "has_bias", "is_transposed", "_apply_gate", "down_proj")


def find_experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return ``(qualified_name, module)`` for every transformers experts module inside ``model``.

    An experts module is one built by transformers' ``use_experts_implementation`` decorator
    (it carries ``has_gate``, ``has_bias``, ``is_transposed``, ``_apply_gate`` and ``down_proj``).
    """
    return [
        (name, module)
        for name, module in model.named_modules()
        if all(hasattr(module, attr) for attr in _EXPERTS_MARKERS)
    ]


def _project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    """``x`` ``[E, T, in]`` or ``[1, T, in]`` times per-expert ``weight`` -> ``[E, T, out]``.

    ``weight`` is ``[E, out, in]`` (``transposed=False``) or ``[E, in, out]`` (``transposed=True``);
    ``bias`` is ``[E, out]`` or ``None``.
    """
    out = torch.matmul(x, weight if transposed else weight.transpose(1, 2))
    if bias is not None:
        out = out + bias.unsqueeze(1)
    return out


def dense_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts forward computing every expert densely (drop-in for a transformers experts module).

    Args:
        self: the experts module (stacked weights ``gate_up_proj``/``up_proj`` and ``down_proj``,
            optional ``*_bias``, the flags ``has_gate``, ``has_bias``, ``is_transposed``,
            ``has_post_expert_norm`` and the ``_apply_gate``/``act_fn`` callables).
        hidden_states: ``[tokens, hidden]`` float.
        top_k_index: ``[tokens, top_k]`` int64 expert ids chosen by the router.
        top_k_weights: ``[tokens, top_k]`` float routing weights.

    Returns:
        ``[tokens, hidden]`` in the dtype of ``hidden_states``:
        ``sum_k top_k_weights[t, k] * expert[top_k_index[t, k]](hidden_states[t])``.
    """
    num_experts = int(self.down_proj.shape[0])
    has_bias = bool(getattr(self, "has_bias", False))
    if getattr(self, "has_gate", True):
        up_weight = self.gate_up_proj
        up_bias = self.gate_up_proj_bias if has_bias else None
    else:
        up_weight = self.up_proj
        up_bias = self.up_proj_bias if has_bias else None
    transposed = bool(getattr(self, "is_transposed", False))

    x = hidden_states.unsqueeze(0)  # [1, T, H], broadcast over experts
    projected = _project(x, up_weight, up_bias, transposed)  # [E, T, 2I] or [E, T, I]
    gated = bool(getattr(self, "has_gate", True))
    projected = self._apply_gate(projected) if gated else self.act_fn(projected)  # [E, T, I]
    out = _project(
        projected, self.down_proj, self.down_proj_bias if has_bias else None, transposed
    )  # [E, T, H]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)

    # Dense routing matrix [T, E]: the weight of expert e for token t, zero when not routed there.
    one_hot = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts).to(out.dtype)  # [T, k, E]
    routing = (one_hot * top_k_weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)  # [T, E]
    combined = (out * routing.transpose(0, 1).unsqueeze(-1)).sum(dim=0)  # [T, H]
    return combined.to(hidden_states.dtype)


@contextlib.contextmanager
def dense_experts(model: torch.nn.Module) -> Iterator[list[str]]:
    """Run every experts module of ``model`` with :func:`dense_experts_forward` inside the block.

    The forward is replaced on each module instance (not on its class), and put back on exit,
    also when the block raises: a module that had no instance-level ``forward`` gets none again.

    Yields:
        The qualified names of the switched modules (empty for a model without experts).
    """
    switched: list[tuple[torch.nn.Module, bool, object]] = []
    names: list[str] = []
    try:
        for name, module in find_experts_modules(model):
            had_own = "forward" in vars(module)
            switched.append((module, had_own, vars(module).get("forward")))
            module.forward = types.MethodType(dense_experts_forward, module)
            names.append(name)
        if names:
            logger.debug("dense experts forward installed on %s", names)
        yield names
    finally:
        for module, had_own, previous in reversed(switched):
            if had_own:
                module.forward = previous
            else:
                vars(module).pop("forward", None)
