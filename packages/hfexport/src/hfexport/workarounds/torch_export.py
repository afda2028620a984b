"""Workarounds every backend needs while ``torch.export`` captures a model (key ``"capture"``).

The faults below are in ``torch.export`` (and the transformers code it traces), not in any
backend, so they are registered once, here, with :func:`hfexport.registry.register_patch` under
the ``"capture"`` key, and :func:`hfexport.capture.capture` installs the active ones around its
``torch.export.export`` call, whichever backend asked for the capture. The registry puts the
originals back afterwards, also when the capture fails; the eager model used for validation runs
the original code.

- :func:`sliding_window_update_keeps_dynamic_length`: the sliding-window cache layer keeps its
  last ``window - 1`` positions with :func:`keep_last` instead of a negative-start slice, which
  makes ``torch.export`` bound the sequence axis below the window;
- :func:`keep_size_one_batch_dynamic`: ``torch.export.export`` traces with size-oblivious
  reasoning when a dynamic batch axis has size 1 in the sample, instead of specialising the
  batch to 1;
- :func:`avg_pool_over_the_whole_map_as_mean` / :func:`max_pool_over_the_whole_map_as_amax`: a
  ``ceil_mode`` 2-d pooling whose one window covers the whole feature map (EfficientNet's and
  ALIGN's pooler: kernel ``hidden_dim``) is captured as the mean / max over the spatial axes, which
  every runtime computes as eager does;
- :func:`max_pool1d_as_max_pool2d`: ``max_pool1d`` is captured as ``max_pool2d`` over a height of 1,
  which keeps the pooled length symbolic (``aten.max_pool1d`` specialises it: SEW's and SEW-D's
  pooled attention mask fixed the audio length at the sample's).
- :func:`mask_functions_broadcast_instead_of_vmap`: transformers' attention masks built from
  combined mask functions (``and_mask_function`` / ``or_mask_function``: T5Gemma2's bidirectional
  sliding window) are computed by broadcasting the index grids instead of four nested
  ``torch.vmap``, which capture leaves as functorch batching ops that the ExecuTorch lowering cannot
  re-trace;
- :func:`t5gemma2_eoi_embedding_as_where`: T5Gemma2's end-of-image embedding is written with
  ``torch.where`` instead of a boolean-mask assignment (``index_put``, refused by OpenVINO).
- :func:`moonshine_feature_lengths_by_floor_division`: Moonshine's encoder computes its three
  convolutions' output length with ``int((length - 127) / 64 + 1)`` (true division, then ``int``),
  which ``torch.export`` evaluates to the sample's value (``Guard failed: math.trunc(1.0 + (-127 +
  attention_mask.size()[1]) / 64) == 40``); the patch computes it with integer floor division,
  which stays symbolic.

Workarounds that depend on what a runtime can execute are registered by their backend under its
own key (for example the mixture-of-experts rewrites: the shared dense every-expert forward of
:mod:`hfexport.workarounds.moe` for ``hfexport-dynamo`` and ``hfexport-executorch``, grouped
matmul plus a custom translation for ``hfexport-onnx``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.registry import register_patch

__all__ = [
    "BACKEND",
    "avg_pool_over_the_whole_map_as_mean",
    "dynamic_image_side_axes",
    "dynamic_size_one_batch_axes",
    "keep_last",
    "keep_size_one_batch_dynamic",
    "mask_functions_broadcast_instead_of_vmap",
    "max_pool1d_as_max_pool2d",
    "max_pool_over_the_whole_map_as_amax",
    "moonshine_feature_lengths_by_floor_division",
    "moonshine_output_length",
    "sliding_window_update_keeps_dynamic_length",
    "t5gemma2_eoi_embedding_as_where",
]

logger = logging.getLogger(__name__)

#: Registry key of the capture workarounds (``hfexport.registry.entries(BACKEND)``).
BACKEND = "capture"

_SIZE_ONE_WARNED = False


# --------------------------------------------------------------------------------------------
# Sliding-window cache
# --------------------------------------------------------------------------------------------


def keep_last(tensor: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """The last ``min(tensor.shape[dim], count)`` entries of ``tensor`` along ``dim``.

    Same values as the slice ``[..., -count:, ...]``, but written with ``sym_min``, ``arange`` and
    ``index_select`` so that ``torch.export`` traces it on a dynamic length without a guard, and
    the kept length is the bounded ``Min(length, count)`` rather than an expression in ``Max``.

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
    BACKEND,
    "transformers.cache_utils.DynamicSlidingWindowLayer.update",
    description=(
        "sliding-window cache layers keep their last window-1 positions without a negative slice, so "
        "torch.export does not bound the sequence axis by the sample length"
    ),
    issue="https://github.com/pytorch/pytorch/issues/161705",
    versions={"torch": ">=2.12", "transformers": ">=5.23,<6"},  # still needed on torch 2.15.0 (nox matrix)
)
def sliding_window_update_keeps_dynamic_length(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DynamicSlidingWindowLayer.update`` while capturing.

    transformers keeps the last ``sliding_window - 1`` positions of a sliding layer with
    ``states[:, :, -sliding_window + 1:, :]``. Traced on a sample shorter than the window,
    ``torch.export`` resolves the negative start against the symbolic length by guarding
    ``length <= sliding_window - 2`` (pytorch/pytorch#161705, fix proposed in
    pytorch/pytorch#185166): with ``Dim.AUTO`` the program silently accepts only short
    sequences (and torch.onnx, which drops the slice, gives a model returning the whole sequence
    as cache for longer prompts); with a named ``Dim`` the export fails with a constraint
    violation. The replacement cuts with :func:`keep_last`, which traces without a guard;
    everything else follows transformers 5.24's ``update``, values are identical. Layers
    recording the past (``record_past``, assisted decoding) run the original.
    """

    @functools.wraps(original)
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

    return update


# --------------------------------------------------------------------------------------------
# Size-one batch axes
# --------------------------------------------------------------------------------------------


def _is_dynamic_marker(dim: Any) -> bool:
    """True for ``Dim.AUTO``/``Dim.DYNAMIC`` and named or derived ``Dim``; False for ``None``, ints, ``STATIC``."""
    from torch.export import Dim

    if dim is None or isinstance(dim, int):
        return False
    if isinstance(dim, type(Dim.AUTO)):  # the _DimHint of AUTO / DYNAMIC / STATIC
        return dim.type.name != "STATIC"
    return isinstance(dim, Dim)


def _batch_marker(spec: Any) -> Any:
    """The marker of axis 0 in the spec of one tensor (dict or list/tuple form), else ``None``."""
    if isinstance(spec, dict):
        return spec.get(0)
    if isinstance(spec, (list, tuple)) and spec and not isinstance(spec[0], (dict, list, tuple)):
        return spec[0]
    return None


def _collect(value: Any, spec: Any, path: str, found: list[str]) -> None:
    if spec is None:
        return
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == 1 and _is_dynamic_marker(_batch_marker(spec)):
            found.append(f"{path}.shape[0]")
        return
    if isinstance(value, dict) and isinstance(spec, dict):
        for key, item in value.items():
            _collect(item, spec.get(key), f"{path}[{key!r}]", found)
        return
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        for index, (item, sub) in enumerate(zip(value, spec)):
            _collect(item, sub, f"{path}[{index}]", found)
        return
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None and isinstance(spec, (list, tuple)):
        children, _ = node.flatten_fn(value)
        for index, (item, sub) in enumerate(zip(children, spec)):
            _collect(item, sub, f"{path}[{index}]", found)


def dynamic_size_one_batch_axes(inputs: Any, dynamic_shapes: Any, path: str = "inputs") -> list[str]:
    """Tensors of ``inputs`` whose axis 0 has size 1 and is marked dynamic in ``dynamic_shapes``.

    Only axis 0 (the batch) is looked at: a size-1 sequence axis is what a single-token decode
    step is traced with, and torch specialising it is what the generation decomposition expects.

    Args:
        inputs: forward kwargs (or a part of them): tensors, dicts, lists, tuples, caches.
        dynamic_shapes: the matching ``dynamic_shapes`` (``torch.export`` layout). ``Dim.AUTO``,
            ``Dim.DYNAMIC`` and named/derived ``Dim`` count as dynamic; ``None``, ints and
            ``Dim.STATIC`` do not.
        path: prefix of the returned descriptions.

    Returns:
        One ``"<path>.shape[0]"`` per such tensor, e.g. ``"inputs['input_ids'].shape[0]"``.
    """
    found: list[str] = []
    _collect(inputs, dynamic_shapes, path, found)
    return found


def dynamic_image_side_axes(inputs: Any, dynamic_shapes: Any) -> list[str]:
    """Image height/width axes (the input-role table's spatial axes) marked dynamic.

    Args:
        inputs: forward kwargs.
        dynamic_shapes: the matching ``dynamic_shapes`` dict keyed by kwarg name.

    Returns:
        One ``"inputs['pixel_values'].shape[2]"`` per such axis.
    """
    from hfexport.conventions import input_role

    found: list[str] = []
    if not isinstance(inputs, dict) or not isinstance(dynamic_shapes, dict):
        return found
    for key, value in inputs.items():
        spec = dynamic_shapes.get(key)
        if not isinstance(value, torch.Tensor) or spec is None:
            continue
        role = input_role(key, value.dim(), present=inputs)
        for axis in role.spatial_axes if role is not None else ():
            leaf = spec.get(axis) if isinstance(spec, dict) else (spec[axis] if axis < len(spec) else None)
            if _is_dynamic_marker(leaf):
                found.append(f"inputs[{key!r}].shape[{axis}]")
    return found


@register_patch(
    BACKEND,
    "torch.export.export",
    description=(
        "dynamic batch axes whose sample size is 1, and dynamic image sides: trace with backed_size_oblivious so "
        "the batch (and feature maps that shrink to 1 at the sample image size) are not 0/1-specialised; retried "
        "without it if that trace fails"
    ),
    issue="https://github.com/pytorch/pytorch/issues/157621",
    versions={"torch": ">=2.12"},
)
def keep_size_one_batch_dynamic(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.export.export`` so a batch-1 sample gives a program with a dynamic batch.

    ``torch.export`` specialises every axis whose sample size is 0 or 1 to that constant (the
    "0/1 specialisation"; pytorch/pytorch#157621, also #133653): with ``Dim.AUTO`` it exports a
    program that rejects any other size, so a batch-1 sample gives a batch-1 program, and with a
    named ``Dim`` the export fails. torch's documented remedy is
    ``torch.fx.experimental._config.backed_size_oblivious = True``, which keeps such axes symbolic
    and reasons about them as if they were not 0 or 1 (pytorch/pytorch#184837 turns it on inside
    torch, for named ``Dim`` ranges only, so ``Dim.AUTO`` still needs this).

    The same specialisation pins the image sides of a dynamic image export: a ConvNeXt traced on
    32x32 images has a 1x1 feature map in its last stage, so ``side // 32 == 1`` is guarded and the
    program only takes sides in [32, 63] (a 64x64 image is refused). The flag is therefore also on
    when image sides (the input-role table's spatial axes) are marked dynamic
    (:func:`dynamic_image_side_axes`).

    The wrapper turns the flag on for the one call, and only when ``dynamic_shapes`` mark axis 0
    of an input whose sample size there is 1 (:func:`dynamic_size_one_batch_axes`) or an image
    side (:func:`dynamic_image_side_axes`); other exports
    trace exactly as before. The flag applies to the whole trace, so in such a call other size-1
    axes marked dynamic (a single-token query of a batch-1 decode step) become symbolic as well.
    If the size-oblivious trace raises, the plain trace runs instead (the batch then stays 1, as
    torch decides) and one warning says so.
    """
    import torch.fx.experimental._config as fx_config

    signature = inspect.signature(original)

    @functools.wraps(original)
    def export(*args: Any, **kwargs: Any) -> Any:
        global _SIZE_ONE_WARNED
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let torch report the bad call
        dynamic_shapes = bound.arguments.get("dynamic_shapes")
        call_args = bound.arguments.get("args") or ()
        call_kwargs = bound.arguments.get("kwargs") or {}
        found: list[str] = []
        if isinstance(dynamic_shapes, dict) and call_kwargs:
            found = dynamic_size_one_batch_axes(
                dict(call_kwargs), {k: v for k, v in dynamic_shapes.items() if k in call_kwargs}
            )
        elif isinstance(dynamic_shapes, (list, tuple)):
            found = dynamic_size_one_batch_axes(tuple(call_args), tuple(dynamic_shapes), "args")
        if isinstance(dynamic_shapes, dict) and call_kwargs:
            found += dynamic_image_side_axes(
                dict(call_kwargs), {k: v for k, v in dynamic_shapes.items() if k in call_kwargs}
            )
        if not found:
            return original(*args, **kwargs)
        logger.info(
            "dynamic size-1 batch axes or image sides (%s): tracing with backed_size_oblivious", found
        )
        try:
            with fx_config.patch(backed_size_oblivious=True):
                return original(*args, **kwargs)
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
            return original(*args, **kwargs)

    return export


# --------------------------------------------------------------------------------------------
# Pooling windows that cover the whole feature map
# --------------------------------------------------------------------------------------------


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (int(value[0]), int(value[1]))
    return None


def _one_window(
    input: Any, kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, dilation: Any = 1
) -> bool:
    """Whether a 2-d pooling call has exactly one window covering the whole (sample) feature map:
    ``ceil_mode`` on, no padding, no dilation, stride absent or equal to the kernel, and the
    sample's height and width at most the kernel's (then the output is 1 x 1)."""
    kernel = _pair(kernel_size)
    if not ceil_mode or kernel is None or not isinstance(input, torch.Tensor) or input.dim() not in (3, 4):
        return False
    if _pair(padding) != (0, 0) or _pair(dilation) != (1, 1):
        return False
    if stride is not None and stride != [] and _pair(stride) != kernel:
        return False
    height, width = input.shape[-2], input.shape[-1]
    # the sample's (hinted) sizes decide; a dynamic side gets a range check below
    return bool(height <= kernel[0]) and bool(width <= kernel[1])


def _check_within(input: torch.Tensor, kernel: tuple[int, int]) -> None:
    """Keep the rewrite exact at every size the program accepts: the sides stay within the kernel
    (``torch.export`` records the bound as the axis' upper limit)."""
    torch._check(input.shape[-2] <= kernel[0])
    torch._check(input.shape[-1] <= kernel[1])


@register_patch(
    BACKEND,
    "torch.nn.functional.avg_pool2d",
    description=(
        "a ceil_mode avg_pool2d whose one window covers the whole feature map is captured as the spatial mean "
        "(ONNX AveragePool divides by the kernel area, OpenVINO refuses a kernel larger than the map)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/183528",
    versions={"torch": ">=2.12"},
)
def avg_pool_over_the_whole_map_as_mean(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.nn.functional.avg_pool2d`` while capturing.

    EfficientNet's and ALIGN's image pooler is ``nn.AvgPool2d(hidden_dim, ceil_mode=True)``: one
    window of ``hidden_dim`` (1280-2560) pixels over a feature map of a few pixels, i.e. the mean of
    the map (eager PyTorch divides a ``ceil_mode`` border window by the pixels it covers). Captured
    as ``avg_pool2d``, the runtimes disagree: ONNX Runtime's ``AveragePool`` with
    ``count_include_pad`` divides that window by the kernel area (pytorch/pytorch#183528), OpenVINO's
    CPU plugin refuses a kernel larger than the padded map ("Kernel after dilation has size ... larger
    than the data shape"), ExecuTorch's numbers differ at a second image size. When the call has
    exactly one window (``ceil_mode``, no padding, stride absent or the kernel, the sample's sides
    within the kernel), the replacement returns ``input.mean((-2, -1), keepdim=True)``, the same
    values as eager up to summation order, and bounds the dynamic sides by the kernel
    (``torch._check``) so the program refuses a map the window would not cover. Every other call
    runs the original.
    """

    @functools.wraps(original)
    def avg_pool2d(
        input: torch.Tensor,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: Any = None,
    ) -> torch.Tensor:
        if divisor_override is None and _one_window(input, kernel_size, stride, padding, ceil_mode):
            _check_within(input, _pair(kernel_size))  # type: ignore[arg-type]
            return input.mean(dim=(-2, -1), keepdim=True)
        return original(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    return avg_pool2d


@register_patch(
    BACKEND,
    "torch.nn.functional.max_pool2d",
    description=(
        "a ceil_mode max_pool2d whose one window covers the whole feature map is captured as the spatial amax "
        "(OpenVINO refuses a kernel larger than the map)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/183528",
    versions={"torch": ">=2.12"},
)
def max_pool_over_the_whole_map_as_amax(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.nn.functional.max_pool2d`` while capturing: the max-pooling twin of
    :func:`avg_pool_over_the_whole_map_as_mean` (EfficientNet / ALIGN with ``pooling_type="max"``):
    one window over the whole map, without indices, becomes ``input.amax((-2, -1), keepdim=True)``
    (identical values); every other call runs the original."""

    @functools.wraps(original)
    def max_pool2d(input: torch.Tensor, kernel_size: Any, *args: Any, **kwargs: Any) -> Any:
        names = ("stride", "padding", "dilation", "ceil_mode", "return_indices")
        options = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False}
        options.update(dict(zip(names, args)))
        options.update({k: v for k, v in kwargs.items() if k in options})
        if not options["return_indices"] and _one_window(
            input,
            kernel_size,
            options["stride"],
            options["padding"],
            bool(options["ceil_mode"]),
            options["dilation"],
        ):
            _check_within(input, _pair(kernel_size))  # type: ignore[arg-type]
            return input.amax(dim=(-2, -1), keepdim=True)
        return original(input, kernel_size, *args, **kwargs)

    return max_pool2d


@register_patch(
    BACKEND,
    "torch.nn.functional.max_pool1d",
    description=(
        "max_pool1d is captured as max_pool2d over a height of 1: aten.max_pool1d has no symbolic shape rule and "
        "specialises the pooled axis (SEW / SEW-D's pooled attention mask fixed the audio length)"
    ),
    # no pytorch issue filed for max_pool1d; the PR that gave max_pool2d/3d their SymInt metas left it out
    issue="https://github.com/pytorch/pytorch/pull/103951",
    versions={"torch": ">=2.12"},
)
def max_pool1d_as_max_pool2d(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``torch.nn.functional.max_pool1d`` while capturing.

    ``aten.max_pool1d`` (a composite op whose C++ body reads concrete sizes) makes ``torch.export``
    specialise the pooled axis to the sample's length: SEW and SEW-D pool their frame-level
    attention mask with it, so a ``dynamic=True`` export kept ``Guard failed: 1 + (... input_values.size()[1]
    // 80 ...) == 8`` and ran at the sample's audio length only. The replacement computes the same
    values with ``max_pool2d`` on a ``[..., 1, length]`` view (kernel, stride, padding and dilation
    ``(1, k)``, ``(1, s)``, ``(0, p)``, ``(1, d)``), whose shape rule is symbolic. Calls asking for
    ``return_indices`` run the original.

    Returns:
        A function with ``max_pool1d``'s signature: input ``[channels, length]`` or ``[batch,
        channels, length]`` (any float dtype), output ``[..., pooled length]`` of the input's dtype.
    """

    @functools.wraps(original)
    def max_pool1d(input: torch.Tensor, kernel_size: Any, *args: Any, **kwargs: Any) -> Any:
        names = ("stride", "padding", "dilation", "ceil_mode", "return_indices")
        options = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False}
        options.update(dict(zip(names, args)))
        options.update({k: v for k, v in kwargs.items() if k in options})
        if options["return_indices"] or not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
            return original(input, kernel_size, *args, **kwargs)

        def one(value: Any, default: Any) -> Any:
            if value is None or (isinstance(value, (list, tuple)) and not value):
                return default
            return value[0] if isinstance(value, (list, tuple)) else value

        kernel = one(kernel_size, None)
        stride = one(options["stride"], kernel)
        pooled = torch.nn.functional.max_pool2d(
            input.unsqueeze(-2),
            (1, kernel),
            (1, stride),
            (0, one(options["padding"], 0)),
            (1, one(options["dilation"], 1)),
            ceil_mode=bool(options["ceil_mode"]),
        )
        return pooled.squeeze(-2)

    return max_pool1d


# --------------------------------------------------------------------------------------------
# Attention masks from combined mask functions, T5Gemma2's end-of-image embedding
# --------------------------------------------------------------------------------------------


@register_patch(
    BACKEND,
    "transformers.masking_utils._vmap_expansion_sdpa",
    description=(
        "attention masks of combined mask functions (and_mask_function/or_mask_function) are built by "
        "broadcasting the [batch, head, query, key] index grids instead of four nested torch.vmap"
    ),
    issue="https://github.com/pytorch/pytorch/issues/153063",
    versions={"torch": ">=2.12", "transformers": ">=5.0,<6"},
)
def mask_functions_broadcast_instead_of_vmap(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``transformers.masking_utils._vmap_expansion_sdpa`` while capturing.

    ``sdpa_mask`` expands a mask function over the batch, head, query and key indices either by
    broadcasting (``_non_vmap_expansion_sdpa``, its default) or, when the caller combined it with
    an ``and_mask_function`` / ``or_mask_function`` (T5Gemma2's bidirectional sliding window,
    ESMC's packed sequences, Gemma 3's image tokens), with four nested ``torch.vmap``.
    ``torch.export`` traces the vmap path as pre-dispatch functorch ops (``_add_batch_dim``,
    ``_vmap_increment_nesting``: pytorch/pytorch#153063, traced since pytorch/pytorch#154650); the
    ExecuTorch lowering re-traces the program and fails on them ("your tensor may have escaped from
    inside a function being vmapped", T5Gemma2). The replacement calls the mask function once on
    the broadcast index grids, as the default path does, and expands the result to
    ``[batch, heads, queries, keys]``: the same boolean mask for index-based mask functions, which
    transformers requires of its own (``masking_utils``: "keep an index-based version for non-vmap
    expansion"). A function that is not index-based gives a mask of another shape or other values,
    which the exporter's validation against eager reports.
    """
    import transformers.masking_utils as masking_utils

    @functools.wraps(original)
    def expansion(mask_function: Callable[..., Any]) -> Callable[..., Any]:
        def broadcast(
            batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor
        ) -> torch.Tensor:
            grids = masking_utils._non_vmap_expansion_sdpa(batch, head, query, key)
            mask = mask_function(*grids)
            return mask.expand(batch.shape[0], head.shape[0], query.shape[0], key.shape[0])

        return broadcast

    return expansion


@register_patch(
    BACKEND,
    "transformers.models.t5gemma2.modeling_t5gemma2.T5Gemma2TextScaledWordEmbedding.forward",
    description=(
        "T5Gemma2's end-of-image token embedding is selected with torch.where instead of a boolean-mask "
        "assignment, which captures as an index_put that OpenVINO's converter refuses"
    ),
    # no upstream issue found: the URL names the boolean-mask assignment in T5Gemma2TextScaledWordEmbedding.forward
    issue="https://github.com/huggingface/transformers/blob/main/src/transformers/models/t5gemma2/modeling_t5gemma2.py",
    versions={"transformers": ">=5.0,<6"},
)
def t5gemma2_eoi_embedding_as_where(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``T5Gemma2TextScaledWordEmbedding.forward`` while capturing.

    The original scales the token embeddings and then writes the learned ``eoi_embedding`` into the
    rows of the end-of-image token with ``embeddings[input_ids == eoi_token_index] = ...``, which
    ``torch.export`` captures as ``aten.index_put`` with a boolean index; OpenVINO's converter
    rejects it (``OpenvinoConversionError`` on every T5Gemma2 head). The replacement returns
    ``torch.where((input_ids == eoi_token_index)[..., None], eoi_embedding, embeddings)``: the same
    values, ``[*input_ids.shape, embedding_dim]`` in the embedding's dtype.
    """

    @functools.wraps(original)
    def forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = torch.nn.Embedding.forward(self, input_ids) * self.embed_scale.to(self.weight.dtype)
        is_eoi = (input_ids == self.eoi_token_index).unsqueeze(-1)
        return torch.where(is_eoi, self.eoi_embedding.to(embeddings.dtype), embeddings)

    return forward


# --------------------------------------------------------------------------------------------
# Moonshine: the convolutions' output length by integer arithmetic
# --------------------------------------------------------------------------------------------

#: Moonshine's three convolutions over the raw audio, as (kernel, stride)
MOONSHINE_CONVOLUTIONS: tuple[tuple[int, int], ...] = ((127, 64), (7, 3), (3, 2))


def moonshine_output_length(input_length: Any) -> Any:
    """The frame count Moonshine's encoder makes of ``input_length`` audio samples.

    ``(length - kernel) // stride + 1`` through its convolutions (kernel 127 stride 64, 7 and 3,
    3 and 2), integer floor division: an ``int`` gives an ``int``, a ``SymInt`` a ``SymInt``.
    Equal to transformers 5.24's ``int((length - kernel) / stride + 1)`` (which truncates toward
    zero) at every length the convolutions accept (each one's input at least its kernel: from 895
    samples on, 1 frame); shorter audio fails in the convolutions either way.

    Args:
        input_length: the audio length in samples (int or ``SymInt``).

    Returns:
        The encoder's sequence length (int or ``SymInt``).
    """
    length = input_length
    for kernel, stride in MOONSHINE_CONVOLUTIONS:
        length = (length - kernel) // stride + 1
    return length


@register_patch(
    BACKEND,
    "transformers.models.moonshine.modeling_moonshine.MoonshinePreTrainedModel._get_feat_extract_output_lengths",
    description=(
        "Moonshine: the encoder's output length from the audio length by integer floor division instead of "
        "int(true division), which torch.export evaluated to the sample's value (Guard failed: math.trunc(1.0 + "
        "(-127 + attention_mask.size()[1]) / 64) == 40)"
    ),
    # no upstream issue found for the guard; the closest report (Moonshine's ONNX encoder failing at other
    # audio lengths)
    issue="https://github.com/huggingface/optimum/issues/2403",
    versions={"transformers": ">=5.23,<6"},
)
def moonshine_feature_lengths_by_floor_division(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``MoonshinePreTrainedModel._get_feat_extract_output_lengths`` while capturing.

    For an ``int`` or ``SymInt`` length (the encoder passes ``attention_mask.shape[-1]``) the
    replacement returns :func:`moonshine_output_length`; a tensor of lengths goes to the original.
    """

    @functools.wraps(original)
    def lengths(self: Any, input_lengths: Any) -> Any:
        if isinstance(input_lengths, (int, torch.SymInt)):
            return moonshine_output_length(input_lengths)
        return original(self, input_lengths)

    return lengths
