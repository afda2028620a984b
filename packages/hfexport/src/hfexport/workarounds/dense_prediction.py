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
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "DENSE_PREDICTION_MODULES",
    "DPT_HEAD_TARGETS",
    "DPT_REASSEMBLE_TARGETS",
    "KEY",
    "capture_key",
    "dpt_head_records_patch_grid",
    "dpt_patch_grid_from_image",
    "patch_grid",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.dense_prediction"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
DENSE_PREDICTION_MODULES: tuple[str, ...] = ("transformers.models.dpt.modeling_dpt",)

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
    for sub in module.modules():
        if type(sub).__module__ in DENSE_PREDICTION_MODULES:
            return KEY
    return None


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
