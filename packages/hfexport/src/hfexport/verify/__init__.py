"""Verification of an export, in one place: does the artifact compute what eager PyTorch computes?

- :mod:`.compare`: output comparison under tolerances, the per-output table, the eager reference
  (:func:`validate_artifact`, :func:`compare_outputs`, :class:`ValidationSet`);
- :mod:`.gates`: quality gates of reduced-precision and quantized exports (cosine, top-1
  agreement, max difference; :func:`validate_quality`, :func:`quality_gates_for`);
- :mod:`.text`: the language-model metrics on the shipped passage (perplexity ratio, KL
  divergence, top-1 agreement on text; :func:`validate_text`);
- :mod:`.second_shape`: the second validation shape of a dynamic export
  (:func:`derive_second_inputs`), built from a size plan per axis group (:mod:`.sizes`) filled
  with values by input role (:mod:`.fill`); :mod:`.caches` reads the KV cache among the inputs.

The modules import one another downwards only (``compare`` <- ``gates`` <- ``text``;
``caches`` <- ``sizes`` <- ``fill`` <- ``second_shape``), and none of them imports
:mod:`hfexport.exporter`, :mod:`hfexport.generation` or the compatibility modules
:mod:`hfexport.validation` / :mod:`hfexport.quality`, which re-export these names.
"""

from __future__ import annotations

from hfexport.verify.compare import (
    OutputComparison,
    ValidationSet,
    compare_outputs,
    default_tolerances,
    eager_outputs,
    format_table,
    validate_artifact,
)
from hfexport.verify.gates import (
    OutputQuality,
    default_quality_gates,
    quality_gates_for,
    score_outputs,
    text_gates_for,
    validate_quality,
)
from hfexport.verify.second_shape import (
    NOTHING_VARIED,
    derive_second_inputs,
    describe_second_shape,
    fit_static_spatial_axes,
)
from hfexport.verify.sizes import AxisGroup, AxisMember, SizePlan, plan_second_shape
from hfexport.verify.text import TextQuality, TextReference, text_quality, validate_text

__all__ = [
    "NOTHING_VARIED",
    "AxisGroup",
    "AxisMember",
    "OutputComparison",
    "OutputQuality",
    "SizePlan",
    "TextQuality",
    "TextReference",
    "ValidationSet",
    "compare_outputs",
    "default_quality_gates",
    "default_tolerances",
    "derive_second_inputs",
    "describe_second_shape",
    "eager_outputs",
    "fit_static_spatial_axes",
    "format_table",
    "plan_second_shape",
    "quality_gates_for",
    "score_outputs",
    "text_gates_for",
    "text_quality",
    "validate_artifact",
    "validate_quality",
    "validate_text",
]
