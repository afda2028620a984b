"""Export configurations: plain dataclasses that round-trip through dicts and JSON.

They live in the core so that a config, or an export recipe file (``export_config.json``), can be
read and checked without the backend that will run it installed.

``dynamic_shapes`` follows ``torch.export.export`` semantics (a pytree matching the forward kwargs
whose leaves are ``torch.export.Dim`` objects, ``Dim.AUTO``/``Dim.STATIC``/``Dim.DYNAMIC`` hints,
integers or ``None``); in JSON a ``Dim`` is stored with its name, min and max and comes back as an
equivalent ``Dim``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hfexport.config_flags import CLI, CliFlag

__all__ = [
    "ACCURACY_LEVELS",
    "DTYPES",
    "ORT_FUSION_TARGETS",
    "QUANTIZATION_OPTIONS",
    "QUANTIZATION_PHASES",
    "CaptureConfig",
    "DynamoConfig",
    "ExecutorchConfig",
    "ExportConfigMixin",
    "ExportFormat",
    "OnnxConfig",
    "OpenvinoConfig",
    "QuantizationConfig",
    "QuantizationMethod",
    "calibration_file",
    "check_dynamic_shapes_leaves",
    "check_opset_version",
    "decode_dynamic_shapes",
    "encode_dynamic_shapes",
    "format_name",
    "is_quality_gated",
    "onnx_opset_range",
    "parse_ort_fusion_target",
    "parse_quality_gates",
]


class ExportFormat(enum.StrEnum):
    """The built-in export formats; the value is the entry-point name of the backend.

    ``export_format`` itself is an open, registered name: a third-party backend adds its own (say
    ``"myformat"``) through :func:`hfexport.auto.register_exporter` or an ``hfexport.exporters``
    entry point, without a member here. Use :func:`format_name` to normalise either kind.
    """

    DYNAMO = "dynamo"
    ONNX = "onnx"
    EXECUTORCH = "executorch"
    OPENVINO = "openvino"

    @classmethod
    def parse(cls, value: str | ExportFormat) -> ExportFormat:
        """Return the built-in member for ``value`` (the enum itself or its string value).

        Raises:
            ValueError: ``value`` names no built-in format; the message lists the built-in ones
                (a plugin's format is not a member: use :func:`format_name` for open names).
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(
                f"export_format={value!r} is not a built-in export format; built-in: {allowed} "
                "(plugins register more: hfexport.available_export_formats() lists them)"
            ) from None


def format_name(value: Any) -> str:
    """The export-format name for ``value``: an :class:`ExportFormat` member or any registered name.

    Built-in names are matched case-insensitively (``"ONNX"`` -> ``"onnx"``); other names are kept
    as given, stripped of surrounding whitespace.

    Raises:
        ValueError: ``value`` is not a non-empty string (or an ``ExportFormat``).
    """
    if isinstance(value, ExportFormat):
        return value.value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"export_format={value!r} is invalid; allowed: a format name such as "
            + ", ".join(repr(m.value) for m in ExportFormat)
            + " or one a plugin registers"
        )
    name = value.strip()
    return name.lower() if name.lower() in ExportFormat._value2member_map_ else name


# --------------------------------------------------------------------------------------------------
# dynamic_shapes <-> JSON
# --------------------------------------------------------------------------------------------------
_DIM_KEY = "__dim__"
_HINT_KEY = "__dim_hint__"
_TUPLE_KEY = "__tuple__"
_INTMAP_KEY = "__int_keys__"


def _finite_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    if math.isinf(as_float):
        return None
    return int(value)


def encode_dynamic_shapes(spec: Any) -> Any:
    """Turn a ``dynamic_shapes`` pytree into JSON-safe data.

    Args:
        spec: ``None``, or a nest of dicts/lists/tuples whose leaves are ``torch.export.Dim``,
            ``Dim.AUTO``/``Dim.STATIC``/``Dim.DYNAMIC``, ints or ``None``. Dicts keyed by dimension
            index (ints) are kept as such.

    Returns:
        The same nest with every ``Dim`` replaced by ``{"__dim__": {"name", "min", "max"}}`` (an
        unbounded max is stored as ``null``), hints by ``{"__dim_hint__": "AUTO"}``, tuples by
        ``{"__tuple__": [...]}`` and int-keyed dicts by ``{"__int_keys__": [[k, v], ...]}``.

    Raises:
        ValueError: a leaf of a type ``torch.export`` does not accept in ``dynamic_shapes``.
    """
    if spec is None or isinstance(spec, (bool, int, str)):
        return spec
    if isinstance(spec, dict):
        if spec and all(isinstance(k, int) for k in spec):
            return {_INTMAP_KEY: [[k, encode_dynamic_shapes(v)] for k, v in spec.items()]}
        return {str(k): encode_dynamic_shapes(v) for k, v in spec.items()}
    if isinstance(spec, tuple):
        return {_TUPLE_KEY: [encode_dynamic_shapes(v) for v in spec]}
    if isinstance(spec, list):
        return [encode_dynamic_shapes(v) for v in spec]
    hint_type = getattr(spec, "type", None)
    if type(spec).__name__ == "_DimHint" and hint_type is not None:
        return {_HINT_KEY: hint_type.name}
    if hasattr(spec, "__name__") and hasattr(spec, "min") and hasattr(spec, "max"):
        return {
            _DIM_KEY: {
                "name": spec.__name__,
                "min": _finite_or_none(spec.min),
                "max": _finite_or_none(spec.max),
            }
        }
    raise ValueError(
        f"dynamic_shapes leaf {spec!r} of type {type(spec).__name__} is not supported; use "
        "torch.export.Dim, Dim.AUTO/STATIC/DYNAMIC, an int or None"
    )


_LEAF_ALLOWED = "torch.export.Dim(name, min=..., max=...), Dim.AUTO, Dim.STATIC, Dim.DYNAMIC, an int or None"


def check_dynamic_shapes_leaves(spec: Any, where: str = "dynamic_shapes") -> None:
    """Refuse leaves of a ``dynamic_shapes`` pytree that ``torch.export`` would reject at capture.

    A ``str`` leaf (``{"input_ids": {0: "batch"}}``) and a ``bool`` or ``float`` leaf are refused
    here, when the config is built, instead of by torch's ``UserError`` once capture has started.
    Strings are accepted as dict keys (the forward kwarg names) only.

    Args:
        spec: the ``dynamic_shapes`` value (dicts, lists, tuples; leaves as ``torch.export`` takes).
        where: how the value is named in the message.

    Raises:
        ValueError: a leaf of an unsupported type; the message names where it sits
            (``dynamic_shapes['input_ids'][0]``), its value, and what is allowed (for a string,
            the ``Dim`` to write instead).
    """
    if isinstance(spec, Mapping):
        for key, value in spec.items():
            check_dynamic_shapes_leaves(value, f"{where}[{key!r}]")
        return
    if isinstance(spec, (list, tuple)):
        for i, value in enumerate(spec):
            check_dynamic_shapes_leaves(value, f"{where}[{i}]")
        return
    if isinstance(spec, str):
        hint = f"Dim({spec!r})" if spec.isidentifier() else "Dim('batch')"
        raise ValueError(
            f"{where}={spec!r} is invalid; allowed: {_LEAF_ALLOWED}; a string names no dimension to "
            f"torch.export: write {hint} (from torch.export import Dim)"
        )
    if isinstance(spec, (bool, float)):
        raise ValueError(f"{where}={spec!r} is invalid; allowed: {_LEAF_ALLOWED}")


