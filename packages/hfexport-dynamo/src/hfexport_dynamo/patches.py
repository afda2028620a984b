"""Workarounds installed while ``hfexport-dynamo`` traces a model (``register_patch("dynamo", ...)``).

Each patch is a factory ``original -> replacement`` registered with
:func:`hfexport.registry.register_patch`; :class:`~hfexport_dynamo.exporter.DynamoExporter` installs
the active ones for the ``torch.export`` capture only (the eager model used for validation runs the
original code) and the registry puts the originals back afterwards, also when the export fails.

- :func:`dense_experts_while_tracing`: mixture-of-experts layers whose ``"eager"`` implementation
  loops over the experts the sample routed to (``nonzero()`` on the router output) run a dense
  computation over every expert instead, so every expert stays in the graph whatever the routing;
- :func:`sliding_window_cache_without_slice_guard`: the sliding-window cache layer keeps its last
  ``window - 1`` positions with an index selection whose length is ``min(length, window - 1)``,
  instead of a negative-start slice that specialises the export to sequences shorter than the window;
- :func:`keep_size_one_axes_dynamic`: ``torch.export.export`` traces with size-oblivious reasoning
  when a dynamic batch axis has size 1 in the sample, instead of specialising the batch to 1.

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
    "keep_size_one_axes_dynamic",
    "sliding_window_cache_without_slice_guard",
]

logger = logging.getLogger(__name__)

_SIZE_ONE_WARNED = False


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
# Sliding-window cache
# --------------------------------------------------------------------------------------------


@register_patch(
    "dynamo",
    "transformers.cache_utils.DynamicSlidingWindowLayer.update",
    description=(
        "sliding-window cache: keep the last window-1 positions with index_select instead of a "
        "negative-start slice, which torch.export turns into a guard 'sequence < window'"
    ),
    issue="https://github.com/pytorch/pytorch/issues/161705",
    versions={"torch": ">=2.12,<2.15", "transformers": ">=5.0,<6"},
)
def sliding_window_cache_without_slice_guard(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DynamicSlidingWindowLayer.update`` with a version that has no length guard.

    The layer stores ``full[:, :, -(window - 1):, :]``. With a symbolic sequence length,
    ``aten.slice`` clamps its start by comparing it with the length, which adds the guard
    ``length < window`` (pytorch/pytorch#161705): the exported program then rejects every input
    longer than the window, although eager PyTorch handles them. The replacement computes the
    start as ``max(length - (window - 1), 0)`` symbolically and gathers those positions with
    ``index_select``, which needs no guard (a ``narrow`` still installs a contiguity guard on
    one side of the bound). Values are identical. With ``record_past`` (assisted decoding) the
    original method runs.
    """

    @functools.wraps(original)
    def update(
        self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record_past:
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        length = full_keys.shape[-2]
        start = torch.sym_max(length - (self.sliding_window - 1), 0)
        keep = torch.arange(start, length, device=full_keys.device)
        self.keys = full_keys.index_select(-2, keep)
        self.values = full_values.index_select(-2, keep)
        return full_keys, full_values

    return update


# --------------------------------------------------------------------------------------------
# Size-one dynamic axes
# --------------------------------------------------------------------------------------------


def _dims_of(spec: Any) -> list[int] | None:
    """Axes marked dynamic in the spec of one tensor (dict or list/tuple form), else ``None``."""
    if isinstance(spec, dict) and all(isinstance(k, int) for k in spec):
        return [axis for axis, dim in spec.items() if dim is not None]
    if isinstance(spec, (list, tuple)) and all(not isinstance(d, (dict, list, tuple)) for d in spec):
        return [axis for axis, dim in enumerate(spec) if dim is not None]
    return None


def _size_one_axes(value: Any, spec: Any, path: str, found: list[str]) -> None:
    """Collect ``path.shape[0]`` for every tensor whose batch axis (0) is marked dynamic and is 1.

    Only the batch axis: a size-1 sequence axis is what a single-token decode step is traced
    with, and that one should stay specialised.
    """
    import torch.utils._pytree as pytree

    if spec is None:
        return
    if isinstance(value, torch.Tensor):
        dims = _dims_of(spec) or []
        if value.dim() and (0 in dims or -value.dim() in dims) and value.shape[0] == 1:
            found.append(f"{path}.shape[0]")
        return
    if isinstance(value, dict) and isinstance(spec, dict):
        for key, item in value.items():
            _size_one_axes(item, spec.get(key), f"{path}[{key!r}]", found)
        return
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        for index, (item, sub) in enumerate(zip(value, spec)):
            _size_one_axes(item, sub, f"{path}[{index}]", found)
        return
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None and isinstance(spec, (list, tuple)):
        children, _ = node.flatten_fn(value)
        for index, (item, sub) in enumerate(zip(children, spec)):
            _size_one_axes(item, sub, f"{path}[{index}]", found)


@register_patch(
    "dynamo",
    "torch.export.export",
    description=(
        "dynamic batch axes whose sample size is 1: trace with backed_size_oblivious so the batch stays "
        "dynamic instead of being 0/1-specialised; retried without it if that trace fails"
    ),
    issue="https://github.com/pytorch/pytorch/issues/133653",
    versions={"torch": ">=2.12,<2.15"},
)
def keep_size_one_axes_dynamic(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.export.export`` so a batch-1 sample gives a program with a dynamic batch.

    ``torch.export`` specialises every axis whose sample size is 0 or 1 to that constant (the
    "0/1 specialisation", pytorch/pytorch#133653): with ``Dim.AUTO`` it warns and exports a
    program that rejects any other size, so a batch-1 sample gives a batch-1 program. torch's
    documented remedy is ``torch.fx.experimental._config.backed_size_oblivious = True``, which
    keeps such axes symbolic and reasons about them as if they were not 1. The wrapper turns it
    on only when the ``dynamic_shapes`` mark the batch axis (0) of an input whose batch is 1
    (a size-1 sequence axis, as in a single-token decode step, keeps its specialisation), and
    falls back to the plain trace (the batch then stays 1, as torch decides, with one warning) if
    the size-oblivious trace raises.
    """

    @functools.wraps(original)
    def export(mod: Any, args: Any = (), kwargs: Any = None, **options: Any) -> Any:
        global _SIZE_ONE_WARNED
        dynamic_shapes = options.get("dynamic_shapes")
        found: list[str] = []
        if dynamic_shapes is not None:
            if isinstance(dynamic_shapes, dict) and kwargs:
                _size_one_axes(dict(kwargs), dynamic_shapes, "inputs", found)
            elif isinstance(dynamic_shapes, (list, tuple)):
                _size_one_axes(tuple(args), tuple(dynamic_shapes), "args", found)
        if not found:
            return original(mod, args, kwargs, **options)
        import torch.fx.experimental._config as fx_config

        try:
            with fx_config.patch(backed_size_oblivious=True):
                return original(mod, args, kwargs, **options)
        except Exception as exc:
            if not _SIZE_ONE_WARNED:
                _SIZE_ONE_WARNED = True
                logger.warning(
                    "size-oblivious trace failed (%s: %s); axes %s keep their sample size 1. Give a sample "
                    "with batch >= 2 for a dynamic batch.",
                    type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "",
                    found,
                )
            return original(mod, args, kwargs, **options)

    return export


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
    versions={"torch": ">=2.12,<2.14"},
)
def fallback_warning_with_its_arguments(original: logging.Logger) -> Any:
    """Wrap the module logger of ``torch._export.serde.serialize`` (see :class:`_FallbackWarningLogger`).

    ``deserialize_torch_artifact`` logs ``"... Loaded object of type %s after initial failure: %s"``
    with one argument: formatting the record raises ``TypeError`` inside logging, which prints a
    "Logging error" traceback, or fails the load where a handler re-raises. Only reached when a
    file is loaded with ``trust_remote_code=True`` and its sample inputs need full unpickling.
    """
    return _FallbackWarningLogger(original)
