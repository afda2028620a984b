"""The dynamo backend's generation hooks: :class:`DynamoGenerationSupport`, the
:class:`hfexport.generation.support.GenerationSupport` of
:class:`hfexport_dynamo.DynamoExporter` (its ``generation_support_class``).

Two hooks differ from the core's defaults:

- ``generation_source``: with int8 weight-only quantization, one quantized copy of the model that
  every component is captured from (:func:`hfexport_dynamo.quantize.quantize_copy`);
- ``component_metadata``: the flat input/output names of a ``.pt2`` (:mod:`hfexport_dynamo.flat_io`),
  so a torch-only process can run a saved component.

Loading keeps the default (``runner(load(path))``, with the safe loader :func:`hfexport_dynamo.load`).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.generation.support import GenerationSupport
from hfexport_dynamo.flat_io import flat_io_names

__all__ = ["DynamoGenerationSupport"]


class DynamoGenerationSupport(GenerationSupport):
    """Generation hooks of the dynamo backend (see the module docstring)."""

    def component_metadata(self, artifact: torch.export.ExportedProgram) -> dict[str, Any]:
        """``{"flat_io": {"inputs": {flat_name: leaf_path}, "outputs": {...}}}`` for the manifest.

        The names a torch-only process passes to ``torch.export.load(file).module()(**leaves)`` and
        reads from its output dict (see :mod:`hfexport_dynamo.flat_io`).
        """
        return {"flat_io": flat_io_names(artifact)}
