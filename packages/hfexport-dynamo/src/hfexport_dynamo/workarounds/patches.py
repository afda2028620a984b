"""Workarounds installed while ``hfexport-dynamo`` traces a model (``register_patch("dynamo", ...)``).

Each patch is a factory ``original -> replacement`` registered with
:func:`hfexport.registry.register_patch`; :class:`~hfexport_dynamo.exporter.DynamoExporter` installs
the active ones for the ``torch.export`` capture only (the eager model used for validation runs the
original code) and the registry puts the originals back afterwards, also when the export fails.

- :func:`dense_experts_while_tracing`: mixture-of-experts layers whose ``"eager"`` implementation
  loops over the experts the sample routed to (``nonzero()`` on the router output) run a dense
  computation over every expert instead, so every expert stays in the graph whatever the routing.

The ``torch.export`` faults every backend meets (the sliding-window cache slice, size-1 dynamic
batch axes) are worked around by the core capture itself, see :mod:`hfexport.capture_workarounds`.

Under the ``"dynamo-load"`` key (installed by :func:`hfexport_dynamo.load` around
``torch.export.load`` when the caller trusts the file):

- :func:`fallback_warning_with_its_arguments`: torch's weights-only fallback warning is formatted
  with the arguments it has instead of raising inside logging.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch

__all__ = [
    "dense_experts_forward",
    "dense_experts_while_tracing",
    "fallback_warning_with_its_arguments",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------


def dense_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts forward that runs every expert on every token (no data-dependent loop).

    Computes what the ``"eager"`` experts implementation of transformers'
    ``@use_experts_implementation`` layers computes: for each token, the sum over its ``top_k``
    routed experts of ``weight * down(act(gate_up(x)))``. Every expert is evaluated for all tokens
    and weighted by a dense ``[tokens, experts]`` routing matrix that is zero where a token was not
    routed, so the traced graph has a fixed structure and contains every expert whichever experts
    the sample inputs happen to route to. Costs ``num_experts / top_k`` times the expert FLOPs of
    a sparse dispatch.

    Args:
        self: the experts module (``MixtralExperts`` and the like): ``num_experts``,
            ``gate_up_proj`` ``[experts, 2 * inter, hidden]`` (or ``up_proj`` without a gate;
            ``[experts, hidden, out]`` when ``is_transposed``), ``down_proj``, optional
            ``*_bias`` ``[experts, out]``, ``act_fn``/``_apply_gate`` and an optional
            ``post_expert_norm``.
        hidden_states: float ``[tokens, hidden]``.
        top_k_index: int64 ``[tokens, top_k]`` expert ids (ids ``>= num_experts``, used as
            expert-parallel sentinels, contribute nothing, as in the eager loop).
        top_k_weights: float ``[tokens, top_k]`` routing weights.

    Returns:
        float ``[tokens, hidden]`` in the dtype of ``hidden_states``.
    """
    num_experts = int(self.num_experts)
    has_gate = bool(getattr(self, "has_gate", True))
    has_bias = bool(getattr(self, "has_bias", False))
    transposed = bool(getattr(self, "is_transposed", False))
    experts = torch.arange(num_experts, device=top_k_index.device)
    # [tokens, top_k, experts] one-hot of the routed ids -> [tokens, experts] routing weights
    routed = (top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype)
    routing = (routed * top_k_weights.unsqueeze(-1)).sum(dim=1)

    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [experts or 1, tokens, in] -> [experts, tokens, out]
        out = torch.matmul(x, weight if transposed else weight.transpose(-1, -2))
        return out if bias is None else out + bias.unsqueeze(-2)

    up_weight = self.gate_up_proj if has_gate else self.up_proj
    up_bias = getattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", None) if has_bias else None
    hidden = project(hidden_states.unsqueeze(0), up_weight, up_bias)
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat = self._apply_gate(flat) if has_gate else self.act_fn(flat)
    hidden = flat.reshape(num_experts, hidden_states.shape[0], flat.shape[-1])
    down_bias = getattr(self, "down_proj_bias", None) if has_bias else None
    out = project(hidden, self.down_proj, down_bias)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # routing weights stay in their own dtype (fp32 from the router softmax), as in the eager loop
    weighted = out * routing.transpose(0, 1).unsqueeze(-1)
    return weighted.sum(dim=0).to(hidden_states.dtype)


@register_patch(
    "dynamo",
    "transformers.integrations.moe.ExpertsInterface.get_interface",
    description=(
        "MoE experts: replace the 'eager' loop over the experts hit by the sample's routing (nonzero) "
        "with a dense every-expert computation while tracing"
    ),
    issue="https://github.com/huggingface/transformers/issues/38518",
    versions={"transformers": ">=5.0,<6"},
)
def dense_experts_while_tracing(original: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``ExpertsInterface.get_interface`` hand out :func:`dense_experts_forward` for ``"eager"``.

    transformers 5.x dispatches the forward of every ``@use_experts_implementation`` experts
    module through ``ExpertsInterface.get_interface(config._experts_implementation, default)``.
    The default ``"eager"`` forward loops over ``expert_mask.sum(...).nonzero()``: under
    ``torch.export`` the loop length is data-dependent, so the export fails (or, traced with
    concrete values, keeps only the experts the sample routed to). The other implementations
    (``"grouped_mm"``, the default when it can dispatch, ``"batched_mm"``) are left alone.
    """

    @functools.wraps(original)
    def get_interface(self: Any, experts_implementation: str | None, default: Callable[..., Any]) -> Any:
        if experts_implementation in (None, "eager"):
            return dense_experts_forward
        return original(self, experts_implementation, default)

    return get_interface


# --------------------------------------------------------------------------------------------
# Loading (installed by hfexport_dynamo.load with trust_remote_code=True only)
# --------------------------------------------------------------------------------------------


class _FallbackWarningLogger:
    """Proxy of torch's serde logger whose weights-only fallback warning formats correctly."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if (
            isinstance(msg, str)
            and msg.startswith("Fallback to weights_only=False")
            and msg.count("%s") > len(args)
        ):
            msg = msg.rsplit(" after initial failure", 1)[0] + " after the weights-only load failed"
        self._logger.warning(msg, *args, **kwargs)


@register_patch(
    "dynamo-load",
    "torch._export.serde.serialize.log",
    description=(
        "format torch's 'Fallback to weights_only=False' warning, which passes one argument for two %s "
        "(a logging error, raised by handlers such as pytest's)"
    ),
    issue="https://github.com/pytorch/pytorch/pull/189679",
    versions={"torch": ">=2.12,<2.15"},
)
def fallback_warning_with_its_arguments(original: logging.Logger) -> Any:
    """Wrap the module logger of ``torch._export.serde.serialize`` (see :class:`_FallbackWarningLogger`).

    ``deserialize_torch_artifact`` logs ``"... Loaded object of type %s after initial failure: %s"``
    with one argument: formatting the record raises ``TypeError`` inside logging, which prints a
    "Logging error" traceback, or fails the load where a handler re-raises. Only reached when a
    file is loaded with ``trust_remote_code=True`` and its sample inputs need full unpickling.
    """
    return _FallbackWarningLogger(original)
