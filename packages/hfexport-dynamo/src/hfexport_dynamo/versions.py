"""The versions ``hfexport-dynamo`` is tested with and supports, written down once.

- :data:`TESTED_VERSIONS`: the exact pins this release was validated with. The ``tested`` extra of
  ``packages/hfexport-dynamo/pyproject.toml`` lists the same pins, the workspace lock resolves them
  for development, and :class:`~hfexport_dynamo.exporter.DynamoExporter` warns once when the
  installed versions differ.
- :data:`MIN_VERSIONS`: hard floors; below one the exporter refuses to start (``ImportError``).
  torch 2.12 is the oldest release of the nox torch matrix.
- :data:`SUPPORTED`: the specifier sets the package metadata declares; the registry uses them to
  report workarounds whose upstream fix has shipped in every supported version
  (:meth:`hfexport.registry.RegistryEntry.is_stale`).
"""

from __future__ import annotations

__all__ = ["MIN_VERSIONS", "SUPPORTED", "TESTED_VERSIONS"]

#: Exact versions this release was validated with (the ``tested`` extra pins these).
TESTED_VERSIONS: dict[str, str] = {"torch": "2.13.0", "transformers": "5.24.0"}

#: Lowest versions the backend runs with; older ones raise ``ImportError`` at construction.
MIN_VERSIONS: dict[str, str] = {"torch": "2.12", "transformers": "5.23"}

#: Supported ranges (package metadata declares ranges, never exact pins).
SUPPORTED: dict[str, str] = {"torch": ">=2.12", "transformers": ">=5.23,<6"}
