"""SHA-256 checksums of an output folder's files: written at export, verified before loading.

Every folder hfexport writes (``hfexport export``, :func:`hfexport.generation.save_components`)
holds a ``checksums.sha256`` in the format of coreutils ``sha256sum``, one line per file, sorted
by path::

    3f5a...e1  generation_manifest.json
    9c0d...7b  prefill.pt2

so ``cd <folder> && sha256sum -c checksums.sha256`` checks a copy without hfexport. Our loaders
(:func:`hfexport.generation.load_components`, ``hfexport generate``,
:func:`hfexport_dynamo.load`, the ONNX/ExecuTorch component loaders) verify the files they load
with :func:`verify_checksums` / :func:`verify_file` before reading them and raise
:class:`~hfexport.errors.IntegrityError` on a mismatch.

A folder without ``checksums.sha256`` (files copied by hand, or written by an older hfexport) is
loaded with one warning per folder: the checksums detect damage in storage or transfer, they are
no signature (whoever can change a file can change ``checksums.sha256`` too; get it from a
source you trust if that matters).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from hfexport.errors import IntegrityError

__all__ = [
    "CHECKSUMS_NAME",
    "compute_checksums",
    "file_sha256",
    "hash_in_background",
    "mark_written",
    "read_checksums",
    "verify_checksums",
    "verify_file",
    "write_checksums",
]

logger = logging.getLogger(__name__)

#: File name of the checksum list inside an output folder.
CHECKSUMS_NAME = "checksums.sha256"

_CHUNK = 1 << 20
_warned_folders: set[Path] = set()
_verified: dict[tuple[Path, int, int], str] = {}
_lock = threading.Lock()
#: digests being computed ahead of time, keyed by the file's identity (device, inode, size, mtime)
_ahead: dict[tuple[int, int, int, int], concurrent.futures.Future[str]] = {}
_hasher: concurrent.futures.ThreadPoolExecutor | None = None


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _hash_if_unchanged(path: Path, identity: tuple[int, int, int, int]) -> str:
    digest = _read_sha256(path)
    if _identity(path) != identity:
        raise OSError(f"{path} changed while it was hashed")
    return digest


def hash_in_background(folder: str | os.PathLike[str]) -> None:
    """Start computing the SHA-256 of every file under ``folder`` in one background thread.

    :func:`file_sha256` (and so :func:`compute_checksums`) later returns a precomputed digest for a
    file that is still the same file (device, inode, size and modification time unchanged; a rename
    keeps them), waiting for it if the thread is still reading it; anything else is hashed as usual.
    The export calls this right after saving its artifact, so the checksums of a multi-GB file are
    computed while the artifact is validated (``hashlib`` releases the GIL on large buffers).
    Files that vanish or change are skipped silently: the digest is then computed on demand.
    """
    global _hasher
    with _lock:
        if _hasher is None:
            _hasher = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hfexport-sha256"
            )
        for path in sorted(Path(folder).rglob("*")):
            try:
                if not path.is_file():
                    continue
                identity = _identity(path)
            except OSError:
                continue
            if identity not in _ahead:
                _ahead[identity] = _hasher.submit(_hash_if_unchanged, path, identity)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of one file's bytes, as 64 lowercase hex digits (read in 1 MiB chunks, or the digest
    :func:`hash_in_background` computed for this very file).

    Raises:
        OSError: the file cannot be read.
    """
    try:
        identity = _identity(path)
    except OSError:
        identity = None
    with _lock:
        ahead = _ahead.pop(identity, None) if identity is not None else None
    if ahead is not None:
        try:
            return ahead.result()
        except OSError:
            pass  # changed or unreadable while hashed ahead: hash it now
    return _read_sha256(path)


def _read_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _relative_names(folder: Path, files: Iterable[str | os.PathLike[str]] | None) -> list[str]:
    if files is None:
        found = (p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS_NAME)
        return sorted(p.relative_to(folder).as_posix() for p in found)
    names = []
    for f in files:
        path = Path(f)
        names.append((path.relative_to(folder) if path.is_absolute() else path).as_posix())
    return sorted(set(names))


def compute_checksums(
    folder: str | os.PathLike[str], files: Iterable[str | os.PathLike[str]] | None = None
) -> dict[str, str]:
    """SHA-256 of files of ``folder``.

    Args:
        folder: the folder.
        files: paths relative to ``folder`` (or absolute paths inside it); ``None``: every file
            under ``folder``, recursively, except ``checksums.sha256``.

    Returns:
        ``{relative path with "/" separators: hex digest}``, sorted by path.

    Raises:
        OSError: a file cannot be read.
        ValueError: an absolute path outside ``folder``.
    """
    root = Path(folder)
    return {name: file_sha256(root / name) for name in _relative_names(root, files)}


def _escape(name: str) -> tuple[str, str]:
    """coreutils' escaping of a file name: a leading backslash marks ``\\\\`` / ``\\n`` escapes."""
    if "\\" in name or "\n" in name or "\r" in name:
        return "\\", name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "", name


def _unescape(name: str) -> str:
    out, chars = [], iter(name)
    for c in chars:
        if c == "\\":
            nxt = next(chars, "")
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(nxt, "\\" + nxt))
        else:
            out.append(c)
    return "".join(out)