def _dim_bound(spec: Mapping[str, Any], key: str, where: str) -> int | None:
    """The ``min``/``max`` of an encoded ``Dim``: ``None``, or a non-negative int (an int-valued
    float, as some JSON writers store it, is accepted)."""
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{where}: Dim {spec.get('name')!r} has {key}={value!r}, which is invalid; allowed: a "
            f'non-negative integer or null (no bound), e.g. {{"name": "batch", "min": 1, "max": 64}}'
        )
    return value


def decode_dynamic_shapes(data: Any, _where: str = "dynamic_shapes") -> Any:
    """Inverse of :func:`encode_dynamic_shapes`: rebuild ``Dim`` objects and hints.

    A ``Dim`` comes back as ``torch.export.Dim(name, min=..., max=...)`` (torch ``Dim`` objects
    compare by identity, so the result is an equivalent, not the identical, object).

    Raises:
        ValueError: an entry that is not an encoded dynamic-shapes value, or a ``Dim`` whose
            ``min`` exceeds its ``max``; the message names where it sits (``dynamic_shapes['input_ids'][0]``).
    """
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if isinstance(data, list):
        return [decode_dynamic_shapes(v, f"{_where}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, dict):
        if set(data) == {_DIM_KEY}:
            from torch.export import Dim

            spec = data[_DIM_KEY]
            if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
                raise ValueError(
                    f"{_where}: {data!r} is not a valid encoded Dim; allowed: "
                    '{"__dim__": {"name": "batch", "min": 1, "max": 64}} (min and max may be null)'
                )
            kwargs = {}
            for bound in ("min", "max"):
                value = _dim_bound(spec, bound, _where)
                if value is not None:
                    kwargs[bound] = value
            if "min" in kwargs and "max" in kwargs and kwargs["min"] > kwargs["max"]:
                raise ValueError(
                    f"{_where}: Dim {spec.get('name')!r} has min={kwargs['min']} > max={kwargs['max']}; "
                    "give a range with min <= max"
                )
            return Dim(spec["name"], **kwargs)
        if set(data) == {_HINT_KEY}:
            from torch.export import Dim

            if data[_HINT_KEY] not in ("AUTO", "STATIC", "DYNAMIC"):
                raise ValueError(
                    f"{_where}: {_HINT_KEY}={data[_HINT_KEY]!r} is invalid; allowed: 'AUTO', 'STATIC', 'DYNAMIC'"
                )
            return getattr(Dim, data[_HINT_KEY])
        if set(data) == {_TUPLE_KEY}:
            return tuple(decode_dynamic_shapes(v, f"{_where}[{i}]") for i, v in enumerate(data[_TUPLE_KEY]))
        if set(data) == {_INTMAP_KEY}:
            pairs = data[_INTMAP_KEY]
            if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                for p in pairs
            ):
                raise ValueError(
                    f"{_where}: {_INTMAP_KEY}={pairs!r} is invalid; allowed: a list of [axis, dim] pairs "
                    'with integer axes, e.g. [[0, {"__dim__": {"name": "batch", "min": 1, "max": 64}}]]'
                )
            return {k: decode_dynamic_shapes(v, f"{_where}[{k}]") for k, v in pairs}
        return {k: decode_dynamic_shapes(v, f"{_where}[{k!r}]") for k, v in data.items()}
    raise ValueError(f"cannot decode dynamic_shapes entry {data!r}")


def read_json_object(path: str | os.PathLike[str], *, what: str = "an export config") -> dict[str, Any]:
    """The JSON object stored in ``path`` (an ``export_config.json``).

    Raises:
        ValueError: the file is not UTF-8, not JSON, or holds something other than an object; the
            message names the file, the position of a syntax error and what the file should hold.
        OSError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{os.fspath(path)} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
            f"it should hold {what} as a JSON object: fix or rewrite it (config.to_json_file(path))"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{os.fspath(path)} is not UTF-8 text ({error.reason} at byte {error.start}); it should hold {what} "
            "as a JSON object"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{os.fspath(path)} holds a JSON {type(data).__name__}, not an object; it should hold {what} as a "
            'JSON object such as {"export_format": "onnx", ...}'
        )
    return data


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
@dataclass
class ExportConfigMixin:
    """Base of every export configuration.

    Subclasses are dataclasses that name their format one of two ways: a ``FORMAT`` class
    attribute (the built-in configs), or a default for the ``export_format`` field
    (``export_format: str = "myformat"``, the way a plugin's config does it);
    :func:`hfexport.auto.register_export_config` sets ``FORMAT`` for a class that names neither.
    Values are checked in ``__post_init__`` (and so on every construction and ``from_dict``); a bad
    value raises ``ValueError`` naming the field and what is allowed.
    """

    FORMAT: ClassVar[str | None] = None

    export_format: str = ""

    @classmethod
    def declared_format(cls) -> str | None:
        """The format this class is for: its ``export_format`` field default, else ``FORMAT``.

        ``None`` for a class that names no format (``ExportConfigMixin`` itself).
        """
        field_ = cls.__dataclass_fields__.get("export_format")  # type: ignore[attr-defined]
        default = getattr(field_, "default", "")
        if isinstance(default, (str, ExportFormat)) and default:
            return format_name(default)
        return format_name(cls.FORMAT) if cls.FORMAT else None

    def __post_init__(self) -> None:
        expected = self.declared_format()
        if self.export_format in ("", None):
            if expected is None:
                raise ValueError(
                    "export_format is required; allowed: a format name such as "
                    + ", ".join(m.value for m in ExportFormat)
                    + " or one a plugin registers"
                )
            self.export_format = expected
        fmt = format_name(self.export_format)
        if expected is not None and fmt != expected:
            raise ValueError(
                f"{type(self).__name__} has export_format={expected!r}, got {fmt!r}; "
                "use AutoExportConfig.from_dict to pick the config class from export_format"
            )
        self.export_format = fmt
        self.validate_fields()
        object.__setattr__(self, "_hfexport_checked", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a field and check the config again, as construction does.

        ``config.atol = -5`` raises the same ``ValueError`` as ``DynamoConfig(atol=-5)``, naming the
        field, the value and what is allowed, and leaves the config as it was; setting a field
        while the config is being constructed or checked, or setting a non-field attribute, is
        not checked here.

        Raises:
            ValueError: the new value (or the config with it) is invalid.
        """
        state = self.__dict__
        if (
            not state.get("_hfexport_checked")
            or state.get("_hfexport_checking")
            or name not in getattr(type(self), "__dataclass_fields__", {})
        ):
            object.__setattr__(self, name, value)
            return
        before = dict(state)
        object.__setattr__(self, name, value)
        state["_hfexport_checking"] = True
        try:
            self.__post_init__()
        except BaseException:
            state.clear()
            state.update(before)
            raise
        finally:
            state.pop("_hfexport_checking", None)

    # subclasses extend this
    def validate_fields(self) -> None:
        """Check every field; raise ``ValueError`` naming the field and the allowed values."""

    # -- dict / JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict of every field (``dynamic_shapes`` encoded, see module doc)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "dynamic_shapes":
                value = encode_dynamic_shapes(value)
            elif isinstance(value, QuantizationConfig):
                value = value.to_dict()
            elif isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExportConfigMixin:
        """Build a config from a dict as produced by :meth:`to_dict` (or written by hand).

        Raises:
            ValueError: an unknown key (the message lists the known ones), a wrong
                ``export_format`` or an invalid value.
            TypeError: ``data`` is not a mapping.
        """
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
        values = dict(data)
        if "dynamic_shapes" in values:
            values["dynamic_shapes"] = decode_dynamic_shapes(values["dynamic_shapes"])
        return cls(**values)

    def to_json_string(self) -> str:
        """The config as indented, key-sorted JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json_string(cls, text: str) -> ExportConfigMixin:
        """Inverse of :meth:`to_json_string`."""
        return cls.from_dict(json.loads(text))

    def to_json_file(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json_string` to ``path`` atomically."""
        from hfexport.atomic import atomic_write_text

        atomic_write_text(path, self.to_json_string())

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> ExportConfigMixin:
        """Read a config written by :meth:`to_json_file`.

        Raises:
            ValueError: the file is not UTF-8 JSON holding an object, or a field is invalid; the
                message names the file.
            OSError: the file cannot be read.
        """
        return cls.from_dict(read_json_object(path, what=f"a {cls.__name__}"))

    def replace(self, **changes: Any) -> ExportConfigMixin:
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)


def _resolve_target(target: Any) -> Any:
    """A callable as is, a ``"module:function"`` string imported, ``None`` as ``None``."""
    if target is None or callable(target):
        return target
    module, _, attr = str(target).partition(":")
    if not module or not attr:
        raise ValueError(f"{target!r} is not a callable or a 'module:function' string")
    import importlib

    return getattr(importlib.import_module(module), attr)


def _check_type(name: str, value: Any, types: tuple[type, ...], allowed: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


#: Compute dtypes an export can capture in (``ExportConfig.dtype``); names as ``torch.<name>``.
DTYPES = ("float32", "float16", "bfloat16")

#: ONNX Runtime execution providers ``OnnxConfig.ort_fusions`` can target.
ORT_FUSION_TARGETS = ("cpu", "cuda")


#: Help sections of ``hfexport export --help`` for the flags every backend shares.
CAPTURE_PANEL = "Capture and validation"
QUANTIZATION_PANEL = "Quantization (with --quantize METHOD)"

#: The metrics ``--gate`` names (``CaptureConfig.quality_gates`` keys), for its error message.
GATE_METRICS = (
    "cosine",
    "cosine_min",
    "top1_agreement",
    "max_abs_diff",
    "cache_cosine",
    "perplexity_ratio",
    "kl_divergence",
    "top1_agreement_text",
)


def calibration_file(path: str | os.PathLike[str]) -> str:
    """``--calibration``'s value as ``QuantizationConfig.calibration``: the path of an existing file.

    Raises:
        ValueError: ``path`` is not a file.
    """
    if not Path(path).is_file():
        raise ValueError(f"{path} is not a file; allowed: a UTF-8 text file, one prompt per line")
    return os.fspath(path)


def parse_quality_gates(items: list[str]) -> dict[str, float]:
    """``--gate`` values as ``CaptureConfig.quality_gates``: ``["cosine=0.98"]`` -> ``{"cosine": 0.98}``.

    Raises:
        ValueError: an item that is not ``METRIC=THRESHOLD`` with a float threshold.
    """
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(
                f"{item!r} is not METRIC=THRESHOLD; allowed metrics: {', '.join(GATE_METRICS)} "
                "(e.g. --gate cosine=0.98)"
            ) from None
    return out


#: byte-size suffixes :func:`parse_byte_size` reads (binary and decimal units; case-insensitive)
BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_byte_size(value: str) -> int:
    """A byte count from the command line: ``"1073741824"``, ``"4GiB"``, ``"512MiB"``, ``"2GB"``.

    Units (case-insensitive): ``B``, ``KB``/``MB``/``GB`` (powers of 1000), ``KiB``/``MiB``/``GiB``
    (powers of 1024); a fraction is allowed with a unit (``1.5GiB``) and rounded down to bytes.

    Raises:
        ValueError: not a number with one of those units, or not positive.
    """
    text = str(value).strip().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number) :].lower()
    try:
        size = int(float(number) * BYTE_UNITS[unit])
    except (KeyError, ValueError):
        size = 0
    if size <= 0 or not number:
        raise ValueError(
            f"{value!r} is not a positive byte size; allowed: a number of bytes or a number with a unit "
            "(KiB, MiB, GiB, KB, MB, GB), e.g. 4GiB"
        )
    return size


