"""Errors specific to the ``hfexport-dynamo`` backend."""

from __future__ import annotations

from hfexport.errors import HfExportError

__all__ = ["ArtifactLoadError", "UnsafeArtifactError"]


class UnsafeArtifactError(HfExportError, ValueError):
    """A ``.pt2`` file holds content that could run code while it is loaded or run.

    Raised by :func:`hfexport_dynamo.load` (unless ``trust_remote_code=True``) when the archive
    contains a pickle that the weights-only unpickler refuses, raw pickles or TorchScript objects,
    AOTInductor shared libraries, graph nodes calling something other than operators, or
    guard/shape expressions that are not plain arithmetic.

    Attributes:
        path: the file that was refused.
        problems: one line per finding, naming the archive member and why it is refused.
    """

    def __init__(self, message: str, *, path: str, problems: list[str]) -> None:
        super().__init__(message)
        self.path = path
        self.problems = list(problems)


class ArtifactLoadError(HfExportError, RuntimeError):
    """``torch.export.load`` could not deserialise a ``.pt2`` file.

    The message carries torch's own reason (a custom operator that is not registered, another
    schema version, a truncated archive) instead of its generic "ran into an error" message.
    """
