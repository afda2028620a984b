"""Run an exported ONNX model in ONNX Runtime on forward kwargs.

:class:`OnnxRuntimeRunner` is what validation calls (``OnnxExporter.runner``) and what a user can
call on a saved ``model.onnx``: it feeds every graph input by name from the leaf tensors of the
forward kwargs and returns ``{leaf_path: torch.Tensor}`` named like the eager model's outputs
(see :mod:`hfexport_onnx.io_names`).

ONNX Runtime prints its own log messages (``[W:onnxruntime:, graph.cc:5809
CleanUnusedInitializersAndNodeArgs] Removing initializer ...``) from C++; :func:`route_ort_logs`,
registered with :func:`hfexport.native_output.register_native_router`, sends them to the
``onnxruntime.native`` logger while the CLI routes native output (without ``-v``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.native_output import native_logger, register_native_router
from hfexport.tensors import get_leaf_tensors
from hfexport_onnx.io_names import COLLISION_SUFFIX, IoNames, io_names_from_metadata

__all__ = [
    "EXTERNAL_DATA_MIN_BYTES",
    "PREPACKED_QUANTIZED_OPS",
    "PROTOBUF_LIMIT_BYTES",
    "OnnxRuntimeRunner",
    "append_initializers",
    "initializer_bytes",
    "route_ort_logs",
]

logger = logging.getLogger(__name__)

# ONNX Runtime severities (0 verbose .. 4 fatal) -> logging levels
_ORT_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}
_ORT_WARNING, _ORT_ERROR = 2, 3


def _log_ort_message(severity: int, category: str, logid: str, code_location: str, message: str) -> None:
    native_logger("onnxruntime").log(
        _ORT_LEVELS.get(int(severity), logging.WARNING),
        "%s (%s%s)",
        message,
        code_location,
        f", {logid}" if logid else "",
    )


def route_ort_logs(on: bool) -> None:
    """Send ONNX Runtime's default-logger messages (every session's, including those
    ``onnxruntime.quantization`` creates) to the ``onnxruntime.native`` logger (``on=True``), or back
    to ONNX Runtime's own stderr printing (``on=False``).

    Uses ``onnxruntime.set_default_logger_callback`` (the Python API asked for in
    microsoft/onnxruntime#28437; present in onnxruntime 1.32), at ONNX Runtime's default severity
    (warnings and above). An onnxruntime without it (1.22-1.31) gets ``set_default_logger_severity``
    ERROR while routing is on and WARNING (its default) afterwards: warnings are then dropped, not
    logged. Messages from ONNX Runtime's own worker threads still print (the callback is only
    called on threads Python knows).
    """
    import onnxruntime as ort

    set_callback = getattr(ort, "set_default_logger_callback", None)
    if set_callback is None:
        ort.set_default_logger_severity(_ORT_ERROR if on else _ORT_WARNING)
        return
    set_callback(_log_ort_message if on else None, _ORT_WARNING)


register_native_router("onnxruntime", route_ort_logs)

#: Serialized protobuf messages cannot exceed 2 GiB; bigger models keep weights as external data.
PROTOBUF_LIMIT_BYTES = 2**31 - 1
#: An in-memory model with at least this many bytes of weights reaches ONNX Runtime as a file with
#: external data, written tensor by tensor, instead of serialized bytes (which hold the weights
#: twice more, as a ``ModelProto`` and as its serialization, next to ONNX Runtime's own copy).
EXTERNAL_DATA_MIN_BYTES = 64 * 2**20
#: Offset alignment of large external tensors in that file: ONNX Runtime can then map them from
#: the file instead of reading them into its own buffers.
_EXTERNAL_ALIGNMENT = 65536
# Headroom left for the graph itself when deciding whether weights fit in one protobuf.
_GRAPH_HEADROOM_BYTES = 64 * 2**20
# Weights shared with ONNX Runtime (``share_weights``) from this size on; smaller ones are read from
# the file (a few hundred norms and constants are not worth an initializer override each).
_SHARE_MIN_BYTES = 1 << 16
#: Operators whose ONNX Runtime CPU kernels prepack their quantized weights into the layout (and
#: the compute path: ``MatMulNBits``' ``accuracy_level``) they run with: a graph holding one keeps
#: prepacking on when its weights are shared (:class:`OnnxRuntimeRunner` ``share_weights``).
PREPACKED_QUANTIZED_OPS = frozenset(
    {
        "MatMulNBits",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "MatMulInteger",
        "QLinearMatMul",
        "QLinearConv",
        "ConvInteger",
        "QGemm",
        "QAttention",
        "DynamicQuantizeLSTM",
        "GatherBlockQuantized",
    }
)


def initializer_bytes(model: Any) -> int:
    """Total size in bytes of the initializers (weights) of an ``onnx_ir.Model``, subgraphs included."""
    total = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None:
                total += int(tensor.nbytes)
    return total


def _to_ir_model(model: Any) -> Any:
    """``ONNXProgram`` / ``onnx_ir.Model`` / ``onnx.ModelProto`` -> ``onnx_ir.Model``."""
    import onnx_ir as ir

    if isinstance(model, ir.Model):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, ir.Model):
        return inner
    try:
        import onnx

        if isinstance(model, onnx.ModelProto):
            return ir.from_proto(model)
    except ImportError:  # pragma: no cover - onnx is a dependency
        pass
    raise TypeError(
        f"cannot run a {type(model).__name__} in ONNX Runtime; pass a torch.onnx.ONNXProgram, an onnx_ir.Model, "
        "an onnx.ModelProto or the path of a .onnx file"
    )


def _numpy(name: str, tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise TypeError(
            f"input {name!r} is bfloat16, which numpy cannot hold; feed the ONNX model float32 inputs or run "
            "it through onnxruntime OrtValues yourself"
        )
    return tensor.detach().to("cpu").contiguous().numpy()


class OnnxRuntimeRunner:
    """An ``onnxruntime.InferenceSession`` over an exported model, fed with forward kwargs.

    Args:
        model: a ``torch.onnx.ONNXProgram``, an ``onnx_ir.Model``, an ``onnx.ModelProto``, or the
            path of a ``.onnx`` file (external data next to it is found by ONNX Runtime).
        providers: ONNX Runtime execution providers, CPU by default.
        session_options: an ``onnxruntime.SessionOptions``; ``None`` uses ONNX Runtime's
            defaults with graph optimizations enabled.

    In-memory models are serialized once, at construction: as bytes when their weights are small,
    else (at least :data:`EXTERNAL_DATA_MIN_BYTES`, and always above the 2 GiB protobuf limit)
    written with external data into a temporary folder (deleted when the runner is garbage
    collected) and loaded from there, so the weights are never held as a ``ModelProto`` and its
    serialization on top of the model and the session.

    With ``share_weights`` (validation: ``OnnxExporter.runner``), such a large in-memory model's
    weights that are held in memory as C-contiguous numpy or torch tensors are handed to ONNX
    Runtime as they are (``SessionOptions.add_initializer``: the session reads the model's own
    buffers, which the runner keeps alive) instead of ONNX Runtime's copy of them, and for a graph
    without quantized kernels (:data:`PREPACKED_QUANTIZED_OPS`) weight prepacking is switched off
    (``session.disable_prepacking``), since prepacking copies every ``MatMul`` weight into a packed
    buffer: float ``MatMul`` runs the same MLAS GEMM either way, packing ``B`` per call instead of
    once (bit-identical outputs; quantized kernels keep prepacking, which selects their compute
    path). Weights computed when read (``onnx_ir.LazyTensor``: packed projections) are read from
    the file.

    Raises:
        TypeError: ``model`` is of an unsupported type.
        FileNotFoundError: a path that does not exist.
        onnxruntime errors: the model is invalid for ONNX Runtime.
    """

    def __init__(
        self,
        model: Any,
        *,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        session_options: Any | None = None,
        share_weights: bool = False,
    ) -> None:
        import onnxruntime as ort

        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        #: numpy arrays and their OrtValues ONNX Runtime reads as initializers (``share_weights``)
        self._shared: list[Any] = []
        if isinstance(model, (str, os.PathLike)):
            path = Path(model)
            if not path.is_file():
                raise FileNotFoundError(f"no ONNX model at {path}")
            import onnx

            metadata = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
            source: str | bytes = str(path)
        else:
            ir_model = _to_ir_model(model)
            metadata = dict(ir_model.metadata_props)
            source = self._serialize(ir_model)
            if share_weights and isinstance(source, str):
                session_options = self._share_weights(ir_model, session_options)
        self.session = ort.InferenceSession(source, sess_options=session_options, providers=list(providers))
        self.io_names: IoNames | None = io_names_from_metadata(metadata)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # a dim named by a number ("8": a size the program fixed, written as a dim_param) is static
        # too, but ONNX Runtime does not check it: a wrong size fails deeper with a kernel's message
        self._input_shapes = {
            i.name: [int(d) if isinstance(d, str) and d.isdigit() else d for d in i.shape]
            for i in self.session.get_inputs()
        }

    def _serialize(self, ir_model: Any) -> str | bytes:
        import onnx_ir as ir

        size = initializer_bytes(ir_model)
        if size < EXTERNAL_DATA_MIN_BYTES and size + _GRAPH_HEADROOM_BYTES < PROTOBUF_LIMIT_BYTES:
            return ir.to_proto(ir_model).SerializeToString()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="hfexport-onnx-")
        path = Path(self._tmpdir.name) / "model.onnx"
        try:
            ir.save(ir_model, path, external_data="model.onnx.data", alignment=_EXTERNAL_ALIGNMENT)
        except TypeError:  # onnx_ir < 1.1 has no alignment option (it aligned large tensors itself)
            ir.save(ir_model, path, external_data="model.onnx.data")
        return str(path)

    def _share_weights(self, ir_model: Any, session_options: Any | None) -> Any:
        """``session_options`` (a new one when ``None``) with the main graph's in-memory weights
        added as user initializers and, without quantized kernels, prepacking off; see the class
        docstring."""
        import onnx_ir as ir
        import onnxruntime as ort

        options = session_options if session_options is not None else ort.SessionOptions()
        graph = ir_model.graph
        if not any(node.op_type in PREPACKED_QUANTIZED_OPS for node in ir_model.graph.all_nodes()):
            options.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if not isinstance(tensor, ir.Tensor) or tensor.nbytes < _SHARE_MIN_BYTES:  # TorchTensor too
                continue
            raw = tensor.raw
            if isinstance(raw, torch.Tensor):
                if raw.dtype == torch.bfloat16 or raw.device.type != "cpu" or not raw.is_contiguous():
                    continue
                array = raw.detach().numpy()
            elif isinstance(raw, np.ndarray):
                array = raw
            else:
                continue
            if not array.flags["C_CONTIGUOUS"] or array.dtype.kind not in "fiub":
                continue
            if array.dtype != tensor.dtype.numpy():
                continue  # stored in another numpy dtype than the graph's (float8 as uint8 ...)
            if tuple(array.shape) != tuple(tensor.shape.numpy()):
                continue  # a tensor whose raw buffer is laid out otherwise (packed sub-byte types)
            ort_value = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(name, ort_value)
            self._shared.append((array, ort_value))
        return options

    def _input_path(self, graph_name: str) -> str:
        if self.io_names is not None:
            return self.io_names.inputs.get(graph_name, graph_name)
        return graph_name

    def _output_path(self, graph_name: str) -> str:
        if self.io_names is not None and graph_name in self.io_names.outputs:
            return self.io_names.outputs[graph_name]
        path = graph_name
        while path.endswith(COLLISION_SUFFIX) and path.removesuffix(COLLISION_SUFFIX) in self.input_names:
            path = path.removesuffix(COLLISION_SUFFIX)
        return path

    def _check_static_axes(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Refuse a feed whose rank or static axis sizes differ from the graph input's.

        ONNX Runtime refuses them too, with its own message ("Got invalid dimensions for input"),
        or, for a fixed size the graph writes as a named dim (``"8"``), fails later in a kernel
        ("MatMul dimension mismatch"); this one names the input's leaf path, the axis, the size the graph was exported with and
        what to do (an axis the model fixes at export: an image side a vision tower computes its
        patch grid from, a sequence axis a model loops over).

        Raises:
            ValueError: a feed's rank differs from the graph input's, or an axis the graph holds
                static has another size.
        """
        for name, array in feeds.items():
            shape = self._input_shapes.get(name)
            if shape is None:
                continue
            path = self._input_path(name)
            if len(shape) != array.ndim:
                raise ValueError(
                    f"input {path!r} has {array.ndim} axes {list(array.shape)}; the ONNX graph takes {len(shape)} "
                    f"({['?' if not isinstance(d, int) else d for d in shape]})"
                )
            for axis, (want, got) in enumerate(zip(shape, array.shape)):
                if isinstance(want, int) and want != got:
                    raise ValueError(
                        f"input {path!r} axis {axis} is {got}, but the ONNX graph was exported with that axis fixed "
                        f"at {want} (shape {['?' if not isinstance(d, int) else d for d in shape]}: the model fixed it "
                        f"at capture); give inputs of that size (resize images to the exported size), or export "
                        "again with sample inputs of the size you serve"
                    )

    def feeds(self, forward_kwargs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Map forward kwargs to the session's feeds ``{graph input name: ndarray}``.

        Tensors the graph does not take (inputs the model never reads, pruned at export) are
        left out. Output flags (``use_cache`` ...) are no graph inputs: each one given is checked
        against the value the graph was exported with (recorded in its metadata) and dropped.

        Raises:
            ValueError: a graph input has no matching leaf tensor in ``forward_kwargs``; the
                message lists what the graph needs and what was given. A tensor whose rank or
                static axis sizes differ from the graph input's (the message names the axis and
                the exported size).
            hfexport.errors.UnsupportedInputError: an output flag differs from its exported value.
        """
        from hfexport.inputs.flags import check_output_flags

        flags = self.io_names.output_flags if self.io_names is not None else {}
        leaves = get_leaf_tensors(check_output_flags(forward_kwargs, flags))
        feeds: dict[str, np.ndarray] = {}
        missing = []
        for name in self.input_names:
            path = self._input_path(name)
            tensor = leaves.get(path)
            if tensor is None:
                missing.append(path)
                continue
            feeds[name] = _numpy(path, tensor)
        if missing:
            raise ValueError(
                f"the ONNX model needs input(s) {missing}, missing from the given inputs {sorted(leaves)}; "
                f"it takes {[self._input_path(n) for n in self.input_names]}"
            )
        self._check_static_axes(feeds)
        unused = sorted(set(leaves) - {self._input_path(n) for n in self.input_names})
        if unused:
            logger.debug("inputs not taken by the ONNX graph (unused by the model): %s", unused)
        return feeds

    def __call__(self, forward_kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run the model on ``forward_kwargs`` (as ``model(**forward_kwargs)`` takes them).

        Returns:
            ``{leaf_path: tensor}`` with the eager output's leaf paths (``logits``,
            ``cache.layers.0.keys`` ...), CPU tensors.

        Raises:
            ValueError: a graph input is missing (see :meth:`feeds`).
            hfexport.errors.UnsupportedInputError: an output flag differs from its exported value.
        """
        results = self.session.run(None, self.feeds(forward_kwargs))
        return {
            self._output_path(name): torch.from_numpy(np.asarray(value))
            for name, value in zip(self.output_names, results)
        }


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# protobuf field keys (field number << 3 | wire type 2, length-delimited) of onnx.proto3:
# ModelProto.graph = 7, GraphProto.initializer = 5, GraphProto.value_info = 13
_MODEL_GRAPH_KEY = _varint(7 << 3 | 2)
_GRAPH_INITIALIZER_KEY = _varint(5 << 3 | 2)
_GRAPH_VALUE_INFO_KEY = _varint(13 << 3 | 2)


