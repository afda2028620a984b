"""The export folder: its file names, the :class:`ExportRecord` of ``export_report.json``, the
writer the CLI and Python users call, and the reader :func:`hfexport.load` uses.

Write a folder without the CLI::

    program = exporter.export(model, inputs)
    hfexport.folder.write_export_folder("out/", exporter, program, model=model, task="feature-extraction")
    hfexport.load("out/")(**inputs)

Two modules, so the import graph stays a DAG: :mod:`hfexport.folder.contents` (names, record,
reader, the "previous export" rule; read by :mod:`hfexport.atomic`, :mod:`hfexport.loader` and
:mod:`hfexport.generation.persist`) and :mod:`hfexport.folder.writer` (which stages the folder with
:mod:`hfexport.atomic`). Neither imports torch. Modules of the core below the writer import from
:mod:`hfexport.folder.contents` directly.
"""

from __future__ import annotations

from hfexport.folder.contents import (
    CHECKSUMS_NAME,
    EXPORT_MARKERS,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    REPORT_NAME,
    ArtifactEntry,
    ExportFolder,
    ExportFolderError,
    ExportRecord,
    previous_export_problem,
    read_export_folder,
    read_json_object,
)
from hfexport.folder.writer import (
    ExportFolderWriter,
    export_versions,
    open_export_folder,
    second_shape_record,
    size_change,
    write_export_folder,
)

__all__ = [
    "CHECKSUMS_NAME",
    "EXPORT_MARKERS",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "REPORT_NAME",
    "ArtifactEntry",
    "ExportFolder",
    "ExportFolderError",
    "ExportFolderWriter",
    "ExportRecord",
    "export_versions",
    "open_export_folder",
    "previous_export_problem",
    "read_export_folder",
    "read_json_object",
    "second_shape_record",
    "size_change",
    "write_export_folder",
]
