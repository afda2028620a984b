"""Decompose a generative model into the components an exported generation loop runs.

- decoder-only language models: ``prefill`` (the prompt) and ``decode`` (new tokens on a filled
  cache), both the whole model, captured from one real ``generate`` call;
- encoder-decoder models: ``encoder``, ``prefill`` (first decoder step, empty cache) and ``decode``;
- multimodal models (:mod:`hfexport.generation.multimodal`): ``image_encoder`` / ``audio_encoder`` /
  ``multi_modal_projector`` / ``embed_tokens`` / ``language_model`` / ``lm_head`` / ``decode``.

Every function returns a :class:`Decomposition`: a dict ``{component: (module, forward_kwargs)}``
that also carries the :class:`~hfexport.generation.plan.GenerationPlan` the runner needs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.generation.components import Decomposition, describe_components, token_ids_of
from hfexport.generation.multimodal import decompose_multimodal, is_multimodal
from hfexport.generation.parts import WithoutModalityOutputs
from hfexport.generation.plan import GenerationPlan
from hfexport.generation.recording import record_generation
from hfexport.generation.recurrent import decompose_recurrent, is_recurrent_state_model

__all__ = [
    "Decomposition",
    "decompose_for_generation",
    "decompose_prefill_decode",
    "describe_components",
    "token_ids_of",
]

logger = logging.getLogger(__name__)


#: the forward kwarg through which transformers >= 5 ``generate`` hands pre-encoded images to the
#: model (it runs ``get_image_features`` itself before the prefill and drops the pixel inputs)
MM_ENCODER_OUTPUTS = "mm_encoder_outputs"


def _raw_modality_inputs(
    model: torch.nn.Module, kwargs: dict[str, Any], inputs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A recorded whole-model call with the prompt's raw image inputs in place of
    ``mm_encoder_outputs`` (issue 28: Fuyu, Apertus-1.5, whose image encoder is not a submodule
    the multimodal split finds, so the whole model is the prefill).

    ``generate`` pre-encodes the images and passes the features as ``mm_encoder_outputs``, a
    nested ``ModelOutput`` a generation runner has no source for; given the raw inputs instead
    (``pixel_values`` ... every prompt input the forward names and the call lacks), the forward
    encodes the images itself, with the same result. ``inputs=None`` (the decode step, whose new
    tokens hold no image placeholder) only drops ``mm_encoder_outputs``.
    """
    if MM_ENCODER_OUTPUTS not in kwargs:
        return kwargs
    out = {k: v for k, v in kwargs.items() if k != MM_ENCODER_OUTPUTS}
    if inputs is None:
        return out
    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = set()
    for key, value in inputs.items():
        if key not in out and key in params and isinstance(value, torch.Tensor):
            out[key] = value
    return out


def decompose_prefill_decode(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    generation_config: Any = None,
    multi_token_decode: bool = False,
) -> Decomposition:
    """Capture the prefill and decode forward kwargs from one real ``model.generate()`` call.

    ``generate`` runs greedily for a window of 2 new tokens (3 with ``multi_token_decode``); a
    forward pre-hook records every top-level forward call (positional arguments named by the
    forward's signature, each call deep-copied, ``logits_to_keep`` dropped). The first call is the
    prefill, the second the decode step; with ``multi_token_decode`` the second and third are
    merged into one two-token decode call (:func:`hfexport.generation.decode.merge_decode_steps`).

    Args:
        model: a ``PreTrainedModel`` with ``generate`` (decoder-only or encoder-decoder).
        inputs: generate-style inputs: ``input_ids`` int64 ``[batch, seq]``, ``attention_mask``
            ``[batch, seq]`` (0 on padding), and whatever else ``generate`` takes. Use batch >= 2
            and seq >= 2 so that ``dynamic=True`` exports keep those axes symbolic.
        generation_config: optional ``GenerationConfig``; copied, never mutated. Its cache settings
            are used: ``GenerationConfig(cache_implementation="static", max_cache_len=N)`` gives a
            static cache, which the graphs take as an input and update in place.
        multi_token_decode: capture a two-token decode step so that a ``dynamic=True`` decode
            graph keeps a symbolic query length.

    Returns:
        ``{"prefill": (model, kwargs), "decode": (model, kwargs)}`` (a :class:`Decomposition`,
        with ``.plan``). For encoder-decoder models the prefill is the first decoder step.

    Raises:
        ValueError: inputs without ``input_ids``/``inputs_embeds``; a static cache without
            ``max_cache_len``.
        RuntimeError: ``generate`` failed (the message names the model and the input keys), or it
            called the top-level forward fewer times than the window needs.
    """
    recording = record_generation(
        model, inputs, generation_config=generation_config, multi_token_decode=multi_token_decode
    )
    recorded_keys = set(recording.prefill) - {MM_ENCODER_OUTPUTS}
    recording.prefill = _raw_modality_inputs(model, recording.prefill, inputs)
    recording.decode = _raw_modality_inputs(model, recording.decode, None)
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    plan = GenerationPlan(
        architecture="encoder_decoder" if encoder_decoder else "decoder",
        model_class=type(model).__name__,
        cache_kind=recording.cache_kind,
        max_cache_len=recording.max_cache_len,
        multi_token_decode=multi_token_decode,
        components=["prefill", "decode"],
        token_ids=token_ids_of(model),
    )
    prefill: torch.nn.Module = model
    if recording.prefill.keys() - recorded_keys:  # it takes the raw images: no encoder outputs out
        prefill = WithoutModalityOutputs(model)
    decomposition = Decomposition(
        {"prefill": (prefill, recording.prefill), "decode": (model, recording.decode)}, plan, model
    )
    describe_components(decomposition)
    return decomposition


