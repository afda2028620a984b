"""Weight compression of a converted OpenVINO IR with NNCF (``OpenvinoConfig.quantization``).

The methods (:data:`QUANTIZATION_METHODS`, ``OpenvinoExporter.quantization_methods``) are declared
in phase ``artifact``: the exporter calls them through
:meth:`hfexport.exporter.HfExporter.quantize_artifact` right after ``openvino.convert_model``, and
their functions (:func:`apply_int8_weight`, :func:`apply_int4_weight`) run ``nncf.compress_weights``
on the ``openvino.Model``, so no second float copy of the model is made (the torch weights are not
quantized, the IR's constants are replaced by low-precision ones plus a decompression subgraph that
the CPU plugin fuses into its MatMul / Gather kernels):

- ``int8-weight``: every MatMul and embedding ``Gather`` weight to 8 bits, one scale (and zero
  point unless ``symmetric=True``) per output channel; data-free.
- ``int4-weight``: MatMul weights to 4 bits in groups of ``group_size`` input channels (default
  :data:`INT4_GROUP_SIZE`, or the largest smaller power of two dividing every MatMul's input
  channels, :func:`check_group_size`; asymmetric unless ``symmetric=True``); the embedding and the last MatMul
  (the LM head) stay 8-bit per channel (NNCF's backup precision, as its default int4 IR does). Data-
  free, unless ``calibration`` names a prompt file: then AWQ and scale estimation run on at most
  ``num_calibration_samples`` of its lines, fed to the IR as prefills (on an empty past for a
  decoder with cache inputs).

``quantization.exclude`` names modules (``fnmatch`` patterns over module paths such as ``lm_head``
or ``model.layers.*.mlp.down_proj``): the MatMuls / Gathers converted from the FX nodes recorded
under those modules (``nn_module_stack``) stay in float.

What an artifact-phase function gets as ``request.target`` is an :class:`IrTarget`: the converted
``openvino.Model`` plus the module paths of the FX nodes it was converted from (the IR names an op
``<fx node>/<aten op>/<ov op>``; :meth:`IrTarget.excluded_ops` maps ``exclude`` patterns onto IR
ops with them), built by :meth:`~hfexport_openvino.exporter.OpenvinoExporter.quantization_target`.
``request.calibration`` holds the IR feeds of the calibration prompts (:func:`calibration_feeds`)
for a method that reads ``calibration`` when ``quantization.calibration`` is set, else ``None``.
A method registered from outside (:func:`hfexport.quantization.register_quantization_method` on
``"openvino"``, phase ``artifact``) gets the same request and returns the compressed model as an
:class:`IrTarget` or a bare ``openvino.Model``. :func:`check_quantization` is run before capture.
"""

from __future__ import annotations

import collections
import fnmatch
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.config import QuantizationConfig, QuantizationMethod
from hfexport.quantization import QuantizationRequest, QuantizationResult

__all__ = [
    "INT4_GROUP_SIZE",
    "INT4_GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "IrTarget",
    "apply_int4_weight",
    "apply_int8_weight",
    "calibration_feeds",
    "check_group_size",
    "check_quantization",
    "compress_int4",
    "compress_int8",
    "compressed_op_counts",
    "excluded_node_names",
    "module_paths",
    "weight_bytes",
]

logger = logging.getLogger(__name__)

#: default group size of ``int4-weight`` (NNCF's and optimum-intel's default for int4 IRs)
INT4_GROUP_SIZE = 128
#: group sizes ``int4-weight`` accepts (the CPU plugin's grouped-decompression kernels)
INT4_GROUP_SIZES = (16, 32, 64, 128, 256)

