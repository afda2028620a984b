"""The package versions hfexport-onnx needs and was tested with: written once, here.

* :data:`MIN_VERSIONS`: hard floors; below one, constructing the exporter raises ``ImportError``.
* :data:`TESTED_VERSIONS`: the exact set this release was validated with; any drift gives one
  warning per process. The ``tested`` extra of ``pyproject.toml`` pins the same versions.
* :data:`SUPPORTED`: the ranges package metadata declares and that workaround entries are
  judged against (an entry whose range no longer meets :data:`SUPPORTED` can be retired).
"""

from __future__ import annotations

from hfexport.environment import version_older_than

__all__ = ["MIN_VERSIONS", "REQUIRED_PACKAGES", "SUPPORTED", "TESTED_VERSIONS", "older_than"]

#: Distributions the ONNX backend imports.
REQUIRED_PACKAGES: tuple[str, ...] = ("torch", "onnx", "onnxscript", "onnxruntime")

#: Exactly what this release was tested with (kept equal to the ``tested`` extra); transformers is
#: listed because the patches replace transformers code of that release.
TESTED_VERSIONS: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "onnx": "1.23.2",
    "onnxscript": "0.7.2",
    "onnxruntime": "1.32.0",
}

#: Hard floors (the lower bounds of the package dependencies).
MIN_VERSIONS: dict[str, str] = {
    "torch": "2.12",
    "onnx": "1.18",
    "onnxscript": "0.5",
    "onnxruntime": "1.22",
}

#: Ranges the package supports (package metadata declares the lower bounds).
SUPPORTED: dict[str, str] = {
    "torch": ">=2.12",
    "transformers": ">=5.23,<6",
    "onnx": ">=1.18",
    "onnxscript": ">=0.5",
    "onnxruntime": ">=1.22",
}


def older_than(distribution: str, version: str) -> bool:
    """True when ``distribution`` is installed below ``version`` (local suffixes ignored).

    A version gate as a helper (``older_than("onnxscript", "0.8")``) rather than comparisons
    scattered through the code; a distribution that is not installed counts as not older.
    """
    return version_older_than(distribution, version)