def parse_ort_fusion_target(value: str) -> str:
    """``--ort-fusions``'s value as ``OnnxConfig.ort_fusions`` (one of :data:`ORT_FUSION_TARGETS`).

    Raises:
        ValueError: another value; the message names the targets (the config's own message names
            Python's ``None``, which the command line cannot give).
    """
    if value not in ORT_FUSION_TARGETS:
        raise ValueError(
            f"{value!r} is not a fusion target; --ort-fusions must be one of: {', '.join(ORT_FUSION_TARGETS)} "
            "(or omit it for a graph without fused ops)"
        )
    return value


#: The :class:`QuantizationConfig` fields a quantization method may read besides ``method``
#: (the names a :class:`QuantizationMethod` lists).
QUANTIZATION_OPTIONS = (
    "group_size",
    "embedding_bits",
    "per_channel",
    "exclude",
    "calibration",
    "num_calibration_samples",
    "symmetric",
    "accuracy_level",
)

#: ``QuantizationConfig.accuracy_level`` values: ONNX Runtime ``MatMulNBits``' minimum compute
#: precision of the activations (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


#: Where a quantization method runs (:attr:`QuantizationMethod.phase`): ``source`` on the eager
#: module before capture, ``program`` on the captured ``ExportedProgram``, ``artifact`` on the
#: backend's lowered artifact (an ONNX graph ...).
QUANTIZATION_PHASES = ("source", "program", "artifact")


