"""Generation with exported components: decomposition, export, greedy runner, save and load.

- :func:`decompose_prefill_decode`, :func:`decompose_for_generation`,
  :func:`decompose_multimodal`, :func:`is_multimodal`: capture the forward kwargs of each component
  from one real ``generate`` call (:mod:`.decompose`, :mod:`.multimodal`, :mod:`.recording`); the result type,
  :class:`Decomposition`, lives in :mod:`.components`;
- :func:`merge_decode_steps`: multi-token decode (:mod:`.decode`);
- ``HfExporter.export_for_generation`` (built on :func:`export_components`) exports every component;
- :class:`GenerationRunner`: the greedy loop over exported components (:mod:`.runner`);
- :func:`save_components` / :func:`load_components` / :func:`generate_from_dir`: one file per
  component plus ``generation_manifest.json`` (:mod:`.persist`);
- :func:`compare_with_generate`: parity of the exported loop with ``model.generate`` (:mod:`.parity`);
- :class:`GenerationSupport`: what a backend adds to all of the above, one object per exporter
  (``HfExporter.generation_support``; :mod:`.support`).

Importing this package registers the ``generation`` workarounds (:mod:`hfexport.workarounds.generation`); the
vision-language input preparers (:mod:`.vision_inputs`) are registered by :mod:`hfexport.inputs` on
first use.
"""

from __future__ import annotations

from hfexport.generation import vision_inputs as _vision_inputs  # noqa: F401  (registers the preparers)
from hfexport.generation.decode import decode_inputs_for_query_length, merge_decode_steps
from hfexport.generation.decompose import (
    Decomposition,
    decompose_for_generation,
    decompose_prefill_decode,
)
from hfexport.generation.export import ComponentExportError, GenerationArtifacts, export_components
from hfexport.generation.multimodal import decompose_multimodal, find_multimodal_layout, is_multimodal
from hfexport.generation.parity import GenerationParity, compare_with_generate
from hfexport.generation.persist import (
    MANIFEST_NAME,
    generate_from_dir,
    load_components,
    load_runner,
    read_manifest,
    save_components,
)
from hfexport.generation.plan import ComponentIO, GenerationPlan
from hfexport.generation.recording import capture_generate_calls, record_generation
from hfexport.generation.runner import GenerationRunner, callers_from_exporter, exported_program_caller
from hfexport.generation.support import GenerationSupport
from hfexport.generation.vision_inputs import mrope_position_ids, vision_grid_inputs
from hfexport.workarounds import generation as _workarounds  # noqa: F401  (registers the workarounds)

__all__ = [
    "MANIFEST_NAME",
    "ComponentExportError",
    "ComponentIO",
    "Decomposition",
    "GenerationArtifacts",
    "GenerationParity",
    "GenerationPlan",
    "GenerationRunner",
    "GenerationSupport",
    "callers_from_exporter",
    "capture_generate_calls",
    "compare_with_generate",
    "decode_inputs_for_query_length",
    "decompose_for_generation",
    "decompose_multimodal",
    "decompose_prefill_decode",
    "export_components",
    "exported_program_caller",
    "find_multimodal_layout",
    "generate_from_dir",
    "is_multimodal",
    "load_components",
    "load_runner",
    "merge_decode_steps",
    "mrope_position_ids",
    "read_manifest",
    "record_generation",
    "save_components",
    "vision_grid_inputs",
]
