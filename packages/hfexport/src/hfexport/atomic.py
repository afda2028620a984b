"""Atomic file writes: a failed export never leaves a half-written file where a good one was."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_output_dir", "atomic_path", "atomic_write_text"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in the same folder as ``path``; rename it onto ``path`` on success.

    The caller writes the file at the yielded path. If the body raises, the temporary file is
    removed and ``path`` (if it existed) is untouched. The rename is atomic on POSIX file systems
    (``os.replace``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus the umask)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success move its files into ``path``.

    Each file is moved with ``os.replace`` (atomic per file), so an existing good file in ``path``
    is only replaced by a complete new one. On error the temporary folder is deleted and ``path``
    keeps what it had.
    """
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
    try:
        yield staging
        for item in sorted(staging.rglob("*")):
            if item.is_dir():
                continue
            dest = target / item.relative_to(staging)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(item, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
