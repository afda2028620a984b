"""hfexport: export Hugging Face transformers models to runtime artifacts and prove they match.

The core holds the shared machinery (configs, the ``HfExporter`` base, Auto classes, workaround
registries, version checks, input preparation, validation); backends live in their own packages
(``hfexport-dynamo``, ``hfexport-onnx``, ``hfexport-executorch``, ``hfexport-openvino``) and are
found through the ``hfexport.exporters`` entry-point group.

``from hfexport import OnnxExporter`` (likewise ``DynamoExporter``, ``ExecutorchExporter``) resolves
lazily to the installed backend; when it is not installed the import raises ``ImportError`` with
the ``pip install`` command. Importing ``hfexport`` never imports a backend.
"""

from __future__ import annotations

import importlib
from typing import Any

from hfexport.__about__ import __version__

# name -> (module, attribute); resolved on first access so `import hfexport` stays light.
_LAZY: dict[str, tuple[str, str]] = {
    # configs
    "ExportFormat": ("hfexport.config", "ExportFormat"),
    "ExportConfigMixin": ("hfexport.config", "ExportConfigMixin"),
    "CaptureConfig": ("hfexport.config", "CaptureConfig"),
    "DynamoConfig": ("hfexport.config", "DynamoConfig"),
    "OnnxConfig": ("hfexport.config", "OnnxConfig"),
    "ExecutorchConfig": ("hfexport.config", "ExecutorchConfig"),
    "OpenvinoConfig": ("hfexport.config", "OpenvinoConfig"),
    # exporter base and auto classes
    "HfExporter": ("hfexport.exporter", "HfExporter"),
    "AutoExportConfig": ("hfexport.auto", "AutoExportConfig"),
    "AutoHfExporter": ("hfexport.auto", "AutoHfExporter"),
    "get_hf_exporter": ("hfexport.auto", "get_hf_exporter"),
    "register_exporter": ("hfexport.auto", "register_exporter"),
    "register_export_config": ("hfexport.auto", "register_export_config"),
    "supports_export_format": ("hfexport.auto", "supports_export_format"),
    "available_export_formats": ("hfexport.auto", "available_export_formats"),
    # registries
    "register_patch": ("hfexport.registry", "register_patch"),
    "register_fx_node_fix": ("hfexport.registry", "register_fx_node_fix"),
    "register_fx_program_fix": ("hfexport.registry", "register_fx_program_fix"),
    "apply_patches": ("hfexport.registry", "apply_patches"),
    # inputs and tensors
    "prepare_for_export": ("hfexport.inputs", "prepare_for_export"),
    "register_export_input_preparer": (
        "hfexport.workarounds.input_preparers",
        "register_export_input_preparer",
    ),
    "get_leaf_tensors": ("hfexport.tensors", "get_leaf_tensors"),
    "load": ("hfexport.loader", "load"),
    "ExportedModel": ("hfexport.loader", "ExportedModel"),
    # errors
    "HfExportError": ("hfexport.errors", "HfExportError"),
    "ExportValidationError": ("hfexport.errors", "ExportValidationError"),
    "ExportStageError": ("hfexport.errors", "ExportStageError"),
    "MissingBackendError": ("hfexport.errors", "MissingBackendError"),
    "OutputDirectoryError": ("hfexport.errors", "OutputDirectoryError"),
    "UnsupportedInputError": ("hfexport.errors", "UnsupportedInputError"),
    "UnsupportedModelError": ("hfexport.errors", "UnsupportedModelError"),
}

# Backend classes resolved through the installed backend (entry points).
_BACKEND_CLASSES = {
    "DynamoExporter": "dynamo",
    "OnnxExporter": "onnx",
    "ExecutorchExporter": "executorch",
    "OpenvinoExporter": "openvino",
}

__all__ = ["__version__", *_LAZY, *_BACKEND_CLASSES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _BACKEND_CLASSES:
        from hfexport.auto import get_hf_exporter

        value = get_hf_exporter(_BACKEND_CLASSES[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfexport' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
