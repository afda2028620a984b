"""Writing an export folder that :func:`hfexport.load` reads: one writer for the CLI and for Python.

>>> program = exporter.export(model, inputs)                       # any backend
>>> write_export_folder("out/", exporter, program, model=model)    # artifact, config.json, record, checksums
>>> hfexport.load("out/")(**inputs)                                # the eager model's output class

:func:`write_export_folder` writes an artifact that is in memory (what ``exporter.export`` or
``exporter.export_for_generation`` returned). The CLI, which saves and validates the artifact in
the staging folder itself (the lowest-memory path), opens the same writer with
:func:`open_export_folder` and finishes it with the record it built; both end in
:meth:`ExportFolderWriter.finish`, which writes ``export_report.json`` and ``checksums.sha256``.
The folder is replaced as a whole (:func:`hfexport.atomic.atomic_output_dir`): a failure leaves
``OUTPUT_DIR`` as it was.

Nothing here imports torch at module level (the functions that take a model or an artifact use
what the exporter and the model object give them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hfexport.folder.contents import MANIFEST_NAME, REPORT_NAME, ArtifactEntry, ExportRecord, read_json_object

__all__ = [
    "ExportFolderWriter",
    "export_versions",
    "open_export_folder",
    "second_shape_record",
    "size_change",
    "write_export_folder",
]


def export_versions(exporter: Any) -> dict[str, str | None]:
    """``{distribution: installed version}`` of hfexport, the exporter's package and every
    distribution in its ``tested_versions`` (``None`` for one that is not installed)."""
    from hfexport.environment import installed_version

    names = ("hfexport", exporter.package_name, *exporter.tested_versions)
    return {name: installed_version(name) for name in names}


def second_shape_record(report: Any) -> dict[str, Any]:
    """What the record keeps of one component's second-shape validation: the report's
    ``second_shape`` entry (shapes, changed axes and values, summary), or the stage's status and
    reason when it did not run.

    Args:
        report: the component's :class:`hfexport.report.ExportReport`.
    """
    record = report.second_shape
    if record is not None:
        return dict(record)
    stages = [s for s in report.stages if s.name == "validate_second_shape"]
    if stages:
        return {"status": stages[-1].status, "reason": stages[-1].detail}
    return {"status": "not run", "reason": "a static export, or validation is off"}


def eager_float32_bytes(model: Any) -> int:
    """:func:`hfexport.linear_forms.eager_float32_bytes` (imported when called: this module loads
    without torch)."""
    from hfexport.linear_forms import eager_float32_bytes as count

    return count(model)


def size_change(
    config: Any,
    model: Any,
    sizes: Mapping[str, int],
    artifact_names: Mapping[str, str],
    export_dtype: str | None = None,
) -> dict[str, Any] | None:
    """Eager fp32 weight bytes vs the artifact's files for a reduced-precision, fused or quantized
    export; ``None`` otherwise or without an artifact file.

    Args:
        config: the export config (its ``dtype``, ``quantization``, ``ort_fusions`` say whether
            the size changes).
        model: the eager model (its floating point parameters and buffers, counted as float32), or
            that count in bytes, taken before an export that releases the model's weights.
        sizes: ``{file name: bytes}`` of the output folder.
        artifact_names: ``{component: artifact file name}`` (``{"model": "model.onnx"}`` for a
            plain export); a component's bytes are those of every file whose name starts with its
            file name (``model.onnx`` + ``model.onnx.data``) plus a ``.bin`` weights file of the same stem
            (``openvino_model.xml`` + ``openvino_model.bin``).
        export_dtype: the dtype the export computed in when ``config.dtype`` is ``None`` (auto:
            the dtype decision's ``export``, e.g. ``"bfloat16"`` for a bf16 checkpoint on dynamo).

    Returns:
        ``{"eager_float32_bytes", "artifact_bytes", "ratio"}`` (all artifact files), and for more
        than one component ``"components": {name: {"bytes", "ratio"}}``.
    """
    dtype = getattr(config, "dtype", None) or export_dtype
    plain = dtype in (None, "float32") and getattr(config, "quantization", None) is None
    if plain and getattr(config, "ort_fusions", None) is None:
        return None

    def weights_of(name: str) -> str:
        return name.rsplit(".", 1)[0] + ".bin"

    # a component's files: its own name and the files it brings (model.onnx + model.onnx.data), and
    # a weights file beside it with its stem (openvino_model.xml + openvino_model.bin)
    per_component = {
        name: sum(n for file, n in sizes.items() if file.startswith(prefix) or file == weights_of(prefix))
        for name, prefix in artifact_names.items()
    }
    artifact = sum(per_component.values())
    eager = model if isinstance(model, int) else eager_float32_bytes(model)
    if not artifact or not eager:
        return None
    change: dict[str, Any] = {
        "eager_float32_bytes": eager,
        "artifact_bytes": artifact,
        "ratio": round(artifact / eager, 4),
    }
    if len(per_component) > 1:
        change["components"] = {
            name: {"bytes": n, "ratio": round(n / eager, 4)} for name, n in per_component.items()
        }
    return change


class ExportFolderWriter:
    """The staging folder of one export folder being written (made by :func:`open_export_folder`).

    Write the files into :attr:`path` (or with the methods below), then call :meth:`finish` with
    the record; the folder takes ``OUTPUT_DIR``'s place when the ``with`` block ends.

    Attributes:
        path: the staging folder (a sibling of ``OUTPUT_DIR``; see :func:`hfexport.atomic.atomic_output_dir`).
        exporter: the ``HfExporter`` whose artifacts the folder holds.
        record: the record :meth:`finish` wrote, ``None`` before.
    """

    def __init__(self, path: Path, exporter: Any) -> None:
        self.path = path
        self.exporter = exporter
        self.record: ExportRecord | None = None

    def artifact_path(self) -> Path:
        """Where a plain export's artifact goes: ``<path>/<exporter.artifact_filename>``."""
        return Path(self.exporter.artifact_path(self.path))

    def save_artifact(self, artifact: Any) -> ArtifactEntry:
        """Save an in-memory artifact of a plain export with ``exporter.save``.

        Returns:
            The record's ``artifact`` entry (file name, ``exporter.generation_support.component_metadata(artifact)``).
        """
        path = self.artifact_path()
        self.exporter.save(artifact, path)
        return ArtifactEntry(
            file=path.name, metadata=dict(self.exporter.generation_support.component_metadata(artifact) or {})
        )

    def saved_artifact(self, metadata: Mapping[str, Any] | None) -> ArtifactEntry:
        """The ``artifact`` entry of an artifact already saved at :meth:`artifact_path` (by
        ``exporter.export_to_path``, whose report holds the ``metadata``)."""
        return ArtifactEntry(file=self.artifact_path().name, metadata=dict(metadata or {}))

    def save_generation(self, artifacts: Mapping[str, Any], *, model: Any = None) -> dict[str, Any]:
        """Save a generation export's components and manifest (:func:`hfexport.generation.save_components`).

        Args:
            artifacts: what ``exporter.export_for_generation`` returned.
            model: the exported model (its generation config refreshes the token ids).

        Returns:
            The record's generation fields: ``components``, ``files``, ``second_shapes`` and, when
            the components have reports, ``component_reports``.
        """
        from hfexport.generation import save_components

        written = save_components(self.exporter, artifacts, self.path, model=model)
        reports = getattr(artifacts, "reports", {}) or {}
        fields: dict[str, Any] = {
            "components": list(artifacts),
            "files": [str(w) for w in written],
            # per component, the shape it was validated at besides the sample, or why none
            "second_shapes": {name: second_shape_record(r) for name, r in reports.items()},
        }
        component_reports = {name: reports[name] for name in artifacts if name in reports}
        if component_reports:
            fields["component_reports"] = {name: r.to_dict() for name, r in component_reports.items()}
        return fields

    def component_files(self, order: Iterable[str] = ()) -> dict[str, str]:
        """``{component: file name}`` from the generation manifest in the folder, ``order``
        first (prefill before decode), then the others by name."""
        manifest = read_json_object(self.path / MANIFEST_NAME)
        files = {str(k): str(v) for k, v in (manifest.get("files") or {}).items()}
        return {name: files[name] for name in [*order, *sorted(files)] if name in files}

    def copy_files(self, files: Iterable[str | os.PathLike[str]]) -> None:
        """Copy files (tokenizer, ``config.json`` ...) into the folder, under their own names."""
        for file in files:
            shutil.copy2(file, self.path / Path(file).name)

    def write_model_config(self, model: Any) -> None:
        """Write ``model.config`` as ``config.json`` unless the folder has one (or the model has no config)."""
        if not (self.path / "config.json").exists() and hasattr(model, "config"):
            model.config.to_json_file(self.path / "config.json")

    def sizes(self) -> dict[str, int]:
        """``{file name: bytes}`` of the folder's top-level files, sorted by name."""
        return {p.name: p.stat().st_size for p in sorted(self.path.iterdir()) if p.is_file()}

    def complete(
        self,
        record: ExportRecord,
        *,
        model_name: str | None,
        task: str | None,
        config: Any,
        dtype: Mapping[str, Any] | None,
        report: Any,
        model: Any = None,
        artifact_names: Mapping[str, str] | None = None,
    ) -> ExportRecord:
        """Fill what every export records, then :meth:`finish` the folder.

        Args:
            record: the record with what the export wrote (``artifact``, or the generation
                fields, or a layout's).
            model_name: what the model was given as (the CLI's ``--model``).
            task: the task exported for.
            config: the export config (recorded with ``to_dict()``).
            dtype: the dtype decision as a dict (``DtypeDecision.to_dict()``).
            report: the (last component's) :class:`hfexport.report.ExportReport`, or ``None``.
            model: the eager model, for the size change of a reduced-precision or quantized export.
            artifact_names: ``{component: artifact file name}`` whose bytes the size change counts.

        Returns:
            The record as written (see :meth:`finish`).
        """
        sizes = self.sizes()
        record.model = model_name
        record.task = task
        record.config = config.to_dict()
        record.dtype = dict(dtype) if dtype is not None else None
        record.versions = export_versions(self.exporter)
        record.report = report.to_dict() if report is not None else None
        if model is not None and artifact_names:
            export_dtype = (dtype or {}).get("export")
            record.size_change = size_change(config, model, sizes, artifact_names, export_dtype)
        record.artifact_sizes_bytes = sizes
        return self.finish(record)

    def finish(self, record: ExportRecord) -> ExportRecord:
        """Complete the record's sizes and checksums and write ``export_report.json`` and
        ``checksums.sha256``.

        Args:
            record: the record; its ``artifact_sizes_bytes`` is filled when empty, its ``sha256``
                always (every file but the record itself).

        Returns:
            The record as written: ``ExportRecord.from_dict`` of the file's JSON (values that are
            not JSON, such as tuples, come back as the file holds them).
        """
        from hfexport.integrity import compute_checksums, write_checksums

        if not record.artifact_sizes_bytes:
            record.artifact_sizes_bytes = self.sizes()
        record.sha256 = compute_checksums(self.path)
        text = record.to_json()
        (self.path / REPORT_NAME).write_text(text, encoding="utf-8")
        write_checksums(self.path, digests=record.sha256)  # + the record: `sha256sum -c` checks all
        # what the file holds (tuples as lists, other objects as str), as a reader gets it back
        self.record = ExportRecord.from_dict(json.loads(text))
        return self.record


@contextlib.contextmanager
def open_export_folder(
    output_dir: str | os.PathLike[str], exporter: Any, *, overwrite: bool = False
) -> Iterator[ExportFolderWriter]:
    """Stage a new export folder; it replaces ``output_dir`` when the block ends without error.

    Args:
        output_dir: the folder to write; it need not exist. It must be new, empty or a previous
            export unless ``overwrite``.
        exporter: the ``HfExporter`` whose artifacts go in.
        overwrite: replace a folder holding other files (they are deleted).

    Yields:
        An :class:`ExportFolderWriter`; the block must call its :meth:`~ExportFolderWriter.finish`.

    Raises:
        OutputDirectoryError: ``output_dir`` cannot receive an export (checked before anything
            is written), or the block ended without :meth:`~ExportFolderWriter.finish` (nothing
            is written then).
        OSError: a file cannot be written (``output_dir`` is left as it was).
    """
    from hfexport.atomic import atomic_output_dir
    from hfexport.errors import OutputDirectoryError

    with atomic_output_dir(output_dir, overwrite=overwrite) as staging:
        writer = ExportFolderWriter(staging, exporter)
        yield writer
        if writer.record is None:
            raise OutputDirectoryError(
                f"the export folder {os.fspath(output_dir)!r} was not finished (no {REPORT_NAME} written); "
                "call ExportFolderWriter.finish(record) inside the block",
                path=os.fspath(output_dir),
            )


def write_export_folder(
    output_dir: str | os.PathLike[str],
    exporter: Any,
    artifact: Any,
    *,
    model: Any = None,
    model_name: str | None = None,
    task: str | None = None,
    config: Any = None,
    files: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
) -> ExportRecord:
    """Write an export folder that :func:`hfexport.load` (and ``hfexport generate``) reads.

    Args:
        output_dir: the folder; replaced as a whole on success, left as it was on failure.
        exporter: the ``HfExporter`` that made ``artifact`` (its ``last_report`` is recorded).
        artifact: what ``exporter.export(...)`` returned (a plain export: saved as
            ``exporter.artifact_filename``), or what ``exporter.export_for_generation(...)``
            returned (one file per component and ``generation_manifest.json``).
        model: the exported model: its ``config.json`` is written (unless ``files`` has one), its
            class names the output class :func:`hfexport.load` returns, its weights give the size
            change of a reduced-precision or quantized export.
        model_name: what the record names as the model (default: the model's ``name_or_path``,
            else its class name).
        task: the task recorded (``"feature-extraction"`` ...; default ``"text-generation"`` for a
            generation export, else ``None``).
        config: the export's config (default: the one the exporter's last export used).
        files: files copied in as they are (tokenizer files, ...).
        overwrite: replace a folder holding files that are not a previous export.

    Returns:
        The :class:`ExportRecord` written to ``export_report.json``.

    Raises:
        OutputDirectoryError: ``output_dir`` cannot receive an export (a file, not writable, or
            a non-empty folder that is not a previous export and ``overwrite`` is false).
        ValueError: ``exporter`` has not exported anything (no report) and ``config`` is not given.
        OSError: a file cannot be written.
        NotImplementedError: the backend cannot save its artifacts.
    """
    report = getattr(exporter, "last_report", None)
    config = config if config is not None else getattr(exporter, "last_config", None)
    if config is None:
        raise ValueError(
            "write_export_folder needs the export's config: export with the exporter first, or pass config="
        )
    generation = hasattr(artifact, "plan") and isinstance(artifact, Mapping)
    with open_export_folder(output_dir, exporter, overwrite=overwrite) as folder:
        record = ExportRecord(export_format=str(exporter.export_format))
        if generation:
            record.update(folder.save_generation(artifact, model=model))
            reports = list(record.component_reports or {})
            last = artifact.reports[reports[-1]] if reports else report
            names = folder.component_files(order=list(artifact))
        else:
            record.artifact = folder.save_artifact(artifact)
            last = report
            names = {"model": record.artifact.file or ""}
        folder.copy_files(files)
        if model is not None:
            folder.write_model_config(model)
        name = model_name
        if name is None and model is not None:
            name = getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__
        record = folder.complete(
            record,
            model_name=name,
            task=task if task is not None else ("text-generation" if generation else None),
            config=config,
            dtype=getattr(last, "dtype", None),
            report=last,
            model=model,
            artifact_names=names,
        )
    return record