#: method name -> what it does and the ``QuantizationConfig`` options it reads
#: (``OpenvinoExporter.quantization_methods``; any other option is refused before capture)
QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {
    "int8-weight": QuantizationMethod(
        "NNCF compress_weights: 8-bit per-channel MatMul and embedding weights (asymmetric unless "
        "symmetric=True), data-free; activations stay float",
        options=frozenset({"symmetric", "exclude"}),
        phase="artifact",
        apply="hfexport_openvino.quantize:apply_int8_weight",
    ),
    "int4-weight": QuantizationMethod(
        "NNCF compress_weights: 4-bit grouped MatMul weights (group_size, default 128 or the largest "
        "smaller power of two dividing the channels; asymmetric unless "
        "symmetric=True), embedding and LM head 8-bit; AWQ + scale estimation when calibration names a "
        "prompt file",
        options=frozenset({"group_size", "symmetric", "exclude", "calibration", "num_calibration_samples"}),
        phase="artifact",
        apply="hfexport_openvino.quantize:apply_int4_weight",
    ),
}

# op types whose weight input NNCF compresses, and the input index of the weight
_WEIGHTED_OPS = {"MatMul": 1, "Gather": 0, "Convolution": 1}
# ops of NNCF's decompression subgraph, walked from a weight input back to its stored constant
_DECOMPRESSION_OPS = ("Convert", "Subtract", "Multiply", "Reshape")
_LOW_PRECISION = {"u4": "int4", "i4": "int4", "u8": "int8", "i8": "int8"}


def check_quantization(quantization: QuantizationConfig | None) -> None:
    """Refuse values of ``quantization`` that NNCF or the CPU plugin cannot take, before capture.

    The option names themselves are checked by ``QuantizationConfig.check_options`` (the base
    class's ``check_precision``).

    Args:
        quantization: the export's ``config.quantization`` (``None``: nothing to check).

    Raises:
        ImportError: ``nncf`` is not installed.
        ValueError: ``group_size`` not in :data:`INT4_GROUP_SIZES`; a ``calibration`` file that does
            not exist, is not UTF-8 or has no non-blank line.
    """
    if quantization is None or quantization.method not in QUANTIZATION_METHODS:
        return
    import importlib.util

    if importlib.util.find_spec("nncf") is None:
        raise ImportError(
            f"quantization method {quantization.method!r} compresses the IR with NNCF, which is not installed: "
            "pip install 'hfexport-openvino[tested]' (or pip install 'nncf>=3.4')"
        )
    if quantization.group_size is not None and quantization.group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantization.group_size={quantization.group_size} is not supported by OpenVINO's 4-bit "
            f"weight decompression; allowed: {', '.join(map(str, INT4_GROUP_SIZES))} "
            f"(default {INT4_GROUP_SIZE})"
        )
    if quantization.calibration is not None:
        _prompt_lines(quantization.calibration)


def _prompt_lines(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"calibration file {path} does not exist; allowed: a UTF-8 text file, one prompt per line"
        )
    try:
        lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"calibration file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); give a UTF-8 "
            "text file, one prompt per line"
        ) from exc
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError(f"calibration file {path} holds no prompt; give at least one non-blank line")
    return lines


# -- facts -------------------------------------------------------------------------------------------
def weight_bytes(ov_model: Any) -> int:
    """Bytes of every ``Constant`` of ``ov_model`` (what its ``.bin`` stores, before any fp16
    compression at save), 4-bit constants counted at half a byte per element."""
    total = 0
    for op in ov_model.get_ops():
        if op.get_type_name() == "Constant":
            shape = op.get_output_partial_shape(0).to_shape()
            total += int(np.prod(list(shape), dtype=np.int64)) * op.get_output_element_type(0).bitwidth // 8
    return total


def _stored_constant(op: Any, index: int) -> Any | None:
    """The ``Constant`` behind input ``index`` of ``op``, through a decompression subgraph."""
    node = op.input_value(index).get_node()
    for _ in range(8):
        kind = node.get_type_name()
        if kind == "Constant":
            return node
        if kind not in _DECOMPRESSION_OPS:
            return None
        node = node.input_value(0).get_node()
    return None


