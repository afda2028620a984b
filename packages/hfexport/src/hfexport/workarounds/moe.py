"""The dense mixture-of-experts forward, shared by every backend that needs it.

transformers 5.x computes the experts of MoE layers (Mixtral, Qwen-MoE, ...) through its experts
interface (``transformers.integrations.moe``): ``ExpertsInterface.get_interface`` hands every
``@use_experts_implementation`` experts module the forward of ``config._experts_implementation``.
Two of them do not survive an export:

- ``"eager"`` loops over the experts the router hit (``nonzero()`` of the routing mask): under
  ``torch.export`` the trip count is data-dependent, so the export fails, or keeps only the experts
  the sample reached (huggingface/transformers#38518);
- ``"grouped_mm"`` (the default where it can dispatch) calls ``torch._grouped_mm``, which runtimes
  without a grouped matmul kernel (ExecuTorch's XNNPACK delegate) cannot run.

:func:`dense_experts_forward` computes every expert on every token as one batched matmul over the
stacked expert weights and combines the results with a dense ``[tokens, experts]`` routing matrix
(zero where a token was not routed), so the graph has a fixed structure with every expert in it.
Its numerics follow the eager loop: ids ``>= num_experts`` (expert-parallel sentinels) contribute
nothing, and each expert's output is weighted in the routing weights' dtype (float32 from the
router softmax) and summed in that dtype before the cast back to the activations' dtype. The cost
is ``num_experts / top_k`` times the expert FLOPs of a sparse dispatch.

A backend registers the patch under its own key with :func:`register_dense_experts`:
``every_implementation=False`` replaces only the ``"eager"`` loop (``hfexport-dynamo``: a ``.pt2``
runs ``torch._grouped_mm`` fine), ``True`` every implementation (``hfexport-executorch`` with
XNNPACK). ``hfexport-onnx`` uses grouped matmul plus a custom translation instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hfexport.registry import register_patch

if TYPE_CHECKING:
    import torch

__all__ = [
    "METADATA",
    "TARGET",
    "dense_experts_for_eager",
    "dense_experts_for_every_implementation",
    "dense_experts_forward",
    "find_experts_modules",
    "register_dense_experts",
]

logger = logging.getLogger(__name__)

#: The attribute the patch replaces.
TARGET = "transformers.integrations.moe.ExpertsInterface.get_interface"

#: The registry metadata of the workaround (the same for every backend key it is registered under).
METADATA: dict[str, Any] = {
    "description": (
        "MoE experts: compute every expert densely (routing-weighted) instead of the data-dependent 'eager' "
        "loop over the experts the sample hit, so every expert stays in the exported graph"
    ),
    "issue": "https://github.com/huggingface/transformers/issues/38518",
    "versions": {"transformers": ">=5.0,<6"},
}

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
    """``x`` ``[E or 1, T, in]`` times per-expert ``weight`` -> ``[E, T, out]``.

    ``weight`` is ``[E, out, in]`` (``transposed=False``) or ``[E, in, out]`` (``transposed=True``);
    ``bias`` is ``[E, out]`` or ``None``.
    """
    import torch

    out = torch.matmul(x, weight if transposed else weight.transpose(-1, -2))
    return out if bias is None else out + bias.unsqueeze(-2)


def dense_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts forward that runs every expert on every token (no data-dependent loop).

    Computes what the ``"eager"`` experts implementation computes: for each token, the sum over
    its ``top_k`` routed experts of ``weight * down(act(gate_up(x)))``.

    Args:
        self: the experts module (``MixtralExperts`` and the like): ``gate_up_proj``
            ``[experts, 2 * inter, hidden]`` (or ``up_proj`` without a gate; ``[experts, hidden,
            out]`` when ``is_transposed``), ``down_proj``, optional ``*_bias`` ``[experts, out]``,
            ``act_fn``/``_apply_gate`` and an optional ``post_expert_norm``. The expert count is
            ``num_experts`` when the module has it, else ``down_proj.shape[0]``.
        hidden_states: float ``[tokens, hidden]``.
        top_k_index: int64 ``[tokens, top_k]`` expert ids; ids ``>= num_experts`` (expert-parallel
            sentinels) contribute nothing, as in the eager loop.
        top_k_weights: float ``[tokens, top_k]`` routing weights (float32 from the router softmax).

    Returns:
        float ``[tokens, hidden]`` in the dtype of ``hidden_states``: each expert's output
        multiplied by its routing weight and summed in the promoted dtype of the two (float32 for
        a float32 router), then cast, as the eager loop does.
    """
    import torch

    num_experts = int(getattr(self, "num_experts", None) or self.down_proj.shape[0])
    has_gate = bool(getattr(self, "has_gate", True))
    has_bias = bool(getattr(self, "has_bias", False))
    transposed = bool(getattr(self, "is_transposed", False))

    up_weight = self.gate_up_proj if has_gate else self.up_proj
    up_bias = getattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias", None) if has_bias else None
    hidden = _project(hidden_states.unsqueeze(0), up_weight, up_bias, transposed)  # [E, T, 2I] or [E, T, I]
    hidden = self._apply_gate(hidden) if has_gate else self.act_fn(hidden)  # [E, T, I]
    down_bias = getattr(self, "down_proj_bias", None) if has_bias else None
    out = _project(hidden, self.down_proj, down_bias, transposed)  # [E, T, H]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)

    # [T, k, E] comparison with the expert ids: a sentinel id (>= E) matches no column
    experts = torch.arange(num_experts, device=top_k_index.device)
    routed = (top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype)
    routing = (routed * top_k_weights.unsqueeze(-1)).sum(dim=1)  # [T, E] in the routing dtype
    weighted = out * routing.transpose(0, 1).unsqueeze(-1)  # promoted (fp32 for an fp32 router)
    return weighted.sum(dim=0).to(hidden_states.dtype)


def _dense_interface(original: Callable[..., Any], every_implementation: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_interface(self: Any, experts_implementation: str | None, default: Callable[..., Any]) -> Any:
        if every_implementation or experts_implementation in (None, "eager"):
            return dense_experts_forward
        return original(self, experts_implementation, default)

    return get_interface


def dense_experts_for_eager(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: ``get_interface`` hands out :func:`dense_experts_forward` for ``"eager"`` only.

    The other implementations (``"grouped_mm"``, ``"batched_mm"``, ...) are left alone.
    """
    return _dense_interface(original, every_implementation=False)


def dense_experts_for_every_implementation(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: ``get_interface`` hands out :func:`dense_experts_forward` whatever is asked.

    For runtimes with no grouped matmul kernel, where ``"grouped_mm"`` cannot run either.
    """
    return _dense_interface(original, every_implementation=True)


def register_dense_experts(backend: str, *, every_implementation: bool = False) -> None:
    """Register the dense experts patch under ``backend`` (idempotent).

    Args:
        backend: the registry key, e.g. ``"dynamo"`` or ``"executorch.xnnpack"``.
        every_implementation: replace every experts implementation (True) or only the
            data-dependent ``"eager"`` loop (False).

    Raises:
        ValueError: when ``backend`` is not a dotted name.
    """
    factory = dense_experts_for_every_implementation if every_implementation else dense_experts_for_eager
    register_patch(backend, TARGET, **METADATA)(factory)
