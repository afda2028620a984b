"""Stateful decoders: the KV cache as OpenVINO state, the model OpenVINO GenAI's ``LLMPipeline`` runs.

:func:`export_stateful_decoder` exports a decoder-only language model once, on a sample with a
non-empty ``DynamicCache`` (so the graph concatenates new keys onto a real past), through the
backend's ordinary :meth:`~hfexport_openvino.exporter.OpenvinoExporter.export` (capture, convert,
leaf-path names, validation against eager PyTorch). :func:`make_stateful` then turns the cache
inputs/outputs into state:

* a new ``beam_idx`` input (int32 ``[batch]``) selects, per step, which batch row's cache each row
  continues (beam search; greedy passes ``0..batch-1``);
* every cache input ``cache.layers.{i}.{keys,values}`` (``past_key_values`` before transformers 5.24) becomes a ``ReadValue`` of a
  variable of the same name whose initial value is an empty ``[batch, heads, 0, head_dim]``
  tensor (``batch`` read from ``input_ids``), gathered by ``beam_idx``;
* the matching updated-cache output becomes an ``Assign`` to that variable.

The result takes ``input_ids``, ``attention_mask`` (``[batch, past + new]``), ``position_ids`` and
``beam_idx`` and returns ``logits``: the interface optimum-intel's stateful exports have and that
OpenVINO GenAI reads (``openvino_model.xml``). This is our own implementation on OpenVINO's public
graph API (``ReadValue``/``Assign`` over ``openvino.op.util.Variable``).

:class:`StatefulDecoder` runs such a model greedily (what validation and ``hfexport generate`` use).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hfexport_openvino.errors import StatefulExportError

__all__ = [
    "STATEFUL_COMPONENT",
    "StatefulDecoder",
    "StatefulGenerationRunner",
    "check_stateful_model",
    "export_stateful_decoder",
    "make_stateful",
    "text_plan",
]

#: Component name of a stateful decoder in a generation folder (saved as ``openvino_model.xml``).
STATEFUL_COMPONENT = "stateful_decoder"
#: Past length of the cache the decoder is traced with.
_SAMPLE_PAST = 3
_CACHE_PATH = re.compile(r"layers\.(\d+)\.(keys|values)$")
#: Forward kwarg names of the KV cache (transformers 5.24 renamed ``past_key_values`` to ``cache``).
CACHE_KWARGS = ("cache", "past_key_values")


def cache_kwarg(model: Any) -> str | None:
    """The name under which ``model.forward`` takes its KV cache, or ``None``."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KWARGS if name in parameters), None)


def check_stateful_model(model: Any) -> None:
    """Refuse, before any capture, a model a stateful decoder cannot be made of.

    Raises:
        StatefulExportError: the model is an encoder-decoder or multimodal model, cannot generate,
            or has no KV cache (``config.use_cache`` absent or the forward takes no
            ``past_key_values``); the message says to export with ``stateful=False``.
    """
    config = getattr(model, "config", None)
    name = type(model).__name__
    hint = "export it with OpenvinoConfig(stateful=False) (stateless components) or as a plain forward"
    if config is None or not getattr(model, "can_generate", lambda: False)():
        raise StatefulExportError(
            f"{name} does not generate text, so it has no KV cache to keep as state; {hint}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise StatefulExportError(
            f"{name} is an encoder-decoder model; stateful OpenVINO exports cover decoder-only language models; {hint}"
        )
    if (
        getattr(config, "text_config", None) is not None
        and getattr(config, "vision_config", None) is not None
    ):
        raise StatefulExportError(
            f"{name} is a multimodal model; stateful OpenVINO exports cover decoder-only language models; {hint}"
        )
    if cache_kwarg(model) is None or getattr(config, "use_cache", None) is None:
        raise StatefulExportError(
            f"{name} has no KV cache (its forward takes no cache / past_key_values); {hint}"
        )