@dataclass(frozen=True)
class QuantizationMethod:
    """One quantization method of a backend: what it does, which :class:`QuantizationConfig`
    options it reads, and where and with what function it runs (``HfExporter.quantization_methods``
    maps each method name to one; :func:`hfexport.quantization.register_quantization_method` adds
    one to a backend from outside).

    An option the method does not read is refused before capture
    (:meth:`QuantizationConfig.check_options`, run by ``HfExporter.check_precision``) instead of
    being silently ignored.

    Attributes:
        description: one line saying what the method does.
        options: the fields of :class:`QuantizationConfig` besides ``method`` that the method always
            reads (names from :data:`QUANTIZATION_OPTIONS`).
        options_if: fields it reads only together with another field:
            ``{"group_size": ("embedding_bits", 4)}`` reads ``group_size`` only when
            ``embedding_bits == 4``; a required value of ``None`` means "when that field is set".
        phase: where ``apply`` runs, one of :data:`QUANTIZATION_PHASES`: ``"source"`` (the eager
            module, before capture, inside the shared capture step
            :meth:`hfexport.exporter.HfExporter.captured_program`), ``"program"`` (the captured
            ``ExportedProgram``, right after capture, same step), ``"artifact"`` (the lowered
            artifact, where the backend calls :meth:`hfexport.exporter.HfExporter.quantize_artifact`).
            ``None`` (with ``apply=None``): the method is only declared, and the backend applies it
            itself.
        apply: the function that quantizes, ``apply(request) -> result``
            (:class:`hfexport.quantization.QuantizationRequest` ->
            :class:`hfexport.quantization.QuantizationResult`), a callable or a lazy
            ``"module:function"`` string imported at the first export that uses it.
        prepare: an optional second function of the same signature run in the ``source`` phase of
            a method whose ``phase`` is later: it adapts the eager module to what ``apply`` will
            quantize (ExecuTorch ``int8-dynamic``: GPT-2 ``Conv1D`` as ``nn.Linear``, embeddings).
        stage: the report stage ``apply`` runs in (default ``"quantize"``; ExecuTorch's PT2E
            ``int8-dynamic`` runs in ``"quantize_pt2e"``); ``prepare`` always runs in ``"quantize"``.

    Raises:
        ValueError: a name that is not one of :data:`QUANTIZATION_OPTIONS`; a ``phase`` not in
            :data:`QUANTIZATION_PHASES`; ``apply`` without ``phase`` or the reverse; ``prepare``
            with a ``source`` phase (``apply`` is the source function then); an empty ``stage``.
    """

    description: str
    options: frozenset[str] = frozenset()
    options_if: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    phase: str | None = None
    apply: Callable[[Any], Any] | str | None = None
    prepare: Callable[[Any], Any] | str | None = None
    stage: str = "quantize"

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", frozenset(self.options))
        object.__setattr__(self, "options_if", dict(self.options_if))
        named = [*self.options, *self.options_if, *(dep for dep, _ in self.options_if.values())]
        unknown = sorted(set(named) - set(QUANTIZATION_OPTIONS))
        if unknown:
            raise ValueError(
                f"QuantizationMethod names unknown option(s) {unknown}; allowed: {', '.join(QUANTIZATION_OPTIONS)}"
            )
        if self.phase is not None and self.phase not in QUANTIZATION_PHASES:
            raise ValueError(
                f"QuantizationMethod phase={self.phase!r} is invalid; allowed: {', '.join(QUANTIZATION_PHASES)}"
            )
        if (self.phase is None) != (self.apply is None):
            raise ValueError(
                "QuantizationMethod needs phase and apply together (the phase says where apply runs); "
                f"got phase={self.phase!r}, apply={self.apply!r}"
            )
        if self.prepare is not None and self.phase in (None, "source"):
            raise ValueError(
                "QuantizationMethod prepare= runs in the source phase before a later phase's apply; with "
                f"phase={self.phase!r} give the source function as apply= (allowed phases with prepare: "
                "program, artifact)"
            )
        if not isinstance(self.stage, str) or not self.stage:
            raise ValueError(f"QuantizationMethod stage={self.stage!r} is invalid; allowed: a stage name")

    def resolve_apply(self) -> Callable[[Any], Any] | None:
        """``apply`` as a callable (a lazy ``"module:function"`` imported now), ``None`` when unset.

        Raises:
            ImportError, AttributeError: the lazy target does not exist.
        """
        return _resolve_target(self.apply)

    def source_function(self) -> Callable[[Any], Any] | None:
        """The function of the ``source`` phase: ``apply`` for a source method, ``prepare`` for a
        later one, ``None`` when the method does nothing to the eager module."""
        return _resolve_target(self.apply if self.phase == "source" else self.prepare)

    def __str__(self) -> str:
        return self.description

    def reads(self, name: str, quantization: QuantizationConfig) -> bool:
        """Whether this method reads the option ``name`` of ``quantization``."""
        if name in self.options:
            return True
        if name not in self.options_if:
            return False
        dependency, required = self.options_if[name]
        if dependency not in quantization.given_options():
            return False
        return required is None or getattr(quantization, dependency) == required

    def describe_options(self) -> str:
        """The options it reads, in :data:`QUANTIZATION_OPTIONS` order, e.g. ``"per_channel, exclude"``
        or ``"group_size (with embedding_bits=4)"``; ``"none"`` when it reads only the method name."""
        parts = [name for name in QUANTIZATION_OPTIONS if name in self.options]
        for name in QUANTIZATION_OPTIONS:
            if name in self.options_if and name not in self.options:
                dependency, required = self.options_if[name]
                parts.append(
                    f"{name} (with {dependency} set)"
                    if required is None
                    else f"{name} (with {dependency}={required})"
                )
        return ", ".join(parts) or "none"


