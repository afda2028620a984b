"""Capture workarounds of dense-prediction heads (key ``"capture.dense_prediction"``, issue 28).

Segmentation and depth heads that turn a vision transformer's tokens back into a feature map.
Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for the capture, but only when the captured
module holds a module of one of :data:`DENSE_PREDICTION_MODULES` (:func:`capture_key`), and puts
the original back afterwards (also when the capture fails); the eager model the exporter validates
against runs the original code.

- :func:`dpt_patch_grid_from_image`: DPT's reassemble stage recovers the patch grid of its ViT
  tokens as ``int(sqrt(tokens))`` when the head does not pass the grid (the plain-ViT and hybrid
  DPT, depth and semantic segmentation). ``torch.export`` cannot keep a square root of a symbolic
  size symbolic: it guards ``trunc(sqrt((height // p) * (width // p))) == 4`` and the program only
  takes the sample's image size. The patch hands the stage the grid the embeddings were built on,
  ``(height // patch_size, width // patch_size)``.
- :func:`depth_pro_patch_counts_stay_symbolic`: DepthPro's patch encoder counts the patches of
  each pyramid level with Python's ``len()``, which must return an int: ``torch.export`` fixes the
  batch (``Eq(batch, 2)``) and the program takes the sample's batch only. While the encoder runs,
  the count is the patch tensor's leading size instead (symbolic while tracing).
- :func:`eomt_mask_probabilities_as_numbers` with the input preparer
  :func:`eomt_mask_probabilities_before_capture`: EoMT's forward decides per query block whether to
  build the masked attention from the values of its ``attn_mask_probs`` buffer (``probs[i] > 0``,
  ``prob < 1``), a data-dependent branch ``torch.export`` cannot take (``GuardOnDataDependentSymNode:
  Eq(u0, 1)``). The preparer reads the buffer's values before capture; while capturing, the forward
  sees them as Python numbers, so the branch is decided at capture as eager decides it.
"""

from __future__ import annotations

import builtins
import contextvars
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.input_preparers import register_export_input_preparer
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "DENSE_PREDICTION_MODULES",
    "DEPTH_PRO_PATCH_ENCODER_TARGETS",
    "DPT_HEAD_TARGETS",
    "DPT_REASSEMBLE_TARGETS",
    "EOMT_FORWARD_TARGETS",
    "KEY",
    "capture_key",
    "depth_pro_patch_counts_stay_symbolic",
    "dpt_head_records_patch_grid",
    "dpt_patch_grid_from_image",
    "eomt_mask_probabilities_as_numbers",
    "eomt_mask_probabilities_before_capture",
    "patch_grid",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.dense_prediction"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
DENSE_PREDICTION_MODULES: tuple[str, ...] = (
    "transformers.models.dpt.modeling_dpt",
    "transformers.models.eomt.modeling_eomt",
    "transformers.models.eomt_dinov3.modeling_eomt_dinov3",
    "transformers.models.depth_pro.modeling_depth_pro",
)

_TRANSFORMERS = {"transformers": ">=5.23,<6"}