def sample_inputs(model: Any, input_ids: torch.Tensor) -> dict[str, Any]:
    """Forward kwargs of one decode step on a real past: ``input_ids``, ``attention_mask``,
    ``position_ids`` and a ``DynamicCache`` of :data:`_SAMPLE_PAST` positions.

    Args:
        model: the decoder-only model (eval mode).
        input_ids: int64 ``[batch, seq]`` prompt ids, ``seq > _SAMPLE_PAST + 1``.
    """
    from transformers import DynamicCache

    batch, seq = input_ids.shape
    if seq < _SAMPLE_PAST + 2:
        input_ids = torch.cat([input_ids, input_ids[:, :1].expand(batch, _SAMPLE_PAST + 2 - seq)], dim=1)
        seq = input_ids.shape[1]
    past_ids, new_ids = input_ids[:, :_SAMPLE_PAST], input_ids[:, _SAMPLE_PAST:]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=past_ids, past_key_values=cache, use_cache=True)
    positions = torch.arange(_SAMPLE_PAST, seq, dtype=torch.int64)[None].expand(batch, -1).contiguous()
    return {
        "input_ids": new_ids.contiguous(),
        "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
        "position_ids": positions,
        cache_kwarg(model) or "past_key_values": cache,
    }


def make_stateful(
    ov_model: Any, *, batch_input: str = "input_ids", cache_shapes: Mapping[str, Sequence[int]] | None = None
) -> list[str]:
    """Turn the cache inputs/outputs of a named decoder into state, in place (see the module docs).

    Args:
        ov_model: an ``openvino.Model`` named by :func:`hfexport_openvino.naming.name_model_io`,
            with inputs ``cache.layers.{i}.{keys,values}`` (or ``past_key_values...``) and matching
            outputs (``cache.layers.{i}.keys.out`` ...).
        batch_input: the input whose first axis gives the batch of the initial (empty) state.
        cache_shapes: ``{cache input name: sample shape}``; gives the heads and head size where
            the converted model left them dynamic (a ``Dim.AUTO`` capture does).

    Returns:
        The variable ids, one per cache tensor (``cache.layers.0.keys`` ...).

    Raises:
        StatefulExportError: the model has no cache inputs, or an input has no matching output.
    """
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.op.util import Variable, VariableInfo

    from hfexport_openvino.naming import RT_INFO_KEY, io_names_from_model

    names = io_names_from_model(ov_model)
    params = {port.get_any_name(): port.get_node() for port in ov_model.inputs}
    results = {port.get_any_name(): port.get_node() for port in ov_model.outputs}
    cache_inputs = [n for n in params if n.split(".", 1)[0] in CACHE_KWARGS and _CACHE_PATH.search(n)]
    if not cache_inputs:
        raise StatefulExportError(
            "the decoder has no cache inputs (cache.layers.N.keys ...) to turn into state"
        )
    outputs_by_slot = {}
    for out_name, path in names.outputs.items():
        match = _CACHE_PATH.search(path)
        if match and out_name in results and out_name not in params:
            outputs_by_slot[match.groups()] = out_name
    batch_param = params[batch_input]
    beam_idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    batch = ops.gather(ops.shape_of(batch_param, output_type="i64"), ops.constant([0], ov.Type.i64), 0)
    variables = []
    for name in cache_inputs:
        param = params[name]
        slot = _CACHE_PATH.search(name).groups()
        out_name = outputs_by_slot.get(slot)
        if out_name is None:
            raise StatefulExportError(f"cache input {name!r} has no matching updated-cache output")
        shape = param.get_output_partial_shape(0)
        sample = list((cache_shapes or {}).get(name, ()))
        if shape.rank.is_dynamic or shape.rank.get_length() != 4:
            raise StatefulExportError(
                f"cache input {name!r} has shape {shape}; a stateful decoder needs [batch, heads, seq, head_dim]"
            )
        sizes = []
        for axis in (1, 3):
            if shape[axis].is_static:
                sizes.append(shape[axis].get_length())
            elif len(sample) == 4:
                sizes.append(int(sample[axis]))
            else:
                raise StatefulExportError(
                    f"cache input {name!r} has a dynamic axis {axis} ({shape}) and no sample shape was given"
                )
        heads, head_dim = sizes
        info = VariableInfo()
        info.variable_id = name
        info.data_type = param.get_element_type()
        info.data_shape = ov.PartialShape([-1, heads, -1, head_dim])
        variable = Variable(info)
        rest = ops.constant([heads, 0, head_dim], ov.Type.i64)
        init = ops.broadcast(ops.constant(0, param.get_element_type()), ops.concat([batch, rest], 0))
        read = ov.op.read_value(init.output(0), variable)
        gathered = ops.gather(read, beam_idx, ops.constant(0, ov.Type.i64))
        param.output(0).replace(gathered.output(0))
        result = results[out_name]
        value = result.input_value(0)
        producer = value.get_node()
        if producer.get_output_size() != 1:  # Assign's binding takes a node: give it a one-output one
            producer = ops.convert(value, value.get_element_type())
        assign = ov.op.assign(producer, variable)
        ov_model.remove_result(result)
        ov_model.remove_parameter(param)
        ov_model.add_variables([variable])
        ov_model.add_sinks([assign])
        variables.append(name)
    ov_model.add_parameters([beam_idx])
    ov_model.validate_nodes_and_infer_types()
    inputs = {p.get_any_name(): p.get_any_name() for p in ov_model.inputs}
    outputs = {
        o.get_any_name(): names.outputs.get(o.get_any_name(), o.get_any_name()) for o in ov_model.outputs
    }
    import json

    ov_model.set_rt_info(json.dumps({"inputs": inputs, "outputs": outputs}), [RT_INFO_KEY, "io"])
    ov_model.set_rt_info("True", [RT_INFO_KEY, "stateful"])
    return variables