@dataclass
class QuantizationConfig:
    """What to quantize and how (``ExportConfig.quantization``); the backend applies it.

    Which ``method`` names exist is the backend's: each exporter lists its own in
    ``HfExporter.quantization_methods`` (e.g. ONNX ``int8-dynamic``, ``int8-static``, ``int4-weight``;
    ExecuTorch ``8da4w``, ``int8-dynamic``; dynamo ``int8-weight``), each a :class:`QuantizationMethod`
    declaring the options below that it reads. An unknown name, and an option the chosen method does
    not read (``calibration`` for a dynamic method, ``group_size`` for an 8-bit one,
    ``per_channel=False`` for a 4-bit one ...), are refused by the exporter before capture
    (:meth:`check_options`), with what is allowed.

    Attributes:
        method: the quantization recipe name.
        group_size: elements per quantization group / block for grouped (4-bit) weights
            (``None`` takes the method's default, e.g. 32 for ``8da4w``, 16 for ONNX ``int4-weight``).
        embedding_bits: also quantize the token embedding to 4 or 8 bits (ExecuTorch); for ONNX
            ``int4-weight``, the bits of a tied LM head and the embedding gathered from its blocks
            (``None``: 8); ``None`` leaves it.
        per_channel: per-output-channel weight scales (True) or one per tensor.
        exclude: fully qualified module names (or ``fnmatch`` patterns over them) left in float,
            e.g. ``("lm_head",)``.
        calibration: a UTF-8 text file of prompts, one per line, tokenized with the model's tokenizer
            for static methods; ``None`` calibrates on the sample inputs plus seeded random variants
            (with a warning). The Python API also accepts an iterable of forward-kwarg dicts where the
            exporter takes ``calibration=``.
        num_calibration_samples: at most this many calibration batches are run.
        symmetric: block-quantized weights with a zero point (False) or without (True); ``None``
            takes the method's default (True for ONNX ``int4-weight`` / ``int8-weight``).
        accuracy_level: ONNX Runtime ``MatMulNBits`` minimum activation compute precision, one of
            :data:`ACCURACY_LEVELS` (4: int8, the CPU fast path); ``None`` takes the method's
            default (4 for ONNX ``int4-weight`` / ``int8-weight``).
    """

    method: str
    group_size: int | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--group-size",
                "Block/group size of 4-bit weights (onnx int4-weight block, executorch 8da4w / 4w group).",
                type="int",
            )
        },
    )
    embedding_bits: int | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--embedding-bits",
                "Token embeddings in 4 or 8 bits (executorch; onnx int4-weight: the bits of a tied LM head "
                "and the embedding it shares, default 8).",
                choices=("4", "8"),
                parse=int,
            )
        },
    )
    per_channel: bool = field(
        default=True,
        metadata={
            CLI: CliFlag(
                "--per-tensor",
                "One weight scale per tensor instead of per output channel (int8 methods).",
                switch=True,
                set_to=False,
            )
        },
    )
    exclude: tuple[str, ...] = field(
        default=(),
        metadata={
            CLI: CliFlag(
                "--quantize-exclude",
                "Leave this module in float (a module path or fnmatch pattern, e.g. lm_head); repeatable.",
                repeat=True,
                metavar="MODULE",
            )
        },
    )
    calibration: str | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--calibration",
                "Text file of calibration prompts, one per line (methods that calibrate: onnx int8-static).",
                type="Path",
                parse=calibration_file,
            )
        },
    )
    num_calibration_samples: int = field(
        default=32,
        metadata={
            CLI: CliFlag(
                "--calibration-samples",
                "At most this many calibration batches (static quantization; default 32).",
                type="int",
            )
        },
    )
    symmetric: bool | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--asymmetric",
                "Block-quantized weights with zero points (onnx int4-weight / int8-weight; default symmetric).",
                switch=True,
                set_to=False,
            )
        },
    )
    accuracy_level: int | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--accuracy-level",
                "MatMulNBits minimum compute precision: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 "
                "(onnx int4-weight / int8-weight; default 4).",
                type="int",
            )
        },
    )

    def __post_init__(self) -> None:
        _check_type("quantization.method", self.method, (str,), "a method name such as 'int8-dynamic'")
        if not self.method:
            raise ValueError("quantization.method is empty; allowed: a method name such as 'int8-dynamic'")
        if self.group_size is not None:
            _check_type("quantization.group_size", self.group_size, (int,), "a positive int or None")
            if self.group_size <= 0:
                raise ValueError(
                    f"quantization.group_size={self.group_size} is invalid; allowed: a positive int or None"
                )
        if self.embedding_bits is not None and self.embedding_bits not in (4, 8):
            raise ValueError(
                f"quantization.embedding_bits={self.embedding_bits!r} is invalid; allowed: 4, 8 or None"
            )
        _check_type("quantization.per_channel", self.per_channel, (bool,), "True or False")
        if isinstance(self.exclude, str):
            self.exclude = (self.exclude,)
        self.exclude = tuple(self.exclude)
        for name in self.exclude:
            _check_type("quantization.exclude", name, (str,), "module names or fnmatch patterns")
        if self.calibration is not None:
            if isinstance(self.calibration, os.PathLike):
                self.calibration = os.fspath(self.calibration)
            _check_type("quantization.calibration", self.calibration, (str,), "a text file path or None")
        _check_type(
            "quantization.num_calibration_samples", self.num_calibration_samples, (int,), "a positive int"
        )
        if self.num_calibration_samples <= 0:
            raise ValueError(
                f"quantization.num_calibration_samples={self.num_calibration_samples} is invalid; "
                "allowed: a positive int"
            )
        if self.symmetric is not None:
            _check_type("quantization.symmetric", self.symmetric, (bool,), "True, False or None")
        if self.accuracy_level is not None:
            _check_type("quantization.accuracy_level", self.accuracy_level, (int,), "0, 1, 2, 3, 4 or None")
            if self.accuracy_level not in ACCURACY_LEVELS:
                raise ValueError(
                    f"quantization.accuracy_level={self.accuracy_level!r} is invalid; allowed: "
                    f"{', '.join(map(str, ACCURACY_LEVELS))} or None (MatMulNBits: 0 unset, 1 fp32, 2 fp16, "
                    "3 bf16, 4 int8 compute)"
                )

    def given_options(self) -> list[str]:
        """The options (:data:`QUANTIZATION_OPTIONS`) set to something other than their default, in
        that order: what the chosen method must read for the config to mean what it says."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in QUANTIZATION_OPTIONS if getattr(self, name) != defaults[name]]

    def check_options(self, methods: Mapping[str, Any], backend: str) -> None:
        """Refuse an option the method does not read (it would be silently ignored).

        Args:
            methods: the backend's ``HfExporter.quantization_methods``: method name ->
                :class:`QuantizationMethod` (a plain description string declares no options and is
                not checked).
            backend: the export format, for the message.

        Raises:
            ValueError: ``quantization.<option>=<value> is not read by ...``: the message names the
                options the method reads and the methods of the backend that read the refused one.
                A method not in ``methods`` is not checked here (the exporter refuses its name).
        """
        spec = methods.get(self.method)
        if not isinstance(spec, QuantizationMethod):
            return
        for name in self.given_options():
            if spec.reads(name, self):
                continue
            readers = [
                method
                for method, other in methods.items()
                if method != self.method
                and isinstance(other, QuantizationMethod)
                and (name in other.options or name in other.options_if)
            ]
            where = (
                f"{name} is read by: {', '.join(readers)}"
                if readers
                else f"no other {backend} method reads {name}"
            )
            raise ValueError(
                f"quantization.{name}={getattr(self, name)!r} is not read by the {backend} quantization method "
                f"{self.method!r} and would be ignored; allowed with {self.method!r}: {spec.describe_options()} "
                f"({where}); drop it or choose a method that reads it"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        out = dataclasses.asdict(self)
        out["exclude"] = list(self.exclude)
        return out

    @classmethod
    def from_value(cls, value: Any) -> QuantizationConfig | None:
        """``None``, a method name, a dict (as :meth:`to_dict` writes) or a ``QuantizationConfig``.

        Raises:
            ValueError: an unknown key (listing the known ones) or an invalid value.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown quantization field(s) {unknown}; known fields: {sorted(known)}")
            return cls(**value)
        raise ValueError(
            f"quantization={value!r} is invalid; allowed: None, a method name, a dict or a QuantizationConfig"
        )


def is_quality_gated(config: object) -> bool:
    """Whether an export with ``config`` is validated by quality gates instead of allclose: a
    ``config.dtype`` other than ``"float32"`` or a ``config.quantization`` (the rule of
    :func:`hfexport.quality.quality_gates_for`, which adds the thresholds; re-exported as
    :func:`hfexport.precision.is_quality_gated`). ``None`` -> ``False``."""
    if config is None:
        return False
    dtype = str(getattr(config, "dtype", "float32") or "float32")
    return dtype != "float32" or getattr(config, "quantization", None) is not None