def compressed_op_counts(ov_model: Any) -> dict[str, int]:
    """``{"<op type> <int4|int8>": count}``: the MatMul / Gather / Convolution ops of ``ov_model``
    whose weight is stored in 4 or 8 bits (``{}`` for an uncompressed model)."""
    counts: collections.Counter[str] = collections.Counter()
    for op in ov_model.get_ops():
        index = _WEIGHTED_OPS.get(op.get_type_name())
        if index is None:
            continue
        constant = _stored_constant(op, index)
        if constant is None:
            continue
        bits = _LOW_PRECISION.get(constant.get_output_element_type(0).get_type_name())
        if bits is not None:
            counts[f"{op.get_type_name()} {bits}"] += 1
    return dict(sorted(counts.items()))


# -- exclude ---------------------------------------------------------------------------------------
def module_paths(program: torch.export.ExportedProgram) -> dict[str, tuple[str, ...]]:
    """FX node name -> the module paths it was recorded under (``nn_module_stack``, outermost
    first; ``()`` for a node outside any submodule).

    Args:
        program: the captured ``ExportedProgram`` the IR is converted from.

    Returns:
        ``{"linear_3": ("model", "model.layers", "model.layers.0", ..., "model.layers.0.mlp.down_proj")}``.
    """
    paths: dict[str, tuple[str, ...]] = {}
    for node in program.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        names = []
        for value in stack.values():
            path = value[0] if isinstance(value, tuple) else value
            # torch.export records module paths like "L['self'].model.layers.0" or "model.layers.0"
            path = str(path).split("L['self'].", 1)[-1].removeprefix("L['self']")
            if path:
                names.append(path)
        paths[node.name] = tuple(names)
    return paths


def excluded_node_names(
    ov_model: Any, paths: Mapping[str, Sequence[str]], patterns: Sequence[str]
) -> list[str]:
    """Friendly names of the weighted ops of ``ov_model`` converted from FX nodes recorded under a
    module matching ``patterns`` (the IR names an op ``<fx node>/<aten op>/<ov op>``).

    Args:
        ov_model: the converted ``openvino.Model``.
        paths: FX node name -> module paths (:func:`module_paths` of the program it came from).
        patterns: module paths or ``fnmatch`` patterns over them (``lm_head``, ``model.layers.*.mlp.*``).

    Returns:
        The op names, sorted (``[]`` for no pattern).

    Raises:
        ValueError: a pattern matches no weighted op (a typo would otherwise compress everything);
            the message lists module paths that exist.
    """
    if not patterns:
        return []
    names: set[str] = set()
    for pattern in patterns:
        matched = set()
        for op in ov_model.get_ops():
            if op.get_type_name() not in _WEIGHTED_OPS:
                continue
            fx_node = op.get_friendly_name().split("/", 1)[0]
            if any(fnmatch.fnmatchcase(path, pattern) for path in paths.get(fx_node, ())):
                matched.add(op.get_friendly_name())
        if not matched:
            known = sorted({p for ps in paths.values() for p in ps if p.count(".") <= 3 and p[0] != "_"})[:12]
            raise ValueError(
                f"quantization.exclude pattern {pattern!r} matches no MatMul / Gather of the model; allowed: "
                f"module paths or fnmatch patterns over them, e.g. {', '.join(known) or 'lm_head'}"
            )
        names |= matched
    return sorted(names)


@dataclass
class IrTarget:
    """``request.target`` of an OpenVINO ``artifact``-phase quantization method.

    Attributes:
        model: the converted, named ``openvino.Model`` (a method may compress it in place).
        module_paths: FX node name -> the module paths it was recorded under
            (:func:`module_paths` of the captured program; empty when unknown: then no ``exclude``
            pattern can match).
    """

    model: Any
    module_paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def excluded_ops(self, patterns: Sequence[str]) -> list[str]:
        """The IR op names ``patterns`` (``quantization.exclude``) keep in float
        (:func:`excluded_node_names`).

        Raises:
            ValueError: a pattern matches no MatMul / Gather.
        """
        return excluded_node_names(self.model, self.module_paths, patterns)


