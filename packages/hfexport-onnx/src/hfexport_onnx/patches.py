"""Patches installed while the ONNX backend captures and translates (``register_patch("onnx", ...)``).

Each patch is a factory ``original -> replacement`` naming the upstream issue it works around and
the version range it is needed for; :class:`~hfexport_onnx.exporter.OnnxExporter` installs the
active ones with ``hfexport.registry.apply_patches("onnx")`` around capture and translation.
Patches of ``torch``/``transformers`` are reported as *torch patches*, patches of ``torch.onnx``,
``onnxscript``, ``onnx_ir``, ``onnx`` or ``onnxruntime`` as *ONNX patches*.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.registry import register_patch

__all__ = [
    "eager_experts_as_grouped_matmul",
    "export_unit_axes_stay_dynamic",
    "has_dynamic_unit_axis",
    "keep_last",
    "sliding_window_update_keeps_dynamic_length",
]

logger = logging.getLogger(__name__)


def keep_last(tensor: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """The last ``min(tensor.shape[dim], count)`` entries of ``tensor`` along ``dim``.

    Same values as ``tensor.narrow(dim, max(length - count, 0), min(length, count))`` or the
    slice ``[..., -count:, ...]``, but written with ``sym_min``, ``arange`` and
    ``index_select`` so that ``torch.export`` traces it on a dynamic ``length`` without a guard
    (the slice forms make export assume ``length < count`` for a short sample, see
    :func:`sliding_window_update_keeps_dynamic_length`).

    Args:
        tensor: any tensor.
        count: how many trailing entries to keep (> 0).
        dim: the axis to cut.

    Returns:
        A new tensor (not a view) of the same rank.
    """
    length = tensor.shape[dim]
    kept = torch.sym_min(length, count)
    index = torch.arange(kept, device=tensor.device) + (length - kept)
    return tensor.index_select(dim, index)


@register_patch(
    "onnx",
    "transformers.cache_utils.DynamicSlidingWindowLayer.update",
    description=(
        "sliding-window cache layers keep their last window-1 positions without a negative slice, so "
        "torch.export does not bound the sequence axis by the sample length"
    ),
    issue="https://github.com/pytorch/pytorch/issues/161705",
    versions={"torch": ">=2.12,<2.15", "transformers": ">=5.23,<6"},
)
def sliding_window_update_keeps_dynamic_length(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DynamicSlidingWindowLayer.update`` while exporting.

    transformers keeps the last ``sliding_window - 1`` positions of a sliding layer with
    ``states[:, :, -sliding_window + 1:, :]``. Traced on a sample shorter than the window,
    ``torch.export`` resolves the negative start against the symbolic length by guarding
    ``length <= sliding_window - 2`` (pytorch/pytorch#161705, fix proposed in
    pytorch/pytorch#185166): with ``Dim.AUTO`` the program silently becomes valid only for
    short sequences (torch.onnx's decomposition then drops the slice and an ONNX model fed a
    longer prompt returns the whole sequence as cache), with an explicit ``Dim`` the export
    fails with a constraint violation. The replacement cuts with :func:`keep_last`, which
    traces without a guard; everything else follows transformers 5.24's ``update``. Layers
    recording the past (assisted decoding) use the original.
    """

    def update(
        self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "record_past", False):
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        self.keys = keep_last(full_keys, self.sliding_window - 1, dim=-2)
        self.values = keep_last(full_values, self.sliding_window - 1, dim=-2)
        return full_keys, full_values

    update.__doc__ = original.__doc__
    update.__wrapped__ = original  # type: ignore[attr-defined]
    return update


def _is_dynamic_marker(dim: Any) -> bool:
    """True for ``Dim.AUTO``/``Dim.DYNAMIC`` and named ``Dim`` objects; False for ``None``, ints, ``STATIC``."""
    if dim is None or isinstance(dim, int):
        return False
    hint = getattr(dim, "type", None)
    if type(dim).__name__ == "_DimHint" and hint is not None:
        return hint.name != "STATIC"
    return hasattr(dim, "__name__") and hasattr(dim, "min")