def write_checksums(
    folder: str | os.PathLike[str],
    files: Iterable[str | os.PathLike[str]] | None = None,
    *,
    digests: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write ``checksums.sha256`` into ``folder`` (replacing one that is there).

    Each line is ``<64 hex digits><two spaces><relative path>``, sorted by path (the output of
    ``sha256sum`` in text mode), so ``sha256sum -c checksums.sha256`` run inside the folder
    verifies every file.

    Args:
        folder: the folder.
        files: which files to list (see :func:`compute_checksums`); ``None``: all of them.
        digests: ``{relative path: hex digest}`` computed a moment ago by
            :func:`compute_checksums` for some of the files; they are written as given, the
            other files are hashed.

    Returns:
        ``{relative path: hex digest}`` as written (for a report's ``"sha256"`` entry).

    Raises:
        OSError: a file cannot be read or ``checksums.sha256`` cannot be written.
    """
    root = Path(folder)
    known = dict(digests or {})
    names = _relative_names(root, files)
    written = {name: known[name] if name in known else file_sha256(root / name) for name in names}
    lines = []
    for name, digest in written.items():
        prefix, escaped = _escape(name)
        lines.append(f"{prefix}{digest}  {escaped}\n")
    (root / CHECKSUMS_NAME).write_text("".join(lines), encoding="utf-8", newline="\n")
    return written


def read_checksums(folder: str | os.PathLike[str]) -> dict[str, str] | None:
    """Parse ``folder/checksums.sha256``: ``{relative path: hex digest}``, or ``None`` if absent.

    Accepts ``sha256sum``'s text (``<hex>  <name>``) and binary (``<hex> *<name>``) lines.

    Raises:
        IntegrityError: a line that is not a SHA-256 checksum line (the message gives the line).
    """
    path = Path(folder) / CHECKSUMS_NAME
    if not path.is_file():
        return None
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        escaped = line.startswith("\\")
        body = line[1:] if escaped else line
        digest, sep, name = body[:64], body[64:66], body[66:]
        if (
            len(digest) != 64
            or any(c not in "0123456789abcdefABCDEF" for c in digest)
            or sep not in ("  ", " *")
            or not name
        ):
            raise IntegrityError(
                f"{path} line {number} is not a sha256sum line ({line[:100]!r}); the checksum list is "
                "damaged: re-export the folder (or download it again)"
            )
        entries[_unescape(name) if escaped else name] = digest.lower()
    return entries


def mark_written(folder: str | os.PathLike[str]) -> None:
    """Record that this process wrote ``folder`` (an export's staging folder): loading its files
    before their ``checksums.sha256`` exists logs no missing-checksums warning."""
    with _lock:
        _warned_folders.add(Path(folder).resolve())


def _warn_no_checksums(folder: Path) -> None:
    key = folder.resolve()
    with _lock:
        if key in _warned_folders:
            return
        _warned_folders.add(key)
    logger.warning(
        "%s has no %s: its files are loaded without an integrity check (folders written by hfexport "
        "export or save_components have one; re-export to get it)",
        folder,
        CHECKSUMS_NAME,
    )


def _check_one(root: Path, name: str, expected: str, listing: Path) -> None:
    path = root / name
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise IntegrityError(
            f"{path} is listed in {listing} but missing; the folder is incomplete: re-export it (or "
            "download it again)"
        ) from None
    key = (path.resolve(), stat.st_size, stat.st_mtime_ns)
    with _lock:
        if _verified.get(key) == expected:
            return
    actual = file_sha256(path)
    if actual != expected:
        raise IntegrityError(
            f"{path} does not match its checksum in {listing}: expected SHA-256 {expected}, got {actual}. "
            "The file was changed or damaged after export: re-export it (or download it again)."
        )
    with _lock:
        _verified[key] = expected


def verify_checksums(
    folder: str | os.PathLike[str],
    files: Iterable[str | os.PathLike[str]] | None = None,
    *,
    require_listed: bool = True,
) -> dict[str, str] | None:
    """Check files of ``folder`` against its ``checksums.sha256``.

    A file is hashed once per process while its size and modification time stay the same.

    Args:
        folder: the folder.
        files: the files to check, relative to ``folder`` (or absolute inside it); ``None``:
            every file the list names.
        require_listed: whether a file of ``files`` the list does not name is an error (``True``)
            or skipped (``False``).

    Returns:
        ``{relative path: hex digest}`` of the files checked, or ``None`` when the folder has no
        ``checksums.sha256`` (a warning is logged once per folder and nothing is checked).

    Raises:
        IntegrityError: a file's SHA-256 differs from the listed one (the message names the file,
            both digests and says to re-export or re-download); a listed file is missing; a file
            of ``files`` is not listed while ``require_listed``; the list is malformed.
    """
    root = Path(folder)
    listed = read_checksums(root)
    if listed is None:
        if root.is_dir():
            _warn_no_checksums(root)
        return None
    listing = root / CHECKSUMS_NAME
    names = list(listed) if files is None else _relative_names(root, files)
    checked: dict[str, str] = {}
    for name in names:
        expected = listed.get(name)
        if expected is None:
            if require_listed:
                raise IntegrityError(
                    f"{root / name} is not listed in {listing}, so its integrity cannot be checked; "
                    "re-export the folder (or download it again)"
                )
            continue
        _check_one(root, name, expected, listing)
        checked[name] = expected
    return checked


def verify_file(path: str | os.PathLike[str]) -> str | None:
    """Check one file against the ``checksums.sha256`` of its folder, when that lists it.

    For loaders of single artifact files: a file copied somewhere on its own (no list, or a list
    that does not name it) is loaded unchecked (no list: one warning per folder).

    Returns:
        The verified hex digest, or ``None`` when nothing was checked.

    Raises:
        IntegrityError: the file's SHA-256 differs from the listed one, or the list is malformed.
    """
    file = Path(path)
    checked = verify_checksums(file.parent, [file.name], require_listed=False)
    return (checked or {}).get(file.name)
