"""hfexport-openvino: export Hugging Face transformers models to OpenVINO IR (``openvino_model.xml``).

>>> from hfexport import OpenvinoConfig
>>> from hfexport_openvino import OpenvinoExporter
>>> exporter = OpenvinoExporter()
>>> ov_model = exporter.export(model, {"input_ids": ids, "attention_mask": mask}, OpenvinoConfig(dynamic=True))
>>> exporter.save(ov_model, "out/openvino_model.xml")   # + out/openvino_model.bin

Importing the package registers its workarounds with :mod:`hfexport.registry` (``"openvino"`` key)
and its ``genai`` layout with :mod:`hfexport.layouts`.
"""

from __future__ import annotations

from hfexport_openvino import bench_runtime  # noqa: F401  (registers the openvino-genai bench runtime)
from hfexport_openvino.__about__ import __version__
from hfexport_openvino.errors import DeviceUnavailableError, OpenvinoConversionError, StatefulExportError
from hfexport_openvino.exporter import OpenvinoExporter, check_device, save_model
from hfexport_openvino.layouts import GENAI_LAYOUT  # registers the "genai" layout
from hfexport_openvino.runtime import OpenvinoRunner
from hfexport_openvino.versions import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS
from hfexport_openvino.workarounds import (
    fx_fixes,  # noqa: F401  (registers the "openvino" workarounds)
    patches,  # noqa: F401  (registers the "openvino" capture patches)
)

__all__ = [
    "GENAI_LAYOUT",
    "MIN_VERSIONS",
    "SUPPORTED",
    "TESTED_VERSIONS",
    "DeviceUnavailableError",
    "OpenvinoConversionError",
    "OpenvinoExporter",
    "OpenvinoRunner",
    "StatefulExportError",
    "__version__",
    "check_device",
    "save_model",
]
