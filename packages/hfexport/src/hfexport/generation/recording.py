"""Record the forward kwargs a real ``model.generate()`` call passes to the model and its parts.

``generate`` prepares every step's inputs itself (cache objects, position ids, masks, encoder
outputs, pre-encoded images), so the surest way to learn what the prefill and decode graphs must
take is to run it once and listen: forward pre-hooks (``with_kwargs=True``) on the model, and on any
submodule of interest, copy each call's arguments as keyword arguments before the call runs.

Listening with hooks rather than replacing ``forward`` leaves ``inspect.signature(model.forward)``
untouched, so ``generate`` takes the same path it takes for the user (it inspects the signature to
decide whether to pass ``position_ids`` and ``logits_to_keep``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "GENERATOR",
    "CallRecorder",
    "GenerateCapture",
    "GenerationRecording",
    "capture_generate_calls",
    "normalise_call",
    "padding_mask_for_call",
    "record_generation",
]

logger = logging.getLogger(__name__)

#: ``submodules`` label of an inner generative model whose own ``generate`` the model's ``generate``
#: calls after encoding the image (BLIP-2, InstructBLIP, Kosmos-2: :func:`record_generation` takes
#: its forward calls as the prefill and decode calls when the top-level forward is never called)
GENERATOR = "generator"

#: Kwargs ``generate`` adds that select outputs rather than feed the computation; they are dropped
#: from captured calls (a decode graph must return the logits of every new position).
DROPPED_KWARGS: tuple[str, ...] = ("logits_to_keep", "num_logits_to_keep")


def normalise_call(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Turn one call's positional and keyword arguments into keyword arguments.

    Positional arguments are bound to parameter names with ``inspect.signature(module.forward)``;
    values gathered by a ``**kwargs`` parameter are merged in; ``None`` values and the kwargs in
    :data:`DROPPED_KWARGS` are left out.

    Args:
        module: the called module.
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.

    Returns:
        A new dict ``{parameter_name: value}`` (values are not copied).

    Raises:
        TypeError: the arguments do not bind to the signature, or a positional argument lands in a
            ``*args`` parameter (it has no name to export it under).
    """
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        if args:
            raise TypeError(
                f"{type(module).__name__}.forward has no inspectable signature, so its {len(args)} positional "
                "argument(s) cannot be named"
            ) from None
        return {k: v for k, v in kwargs.items() if v is not None and k not in DROPPED_KWARGS}
    bound = signature.bind_partial(*args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(
                    f"{type(module).__name__}.forward received {len(value)} argument(s) through *{name}; "
                    "they have no keyword name to export them under"
                )
        else:
            named[name] = value
    return {k: v for k, v in named.items() if v is not None and k not in DROPPED_KWARGS}


class CallRecorder:
    """Forward pre-hooks recording deep copies of the normalised kwargs of each call.

    Args:
        modules: ``{label: module}`` to listen to.
        max_calls: ``{label: n}``: keep at most ``n`` calls of that module (default: all).

        record_outputs: also keep a deep copy of each recorded call's output in ``outputs[label]``.

    Use as a context manager; the hooks are removed on exit, also on error. ``calls[label]`` is the
    list of recorded kwargs dicts, in call order.
    """

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        max_calls: Mapping[str, int] | None = None,
        record_outputs: bool = False,
    ) -> None:
        self.modules = dict(modules)
        self.max_calls = dict(max_calls or {})
        self.record_outputs = record_outputs
        self.calls: dict[str, list[dict[str, Any]]] = {label: [] for label in self.modules}
        self.outputs: dict[str, list[Any]] = {label: [] for label in self.modules}
        self.errors: list[str] = []
        self._handles: list[Any] = []

    def _hook(self, label: str, module: torch.nn.Module) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            limit = self.max_calls.get(label)
            if limit is not None and len(self.calls[label]) >= limit:
                return
            try:
                named = copy.deepcopy(normalise_call(module, args, kwargs))
                # a view handed on by the model (LLaVA's projector gets the vision tower's hidden
                # states without their CLS row: a strided view) would be captured with its strides
                # and the program would guard on them; what a runtime feeds is contiguous
                named = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in named.items()}
                self.calls[label].append(named)
            except Exception as exc:  # recorded, raised by the caller with context
                self.errors.append(f"{label} ({type(module).__name__}): {type(exc).__name__}: {exc}")

        return hook

    def _output_hook(self, label: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if len(self.outputs[label]) < len(self.calls[label]):
                self.outputs[label].append(copy.deepcopy(output))

        return hook

    def __enter__(self) -> CallRecorder:
        seen: dict[int, str] = {}
        for label, module in self.modules.items():
            if id(module) in seen:
                raise ValueError(f"modules {seen[id(module)]!r} and {label!r} are the same module")
            seen[id(module)] = label
            self._handles.append(
                module.register_forward_pre_hook(self._hook(label, module), with_kwargs=True)
            )
            if self.record_outputs:
                self._handles.append(module.register_forward_hook(self._output_hook(label)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class GenerateCapture:
    """What one recorded ``generate`` call saw.

    Attributes:
        calls: ``{label: [kwargs, ...]}`` per listened module; ``"model"`` is the top-level forward.
        outputs: ``{label: [output, ...]}`` when outputs were recorded (else empty lists).
        sequences: the token ids ``generate`` returned (``[batch, prompt + new]``).
        generation_config: the (copied) generation config ``generate`` ran with.
    """

    calls: dict[str, list[dict[str, Any]]]
    sequences: torch.Tensor
    generation_config: Any
    outputs: dict[str, list[Any]] = field(default_factory=dict)


def _window_config(model: Any, generation_config: Any, new_tokens: int) -> Any:
    """A copy of the generation config that greedily produces exactly ``new_tokens`` tokens, with
    the cache on."""
    from transformers import GenerationConfig

    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    config.max_new_tokens = new_tokens
    config.min_new_tokens = new_tokens
    config.do_sample = False
    config.num_beams = 1
    config.num_return_sequences = 1
    config.return_dict_in_generate = False
    # the split's decode step reads the cache: a generation config that turns it off (Pix2Struct's
    # text config defaults to use_cache=False; issue 28) would record steps that re-read the whole
    # decoder prompt; greedy search gives the same tokens either way
    config.use_cache = True
    # sampling-only knobs would only produce warnings under greedy search
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(config, name):
            setattr(config, name, None)
    if getattr(config, "pad_token_id", None) is None:
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        config.pad_token_id = eos if eos is not None else 0
    return config


def capture_generate_calls(
    model: Any,
    inputs: Mapping[str, Any],
    *,
    new_tokens: int,
    generation_config: Any = None,
    submodules: Mapping[str, torch.nn.Module] | None = None,
    record_outputs: bool = False,
) -> GenerateCapture:
    """Run ``model.generate(**inputs)`` for ``new_tokens`` greedy tokens and record every call.

    Args:
        model: a ``PreTrainedModel`` with ``GenerationMixin``.
        inputs: generate-style inputs (``input_ids`` int64 ``[batch, seq]``, ``attention_mask``,
            ``pixel_values`` ...). Not modified.
        new_tokens: the capture window: how many tokens to generate (``min_new_tokens`` is set to the
            same value so an early EOS cannot shorten it).
        generation_config: a ``GenerationConfig``; copied, never mutated. Its cache settings
            (``cache_implementation``, ``max_cache_len``) are kept.
        submodules: ``{label: module}`` to record as well (each call, normalised and deep-copied).
        record_outputs: also record each call's output (``GenerateCapture.outputs``).

    Returns:
        A :class:`GenerateCapture`; ``calls["model"]`` holds the top-level forward calls.

    Raises:
        RuntimeError: ``generate`` failed (names the model class and the input keys), or a hook could
            not normalise a call.
    """
    modules = {"model": model, **dict(submodules or {})}
    config = _window_config(model, generation_config, new_tokens)
    with contextlib.ExitStack() as stack:
        recorder = stack.enter_context(CallRecorder(modules, record_outputs=record_outputs))
        stack.enter_context(torch.no_grad())
        try:
            sequences = model.generate(**dict(inputs), generation_config=config)
        except Exception as exc:
            raise RuntimeError(
                f"model.generate() failed for {type(model).__name__} with inputs {sorted(inputs)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if recorder.errors:
        raise RuntimeError(
            f"could not record the forward kwargs of {type(model).__name__}.generate(): "
            + "; ".join(recorder.errors)
        )
    seq = sequences if isinstance(sequences, torch.Tensor) else sequences.sequences
    return GenerateCapture(
        calls=recorder.calls, sequences=seq, generation_config=config, outputs=recorder.outputs
    )


def _seq_length(value: Any) -> int:
    if value is None:
        return 0
    length = value.get_seq_length() if hasattr(value, "get_seq_length") else 0
    return int(length)


def padding_mask_for_call(
    kwargs: Mapping[str, Any], base_mask: torch.Tensor | None, batch: int
) -> torch.Tensor:
    """The 2-D padding mask ``[batch, past + q]`` that ``generate`` tracks for one decoder call.

    ``generate`` keeps a 2-D mask over every position seen so far (the prompt's mask, then ones for
    each generated token) but may hand the model a 4-D mask, a dict of masks, or nothing when there
    is no padding. This rebuilds the 2-D form from the prompt's mask and the cache length.

    Args:
        kwargs: the call's kwargs (``input_ids`` or ``inputs_embeds`` give ``q``; ``cache`` the past).
        base_mask: the prompt's 2-D mask ``[batch, prompt_len]`` or ``None`` (no padding).
        batch: batch size.

    Returns:
        An int64 tensor ``[batch, past + q]``.
    """
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    q = int(tokens.shape[1]) if tokens is not None else 0
    total = _seq_length(kwargs.get("cache")) + q
    if base_mask is None:
        return torch.ones(batch, total, dtype=torch.int64)
    base = base_mask.to(torch.int64)
    if total <= base.shape[1]:
        return base[:, :total].clone()
    extra = torch.ones(base.shape[0], total - base.shape[1], dtype=torch.int64, device=base.device)
    return torch.cat([base, extra], dim=1)


@dataclass
class GenerationRecording:
    """The prefill and decode calls of one recorded ``generate`` window.

    Attributes:
        prefill: kwargs of the first top-level forward call (the prompt).
        decode: kwargs of the decode call: the second call, or the second and third merged into one
            two-token call (``multi_token_decode``).
        decode_steps: the single-token decode calls, as recorded.
        capture: the raw :class:`GenerateCapture` (submodule calls and outputs included).
        cache_kind: ``"static"`` when the cache is preallocated (``StaticCache``), else ``"dynamic"``.
        max_cache_len: the static cache length, or ``None``.
        caller: the label whose forward calls ``prefill`` and ``decode`` are: ``"model"`` (the
            top-level forward) or :data:`GENERATOR` (an inner language model's, when the model's
            ``generate`` never calls its own forward and ``submodules`` names that inner model).
    """

    prefill: dict[str, Any]
    decode: dict[str, Any]
    decode_steps: list[dict[str, Any]]
    capture: GenerateCapture
    cache_kind: str
    max_cache_len: int | None
    caller: str = "model"


def _cache_of(kwargs: Mapping[str, Any]) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _is_static(cache: Any) -> bool:
    from transformers.cache_utils import StaticCache

    if isinstance(cache, StaticCache):
        return True
    inner = getattr(cache, "self_attention_cache", None)
    return isinstance(inner, StaticCache)


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def record_generation(
    model: Any,
    inputs: Mapping[str, Any],
    *,
    generation_config: Any = None,
    multi_token_decode: bool = False,
    submodules: Mapping[str, torch.nn.Module] | None = None,
    record_outputs: bool = False,
    decoder_masks: Mapping[str, torch.nn.Module] | None = None,
    steps_from: str | None = None,
) -> GenerationRecording:
    """Record the prefill and decode calls of one short greedy ``generate`` run.

    The window is 2 new tokens (prefill + one decode step), 3 with ``multi_token_decode`` (the two
    decode steps are merged by :func:`hfexport.generation.decode.merge_decode_steps`); one more
    for encoder-decoder models, whose first decode step (a one-position self-attention cache) is
    skipped so that a dynamic export keeps the cache length symbolic. The
    ``generation`` workarounds (:mod:`hfexport.workarounds.generation`) are installed for the run.

    Decoder-only calls get the 2-D padding mask ``generate`` tracks (``[batch, past + q]``, see
    :func:`padding_mask_for_call`) in place of a missing, 4-D or per-layer-type mask, so every graph
    takes a padding mask and builds its causal mask inside, whatever the cache kind.

    Args:
        model: a ``PreTrainedModel`` with ``generate``.
        inputs: generate-style inputs (``input_ids`` ``[batch, seq]`` int64, ``attention_mask``, ...).
        generation_config: a ``GenerationConfig`` (copied); ``cache_implementation="static"`` with
            ``max_cache_len`` selects a static cache.
        multi_token_decode: merge two decode steps into one two-token call.
        submodules: extra modules whose calls to record (labels other than ``"model"``); the label
            :data:`GENERATOR` names an inner language model whose calls stand in for the top-level ones.
        record_outputs: also record outputs.
        decoder_masks: ``{label: module}`` of recorded submodules that are decoders taking the
            same 2-D padding mask (e.g. a multimodal model's language model).
        steps_from: a ``submodules`` label (:data:`GENERATOR`) whose forward calls are the prefill
            and decode steps even when the top-level forward made enough calls (Kosmos-2.5's forward
            computes the image features and calls its text model with them; issue 28).

    Returns:
        A :class:`GenerationRecording`.

    Raises:
        ValueError: a static cache without ``max_cache_len``; ``inputs`` without ``input_ids`` or
            ``inputs_embeds`` (an encoder-decoder's: nor ``input_features`` / ``pixel_values`` /
            ``flattened_patches``).
        RuntimeError: ``generate`` failed (names the model and input keys), or it made fewer
            top-level forward calls than the window needs (its ``generate`` bypasses ``forward``)
            and no :data:`GENERATOR` submodule made enough either.
    """
    from hfexport.generation.decode import merge_decode_steps
    from hfexport.registry import apply_patches
    from hfexport.workarounds.generation import BACKEND

    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    # an encoder-decoder's prompt may be its encoder's input alone: audio features (Whisper) or
    # an image (VisionEncoderDecoder: pixel_values and a decoder prompt; issue 28)
    prompt_keys = {"input_ids", "inputs_embeds", "input_features"} | (
        {"pixel_values", "flattened_patches"} if encoder_decoder else set()
    )
    if not isinstance(inputs, Mapping) or not (prompt_keys & set(inputs)):
        raise ValueError(
            "generation inputs must be a dict with input_ids (int64 [batch, seq]) or inputs_embeds "
            "(an encoder-decoder: or its encoder's input_features / pixel_values / flattened_patches); "
            f"got {sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__}"
        )
    static_requested = getattr(generation_config, "cache_implementation", None) == "static"
    if static_requested and not getattr(generation_config, "max_cache_len", None):
        raise ValueError(
            "a static cache needs its length: pass GenerationConfig(cache_implementation='static', "
            "max_cache_len=N) with N >= prompt length + the tokens you will generate"
        )
    # An encoder-decoder's first decode step sees a self-attention cache of one position (the start
    # token), which a dynamic export would specialise: skip it so the recorded past is >= 2.
    skip = 1 if encoder_decoder else 0
    window = (3 if multi_token_decode else 2) + skip
    with apply_patches(BACKEND):
        capture = capture_generate_calls(
            model,
            inputs,
            new_tokens=window,
            generation_config=generation_config,
            submodules=submodules,
            record_outputs=record_outputs,
        )
    top = capture.calls["model"]
    caller = "model"
    if steps_from is not None and len(capture.calls.get(steps_from) or []) >= window:
        top, caller = capture.calls[steps_from], steps_from
    elif len(top) < window and len(capture.calls.get(GENERATOR) or []) >= window:
        # the model's generate encodes the image and hands the embeddings to an inner language
        # model's generate (BLIP-2, InstructBLIP, Kosmos-2): its forward calls are the steps
        top, caller = capture.calls[GENERATOR], GENERATOR
    if len(top) < window:
        raise RuntimeError(
            f"{type(model).__name__}.generate() called the top-level forward {len(top)} time(s) for {window} new "
            f"tokens, {window} expected: this model's generate bypasses its forward (e.g. a custom decoding "
            "loop), so its prefill and decode calls cannot be captured"
        )
    if not encoder_decoder:
        base_mask = inputs.get("attention_mask")
        batch = (
            int(inputs["input_ids"].shape[0])
            if "input_ids" in inputs
            else int(inputs["inputs_embeds"].shape[0])
        )
        labelled = [("model", model), *dict(decoder_masks or {}).items()]
        if caller != "model" and submodules is not None:
            labelled.append((caller, submodules[caller]))
        for label, module in labelled:
            if not _accepts(module, "attention_mask"):
                continue
            for call in capture.calls[label]:
                mask = call.get("attention_mask")
                if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
                    call["attention_mask"] = padding_mask_for_call(call, base_mask, batch)
    steps = top[1 + skip : window]
    decode = merge_decode_steps(steps)
    cache = _cache_of(decode)
    if cache is None:
        cache = _cache_of(top[0])
    static = _is_static(cache)
    max_len = None
    if static:
        inner = getattr(cache, "self_attention_cache", cache)
        max_len = int(inner.layers[0].max_cache_len) if inner.layers else None
    return GenerationRecording(
        prefill=top[0],
        decode=decode,
        decode_steps=list(steps),
        capture=capture,
        cache_kind="static" if static else "dynamic",
        max_cache_len=max_len,
        caller=caller,
    )
