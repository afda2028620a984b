"""Auto classes: pick the config class and the exporter for an ``export_format``.

Backends announce themselves through the entry-point group ``hfexport.exporters`` (name = format,
value = ``module:ExporterClass``); they are loaded lazily, the first time a format is asked for,
so ``import hfexport`` never imports a backend. Code can also register classes directly with
:func:`register_exporter` / :func:`register_export_config`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hfexport.config import BUILTIN_CONFIGS, ExportConfigMixin, ExportFormat
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

# format -> package that provides it (for install hints)
KNOWN_BACKEND_PACKAGES = {
    ExportFormat.DYNAMO.value: "hfexport-dynamo",
    ExportFormat.ONNX.value: "hfexport-onnx",
    ExportFormat.EXECUTORCH.value: "hfexport-executorch",
}

_EXPORTERS: dict[str, type] = {}
_CONFIGS: dict[str, type[ExportConfigMixin]] = dict(BUILTIN_CONFIGS)

T = TypeVar("T")


def register_exporter(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator registering an ``HfExporter`` subclass under the format ``name``.

    Raises:
        TypeError: the class is not an ``HfExporter`` subclass.

    Registering a different class under a taken name replaces it with a warning; registering the
    same class again (a module imported twice) is silent.
    """
    from hfexport.exporter import HfExporter

    def decorate(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, HfExporter)):
            raise TypeError(f"register_exporter({name!r}) expects an HfExporter subclass, got {cls!r}")
        old = _EXPORTERS.get(name)
        if (
            old is not None
            and f"{old.__module__}.{old.__qualname__}" != f"{cls.__module__}.{cls.__qualname__}"
        ):
            warnings.warn(
                f"exporter {name!r}: {old.__qualname__} replaced by {cls.__qualname__}", stacklevel=2
            )
        _EXPORTERS[name] = cls
        return cls

    return decorate


def register_export_config(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator registering an ``ExportConfigMixin`` subclass under the format ``name``.

    Raises:
        TypeError: the class is not an ``ExportConfigMixin`` subclass.
    """

    def decorate(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, ExportConfigMixin)):
            raise TypeError(
                f"register_export_config({name!r}) expects an ExportConfigMixin subclass, got {cls!r}"
            )
        old = _CONFIGS.get(name)
        if old is not None and old is not cls and old.__qualname__ != cls.__qualname__:
            warnings.warn(
                f"export config {name!r}: {old.__qualname__} replaced by {cls.__qualname__}", stacklevel=2
            )
        _CONFIGS[name] = cls  # type: ignore[assignment]
        return cls

    return decorate


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_backend(name: str) -> type | None:
    if name in _EXPORTERS:
        return _EXPORTERS[name]
    ep = _entry_points().get(name)
    if ep is None:
        return None
    cls = ep.load()
    _EXPORTERS.setdefault(name, cls)
    return _EXPORTERS[name]


def available_export_formats() -> list[str]:
    """Formats whose backend is installed (entry points) or registered in this process."""
    return sorted(set(_EXPORTERS) | set(_entry_points()))


def supports_export_format(name: str) -> bool:
    """True when an exporter for ``name`` is installed or registered (without importing it)."""
    return name in _EXPORTERS or name in _entry_points()


def _missing_backend(name: str) -> MissingBackendError:
    package = KNOWN_BACKEND_PACKAGES.get(name)
    if package is None:
        known = ", ".join(sorted(set(KNOWN_BACKEND_PACKAGES) | set(_EXPORTERS)))
        return MissingBackendError(f"no exporter for export_format={name!r}; known formats: {known}")
    return MissingBackendError(
        f"export_format={name!r} needs the {package} package, which is not installed; "
        f"install it with: pip install {package}"
    )


def get_hf_exporter(name: str | ExportFormat) -> type:
    """Return the exporter class for ``name``, loading its backend through entry points.

    Raises:
        MissingBackendError (an ``ImportError``): the backend package is not installed; the
            message has the ``pip install`` command.
    """
    key = name.value if isinstance(name, ExportFormat) else str(name)
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
        """The config class registered for ``export_format``.

        Raises:
            ValueError: unknown format (the message lists known ones).
        """
        key = export_format.value if isinstance(export_format, ExportFormat) else str(export_format)
        if key not in _CONFIGS:
            raise ValueError(f"export_format={key!r} is not known; allowed: {', '.join(sorted(_CONFIGS))}")
        return _CONFIGS[key]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportConfigMixin:
        """Config for ``data["export_format"]`` (enum or string) built from the rest of ``data``.

        Raises:
            ValueError: ``export_format`` missing or unknown, or any field invalid.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"AutoExportConfig.from_dict expects a dict, got {type(data).__name__}")
        if "export_format" not in data or data["export_format"] in (None, ""):
            raise ValueError(
                "export_format is missing from the config dict; allowed: " + ", ".join(sorted(_CONFIGS))
            )
        fmt = data["export_format"]
        key = fmt.value if isinstance(fmt, ExportFormat) else str(fmt)
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