def has_dynamic_unit_axis(value: Any, spec: Any) -> bool:
    """Whether some tensor of ``value`` has an axis of size 0 or 1 that ``spec`` marks dynamic.

    Args:
        value: forward kwargs (or a part of them): tensors, dicts, lists, tuples, caches.
        spec: the matching part of ``dynamic_shapes`` (``torch.export`` layout).
    """
    if spec is None:
        return False
    if isinstance(value, torch.Tensor):
        axes = (
            spec.items()
            if isinstance(spec, dict)
            else enumerate(spec)
            if isinstance(spec, (list, tuple))
            else ()
        )
        return any(
            isinstance(axis, int)
            and -value.dim() <= axis < value.dim()
            and value.shape[axis] <= 1
            and _is_dynamic_marker(dim)
            for axis, dim in axes
        )
    if isinstance(value, dict) and isinstance(spec, dict):
        return any(has_dynamic_unit_axis(value[k], spec.get(k)) for k in value)
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        return any(has_dynamic_unit_axis(v, s) for v, s in zip(value, spec))
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None and isinstance(spec, (list, tuple)):
        children, _ = node.flatten_fn(value)
        return any(has_dynamic_unit_axis(v, s) for v, s in zip(children, spec))
    return False


@register_patch(
    "onnx",
    "torch.export.export",
    description=(
        "trace with backed_size_oblivious when a sample axis of size 0/1 is marked dynamic, so a batch-1 "
        "sample does not make the batch axis static"
    ),
    issue="https://github.com/pytorch/pytorch/issues/157621",
    versions={"torch": ">=2.12"},
)
def export_unit_axes_stay_dynamic(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.export.export`` so dynamic axes with a sample size of 0 or 1 stay dynamic.

    ``torch.export`` specializes every axis whose sample size is 0 or 1 ("0/1 specialization"):
    with ``Dim.AUTO`` the axis silently becomes static (a model exported from a one-prompt sample
    then rejects a batch of two in ONNX Runtime, pytorch/pytorch#157621), with ``Dim.DYNAMIC`` or
    a named ``Dim`` the export fails. torch's own answer is the experimental
    ``torch.fx.experimental._config.backed_size_oblivious`` flag, which keeps such axes symbolic
    (their size is assumed >= 2 while tracing); pytorch/pytorch#184837 turns it on for named
    ``Dim`` ranges only. The wrapper turns it on for the duration of the call, and only when a
    tensor axis of size 0/1 is marked dynamic, so exports from larger samples trace as before.
    """
    import inspect

    import torch.fx.experimental._config as fx_config

    signature = inspect.signature(original)

    def export(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        dynamic_shapes = bound.arguments.get("dynamic_shapes")
        call_args = bound.arguments.get("args") or ()
        call_kwargs = bound.arguments.get("kwargs") or {}
        unit = False
        if isinstance(dynamic_shapes, dict):
            unit = has_dynamic_unit_axis(
                call_kwargs, {k: v for k, v in dynamic_shapes.items() if k in call_kwargs}
            )
        elif isinstance(dynamic_shapes, (list, tuple)):
            unit = has_dynamic_unit_axis(tuple(call_args), tuple(dynamic_shapes))
        if not unit:
            return original(*args, **kwargs)
        logger.info("a dynamic axis has a sample size of 0 or 1: tracing with backed_size_oblivious")
        with fx_config.patch(backed_size_oblivious=True):
            return original(*args, **kwargs)

    export.__doc__ = original.__doc__
    export.__wrapped__ = original  # type: ignore[attr-defined]
    return export


@register_patch(
    "onnx",
    "transformers.integrations.moe.ExpertsInterface.get_interface",
    description=(
        "serve the data-dependent 'eager' experts loop of MoE layers with transformers' grouped_mm experts "
        "while exporting, so every expert stays in the graph"
    ),
    issue="https://github.com/huggingface/transformers/issues/38518",
    versions={"transformers": ">=5.0,<6"},
)
def eager_experts_as_grouped_matmul(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``ExpertsInterface.get_interface`` while exporting.

    MoE layers declared with ``@use_experts_implementation`` pick their forward from
    ``config._experts_implementation``. The ``"eager"`` forward loops over the experts the router
    chose (``nonzero()`` of the routing mask): data-dependent, so ``torch.export`` fails with a
    data-dependent guard, or would keep only the experts the sample reached
    (huggingface/transformers#38518). While exporting, ``"eager"`` is served by transformers' own
    ``grouped_mm`` forward (sort rows by expert, one grouped matmul), whose opaque
    ``transformers::grouped_mm_fallback`` operator is translated to ONNX by
    :func:`hfexport_onnx.translations.grouped_mm_fallback` with every expert in the graph. Same
    numbers as the eager loop (float32 sums in another order); other implementations are left
    alone.
    """

    def get_interface(
        self: Any, experts_implementation: str | None, default: Callable[..., Any]
    ) -> Callable[..., Any]:
        if experts_implementation in (None, "eager") and "grouped_mm" in self:
            return original(self, "grouped_mm", default)
        return original(self, experts_implementation, default)

    get_interface.__doc__ = original.__doc__
    get_interface.__wrapped__ = original  # type: ignore[attr-defined]
    return get_interface