def _decompose_encoder_decoder(
    model: torch.nn.Module, inputs: Mapping[str, Any], generation_config: Any, multi_token_decode: bool
) -> Decomposition:
    encoder = model.get_encoder()
    if encoder is model or not isinstance(encoder, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder but get_encoder() returns no submodule"
        )
    recording = record_generation(
        model,
        inputs,
        generation_config=generation_config,
        multi_token_decode=multi_token_decode,
        submodules={"encoder": encoder},
    )
    encoder_calls = recording.capture.calls["encoder"]
    if not encoder_calls:
        raise RuntimeError(
            f"{type(model).__name__}.generate() never called its encoder {type(encoder).__name__}"
        )
    plan = GenerationPlan(
        architecture="encoder_decoder",
        model_class=type(model).__name__,
        cache_kind=recording.cache_kind,
        max_cache_len=recording.max_cache_len,
        multi_token_decode=multi_token_decode,
        components=["encoder", "prefill", "decode"],
        token_ids=token_ids_of(model),
    )
    components = {
        "encoder": (encoder, encoder_calls[0]),
        "prefill": (model, recording.prefill),
        "decode": (model, recording.decode),
    }
    decomposition = Decomposition(components, plan, model)
    describe_components(decomposition)
    return decomposition


def decompose_for_generation(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    generation_config: Any = None,
    multi_token_decode: bool = False,
    *,
    per_image_grid: bool = False,
) -> Decomposition:
    """Decompose ``model`` into the components of an exported greedy generation loop.

    Args:
        model: a generative ``PreTrainedModel``.
        inputs: generate-style inputs (see :func:`decompose_prefill_decode`; multimodal models take
            the processor's outputs, e.g. ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``).
        generation_config: optional ``GenerationConfig`` (copied; cache settings kept).
        multi_token_decode: capture a two-token decode step.
        per_image_grid: multimodal models: export the image features for one image of the
            sample's patch grid (see :func:`hfexport.generation.multimodal.decompose_multimodal`).

    Returns:
        A :class:`Decomposition`: ``prefill`` / ``decode`` for decoder-only models; ``encoder`` /
        ``prefill`` / ``decode`` for encoder-decoder models; for multimodal models
        ``image_encoder`` / ``audio_encoder`` / ``multi_modal_projector`` (those present),
        ``embed_tokens``, ``language_model``, ``lm_head``, ``decode``; for recurrent-state models
        (mamba, ...) ``prefill`` / ``decode`` wrappers with the state as named tensors
        (:func:`hfexport.generation.recurrent.decompose_recurrent`).

    Raises:
        ValueError, RuntimeError: see :func:`decompose_prefill_decode` and
            :func:`hfexport.generation.multimodal.decompose_multimodal`.
    """
    if is_recurrent_state_model(model):
        return decompose_recurrent(model, inputs, multi_token_decode=multi_token_decode)
    if is_multimodal(model):
        return decompose_multimodal(
            model,
            inputs,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            include_decode=True,
            per_image_grid=per_image_grid,
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return _decompose_encoder_decoder(model, inputs, generation_config, multi_token_decode)
    return decompose_prefill_decode(model, inputs, generation_config, multi_token_decode)
