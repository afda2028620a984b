"""The ``transformers.js`` layout: a folder that ``@huggingface/transformers`` (npm) loads as it is.

``hfexport export onnx --layout transformers.js --model FOLDER OUT`` writes::

    OUT/config.json              the model's config + "transformers.js_config" (dtype, external data)
    OUT/tokenizer.json           the fast tokenizer (transformers.js has no tokenizer converter)
    OUT/tokenizer_config.json    (+ special_tokens_map.json, chat template ... when the model has them)
    OUT/generation_config.json   text-generation, when the model has one
    OUT/onnx/model.onnx          the graph (fp32)
    OUT/onnx/model.onnx_data     its weights, when saved as external data (the default)

and ``pipeline(task, "OUT", {local_files_only: true})`` runs it under Node (onnxruntime-node) or
in a browser (onnxruntime-web). What the loader expects (transformers.js 4.x sources,
``src/models/session.js``, ``src/utils/model-loader.js``, ``src/configs.js``,
``src/models/modeling_utils.js``):

* the graph is ``<subfolder>/<name><dtype suffix>.onnx`` with subfolder ``onnx``, name ``model``
  and suffix ``""`` for ``dtype: "fp32"`` (``src/utils/dtypes.js``, ``DEFAULT_DTYPE_SUFFIX_MAPPING``:
  ``_fp16`` for fp16, ``_q4`` for q4, ``_q4f16`` for q4f16 ...); the dtype comes from the ``dtype``
  option or ``config["transformers.js_config"]["dtype"]``, else the device's default (fp32 in Node,
  q8, i.e. ``model_quantized.onnx``, in the browser's wasm backend): we write the dtype of the file
  we wrote (:data:`DTYPES`, :data:`QUANTIZED_DTYPES`) so every device picks it;
* ``q4`` / ``q4f16`` are transformers.js's names for 4-bit block-quantized ``MatMulNBits`` weights
  with float32 / float16 activations: ``--quantize int4-weight`` writes ``onnx/model_q4.onnx``, and
  with ``--dtype float16`` ``onnx/model_q4f16.onnx`` (float16 inputs, outputs, KV cache and
  remaining weights; ``MatMulNBits`` with float16 scales, which ONNX Runtime's CPU provider runs
  by converting the activations to float32 around its float32 kernel). Other quantization methods
  have no transformers.js dtype this layout writes and are refused before loading
  (:func:`check_transformers_js_config`);
* external data is read only when ``transformers.js_config.use_external_data_format`` is set;
  chunk ``k`` of ``model.onnx`` is ``model.onnx_data`` (``k = 0``), ``model.onnx_data_k`` after;
* the model class comes from ``config.json``'s ``model_type`` (``bert``, ``llama`` ...), the
  tokenizer from ``tokenizer.json`` + ``tokenizer_config.json`` (both required);
* encoder tasks feed ``input_ids``, ``attention_mask`` and ``token_type_ids`` (zeros when the
  tokenizer gives none) and read ``last_hidden_state`` (feature-extraction), ``logits``
  (fill-mask, text-classification, token-classification) or ``start_logits``/``end_logits``
  (question-answering): our leaf-path I/O names (:mod:`hfexport_onnx.io_names`) are these names;
* text-generation drives ONE decoder graph (``onnx/model.onnx``) with inputs ``input_ids``,
  ``attention_mask``, ``position_ids`` (when present, computed from the mask),
  ``past_key_values.{i}.key/value`` and outputs ``logits``, ``present.{i}.key/value``
  (:mod:`hfexport_onnx.decoder_graph`). The first step feeds an empty past whose shape it reads
  from the graph's input metadata: a symbolic axis named ``batch_size`` becomes the batch size,
  every other symbolic axis 0, so heads and head size must be static and the batch axis must be
  named ``batch_size``; the writer checks this.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hfexport.errors import UnsupportedModelError
from hfexport.layouts import Layout, LayoutRequest, register_layout, tokenizer_files

__all__ = [
    "LAYOUT",
    "ONNX_SUBFOLDER",
    "QUANTIZED_DTYPES",
    "TASK_OUTPUTS",
    "check_transformers_js",
    "check_transformers_js_config",
    "transformers_js_dtype",
    "write_transformers_js",
]

logger = logging.getLogger(__name__)

#: Folder of the graphs inside the layout (transformers.js's default ``subfolder``).
ONNX_SUBFOLDER = "onnx"
#: Graph base name (transformers.js's default ``model_file_name`` for single-session models).
MODEL_NAME = "model"
#: torch dtype name -> (transformers.js dtype, file suffix); transformers.js's
#: ``DEFAULT_DTYPE_SUFFIX_MAPPING`` for the float types we can write.
DTYPES: Mapping[str, tuple[str, str]] = {"float32": ("fp32", ""), "float16": ("fp16", "_fp16")}
#: quantization method -> {graph float type (torch name) -> (transformers.js dtype, file suffix)}:
#: ``int4-weight`` (``MatMulNBits``, 4-bit blocks) is transformers.js's q4 in a float32 graph and
#: q4f16 in a float16 one.
QUANTIZED_DTYPES: Mapping[str, Mapping[str, tuple[str, str]]] = {
    "int4-weight": {"float32": ("q4", "_q4"), "float16": ("q4f16", "_q4f16")},
}
#: Task -> the graph outputs its transformers.js pipeline reads (any one of each tuple).
TASK_OUTPUTS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "feature-extraction": (("last_hidden_state", "logits", "token_embeddings"),),
    "fill-mask": (("logits",),),
    "text-classification": (("logits",),),
    "token-classification": (("logits",),),
    "question-answering": (("start_logits",), ("end_logits",)),
    "text-generation": (("logits",),),
}
#: Graph inputs transformers.js can feed to an encoder (from its tokenizer, or zeros).
ENCODER_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
#: The symbolic batch axis name transformers.js resolves when it builds the empty past.
BATCH_AXIS = "batch_size"
#: Tokenizer files transformers.js reads (both required).
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _model_dtype(model: Any) -> str:
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return str(param.dtype).removeprefix("torch.") if param is not None else "float32"


def check_transformers_js_config(config: Any) -> str | None:
    """Why an export with ``config`` cannot be written in the transformers.js layout, or ``None``.

    Refused: a ``config.quantization`` method with no transformers.js dtype (anything but
    ``int4-weight``, see :data:`QUANTIZED_DTYPES`). The dtype / method pairs themselves are the
    backend's to check (:meth:`hfexport_onnx.exporter.OnnxExporter.check_precision`).
    """
    quantization = getattr(config, "quantization", None)
    if quantization is None or quantization.method in QUANTIZED_DTYPES:
        return None
    return (
        f"--quantize {quantization.method} has no transformers.js dtype; this layout writes fp32 and fp16 "
        "(no --quantize; --dtype float16), q4 (--quantize int4-weight) and q4f16 (--dtype float16 "
        "--quantize int4-weight)"
    )


def transformers_js_dtype(graph_dtype: str, method: str | None) -> tuple[str, str]:
    """The transformers.js dtype and graph file suffix of a graph computing in ``graph_dtype``
    (``"float32"`` / ``"float16"``) quantized with ``method`` (``None``: not quantized).

    Returns:
        ``(dtype, suffix)``, e.g. ``("q4f16", "_q4f16")`` for ``("float16", "int4-weight")``.

    Raises:
        hfexport.errors.UnsupportedModelError: a pair transformers.js has no file name for.
    """
    table = DTYPES if method is None else QUANTIZED_DTYPES.get(method, {})
    found = table.get(graph_dtype)
    if found is None:
        pairs = [(d, None, js) for d, (js, _) in DTYPES.items()]
        pairs += [(d, m, js) for m, table in QUANTIZED_DTYPES.items() for d, (js, _) in table.items()]
        allowed = ", ".join(f"{js} ({d}{' + ' + m if m else ''})" for d, m, js in pairs)
        raise UnsupportedModelError(
            f"transformers.js has no file for a {graph_dtype} graph"
            + (f" quantized with {method}" if method else "")
            + f"; the transformers.js layout writes: {allowed}"
        )
    return found


def check_transformers_js(model: Any, task: str) -> str | None:
    """Why ``model`` cannot be written in the transformers.js layout for ``task``, or ``None``.

    Refused: weights in a dtype transformers.js has no plain file for (bfloat16 ...); for
    text-generation, a model whose cache is not plain growing attention layers (encoder-decoders,
    sliding-window / state-space caches: :func:`hfexport_onnx.decoder_graph.decoder_cache_refusal`).
    """
    if model is None:
        return None
    dtype = _model_dtype(model)
    if dtype not in DTYPES:
        return (
            f"transformers.js loads float32 or float16 graphs (onnx/model.onnx, onnx/model_fp16.onnx), "
            f"the model's weights are {dtype}"
        )
    if task == "text-generation":
        try:
            from hfexport_onnx.decoder_graph import decoder_cache_refusal
        except ImportError:  # pragma: no cover - a build without the decoder graph module
            return "this hfexport-onnx has no decoder graph export (hfexport_onnx.decoder_graph)"
        reason = decoder_cache_refusal(model)
        if reason is not None:
            return f"transformers.js's text-generation needs one decoder graph with past/present tensors: {reason}"
    return None


def _copy_tokenizer(files: Sequence[Path], dest: Path) -> list[str]:
    """Copy the tokenizer files; convert to ``tokenizer.json`` when only slow-tokenizer files exist."""
    found = tokenizer_files(files)
    names = {f.name for f in found}
    if all(n in names for n in REQUIRED_TOKENIZER_FILES):
        for f in found:
            shutil.copy2(f, dest / f.name)
        return sorted(names)
    # a vocab.txt / sentencepiece folder without tokenizer.json: transformers converts it to the
    # fast tokenizer, whose save writes both files transformers.js reads
    source = found[0].parent if found else None
    error = None
    with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=dest) as tmp:
        converted = Path(tmp)
        if source is not None:
            try:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(converted))
            except Exception as exc:  # a tokenizer transformers cannot load or convert
                error = f"{type(exc).__name__}: {exc}"
        complete = all((converted / n).is_file() for n in REQUIRED_TOKENIZER_FILES)
        vocab = next((f for f in found if f.name == "vocab.txt"), None)
        if complete and vocab is not None:
            # transformers 5 may "convert" a vocab.txt it does not understand into a tokenizer of a
            # handful of tokens (the rxnmapper ALBERT folder: 591 entries -> 5): refuse, do not ship it
            entries = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line.strip())
            size = _tokenizer_size(converted / "tokenizer.json")
            if size < entries:
                complete = False
                error = (
                    f"the conversion gave a tokenizer of {size} tokens for the {entries} entries of vocab.txt "
                    "(transformers' AutoTokenizer does not understand this folder)"
                )
        if not complete:
            raise ValueError(
                "layout 'transformers.js' needs the tokenizer as transformers.js reads it: add "
                + " and ".join(REQUIRED_TOKENIZER_FILES)
                + " to the model folder (tokenizer.save_pretrained(model_folder) with a fast tokenizer)"
                + (f"; converting the folder's {', '.join(sorted(names))} failed: {error}" if error else "")
            )
        written = sorted(p.name for p in converted.iterdir() if p.is_file())
        for name in written:
            shutil.move(str(converted / name), dest / name)
    return written


def _tokenizer_size(path: Path) -> int:
    """Number of tokens of a ``tokenizer.json`` (model vocabulary plus added tokens)."""
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))


def _config_dict(request: LayoutRequest) -> dict[str, Any]:
    for f in request.files:
        if Path(f).name == "config.json":
            return json.loads(Path(f).read_text())
    config = getattr(request.model, "config", None)
    if config is None:
        raise UnsupportedModelError("the transformers.js layout needs the model's config (config.json)")
    return config.to_dict()


def _check_outputs(task: str, outputs: Sequence[str]) -> None:
    for options in TASK_OUTPUTS.get(task, ()):
        if not any(o in outputs for o in options):
            raise UnsupportedModelError(
                f"transformers.js's {task} pipeline reads the graph output {' or '.join(options)}, the "
                f"exported graph has {', '.join(outputs)}"
            )


def _batch_axis_checked(model: Any, num_layers: int) -> None:
    """The past inputs must have a ``batch_size`` batch axis and static heads / head size."""
    import onnx_ir as ir

    by_name = {v.name: v for v in model.graph.inputs}
    for i in range(num_layers):
        for kind in ("key", "value"):
            value = by_name.get(f"past_key_values.{i}.{kind}")
            shape = None if value is None else value.shape
            if shape is None or len(shape) != 4:
                raise RuntimeError(f"the decoder graph has no 4-d input past_key_values.{i}.{kind}")
            batch = shape[0]
            if isinstance(batch, ir.SymbolicDim) and batch.value != BATCH_AXIS:
                raise RuntimeError(
                    f"past_key_values.{i}.{kind} has batch axis {batch.value!r}; transformers.js builds the "
                    f"empty past only from an axis named {BATCH_AXIS!r}"
                )
            if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
                raise RuntimeError(
                    f"past_key_values.{i}.{kind} has shape {shape}; transformers.js needs static heads and head size"
                )


def _save(onnx_model: Any, path: Path, *, external: bool) -> list[Path]:
    """Save ``onnx_model`` (``onnx_ir.Model``) to ``path``, weights in ``<name>_data`` when ``external``."""
    import onnx_ir as ir

    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        data = path.with_name(path.name + "_data")
        ir.save(onnx_model, path, external_data=data.name)
        return [path, data]
    ir.save(onnx_model, path)
    return [path]


def write_transformers_js(request: LayoutRequest) -> dict[str, Any]:
    """Write the transformers.js folder for ``request.task`` into ``request.output_dir``.

    Args:
        request: the :class:`hfexport.layouts.LayoutRequest` (model in eval mode, sample inputs,
            the backend's :class:`hfexport.config.OnnxConfig`, model-folder files).

    Returns:
        Report fields: ``files`` (paths relative to the folder), ``onnx_file``,
        ``transformers_js_dtype``, ``external_data``, ``onnx_inputs``, ``onnx_outputs``.

    Raises:
        ValueError: the tokenizer files are missing and cannot be converted (says which to add).
        hfexport.errors.UnsupportedModelError: a dtype or quantization transformers.js has no file
            name for, a model without config, a graph lacking the outputs the task's pipeline reads.
        hfexport.errors.ExportStageError / ExportValidationError: the ONNX export failed or differs
            from eager PyTorch.
    """
    out = Path(request.output_dir)
    reason = check_transformers_js_config(request.config) or check_transformers_js(
        request.model, request.task
    )
    if reason is not None:
        raise UnsupportedModelError(reason)
    tokenizer = _copy_tokenizer(request.files, out)  # before the export: a missing tokenizer fails fast

    from hfexport_onnx.runtime import PROTOBUF_LIMIT_BYTES, initializer_bytes

    if request.task == "text-generation":
        from hfexport_onnx.decoder_graph import export_decoder_with_past

        graph = export_decoder_with_past(
            request.model, request.inputs, request.config, None, exporter=request.exporter
        )
        onnx_model = graph.artifact.model
        _batch_axis_checked(onnx_model, graph.num_layers)
    else:
        artifact = request.exporter.export(request.model, dict(request.inputs), request.config)
        onnx_model = artifact.model
        unknown = [v.name for v in onnx_model.graph.inputs if v.name not in ENCODER_INPUTS]
        if unknown:
            raise UnsupportedModelError(
                f"the graph takes {', '.join(unknown)}, which transformers.js's {request.task} pipeline does not "
                f"feed (it feeds {', '.join(sorted(ENCODER_INPUTS))})"
            )
    inputs = [v.name for v in onnx_model.graph.inputs]
    outputs = [v.name for v in onnx_model.graph.outputs]
    _check_outputs(request.task, outputs)
    # the file name and "dtype" follow the graph's float type (config.dtype casts at capture,
    # the eager model stays float32) and the quantization: transformers.js picks model.onnx for
    # fp32, model_fp16.onnx for fp16, model_q4.onnx for q4, model_q4f16.onnx for q4f16
    graph_dtype = str(getattr(onnx_model.graph.outputs[0].dtype, "name", "")).lower()
    torch_dtype = {"float": "float32", "float16": "float16"}.get(graph_dtype)
    if torch_dtype is None:
        raise UnsupportedModelError(
            f"the graph's {outputs[0]} is {graph_dtype or 'untyped'}; the transformers.js layout writes float32 or "
            "float16 graphs (onnx/model.onnx, onnx/model_fp16.onnx)"
        )
    quantization = getattr(request.config, "quantization", None)
    js_dtype, suffix = transformers_js_dtype(torch_dtype, quantization.method if quantization else None)

    external = bool(getattr(request.config, "external_data", True)) or (
        initializer_bytes(onnx_model) >= PROTOBUF_LIMIT_BYTES
    )
    graph_path = out / ONNX_SUBFOLDER / f"{MODEL_NAME}{suffix}.onnx"
    written = _save(onnx_model, graph_path, external=external)

    config = _config_dict(request)
    js_config = dict(config.get("transformers.js_config") or {})
    js_config["dtype"] = js_dtype
    if external:
        js_config["use_external_data_format"] = True
    else:
        js_config.pop("use_external_data_format", None)
    config["transformers.js_config"] = js_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    extra = []
    for f in request.files:
        if Path(f).name == "generation_config.json":
            shutil.copy2(f, out / "generation_config.json")
            extra.append("generation_config.json")
    files = sorted(["config.json", *tokenizer, *extra, *(p.relative_to(out).as_posix() for p in written)])
    return {
        "files": files,
        "onnx_file": graph_path.relative_to(out).as_posix(),
        "transformers_js_dtype": js_dtype,
        "external_data": external,
        "onnx_inputs": inputs,
        "onnx_outputs": outputs,
    }


#: The registered layout (``hfexport export onnx --layout transformers.js``).
LAYOUT = register_layout(
    Layout(
        name="transformers.js",
        export_format="onnx",
        tasks=tuple(TASK_OUTPUTS),
        runtime="transformers.js (@huggingface/transformers, npm)",
        description="onnx/model.onnx + config.json + tokenizer files that transformers.js's pipeline() loads",
        writer="hfexport_onnx.layouts.transformers_js:write_transformers_js",
        needs_tokenizer=True,
        check="hfexport_onnx.layouts.transformers_js:check_transformers_js",
        check_config="hfexport_onnx.layouts.transformers_js:check_transformers_js_config",
    )
)
