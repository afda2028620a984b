"""The ``llm-runner`` layout: a ``.pte`` and ``tokenizer.json`` that ExecuTorch's own LLM runner runs.

ExecuTorch 1.4's text runner (``executorch.extension.llm.runner.TextLLMRunner(pte, tokenizer)`` in
Python, ``create_text_llm_runner`` in C++) drives a program by these conventions (read in
``extension/llm/runner/{llm_runner_helper,text_decoder_runner,text_prefiller}.cpp`` and
``io_manager/io_manager.h`` of executorch 1.4.1):

- method ``forward`` takes exactly two inputs, ``tokens`` int64 ``[1, seq]`` and the positions
  int64: ``[seq]`` (``start_pos .. start_pos + seq - 1``) when the planned size of that input is
  above 1, else ``[1]`` (``start_pos``); it returns exactly one floating tensor of logits,
  ``[1, vocab]`` or ``[1, seq, vocab]`` (the runner then samples the last row);
- the KV cache lives inside the program (mutable buffers); the runner never passes it;
- metadata are methods returning constants: ``get_max_seq_len`` (required: the most tokens per
  call; longer prompts are prefilled in chunks), ``get_max_context_len`` (cache positions),
  ``enable_dynamic_shape`` (prefill the prompt in one call, else token by token),
  ``use_kv_cache``, ``use_sdpa_with_kv_cache`` and ``get_eos_ids`` (a list); the runner takes
  bos and the vocabulary size from the tokenizer, and samples among the first
  ``tokenizer vocab size`` logits;
- ``max_seq_len < max_context_len`` means a sliding-window model to the runner (it then stops
  counting used positions), so this layout writes both equal.

The program here (:class:`RunnerProgram`) wraps the eager model around a transformers
``StaticCache`` of ``max_context_len`` positions whose tensors are registered as buffers: the
cache layers' in-place ``index_copy_`` becomes a buffer mutation, which ExecuTorch keeps as
mutable state between calls. Each call sets the layers' write position from ``input_pos``, so
the runner's ``reset()`` (positions from 0 again) simply overwrites the old entries; positions
beyond the current one are masked by causality. The ExecuTorch ``Module`` zero-fills its planned
memory at load (``Module::make_planned_memory``), so unwritten cache entries are zeros.

The export goes through :class:`hfexport_executorch.ExecutorchExporter` (patches, capture,
XNNPACK lowering, memory planning, validation at the sample shape), with the metadata as constant
methods; then :func:`validate_runner_sequence` runs two prefills of different lengths and a
decode step through the ExecuTorch runtime, keeping the cache between calls as the runner does,
against the eager model.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_MAX_CONTEXT_LEN",
    "RunnerProgram",
    "export_llm_runner",
    "refusal",
    "runner_metadata",
    "runner_text_reference",
    "runner_vocab_size",
    "validate_runner_sequence",
    "validate_runner_text",
    "write_llm_runner",
]

logger = logging.getLogger(__name__)

#: Cache positions when nothing else is asked: the model's maximum positions, capped here (the
#: cache is ``2 x layers x kv heads x positions x head dim`` values held in memory by the runner).
DEFAULT_MAX_CONTEXT_LEN = 2048

#: Layer types of ``config.layer_types`` a static KV cache serves (transformers' names).
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")

#: Pre-tokenizers the runner's ``tokenizers::HFTokenizer`` (meta-pytorch/tokenizers) parses.
_RUNNER_PRE_TOKENIZERS = ("Split", "Digits", "ByteLevel", "Sequence")

_PTE_NAME = "model.pte"
_CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
)


# -- what fits ----------------------------------------------------------------------------------
def _layer_types(model: Any) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config.get_text_config(decoder=True)
    types, _ = get_layer_types_and_kwargs(config)
    return list(types)


def refusal(model: Any, task: str) -> str | None:
    """Why ``model`` cannot be written as an ``llm-runner`` program, or ``None`` when it can.

    The runner's ``forward(tokens, input_pos)`` fits decoder-only causal LMs whose cache is an
    attention KV cache: encoder-decoder models (the decoder also reads the encoder output),
    state-space / linear-attention / hybrid caches, multimodal models and models without
    ``generate`` are refused, each with what to export instead.
    """
    if model is None:
        return None
    config = getattr(model, "config", None)
    name = type(model).__name__
    plain = "export it without --layout (hfexport export executorch --task text-generation writes components that `hfexport generate` runs)"
    if config is None or not callable(getattr(model, "can_generate", None)) or not model.can_generate():
        return f"{name} does not generate text (no causal LM head); the llm-runner layout needs a decoder-only causal LM"
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"{name} is an encoder-decoder model: its decoder's cache is not causal-only (cross-attention over the "
            f"encoder output), which the runner's forward(tokens, input_pos) cannot feed; {plain}"
        )
    from hfexport.generation.multimodal import is_multimodal

    if is_multimodal(model):
        return f"{name} takes images or audio; TextLLMRunner feeds text tokens only; {plain}"
    if getattr(model, "_is_stateful", False):
        return f"{name} keeps a recurrent (state-space) cache, not a KV cache of positions; {plain}"
    try:
        types = _layer_types(model)
    except Exception as exc:  # a config transformers cannot map to cache layers
        return f"{name}'s cache layers cannot be worked out from its config ({exc}); {plain}"
    other = sorted(set(types) - set(_ATTENTION_LAYERS))
    if other:
        return (
            f"{name} has cache layers of type {', '.join(other)} (not a causal attention KV cache the runner's "
            f"static cache can hold); {plain}"
        )
    return None


# -- tokenizer ----------------------------------------------------------------------------------
def _tokenizer_json(files: Sequence[Path]) -> Path | None:
    return next((Path(f) for f in files if Path(f).name == "tokenizer.json"), None)


def _isolates_characters(pre: Any) -> bool:
    """True when the pre-tokenizer cuts text into single characters (a ``Split`` on the empty
    string, isolated), after an optional whitespace split."""
    if not isinstance(pre, Mapping):
        return False
    parts = list(pre.get("pretokenizers") or ()) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts if isinstance(p, Mapping)]
    last = parts[-1] if parts else {}
    return (
        set(kinds[:-1]) <= {"WhitespaceSplit", "Whitespace"}
        and last.get("type") == "Split"
        and (last.get("pattern") or {}).get("String") == ""
        and last.get("behavior") == "Isolated"
    )


def _character_bpe(data: dict[str, Any]) -> dict[str, Any] | None:
    """The character-level BPE ``tokenizer.json`` equivalent to a character-level WordPiece one, or
    ``None`` when ``data`` is not that.

    A WordPiece tokenizer whose vocabulary holds single characters only (besides its added special
    tokens) and whose pre-tokenizer isolates characters (what protein / chemistry checkpoints
    ship, e.g. IgLM's ``vocab.txt``) maps every character to its own id; a BPE with the same vocabulary,
    no merges and a pre-tokenizer that drops spaces and isolates characters gives the same ids (for
    text whose whitespace is spaces; tabs and newlines become unknown tokens).
    The runner's tokenizer reads BPE only, so the layout writes this form.
    """
    model = data.get("model") or {}
    if model.get("type") != "WordPiece" or not _isolates_characters(data.get("pre_tokenizer")):
        return None
    added = {t.get("content") for t in data.get("added_tokens") or ()}
    vocab = dict(model.get("vocab") or {})
    if any(len(token) != 1 for token in vocab if token not in added):
        return None
    converted = dict(data)
    converted["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": model.get("unk_token"),
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [],
    }
    converted["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            # read alike by `tokenizers` and by the runner, whose Split keeps the matches of a Regex
            # pattern whatever the behavior, and splits on a String pattern as a delimiter
            {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
            {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        ],
    }
    converted["decoder"] = None
    return converted


def _check_runner_tokenizer(path: Path | None) -> tuple[dict[str, Any], str | None]:
    """Parse ``tokenizer.json`` and check the runner's tokenizer can load it.

    Returns:
        ``(tokenizer.json contents to write, conversion note or None)``: a character-level WordPiece
        tokenizer comes back as its equivalent BPE (see :func:`_character_bpe`).

    Raises:
        ValueError: no ``tokenizer.json``, or a tokenizer model / pre-tokenizer the runner's
            ``HFTokenizer`` does not read (it reads BPE with Split/Digits/ByteLevel pre-tokenizers).
    """
    if path is None:
        raise ValueError(
            "the llm-runner layout needs tokenizer.json next to the model (ExecuTorch's runner reads it): add "
            "tokenizer.json and tokenizer_config.json to the model folder, e.g. tokenizer.save_pretrained(folder)"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    note = None
    converted = _character_bpe(data)
    if converted is not None:
        data, note = converted, "character-level WordPiece written as the equivalent character-level BPE"
    kind = (data.get("model") or {}).get("type")
    if kind != "BPE":
        raise ValueError(
            f"{path} holds a {kind} tokenizer; ExecuTorch 1.4's runner loads tokenizer.json files of BPE "
            "tokenizers only (meta-pytorch/tokenizers HFTokenizer; WordPiece/Unigram are not read): ship a BPE "
            "tokenizer.json, or a SentencePiece/tiktoken model file the runner reads, with the .pte"
        )

    def pre_types(node: Any) -> list[str]:
        if not isinstance(node, Mapping):
            return []
        found = [str(node.get("type"))]
        for child in node.get("pretokenizers") or ():
            found.extend(pre_types(child))
        return found

    unread = sorted(set(pre_types(data.get("pre_tokenizer"))) - set(_RUNNER_PRE_TOKENIZERS))
    if data.get("pre_tokenizer") is None or unread:
        raise ValueError(
            f"{path}'s pre-tokenizer ({', '.join(unread) or 'none'}) is not one ExecuTorch 1.4's runner reads "
            f"({', '.join(_RUNNER_PRE_TOKENIZERS)}); ship a tokenizer.json with one of those"
        )
    return data, note


def runner_vocab_size(tokenizer: Mapping[str, Any]) -> int:
    """The vocabulary size ExecuTorch's runner gives a parsed ``tokenizer.json``: the distinct ids of
    ``model.vocab`` and ``added_tokens`` (``HFTokenizer::vocab_size()``); its sampler takes the
    argmax over that many leading logits."""
    ids = {int(v) for v in (tokenizer.get("model") or {}).get("vocab", {}).values()}
    ids |= {int(t["id"]) for t in tokenizer.get("added_tokens") or ()}
    return len(ids)


# -- the program --------------------------------------------------------------------------------
class RunnerProgram(torch.nn.Module):
    """``forward(tokens, input_pos) -> logits`` over a causal LM with its KV cache as buffers.

    Args:
        model: a decoder-only ``PreTrainedModel`` with a causal LM head (eval mode).
        max_context_len: cache positions (prompt + generated tokens of one conversation).
        logits_size: width of the returned logits; columns past the model's vocabulary are
            ``-inf`` (the runner samples among as many logits as its tokenizer has ids).
        custom_ops: write the cache with ExecuTorch's ``llama::update_cache`` (buffers in the
            op's ``[1, max_context_len, kv heads, head dim]`` layout) and pass the start position to
            the attention as ``hfexport_start_pos``; trace the program inside
            :func:`hfexport_executorch.llm_ops.custom_op_attention` so attention runs
            ``llama::custom_sdpa`` (see :mod:`hfexport_executorch.llm_ops`).
        kv_cache_dtype: with ``custom_ops``, ``"int8"`` keeps the cache in int8 with per-token scales
            (:class:`hfexport_executorch.llm_ops.Int8UpdateCacheLayer`, more buffers per layer);
            ``None`` in the model's dtype.

    Call:
        ``tokens``: int64 ``[1, seq]``, ``1 <= seq <= max_context_len``;
        ``input_pos``: int64 ``[seq]``, the positions ``start .. start + seq - 1`` of the tokens.

    Returns:
        float logits ``[1, logits_size]`` of the last position (the model's dtype).

    The cache tensors are the buffers ``k_cache_{i}`` / ``v_cache_{i}`` (``[1, kv heads,
    max_context_len, head dim]``, one per layer; ``[1, max_context_len, kv heads, head dim]`` with
    ``custom_ops``), written in place at ``input_pos``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_context_len: int,
        *,
        logits_size: int | None = None,
        custom_ops: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> None:
        super().__init__()
        from transformers.cache_utils import StaticCache

        self.model = model
        self.config = model.config
        self.max_context_len = int(max_context_len)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        self.vocab_size = vocab
        self.logits_size = int(logits_size or vocab)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        cache = StaticCache(config=model.config, max_cache_len=self.max_context_len)
        # one eager step lets every layer allocate its tensors with the shapes the model uses
        with torch.no_grad():
            device = next(model.parameters()).device
            model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        self.cache = cache
        self.custom_ops = bool(custom_ops)
        if self.custom_ops:
            from hfexport_executorch.llm_ops import load_export_ops, update_cache_transform

            load_export_ops()
            update_cache_transform(self, kv_cache_dtype)
        elif kv_cache_dtype is not None:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs custom_ops=True (the quantized cache is ExecuTorch's "
                "llama::custom_quantized_sdpa); allowed without them: None"
            )
        self._buffers_of = getattr(cache.layers[0], "BUFFERS", {"keys": "k_cache", "values": "v_cache"})
        for i, layer in enumerate(cache.layers):
            layer.keys.zero_()
            layer.values.zero_()
            for attr, prefix in self._buffers_of.items():
                self.register_buffer(f"{prefix}_{i}", getattr(layer, attr), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):
            # the buffers as this call sees them (torch.export swaps in its own tensors), and the
            # write position from input_pos instead of the layer's running counter
            for attr, prefix in self._buffers_of.items():
                setattr(layer, attr, self.get_buffer(f"{prefix}_{i}"))
            layer.cumulative_length = input_pos[0].clone()
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache, "use_cache": True}
        if self.custom_ops:
            # the ops take the start position as a scalar (SymInt), bounded for the export
            start = input_pos[0].item()
            torch._check(start >= 0)
            torch._check(start + tokens.shape[1] <= self.max_context_len)
            for layer in self.cache.layers:
                layer.start_pos = start
            kwargs["hfexport_start_pos"] = start
            kwargs["hfexport_cache"] = self.cache
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=tokens, position_ids=input_pos.unsqueeze(0), **kwargs)
        logits = out.logits[:, -1, :]
        if self.logits_size > logits.shape[-1]:
            pad = self.logits_size - logits.shape[-1]
            logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        return logits


