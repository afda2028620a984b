"""Quantized ``ExportedProgram``: the ``DynamoConfig.quantization`` methods of the dynamo backend.

``int8-weight`` (a ``source``-phase method: :func:`apply_int8_weight`, run by the base exporter's
shared capture step, :meth:`hfexport.exporter.HfExporter.captured_program`): int8 weight-only
linear layers through torchao. :func:`quantize_copy` deep-copies
the model, turns transformers' GPT-2 ``Conv1D`` projections into ``nn.Linear``
(:func:`hfexport.linear_forms.conv1d_as_linear`) and applies torchao's ``Int8WeightOnlyConfig``
(symmetric int8, one scale per output channel) to every ``nn.Linear`` not excluded; the copy is
captured. :func:`to_plain_aten` then runs ``ExportedProgram.run_decompositions({})``, which
flattens torchao's tensor subclass into plain ``int8`` / ``float32`` parameters and the
dequantize-then-matmul into ``aten._to_copy``, ``aten.mul`` and ``aten.mm``: the program runs under
plain torch (torchao is not needed to load or run it) and holds only tensors the weights-only
unpickler reads. Activations stay float; the matmul runs on the dequantized weight.

The user's model is never modified.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hfexport.config import QuantizationMethod
from hfexport.linear_forms import conv1d_as_linear, matches_any
from hfexport.quantization import QuantizationRequest, QuantizationResult

__all__ = [
    "METHODS",
    "apply_int8_weight",
    "check_quantization",
    "program_weight_bytes",
    "quantize_copy",
    "to_plain_aten",
]

#: Method name -> what it does and the ``QuantizationConfig`` options it reads
#: (``DynamoExporter.quantization_methods``; any other option is refused before capture).
METHODS: dict[str, QuantizationMethod] = {
    "int8-weight": QuantizationMethod(
        "int8 weight-only linear layers (torchao Int8WeightOnlyConfig, per-channel), decomposed to plain aten ops",
        options=frozenset({"exclude"}),
        phase="source",
        apply="hfexport_dynamo.quantize:apply_int8_weight",
    ),
}


def check_quantization(quantization: Any) -> None:
    """Refuse ``embedding_bits``, which no method of this backend has, saying where 4/8-bit
    embeddings are (called before capture, ahead of the core's check of the options each method
    reads: :data:`METHODS`, :meth:`hfexport.config.QuantizationConfig.check_options`, which refuses
    ``per_channel=False`` and ``group_size`` for ``int8-weight``).

    Raises:
        ValueError: ``quantization.embedding_bits`` is set (``int8-weight`` quantizes linear layers
            only); the message names what is allowed.
    """
    if quantization is None:
        return
    if quantization.embedding_bits is not None:
        raise ValueError(
            f"quantization.embedding_bits={quantization.embedding_bits} is not supported by the dynamo "
            "backend (int8-weight quantizes linear layers only); allowed: embedding_bits=None, or "
            "export_format='executorch' for 4/8-bit embeddings"
        )


def quantize_copy(model: torch.nn.Module, quantization: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """An int8 weight-only deep copy of ``model`` (``quantization.method == "int8-weight"``).

    Args:
        model: the model being exported; left exactly as it was.
        quantization: a :class:`hfexport.config.QuantizationConfig`; ``exclude`` names (or
            ``fnmatch`` patterns of) linear modules kept float.

    Returns:
        ``(copy, summary)``: ``summary`` is ``{"method", "linear": quantized linear modules,
        "conv1d_as_linear": Conv1D modules rewritten, "excluded": [names]}``.

    Raises:
        ValueError: see :func:`check_quantization`.
    """
    check_quantization(quantization)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized = copy.deepcopy(model)
    summary: dict[str, Any] = {"method": quantization.method, "linear": 0, "excluded": []}
    summary["conv1d_as_linear"] = len(conv1d_as_linear(quantized))
    exclude = tuple(quantization.exclude)

    def filter_fn(module: torch.nn.Module, fqn: str) -> bool:
        if type(module) is not torch.nn.Linear:
            return False
        if matches_any(fqn, exclude):
            summary["excluded"].append(fqn)
            return False
        summary["linear"] += 1
        return True

    quantize_(quantized, Int8WeightOnlyConfig(), filter_fn=filter_fn)
    return quantized, summary


def apply_int8_weight(request: QuantizationRequest) -> QuantizationResult:
    """The ``source`` phase of ``int8-weight``: the model's int8 weight-only copy
    (:func:`quantize_copy`), captured instead of the model; the exporter's ``lower`` stage then
    flattens it to plain aten (:func:`to_plain_aten`).

    Args:
        request: ``target`` the eager model (left as it was), ``quantization`` the config.

    Returns:
        The copy, with facts ``{"method", "linear", "conv1d_as_linear", "excluded"}``.

    Raises:
        ValueError: see :func:`check_quantization`.
    """
    quantized, summary = quantize_copy(request.target, request.quantization)
    return QuantizationResult(
        quantized, summary, f"{request.quantization.method}: {summary['linear']} linear module(s)"
    )


def to_plain_aten(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with torchao's weight subclasses flattened into plain tensors and aten ops.

    Raises:
        RuntimeError: a ``torchao`` operator is left in the graph (a torchao release whose subclass
            does not decompose): the program would not run without torchao.
    """
    plain = program.run_decompositions({})
    left = sorted(
        {
            str(node.target)
            for node in plain.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("torchao.")
        }
    )
    if left:
        raise RuntimeError(
            f"the int8-weight program still calls torchao operators {left} after run_decompositions; it "
            "would need torchao at run time (the installed torchao's subclass does not decompose to aten)"
        )
    return plain


def program_weight_bytes(program: torch.export.ExportedProgram) -> int:
    """Bytes of the parameters, buffers and constants ``program`` stores (each storage once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*program.state_dict.values(), *program.constants.values()]:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