@dataclass
class CaptureConfig(ExportConfigMixin):
    """How to capture the model with ``torch.export`` and validate the artifact: the fields every
    backend shares, and the parent of each backend's config (:class:`DynamoConfig`,
    :class:`OnnxConfig`, :class:`ExecutorchConfig`, :class:`OpenvinoConfig`, and third-party
    backends' configs, see docs/extending.md). Not tied to a format itself (``FORMAT`` is ``None``).

    Attributes:
        dynamic: mark every tensor dimension ``Dim.AUTO`` when ``dynamic_shapes`` is not given;
            slower to export than naming only the axes that vary.
        strict: ``torch.export.export(strict=...)``: TorchDynamo bytecode tracing (True) or
            Python-level tracing (False, the default and what transformers models need).
        dynamic_shapes: explicit ``torch.export`` dynamic shapes keyed by forward kwarg name;
            they win over ``dynamic``.
        prefer_deferred_runtime_asserts_over_guards: passed to ``torch.export.export``.
        validate: run the artifact after export and compare with eager PyTorch.
        atol / rtol: validation tolerances; ``None`` takes the backend's default for the dtype.
        validate_second_shape: for dynamic exports also validate on a second input with another
            batch size and a longer sequence derived from the sample inputs; with explicit
            ``dynamic_shapes`` only the declared dynamic axes change, within their ``min``/``max``
            (:func:`hfexport.validation.derive_second_inputs`).
        dtype: compute dtype of the export, one of :data:`DTYPES`, or ``None`` (auto, the
            default): the backend's choice for the model's dtype (``HfExporter.decide_dtype``: a
            dtype its runtime computes well on CPU is kept, any other becomes float32; the report
            records the decision and why). The model and its float inputs are cast to it (the
            user's model is restored afterwards); an artifact computing in another dtype than its
            eager reference (float32 for a float32 export, else the model's own dtype) is validated
            with quality gates instead of allclose.
        quantization: a :class:`QuantizationConfig` (or a method name / dict, converted), or ``None``.
        quality_gates: overrides of the quality-gate thresholds by metric name (e.g.
            ``{"cosine": 0.98, "top1_agreement": 0.85}``); ``None`` takes the defaults for the dtype
            and quantization method. Refused on a float32 export without quantization, which is
            validated with ``atol``/``rtol`` (no gate would apply).
    """

    dynamic: bool = field(
        default=False,
        metadata={
            # the command line exports dynamic shapes unless --static is given
            CLI: CliFlag(
                "--static",
                "Export static shapes (default: dynamic).",
                switch=True,
                set_to=False,
                unset=True,
                panel=CAPTURE_PANEL,
            )
        },
    )
    strict: bool = False
    dynamic_shapes: Any = None
    prefer_deferred_runtime_asserts_over_guards: bool = False
    validate: bool = field(
        default=True,
        metadata={
            CLI: CliFlag(
                "--no-validate", "Skip the parity check.", switch=True, set_to=False, panel=CAPTURE_PANEL
            )
        },
    )
    atol: float | None = field(
        default=None,
        metadata={
            CLI: CliFlag("--atol", "Validation absolute tolerance.", type="float", panel=CAPTURE_PANEL)
        },
    )
    rtol: float | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--rtol",
                "Validation relative tolerance (default: the backend's for the dtype).",
                type="float",
                panel=CAPTURE_PANEL,
            )
        },
    )
    validate_second_shape: bool = True
    dtype: str | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--dtype",
                "Compute dtype of the capture: float32 (default), float16, bfloat16 (what the backend runs).",
                panel=CAPTURE_PANEL,
            )
        },
    )
    quantization: QuantizationConfig | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--quantize",
                "Quantization method of the backend (each format's methods and the options they read: "
                "`hfexport env`): onnx int8-dynamic, int8-static, int4-weight, int8-weight; openvino "
                "int8-weight, int4-weight; executorch 8da4w, 4w, 8w, int8-dynamic; dynamo int8-weight.",
                group=QuantizationConfig,
                group_key="method",
                group_noun="a quantization",
                value_name="METHOD",
                panel=QUANTIZATION_PANEL,
            )
        },
    )
    quality_gates: dict[str, float] | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--gate",
                "Override a quality gate, METRIC=THRESHOLD (cosine, cosine_min, top1_agreement, "
                "max_abs_diff, cache_cosine for KV-cache outputs; for a quantized causal LM also the text "
                "metrics perplexity_ratio, kl_divergence, top1_agreement_text); repeatable.",
                repeat=True,
                parse=parse_quality_gates,
                panel=CAPTURE_PANEL,
            )
        },
    )

    def validate_fields(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; allowed: None (auto), {', '.join(DTYPES)}")
        self.quantization = QuantizationConfig.from_value(self.quantization)
        if self.quality_gates is not None:
            if not isinstance(self.quality_gates, dict):
                raise ValueError(
                    f"quality_gates={self.quality_gates!r} is invalid; allowed: None or a dict of metric "
                    "name -> threshold"
                )
            for key, threshold in self.quality_gates.items():
                _check_type(f"quality_gates[{key!r}]", threshold, (int, float), "a finite float")
                if not math.isfinite(threshold):
                    raise ValueError(
                        f"quality_gates[{key!r}]={threshold!r} is invalid; allowed: a finite float"
                    )
            if self.quality_gates and self.dtype is not None and not is_quality_gated(self):
                raise ValueError(
                    f"quality_gates={self.quality_gates!r} cannot apply: quality gates score reduced-precision "
                    "and quantized exports, and this one (dtype float32, no quantization) is validated with "
                    "allclose (atol/rtol); allowed: quality_gates=None, or a dtype other than float32, or a "
                    "quantization"
                )
        for name in (
            "dynamic",
            "strict",
            "prefer_deferred_runtime_asserts_over_guards",
            "validate",
            "validate_second_shape",
        ):
            _check_type(name, getattr(self, name), (bool,), "True or False")
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None:
                allowed = "a finite, non-negative float or None"
                _check_type(name, value, (int, float), allowed)
                # nan compares False with everything (so `value < 0` lets it through) and inf makes
                # every comparison pass: both would turn validation into a no-op or a late failure
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
        if self.dynamic_shapes is not None:
            if not isinstance(self.dynamic_shapes, (dict, list, tuple)):
                raise ValueError(
                    f"dynamic_shapes={self.dynamic_shapes!r} is invalid; allowed: None or a dict keyed "
                    "by forward kwarg name (torch.export.export semantics)"
                )
            check_dynamic_shapes_leaves(self.dynamic_shapes)
            encode_dynamic_shapes(self.dynamic_shapes)  # raises ValueError on a bad leaf

    @property
    def is_dynamic(self) -> bool:
        """True when the export has any dynamic dimension (``dynamic`` or ``dynamic_shapes``)."""
        return bool(self.dynamic or self.dynamic_shapes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExportConfigMixin:
        """:meth:`ExportConfigMixin.from_dict`, reading the configs of hfexport 0.x, whose
        non-dynamo configs carried ``"aoti": false`` (inherited from ``DynamoConfig`` then): a false
        ``aoti`` is dropped for a class without the field, a true one is refused.

        Raises:
            ValueError: as :meth:`ExportConfigMixin.from_dict`; ``aoti`` true on a config class
                without AOTInductor (only :class:`DynamoConfig` has it).
        """
        if (
            isinstance(data, dict)
            and "aoti" in data
            and "aoti" not in {f.name for f in dataclasses.fields(cls)}
        ):
            if data["aoti"] not in (False, None):
                raise ValueError(_aoti_refusal(cls.declared_format() or cls.__name__))
            data = {k: v for k, v in data.items() if k != "aoti"}
        return super().from_dict(data)


def _aoti_refusal(fmt: str) -> str:
    return (
        f"aoti=True applies to the {ExportFormat.DYNAMO.value} format only, not {fmt}; "
        "drop it or export with DynamoConfig"
    )


@dataclass
class DynamoConfig(CaptureConfig):
    """:class:`CaptureConfig` plus what only the dynamo format (an ``ExportedProgram`` saved as
    ``.pt2``) offers.

    Attributes:
        aoti: also compile the program with AOTInductor
            (``torch._inductor.aoti_compile_and_package``) into ``model.aoti.pt2`` next to
            ``model.pt2`` and validate the package at the sample and second shapes; needs a C++
            compiler (refused before capture without one). A subclass naming another format
            refuses ``True``.
    """

    FORMAT: ClassVar[str | None] = ExportFormat.DYNAMO.value

    aoti: bool = field(
        default=False,
        metadata={
            CLI: CliFlag(
                "--aoti",
                "dynamo: also compile an AOTInductor package (model.aoti.pt2) and validate it at both shapes "
                "(needs a C++ compiler).",
                switch=True,
                formats=(ExportFormat.DYNAMO.value,),  # a subclass for another format refuses it
                elsewhere=f"--aoti applies to the {ExportFormat.DYNAMO.value} format, not {{format}}",
            )
        },
    )

    def validate_fields(self) -> None:
        super().validate_fields()
        _check_type("aoti", self.aoti, (bool,), "True or False")
        if self.aoti and self.export_format != ExportFormat.DYNAMO.value:
            raise ValueError(_aoti_refusal(self.export_format))


@dataclass
class OnnxConfig(CaptureConfig):
    """:class:`CaptureConfig` plus what ``torch.onnx.export(dynamo=True)`` and saving need.

    Attributes:
        output_path: when set, the exported model is also saved there (``.onnx``).
        opset_version: ONNX default-domain opset; ``None`` lets torch.onnx choose.
        external_data: store weights next to the model as external data (always done above 2 GB,
            the protobuf limit).
        optimize: run the onnxscript optimizer on the exported model.
        export_params: store the weights in the model (False exports the graph only).
        keep_initializers_as_inputs: also list initializers as graph inputs.
        ort_fusions: rewrite the optimized graph into ONNX Runtime's fused contrib ops for that
            execution provider (one of :data:`ORT_FUSION_TARGETS`), or ``None`` for a plain graph.
    """

    FORMAT: ClassVar[str | None] = ExportFormat.ONNX.value

    output_path: str | None = None
    opset_version: int | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--opset",
                "ONNX opset version (onnx only).",
                type="int",
                elsewhere="--opset applies to onnx, not {format}",
            )
        },
    )
    external_data: bool = True
    optimize: bool = field(
        default=True,
        metadata={
            CLI: CliFlag(
                "--no-optimize",
                "Skip the graph optimizer (onnx).",
                switch=True,
                set_to=False,
                ignore_elsewhere=True,
            )
        },
    )
    export_params: bool = True
    keep_initializers_as_inputs: bool = False
    ort_fusions: str | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--ort-fusions",
                "Rewrite into ONNX Runtime fused contrib ops for cpu or cuda (onnx).",
                parse=parse_ort_fusion_target,
                elsewhere="--ort-fusions applies to onnx, not {format}",
                elsewhere_hint=True,
            )
        },
    )

    def validate_fields(self) -> None:
        super().validate_fields()
        if self.ort_fusions is not None and self.ort_fusions not in ORT_FUSION_TARGETS:
            raise ValueError(
                f"ort_fusions={self.ort_fusions!r} is invalid; allowed: None, {', '.join(map(repr, ORT_FUSION_TARGETS))}"
            )
        for name in ("external_data", "optimize", "export_params", "keep_initializers_as_inputs"):
            _check_type(name, getattr(self, name), (bool,), "True or False")
        if self.opset_version is not None:
            check_opset_version(self.opset_version)
        if self.output_path is not None:
            if isinstance(self.output_path, os.PathLike):
                self.output_path = os.fspath(self.output_path)
            _check_type("output_path", self.output_path, (str,), "a file path or None")


