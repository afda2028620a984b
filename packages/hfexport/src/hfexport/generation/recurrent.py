"""Prefill and decode components for models whose generation state is a recurrence (issue 28).

Mamba, FalconMamba and Mamba2 keep, per layer, a *conv state* (the last ``conv_kernel`` inputs of
the causal convolution) and an *SSM state*; RWKV keeps five per-layer tensors (the token-shift
inputs of time and channel mixing and the WKV numerator, denominator and running maximum);
RecurrentGemma keeps, per recurrent layer, a conv state and the RG-LRU state, and per attention
layer a fixed window of keys and values, all inside its modules. None of them is a KV cache of
positions that grows by one entry per token, so the recording of ``generate()`` the attention
models use does not apply (their cache objects have no sequence length, or live in the modules).

This module wraps the model into two components with the state as plain named tensors:

- ``prefill``: ``input_ids`` ``[batch, seq]`` (+ ``attention_mask`` for the Mamba family,
  ``position_ids`` for RecurrentGemma) -> ``logits`` ``[batch, seq, vocab]`` and ``cache.<name>``
  for every state tensor;
- ``decode``: ``input_ids`` ``[batch, 1]`` (+ ``position_ids`` for RecurrentGemma) and ``cache``
  (``{name: tensor}``, the previous call's ``cache.<name>`` outputs) -> ``logits``
  ``[batch, 1, vocab]`` and the new ``cache.<name>``.

The ``cache`` input carries the ``cache`` role of :mod:`hfexport.conventions.roles`, and the names
(``layers.<i>.conv_states`` ...) follow the leaf names of transformers' own cache layers, so
:class:`~hfexport.generation.runner.GenerationRunner` feeds the decode step from the previous
outputs unchanged. The wrappers are the eager model's own forward (no arithmetic of ours): the state
tensors handed to the model are fresh copies (the model updates its cache in place), and the
plain-forward recurrence patches of :mod:`hfexport.workarounds.recurrences` apply to the prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfexport.generation.components import Decomposition, describe_components, token_ids_of
from hfexport.generation.plan import GenerationPlan

__all__ = [
    "LINEAR_ATTENTION_CACHE_TYPES",
    "RECURRENT_GENERATION_TYPES",
    "RWKV_STATE_NAMES",
    "RecurrentStateComponent",
    "decompose_recurrent",
    "is_recurrent_state_model",
    "recurrent_state_names",
]

#: Model types whose transformers cache is a ``DynamicCache`` of linear-attention layers (one conv
#: state and one SSM state per layer, ``state_idx`` 0).
LINEAR_ATTENTION_CACHE_TYPES = frozenset({"mamba", "falcon_mamba", "mamba2"})

#: RWKV's five state tensors ``[batch, hidden, layers]`` in the order of transformers' ``state``
#: list: the token-shift inputs of channel mixing and of time mixing, then the WKV numerator,
#: denominator and running maximum.
RWKV_STATE_NAMES: tuple[str, ...] = (
    "feed_forward_shift",
    "time_mixing_shift",
    "wkv_numerator",
    "wkv_denominator",
    "wkv_max",
)

#: Every model type this module builds prefill/decode components for.
RECURRENT_GENERATION_TYPES = LINEAR_ATTENTION_CACHE_TYPES | {"rwkv", "recurrent_gemma"}


def _gemma_layers(model: Any) -> list[tuple[int, Any]]:
    """``[(index, temporal_block)]`` of a RecurrentGemma model's decoder layers."""
    return [(i, layer.temporal_block) for i, layer in enumerate(model.model.layers)]


def _is_recurrent_block(block: Any) -> bool:
    return hasattr(block, "rg_lru")


def _model_type(model: Any) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def is_recurrent_state_model(model: Any) -> bool:
    """``model``'s generation state is one this module carries (:data:`RECURRENT_GENERATION_TYPES`)."""
    return _model_type(model) in RECURRENT_GENERATION_TYPES


def _num_layers(model: Any) -> int:
    config = model.config
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)


