"""Errors specific to the ``hfexport-dynamo`` backend."""

from __future__ import annotations

from hfexport.errors import HfExportError

__all__ = ["ArtifactLoadError", "CorruptArtifactError", "UnsafeArtifactError"]


class UnsafeArtifactError(HfExportError, ValueError):
    """A ``.pt2`` file holds content that could run code while it is loaded or run.

    Raised by :func:`hfexport_dynamo.load` (unless ``trust_remote_code=True``) when the archive
    contains a pickle that the weights-only unpickler refuses, raw pickles or TorchScript objects,
    AOTInductor shared libraries, graph nodes calling something other than operators, or
    guard/shape expressions that are not plain arithmetic.

    Also raised, whatever ``trust_remote_code`` says, for an archive that zip readers could read
    differently: two members whose names torch's reader maps to the same record (exact duplicates,
    or names differing only in case, separators or Unicode normalization), members hidden between
    or before the listed ones, or local headers that disagree with the central directory.
    ``torch.export.save`` never writes such an archive; the message then says to re-export.

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


class CorruptArtifactError(ArtifactLoadError):
    """A ``.pt2`` file is not a valid ``torch.export`` archive: truncated, not a zip, or damaged.

    Raised by :func:`hfexport_dynamo.load` and :func:`hfexport_dynamo.inspect_pt2` before anything
    is unpickled, whatever ``trust_remote_code`` says. The message names the file and the reason
    (no zip end record, a member failing its CRC check, an unreadable local header ...) and says
    to re-export (or re-download) the file. A subclass of :class:`ArtifactLoadError`, so code
    catching that keeps working.

    Attributes:
        path: the file, when known (``None`` for an anonymous buffer).
        reason: what is wrong with it, in one line.
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
