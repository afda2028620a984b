"""hfexport-executorch: export Hugging Face transformers models to ExecuTorch programs (``.pte``).

``ExecutorchExporter`` lowers through XNNPACK (CPU) or the CUDA backend and validates the program
in the ExecuTorch runtime against eager PyTorch. Importing this package registers the exporter
under the ``"executorch"`` format and registers its patches, FX fixes and LLM custom-op source
transforms (:mod:`hfexport_executorch.llm_ops`) with :mod:`hfexport.registry`, and its runtime layouts (``llm-runner``, :mod:`hfexport_executorch.layouts`) with
:mod:`hfexport.layouts`.
"""

from __future__ import annotations

from hfexport_executorch import (
    bench_runtime,  # noqa: F401  (registers the executorch-llm-runner bench runtime)
    llm_ops,  # noqa: F401  (register the LLM custom-op source transforms)
)
from hfexport_executorch.__about__ import __version__
from hfexport_executorch.exporter import ExecutorchExporter
from hfexport_executorch.layouts import LLM_RUNNER as _LLM_RUNNER  # noqa: F401  (register the layouts)
from hfexport_executorch.versions import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS
from hfexport_executorch.workarounds import edge_passes, fx_fixes, patches  # noqa: F401  (register the workarounds)

__all__ = ["MIN_VERSIONS", "SUPPORTED", "TESTED_VERSIONS", "ExecutorchExporter", "__version__"]
