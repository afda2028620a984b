"""One decoder-only causal-LM graph with the conventional KV-cache I/O names, for runtimes' own loaders.

ONNX Runtime GenAI's ``Model(folder)``, transformers.js's text-generation pipeline and most
hand-written ONNX generation loops drive a single decoder graph with these names:

========================  ======  ==========================================  =============
name                      kind    shape                                       dtype
========================  ======  ==========================================  =============
``input_ids``             input   ``[batch, sequence]``                       int64
``attention_mask``        input   ``[batch, past_sequence + sequence]``       int64
``position_ids``          input   ``[batch, sequence]`` (when the model's     int64
                                  forward takes them)
``past_key_values.{i}.key``  input  ``[batch, kv_heads, past_sequence, head_dim]``  model dtype
``past_key_values.{i}.value`` input (same)                                  model dtype
``logits``                output  ``[batch, sequence, vocab]``                model dtype
``present.{i}.key``       output  ``[batch, kv_heads, past_sequence + sequence, head_dim]``  model dtype
``present.{i}.value``     output  (same)                                      model dtype
========================  ======  ==========================================  =============

``batch``, ``sequence`` and ``past_sequence`` are dynamic; the first step of a generation feeds
an empty past (``past_sequence = 0``) and the whole prompt, the next steps one token and the
previous step's ``present`` as ``past_key_values``.

:func:`export_decoder_with_past` builds the graph with the backend's normal export
(:meth:`hfexport_onnx.OnnxExporter.export`: patches, capture, fixes, translation, leaf-path I/O
names, optimizer, validation against eager PyTorch): the model is wrapped in
:class:`DecoderWithPast`, a module whose forward takes the flat tensors above (the past as
``past_key_values=[{"key": k, "value": v}, ...]``, which the leaf-path naming rule of
:mod:`hfexport_onnx.io_names` turns into ``past_key_values.0.key``) and builds the model's
``DynamicCache`` around them. The graph is then validated again at the two shapes a generation
loop uses (prefill on an empty past, one-token decode step on a non-empty past) and saved.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import UnsupportedModelError

__all__ = [
    "PAST_KEY_TEMPLATE",
    "PAST_VALUE_TEMPLATE",
    "PRESENT_KEY_TEMPLATE",
    "PRESENT_VALUE_TEMPLATE",
    "DecoderGraph",
    "DecoderWithPast",
    "decoder_cache_refusal",
    "export_decoder_with_past",
]

logger = logging.getLogger(__name__)

#: Graph input name of layer ``i``'s past keys (``%`` template, as ONNX Runtime GenAI writes it).
PAST_KEY_TEMPLATE = "past_key_values.%d.key"
#: Graph input name of layer ``i``'s past values.
PAST_VALUE_TEMPLATE = "past_key_values.%d.value"
#: Graph output name of layer ``i``'s keys after the step (past + new tokens).
PRESENT_KEY_TEMPLATE = "present.%d.key"
#: Graph output name of layer ``i``'s values after the step.
PRESENT_VALUE_TEMPLATE = "present.%d.value"

# sample sizes of the trace: distinct and >= 2, so no axis is specialised or unified with another
_TRACE_BATCH, _TRACE_SEQUENCE, _TRACE_PAST = 2, 3, 5


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward kwarg taking the KV cache (``cache`` in transformers 5.x, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__}.forward takes neither 'cache' nor 'past_key_values': it has no KV cache "
        "to export as past/present tensors"
    )


def _takes(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def decoder_cache_refusal(model: Any) -> str | None:
    """Why ``model`` cannot be exported as a decoder graph with past/present tensors, or ``None``.

    Fits: a decoder-only causal LM (not an encoder-decoder) whose ``DynamicCache`` is made of plain
    growing attention layers (``[batch, kv_heads, past, head_dim]`` keys and values per layer).
    Refused: encoder-decoders, models without a cache argument, and caches with sliding-window,
    linear-attention / state-space or otherwise non-growing layers (their state is not the
    ``past + sequence`` keys and values the conventional names describe).
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        return "the model has no transformers config"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; the decoder graph needs a decoder-only causal LM"
    try:
        _cache_kwarg(model)
    except UnsupportedModelError as exc:
        return str(exc)
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache(config=config)
    except Exception as exc:  # a config transformers cannot build a cache for
        return f"cannot build a DynamicCache for {type(model).__name__}: {type(exc).__name__}: {exc}"
    layers = list(getattr(cache, "layers", []))
    if not layers:
        return None  # lazily grown plain layers (no layer types in the config)
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd:
        return (
            f"{type(model).__name__}'s cache has {', '.join(odd)} layers (sliding-window, linear-attention or "
            "state-space state), not only plain growing attention layers [batch, kv_heads, past, head_dim]"
        )
    return None


