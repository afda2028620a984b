"""hfexport-onnx: export Hugging Face transformers models to ONNX and validate them in ONNX Runtime.

``OnnxExporter().export(model, forward_kwargs, OnnxConfig(dynamic=True))`` returns a
``torch.onnx.ONNXProgram`` (``.save("model.onnx")``); importing this package registers the
exporter under the format ``"onnx"``, its workarounds (patches, FX fixes, custom translations,
ONNX IR fixes) in their registries and its runtime layouts (``genai``: ONNX Runtime GenAI, see
:mod:`hfexport_onnx.layouts.genai`).
"""

from __future__ import annotations

from hfexport_onnx import bench_runtime  # noqa: F401  (registers the onnxruntime-genai bench runtime)
from hfexport_onnx.__about__ import __version__
from hfexport_onnx.exporter import OnnxExporter, SaveOptions
from hfexport_onnx.io_names import IoNames
from hfexport_onnx.layouts import genai as _genai_layout  # noqa: F401  (registers the "genai" layout)
from hfexport_onnx.layouts import transformers_js  # noqa: F401  (registers the transformers.js layout)
from hfexport_onnx.runtime import OnnxRuntimeRunner
from hfexport_onnx.workarounds import (  # noqa: F401  (registration)
    fx_fixes,
    ir_fixes,
    ort_layer_norm,
    patches,
    sdpa_key_transpose,
    sdpa_nan_guard,
    translations,
)

__all__ = ["IoNames", "OnnxExporter", "OnnxRuntimeRunner", "SaveOptions", "__version__"]
