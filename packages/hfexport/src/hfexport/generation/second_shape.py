"""Compatibility module: the second shape of inputs holding a KV cache is part of
:mod:`hfexport.verify.second_shape` (issue 26): a size plan (batch, past length) filled by input role,
the same path as every other second shape. The public names this module had are re-exported.
"""

from __future__ import annotations

from hfexport.verify.caches import cache_past_length, find_cache, static_cache_length
from hfexport.verify.second_shape import derive_cache_second_inputs

__all__ = ["cache_past_length", "derive_cache_second_inputs", "find_cache", "static_cache_length"]
