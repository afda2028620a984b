"""The ``genai`` layout: a folder that ONNX Runtime GenAI's own ``Model(folder)`` and ``Generator`` run.

``hfexport export onnx --task text-generation --layout genai --model FOLDER OUTPUT_DIR`` writes:

* ``model.onnx`` (``model.onnx.data`` above the 2 GiB protobuf limit): one decoder graph with the
  conventional names (:mod:`hfexport_onnx.decoder_graph`);
* ``genai_config.json``: what ONNX Runtime GenAI reads to drive it (``model.type``,
  ``context_length``, the decoder's file, heads, head size, layers, input/output name templates,
  bos/eos/pad ids, vocabulary size, and the ``search`` defaults from the model's generation config);
* the tokenizer files of the model folder (``tokenizer.json``, ``tokenizer_config.json`` ...),
  ``generation_config.json`` and ``config.json``.

``model.type``: ONNX Runtime GenAI picks its model class by this name. The graph is a generic
decoder (the runtime's ``DecoderOnly_Model``), so a model whose transformers ``model_type`` is one
of the runtime's plain decoder types (:data:`PASS_THROUGH_TYPES`) keeps it, and every other
decoder-only model with a plain attention KV cache is written as ``"decoder"``, the runtime's
generic decoder-only type. ``gpt2`` is among the latter: the runtime dispatches that name to a
GPT-2 specific class that looks for inputs our graph does not have (onnxruntime-genai 0.18.0:
``RuntimeError: Model input was not found``). The phi3 family is also written as ``"decoder"``:
the runtime applies a rotary-embedding rewind threshold to those names that belongs to its own
model builder's graphs.

Tested with onnxruntime-genai 0.18.0 on CPU, fp32.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from hfexport.layouts import Layout, LayoutRequest, register_layout, tokenizer_files

__all__ = [
    "CONFIG_NAME",
    "GENERIC_TYPE",
    "LAYOUT",
    "PASS_THROUGH_TYPES",
    "check_genai",
    "check_genai_config",
    "genai_config",
    "genai_model_type",
    "tokenizer_warning",
    "write_genai",
]

logger = logging.getLogger(__name__)

#: File ONNX Runtime GenAI reads from the folder.
CONFIG_NAME = "genai_config.json"
#: ``model.type`` of ONNX Runtime GenAI's generic decoder-only model.
GENERIC_TYPE = "decoder"
#: transformers ``model_type`` values that ONNX Runtime GenAI (0.18) runs as a plain decoder-only
#: model with no behaviour of its own: written as they are.
PASS_THROUGH_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "olmo", "nemotron", "phi", "smollm3"}
)
#: Files copied from the model folder besides the tokenizer.
_MODEL_FILES = ("generation_config.json", "config.json")
# context length written when the config names none (ONNX Runtime GenAI requires one)
_DEFAULT_CONTEXT_LENGTH = 2048


def genai_model_type(model_type: str | None) -> str:
    """The ``model.type`` written for a transformers ``model_type`` (see the module docstring)."""
    return model_type if model_type in PASS_THROUGH_TYPES else GENERIC_TYPE


def check_genai(model: Any, task: str) -> str | None:
    """:attr:`Layout.check` of ``genai``: why ``model`` cannot be served, or ``None``.

    Refuses models that are not decoder-only causal LMs with a plain attention KV cache
    (encoders, encoder-decoders, state-space / linear-attention / sliding-window caches); see
    :func:`hfexport_onnx.decoder_graph.decoder_cache_refusal`.
    """
    from hfexport_onnx.decoder_graph import decoder_cache_refusal

    if model is None:
        return None
    reason = decoder_cache_refusal(model)
    if reason is None:
        return None
    return (
        f"layout 'genai' runs decoder-only causal LMs with a plain attention KV cache (llama, qwen2, qwen3, "
        f"mistral, gpt2 ...): {reason}"
    )


def check_genai_config(config: Any) -> str | None:
    """:attr:`Layout.check_config` of ``genai``: a float16 graph with quantized weights (the
    transformers.js q4f16 recipe, ``--dtype float16 --quantize int4-weight``) is refused; the
    ``genai`` layout writes quantized graphs in float32, as ONNX Runtime GenAI's builder does for
    its CPU ``int4`` models, and no float16 quantized folder has been run in ONNX Runtime GenAI here.
    """
    dtype = getattr(config, "dtype", None)
    quantization = getattr(config, "quantization", None)
    if quantization is None or dtype != "float16":
        return None
    return (
        f"--dtype float16 with --quantize {quantization.method} is not written for ONNX Runtime GenAI; "
        f"allowed: --dtype float32 (the default) with --quantize {quantization.method}, or "
        "--layout transformers.js for a float16 int4-weight graph (transformers.js's q4f16)"
    )


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _context_length(text_config: Any) -> tuple[int, str]:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return _DEFAULT_CONTEXT_LENGTH, "default"


def genai_config(
    model: Any, graph: Any, *, generation_config: Any = None, share_buffer: bool = False
) -> dict[str, Any]:
    """The ``genai_config.json`` content for a decoder graph of ``model``.

    Args:
        model: the eager causal LM (its text config gives hidden size, heads, context length,
            vocabulary, and bos/eos/pad ids when the generation config has none).
        graph: the :class:`hfexport_onnx.decoder_graph.DecoderGraph` written next to it (file
            name, layers, KV heads, head size, whether it takes ``position_ids``).
        generation_config: a ``transformers.GenerationConfig``; default ``model.generation_config``.
        share_buffer: ``search.past_present_share_buffer``: True only for a graph whose attentions
            read their lengths from ``attention_mask`` (:func:`hfexport_onnx.gqa.shares_past_present_buffer`);
            a graph that concatenates past and new keys needs False.

    Returns:
        A JSON-safe dict: ``{"model": {...}, "search": {...}}``. ``search.max_length`` (prompt +
        new tokens, as in ONNX Runtime GenAI) is the context length; ``do_sample``, ``top_k``,
        ``top_p``, ``temperature``, ``repetition_penalty``, ``num_beams`` ... come from the
        generation config (greedy when it says nothing).
    """
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    gen = generation_config if generation_config is not None else getattr(model, "generation_config", None)

    def gen_value(name: str) -> Any:
        return getattr(gen, name, None) if gen is not None else None

    bos = _first(
        gen_value("bos_token_id"), getattr(text, "bos_token_id", None), getattr(config, "bos_token_id", None)
    )
    eos = _first(
        gen_value("eos_token_id"), getattr(text, "eos_token_id", None), getattr(config, "eos_token_id", None)
    )
    pad = _first(
        gen_value("pad_token_id"), getattr(text, "pad_token_id", None), getattr(config, "pad_token_id", None)
    )
    if pad is None and eos is not None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    context_length, _ = _context_length(text)
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if graph.takes_position_ids:
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = graph.past_key_template
    inputs["past_value_names"] = graph.past_value_template
    num_beams = gen_value("num_beams") or 1
    top_k = gen_value("top_k")
    model_section: dict[str, Any] = {
        "type": genai_model_type(getattr(text, "model_type", None) or getattr(config, "model_type", None)),
        "context_length": context_length,
        "vocab_size": int(text.vocab_size),
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "filename": graph.path.name,
            "head_size": graph.head_dim,
            "hidden_size": int(getattr(text, "hidden_size", 0) or 0),
            "num_attention_heads": int(getattr(text, "num_attention_heads", 0) or graph.num_kv_heads),
            "num_key_value_heads": graph.num_kv_heads,
            "num_hidden_layers": graph.num_layers,
            "inputs": inputs,
            "outputs": {
                "logits": "logits",
                "present_key_names": graph.present_key_template,
                "present_value_names": graph.present_value_template,
            },
        },
    }
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if value is not None:
            model_section[key] = list(value) if isinstance(value, (list, tuple)) else int(value)
    search = {
        "do_sample": bool(gen_value("do_sample") or False),
        "num_beams": int(num_beams),
        "num_return_sequences": int(gen_value("num_return_sequences") or 1),
        "max_length": context_length,
        "min_length": 0,
        "early_stopping": bool(gen_value("early_stopping") or False) if num_beams > 1 else True,
        "length_penalty": float(_first(gen_value("length_penalty"), 1.0)),
        "diversity_penalty": float(_first(gen_value("diversity_penalty"), 0.0)),
        "no_repeat_ngram_size": int(gen_value("no_repeat_ngram_size") or 0),
        "repetition_penalty": float(_first(gen_value("repetition_penalty"), 1.0)),
        "temperature": float(_first(gen_value("temperature"), 1.0)),
        "top_k": int(top_k) if top_k is not None else 50,
        "top_p": float(_first(gen_value("top_p"), 1.0)),
        # True: the runtime feeds one max_length buffer as past and present and the GroupQueryAttention
        # nodes write the new keys/values in place; False: present is past + sequence (a Concat)
        "past_present_share_buffer": bool(share_buffer),
    }
    return {"model": model_section, "search": search}


def tokenizer_warning(tokenizer_json: Path) -> str | None:
    """Why ``og.Tokenizer`` will not read this ``tokenizer.json``, or ``None`` when it should.

    ONNX Runtime GenAI tokenizes with onnxruntime-extensions, which reads BPE and Unigram
    (SentencePiece) ``tokenizer.json`` models only (onnxruntime-genai 0.18.0); a WordPiece or
    WordLevel tokenizer fails in ``og.Tokenizer(model)`` (``Cannot know how to parse line``). The
    graph still runs: encode prompts with another tokenizer and pass the ids to the generator.
    """
    try:
        kind = json.loads(Path(tokenizer_json).read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, ValueError):
        return None
    if kind in (None, "BPE", "Unigram"):
        return None
    return (
        f"the tokenizer is a {kind} model; onnxruntime-genai's og.Tokenizer reads BPE and Unigram (SentencePiece) "
        "tokenizers only, so encode prompts with another tokenizer (e.g. tokenizers.Tokenizer.from_file("
        "'tokenizer.json')) and pass the ids to og.Generator.append_tokens"
    )


def write_genai(request: LayoutRequest) -> dict[str, Any]:
    """Writer of the ``genai`` layout: decoder graph + ``genai_config.json`` + tokenizer and model files.

    Args:
        request: the :class:`hfexport.layouts.LayoutRequest` (model, sample prompt, ONNX config,
            staging folder, model-folder files).

    Returns:
        Extra ``export_report.json`` fields: ``genai`` (model type written and the transformers one,
        context length and where it came from, layers, KV heads, head size, files).

    Raises:
        Whatever :func:`hfexport_onnx.decoder_graph.export_decoder_with_past` raises (the CLI
        leaves OUTPUT_DIR as it was).
    """
    from hfexport_onnx.decoder_graph import export_decoder_with_past
    from hfexport_onnx.gqa import attention_mask_lengths, shares_past_present_buffer

    out = Path(request.output_dir)
    text = request.model.config
    text = text.get_text_config(decoder=True) if hasattr(text, "get_text_config") else text
    context_length, context_source = _context_length(text)
    # with ort_fusions, GroupQueryAttention reads its lengths from attention_mask, so the runtime
    # can share one past/present buffer (no copy of the whole cache per step), and its cos/sin
    # tables cover the context length from constants (folded once when the session is created)
    with attention_mask_lengths(context_length):
        graph = export_decoder_with_past(
            request.model, request.inputs, request.config, out, exporter=request.exporter
        )
    share_buffer = graph.artifact is not None and shares_past_present_buffer(graph.artifact.model)
    content = genai_config(request.model, graph, share_buffer=share_buffer)
    (out / CONFIG_NAME).write_text(json.dumps(content, indent=2) + "\n")
    copied = []
    wanted = {f.name for f in tokenizer_files(request.files)} | set(_MODEL_FILES)
    for f in request.files:
        if Path(f).name in wanted and not (out / Path(f).name).exists():
            shutil.copy2(f, out / Path(f).name)
            copied.append(Path(f).name)
    if "config.json" not in copied and hasattr(request.model, "config"):
        request.model.config.to_json_file(out / "config.json")
        copied.append("config.json")
    extra: dict[str, Any] = {}
    warning = tokenizer_warning(out / "tokenizer.json")
    if warning is not None:
        logger.warning("%s", warning)
        extra["tokenizer_warning"] = warning
    return {
        "genai": {
            "model_type": content["model"]["type"],
            "transformers_model_type": getattr(text, "model_type", None),
            "context_length": content["model"]["context_length"],
            "context_length_from": context_source,
            "past_present_share_buffer": share_buffer,
            "num_layers": graph.num_layers,
            "num_key_value_heads": graph.num_kv_heads,
            "head_size": graph.head_dim,
            "inputs": list(graph.input_names),
            "outputs": list(graph.output_names),
            "files": [p.name for p in graph.files] + [CONFIG_NAME] + copied,
            **extra,
        }
    }


LAYOUT = register_layout(
    Layout(
        name="genai",
        export_format="onnx",
        tasks=("text-generation",),
        runtime="onnxruntime-genai",
        description="one decoder graph + genai_config.json + tokenizer: onnxruntime_genai.Model(folder) runs it",
        writer="hfexport_onnx.layouts.genai:write_genai",
        needs_tokenizer=True,
        check="hfexport_onnx.layouts.genai:check_genai",
        check_config="hfexport_onnx.layouts.genai:check_genai_config",
    )
)
