"""The versions hfexport-executorch is tested with and supports: written once, here.

- :data:`TESTED_VERSIONS`: the exact pins the test suite ran on. A different installed version
  gives one ``VersionDriftWarning`` per process (see ``hfexport.environment``). The
  ``tested`` extra in this package's ``pyproject.toml`` pins the same versions.
- :data:`MIN_VERSIONS`: hard floors; below one, constructing the exporter raises ``ImportError``.
- :data:`SUPPORTED`: the ranges the package metadata declares (``dependencies``). Registry entries
  whose version range no longer overlaps these can be retired (``RegistryEntry.is_stale``).
"""

from __future__ import annotations

__all__ = ["MIN_VERSIONS", "SUPPORTED", "TESTED_VERSIONS"]

TESTED_VERSIONS: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "executorch": "1.4.1",
}

MIN_VERSIONS: dict[str, str] = {
    "torch": "2.12",
    "executorch": "1.3",
}

SUPPORTED: dict[str, str] = {
    "torch": ">=2.12",
    "executorch": ">=1.3",
}