# -- calibration -------------------------------------------------------------------------------------
def calibration_feeds(
    ov_model: Any,
    quantization: QuantizationConfig,
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    max_length: int = 256,
) -> list[dict[str, np.ndarray]]:
    """The IR feeds of the prompts in ``quantization.calibration`` (one prefill per prompt).

    Each prompt (one line, at most ``max_length`` tokens) becomes one feed of ``ov_model``'s inputs:
    ``input_ids`` ``[1, n]``, ``attention_mask`` of ones, ``position_ids`` ``0..n-1``,
    ``token_type_ids`` zeros and, for a decoder with cache inputs, each cache tensor empty
    (``[1, heads, 0, head_dim]``, shaped like the sample's).

    Args:
        ov_model: the converted ``openvino.Model`` (inputs named by leaf path).
        quantization: the config (``calibration``, ``num_calibration_samples``).
        model: the eager model: its tokenizer folder (``config._name_or_path``) tokenizes the prompts.
        inputs: the sample forward kwargs (the cache shapes).
        max_length: prompts are cut to this many tokens.

    Returns:
        At most ``num_calibration_samples`` dicts ``{IR input name: numpy array}``.

    Raises:
        ValueError: no tokenizer next to the model, every prompt tokenizes to nothing, or the IR takes
            an input that is neither token ids, a mask, positions nor a cache tensor.
    """
    from hfexport.quality import model_tokenizer
    from hfexport.tensors import get_leaf_tensors
    from hfexport_openvino.naming import io_names_from_model

    lines = _prompt_lines(str(quantization.calibration))[: quantization.num_calibration_samples]
    tokenizer = model_tokenizer(model)
    if tokenizer is None:
        raise ValueError(
            "calibration prompts need the model's tokenizer, and none is saved next to it "
            f"({getattr(model.config, '_name_or_path', '') or 'no folder'}); export from a folder with "
            "tokenizer files or drop quantization.calibration (data-free compression)"
        )
    ids = [tokenizer(line, add_special_tokens=True)["input_ids"][:max_length] for line in lines]
    ids = [row for row in ids if row]
    if not ids:
        raise ValueError(
            f"calibration file {quantization.calibration}: every prompt tokenizes to no token; give prompts of text"
        )
    names = io_names_from_model(ov_model).inputs
    leaves = get_leaf_tensors(dict(inputs))
    feeds = []
    for row in ids:
        tokens = np.asarray([row], dtype=np.int64)
        feed: dict[str, np.ndarray] = {}
        for name, path in names.items():
            leaf = path.rsplit(".", 1)[-1]
            sample = leaves.get(path)
            if leaf == "input_ids":
                feed[name] = tokens
            elif leaf == "attention_mask":
                feed[name] = np.ones_like(tokens)
            elif leaf == "position_ids":
                feed[name] = np.arange(tokens.shape[1], dtype=np.int64)[None]
            elif leaf == "token_type_ids":
                feed[name] = np.zeros_like(tokens)
            elif sample is not None and sample.dim() == 4 and sample.is_floating_point():
                feed[name] = np.zeros((1, sample.shape[1], 0, sample.shape[3]), dtype=np.float32)
            else:
                raise ValueError(
                    f"calibration prompts cannot feed the IR input {path!r}; allowed inputs: input_ids, "
                    "attention_mask, position_ids, token_type_ids and KV-cache tensors. Drop "
                    "quantization.calibration (data-free compression)"
                )
        feeds.append(feed)
    return feeds


