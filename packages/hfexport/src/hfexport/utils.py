"""Thin facade: the utility names of the reference exporter API, importable from one place.

The code lives in modules named for their concept; this module only re-exports it:

- registries (:mod:`hfexport.registry`): ``register_patch``, ``register_fx_node_fix``,
  ``register_fx_program_fix``, ``apply_patches``, ``apply_fx_node_fixes``, ``apply_fx_program_fixes``;
- tensors (:mod:`hfexport.tensors`): ``get_leaf_tensors``, ``duplicate_leaf_tensors``, ``cast_leaf_tensors``;
- inputs (:mod:`hfexport.inputs`): ``prepare_for_export``, ``register_export_input_preparer``,
  ``precompute_export_inputs``;
- environment (:mod:`hfexport.environment`): ``installed_version``, ``torch_older_than``;
- capture (:mod:`hfexport.capture`, :mod:`hfexport.pytree`): ``auto_dynamic_shapes``,
  ``register_cache_pytrees``;
- validation (:mod:`hfexport.validation`): ``compare_outputs``, ``validate_artifact``.
"""

from __future__ import annotations

from hfexport.capture import auto_dynamic_shapes
from hfexport.environment import installed_version, torch_older_than
from hfexport.inputs import precompute_export_inputs, prepare_for_export, register_export_input_preparer
from hfexport.pytree import register_cache_pytrees
from hfexport.registry import (
    apply_fx_node_fixes,
    apply_fx_program_fixes,
    apply_patches,
    register_fx_node_fix,
    register_fx_program_fix,
    register_patch,
)
from hfexport.tensors import cast_leaf_tensors, duplicate_leaf_tensors, get_leaf_tensors
from hfexport.validation import compare_outputs, validate_artifact

__all__ = [
    "apply_fx_node_fixes",
    "apply_fx_program_fixes",
    "apply_patches",
    "auto_dynamic_shapes",
    "cast_leaf_tensors",
    "compare_outputs",
    "duplicate_leaf_tensors",
    "get_leaf_tensors",
    "installed_version",
    "precompute_export_inputs",
    "prepare_for_export",
    "register_cache_pytrees",
    "register_export_input_preparer",
    "register_fx_node_fix",
    "register_fx_program_fix",
    "register_patch",
    "torch_older_than",
    "validate_artifact",
]