def recurrent_state_names(model: Any) -> list[str]:
    """The names of ``model``'s state tensors, in the order the components return them.

    Args:
        model: a model of a type in :data:`RECURRENT_GENERATION_TYPES`.

    Returns:
        ``["layers.0.conv_states", "layers.0.recurrent_states", "layers.1.conv_states", ...]`` for
        the linear-attention caches, :data:`RWKV_STATE_NAMES` for RWKV; for RecurrentGemma
        ``layers.<i>.conv_states`` / ``recurrent_states`` of its recurrent layers and
        ``layers.<i>.keys`` / ``values`` of its attention layers.

    Raises:
        ValueError: ``model`` is of another type.
    """
    model_type = _model_type(model)
    if model_type in LINEAR_ATTENTION_CACHE_TYPES:
        return [
            f"layers.{i}.{kind}"
            for i in range(_num_layers(model))
            for kind in ("conv_states", "recurrent_states")
        ]
    if model_type == "rwkv":
        return list(RWKV_STATE_NAMES)
    if model_type == "recurrent_gemma":
        names: list[str] = []
        for i, block in _gemma_layers(model):
            kinds = ("conv_states", "recurrent_states") if _is_recurrent_block(block) else ("keys", "values")
            names.extend(f"layers.{i}.{kind}" for kind in kinds)
        return names
    raise ValueError(
        f"model type {model_type!r} has no recurrent-state components; supported: "
        f"{sorted(RECURRENT_GENERATION_TYPES)}"
    )


# --------------------------------------------------------------------------------------------
# Linear-attention caches (mamba, falcon_mamba, mamba2)
# --------------------------------------------------------------------------------------------