class DecoderWithPast(torch.nn.Module):
    """A causal LM taking and returning its KV cache as flat tensors.

    Args:
        model: a decoder-only ``PreTrainedModel`` for causal LM (``logits`` output, ``DynamicCache``).
        num_layers: number of cache layers (the length of ``past_key_values``).

    ``forward(input_ids, attention_mask, position_ids=None, past_key_values=())``:

    * ``input_ids`` int64 ``[batch, sequence]``; ``attention_mask`` int64 ``[batch, past + sequence]``;
      ``position_ids`` int64 ``[batch, sequence]`` (only passed on when the model takes them);
    * ``past_key_values``: ``num_layers`` dicts ``{"key": k, "value": v}``, each
      ``[batch, kv_heads, past, head_dim]`` (``past`` may be 0);

    returns ``{"logits": [batch, sequence, vocab], "present": [{"key": ..., "value": ...}, ...]}``
    with present tensors of ``past + sequence`` positions.
    """

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = int(num_layers)
        self._cache_kwarg = _cache_kwarg(model)
        self._position_ids = _takes(model, "position_ids")

    @property
    def config(self) -> Any:
        return getattr(self.model, "config", None)

    def _cache(self, past_key_values: Any) -> Any:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if not getattr(cache, "layers", None) or len(cache.layers) != len(past_key_values):
            from transformers.cache_utils import DynamicLayer

            cache.layers = [DynamicLayer() for _ in past_key_values]
        for layer, entry in zip(cache.layers, past_key_values):
            key, value = entry["key"], entry["value"]
            # the layer holds the given tensors as they are (also with 0 positions), as a layer
            # filled by earlier steps would
            layer.keys, layer.values = key, value
            layer.device = key.device
            layer.dtype = key.dtype
            layer.is_initialized = True
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = (),
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            self._cache_kwarg: self._cache(past_key_values),
            "use_cache": True,
            "return_dict": True,
        }
        if self._position_ids and position_ids is not None:
            kwargs["position_ids"] = position_ids
        out = self.model(**kwargs)
        cache = out[self._cache_kwarg] if self._cache_kwarg in out else out.get("past_key_values")
        present = [{"key": layer.keys, "value": layer.values} for layer in cache.layers]
        return {"logits": out["logits"], "present": present}