class StatefulDecoder:
    """A compiled stateful decoder: :meth:`reset`, then :meth:`step` once per chunk of tokens.

    Args:
        model: the stateful ``openvino.Model`` (or the path of its ``openvino_model.xml``).
        device: the OpenVINO device.
        precision_hint: ``INFERENCE_PRECISION_HINT`` (``None``: ``"f32"``).
    """

    def __init__(self, model: Any, device: str = "CPU", precision_hint: str | None = None) -> None:
        import os

        import openvino as ov

        from hfexport_openvino.runtime import compile_properties

        core = ov.Core()
        if isinstance(model, (str, os.PathLike)):
            model = core.read_model(os.fspath(model))
        self.model = model
        self.request = core.compile_model(
            model, device, compile_properties(precision_hint)
        ).create_infer_request()
        self.past = 0

    def reset(self) -> None:
        """Forget the cache (a new sequence starts)."""
        self.request.reset_state()
        self.past = 0

    def step(self, input_ids: torch.Tensor, beam_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``input_ids`` int64 ``[batch, n]`` after the cached positions; return logits ``[batch, n, vocab]``."""
        batch, n = input_ids.shape
        feed = {
            "input_ids": input_ids.numpy().astype(np.int64),
            "attention_mask": np.ones((batch, self.past + n), dtype=np.int64),
            "position_ids": np.arange(self.past, self.past + n, dtype=np.int64)[None].repeat(batch, 0),
            "beam_idx": (beam_idx.numpy() if beam_idx is not None else np.arange(batch)).astype(np.int32),
        }
        out = self.request.infer(feed)
        self.past += n
        return torch.from_numpy(np.array(out["logits"], copy=True))

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: Sequence[int] = (),
        pad_token_id: int = 0,
    ) -> torch.Tensor:
        """Greedy generation: int64 ``[batch, seq]`` -> ``[batch, seq + n]``, ``n <= max_new_tokens``.

        Rows that produced an end-of-sequence token continue with ``pad_token_id``; generation stops
        early once every row has ended.
        """
        self.reset()
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        finished = torch.zeros(ids.shape[0], dtype=torch.bool)
        logits = self.step(ids)
        out = [ids]
        for _ in range(max_new_tokens):
            token = logits[:, -1].argmax(-1)
            token = torch.where(finished, torch.full_like(token, pad_token_id), token)
            out.append(token[:, None])
            finished |= torch.isin(token, torch.tensor(list(eos_token_id), dtype=torch.int64))
            if bool(finished.all()) or len(out) - 1 == max_new_tokens:
                break
            logits = self.step(token[:, None])
        return torch.cat(out, dim=1)


class StatefulGenerationRunner:
    """What ``hfexport generate`` / :func:`hfexport.generation.load_runner` get for a stateful folder.

    Has the :class:`hfexport.generation.GenerationRunner` interface the core uses: ``plan`` and
    ``generate(input_ids, attention_mask=None, *, max_new_tokens)``.
    """

    def __init__(self, plan: Any, decoder: StatefulDecoder) -> None:
        self.plan = plan
        self.decoder = decoder

    def generate(
        self,
        input_ids: Any,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 20,
        **inputs: Any,
    ) -> torch.Tensor:
        """Greedy generation; ``attention_mask`` must be all ones (no padding), other inputs are refused."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if inputs:
            raise ValueError(
                f"a stateful OpenVINO decoder takes only input_ids and attention_mask, got {sorted(inputs)}"
            )
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        if ids.dim() == 1:
            ids = ids[None]
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise ValueError(
                "a stateful OpenVINO decoder runs unpadded prompts only (attention_mask all ones)"
            )
        token_ids = self.plan.token_ids
        eos = token_ids.get("eos_token_id") or []
        eos = [eos] if isinstance(eos, int) else list(eos)
        pad = token_ids.get("pad_token_id")
        return self.decoder.generate(
            ids,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad if isinstance(pad, int) else 0,
        )


def text_plan(model: Any, kwargs: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """How the quality text is fed to the stateless decoder (``hfexport_text_plan``, read by
    :meth:`hfexport.exporter.HfExporter.text_reference`): prefills of up to
    :data:`hfexport.quality.TEXT_CHUNK_TOKENS` (512, as ``hfexport bench`` cuts the text) or the
    model's position limit on an empty cache, batch 1.

    Args:
        model: the decoder-only ``PreTrainedModel``.
        kwargs: the export's sample kwargs (:func:`sample_inputs`): the cache kwarg and its shapes.

    Returns:
        ``(make_inputs, chunking)``: ``make_inputs`` turns an int64 ``[1, n]`` chunk into forward
        kwargs (``input_ids``, mask of ones, positions ``0..n-1``, a fresh cache whose layers hold
        empty ``[1, heads, 0, head_dim]`` tensors); ``chunking`` the keywords of
        :func:`hfexport.quality.text_chunks`.
    """
    from transformers import DynamicCache

    from hfexport.quality import TEXT_CHUNK_TOKENS, position_limit

    name = cache_kwarg(model) or "past_key_values"
    layers = [(layer.keys, layer.values) for layer in kwargs[name].layers]

    def make_inputs(chunk: torch.Tensor) -> dict[str, Any]:
        length = int(chunk.shape[1])
        cache = DynamicCache(config=model.config)
        for index, (keys, values) in enumerate(layers):
            cache.update(keys[:1, :, :0].clone(), values[:1, :, :0].clone(), index)
        return {
            "input_ids": chunk.to(torch.long),
            "attention_mask": torch.ones(1, length, dtype=torch.long),
            "position_ids": torch.arange(length, dtype=torch.long)[None],
            name: cache,
        }

    limit = min(position_limit(model) or TEXT_CHUNK_TOKENS, TEXT_CHUNK_TOKENS)
    return make_inputs, {"max_length": limit, "exact": False, "batch": 1}


def export_stateful_decoder(
    exporter: Any, model: Any, inputs: Mapping[str, Any], config: Any
) -> dict[str, Any]:
    """Export ``model`` as a stateful decoder, validated stateless first, then as state against ``generate``.

    Args:
        exporter: the :class:`~hfexport_openvino.exporter.OpenvinoExporter`.
        model: a decoder-only ``PreTrainedModel`` (checked by :func:`check_stateful_model`).
        inputs: generate-style inputs: ``input_ids`` int64 ``[batch, seq]`` (``attention_mask`` ignored).
        config: the resolved ``OpenvinoConfig`` (``stateful=True``).

    Returns:
        A ``GenerationArtifacts`` ``{"stateful_decoder": openvino.Model}`` with ``.plan`` (architecture
        ``"decoder"``, the model's token ids) and ``.reports``.

    A quantized export (``config.quantization``) is scored by the quality gates instead: the
    stateless sample by the per-output gates, the quality text (teacher-forced prefills on an empty
    cache, :func:`text_plan`) by the text gates of :func:`hfexport.quality.text_gates_for`; its
    greedy tokens are recorded (``report.validation_generation``), not gated.

    Raises:
        StatefulExportError: before capture, see :func:`check_stateful_model`.
        ExportValidationError: the stateful decoder's greedy tokens differ from ``model.generate``
            (unquantized), or a quality gate is missed (quantized).
    """
    from hfexport.errors import ExportValidationError
    from hfexport.generation.decompose import token_ids_of
    from hfexport.generation.export import GenerationArtifacts
    from hfexport.generation.plan import GenerationPlan

    check_stateful_model(model)
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("a stateful decoder export needs input_ids, an int64 tensor [batch, seq]")
    was_training = model.training
    model.eval()
    quantized = getattr(config, "quantization", None) is not None
    try:
        kwargs = sample_inputs(model, input_ids)
        if quantized:  # read by HfExporter.text_reference: the text is fed as prefills on an empty cache
            model.hfexport_text_plan = text_plan(model, kwargs)
        try:
            ov_model = exporter.export(
                model, kwargs, config.replace(dynamic=True), component=STATEFUL_COMPONENT
            )
        finally:
            model.__dict__.pop("hfexport_text_plan", None)
        report = exporter.last_report
        with report.stage("make_stateful") as record:
            from hfexport.tensors import get_leaf_tensors

            shapes = {path: list(t.shape) for path, t in get_leaf_tensors(kwargs).items()}
            variables = make_stateful(ov_model, cache_shapes=shapes)
            record.detail = f"{len(variables)} cache tensors as state, beam_idx input"
        with report.stage("validate_generation") as record:
            prompt = input_ids[:1]
            new = 5
            with torch.no_grad():
                expected = model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    num_beams=1,
                )
            decoder = StatefulDecoder(
                ov_model, device=config.device, precision_hint=config.inference_precision_hint
            )
            got = decoder.generate(prompt, max_new_tokens=new)
            if quantized:  # gated on the text metrics above; greedy parity is a fact, not a gate
                equal = bool(torch.equal(got, expected))
                matching = int((got[0, prompt.shape[1] :] == expected[0, prompt.shape[1] :]).sum())
                record.detail = (
                    f"{matching}/{new} greedy tokens equal to model.generate (quantized: not gated)"
                )
                report.validation_generation = {"greedy_tokens": got[0].tolist(), "equal_to_generate": equal}
            elif not torch.equal(got, expected):
                raise ExportValidationError(
                    f"the stateful decoder's greedy tokens {got[0, prompt.shape[1] :].tolist()} differ from "
                    f"model.generate's {expected[0, prompt.shape[1] :].tolist()}"
                )
            else:
                record.detail = f"{new} greedy tokens equal to model.generate"
                report.validation_generation = {
                    "greedy_tokens": got[0].tolist(),
                    "equal_to_generate": True,
                }
    finally:
        model.train(was_training)
    plan = GenerationPlan(
        architecture="decoder",
        model_class=type(model).__name__,
        components=[STATEFUL_COMPONENT],
        token_ids=token_ids_of(model),
    )
    return GenerationArtifacts(
        {STATEFUL_COMPONENT: ov_model}, plan, {STATEFUL_COMPONENT: report}, exporter.export_format
    )