#: Lowest ONNX default-domain opset an export can target: torch.onnx's dynamo exporter emits opset 18
#: (``torch.onnx._internal.exporter._constants.TORCHLIB_OPSET``) and does not convert downwards.
ONNX_MIN_OPSET = 18

#: Highest opset accepted when onnxscript is not installed (the config can then only be read, not
#: exported; the ONNX backend checks the exact range of the installed onnxscript before capture).
ONNX_STATIC_MAX_OPSET = 30

# The constant onnxscript's version converter (which torch.onnx calls for ``opset_version``)
# checks its target against; onnxscript 0.5-0.7 define it in this module.
_ONNXSCRIPT_CONVERTER = ("version_converter", "_version_converter.py")
_ONNXSCRIPT_MAX_RE = re.compile(r"^SUPPORTED_MAX_ONNX_OPSET\s*=\s*(\d+)\s*$", re.MULTILINE)


@functools.cache
def onnx_opset_range() -> tuple[int, int, str]:
    """The ONNX opsets an :class:`OnnxConfig` may name, without importing onnxscript.

    Returns:
        ``(lowest, highest, source)``: ``lowest`` is :data:`ONNX_MIN_OPSET`; ``highest`` is the
        ``SUPPORTED_MAX_ONNX_OPSET`` of the installed onnxscript's version converter, read from
        the module when it is already imported, else from its source file (importing onnxscript
        takes seconds, and the core must stay importable without it); when onnxscript is not
        installed, or its layout changed, ``highest`` is :data:`ONNX_STATIC_MAX_OPSET`. ``source``
        says where ``highest`` came from, for error messages.

    The ONNX backend repeats the check with the imported modules (also capped by the installed
    onnx's opset) before capture: ``hfexport_onnx.versions.check_opset_version``.
    """
    import sys

    module = sys.modules.get("onnxscript.version_converter._version_converter")
    found = getattr(module, "SUPPORTED_MAX_ONNX_OPSET", None) if module is not None else None
    if found is None:
        import importlib.util

        try:
            spec = importlib.util.find_spec("onnxscript")  # finds the top-level package, no import
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return ONNX_MIN_OPSET, ONNX_STATIC_MAX_OPSET, "onnxscript is not installed"
        path = os.path.join(next(iter(spec.submodule_search_locations)), *_ONNXSCRIPT_CONVERTER)
        try:
            with open(path, encoding="utf-8") as fh:
                match = _ONNXSCRIPT_MAX_RE.search(fh.read())
        except OSError:
            match = None
        if match is None:
            return ONNX_MIN_OPSET, ONNX_STATIC_MAX_OPSET, "the onnxscript version converter was not found"
        found = int(match.group(1))
    try:
        import importlib.metadata

        version = importlib.metadata.version("onnxscript")
    except Exception:  # metadata missing (a source checkout): the range is still right
        version = "?"
    return ONNX_MIN_OPSET, int(found), f"the opsets the installed onnxscript {version} converts to"


def check_opset_version(opset_version: Any, *, highest: int | None = None, source: str = "") -> None:
    """Check an ONNX opset version against :func:`onnx_opset_range` (or an explicit ``highest``).

    Raises:
        ValueError: not an int, or outside ``[ONNX_MIN_OPSET, highest]``; the message names the
            allowed range and where its upper end comes from.
    """
    lowest, top, why = onnx_opset_range()
    if highest is not None:
        top, why = highest, source or why
    allowed = f"an int from {lowest} to {top} ({why}) or None"
    _check_type("opset_version", opset_version, (int,), allowed)
    if not lowest <= opset_version <= top:
        raise ValueError(
            f"opset_version={opset_version} is invalid; allowed: {allowed}; torch.onnx's dynamo exporter "
            f"emits opset {lowest} and converts upwards"
        )


EXECUTORCH_BACKENDS = ("xnnpack", "cuda")
#: ``ExecutorchConfig.kv_cache_dtype`` values besides ``None`` (the ``llm-runner`` layout's int8 cache).
EXECUTORCH_KV_CACHE_DTYPES = ("int8",)