def check_group_size(ov_model: Any, group_size: int | None, excluded: Sequence[str] = ()) -> int:
    """The group size of ``int4-weight`` for ``ov_model``: ``group_size`` when it divides the input
    channels of every float MatMul weight; for ``None``, :data:`INT4_GROUP_SIZE` or, when that does
    not divide them (SmolLM2's hidden size 576), the largest smaller size of :data:`INT4_GROUP_SIZES`
    that does (64 there).

    Args:
        ov_model: the converted ``openvino.Model``.
        group_size: the requested size, or ``None`` for the default.
        excluded: op names left in float (not compressed, not checked).

    Returns:
        The group size to use.

    Raises:
        ValueError: no usable size; the message names the channel sizes and the group sizes of
            :data:`INT4_GROUP_SIZES` that divide them all.
    """
    sizes = set()
    for op in ov_model.get_ops():
        if op.get_type_name() != "MatMul" or op.get_friendly_name() in excluded:
            continue
        weight = op.input_value(1).get_node()
        if weight.get_type_name() != "Constant" or not weight.get_output_element_type(0).is_real():
            continue
        shape = list(weight.get_output_partial_shape(0).to_shape())
        if len(shape) != 2:
            continue
        sizes.add(int(shape[1] if op.get_transpose_b() else shape[0]))
    allowed = [g for g in INT4_GROUP_SIZES if all(size % g == 0 for size in sizes)]
    if group_size is None:
        fitting = [g for g in allowed if g <= INT4_GROUP_SIZE]
        if fitting:
            return fitting[-1]
        group_size = INT4_GROUP_SIZE
    bad = sorted(size for size in sizes if size % group_size)
    if bad:
        raise ValueError(
            f"quantization.group_size={group_size} does not divide the input channels {bad} of the model's "
            f"MatMul weights; allowed here: {', '.join(map(str, allowed)) or 'none of ' + str(INT4_GROUP_SIZES)}"
        )
    return group_size


# -- methods -----------------------------------------------------------------------------------------
def _ignored_scope(names: list[str]) -> Any:
    import nncf

    return nncf.IgnoredScope(names=names) if names else None


def compress_int8(
    ov_model: Any, quantization: QuantizationConfig, *, excluded: list[str], **_: Any
) -> tuple[Any, dict[str, Any]]:
    """``int8-weight``: ``nncf.compress_weights`` in ``INT8_ASYM`` (``INT8_SYM`` with
    ``symmetric=True``), per output channel, data-free.

    Args:
        ov_model: the converted ``openvino.Model`` (compressed in place).
        quantization: the config (``symmetric``).
        excluded: op names left in float (:func:`excluded_node_names`).

    Returns:
        ``(compressed model, {"mode": ..., "group_size": None, ...})``.
    """
    import nncf

    mode = nncf.CompressWeightsMode.INT8_SYM if quantization.symmetric else nncf.CompressWeightsMode.INT8_ASYM
    compressed = nncf.compress_weights(ov_model, mode=mode, ignored_scope=_ignored_scope(excluded))
    return compressed, {"mode": mode.value, "group_size": None, "ratio": 1.0, "backup_mode": None}