def _graph_record(key: bytes, message: bytes) -> tuple[bytes, bytes]:
    """The two headers of ``ModelProto { graph { <key>: message } }`` (``message`` follows them)."""
    inner = key + _varint(len(message))
    return _MODEL_GRAPH_KEY + _varint(len(inner) + len(message)), inner


def append_initializers(path: str | os.PathLike[str], graph: Any) -> int:
    """Append the initializers of ``graph`` (an ``onnx_ir.Graph``, the main graph of the model saved
    without them at ``path``) to that ``.onnx`` file, one tensor at a time.

    Protobuf merges repeated occurrences of a message field: a ``ModelProto`` followed by
    ``graph { initializer { ... } }`` records parses (in ``onnx.load``, ONNX Runtime, any protobuf
    reader) as the same model with those initializers added, in order. Written this way, the
    weights are never held as one ``ModelProto`` and its serialization (two copies of every weight
    while ``onnx_ir.save`` serializes a model inside its file); only one tensor's bytes at a time.

    Args:
        path: a model file written without its main graph's initializers (e.g.
            ``ONNXProgram.save(path, include_initializers=False)``).
        graph: the graph whose initializers to append (their ``const_value`` tensors).

    Returns:
        The number of bytes appended.

    Raises:
        ValueError: an initializer has no constant value.
    """
    from onnx_ir import serde

    # the value_info onnx_ir writes for an initializer (its type and shape, metadata), when its
    # serializer says so; without that (private) rule, none: the tensor carries type and shape
    wants_info = getattr(serde, "_should_create_value_info_for_value", lambda value: False)
    inputs = {v.name for v in graph.inputs}
    written = 0
    with open(path, "ab") as fh:
        for value in graph.initializers.values():
            if value.const_value is None:
                raise ValueError(f"initializer {value.name!r} has no constant value to write")
            records = []
            if value.name not in inputs and wants_info(value):
                records.append((_GRAPH_VALUE_INFO_KEY, serde.serialize_value(value).SerializeToString()))
            value.const_value.name = value.name  # as onnx_ir's serializer names it
            records.append(
                (_GRAPH_INITIALIZER_KEY, serde.serialize_tensor(value.const_value).SerializeToString())
            )
            for key, message in records:
                outer, inner = _graph_record(key, message)
                fh.write(outer)
                fh.write(inner)
                fh.write(message)
                written += len(outer) + len(inner) + len(message)
            del records
    return written
