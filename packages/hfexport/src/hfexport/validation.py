"""Compatibility module: verification lives in :mod:`hfexport.verify` (issue 26).

Output comparison is :mod:`hfexport.verify.compare`; the second validation shape is
:mod:`hfexport.verify.second_shape` (a size plan, :mod:`hfexport.verify.sizes`, filled by input
role, :mod:`hfexport.verify.fill`). The public names this module had are re-exported unchanged.
"""

from __future__ import annotations

from hfexport.verify.compare import (
    OutputComparison,
    Runner,
    ValidationSet,
    compare_outputs,
    default_tolerances,
    eager_outputs,
    format_table,
    validate_artifact,
)
from hfexport.verify.second_shape import (
    NOTHING_VARIED,
    TOKEN_VALUES,
    derive_second_inputs,
    describe_second_shape,
    fit_static_spatial_axes,
)

__all__ = [
    "NOTHING_VARIED",
    "TOKEN_VALUES",
    "OutputComparison",
    "Runner",
    "ValidationSet",
    "compare_outputs",
    "default_tolerances",
    "derive_second_inputs",
    "describe_second_shape",
    "eager_outputs",
    "fit_static_spatial_axes",
    "format_table",
    "validate_artifact",
]
