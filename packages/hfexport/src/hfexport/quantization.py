"""Quantization methods as data: what a method's function gets and returns, and the open table of
methods per backend.

A backend lists its methods in ``HfExporter.quantization_methods``, each a
:class:`hfexport.config.QuantizationMethod` naming the options it reads, the *phase* it runs in
and the function that applies it:

- ``source``: on the eager module before capture (a quantized copy is captured);
- ``program``: on the captured ``torch.export.ExportedProgram``;
- ``artifact``: on the backend's lowered artifact (an ONNX graph ...).

The base exporter runs the ``source`` and ``program`` phases inside its shared capture step
(:meth:`hfexport.exporter.HfExporter.captured_program`) and the ``artifact`` phase where the backend
calls :meth:`hfexport.exporter.HfExporter.quantize_artifact`. Each function is called as
``apply(request: QuantizationRequest) -> QuantizationResult``; the result's ``facts`` become
``report.quantization``.

A new method for an installed backend is one module (its function) plus one call::

    register_quantization_method("onnx", "my-int8", QuantizationMethod(
        "what it does", options={"exclude"}, phase="artifact", apply="my_pkg.quant:apply"))

after which ``OnnxExporter.quantization_methods`` lists it, ``check_precision`` accepts it (and
refuses options it does not read) and exports with ``QuantizationConfig(method="my-int8")`` run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hfexport.config import QUANTIZATION_PHASES, QuantizationConfig, QuantizationMethod

__all__ = [
    "QUANTIZATION_PHASES",
    "QuantizationMethodTable",
    "QuantizationRequest",
    "QuantizationResult",
    "isolated_quantization_methods",
    "register_quantization_method",
    "registered_quantization_methods",
]


@dataclass(frozen=True)
class QuantizationRequest:
    """What a quantization function gets.

    Attributes:
        target: the thing to quantize: the eager ``torch.nn.Module`` (phase ``source``; never
            modify it: return a quantized copy), the captured ``ExportedProgram`` (``program``), or
            the backend's artifact (``artifact``: for ONNX the ``onnx_ir.Model``, which may be
            rewritten in place).
        quantization: the export's :class:`hfexport.config.QuantizationConfig`.
        phase: the phase this call runs in (one of :data:`QUANTIZATION_PHASES`).
        inputs: the sample forward kwargs the program is captured with (for a one-pass calibration).
        report: the export's :class:`hfexport.report.ExportReport`, ``None`` outside an export (a
            generation source built once for every component).
        calibration: forward-kwarg dicts to calibrate on, when the backend built some (ONNX: for a
            method that reads ``calibration``), else ``None``.
        capture: (``program`` phase) captures a module again with the export's inputs and config
            (``capture(module) -> ExportedProgram``), for a function that quantizes
            ``target.module()`` and must return a program; ``None`` in other phases.
    """

    target: Any
    quantization: QuantizationConfig
    phase: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    report: Any = None
    calibration: Sequence[Mapping[str, Any]] | None = None
    capture: Callable[[Any], Any] | None = None


@dataclass
class QuantizationResult:
    """What a quantization function returns.

    Attributes:
        target: the quantized thing (a new module / program / artifact, or ``request.target``
            when it was changed in place; in the ``source`` phase, ``request.target`` itself means
            the method left the eager module alone).
        facts: JSON-safe facts (counts, options used, sizes) merged into ``report.quantization``.
        detail: one line for the stage's detail (``"int8-weight: 14 linear module(s)"``);
            empty keeps the method name.
    """

    target: Any
    facts: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


# (backend format, method name) -> QuantizationMethod, registered from outside the backend
_REGISTERED: dict[str, dict[str, QuantizationMethod]] = {}
# backend -> its own table, to refuse a registration that would shadow a built-in method
_BUILTIN: dict[str, Mapping[str, QuantizationMethod | str]] = {}


def register_quantization_method(backend: str, name: str, method: QuantizationMethod) -> QuantizationMethod:
    """Add the quantization method ``name`` to the backend whose ``export_format`` is ``backend``.

    The exporter's ``quantization_methods`` (a :class:`QuantizationMethodTable`) lists it from then
    on, next to the backend's own; the CLI's ``--quantize`` and ``hfexport env`` show it.
    Registering an equal method again is a no-op (a module imported twice).

    Args:
        backend: the export format (``"onnx"``, ``"dynamo"``, ``"executorch"``, a plugin's).
        name: the ``QuantizationConfig.method`` value that selects it.
        method: what it does, which options it reads, its phase and function; a method without
            ``phase``/``apply`` is refused (nothing would run it).

    Returns:
        ``method``.

    Raises:
        ValueError: an empty name; a method without ``phase`` and ``apply``; ``name`` already a
            method of that backend (its own or registered) that is not this one.
        TypeError: ``method`` is not a :class:`hfexport.config.QuantizationMethod`.
    """
    if not isinstance(method, QuantizationMethod):
        raise TypeError(
            f"register_quantization_method({backend!r}, {name!r}, ...) takes a hfexport.config.QuantizationMethod, "
            f"got {type(method).__name__}"
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"quantization method name {name!r} is invalid; allowed: a non-empty string")
    if method.phase is None:
        raise ValueError(
            f"quantization method {name!r} declares no phase and apply function, so no export would run it; "
            f"give phase= (one of {', '.join(QUANTIZATION_PHASES)}) and apply="
        )
    own = _BUILTIN.get(backend, {})
    existing = _REGISTERED.get(backend, {}).get(name, own.get(name))
    if existing is not None and existing != method:
        raise ValueError(
            f"quantization method {name!r} is already a {backend} method ({existing.description!r}); "
            "pick another name"
        )
    _REGISTERED.setdefault(backend, {})[name] = method
    return method


def registered_quantization_methods(backend: str) -> dict[str, QuantizationMethod]:
    """The methods :func:`register_quantization_method` added to ``backend`` (name -> method)."""
    return dict(_REGISTERED.get(backend, {}))


@contextlib.contextmanager
def isolated_quantization_methods() -> Iterator[None]:
    """Drop, on exit, every method registered inside the ``with`` block (for tests and examples);
    the methods registered before stay."""
    saved = {backend: dict(methods) for backend, methods in _REGISTERED.items()}
    try:
        yield
    finally:
        _REGISTERED.clear()
        _REGISTERED.update(saved)


class QuantizationMethodTable(Mapping[str, "QuantizationMethod | str"]):
    """A backend's quantization methods: its own, then those registered for its format, looked up
    live (a method registered after the class was defined is listed; a registered name that the
    backend also defines itself, registered before the backend was imported, is not used).

    ``HfExporter`` turns every subclass's ``quantization_methods`` class attribute into one, so
    ``dict(OnnxExporter.quantization_methods)`` lists the built-in and registered methods.

    Args:
        backend: the export format the registered methods are looked up under.
        own: the backend's own methods (name -> :class:`hfexport.config.QuantizationMethod`, or a
            plain description string that declares nothing).
    """

    def __init__(self, backend: str, own: Mapping[str, QuantizationMethod | str]) -> None:
        self.backend = backend
        self.own = dict(own)
        if backend:
            _BUILTIN[backend] = {**_BUILTIN.get(backend, {}), **self.own}

    def _merged(self) -> dict[str, QuantizationMethod | str]:
        merged = dict(self.own)
        for name, method in _REGISTERED.get(self.backend, {}).items():
            merged.setdefault(name, method)  # a backend's own method is never shadowed
        return merged

    def __getitem__(self, name: str) -> QuantizationMethod | str:
        return self._merged()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())

    def __repr__(self) -> str:
        return f"QuantizationMethodTable({self.backend!r}, {sorted(self._merged())})"
