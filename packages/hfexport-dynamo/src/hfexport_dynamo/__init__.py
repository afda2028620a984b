"""hfexport-dynamo: export Hugging Face transformers models to ``torch.export`` programs (``.pt2``).

>>> from hfexport_dynamo import DynamoExporter, load
>>> program = DynamoExporter().export(model, {"input_ids": ids, "attention_mask": mask},
...                                   {"export_format": "dynamo", "dynamic": True})
>>> program.module()(input_ids=ids, attention_mask=mask).logits

Importing the package registers its workarounds with :mod:`hfexport.registry` (``"dynamo"`` key)
and transformers' ``Cache`` classes and model outputs as pytree nodes. :func:`save` writes
programs with flat tensor inputs and outputs (:mod:`hfexport_dynamo.flat_io`), so stock
``torch.export.load`` runs them in a process that imports only torch; :func:`load` is the safe
way in: it verifies checksums and refuses files whose content could run code unless
``trust_remote_code=True``. ``DynamoConfig(aoti=True)`` also writes an AOTInductor package
(:mod:`hfexport_dynamo.aoti`).
"""

from __future__ import annotations

from hfexport.pytree import register_known_pytrees
from hfexport_dynamo.__about__ import __version__
from hfexport_dynamo.errors import ArtifactLoadError, CorruptArtifactError, UnsafeArtifactError
from hfexport_dynamo.exporter import DynamoExporter
from hfexport_dynamo.runtime import ProgramRunner, program_input_names
from hfexport_dynamo.safety import check_archive, inspect_pt2
from hfexport_dynamo.serialization import load, save
from hfexport_dynamo.versions import MIN_VERSIONS, SUPPORTED, TESTED_VERSIONS
from hfexport_dynamo.workarounds import patches  # noqa: F401  (registers the "dynamo" patches)

__all__ = [
    "MIN_VERSIONS",
    "SUPPORTED",
    "TESTED_VERSIONS",
    "ArtifactLoadError",
    "CorruptArtifactError",
    "DynamoExporter",
    "ProgramRunner",
    "UnsafeArtifactError",
    "__version__",
    "check_archive",
    "inspect_pt2",
    "load",
    "program_input_names",
    "save",
]

# transformers' Cache classes and model outputs (transformers.modeling_outputs), so a plain
# torch.export.load in a process that imported this package reads cache-carrying programs
register_known_pytrees()