def compress_int4(
    ov_model: Any,
    quantization: QuantizationConfig,
    *,
    excluded: list[str],
    calibration: Callable[[], tuple[Any, int]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``int4-weight``: ``nncf.compress_weights`` in ``INT4_ASYM`` (``INT4_SYM`` with
    ``symmetric=True``), groups of ``group_size`` (default: :func:`check_group_size`), ratio 1.0, the
    embedding and the last MatMul in ``INT8_ASYM`` (NNCF's backup mode); with ``calibration``, AWQ
    and scale estimation on its dataset.

    Args:
        ov_model: the converted ``openvino.Model`` (compressed in place).
        quantization: the config (``group_size``, ``symmetric``).
        excluded: op names left in float (:func:`excluded_node_names`).
        calibration: ``None`` (data-free) or a callable returning ``(nncf.Dataset, samples)``
            (built from the IR feeds of :func:`calibration_feeds`).

    Returns:
        ``(compressed model, facts)``: mode, group size, ratio, backup mode, awq, scale estimation,
        calibration samples.
    """
    import nncf

    mode = nncf.CompressWeightsMode.INT4_SYM if quantization.symmetric else nncf.CompressWeightsMode.INT4_ASYM
    group_size = check_group_size(ov_model, quantization.group_size, excluded)
    dataset, samples = calibration() if calibration is not None else (None, 0)
    compressed = nncf.compress_weights(
        ov_model,
        mode=mode,
        group_size=group_size,
        ratio=1.0,
        backup_mode=nncf.BackupMode.INT8_ASYM,
        ignored_scope=_ignored_scope(excluded),
        dataset=dataset,
        subset_size=max(samples, 1),
        awq=dataset is not None,
        scale_estimation=dataset is not None,
    )
    return compressed, {
        "mode": mode.value,
        "group_size": group_size,
        "ratio": 1.0,
        "backup_mode": nncf.BackupMode.INT8_ASYM.value,
        "awq": dataset is not None,
        "scale_estimation": dataset is not None,
        "calibration_samples": samples,
    }


def _apply(
    request: QuantizationRequest, compress: Callable[..., tuple[Any, dict[str, Any]]]
) -> QuantizationResult:
    """Run ``compress`` on ``request.target`` (an :class:`IrTarget` or a bare ``openvino.Model``)
    and collect the facts of ``report.quantization``."""
    import nncf

    quantization = request.quantization
    target = request.target if isinstance(request.target, IrTarget) else IrTarget(request.target)
    before = weight_bytes(target.model)
    excluded = target.excluded_ops(quantization.exclude)
    calibration = None
    if request.calibration:
        feeds = list(request.calibration)

        def calibration() -> tuple[Any, int]:
            return nncf.Dataset(feeds), len(feeds)

    compressed, facts = compress(target.model, quantization, excluded=excluded, calibration=calibration)
    after = weight_bytes(compressed)
    ops = compressed_op_counts(compressed)
    detail = f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB; " + (
        ", ".join(f"{op} x{n}" for op, n in ops.items()) or "no op compressed"
    )
    return QuantizationResult(
        IrTarget(compressed, target.module_paths),
        {
            "options": {name: quantization.to_dict()[name] for name in quantization.given_options()},
            "tool": f"nncf {nncf.__version__}",
            **facts,
            "excluded": excluded,
            "weights_bytes_before": before,
            "weights_bytes_after": after,
            "quantized_ops": ops,
        },
        detail,
    )


def apply_int8_weight(request: QuantizationRequest) -> QuantizationResult:
    """``int8-weight`` (phase ``artifact``): :func:`compress_int8` on ``request.target``.

    Args:
        request: ``target`` an :class:`IrTarget` (or an ``openvino.Model``: no module paths, so no
            ``exclude``); ``quantization`` the config.

    Returns:
        ``target`` the compressed :class:`IrTarget`; ``facts`` the options, NNCF version and mode,
        excluded op names, ``weights_bytes_before`` / ``weights_bytes_after`` (:func:`weight_bytes`)
        and ``quantized_ops`` (:func:`compressed_op_counts`).

    Raises:
        ValueError: an ``exclude`` pattern matching no MatMul / Gather.
    """
    return _apply(request, compress_int8)


def apply_int4_weight(request: QuantizationRequest) -> QuantizationResult:
    """``int4-weight`` (phase ``artifact``): :func:`compress_int4` on ``request.target``, with AWQ and
    scale estimation on ``request.calibration`` (IR feeds, :func:`calibration_feeds`) when given.

    Args:
        request: as :func:`apply_int8_weight`, plus ``calibration``: ``None`` (data-free) or a list of
            feeds ``{IR input name: numpy array}``.

    Returns:
        As :func:`apply_int8_weight`, the facts also holding group size, ratio, backup mode, ``awq``,
        ``scale_estimation`` and ``calibration_samples``.

    Raises:
        ValueError: an ``exclude`` pattern matching no op; a group size that does not divide the
            MatMul input channels (:func:`check_group_size`).
    """
    return _apply(request, compress_int4)
