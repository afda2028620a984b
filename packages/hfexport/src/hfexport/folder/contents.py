"""What an export folder holds, and reading it back: file names, :class:`ExportRecord`, the reader.

This module imports neither torch nor any other part of hfexport that does (the CLI's ``generate``
checks a folder with it before torch is loaded), and nothing here writes: the writer is
:mod:`hfexport.folder.writer`, which stages the folder with :mod:`hfexport.atomic`, and
:mod:`hfexport.atomic` reads the names and the "previous export" rule from here.

An export folder holds the artifact (or one file per generation component), the model's
``config.json`` and tokenizer files, and

- ``export_report.json`` (:data:`REPORT_NAME`): the :class:`ExportRecord` of the export, written by
  every ``hfexport export`` and by :func:`hfexport.folder.write_export_folder`;
- ``generation_manifest.json`` (:data:`MANIFEST_NAME`): a generation export's components and plan
  (:func:`hfexport.generation.save_components`);
- ``checksums.sha256`` (:data:`CHECKSUMS_NAME`, defined in :mod:`hfexport.integrity`, which
  writes and checks it): the SHA-256 of every other file, as coreutils ``sha256sum`` writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hfexport.errors import HfExportError
from hfexport.integrity import CHECKSUMS_NAME

__all__ = [
    "CHECKSUMS_NAME",
    "EXPORT_MARKERS",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "REPORT_NAME",
    "ArtifactEntry",
    "ExportFolder",
    "ExportFolderError",
    "ExportRecord",
    "previous_export_problem",
    "read_export_folder",
    "read_json_object",
]

#: The export record of every export folder (:class:`ExportRecord` as JSON).
REPORT_NAME = "export_report.json"
#: The generation manifest of a generation export (:func:`hfexport.generation.save_components`).
MANIFEST_NAME = "generation_manifest.json"
#: Version of the generation manifest's layout (bumped on incompatible changes).
MANIFEST_VERSION = 1
#: A folder holding one of these files at its top level is a previous hfexport export.
EXPORT_MARKERS: tuple[str, ...] = (REPORT_NAME, MANIFEST_NAME)
#: The keys a marker file written by hfexport holds (one of them is enough to recognise it).
MARKER_KEYS: dict[str, tuple[str, ...]] = {
    REPORT_NAME: ("export_format", "report"),
    MANIFEST_NAME: ("manifest_version", "format", "files"),
}


class ExportFolderError(HfExportError, ValueError):
    """The path is not a folder that ``hfexport export`` (or ``save_components``) wrote, or it holds
    something :func:`hfexport.load` cannot run (a runtime layout meant for another tool)."""


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object stored in ``path``.

    Args:
        path: a JSON file of an export folder (``export_report.json``, ``generation_manifest.json``).

    Returns:
        The parsed object.

    Raises:
        ExportFolderError: the file cannot be read, is not JSON, or holds something else than an
            object; the message says to export the folder again.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportFolderError(f"{path} cannot be read as JSON ({exc}); export the folder again") from None
    if not isinstance(data, dict):
        raise ExportFolderError(
            f"{path} holds a JSON {type(data).__name__}, not an object; export the folder again"
        )
    return data


@dataclass
class ArtifactEntry:
    """The artifact of a plain export: its file name in the folder and the metadata the backend's
    ``load_component(path, metadata)`` takes (what ``generation_support.component_metadata`` returned)."""

    file: str | None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"file": ..., "metadata": {...}}``, as ``export_report.json`` stores it."""
        return {"file": self.file, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArtifactEntry:
        """The entry of ``export_report.json``'s ``artifact`` object (missing keys: ``None``, ``{}``)."""
        file = data.get("file")
        return cls(file=None if file is None else str(file), metadata=dict(data.get("metadata") or {}))


# the top-level keys of export_report.json in the order they are written; ``extra`` (fields a
# runtime layout's writer adds) follows ``runtime``
_ORDER = (
    "layout",
    "runtime",
    "artifact",
    "components",
    "files",
    "second_shapes",
    "component_reports",
    "size_change",
    "model",
    "task",
    "export_format",
    "config",
    "dtype",
    "versions",
    "report",
    "artifact_sizes_bytes",
    "sha256",
)
# keys written only when they apply (a layout, a plain or a generation export, a size change)
_OPTIONAL = frozenset(
    {
        "layout",
        "runtime",
        "artifact",
        "components",
        "files",
        "second_shapes",
        "component_reports",
        "size_change",
    }
)


@dataclass
class ExportRecord:
    """What an export folder holds and how it was made: the content of ``export_report.json``.

    Filled by the writer (:func:`hfexport.folder.write_export_folder`, the CLI) from the export's
    reports; read by :func:`hfexport.load` (which backend, which artifact file, which output
    class). :meth:`to_dict` / :meth:`from_dict` round-trip the file: a folder written by an
    earlier hfexport gives back the same JSON object, keys in the same order.

    Attributes:
        export_format: the backend's format (``"dynamo"``, ``"onnx"`` ...); selects the loader.
        model: what the model was given as (``--model`` of the CLI: a folder, ``pkg:...``,
            ``tiny:...``; a name of the user's choice from Python).
        task: the task it was exported for (``"feature-extraction"``, ``"text-generation"`` ...).
        config: the export config as ``ExportConfigMixin.to_dict`` gives it.
        dtype: the dtype decision (``hfexport.precision.DtypeDecision.to_dict``).
        versions: ``{distribution: installed version}`` of hfexport, the backend and the libraries
            it was tested with.
        report: the last component's ``ExportReport.to_dict()`` (stages, validation, ...); ``None``
            when no report exists.
        artifact: a plain export's artifact file and load metadata; ``None`` otherwise.
        components: a generation export's components in export order; ``None`` otherwise.
        files: the files ``save_components`` wrote (generation exports).
        second_shapes: per generation component, the second shape it was validated at, or why not.
        component_reports: per generation component, its ``ExportReport.to_dict()``.
        layout: the runtime layout's name (``--layout``); ``None`` for our own folders.
        runtime: the runtime the layout is for.
        size_change: eager float32 weight bytes vs the artifact's bytes (reduced precision,
            fused or quantized exports).
        artifact_sizes_bytes: ``{file name: bytes}`` of the folder's top-level files (the record
            and the checksums excepted).
        sha256: ``{relative path: hex digest}`` of every file but the record and the checksums.
        extra: other top-level fields, written after ``runtime``: what a runtime layout's writer
            returns (``genai``, ``files`` ...; the CLI keeps all of it here, so a layout's fields
            stay together), and keys of a record read from a file that this version does not know.
    """

    export_format: str
    model: str | None = None
    task: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    dtype: dict[str, Any] | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    report: dict[str, Any] | None = None
    artifact: ArtifactEntry | None = None
    components: list[str] | None = None
    files: list[str] | None = None
    second_shapes: dict[str, Any] | None = None
    component_reports: dict[str, dict[str, Any]] | None = None
    layout: str | None = None
    runtime: str | None = None
    size_change: dict[str, Any] | None = None
    artifact_sizes_bytes: dict[str, int] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # the key order of the dict this record was read from (and which keys it had), so a folder
    # written by an earlier version round-trips exactly; ``None`` for a record built in code
    _source_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    # -- what the report says -------------------------------------------------------------------
    @property
    def model_class(self) -> str | None:
        """The class name of the exported module (``"BertModel"``), from the report; ``None`` if absent."""
        name = self.report.get("model_class") if isinstance(self.report, Mapping) else None
        return str(name) if name else None

    @property
    def stages(self) -> list[dict[str, Any]]:
        """The report's stages (``name``, ``status``, ``seconds`` ...), in run order."""
        stages = self.report.get("stages") if isinstance(self.report, Mapping) else None
        return list(stages) if isinstance(stages, list) else []

    @property
    def validation(self) -> dict[str, list[dict[str, Any]]]:
        """The report's comparison rows per validated input set (empty when not validated)."""
        rows = self.report.get("validation") if isinstance(self.report, Mapping) else None
        return dict(rows) if isinstance(rows, Mapping) else {}

    @property
    def is_generation(self) -> bool:
        """Whether the folder holds generation components (and a ``generation_manifest.json``)."""
        return self.components is not None

    def update(self, values: Mapping[str, Any]) -> None:
        """Set fields from ``{key: value}`` as ``export_report.json`` names them (what a layout's
        writer or :meth:`hfexport.folder.ExportFolderWriter.save_generation` returns); keys that
        are no field of the record go to :attr:`extra`.

        Raises:
            ValueError: ``values`` names ``extra`` or ``artifact`` (set those attributes directly).
        """
        names = {f.name for f in fields(self) if not f.name.startswith("_")}
        for key, value in values.items():
            if key in ("extra", "artifact"):
                raise ValueError(f"set ExportRecord.{key} directly, not through update()")
            if key in names:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``export_report.json`` holds.

        Returns:
            A dict in the file's key order; fields that do not apply (``layout`` of a plain
            export, ``artifact`` of a generation export ...) are left out. A record read by
            :meth:`from_dict` gives back exactly the keys, order and values it was read from.
        """
        values: dict[str, Any] = {
            "layout": self.layout,
            "runtime": self.runtime,
            "artifact": self.artifact.to_dict() if self.artifact is not None else None,
            "components": self.components,
            "files": self.files,
            "second_shapes": self.second_shapes,
            "component_reports": self.component_reports,
            "size_change": self.size_change,
            "model": self.model,
            "task": self.task,
            "export_format": self.export_format,
            "config": self.config,
            "dtype": self.dtype,
            "versions": self.versions,
            "report": self.report,
            "artifact_sizes_bytes": self.artifact_sizes_bytes,
            "sha256": self.sha256,
        }
        if self._source_keys is not None:
            # the keys, order and values of the file it was read from; a field the file lacked is
            # added only when it was given a value since
            every = {**self.extra, **values}
            out = {key: every[key] for key in self._source_keys if key in every}
            out.update({k: v for k, v in every.items() if k not in out and v not in (None, "", {})})
            return out
        out = {}
        for key in _ORDER:
            if key in _OPTIONAL and values[key] is None:
                continue
            out[key] = values[key]
            if key == "runtime":  # a layout's own fields follow its name and runtime
                out.update(self.extra)
        if "runtime" not in out:
            out = {**self.extra, **out}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportRecord:
        """Read the JSON object of an ``export_report.json`` (any hfexport version's).

        Args:
            data: the parsed object.

        Returns:
            The record; keys it does not know go to :attr:`extra`.

        Raises:
            ExportFolderError: ``data`` is not a mapping.
        """
        if not isinstance(data, Mapping):
            raise ExportFolderError(
                f"an export record is a JSON object, got {type(data).__name__}; export the folder again"
            )
        known = {f.name for f in fields(cls) if not f.name.startswith("_")} - {"extra", "artifact"}
        kwargs: dict[str, Any] = {key: data[key] for key in known if key in data}
        artifact = data.get("artifact")
        kwargs["export_format"] = data.get("export_format", "")
        record = cls(
            artifact=ArtifactEntry.from_dict(artifact) if isinstance(artifact, Mapping) else None,
            extra={k: v for k, v in data.items() if k not in known and k != "artifact"},
            **kwargs,
        )
        record._source_keys = tuple(data)
        return record

    def to_json(self) -> str:
        """The text of ``export_report.json``: indented JSON, non-JSON values as ``str``, one final newline."""
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"


@dataclass
class ExportFolder:
    """An export folder as read by :func:`read_export_folder`.

    Attributes:
        path: the folder.
        record: its ``export_report.json`` as an :class:`ExportRecord` (``None`` when absent: a
            folder written by :func:`hfexport.generation.save_components` alone).
        is_generation: it holds a ``generation_manifest.json`` (its components run with a
            generation runner; :func:`hfexport.generation.read_manifest` reads and checks it).
    """

    path: Path
    record: ExportRecord | None
    is_generation: bool

    @property
    def report_path(self) -> Path:
        """``<path>/export_report.json``."""
        return self.path / REPORT_NAME

    @property
    def manifest_path(self) -> Path:
        """``<path>/generation_manifest.json``."""
        return self.path / MANIFEST_NAME

    @property
    def layout(self) -> str | None:
        """The runtime layout the folder was written in (``--layout``), or ``None``."""
        return self.record.layout if self.record is not None else None

    def model_class(self) -> str | None:
        """The exported class's name: the record's, else :meth:`architecture`."""
        if self.record is not None and self.record.model_class:
            return self.record.model_class
        return self.architecture()

    def architecture(self) -> str | None:
        """The first of ``config.json``'s ``architectures``; ``None`` when it names none."""
        config = self.path / "config.json"
        if config.is_file():
            try:
                architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                return None
            if isinstance(architectures, list) and architectures:
                return str(architectures[0])
        return None


def read_export_folder(output_dir: str | os.PathLike[str], *, verify: bool = True) -> ExportFolder:
    """Read what an export folder holds: its record and, for a generation export, its manifest.

    Args:
        output_dir: a folder written by ``hfexport export``, :func:`hfexport.folder.write_export_folder`
            or :func:`hfexport.generation.save_components`.
        verify: first check every file ``checksums.sha256`` lists (:func:`hfexport.integrity.verify_checksums`).

    Returns:
        An :class:`ExportFolder` (the manifest is only noted: its reader,
        :func:`hfexport.generation.read_manifest`, checks it against the component files).

    Raises:
        ExportFolderError: ``output_dir`` is not a folder, holds neither ``export_report.json`` nor
            ``generation_manifest.json``, or its ``export_report.json`` is not a readable JSON object.
        hfexport.errors.IntegrityError: (``verify``) a file differs from its SHA-256.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        raise ExportFolderError(
            f"{folder} is not a folder; pass the OUTPUT_DIR that `hfexport export FORMAT OUTPUT_DIR` wrote"
        )
    report_path, manifest_path = folder / REPORT_NAME, folder / MANIFEST_NAME
    if not manifest_path.is_file() and not report_path.is_file():
        raise ExportFolderError(
            f"{folder} is not an export folder: it has neither {MANIFEST_NAME} nor {REPORT_NAME}; pass the "
            "OUTPUT_DIR that `hfexport export FORMAT OUTPUT_DIR` wrote"
        )
    if verify:
        from hfexport.integrity import verify_checksums

        verify_checksums(folder)  # every listed file, before anything is parsed
    record = ExportRecord.from_dict(read_json_object(report_path)) if report_path.is_file() else None
    return ExportFolder(folder, record, manifest_path.is_file())


def previous_export_problem(folder: str | os.PathLike[str], entries: list[str]) -> str | None:
    """Why the non-empty ``folder`` (holding ``entries``) is not a previous export, or ``None``.

    A previous export holds a marker (:data:`EXPORT_MARKERS`) that is a JSON object with the keys
    hfexport writes; when it also holds ``checksums.sha256`` (every export of this version does),
    each of its files must be listed there, so a file dropped into an export folder later is not
    deleted by the next export without ``--overwrite``.

    Args:
        folder: the folder.
        entries: the names of its top-level entries (``os.listdir``).

    Returns:
        ``None`` for a previous export, else a phrase for an error message (``"it holds a, b but no ..."``).
    """
    target = Path(folder)
    listed = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    markers = [m for m in EXPORT_MARKERS if m in entries]
    if not markers:
        return f"it holds {listed} but no {' or '.join(EXPORT_MARKERS)}"
    for marker in markers:
        try:
            data = json.loads((target / marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        if not (isinstance(data, dict) and any(key in data for key in MARKER_KEYS[marker])):
            return f"its {marker} is not one hfexport wrote"
    if CHECKSUMS_NAME in entries:
        try:
            lines = (target / CHECKSUMS_NAME).read_text(encoding="utf-8").splitlines()
        except (OSError, ValueError):
            return f"its {CHECKSUMS_NAME} cannot be read"
        known = {line.split("  ", 1)[1] for line in lines if "  " in line} | {CHECKSUMS_NAME}
        extra = sorted(e for e in entries if e not in known and (target / e).is_file())
        # a folder is the export's when it holds a listed file (a layout's onnx/model.onnx)
        parents = {path.split("/", 1)[0] for path in known if "/" in path}
        extra += sorted(e for e in entries if (target / e).is_dir() and e not in known | parents)
        if extra:
            shown = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
            verb = "is" if len(extra) == 1 else "are"
            return f"{shown} {verb} not among the files the export listed in {CHECKSUMS_NAME}"
    return None