def _linear_attention_cache(model: Any, state: Mapping[str, torch.Tensor] | None) -> Any:
    """A transformers ``DynamicCache`` for ``model``: empty, or holding copies of ``state``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if state is None:
        return cache
    for i, layer in enumerate(cache.layers):
        conv, recurrent = state[f"layers.{i}.conv_states"], state[f"layers.{i}.recurrent_states"]
        # copies: the model updates its cache in place (copy_), which must not write into graph inputs
        layer.conv_states[0] = conv.clone()
        layer.recurrent_states[0] = recurrent.clone()
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.is_conv_states_initialized[0] = True
        layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
        layer.dtype, layer.device = conv.dtype, conv.device
    return cache


def _linear_attention_state(cache: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        out[f"layers.{i}.conv_states"] = layer.conv_states[0]
        out[f"layers.{i}.recurrent_states"] = layer.recurrent_states[0]
    return out


class RecurrentStateComponent(torch.nn.Module):
    """The ``prefill`` or ``decode`` component of a recurrent-state model (see the module docstring).

    Args:
        model: the ``*ForCausalLM`` model (a type in :data:`RECURRENT_GENERATION_TYPES`); shared,
            not copied.
        kind: ``"prefill"`` (no state in, the prompt) or ``"decode"`` (state in, one token).

    Forward:
        ``input_ids`` int64 ``[batch, seq]``; ``attention_mask`` ``[batch, seq]`` (prefill only,
        optional; ignored by RWKV and RecurrentGemma); ``cache`` ``{name: tensor}`` (decode only,
        :func:`recurrent_state_names`); ``position_ids`` int64 ``[batch, seq]`` (RecurrentGemma,
        required: its RG-LRU restarts where they are 0).
        Returns ``{"logits": [batch, seq, vocab] float, "cache": {name: tensor}}``.

    Raises:
        ValueError: an unknown ``kind`` or a model of an unsupported type (at construction); a
            decode call without ``cache``, or a RecurrentGemma call without ``position_ids`` (at call).
    """

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        super().__init__()
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
        recurrent_state_names(model)  # raises for an unsupported type
        self.model = model
        self.kind = kind
        self.config = model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Mapping[str, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        if self.kind == "decode" and cache is None:
            raise ValueError("the decode component needs the previous call's cache")
        state = None if self.kind == "prefill" else cache
        if self.config.model_type == "rwkv":
            # copies: the model writes each layer's slice of the state in place
            given = None if state is None else [state[name].clone() for name in RWKV_STATE_NAMES]
            # RWKV's forward takes no padding mask (it ignores attention_mask)
            output = self.model(input_ids=input_ids, state=given, use_cache=True, return_dict=True)
            return {"logits": output.logits, "cache": dict(zip(RWKV_STATE_NAMES, output.state, strict=True))}
        if self.config.model_type == "recurrent_gemma":
            return self._recurrent_gemma(input_ids, position_ids, state)
        model_cache = _linear_attention_cache(self.model, state)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=model_cache,
            use_cache=True,
            return_dict=True,
        )
        return {"logits": output.logits, "cache": _linear_attention_state(model_cache)}

    def _recurrent_gemma(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        state: Mapping[str, torch.Tensor] | None,
    ) -> dict[str, Any]:
        """RecurrentGemma: module-held conv / RG-LRU states and a sliding-window KV cache."""
        from transformers import DynamicCache

        if position_ids is None:
            raise ValueError(
                "RecurrentGemma's components need position_ids (the RG-LRU resets where they are 0)"
            )
        layers = _gemma_layers(self.model)
        saved = [(b, b.conv1d_state, b.rg_lru.recurrent_states) for _, b in layers if _is_recurrent_block(b)]
        cache = DynamicCache(config=self.config)
        try:
            if state is None:
                self.model.model._setup_cache(
                    self.config, input_ids.shape[0], input_ids.device, self.model.dtype
                )
            else:
                for i, block in layers:
                    if _is_recurrent_block(block):
                        # copies: the model replaces them, but a graph must not alias its inputs
                        block.conv1d_state = state[f"layers.{i}.conv_states"].clone()
                        block.rg_lru.recurrent_states = state[f"layers.{i}.recurrent_states"].clone()
                    else:
                        keys, values = state[f"layers.{i}.keys"], state[f"layers.{i}.values"]
                        layer = cache.layers[i]
                        layer.lazy_initialization(keys, values)
                        layer.keys, layer.values = keys, values
                        layer.cumulative_length = keys.shape[-2]
            output = self.model(
                input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, return_dict=True
            )
            out: dict[str, torch.Tensor] = {}
            for i, block in layers:
                if _is_recurrent_block(block):
                    out[f"layers.{i}.conv_states"] = block.conv1d_state
                    out[f"layers.{i}.recurrent_states"] = block.rg_lru.recurrent_states
                else:
                    out[f"layers.{i}.keys"] = cache.layers[i].keys
                    out[f"layers.{i}.values"] = cache.layers[i].values
        finally:
            for block, conv, recurrent in saved:
                block.conv1d_state, block.rg_lru.recurrent_states = conv, recurrent
        return {"logits": output.logits, "cache": out}


def decompose_recurrent(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, multi_token_decode: bool = False
) -> Decomposition:
    """``prefill`` and ``decode`` components of a recurrent-state model, with sample kwargs.

    The decode sample is the state after the prompt (computed eagerly by the prefill component)
    and the greedy next token, so both components are captured on real states.

    Args:
        model: a model of a type in :data:`RECURRENT_GENERATION_TYPES`.
        inputs: ``input_ids`` int64 ``[batch, seq]`` (seq >= 2) and optionally ``attention_mask``.
        multi_token_decode: must be False: the models continue a state one token at a time
            (their multi-token path restarts the recurrence from zero).

    Returns:
        A :class:`Decomposition` ``{"prefill": ..., "decode": ...}`` whose plan is a
        ``"decoder"`` plan with a ``"dynamic"`` cache.

    Raises:
        ValueError: no ``input_ids``, ``multi_token_decode=True``, or a model of an unsupported type.
    """
    if multi_token_decode:
        raise ValueError(
            f"{_model_type(model)} continues its recurrent state one token at a time: its decode component "
            "takes one token; export without multi_token_decode"
        )
    input_ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            "a recurrent model's generation components need input_ids [batch, seq] among the inputs"
        )
    prefill = RecurrentStateComponent(model, "prefill").eval()
    decode = RecurrentStateComponent(model, "decode").eval()
    prefill_kwargs: dict[str, Any] = {"input_ids": input_ids}
    mask = inputs.get("attention_mask")
    gemma = _model_type(model) == "recurrent_gemma"
    if mask is not None and _model_type(model) not in ("rwkv", "recurrent_gemma"):
        prefill_kwargs["attention_mask"] = mask
    if gemma:  # generate() gives RecurrentGemma position ids and no mask
        prefill_kwargs["position_ids"] = (
            torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1).clone()
        )
    with torch.no_grad():
        first = prefill(**prefill_kwargs)
    token = first["logits"][:, -1].argmax(-1, keepdim=True).to(torch.int64)
    decode_kwargs: dict[str, Any] = {
        "input_ids": token,
        "cache": {k: v.detach().clone() for k, v in first["cache"].items()},
    }
    if gemma:
        decode_kwargs["position_ids"] = torch.full_like(token, input_ids.shape[1])
    plan = GenerationPlan(
        architecture="decoder",
        model_class=type(model).__name__,
        cache_kind="dynamic",
        components=["prefill", "decode"],
        token_ids=token_ids_of(model),
    )
    decomposition = Decomposition(
        {"prefill": (prefill, prefill_kwargs), "decode": (decode, decode_kwargs)}, plan, model
    )
    describe_components(decomposition)
    return decomposition