def _token_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def runner_metadata(
    model: Any, max_context_len: int, *, vocab_size: int, sdpa_with_kv_cache: bool = False
) -> dict[str, Any]:
    """The constant methods the runner reads (see the module docstring), plus the conventional
    ``get_bos_id`` / ``get_vocab_size`` / ``get_n_layers`` other ExecuTorch tools read.
    ``sdpa_with_kv_cache``: the program runs ExecuTorch's custom SDPA / cache-update ops
    (``use_sdpa_with_kv_cache``, as ``export_llm`` writes it for those ops).

    Returns:
        ``{method name: int | bool | list[int]}``.
    """
    generation = getattr(model, "generation_config", None)
    config = model.config.get_text_config(decoder=True)
    eos = _token_id_list(getattr(generation, "eos_token_id", None)) or _token_id_list(
        getattr(config, "eos_token_id", None)
    )
    bos = getattr(generation, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    methods: dict[str, Any] = {
        "get_max_seq_len": int(max_context_len),
        "get_max_context_len": int(max_context_len),
        "enable_dynamic_shape": True,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": bool(sdpa_with_kv_cache),
        "get_vocab_size": int(vocab_size),
        "get_n_layers": int(getattr(config, "num_hidden_layers", 0) or len(_layer_types(model))),
    }
    if bos is not None:
        methods["get_bos_id"] = int(bos)
    if eos:
        methods["get_eos_ids"] = sorted(set(eos))
    return methods


def _max_context_len(model: Any, requested: int | None) -> tuple[int, str]:
    from hfexport.conventions import max_positions

    positions, source = max_positions(model.config, decoder=True)
    windows = [
        int(w)
        for w in (getattr(model.config.get_text_config(decoder=True), "sliding_window", None),)
        if isinstance(w, int) and w > 0 and "sliding_attention" in _layer_types(model)
    ]
    if requested is not None:
        if requested < 2:
            raise ValueError(f"max_context_len={requested} is invalid; allowed: an int >= 2")
        if positions and requested > positions:
            raise ValueError(
                f"max_context_len={requested} exceeds the model's {positions} positions ({source}); allowed: 2..{positions}"
            )
        if windows and requested > windows[0]:
            raise ValueError(
                f"max_context_len={requested} exceeds the sliding window ({windows[0]}); the runner's sliding-window "
                f"mode is not written by this layout; allowed: 2..{windows[0]}"
            )
        return int(requested), "requested"
    chosen = min([DEFAULT_MAX_CONTEXT_LEN, *([positions] if positions else []), *windows])
    why = f"min({DEFAULT_MAX_CONTEXT_LEN}, {source or 'no position limit'}"
    why += f", sliding_window {windows[0]})" if windows else ")"
    return int(chosen), why


# -- validation ---------------------------------------------------------------------------------
def validate_runner_sequence(
    manager: Any,
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    max_context_len: int,
    atol: float,
    rtol: float = 0.0,
    required_backend: str | None = None,
    gates: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Run the program as the runner does (one loaded method, state kept) and compare with eager.

    Steps: prefill ``prompt[:, :n1]`` at positions ``0..n1-1``; one decode step with the greedy
    token at position ``n1``; a second prefill of another length ``n2`` from position 0 (what the
    runner does after ``reset()``). Each program logits row is compared with the eager model's
    last-position logits on the same tokens (no cache).

    Args:
        manager: the ``ExecutorchProgramManager`` of a :class:`RunnerProgram`.
        model: the eager ``PreTrainedModel``.
        prompt: int64 ``[1, n]`` token ids, ``n >= 3``.
        max_context_len: the program's cache positions.
        atol / rtol: tolerances (``|a - b| <= atol + rtol * |b|``).
        required_backend: delegate backend the runtime must have.
        gates: quality gates of a quantized or reduced-precision program
            (:func:`hfexport.quality.quality_gates_for`): instead of the tolerances, each step's
            logits row must reach ``gates["cosine"]`` against the fp32 eager row, and the share of
            steps whose arg-max token equals eager's must reach ``gates["top1_agreement"]``.

    Returns:
        ``{"steps": [{"step", "positions", "max_abs_diff", "same_argmax", "cosine"}], "max_abs_diff":
        float}``, plus ``"top1_agreement"`` and ``"gates"`` when gated.

    Raises:
        hfexport.errors.ExportValidationError: a step differs beyond tolerance, or misses a gate
            (names the step or the metric, its value and the gate).
    """
    from executorch.runtime import Runtime

    from hfexport.errors import ExportValidationError

    if required_backend and not Runtime.get().backend_registry.is_available(required_backend):
        raise RuntimeError(
            f"the ExecuTorch runtime in this process has no {required_backend}; cannot validate"
        )
    from hfexport_executorch.runtime import load_method, load_program

    method = load_method(load_program(manager.buffer), "forward")
    n = int(prompt.shape[1])
    n1 = max(2, min(n - 1, max_context_len - 2))
    n2 = max(1, min(n, max_context_len - 1)) if n != n1 else max(1, n1 - 1)
    vocab = int(model.get_output_embeddings().weight.shape[0])

    def eager(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits[:, -1, :].float()

    def run(ids: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], dtype=torch.long)
        (out,) = method.execute([ids.contiguous(), positions])
        return out.clone()[:, :vocab].float()

    steps = []
    first = prompt[:, :n1]
    got = run(first, 0)
    plan = [("prefill", first, got, eager(first), f"0..{n1 - 1}")]
    token = got.argmax(-1, keepdim=True)
    extended = torch.cat([first, token], dim=1)
    plan.append(("decode", extended, run(token, n1), eager(extended), str(n1)))
    second = prompt[:, :n2]
    plan.append(("prefill_again", second, run(second, 0), eager(second), f"0..{n2 - 1}"))
    worst = 0.0
    for name, _ids, actual, expected, positions in plan:
        diff = float((actual - expected).abs().max())
        worst = max(worst, diff)
        cosine = float(
            torch.nn.functional.cosine_similarity(actual.double(), expected.double(), dim=-1).min()
        )
        steps.append(
            {
                "step": name,
                "positions": positions,
                "max_abs_diff": diff,
                "same_argmax": bool(torch.equal(actual.argmax(-1), expected.argmax(-1))),
                "cosine": cosine,
            }
        )
        if gates is not None:
            if "cosine" in gates and not cosine >= gates["cosine"]:
                raise ExportValidationError(
                    f"the llm-runner program's {name} step (positions {positions}) misses its quality gate against "
                    f"fp32 eager: cosine = {cosine:.4f} (gate >= {gates['cosine']}); lower it with --gate "
                    "cosine=... or exclude sensitive layers from quantization"
                )
            continue
        if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
            raise ExportValidationError(
                f"the llm-runner program's {name} step (positions {positions}) differs from eager PyTorch: max abs "
                f"diff {diff:.3g} > atol {atol:g}; the cache kept between calls does not reproduce the model"
            )
    result: dict[str, Any] = {"steps": steps, "max_abs_diff": worst}
    if gates is not None:
        top1 = sum(step["same_argmax"] for step in steps) / len(steps)
        result.update(top1_agreement=top1, gates=dict(gates))
        if "top1_agreement" in gates and not top1 >= gates["top1_agreement"]:
            raise ExportValidationError(
                f"the llm-runner program's next token differs from fp32 eager's: top1_agreement = {top1:.4f} over "
                f"{len(steps)} steps (gate >= {gates['top1_agreement']}); steps: {steps}"
            )
    return result


def runner_text_reference(model: Any, config: Any, max_context_len: int) -> Any:
    """The eager side of the text metrics (:mod:`hfexport.verify.text`) for an ``llm-runner``
    program, or ``None`` when no text gate applies (an unquantized export whose ``quality_gates``
    name no text metric).

    The quality text is tokenized with the tokenizer saved next to ``model`` (UTF-8 bytes without
    one), cut into chunks of at most ``max_context_len`` tokens (one conversation of the program's
    cache each) and run through the eager model once per chunk (teacher-forced prefill). Default
    gates of a tokenizer that maps the text to its unknown token are dropped, as for every export
    (:func:`hfexport.verify.text.text_coverage_problem`).

    Args:
        model: the eager causal LM (float32).
        config: the export's ``ExecutorchConfig`` (its ``quantization`` and ``quality_gates``).
        max_context_len: the program's cache positions.

    Returns:
        A :class:`hfexport.verify.text.TextReference` (logits ``[1, length, vocab]`` per chunk), or ``None``.
    """
    from hfexport.verify.gates import text_default_gates, text_gates_for
    from hfexport.verify.text import (
        model_tokenizer,
        position_limit,
        text_chunks,
        text_coverage_problem,
        text_reference,
        text_token_ids,
    )

    gates = text_gates_for(config)
    if gates is None:
        return None
    text_config = model.config.get_text_config(decoder=True)
    tokenizer = model_tokenizer(model)
    ids, how = text_token_ids(tokenizer, getattr(text_config, "vocab_size", None))
    if text_coverage_problem(tokenizer, ids) is not None:  # out-of-domain text: only named gates
        defaults = set(text_default_gates(config, gates))
        gates = {k: v for k, v in gates.items() if k not in defaults}
        if not gates:
            return None
    length = min(int(max_context_len), position_limit(model) or int(max_context_len))
    chunks = text_chunks(ids, max_length=max(2, length))
    return text_reference(
        model,
        lambda chunk: {"input_ids": chunk},
        chunks,
        gates=gates,
        tokenizer=how,
        default_gates=text_default_gates(config, gates),
    )


def validate_runner_text(manager: Any, reference: Any, *, required_backend: str | None = None) -> Any:
    """Score the program on the quality text as the runner runs it, against the eager logits of
    :func:`runner_text_reference`: each chunk fed one token per call at positions ``0, 1, ...``
    (the program returns the last position's logits only, so a prefill gives one row), the cache
    kept between calls and overwritten from position 0 for the next chunk (the runner's ``reset()``).

    Args:
        manager: the ``ExecutorchProgramManager`` of a :class:`RunnerProgram`.
        reference: from :func:`runner_text_reference`.
        required_backend: delegate backend the runtime must have.

    Returns:
        The :class:`hfexport.verify.text.TextQuality` (perplexity ratio, KL, top-1 over every position;
        ``ok`` False and ``failures`` filled when a gate is missed: the caller raises).

    Raises:
        RuntimeError: the runtime lacks ``required_backend``.
    """
    from executorch.runtime import Runtime

    from hfexport.verify.text import text_quality
    from hfexport_executorch.runtime import load_method, load_program

    if required_backend and not Runtime.get().backend_registry.is_available(required_backend):
        raise RuntimeError(
            f"the ExecuTorch runtime in this process has no {required_backend}; cannot validate"
        )
    method = load_method(load_program(manager.buffer), "forward")
    actual = []
    for chunk, expected in zip(reference.chunks, reference.expected, strict=True):
        vocab = int(expected.shape[-1])
        rows = []
        for position in range(int(chunk.shape[1])):
            token = chunk[:, position : position + 1].contiguous()
            (out,) = method.execute([token, torch.tensor([position], dtype=torch.long)])
            rows.append(out.clone()[:, :vocab].float())
        actual.append(torch.stack(rows, dim=1))
    return text_quality(
        reference.chunks,
        reference.expected,
        actual,
        gates=reference.gates,
        tokenizer=reference.tokenizer,
        default_gates=reference.default_gates,
    )


# -- writer -------------------------------------------------------------------------------------
def _prompt_ids(model: Any, inputs: Mapping[str, Any] | None, length: int = 12) -> torch.Tensor:
    """A deterministic prompt ``[1, length]``: the sample's first row, extended with fixed ids."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    sample = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    row = sample[:1].to(torch.long) if isinstance(sample, torch.Tensor) and sample.dim() == 2 else None
    generator = torch.Generator().manual_seed(0)
    filler = torch.randint(0, vocab, (1, length), generator=generator)
    ids = filler if row is None else torch.cat([row, filler], dim=1)
    return ids[:, :length].clamp(0, vocab - 1)


def export_llm_runner(
    model: torch.nn.Module,
    output_dir: str | Path,
    *,
    files: Sequence[str | Path],
    max_context_len: int | None = None,
    exporter: Any = None,
    config: Any = None,
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``model.pte`` + tokenizer files for ExecuTorch's ``TextLLMRunner`` into ``output_dir``.

    Args:
        model: a decoder-only causal ``PreTrainedModel`` (see :func:`refusal`).
        output_dir: an existing folder (the CLI passes its staging folder).
        files: the model folder's files; ``tokenizer.json`` (a BPE tokenizer) is required,
            ``tokenizer_config.json`` (the runner's bos/eos when given the folder), ``config.json``
            and ``generation_config.json`` are copied when present.
        max_context_len: KV-cache positions (prompt + new tokens per conversation); default
            ``min(2048, the model's maximum positions, its sliding window)``.
        exporter: an :class:`hfexport_executorch.ExecutorchExporter` (a new one when ``None``).
        config: an ``ExecutorchConfig`` (backend, tolerances, memory planning); its dynamic
            shapes are set here.
        inputs: sample forward kwargs; the first row of ``input_ids`` seeds the validation prompt.

    Returns:
        Report fields: ``max_context_len`` (and why), ``metadata`` (the constant methods),
        ``runner_vocab_size``, ``sequence_validation`` (:func:`validate_runner_sequence`), ``files``.

    Raises:
        ValueError: the model does not fit (:func:`refusal`), the tokenizer is missing or not one
            the runner reads, ``max_context_len`` out of range; the activation budget would cut
            the per-call token bound below ``max_context_len``.
        hfexport.errors.ExportValidationError: the program differs from eager PyTorch.
    """
    from torch.export import Dim

    from hfexport.config import ExecutorchConfig
    from hfexport_executorch.backends import runtime_backend
    from hfexport_executorch.exporter import ExecutorchExporter
    from hfexport_executorch.lowering import CONSTANT_METHODS_ATTR

    output_dir = Path(output_dir)
    files = [Path(f) for f in files]
    reason = refusal(model, "text-generation")
    if reason is not None:
        raise ValueError(reason)
    tokenizer, tokenizer_note = _check_runner_tokenizer(_tokenizer_json(files))
    tok_vocab = runner_vocab_size(tokenizer)
    context, why = _max_context_len(model, max_context_len)
    exporter = exporter if exporter is not None else ExecutorchExporter()
    config = config if config is not None else ExecutorchConfig()
    model_vocab = int(model.get_output_embeddings().weight.shape[0])
    if tok_vocab < model_vocab:
        logger.warning(
            "the tokenizer has %d ids, the model's vocabulary %d: ExecuTorch's runner samples among the first %d "
            "logits only",
            tok_vocab,
            model_vocab,
            tok_vocab,
        )
    custom_ops, custom_ops_note = _use_custom_ops(model, config)
    kv_cache_dtype = getattr(config, "kv_cache_dtype", None)
    program = RunnerProgram(
        model,
        context,
        logits_size=max(tok_vocab, model_vocab),
        custom_ops=custom_ops,
        kv_cache_dtype=kv_cache_dtype,
    ).eval()
    metadata = runner_metadata(
        model, context, vocab_size=max(tok_vocab, model_vocab), sdpa_with_kv_cache=custom_ops
    )
    setattr(program, CONSTANT_METHODS_ATTR, metadata)
    validate = bool(getattr(config, "validate", True))
    text = runner_text_reference(model, config, context) if validate else None
    text_gated = _text_gated(text)
    unnamed_gates: set[str] = set()
    if text_gated:
        # a 4-bit LM's logits at one position are far from fp32 eager's where the model is unsure (SmolLM2
        # 8da4w: cosine 0.73 on the sample's last position while the text metrics pass): the sample and
        # sequence rows are recorded and gated only by the metrics quality_gates names; the text gates decide:
        # the sample row's unnamed gates are 0 (quality_gates takes [0, 1]), the sequence steps' are dropped,
        # since a 4-bit row can point away from fp32's (SmolLM2 8da4w, MSE scales: prefill_again cosine -0.33)
        named = dict(getattr(config, "quality_gates", None) or {})
        unnamed_gates = {k for k in _SAMPLE_GATES if k not in named}
        config = config.replace(
            quality_gates={**named, **{k: named.get(k, 0.0) for k in _SAMPLE_GATES}},
        )
    prompt = _prompt_ids(model, inputs)
    sample_len = max(2, min(8, context - 1))
    sample = {"tokens": prompt[:, :sample_len], "input_pos": torch.arange(sample_len, dtype=torch.long)}
    seq = Dim("seq", min=1, max=context)
    export_config = config.replace(
        dynamic=True,
        dynamic_shapes={"tokens": {1: seq}, "input_pos": {0: seq}},
        validate_second_shape=False,
        output_path=None,
        kv_cache_dtype=None,  # read here; the plain exporter refuses it
    )
    if custom_ops:
        from hfexport_executorch.llm_ops import custom_op_attention

        with custom_op_attention(model):
            manager = exporter.export(program, sample, export_config)
    else:
        manager = exporter.export(program, sample, export_config)
    report = exporter.last_report
    bound = _token_bound(report)
    if bound is not None and bound < context:
        raise ValueError(
            f"the activation budget cut the tokens per call to {bound} (< max_context_len {context}): export with a "
            "smaller max_context_len or a larger ExecutorchConfig.max_dynamic_bytes (`hfexport export executorch "
            "--max-dynamic-bytes SIZE` on the command line)"
        )
    sequence = text_result = None
    if validate:
        sequence = validate_runner_sequence(
            manager,
            model,
            prompt,
            max_context_len=context,
            atol=float(getattr(export_config, "atol", 1e-4) or 1e-4),
            rtol=float(getattr(export_config, "rtol", 0.0) or 0.0),
            required_backend=runtime_backend(manager),
            gates=_sequence_gates(_gates(export_config, kv_cache_dtype), unnamed_gates),
        )
    if text is not None:
        text_result = _check_runner_text(manager, text, report, runtime_backend(manager))
    exporter.save(manager, output_dir / _PTE_NAME)
    written = [_PTE_NAME]
    for f in files:
        if f.name in _CARRIED_FILES and f.is_file():
            if f.name == "tokenizer.json" and tokenizer_note:
                (output_dir / f.name).write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n")
            else:
                shutil.copy2(f, output_dir / f.name)
            written.append(f.name)
    if not (output_dir / "config.json").exists():
        model.config.to_json_file(output_dir / "config.json")
        written.append("config.json")
    return {
        "max_context_len": context,
        "max_context_len_source": why,
        "metadata": metadata,
        "runner_vocab_size": tok_vocab,
        "tokenizer_conversion": tokenizer_note,
        "model_vocab_size": model_vocab,
        "custom_ops": _custom_ops_facts(manager) if custom_ops else [],
        "custom_ops_note": custom_ops_note,
        "kv_cache_dtype": kv_cache_dtype,
        "sequence_validation": sequence,
        "text_quality": text_result,
        "files": written,
    }


#: Validation gates of an ``--kv-cache-dtype int8`` program whose weights are float (a quantized
#: one keeps its method's gates): each step's logits cosine against fp32 eager, and next-token
#: agreement over the three steps (measured on the tiny llama: cosine 1.0000, every step equal).
INT8_CACHE_GATES = {"cosine": 0.99, "top1_agreement": 2 / 3}


#: The per-step gates of the sample and sequence checks that the text gates replace (see
#: :func:`export_llm_runner`): still measured and recorded, gated only when ``quality_gates`` names them.
_SAMPLE_GATES = ("cosine", "top1_agreement", "cache_cosine")


def _text_gated(reference: Any) -> bool:
    """True when a text gate of ``reference`` is in force: a named one, or the defaults when the
    eager model is not at chance on the text (a real checkpoint, not a random-weight test model)."""
    if reference is None:
        return False
    from hfexport.verify.text import text_gates_in_force

    return bool(text_gates_in_force(reference))


def _check_runner_text(manager: Any, reference: Any, report: Any, backend: str | None) -> dict[str, Any]:
    """:func:`validate_runner_text`, recorded in ``report`` (``validation["text"]``,
    ``text_quality_gates``) as every export records its text metrics.

    Raises:
        hfexport.errors.ExportValidationError: a text gate is missed (metric, value, gate, margin).
    """
    from hfexport.errors import ExportValidationError
    from hfexport.verify.text import format_text_quality, text_gate_message

    result = validate_runner_text(manager, reference, required_backend=backend)
    row = result.to_dict()
    if report is not None:
        report.validation["text"] = [row]
        report.text_quality_gates = dict(reference.gates)
        report.top1_gated_on_text = "top1_agreement_text" in result.gates
    table = format_text_quality(result, title="llm-runner program on the quality text vs fp32 eager")
    logger.info("%s", table)
    if not result.ok:
        raise ExportValidationError(text_gate_message(result, table), [result])
    return row


def _sequence_gates(gates: dict[str, float] | None, dropped: set[str]) -> dict[str, float] | None:
    """``gates`` without the names in ``dropped`` (recorded, not gated); ``None`` stays ``None``."""
    return None if gates is None else {k: v for k, v in gates.items() if k not in dropped}


def _gates(config: Any, kv_cache_dtype: str | None) -> dict[str, float] | None:
    from hfexport.quality import quality_gates_for

    gates = quality_gates_for(config)
    if gates is None and kv_cache_dtype is not None:
        overrides = dict(getattr(config, "quality_gates", None) or {})
        gates = {**INT8_CACHE_GATES, **{k: float(v) for k, v in overrides.items() if k in INT8_CACHE_GATES}}
    return gates


def _use_custom_ops(model: Any, config: Any) -> tuple[bool, str | None]:
    """Whether the program uses ExecuTorch's LLM custom ops, and why not when it does not.

    ``ExecutorchConfig.custom_ops`` (default True) asks for them; they are left out, with the reason
    logged and returned, for the ``cuda`` backend (the ops are CPU kernels), a model whose attention
    they cannot replace (:func:`hfexport_executorch.llm_ops.custom_op_refusal`), and an executorch
    install whose custom-op library or runtime kernels are missing (the program then keeps the
    plain cache and attention, which every runtime runs).
    """
    from hfexport_executorch import llm_ops

    if not getattr(config, "custom_ops", True):  # ExecutorchConfig refuses kv_cache_dtype without them
        return False, "custom_ops=False (--no-custom-ops)"
    backend = getattr(config, "backend", "xnnpack")
    reason = None
    if backend != "xnnpack":
        reason = f"the {backend} backend: ExecuTorch's LLM custom ops are CPU kernels"
    else:
        reason = llm_ops.custom_op_refusal(model)
    if reason is None:
        try:
            llm_ops.load_export_ops()
            missing = llm_ops.missing_runtime_kernels()
        except llm_ops.CustomOpsUnavailableError as exc:
            reason, missing = str(exc), []
        if missing:
            reason = f"the ExecuTorch runtime of this install registers no {', '.join(missing)}"
    kv_cache_dtype = getattr(config, "kv_cache_dtype", None)
    if reason is None and kv_cache_dtype is not None:
        importlib.import_module("executorch.kernels.quantized")  # the per-token quantize kernels
        missing = llm_ops.missing_runtime_kernels(llm_ops.INT8_CACHE_KERNELS)
        if missing:
            reason = f"the ExecuTorch runtime of this install registers no {', '.join(missing)}"
    if reason is not None and kv_cache_dtype is not None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} (--kv-cache-dtype) needs ExecuTorch's LLM custom ops, which this "
            f"export cannot use: {reason}; export without --kv-cache-dtype"
        )
    if reason is not None:
        logger.warning("llm-runner: plain KV cache and attention, not ExecuTorch's custom ops: %s", reason)
        return False, reason
    return True, None


def _custom_ops_facts(manager: Any) -> list[str]:
    """The ``llama::`` operators the saved program calls (sorted)."""
    from hfexport_executorch.runtime import program_operators

    return sorted(name for name in program_operators(manager.buffer) if name.startswith("llama::"))


def _token_bound(report: Any) -> int | None:
    axes = (getattr(report, "dynamic_bounds", None) or {}).get("axes") or []
    bounds = [a.get("max") for a in axes if a.get("input") == "tokens" and a.get("axis") == 1]
    return int(bounds[0]) if bounds and bounds[0] is not None else None


def write_llm_runner(request: Any) -> dict[str, Any]:
    """Layout writer for the CLI (:class:`hfexport.layouts.LayoutRequest`); see :func:`export_llm_runner`
    (default ``max_context_len``)."""
    return export_llm_runner(
        request.model,
        request.output_dir,
        files=request.files,
        exporter=request.exporter,
        config=request.config,
        inputs=request.inputs,
    )