@dataclasses.dataclass(frozen=True)
class DecoderGraph:
    """What :func:`export_decoder_with_past` wrote.

    Attributes:
        path: the ``.onnx`` file.
        files: every file written (the graph, its external data if any), in write order.
        input_names / output_names: graph input and output names, in graph order.
        num_layers: number of KV-cache layers.
        num_kv_heads: key/value heads per layer (axis 1 of the past/present tensors).
        head_dim: size of one head (axis 3).
        takes_position_ids: whether the graph has a ``position_ids`` input.
        dtype: dtype of logits and cache tensors (``"float32"`` ...).
        report: the :class:`hfexport.report.ExportReport` of the export, with the extra
            validations ``prefill_empty_past`` and ``decode_step`` in ``report.validation``.
        artifact: the in-memory ``torch.onnx.ONNXProgram``.
    """

    path: Path
    files: tuple[Path, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    takes_position_ids: bool
    dtype: str
    report: Any
    artifact: Any = dataclasses.field(repr=False, default=None)

    past_key_template: str = PAST_KEY_TEMPLATE
    past_value_template: str = PAST_VALUE_TEMPLATE
    present_key_template: str = PRESENT_KEY_TEMPLATE
    present_value_template: str = PRESENT_VALUE_TEMPLATE


def _token_range(sample_inputs: Mapping[str, Any], model: torch.nn.Module) -> tuple[int, int]:
    ids = sample_inputs.get("input_ids")
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if isinstance(ids, torch.Tensor) and ids.numel():
        return int(ids.min()), int(ids.max()) + 1
    return 0, max(vocab, 2)


def _step_inputs(
    past_cache: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    batch: int,
    sequence: int,
    past: int,
    takes_position_ids: bool,
    token_range: tuple[int, int],
    seed: int,
) -> dict[str, Any]:
    """Wrapper kwargs for one step: ``sequence`` new tokens after ``past`` cached ones."""
    gen = torch.Generator().manual_seed(seed)
    low, high = token_range
    inputs: dict[str, Any] = {
        "input_ids": torch.randint(low, max(high, low + 1), (batch, sequence), generator=gen),
        "attention_mask": torch.ones(batch, past + sequence, dtype=torch.long),
    }
    if takes_position_ids:
        inputs["position_ids"] = (
            torch.arange(past, past + sequence, dtype=torch.long).expand(batch, sequence).clone()
        )
    inputs["past_key_values"] = [
        {"key": k[:batch, :, :past].contiguous(), "value": v[:batch, :, :past].contiguous()}
        for k, v in past_cache
    ]
    return inputs


def _text_plan(
    model: torch.nn.Module, past_cache: list[tuple[torch.Tensor, torch.Tensor]], takes_position_ids: bool
) -> tuple[Any, dict[str, Any]]:
    """How the quality text is fed to the decoder graph (:meth:`HfExporter.text_reference`):
    prefills of up to :data:`hfexport.quality.TEXT_CHUNK_TOKENS` (512, as ``hfexport bench``
    cuts the text) or the model's position limit on an empty past, batch 1."""
    from hfexport.quality import TEXT_CHUNK_TOKENS, position_limit

    def make_inputs(chunk: torch.Tensor) -> dict[str, Any]:
        length = int(chunk.shape[1])
        inputs: dict[str, Any] = {
            "input_ids": chunk.to(torch.long),
            "attention_mask": torch.ones(1, length, dtype=torch.long),
        }
        if takes_position_ids:
            inputs["position_ids"] = torch.arange(length, dtype=torch.long)[None]
        inputs["past_key_values"] = [
            {"key": k[:1, :, :0].contiguous(), "value": v[:1, :, :0].contiguous()} for k, v in past_cache
        ]
        return inputs

    limit = min(position_limit(model) or TEXT_CHUNK_TOKENS, TEXT_CHUNK_TOKENS)
    return make_inputs, {"max_length": limit, "exact": False, "batch": 1}


def _eager_past(
    model: torch.nn.Module, length: int, batch: int, token_range: tuple[int, int], takes_position_ids: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Real cache tensors: the eager model run on ``length`` seeded tokens, ``[batch, kv_heads, length, head_dim]``."""
    gen = torch.Generator().manual_seed(1234)
    low, high = token_range
    ids = torch.randint(low, max(high, low + 1), (batch, length), generator=gen)
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "use_cache": True,
        "return_dict": True,
    }
    if takes_position_ids:
        kwargs["position_ids"] = torch.arange(length).expand(batch, length).clone()
    with torch.no_grad():
        out = model(**kwargs)
    cache = out.get("cache", None) if "cache" in out else out.get("past_key_values")
    if cache is None or not getattr(cache, "layers", None):
        raise UnsupportedModelError(
            f"{type(model).__name__} returned no KV cache with use_cache=True; a decoder graph with past/present "
            "tensors needs one"
        )
    pairs = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[-2] != length:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s cache layer {i} ({type(layer).__name__}) does not hold "
                f"[batch, kv_heads, {length}, head_dim] keys after {length} tokens; the decoder graph needs plain "
                "growing attention layers"
            )
        pairs.append((keys.detach().clone(), values.detach().clone()))
    return pairs


def _name_cache_axes(artifact: Any, report: Any) -> None:
    """Name the past and total sequence axes (``Dim.AUTO`` / nested inputs get ``s<N>`` symbols)."""
    import onnx_ir as ir

    by_name = {v.name: v for v in artifact.model.graph.inputs}
    wanted = {
        "past_key_values.0.key": (2, "past_sequence_length"),
        "attention_mask": (1, "total_sequence_length"),
    }
    mapping: dict[str, str] = {}
    for name, (axis, new) in wanted.items():
        value = by_name.get(name)
        if value is None or value.shape is None or axis >= len(value.shape):
            continue
        dim = value.shape[axis]
        if isinstance(dim, ir.SymbolicDim) and dim.value and dim.value != new and dim.value.isidentifier():
            mapping[dim.value] = new
    if mapping:
        artifact.rename_axes(mapping)
        report.extra.setdefault("onnx_axis_names", {}).update(mapping)


def export_decoder_with_past(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any] | None,
    config: Any = None,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    file_name: str = "model.onnx",
    exporter: Any = None,
    external_data: bool | None = None,
) -> DecoderGraph:
    """Export ``model`` as ONE decoder graph with ``past_key_values.{i}.key/value`` in and ``present.{i}.key/value`` out.

    Args:
        model: a decoder-only causal LM (``PreTrainedModel``, eval mode) whose cache is a
            ``DynamicCache`` of plain attention layers (see :func:`decoder_cache_refusal`).
        sample_inputs: a prompt as ``generate`` takes it (``input_ids`` int64 ``[batch, seq]`` ...),
            used only for the range of token ids of the trace and validation inputs; ``None``:
            ids drawn from the whole vocabulary.
        config: an :class:`hfexport.config.OnnxConfig` (or dict, or ``None`` for the defaults):
            ``opset_version``, ``optimize``, ``atol``/``rtol``, ``validate``, ``dtype`` ... apply;
            ``dynamic``/``dynamic_shapes`` are set here (batch, sequence, past are dynamic) and
            ``output_path`` is ignored.
        output_dir: folder to write ``file_name`` (and ``file_name + ".data"`` with external data)
            into, created if missing; ``None`` writes nothing (``DecoderGraph.path`` is then the
            path it would have).
        file_name: the graph's file name.
        exporter: an :class:`hfexport_onnx.OnnxExporter` to export with (its ``stage_callback``
            reports progress); default: a new one.
        external_data: store the weights in ``<file_name>.data``; ``None`` (default) only when they
            exceed the 2 GiB protobuf limit.

    Returns:
        A :class:`DecoderGraph` (names, cache geometry, report). Inputs: ``input_ids`` int64
        ``[batch, sequence]``, ``attention_mask`` int64 ``[batch, past_sequence + sequence]``,
        ``position_ids`` int64 ``[batch, sequence]`` (when the model's forward takes them),
        ``past_key_values.{i}.key`` / ``.value`` ``[batch, kv_heads, past_sequence, head_dim]``;
        outputs ``logits`` ``[batch, sequence, vocab]``, ``present.{i}.key`` / ``.value``
        ``[batch, kv_heads, past_sequence + sequence, head_dim]`` (float tensors in the model's dtype).

    Raises:
        hfexport.errors.UnsupportedModelError: an encoder-decoder, a model without a KV cache, or
            a cache that is not made of plain growing attention layers (the message says why).
        hfexport.errors.ExportStageError: a stage of the ONNX export failed.
        hfexport.errors.ExportValidationError: the graph differs from eager PyTorch at the trace
            shape, on a prefill with an empty past, or on a one-token decode step.

    The model is left as it was. Saving is atomic (:meth:`OnnxExporter.save`): the graph file
    appears only once complete, after its weights.
    """
    from hfexport.config import OnnxConfig
    from hfexport.inputs import attention_for_export, restore_model_state
    from hfexport.report import Stage
    from hfexport_onnx.exporter import OnnxExporter

    reason = decoder_cache_refusal(model)
    if reason is not None:
        raise UnsupportedModelError(f"cannot export a decoder graph with past/present tensors: {reason}")
    exporter = exporter if exporter is not None else OnnxExporter()
    if config is None:
        config = exporter.config if isinstance(exporter.config, OnnxConfig) else OnnxConfig()
    config = exporter._resolve_config(config)
    exporter.check_precision(config)  # an unsupported dtype is refused before the eager run
    sample_inputs = dict(sample_inputs or {})
    takes_position_ids = _takes(model, "position_ids")
    token_range = _token_range(sample_inputs, model)

    with restore_model_state(model), attention_for_export(model):
        model.eval()
        past_cache = _eager_past(model, _TRACE_PAST + 2, _TRACE_BATCH, token_range, takes_position_ids)
    num_layers = len(past_cache)
    _, num_kv_heads, _, head_dim = past_cache[0][0].shape
    wrapper = DecoderWithPast(model, num_layers)
    trace = _step_inputs(
        past_cache,
        batch=_TRACE_BATCH,
        sequence=_TRACE_SEQUENCE,
        past=_TRACE_PAST,
        takes_position_ids=takes_position_ids,
        token_range=token_range,
        seed=0,
    )

    from torch.export import Dim

    batch = Dim("batch_size")
    sequence = Dim("sequence_length")
    past = Dim("past_sequence_length")
    dynamic_shapes: dict[str, Any] = {
        "input_ids": {0: batch, 1: sequence},
        "attention_mask": {0: batch, 1: Dim.AUTO},  # past + sequence: derived, not a Dim of its own
    }
    if takes_position_ids:
        dynamic_shapes["position_ids"] = {0: batch, 1: sequence}
    dynamic_shapes["past_key_values"] = [
        {"key": {0: batch, 2: past}, "value": {0: batch, 2: past}}
    ] * num_layers
    # None: weights inside the file unless they exceed the protobuf limit (the exporter forces
    # external data then)
    use_external = None if external_data is None else bool(external_data)
    resolved = config.replace(
        dynamic=True,
        dynamic_shapes=dynamic_shapes,
        validate_second_shape=False,
        output_path=None,
        external_data=bool(use_external),
    )
    # a quantized graph is also scored on real text, teacher-forced in prefills on an empty past
    # (hfexport.quality.text_quality), right after the sample check in HfExporter.validate: the
    # reference stage reads the plan and the tokenizer's model from these attributes
    wrapper.hfexport_text_plan = _text_plan(model, past_cache, takes_position_ids)
    wrapper.hfexport_text_source = model
    artifact = exporter.export(wrapper, trace, resolved, component="decoder")
    report = exporter.last_report
    _name_cache_axes(artifact, report)

    if getattr(resolved, "validate", True):
        run = exporter.runner(artifact)
        cases = {
            "prefill_empty_past": dict(batch=1, sequence=4, past=0, seed=1),
            "decode_step": dict(batch=1, sequence=1, past=_TRACE_PAST + 1, seed=2),
        }
        with restore_model_state(model), attention_for_export(model), torch.no_grad():
            model.eval()
            for label, shape in cases.items():
                inputs = _step_inputs(
                    past_cache,
                    takes_position_ids=takes_position_ids,
                    token_range=token_range,
                    **shape,
                )
                with report.stage(f"{Stage.VALIDATE}_{label}"):
                    # fp32 eager reference; with a reduced config.dtype the graph gets the float
                    # inputs (the past keys/values) cast to it and is scored by the quality gates
                    report.validation[label] = exporter.check_outputs(
                        wrapper, run, inputs, resolved, report=report, label=label.replace("_", " ")
                    )
        del run  # the session and its weights go before the save serializes the graph
        from hfexport.memory import release_freed_memory

        release_freed_memory()

    graph = artifact.model.graph
    input_names = tuple(v.name for v in graph.inputs if v.name not in graph.initializers)
    output_names = tuple(v.name for v in graph.outputs)
    expected_in = ["input_ids", "attention_mask"] + (["position_ids"] if takes_position_ids else [])
    expected_in += [t % i for i in range(num_layers) for t in (PAST_KEY_TEMPLATE, PAST_VALUE_TEMPLATE)]
    expected_out = ["logits"] + [
        t % i for i in range(num_layers) for t in (PRESENT_KEY_TEMPLATE, PRESENT_VALUE_TEMPLATE)
    ]
    if sorted(input_names) != sorted(expected_in) or sorted(output_names) != sorted(expected_out):
        raise RuntimeError(
            f"the exported decoder graph has inputs {list(input_names)} and outputs {list(output_names)}; "
            f"expected {expected_in} and {expected_out}"
        )
    target = Path(output_dir) / file_name if output_dir is not None else Path(file_name)
    files: list[Path] = []
    if output_dir is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with report.stage(Stage.SAVE, detail=str(target)):
            exporter.save(artifact, target, external_data=use_external)
        data = target.with_name(target.name + ".data")
        files = [data, target] if data.is_file() else [target]
    report.extra["decoder_graph"] = {
        "file": target.name,
        "num_layers": num_layers,
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "position_ids": takes_position_ids,
    }
    # the graph's float dtype: config.dtype casts the model for capture (the eager past is fp32)
    dtype = str(getattr(resolved, "dtype", None) or "float32")
    if dtype == "float32":
        dtype = str(past_cache[0][0].dtype).removeprefix("torch.")
    return DecoderGraph(
        path=target,
        files=tuple(files),
        input_names=input_names,
        output_names=output_names,
        num_layers=num_layers,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        takes_position_ids=takes_position_ids,
        dtype=dtype,
        report=report,
        artifact=artifact,
    )
