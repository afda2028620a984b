"""Auto classes: pick the config class and the exporter for an ``export_format``.

``export_format`` is an open name. The built-in formats (:class:`hfexport.config.ExportFormat`)
have their configs in the core; any other name works once something registers it:

- a third-party backend package announces its exporter through the entry-point group
  ``hfexport.exporters`` (name = format, value = ``module:ExporterClass``); its config class is
  the exporter's ``config_class`` attribute, found when the entry point is loaded;
- code registers classes directly with :func:`register_exporter` / :func:`register_export_config`.

Entry points are loaded lazily, the first time a format is asked for, so ``import hfexport``
never imports a backend; listing them (:func:`available_export_formats`) imports nothing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hfexport.config import BUILTIN_CONFIGS, ExportConfigMixin, ExportFormat, format_name
from hfexport.errors import MissingBackendError

__all__ = [
    "EXPORT_CONFIG_FILENAME",
    "AutoExportConfig",
    "AutoHfExporter",
    "available_export_formats",
    "get_hf_exporter",
    "register_export_config",
    "register_exporter",
    "supports_export_format",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hfexport.exporters"
EXPORT_CONFIG_FILENAME = "export_config.json"

# The built-in format table: format -> package that provides it (for install hints).
KNOWN_BACKEND_PACKAGES = {
    ExportFormat.DYNAMO.value: "hfexport-dynamo",
    ExportFormat.ONNX.value: "hfexport-onnx",
    ExportFormat.EXECUTORCH.value: "hfexport-executorch",
    ExportFormat.OPENVINO.value: "hfexport-openvino",
}

_EXPORTERS: dict[str, type] = {}
_CONFIGS: dict[str, type[ExportConfigMixin]] = dict(BUILTIN_CONFIGS)

T = TypeVar("T")


def register_exporter(name: str | ExportFormat) -> Callable[[type[T]], type[T]]:
    """Class decorator registering an ``HfExporter`` subclass under the format ``name``.

    ``name`` may be any format name, not only a built-in one. A class whose ``export_format`` is
    empty gets ``name``; its ``config_class`` (when it is a config subclass and no config is
    registered for ``name`` yet) becomes the config for ``name``.

    Raises:
        TypeError: the class is not an ``HfExporter`` subclass.
        ValueError: ``name`` is not a non-empty string.

    Registering a different class under a taken name replaces it with a warning; registering the
    same class again (a module imported twice) is silent.
    """
    from hfexport.exporter import HfExporter

    key = format_name(name)

    def decorate(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, HfExporter)):
            raise TypeError(f"register_exporter({key!r}) expects an HfExporter subclass, got {cls!r}")
        old = _EXPORTERS.get(key)
        if old is not None and _qualified(old) != _qualified(cls):
            warnings.warn(
                f"exporter {key!r}: {old.__qualname__} replaced by {cls.__qualname__}", stacklevel=2
            )
        if not cls.export_format:
            cls.export_format = key
        _EXPORTERS[key] = cls
        return cls

    return decorate


def register_export_config(name: str | ExportFormat) -> Callable[[type[T]], type[T]]:
    """Class decorator registering an ``ExportConfigMixin`` subclass under the format ``name``.

    A class that names no format of its own (no ``export_format`` field default and no ``FORMAT``
    of its own) gets ``FORMAT = name``, so ``MyConfig()`` fills in ``export_format``.

    Raises:
        TypeError: the class is not an ``ExportConfigMixin`` subclass.
        ValueError: the class declares another format than ``name``.
    """
    key = format_name(name)

    def decorate(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, ExportConfigMixin)):
            raise TypeError(
                f"register_export_config({key!r}) expects an ExportConfigMixin subclass, got {cls!r}"
            )
        field_default = getattr(cls.__dataclass_fields__.get("export_format"), "default", "")  # type: ignore[attr-defined]
        if not field_default and "FORMAT" not in cls.__dict__:
            cls.FORMAT = key  # the decorator names the format of a class that did not
        declared = cls.declared_format()
        if declared != key:
            raise ValueError(
                f"register_export_config({key!r}): {cls.__qualname__} declares export_format={declared!r}; "
                f"set its export_format default (or FORMAT) to {key!r}"
            )
        old = _CONFIGS.get(key)
        if old is not None and _qualified(old) != _qualified(cls):
            warnings.warn(
                f"export config {key!r}: {old.__qualname__} replaced by {cls.__qualname__}", stacklevel=2
            )
        _CONFIGS[key] = cls  # type: ignore[assignment]
        return cls

    return decorate


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """``{format: entry point}`` of the ``hfexport.exporters`` group (nothing is imported)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_backend(name: str) -> type | None:
    if name in _EXPORTERS:
        return _EXPORTERS[name]
    ep = _entry_points().get(name)
    if ep is None:
        return None
    from hfexport.exporter import HfExporter

    try:
        cls = ep.load()
    except ImportError as exc:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "the package that declares it"
        raise MissingBackendError(
            f"the {name!r} backend ({ep.value}, from {dist}) failed to import: {exc}; reinstall or fix {dist}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, HfExporter)):
        raise TypeError(
            f"entry point {ENTRY_POINT_GROUP}:{name} = {ep.value} is not an HfExporter subclass ({cls!r})"
        )
    if not cls.export_format:
        cls.export_format = name
    _EXPORTERS.setdefault(name, cls)
    return _EXPORTERS[name]


def available_export_formats() -> list[str]:
    """Formats with an exporter: installed (entry points) or registered in this process.

    Built-in formats whose package is not installed are not listed; nothing is imported.
    """
    return sorted(set(_EXPORTERS) | set(_entry_points()))


def supports_export_format(name: str | ExportFormat) -> bool:
    """True when an exporter for ``name`` is installed or registered (without importing it)."""
    try:
        key = format_name(name)
    except ValueError:
        return False
    return key in _EXPORTERS or key in _entry_points()


def _choices() -> str:
    """The formats an error message offers: available ones, then built-ins that need a package."""
    available = available_export_formats()
    missing = [
        f"{fmt} (pip install {pkg})" for fmt, pkg in KNOWN_BACKEND_PACKAGES.items() if fmt not in available
    ]
    return ", ".join([*available, *missing]) or "none"


def _missing_backend(name: str) -> MissingBackendError:
    package = KNOWN_BACKEND_PACKAGES.get(name)
    if package is None:
        return MissingBackendError(
            f"no exporter for export_format={name!r}: no installed package announces it (entry-point "
            f"group {ENTRY_POINT_GROUP!r}) and nothing registered it with @register_exporter; "
            f"available: {_choices()}"
        )
    return MissingBackendError(
        f"export_format={name!r} needs the {package} package, which is not installed; "
        f"install it with: pip install {package}"
    )


def get_hf_exporter(name: str | ExportFormat) -> type:
    """Return the exporter class for ``name``, loading its backend through entry points.

    Args:
        name: a built-in :class:`ExportFormat` or any registered / entry-point format name.

    Raises:
        MissingBackendError (an ``ImportError``): no backend for ``name`` is installed or
            registered (for a built-in format the message has the ``pip install`` command; for
            another name it lists the available formats), or its entry point failed to import.
        TypeError: the entry point does not name an ``HfExporter`` subclass.
    """
    key = format_name(name)
    cls = _load_backend(key)
    if cls is None:
        raise _missing_backend(key)
    return cls


class AutoExportConfig:
    """Build the right config class from a dict that names its ``export_format``."""

    def __init__(self) -> None:
        raise OSError("AutoExportConfig is not instantiable; use AutoExportConfig.from_dict(...)")

    @staticmethod
    def config_class(export_format: str | ExportFormat) -> type[ExportConfigMixin]:
        """The config class for ``export_format``.

        Looked up in order: a class registered with :func:`register_export_config` (the built-in
        configs are registered), then the ``config_class`` of the exporter registered or
        announced (entry point, loaded here) for that format.

        Raises:
            ValueError: no config is known for ``export_format`` (the message lists the available
                formats and the ``pip install`` command of built-in ones not installed).
            MissingBackendError: the format's entry point failed to import.
        """
        key = format_name(export_format)
        if key in _CONFIGS:
            return _CONFIGS[key]
        exporter_cls = _load_backend(key)
        config_cls = getattr(exporter_cls, "config_class", None)
        if (
            isinstance(config_cls, type)
            and issubclass(config_cls, ExportConfigMixin)
            and config_cls is not ExportConfigMixin
        ):
            declared = config_cls.declared_format()
            if declared is None:
                config_cls.FORMAT = key
            elif declared != key:
                raise ValueError(
                    f"export_format={key!r}: {exporter_cls.__qualname__}.config_class is "
                    f"{config_cls.__qualname__}, a config for {declared!r}; give the backend its own "
                    f"config dataclass with export_format: str = {key!r}"
                )
            _CONFIGS[key] = config_cls
            return config_cls
        if exporter_cls is not None:
            raise ValueError(
                f"export_format={key!r}: {exporter_cls.__qualname__} names no config class; set its "
                "config_class to an ExportConfigMixin dataclass, or register one with "
                f"@register_export_config({key!r})"
            )
        raise ValueError(f"export_format={key!r} is not known; available: {_choices()}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportConfigMixin:
        """Config for ``data["export_format"]`` (enum or string) built from the rest of ``data``.

        Raises:
            ValueError: ``export_format`` missing or unknown, or any field invalid.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"AutoExportConfig.from_dict expects a dict, got {type(data).__name__}")
        if "export_format" not in data or data["export_format"] in (None, ""):
            raise ValueError("export_format is missing from the config dict; available: " + _choices())
        key = format_name(data["export_format"])
        config_cls = cls.config_class(key)
        values = dict(data)
        values["export_format"] = key
        return config_cls.from_dict(values)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> ExportConfigMixin:
        """Read a config (export recipe) JSON file.

        Raises:
            ValueError: the file is not JSON holding an object (the message names the file), or
                its ``export_format`` or a field is invalid (the message names the file too).
            OSError: the file cannot be read.
        """
        from hfexport.config import read_json_object

        data = read_json_object(path)
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{os.fspath(path)}: {error}") from error


class AutoHfExporter:
    """Instantiate the exporter matching a config, a dict or a local export recipe."""

    def __init__(self) -> None:
        raise OSError("AutoHfExporter is not instantiable; use AutoHfExporter.from_config(...)")

    @classmethod
    def from_config(cls, config: ExportConfigMixin | Mapping[str, Any]) -> Any:
        """Return an exporter instance for ``config`` (a config object or a dict with ``export_format``).

        Raises:
            ValueError: the dict has no or an unknown ``export_format``.
            MissingBackendError: the backend for that format is not installed.
        """
        if not isinstance(config, ExportConfigMixin):
            config = AutoExportConfig.from_dict(config)
        exporter_cls = get_hf_exporter(config.export_format)
        return exporter_cls(config=config)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, filename: str = EXPORT_CONFIG_FILENAME
    ) -> tuple[Any, ExportConfigMixin]:
        """Read an export recipe from a local model folder.

        Args:
            path: a local folder holding ``export_config.json`` (or that file itself).
            filename: the recipe file name inside the folder.

        Returns:
            ``(exporter, config)``.

        Raises:
            FileNotFoundError: no recipe there (hub ids are not fetched: pass a local folder).
            ValueError / MissingBackendError: as for :meth:`from_config`.
        """
        p = Path(path)
        recipe = p if p.is_file() else p / filename
        if not recipe.is_file():
            raise FileNotFoundError(
                f"no export recipe at {recipe}; AutoHfExporter.from_pretrained reads a local folder holding "
                f"{filename} (write one with config.to_json_file(...))"
            )
        config = AutoExportConfig.from_json_file(recipe)
        return cls.from_config(config), config
