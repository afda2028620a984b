"""The ONNX backend's generation hooks: :class:`OnnxGenerationSupport`, the
:class:`hfexport.generation.support.GenerationSupport` of :class:`hfexport_onnx.OnnxExporter`
(its ``generation_support_class``).

One hook differs from the core's defaults: ``load_component`` opens an ONNX Runtime session over
the saved file, after checking the graph and its external data against the folder's checksums.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfexport.generation.support import GenerationSupport
from hfexport_onnx.runtime import OnnxRuntimeRunner

__all__ = ["OnnxGenerationSupport"]


class OnnxGenerationSupport(GenerationSupport):
    """Generation hooks of the ONNX backend (see the module docstring)."""

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """An ONNX Runtime session over a saved ``.onnx`` component (or a plain export's model).

        The graph feeds inputs by leaf path (``input_ids``, ``cache.layers.0.keys`` ...) and names
        the outputs like the eager model's; a cache goes in as graph inputs and comes back as
        paired outputs (``cache.layers.0.keys.out`` mapped back to the leaf path), also for a
        static cache, whose in-place update becomes an output in ONNX. ``metadata`` is unused (the
        graph's names are in the file).

        The graph and its external data (``<file>.data``) are first checked against the folder's
        ``checksums.sha256`` when it lists them (:func:`hfexport.integrity.verify_file`).

        Returns:
            An :class:`hfexport_onnx.runtime.OnnxRuntimeRunner`: forward kwargs -> ``{leaf path: tensor}``.

        Raises:
            FileNotFoundError: no file at ``path``.
            hfexport.errors.IntegrityError: the graph or its weights differ from their SHA-256.
        """
        from hfexport.integrity import verify_file

        if not os.path.isfile(path):
            raise FileNotFoundError(f"no ONNX model at {path}")
        verify_file(path)
        external = Path(path).with_name(Path(path).name + ".data")
        if external.is_file():
            verify_file(external)
        return OnnxRuntimeRunner(path)
