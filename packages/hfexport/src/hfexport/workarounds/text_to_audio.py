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

And a helper for the backends, which register it under their own key:

- :func:`register_bernoulli_as_uniform`: ``torch.bernoulli`` (SpeechT5's speech-decoder prenet draws
  its "consistent dropout" mask with it in eval mode too) as a comparison of uniform draws with the
  probability, for lowerings with no ``aten.bernoulli.p`` kernel or rule;
- :func:`register_normal_from_uniform`: ``torch.randn`` / ``torch.randn_like`` (VITS's duration and
  prior noise, scaled by ``noise_scale``) by the Box-Muller transform of uniform draws, for lowerings
  with no ``aten.randn`` / ``aten.randn_like`` kernel or rule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

__all__ = [
    "CAPTURE",
    "KEY",
    "LENGTH_REGULATOR_TARGETS",
    "MAX_FRAMES",
    "MIN_FRAMES",
    "TEXT_TO_AUDIO_MODULES",
    "bernoulli_from_uniform",
    "capture_key",
    "length_regulator_as_gather",
    "normal_from_uniform",
    "register_bernoulli_as_uniform",
    "register_normal_from_uniform",
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
    return KEY if holds_module_from(module, TEXT_TO_AUDIO_MODULES) else CAPTURE


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


# --------------------------------------------------------------------------------------------
# Bernoulli draws (SpeechT5's prenet dropout in eval mode)
# --------------------------------------------------------------------------------------------


def bernoulli_from_uniform(input: torch.Tensor, p: float | None = None) -> torch.Tensor:
    """Bernoulli draws as ``rand(input.shape) < probability``, in ``input``'s dtype.

    The same distribution as ``torch.bernoulli``: 1 with probability ``p`` (a float), or with the
    probability held by each element of ``input`` when ``p`` is ``None``; 0 otherwise. A uniform
    draw in ``[0, 1)`` is below 0 never and below 1 always, so ``p`` 0 and 1 (SpeechT5's tiny
    preset, prenet dropout 0) give exactly ``torch.bernoulli``'s all-zero and all-one masks.

    Args:
        input: a floating tensor (the shape of the draw; the probabilities when ``p`` is None).
        p: the probability of a 1, in ``[0, 1]``, or None.

    Returns:
        A tensor of ``input``'s shape and dtype holding 0 and 1.
    """
    probability = input if p is None else p
    # torch.rand, not rand_like: aten.rand is in ExecuTorch's core ATen opset, aten.rand_like is not
    uniform = torch.rand(input.shape, dtype=input.dtype, device=input.device)
    return (uniform < probability).to(input.dtype)


def register_bernoulli_as_uniform(backend: str, *, issue: str, versions: Mapping[str, str]) -> None:
    """Register, under ``backend``, a patch serving ``torch.bernoulli`` with :func:`bernoulli_from_uniform`.

    SpeechT5's speech-decoder prenet applies its dropout in eval mode too, drawing the mask with
    ``torch.bernoulli(x, p=...)``; ``torch.export`` records ``aten.bernoulli.p``, which ExecuTorch
    has no kernel for (it is outside the core ATen opset) and OpenVINO's ``torch.export`` frontend
    no conversion rule. ``aten.rand`` both have. A call with a generator, ``out=`` or a non-floating input runs the original.

    Args:
        backend: the registry key (``"executorch"``, ``"openvino"``).
        issue: the upstream issue of that backend's missing operator.
        versions: the backend's version range the patch is needed in.

    Raises:
        ValueError: ``backend`` is not a valid registry key.
    """

    def bernoulli_as_uniform(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def bernoulli(input: Any, *args: Any, **kwargs: Any) -> Any:
            call = {k: v for k, v in kwargs.items() if not (k == "generator" and v is None)}
            if len(args) == 1 and "p" not in call:
                call["p"] = args[0]
            p = call.pop("p", None)
            plain = len(args) <= 1 and not call and (p is None or isinstance(p, float | int))
            if not plain or not isinstance(input, torch.Tensor) or not input.is_floating_point():
                return original(input, *args, **kwargs)
            return bernoulli_from_uniform(input, None if p is None else float(p))

        return bernoulli

    bernoulli_as_uniform.__qualname__ = f"bernoulli_as_uniform[{backend}]"
    register_patch(
        backend,
        "torch.bernoulli",
        description=(
            "torch.bernoulli (SpeechT5's eval-mode prenet dropout) as rand(x.shape) < p: the lowering has no "
            "aten.bernoulli.p operator"
        ),
        issue=issue,
        versions=versions,
    )(bernoulli_as_uniform)


# --------------------------------------------------------------------------------------------
# Normal draws (VITS's noise)
# --------------------------------------------------------------------------------------------


def normal_from_uniform(
    shape: tuple[int | torch.SymInt, ...], dtype: torch.dtype | None = None, device: Any = None
) -> torch.Tensor:
    """Standard normal draws of ``shape`` by the Box-Muller transform of two uniform draws.

    ``sqrt(-2 * log(1 - u1)) * cos(2 * pi * u2)`` with ``u1``, ``u2`` uniform in ``[0, 1)``: the
    same distribution as ``torch.randn``, always finite (``1 - u1`` lies in ``(0, 1]``), so a draw
    scaled by 0 (VITS's tiny preset, noise scales 0) is exactly 0.

    Args:
        shape: the sizes (ints or symbolic sizes).
        dtype: a floating dtype; ``None`` = the default dtype.
        device: the device; ``None`` = the default device.

    Returns:
        A tensor of ``shape``.
    """
    first = torch.rand(shape, dtype=dtype, device=device)
    second = torch.rand(shape, dtype=dtype, device=device)
    return torch.sqrt(-2.0 * torch.log1p(-first)) * torch.cos((2.0 * math.pi) * second)


_PLAIN_FACTORY_KWARGS = frozenset({"dtype", "device"})


def register_normal_from_uniform(backend: str, *, issue: str, versions: Mapping[str, str]) -> None:
    """Register, under ``backend``, patches serving ``torch.randn`` and ``torch.randn_like`` with
    :func:`normal_from_uniform`.

    VITS draws its stochastic duration predictor's noise (``torch.randn``) and its prior latents
    (``torch.randn_like``) in the forward, scaled by ``noise_scale_duration`` / ``noise_scale``;
    ``torch.export`` records ``aten.randn`` / ``aten.randn_like``, which OpenVINO's ``torch.export``
    frontend has no conversion rule for and ExecuTorch's edge dialect refuses (``randn_like`` is
    outside the core ATen opset). ``aten.rand`` both have. A call with a generator, ``out=``,
    ``layout``, ``requires_grad`` or ``names`` runs the original.

    Args:
        backend: the registry key (``"executorch"``, ``"openvino"``).
        issue: the upstream issue of that backend's missing operator.
        versions: the backend's version range the patches are needed in.

    Raises:
        ValueError: ``backend`` is not a valid registry key.
    """

    def normal_as_box_muller(original: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, "__name__", "") == "randn_like":

            @functools.wraps(original)
            def randn_like(input: Any, *args: Any, **kwargs: Any) -> Any:
                extra = {k: v for k, v in kwargs.items() if v is not None}
                if args or set(extra) - _PLAIN_FACTORY_KWARGS or not isinstance(input, torch.Tensor):
                    return original(input, *args, **kwargs)
                dtype = extra.get("dtype", input.dtype)
                if not dtype.is_floating_point:
                    return original(input, *args, **kwargs)
                return normal_from_uniform(tuple(input.shape), dtype, extra.get("device", input.device))

            return randn_like

        @functools.wraps(original)
        def randn(*size: Any, **kwargs: Any) -> Any:
            extra = {k: v for k, v in kwargs.items() if v is not None}
            shape = (
                tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size) else size
            )
            sizes_ok = bool(shape) and all(isinstance(n, int | torch.SymInt) for n in shape)
            dtype = extra.get("dtype")
            if (
                not sizes_ok
                or set(extra) - _PLAIN_FACTORY_KWARGS
                or (dtype is not None and not dtype.is_floating_point)
            ):
                return original(*size, **kwargs)
            return normal_from_uniform(shape, dtype, extra.get("device"))

        return randn

    normal_as_box_muller.__qualname__ = f"normal_as_box_muller[{backend}]"
    register_patch(
        backend,
        "torch.randn",
        "torch.randn_like",
        description=(
            "torch.randn / torch.randn_like (VITS's noise) as the Box-Muller transform of torch.rand draws: the "
            "lowering has no aten.randn / aten.randn_like operator"
        ),
        issue=issue,
        versions=versions,
    )(normal_as_box_muller)
