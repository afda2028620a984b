"""The versions ``hfexport-openvino`` is tested with and supports, written down once.

- :data:`TESTED_VERSIONS`: the exact pins this release was validated with. The ``tested`` extra of
  ``packages/hfexport-openvino/pyproject.toml`` lists the same pins and
  :class:`~hfexport_openvino.exporter.OpenvinoExporter` warns once when the installed versions differ.
- :data:`MIN_VERSIONS`: hard floors; below one the exporter refuses to start (``ImportError``).
- :data:`SUPPORTED`: the specifier sets the package metadata declares; the registry judges this
  backend's workarounds against them (:meth:`hfexport.registry.RegistryEntry.is_stale`).
"""

from __future__ import annotations

__all__ = ["MIN_VERSIONS", "REQUIRED_PACKAGES", "SUPPORTED", "TESTED_VERSIONS"]

#: Distributions the backend imports (``nncf``, a dependency too, is imported only by a
#: ``--quantize`` export: :mod:`hfexport_openvino.quantize`).
REQUIRED_PACKAGES: tuple[str, ...] = ("torch", "transformers", "openvino")

#: Exact versions this release was validated with (the ``tested`` extra pins these).
TESTED_VERSIONS: dict[str, str] = {
    "openvino": "2026.4.1",
    "nncf": "3.4.0",
    "torch": "2.13.0",
    "transformers": "5.24.0",
}

#: Lowest versions the backend runs with; older ones raise ``ImportError`` at construction.
MIN_VERSIONS: dict[str, str] = {"openvino": "2026.0", "nncf": "3.4", "torch": "2.12", "transformers": "5.23"}

#: Supported ranges (package metadata declares ranges, never exact pins).
SUPPORTED: dict[str, str] = {
    "openvino": ">=2026.0",
    "nncf": ">=3.4",
    "torch": ">=2.12",
    "transformers": ">=5.23,<6",
}