@dataclass
class ExecutorchConfig(CaptureConfig):
    """:class:`CaptureConfig` plus ExecuTorch lowering and memory planning.

    Attributes:
        backend: the delegate to lower to: ``"xnnpack"`` (CPU) or ``"cuda"``.
        alloc_graph_input / alloc_graph_output / alloc_mutable_buffers: whether ExecuTorch memory
            planning allocates graph inputs, outputs and mutable buffers (KV caches) in its planned
            arena (mirrors ``executorch.exir.passes.MemoryPlanningPass`` arguments).
        max_dynamic_bytes: memory budget used to bound ``Dim.AUTO`` axes for memory planning
            (bytes; ``None`` takes the backend's default).
        output_path: when set, the program is also saved there (``.pte``).
        custom_ops: the ``llm-runner`` layout writes the KV cache with ExecuTorch's
            ``llama::update_cache`` and attention with ``llama::custom_sdpa`` (default True; left
            out, with the reason in the report, where they do not apply); False keeps transformers'
            cache and attention.
        kv_cache_dtype: ``None`` (the cache in the model's dtype) or ``"int8"``: the ``llm-runner``
            layout keeps keys/values in int8 with per-token scales, attended by
            ``llama::custom_quantized_sdpa`` (needs ``custom_ops``; other exports refuse it).
    """

    FORMAT: ClassVar[str | None] = ExportFormat.EXECUTORCH.value

    backend: str = field(
        default="xnnpack",
        metadata={
            CLI: CliFlag(
                "--backend",
                "ExecuTorch delegate: xnnpack or cuda.",
                elsewhere="--backend applies to executorch, not {format}",
            )
        },
    )
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    alloc_mutable_buffers: bool = True
    max_dynamic_bytes: int | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--max-dynamic-bytes",
                "Memory budget of the planned activations at the dynamic axes' upper bounds, e.g. 4GiB "
                "(default 1 GiB); hfexport's default bounds (sequence, batch) are halved until the "
                "estimate fits, so a larger budget keeps longer prompts.",
                metavar="SIZE",
                parse=parse_byte_size,
                elsewhere="--max-dynamic-bytes applies to executorch, not {format}",
            )
        },
    )
    output_path: str | None = None
    custom_ops: bool = field(
        default=True,
        metadata={
            CLI: CliFlag(
                "--no-custom-ops",
                "llm-runner layout: keep transformers' KV cache and attention instead of ExecuTorch's "
                "llama::update_cache / llama::custom_sdpa ops.",
                switch=True,
                set_to=False,
            )
        },
    )
    kv_cache_dtype: str | None = field(
        default=None,
        metadata={
            CLI: CliFlag(
                "--kv-cache-dtype",
                "llm-runner layout: keep the KV cache in int8 (per-token scales, ExecuTorch's "
                "llama::custom_quantized_sdpa); default: the model's dtype.",
                choices=EXECUTORCH_KV_CACHE_DTYPES,
            )
        },
    )

    def validate_fields(self) -> None:
        super().validate_fields()
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in EXECUTORCH_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid; allowed: None, "
                + ", ".join(map(repr, EXECUTORCH_KV_CACHE_DTYPES))
            )
        if self.kv_cache_dtype is not None and not self.custom_ops:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} needs custom_ops=True (the quantized cache is read by "
                "ExecuTorch's llama::custom_quantized_sdpa); drop --no-custom-ops or --kv-cache-dtype"
            )
        if self.backend not in EXECUTORCH_BACKENDS:
            raise ValueError(
                f"backend={self.backend!r} is invalid; allowed: {', '.join(map(repr, EXECUTORCH_BACKENDS))}"
            )
        for name in ("alloc_graph_input", "alloc_graph_output", "alloc_mutable_buffers", "custom_ops"):
            _check_type(name, getattr(self, name), (bool,), "True or False")
        if self.max_dynamic_bytes is not None:
            _check_type("max_dynamic_bytes", self.max_dynamic_bytes, (int,), "a positive int or None")
            if self.max_dynamic_bytes <= 0:
                raise ValueError(
                    f"max_dynamic_bytes={self.max_dynamic_bytes} is invalid; allowed: a positive int or None"
                )
        if self.output_path is not None:
            if isinstance(self.output_path, os.PathLike):
                self.output_path = os.fspath(self.output_path)
            _check_type("output_path", self.output_path, (str,), "a file path or None")


#: OpenVINO devices an :class:`OpenvinoConfig` may name (whether one is present is checked by the
#: backend against ``openvino.Core().available_devices`` before capture).
OPENVINO_DEVICES = ("CPU", "GPU", "NPU")
#: ``OpenvinoConfig.inference_precision_hint`` values (OpenVINO's ``INFERENCE_PRECISION_HINT``).
OPENVINO_PRECISION_HINTS = ("f32", "f16", "bf16")


@dataclass
class OpenvinoConfig(CaptureConfig):
    """:class:`CaptureConfig` plus OpenVINO conversion, saving and compilation options.

    Readable and checked without OpenVINO installed; whether the device is present and supports the
    precision hint is checked by the ``openvino`` backend before capture.

    Attributes:
        device: the OpenVINO device validation compiles for: ``"CPU"`` (default), ``"GPU"`` or
            ``"NPU"``; an indexed device (``"GPU.1"``) names one of several.
        compress_to_fp16: store the IR weights as fp16 (``openvino.save_model(compress_to_fp16=...)``);
            the computation precision is unchanged. Default False: the ``.bin`` holds the weights as
            exported.
        inference_precision_hint: ``None`` (the device's default: bf16 on CPUs with AMX or
            AVX512-BF16, else f32; validation then compiles with ``"f32"``) or ``"f32"`` /
            ``"f16"`` / ``"bf16"``: compiled with that ``INFERENCE_PRECISION_HINT`` for validation
            and recorded in the IR's ``rt_info`` for hfexport's runners (other loaders, such as
            OpenVINO GenAI, take it as a compile property).
        stateful: generation exports of decoder-only language models keep the KV cache as internal
            state (``ReadValue``/``Assign``, a ``beam_idx`` input), the form OpenVINO GenAI's
            ``LLMPipeline`` runs; False exports stateless prefill/decode graphs whose cache is
            inputs and outputs.
        output_path: when set, the exported model is also saved there (``openvino_model.xml``).
    """

    FORMAT: ClassVar[str | None] = ExportFormat.OPENVINO.value

    device: str = "CPU"
    compress_to_fp16: bool = False
    inference_precision_hint: str | None = None
    stateful: bool = True
    output_path: str | None = None

    def validate_fields(self) -> None:
        super().validate_fields()
        _check_type("device", self.device, (str,), "'CPU', 'GPU' or 'NPU' (optionally indexed, 'GPU.1')")
        if self.device.split(".", 1)[0].upper() not in OPENVINO_DEVICES:
            raise ValueError(
                f"device={self.device!r} is invalid; allowed: {', '.join(map(repr, OPENVINO_DEVICES))} "
                "(optionally indexed, 'GPU.1')"
            )
        self.device = self.device.upper()
        for name in ("compress_to_fp16", "stateful"):
            _check_type(name, getattr(self, name), (bool,), "True or False")
        if self.inference_precision_hint is not None and (
            self.inference_precision_hint not in OPENVINO_PRECISION_HINTS
        ):
            raise ValueError(
                f"inference_precision_hint={self.inference_precision_hint!r} is invalid; allowed: None, "
                + ", ".join(map(repr, OPENVINO_PRECISION_HINTS))
            )
        if self.output_path is not None:
            if isinstance(self.output_path, os.PathLike):
                self.output_path = os.fspath(self.output_path)
            _check_type("output_path", self.output_path, (str,), "a file path or None")


BUILTIN_CONFIGS: dict[str, type[ExportConfigMixin]] = {
    ExportFormat.DYNAMO.value: DynamoConfig,
    ExportFormat.ONNX.value: OnnxConfig,
    ExportFormat.EXECUTORCH.value: ExecutorchConfig,
    ExportFormat.OPENVINO.value: OpenvinoConfig,
}

_ = field  # re-exported helper for subclasses defined elsewhere
