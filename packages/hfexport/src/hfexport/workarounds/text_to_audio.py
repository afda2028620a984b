"""Capture workarounds of the text-to-audio models (key ``"capture.text_to_audio"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for the capture, but only when the captured
module holds a module of one of :data:`TEXT_TO_AUDIO_MODULES` (:func:`capture_key`), and puts the
original back afterwards (also when the capture fails); the eager model the exporter validates
against runs the original code.

- :func:`length_regulator_as_gather`: FastSpeech 2's length regulator (fastspeech2_conformer, with
  or without its HiFi-GAN vocoder) repeats each phoneme's encoding by its predicted duration with
  a Python branch on the durations' sum and a per-row ``repeat_interleave`` loop, which
  ``torch.export`` cannot trace (``GuardOnDataDependentSymNode: Eq(u0, 1)``). The replacement
  computes the same frames at once: each frame gathers the phoneme whose cumulative duration
  first exceeds the frame's index, frames past a row's total are zeros, and the frame count (the
  largest total of the batch) is one data-dependent size bounded to ``[2, 5000]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "CAPTURE",
    "KEY",
    "LENGTH_REGULATOR_TARGETS",
    "MAX_FRAMES",
    "MIN_FRAMES",
    "TEXT_TO_AUDIO_MODULES",
    "capture_key",
    "length_regulator_as_gather",
    "regulate_lengths",
]

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.text_to_audio"

#: transformers modeling modules whose models the capture patches of this module concern
TEXT_TO_AUDIO_MODULES: tuple[str, ...] = (
    "transformers.models.fastspeech2_conformer.modeling_fastspeech2_conformer",
)

_TRANSFORMERS = {"transformers": ">=5.23,<6"}


def capture_key(module: torch.nn.Module) -> str:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.text_to_audio"``: the ``"capture"`` entries and this module's)
        when ``module`` or one of its submodules is defined in one of :data:`TEXT_TO_AUDIO_MODULES`;
        ``"capture"`` otherwise, so other models' reports do not list these patches.
    """
    for sub in module.modules():
        if type(sub).__module__ in TEXT_TO_AUDIO_MODULES:
            return KEY
    return CAPTURE


# --------------------------------------------------------------------------------------------
# FastSpeech 2 length regulator
# --------------------------------------------------------------------------------------------

#: the regulator as the modeling module calls it (a module-level function looked up at call time)
LENGTH_REGULATOR_TARGETS: tuple[str, ...] = (
    "transformers.models.fastspeech2_conformer.modeling_fastspeech2_conformer.length_regulator",
)
#: frames the captured program produces at most: the decoder's relative positional table holds
#: 2 * 5000 - 1 positions (``FastSpeech2ConformerRelPositionalEncoding.max_len``); eager recomputes
#: the table for longer outputs, a program keeps the traced one
MAX_FRAMES = 5000
#: frames the captured program produces at least: the decoder's relative-position shift views a
#: ``[..., frames, 2 * frames - 1]`` tensor whose stride ``torch.export`` cannot decide at one frame
MIN_FRAMES = 2


def regulate_lengths(
    encoded_embeddings: torch.Tensor, duration_labels: torch.Tensor, speaking_speed: float = 1.0
) -> torch.Tensor:
    """FastSpeech 2's length regulator without data-dependent Python control flow.

    The same values as transformers 5.24's ``length_regulator``: each phoneme encoding is repeated
    by its duration (durations scaled by ``speaking_speed`` and rounded when it is not 1; when every
    duration of the batch is 0, the rows summing to 0 get duration 1 everywhere), rows are padded
    with zeros to the longest row. Frame ``f`` of row ``b`` is the encoding of the phoneme ``i``
    with ``cumsum(durations[b])[i - 1] <= f < cumsum(durations[b])[i]``, found by counting the
    cumulative durations ``<= f`` and gathered, so the only data-dependent size is the frame count.

    Args:
        encoded_embeddings: ``[batch, phonemes, hidden]`` phoneme encodings.
        duration_labels: ``[batch, phonemes]`` int64 durations in frames (>= 0).
        speaking_speed: duration scale (> 0); 1.0 keeps the durations.

    Returns:
        ``[batch, frames, hidden]`` float32, ``frames`` the largest row total of the batch.

    Raises:
        ValueError: ``speaking_speed`` is not positive (as transformers).
        RuntimeError: while capturing nothing; in the captured program the frame count is asserted
            to lie in ``[MIN_FRAMES, MAX_FRAMES]`` (eagerly, a total outside it fails the same check).
    """
    if speaking_speed <= 0:
        raise ValueError("`speaking_speed` must be greater than 0.")
    if speaking_speed != 1.0:
        duration_labels = torch.round(duration_labels.float() * speaking_speed).long()
    rows = duration_labels.sum(dim=1, keepdim=True)
    empty = duration_labels.sum().eq(0) & rows.eq(0)
    duration_labels = torch.where(empty, torch.ones_like(duration_labels), duration_labels)
    ends = duration_labels.cumsum(dim=1)
    frames_count = ends[:, -1].max().item()
    torch._check(frames_count >= MIN_FRAMES)
    torch._check(frames_count <= MAX_FRAMES)
    frames = torch.arange(frames_count, device=ends.device)
    index = (ends.unsqueeze(1) <= frames.view(1, -1, 1)).sum(dim=-1)
    index = index.clamp(max=encoded_embeddings.size(1) - 1)
    hidden = encoded_embeddings.size(2)
    picked = torch.gather(encoded_embeddings, 1, index.unsqueeze(-1).expand(-1, -1, hidden))
    inside = frames.unsqueeze(0) < ends[:, -1:]
    return torch.where(inside.unsqueeze(-1), picked, 0.0).to(torch.float)


@register_patch(
    KEY,
    *LENGTH_REGULATOR_TARGETS,
    description=(
        "fastspeech2_conformer: the length regulator repeats phoneme encodings by a gather over cumulative "
        "durations, one data-dependent frame count in [2, 5000], instead of a Python branch on the durations "
        "and a per-row repeat_interleave loop torch.export cannot trace (Eq(u0, 1))"
    ),
    # no upstream issue filed; the regulator loops over the batch in transformers 5.24
    issue="https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/fastspeech2_conformer/modeling_fastspeech2_conformer.py",
    versions=_TRANSFORMERS,
)
def length_regulator_as_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``length_regulator`` with :func:`regulate_lengths` while capturing."""

    @functools.wraps(original)
    def length_regulator(
        encoded_embeddings: torch.Tensor, duration_labels: torch.Tensor, speaking_speed: float = 1.0
    ) -> torch.Tensor:
        return regulate_lengths(encoded_embeddings, duration_labels, speaking_speed)

    return length_regulator
