"""Generation components for the ONNX backend: run saved ``.onnx`` components in ONNX Runtime.

The greedy loop lives in the core (:class:`hfexport.generation.GenerationRunner`); each component
call is an :class:`hfexport_onnx.runtime.OnnxRuntimeRunner`, which feeds the graph inputs by leaf
path (``input_ids``, ``cache.layers.0.keys`` ...) and names the outputs like the eager model's. A
cache is passed in as graph inputs and comes back as paired outputs (``cache.layers.0.keys`` in,
``cache.layers.0.keys.out`` out, mapped back to the leaf path), also for a static cache, whose
in-place update becomes an output in ONNX.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hfexport.generation.runner import Caller

__all__ = ["component_metadata", "load_component"]


def component_metadata(artefact: Any) -> dict[str, Any]:
    """Nothing beyond the file: the graph's input/output names map to leaf paths in its metadata."""
    return {}


def load_component(path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Caller:
    """Load a saved ``.onnx`` component into an ONNX Runtime session and return its caller.

    The graph and its external data (``<file>.data``) are first checked against the folder's
    ``checksums.sha256`` when it lists them (:func:`hfexport.integrity.verify_file`).

    Raises:
        FileNotFoundError: no file at ``path``.
        hfexport.errors.IntegrityError: the graph or its weights differ from their SHA-256.
    """
    from pathlib import Path

    from hfexport.integrity import verify_file
    from hfexport_onnx.runtime import OnnxRuntimeRunner

    if os.path.isfile(path):
        verify_file(path)
        external = Path(path).with_name(Path(path).name + ".data")
        if external.is_file():
            verify_file(external)
    return OnnxRuntimeRunner(path)
