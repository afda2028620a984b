"""Facade: the utility names of the reference exporter API, importable from one place.

``from hfexport.utils import register_patch, decompose_for_generation`` works as the reference API
documents it. Nothing is defined here: :data:`_SOURCES` maps each public name to the module
(named for its concept) that defines it, and a name is imported from there on first access, so
``import hfexport.utils`` stays as light as ``import hfexport``. ``__all__`` and ``dir()`` derive
from the same table.
"""

from __future__ import annotations

import importlib
from typing import Any

# The one list: public name -> defining module.
_SOURCES: dict[str, str] = {
    # workaround registries
    "register_patch": "hfexport.registry",
    "register_fx_node_fix": "hfexport.registry",
    "register_fx_program_fix": "hfexport.registry",
    "apply_patches": "hfexport.registry",
    "apply_fx_node_fixes": "hfexport.registry",
    "apply_fx_program_fixes": "hfexport.registry",
    # leaf tensors
    "get_leaf_tensors": "hfexport.tensors",
    "duplicate_leaf_tensors": "hfexport.tensors",
    "cast_leaf_tensors": "hfexport.tensors",
    # input preparation
    "prepare_for_export": "hfexport.inputs",
    "register_export_input_preparer": "hfexport.inputs",
    "precompute_export_inputs": "hfexport.inputs",
    # generation decomposition
    "decompose_for_generation": "hfexport.generation.decompose",
    "decompose_prefill_decode": "hfexport.generation.decompose",
    "decompose_multimodal": "hfexport.generation.multimodal",
    "is_multimodal": "hfexport.generation.multimodal",
    # environment
    "installed_version": "hfexport.environment",
    "torch_older_than": "hfexport.environment",
    # capture
    "auto_dynamic_shapes": "hfexport.capture",
    "register_cache_pytrees": "hfexport.pytree",
    # validation
    "compare_outputs": "hfexport.verify.compare",
    "validate_artifact": "hfexport.verify.compare",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'hfexport.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
