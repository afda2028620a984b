"""Model conventions kept as data: which forward kwargs carry which axes, and config lookups.

- :mod:`hfexport.conventions.roles`: one table of input roles (kwarg name -> batch axis,
  sequence axis, spatial axes, modality); validation, batching, ExecuTorch bounds, decoding and
  parity derive their key sets from it. A new input name or modality is one
  :func:`~hfexport.conventions.roles.register_input_role` call (or one table entry).
- :mod:`hfexport.conventions.config_lookups`: attribute lookups on transformers configs
  (the maximum number of positions, the placeholder token ids of image/video/audio prompts),
  written once.
"""

from __future__ import annotations

from hfexport.conventions.config_lookups import max_positions, placeholder_token_ids
from hfexport.conventions.roles import (
    AUDIO,
    DECODER,
    IMAGE,
    SIGNAL,
    STATE,
    TEXT,
    VIDEO,
    InputRole,
    batch_axis,
    batch_keys,
    input_role,
    input_roles,
    is_known_input,
    modality_of,
    names_with,
    register_input_role,
    sequence_axis,
    sequence_group,
    spatial_axes,
)

__all__ = [
    "AUDIO",
    "DECODER",
    "IMAGE",
    "SIGNAL",
    "STATE",
    "TEXT",
    "VIDEO",
    "InputRole",
    "batch_axis",
    "batch_keys",
    "input_role",
    "input_roles",
    "is_known_input",
    "max_positions",
    "modality_of",
    "names_with",
    "placeholder_token_ids",
    "register_input_role",
    "sequence_axis",
    "sequence_group",
    "spatial_axes",
]
