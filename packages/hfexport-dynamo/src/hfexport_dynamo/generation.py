"""Generation components for the Dynamo backend: run and load ``ExportedProgram`` components.

The greedy loop lives in the core (:class:`hfexport.generation.GenerationRunner`); this module
supplies the per-component call: :class:`hfexport_dynamo.runtime.ProgramRunner`, i.e.
``ExportedProgram.module()`` called with the component's forward kwargs. A static cache passed to
a decode graph is updated in place, as the eager model updates it. Saved components (``.pt2``) are
read with :func:`hfexport_dynamo.serialization.load`, which inspects the file before unpickling
anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.generation.runner import Caller

__all__ = ["component_caller", "component_metadata", "load_component"]


def component_caller(artefact: torch.export.ExportedProgram) -> Caller:
    """A caller for an in-memory component: forward kwargs -> ``{output_leaf_path: tensor}``."""
    from hfexport_dynamo.runtime import ProgramRunner

    return ProgramRunner(artefact)


def component_metadata(artefact: torch.export.ExportedProgram) -> dict[str, Any]:
    """Nothing beyond the file: :func:`hfexport_dynamo.serialization.load` finds the modules the
    program's specs need by itself."""
    return {}


def load_component(path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Caller:
    """Load a component saved as ``.pt2`` and return its caller.

    Args:
        path: the ``.pt2`` file.
        metadata: the component's entry of the generation manifest (unused).

    Raises:
        FileNotFoundError: no file at ``path``.
        hfexport_dynamo.UnsafeArtifactError: the file holds content that could run code.
    """
    from hfexport_dynamo.serialization import load

    return component_caller(load(path))