def capture_key(module: torch.nn.Module) -> str | None:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.dense_prediction"``: the ``"capture"`` entries and this module's)
        when ``module`` or one of its submodules is defined in one of
        :data:`DENSE_PREDICTION_MODULES`; ``None`` otherwise, so other models' reports do not list
        these patches.
    """
    return KEY if holds_module_from(module, DENSE_PREDICTION_MODULES) else None


# --------------------------------------------------------------------------------------------
# DPT: the patch grid of the reassemble stage
# --------------------------------------------------------------------------------------------

#: the heads whose forward runs the ViT and then the neck without the patch grid
DPT_HEAD_TARGETS: tuple[str, ...] = (
    "transformers.models.dpt.modeling_dpt.DPTForDepthEstimation.forward",
    "transformers.models.dpt.modeling_dpt.DPTForSemanticSegmentation.forward",
)
#: the stage that reshapes the tokens into ``[batch, channels, grid_h, grid_w]``
DPT_REASSEMBLE_TARGETS: tuple[str, ...] = ("transformers.models.dpt.modeling_dpt.DPTReassembleStage.forward",)

#: ``(grid height, grid width)`` of the DPT head whose forward currently runs (see
#: :func:`dpt_head_records_patch_grid`), ``None`` outside one
_PATCH_GRID: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "hfexport_dpt_patch_grid", default=None
)


def patch_grid(pixel_values: torch.Tensor, patch_size: Any) -> tuple[Any, Any]:
    """The ViT patch grid of a batch of images: ``(height // patch, width // patch)``.

    Args:
        pixel_values: ``[batch, channels, height, width]`` images (any float dtype); its sides may
            be symbolic sizes while ``torch.export`` traces, and the result then is too.
        patch_size: an int, or a ``(height, width)`` pair of ints.

    Returns:
        ``(grid_height, grid_width)``, ints (or ``SymInt`` while tracing).

    Raises:
        ValueError: ``pixel_values`` is not 4-D.
    """
    if pixel_values.dim() != 4:
        raise ValueError(
            f"pixel_values must be [batch, channels, height, width], got shape {tuple(pixel_values.shape)}"
        )
    if isinstance(patch_size, (list, tuple)):
        patch_h, patch_w = int(patch_size[0]), int(patch_size[1])
    else:
        patch_h = patch_w = int(patch_size)
    return pixel_values.shape[2] // patch_h, pixel_values.shape[3] // patch_w


@register_patch(
    BACKEND,
    *DPT_HEAD_TARGETS,
    description=(
        "DPT (ViT and hybrid, depth and semantic segmentation): the head records the patch grid of its "
        "pixel_values for the reassemble stage (the partner of dpt_patch_grid_from_image)"
    ),
    # the grid is passed to the neck only for a DPT on a separate backbone (huggingface/transformers#26092,
    # DINOv2 under DPT); the ViT path kept the square root. No issue filed for the export guard.
    issue="https://github.com/huggingface/transformers/pull/26092",
    versions=_TRANSFORMERS,
)
def dpt_head_records_patch_grid(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DPTForDepthEstimation.forward`` / ``DPTForSemanticSegmentation.forward`` while capturing.

    When the head runs its own ViT (``DPTModel``, plain or hybrid: no separate ``backbone``), the
    replacement records :func:`patch_grid` of ``pixel_values`` at ``config.patch_size`` for
    :func:`dpt_patch_grid_from_image` and runs the original. A head on a separate backbone
    (DINOv2 under DPT) passes the grid to its neck itself and runs the original untouched.
    """

    @functools.wraps(original)
    def forward(self: Any, pixel_values: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(pixel_values, torch.Tensor) or getattr(self, "backbone", None) is not None:
            return original(self, pixel_values, *args, **kwargs)
        token = _PATCH_GRID.set(patch_grid(pixel_values, self.config.patch_size))
        try:
            return original(self, pixel_values, *args, **kwargs)
        finally:
            _PATCH_GRID.reset(token)

    return forward


@register_patch(
    BACKEND,
    *DPT_REASSEMBLE_TARGETS,
    description=(
        "DPT: the reassemble stage reshapes the ViT tokens to the patch grid of the image instead of "
        "int(sqrt(tokens)), a square root torch.export guards at the sample's size (the program kept "
        "the sample's image side)"
    ),
    issue="https://github.com/huggingface/transformers/pull/26092",
    versions=_TRANSFORMERS,
)
def dpt_patch_grid_from_image(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DPTReassembleStage.forward`` while capturing.

    Without ``patch_height``/``patch_width`` the stage reshapes each tapped ``[batch, 1 + tokens,
    hidden]`` hidden state to ``[batch, s, s, hidden]`` with ``s = int(tokens ** 0.5)``. On a
    symbolic token count that is a square root of ``(height // p) * (width // p)``, which
    ``torch.export`` evaluates to the sample's value with the guard ``trunc(sqrt(...)) == 4``: the
    program refuses every other image size (dynamo, ExecuTorch), or keeps the sample's grid in a
    reshape (ONNX's Concat, OpenVINO's wrong numbers at a second size). Inside a head run by
    :func:`dpt_head_records_patch_grid` the replacement passes the recorded grid instead, which is
    the grid the ViT's embeddings were built on: for a square image the same ``s``, so the same
    values as eager; a non-square image (which the original cannot reshape) gets its grid.
    A call that gives the grid, or one outside such a head, runs the original.
    """

    @functools.wraps(original)
    def forward(self: Any, hidden_states: Any, patch_height: Any = None, patch_width: Any = None) -> Any:
        grid = _PATCH_GRID.get()
        if grid is not None and patch_height is None and patch_width is None:
            patch_height, patch_width = grid
        return original(self, hidden_states, patch_height, patch_width)

    return forward


# --------------------------------------------------------------------------------------------
# DepthPro: the patch counts of the image pyramid
# --------------------------------------------------------------------------------------------

#: the encoder whose forward counts each pyramid level's patches with ``len()``
DEPTH_PRO_PATCH_ENCODER_TARGETS: tuple[str, ...] = (
    "transformers.models.depth_pro.modeling_depth_pro.DepthProPatchEncoder.forward",
)


def _leading_size(obj: Any) -> Any:
    """``len()`` that answers a tensor's leading size as it is (a ``SymInt`` while tracing)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise TypeError("len() of a 0-d tensor")
        return obj.shape[0]
    return builtins.len(obj)


@register_patch(
    BACKEND,
    *DEPTH_PRO_PATCH_ENCODER_TARGETS,
    description=(
        "DepthPro: the patch encoder counts each pyramid level's patches as the patch tensor's leading size, "
        "not len(), whose int result made torch.export fix the batch to the sample's (no upstream issue found)"
    ),
    issue="https://github.com/huggingface/transformers/blob/v5.0.0/src/transformers/models/depth_pro/modeling_depth_pro.py",
    versions=_TRANSFORMERS,
)
def depth_pro_patch_counts_stay_symbolic(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``DepthProPatchEncoder.forward`` while capturing.

    The encoder cuts each scaled image of its pyramid into ``[batch * patches, 3, p, p]`` patches,
    records every level's count as ``len(level)`` and later splits the encoded patches by those
    counts (``torch.split_with_sizes``). ``len()`` must return a Python int, so on a symbolic batch
    ``torch.export`` evaluates the count to the sample's and installs ``Eq(batch, 2)``: the program
    refuses every other batch. While the original forward runs, the replacement binds the name
    ``len`` in the modeling module's globals to :func:`_leading_size` (a tensor's ``shape[0]``,
    symbolic while tracing; anything else the builtin's answer) and removes it afterwards, also on
    error. The split sizes are the same numbers as eager's.
    """
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        had = "len" in module.__dict__
        saved = module.__dict__.get("len")
        module.len = _leading_size  # type: ignore[attr-defined]
        try:
            return original(self, *args, **kwargs)
        finally:
            if had:
                module.len = saved  # type: ignore[attr-defined]
            else:
                del module.len

    return forward


# --------------------------------------------------------------------------------------------
# EoMT: the masked-attention probabilities as numbers
# --------------------------------------------------------------------------------------------

#: the universal-segmentation heads whose forward branches on ``attn_mask_probs`` values
EOMT_FORWARD_TARGETS: tuple[str, ...] = (
    "transformers.models.eomt.modeling_eomt.EomtForUniversalSegmentation.forward",
    "transformers.models.eomt_dinov3.modeling_eomt_dinov3.EomtDinov3ForUniversalSegmentation.forward",
)
#: attribute the preparer stores the probabilities under (a tuple of floats)
EOMT_PROBS_ATTRIBUTE = "_hfexport_attn_mask_probs"
_EOMT_CLASSES = ("EomtForUniversalSegmentation", "EomtDinov3ForUniversalSegmentation")
_EOMT_ISSUE = "https://github.com/huggingface/transformers/pull/34393"


@register_export_input_preparer(
    "pixel_values",
    description=(
        "EoMT: read the attn_mask_probs buffer's values before capture, so the forward's per-block branch on "
        "them is decided at capture (the partner of eomt_mask_probabilities_as_numbers)"
    ),
    # no issue filed for EoMT; transformers removed the same kind of value branch from Mask2Former for export
    issue=_EOMT_ISSUE,
    versions=_TRANSFORMERS,
)
def eomt_mask_probabilities_before_capture(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Store each EoMT head's ``attn_mask_probs`` values on it as a tuple of floats.

    Args:
        model: the model about to be captured; every submodule that is an EoMT universal-segmentation
            head (``EomtForUniversalSegmentation``, ``EomtDinov3ForUniversalSegmentation``) with an
            ``attn_mask_probs`` tensor gets the attribute :data:`EOMT_PROBS_ATTRIBUTE`; other models are
            left alone.
        inputs: the forward kwargs, returned unchanged.

    Returns:
        ``inputs``.
    """
    if isinstance(model, torch.nn.Module):
        for sub in model.modules():
            probs = getattr(sub, "attn_mask_probs", None)
            if type(sub).__name__ in _EOMT_CLASSES and isinstance(probs, torch.Tensor):
                sub.__dict__[EOMT_PROBS_ATTRIBUTE] = tuple(float(v) for v in probs.detach().cpu().tolist())
    return inputs


@register_patch(
    BACKEND,
    *EOMT_FORWARD_TARGETS,
    description=(
        "EoMT: while capturing, the forward reads attn_mask_probs as the numbers the preparer read (its per-block "
        "branch probs[i] > 0 on the buffer's values failed capture: GuardOnDataDependentSymNode Eq(u0, 1))"
    ),
    issue=_EOMT_ISSUE,
    versions=_TRANSFORMERS,
)
def eomt_mask_probabilities_as_numbers(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``Eomt(Dinov3)ForUniversalSegmentation.forward`` while capturing.

    The forward builds the masked attention of query block ``i`` only when ``training or
    attn_mask_probs[i] > 0`` and drops random queries when ``prob < 1``: Python decisions on a
    buffer's values, which ``torch.export`` sees as a data-dependent symbol and refuses. In eval
    mode, when :func:`eomt_mask_probabilities_before_capture` stored the values, the replacement
    runs the original with ``attn_mask_probs`` set to that tuple of floats for the call (the buffer is
    put back afterwards), so each branch is decided at capture as eager decides it for these values
    (all 1, the released checkpoints' and transformers' initial value: every block masked, no
    random drop). A probability strictly between 0 and 1 drops random queries in eager too, so such
    a model is nondeterministic and the program freezes no particular draw. Training mode, or a head
    the preparer did not see, runs the original.
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        probs = self.__dict__.get(EOMT_PROBS_ATTRIBUTE)
        buffer = self._buffers.get("attn_mask_probs")
        if self.training or probs is None or buffer is None or len(probs) != buffer.shape[0]:
            return original(self, *args, **kwargs)
        del self._buffers["attn_mask_probs"]
        self.__dict__["attn_mask_probs"] = probs
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.__dict__["attn_mask_probs"]
            self._buffers["attn_mask_probs"] = buffer

    return forward
