"""Atomic writes: a failed export never leaves a half-written file or folder where a good one was.

Single files (:func:`atomic_path`, :func:`atomic_write_text`) are written next to their target and
renamed onto it. Output folders (:func:`atomic_output_dir`) are replaced as a whole: the new folder
is staged complete beside the target and swapped in with renames, so a reader sees either the old
folder or the new one, never a mix of the two.

Write-once folders (:func:`atomic_new_dir`, e.g. a cache entry) are staged the same way but never
replace a folder that exists: when two processes build the same one, the first rename wins and the
other's copy is discarded.

Output folder rules (also in ``docs/index.md``, "Output folders"):

- The folder is the unit. After a successful export ``OUTPUT_DIR`` holds exactly the new files; a
  file of an earlier export (``generation_manifest.json``, a component, a stale ``.onnx.data``)
  is gone. On failure ``OUTPUT_DIR`` is left byte for byte as it was.
- Names of our own temporary folders, always beside the target (same parent, so the renames stay
  on one file system): ``.<name>.hfexport-staging.<pid>.<host>.<random>`` (the new folder being
  written), ``.<name>.hfexport-old.<pid>.<host>.<random>`` (the previous folder during the swap)
  and ``.<name>.hfexport-trash.<pid>.<host>.<random>`` (the previous folder being deleted).
  ``<host>`` is 8 hex digits of a hash of the host name, ``<random>`` 8 hex digits.
- Stale temporary folders are cleaned by the next export into the same target: a folder of ours
  whose process is gone (``os.kill(pid, 0)`` on the same host) or whose modification time is older
  than :data:`STALE_AFTER_SECONDS` is removed, except that an ``-old`` folder left by a run killed
  in the middle of the swap is renamed back onto the target when the target is missing. Nothing
  that does not match these names is ever touched.
- While a staging folder is being filled, the file ``<staging folder name>.stage`` beside it holds
  the name of the export stage that started last (:func:`note_stage`, called by the report's
  stage recorder). A run killed outright (SIGKILL from the out-of-memory killer, ``kill -9``)
  cannot clean up; the next export into the same target removes its folders and logs a warning
  naming the stage it died in (:func:`clean_stale`). The file is removed with its folder.
- A folder that already exists is replaced only if it is empty, or it is a previous hfexport
  export (it holds :data:`EXPORT_MARKERS`: ``export_report.json``, written by every
  ``hfexport export``, or ``generation_manifest.json``, written by
  :func:`hfexport.generation.save_components`), or the caller passes ``overwrite=True``
  (``--overwrite``). Anything else a replaced folder held is deleted with it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from hfexport import faults
from hfexport.errors import OutputDirectoryError

# a folder holding one of EXPORT_MARKERS is a previous export, replaced without overwrite=True; the
# names and the rule are the export folder's own
from hfexport.folder.contents import EXPORT_MARKERS, previous_export_problem

__all__ = [
    "EXPORT_MARKERS",
    "STALE_AFTER_SECONDS",
    "atomic_new_dir",
    "atomic_output_dir",
    "atomic_path",
    "atomic_write_text",
    "check_output_dir",
    "check_output_file",
    "clean_stale",
    "killed_stage",
    "note_stage",
]

logger = logging.getLogger(__name__)

#: A temporary folder of ours older than this (seconds since its last modification) is stale even
#: when its process id is alive (the id may have been reused) or belongs to another host.
STALE_AFTER_SECONDS = 24 * 3600

_KINDS = ("staging", "old", "trash")
_BREADCRUMB = ".stage"  # suffix of the file beside a staging folder naming its current stage
#: the staging folders of atomic_output_dir being filled in this process, outermost first
_ACTIVE: list[Path] = []
_HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in the same folder as ``path``; rename it onto ``path`` on success.

    The caller writes the file at the yielded path. If the body raises, the temporary file is
    removed and ``path`` (if it existed) is untouched. The file is flushed to disk (``fsync``)
    before the rename, which is atomic on POSIX file systems (``os.replace``), so after a crash
    ``path`` holds the old or the new content, never an empty file.

    Raises:
        OutputDirectoryError: ``path`` is an existing folder, or lies under a file (the message
            names both); nothing is written.
        OSError: the file cannot be created or written (the temporary file is removed).
    """
    target = Path(path)
    if target.is_dir():
        raise OutputDirectoryError(
            f"cannot write the file {os.fspath(path)!r}: it is an existing folder; allowed: a file path "
            f"(e.g. {os.fspath(target / 'model.onnx')!r}), or remove the folder",
            path=os.fspath(path),
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = _file_ancestor(target.parent)
        raise OutputDirectoryError(
            f"cannot write the file {os.fspath(path)!r}: {os.fspath(blocker)!r} is a file, not a folder; "
            "pick a path under a folder, or move the file away",
            path=os.fspath(path),
        ) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus the umask)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        yield tmp_path
        _fsync_path(tmp_path, directory=False)
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _file_ancestor(folder: Path) -> Path:
    """The nearest existing ancestor of ``folder`` (itself included) that is not a folder, or the
    nearest existing ancestor when there is none (for messages)."""
    folder = Path(os.path.abspath(folder))
    for candidate in (folder, *folder.parents):
        if os.path.lexists(candidate):
            return candidate
    return folder


def _probe_write(folder: Path) -> OSError | None:
    """Create and remove an empty folder in ``folder``; the error when that fails, else ``None``.

    ``os.access`` answers from the permission bits only (always "yes" for root, "no" for nothing on
    a read-only mount it cannot see, wrong under ACLs); the probe is what the export will do. Its
    name follows the staging-folder rule, so a probe left by a killed process is cleaned like one.
    """
    probe = folder / f".hfexport-probe.hfexport-staging.{os.getpid()}.{_HOST}.{secrets.token_hex(4)}"
    try:
        os.mkdir(probe)
    except OSError as exc:
        return exc
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def _unwritable(shown: str, receiver: Path, what: str) -> str | None:
    """The message for ``receiver`` not taking new entries, or ``None`` when it does."""
    if os.access(receiver, os.W_OK | os.X_OK):
        error = _probe_write(receiver)
        if error is None:
            return None
        reason = error.strerror or str(error)
    else:
        reason = "no write permission"
    return (
        f"{what} {shown!r} cannot be written: {reason} on {os.fspath(receiver)!r} (hfexport writes "
        "the new files beside the old ones there and renames them into place); fix the permissions "
        "or pick another folder"
    )


def check_output_file(path: str | os.PathLike[str], *, what: str = "output_path") -> None:
    """Check that the file ``path`` (an artifact such as ``model.onnx``) can be written, without
    leaving anything behind, before an export starts.

    Accepted: a new or existing file whose parent folder exists and takes new entries, or whose
    missing parent folders can be created (the nearest existing ancestor is a writable folder).

    Args:
        path: the artifact file (``config.output_path``, ``export_to_path``'s ``path``).
        what: how the path is named in the message.

    Raises:
        OutputDirectoryError: (a ``ValueError``) ``path`` is an existing folder, lies under a
            file, or its folder (or nearest existing ancestor) cannot be written; the message
            names the path, the problem and what to do.
    """
    shown = os.fspath(path)
    target = Path(os.path.abspath(path))
    if target.is_dir():
        raise OutputDirectoryError(
            f"{what}={shown!r} is invalid: it is an existing folder; allowed: a file path such as "
            f"{os.path.join(shown, 'model.onnx')!r} (the backend writes its companion files beside it)",
            path=shown,
        )
    receiver = _file_ancestor(target.parent)
    if not receiver.is_dir():
        raise OutputDirectoryError(
            f"{what}={shown!r} is invalid: {os.fspath(receiver)!r} is a file, not a folder, so the file cannot "
            "be created under it; pick a path under a folder, or move the file away",
            path=shown,
        )
    problem = _unwritable(shown, receiver, what)
    if problem is not None:
        raise OutputDirectoryError(problem, path=shown)


def _resolve(path: str | os.PathLike[str]) -> Path:
    """The absolute folder path to write: a symlink is followed (the link itself stays)."""
    if os.path.islink(path):
        return Path(os.path.realpath(path))
    return Path(os.path.abspath(path))


def _stem(name: str) -> str:
    """``name`` as used in our temporary folder names (hashed when too long for a file name)."""
    if len(os.fsencode(name)) <= 180:
        return name
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:16]


def _sibling_name(target: Path, kind: str) -> Path:
    return (
        target.parent / f".{_stem(target.name)}.hfexport-{kind}.{os.getpid()}.{_HOST}.{secrets.token_hex(4)}"
    )


def _sibling_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(
        rf"^\.{re.escape(_stem(target.name))}\.hfexport-(?P<kind>{'|'.join(_KINDS)})"
        r"\.(?P<pid>[0-9]+)\.(?P<host>[0-9a-f]{8})\.[0-9a-f]{8}$"
    )


def check_output_dir(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    keep: Iterable[str | os.PathLike[str]] = (),
    keep_cwd: bool = False,
) -> None:
    """Check that ``path`` can receive an export, leaving nothing behind.

    The only write is a probe: an empty folder created and removed where the export will stage
    its files (permission bits do not tell, e.g. for root, ACLs or read-only mounts).

    Call it before the expensive work (the CLI calls it before loading the model);
    :func:`atomic_output_dir` runs it again. Accepted: a path that does not exist yet (its missing
    parent folders will be created), an empty folder, a folder holding a previous export (one of
    :data:`EXPORT_MARKERS` at its top level), and with ``overwrite=True`` any folder except one
    that is or contains the home folder or a ``keep`` path. A symlink is followed to the folder it
    names.

    Args:
        path: the output folder.
        overwrite: accept a non-empty folder that holds something other than a previous export
            (everything in it is replaced by the new export).
        keep: existing paths the export must not delete (the CLI passes the ``--model`` folder);
            the user's home folder is always kept. Paths that do not exist are ignored.
        keep_cwd: also refuse a ``path`` that is or contains the current working folder (the CLI:
            replacing it would leave the user's shell in a deleted folder).

    Raises:
        OutputDirectoryError: (a ``ValueError``) ``path`` is a file or lies under a file, is a
            dangling symbolic link, is a file-system root, is or contains the home folder, a
            ``keep`` path or (``keep_cwd``) the working folder, cannot be listed,
            holds files that are not a previous export and ``overwrite`` is false, or the folder
            that must receive it (its parent, or the nearest existing ancestor) is not writable.
            The message names the path, the problem and what to do.
    """
    shown = os.fspath(path)
    if os.path.islink(path) and not os.path.exists(path):
        raise OutputDirectoryError(
            f"output folder {shown!r} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
            "refusing to follow a dangling link (the export would create a folder wherever it points). "
            "Create the folder it names, remove the link, or pick another folder",
            path=shown,
        )
    target = _resolve(path)
    if target.name == "":
        raise OutputDirectoryError(
            f"output folder {shown!r} is a file-system root; pick a folder below it "
            f"(e.g. {os.path.join(shown, 'export')!r})",
            path=shown,
        )
    try:
        home: str | None = os.path.realpath(Path.home())
    except (RuntimeError, KeyError):  # no home folder known
        home = None
    real_target = Path(os.path.realpath(target))
    if keep_cwd:
        try:
            cwd: str | None = os.path.realpath(os.getcwd())
        except OSError:
            cwd = None
        if cwd is not None and (Path(cwd) == real_target or real_target in Path(cwd).parents):
            raise OutputDirectoryError(
                f"output folder {shown!r} is or contains the current working folder {cwd!r}, which an "
                "export would replace as a whole (your shell would be left in a deleted folder); pick a "
                f"new folder for the export, e.g. {os.path.join(shown, 'export')!r}, or run from another folder",
                path=shown,
            )
    for kept in [*([home] if home else []), *keep]:
        if not os.path.exists(kept):
            continue
        kept = Path(os.path.realpath(kept))
        if kept == real_target or real_target in kept.parents:
            what = "your home folder" if os.fspath(kept) == home else repr(os.fspath(kept))
            raise OutputDirectoryError(
                f"output folder {shown!r} is or contains {what}, which an export would delete (it "
                "replaces the whole output folder); pick a new folder for the export, e.g. "
                f"{os.path.join(shown, 'export')!r}",
                path=shown,
            )
    if target.exists() or os.path.islink(target):
        if not target.is_dir():
            raise OutputDirectoryError(
                f"output folder {shown!r} is a file, not a folder; pick a folder path (hfexport writes the "
                "artifact, its config and export_report.json into a folder), or move the file away",
                path=shown,
            )
        try:
            entries = os.listdir(target)
        except OSError as exc:
            raise OutputDirectoryError(
                f"output folder {shown!r} cannot be read ({exc.strerror}); fix its permissions or pick "
                "another folder",
                path=shown,
            ) from exc
        problem = previous_export_problem(target, entries) if entries and not overwrite else None
        if problem is not None:
            raise OutputDirectoryError(
                f"output folder {shown!r} is not empty and is not a previous hfexport export ({problem}); "
                "an export replaces the whole folder, so these files would be deleted. Pass --overwrite "
                "(overwrite=True) to replace it, or pick an empty or new folder",
                path=shown,
            )
        receiver = target.parent
    else:
        receiver = target.parent
        while not os.path.lexists(receiver) and receiver.parent != receiver:
            receiver = receiver.parent
        if not receiver.is_dir():
            raise OutputDirectoryError(
                f"output folder {shown!r} cannot be created: {os.fspath(receiver)!r} is a file, not a "
                "folder; pick another folder",
                path=shown,
            )
    problem = _unwritable(shown, receiver, "output folder")
    if problem is not None:
        raise OutputDirectoryError(problem, path=shown)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, owned by another user
        return True
    return True


def _is_stale(path: Path, match: re.Match[str]) -> bool:
    try:
        age = time.time() - path.lstat().st_mtime
    except OSError:
        return False
    if age > STALE_AFTER_SECONDS:
        return True
    return match["host"] == _HOST and not _pid_alive(int(match["pid"]))


def _clean_stale(target: Path) -> bool:
    """Remove our stale temporary folders beside ``target``; return True if one was restored.

    An ``-old`` folder (the previous export, renamed aside by a run killed before its new folder
    was in place) is renamed back onto ``target`` when ``target`` is missing. When the killed run
    had already moved its new folder onto ``target`` (its breadcrumb is left and its staging folder
    is gone: a kill between the last two renames of the swap), the swap is rolled back: the new
    folder goes and the ``-old`` one is renamed back, so a killed export changes nothing, like any
    other failed one. Every other stale folder of ours is deleted. Entries not matching our names,
    symlinks and files are left alone.
    """
    parent = target.parent
    pattern = _sibling_pattern(target)
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    stale: list[tuple[str, Path, str]] = []
    moved_in: set[str] = set()  # pids of killed runs whose new folder is already at target
    for name in names:
        crumb = name.endswith(_BREADCRUMB)
        match = pattern.match(name[: -len(_BREADCRUMB)] if crumb else name)
        full = parent / name
        if crumb and match is not None and match["kind"] == "staging" and full.is_file():
            # a breadcrumb whose folder is gone (the run was killed after moving it in, or the
            # folder was removed above): reported and removed with the folder, or alone
            if not os.path.lexists(full.with_name(name[: -len(_BREADCRUMB)])) and _is_stale(full, match):
                moved_in.add(match["pid"])
                _report_killed(target, full, match)
            continue
        if match is None or full.is_symlink() or not full.is_dir():
            continue
        if _is_stale(full, match):
            stale.append((match["kind"], full, match["pid"]))
    restored = False
    # the newest previous folder is the one the killed run took away from the target
    stale.sort(key=lambda item: (item[0] != "old", -_mtime(item[1])))
    for kind, full, pid in stale:
        if kind == "old" and pid in moved_in and os.path.isdir(target) and not os.path.islink(target):
            # killed between "new folder in" and "previous folder out": roll the swap back
            undone = _sibling_name(target, "trash")
            try:
                os.rename(target, undone)
            except OSError as exc:
                logger.warning("could not roll back %s (killed mid-swap): %s", target, exc)
            else:
                shutil.rmtree(undone, ignore_errors=True)
                moved_in.discard(pid)
        if kind == "old" and not os.path.lexists(target):
            try:
                os.rename(full, target)
            except OSError as exc:
                logger.warning("could not restore %s to %s: %s", full, target, exc)
                continue
            logger.warning("restored %s from %s, left by an interrupted export", target, full.name)
            restored = True
            continue
        # a nested atomic_output_dir (save_components into the CLI's staging folder) has its own
        # temporary folders beside this one, named after it
        _clean_stale(full)
        logger.info("removing stale temporary folder %s", full)
        shutil.rmtree(full, ignore_errors=True)
        crumb = full.with_name(full.name + _BREADCRUMB)
        if kind == "staging" and crumb.is_file():
            match = pattern.match(full.name)
            if match is not None:
                _report_killed(target, crumb, match)
    return restored


def _report_killed(target: Path, crumb: Path, match: re.Match[str]) -> None:
    """Warn that the run whose breadcrumb is ``crumb`` died without cleaning up; remove ``crumb``."""
    stage = _read_stage(crumb)
    where = f"during stage '{stage}'" if stage else "before its first stage"
    logger.warning(
        "a previous export into %s (process %s) was killed %s without cleaning up (SIGKILL: the "
        "out-of-memory killer or kill -9, or a crash); its temporary files are removed and the folder "
        "is as that run found it. If memory ran out: --dtype bfloat16, --no-validate, or a smaller model",
        target,
        match["pid"],
        where,
    )
    with contextlib.suppress(OSError):
        crumb.unlink()


def _read_stage(crumb: Path) -> str | None:
    try:
        text = crumb.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[-1][:200] if text else None


def note_stage(name: str) -> None:
    """Record ``name`` as the current stage of the export whose output folder is being staged in
    this process (the breadcrumb file beside the outermost staging folder); nothing when no
    :func:`atomic_output_dir` is open. Called by :meth:`hfexport.report.ExportReport.stage` at
    each stage start and by the CLI for its own steps; a failure to write is ignored."""
    if not _ACTIVE:
        return
    crumb = _ACTIVE[0].with_name(_ACTIVE[0].name + _BREADCRUMB)
    with contextlib.suppress(OSError), open(crumb, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")


def killed_stage(path: str | os.PathLike[str], pid: int) -> tuple[bool, str | None]:
    """What the process ``pid`` (gone) left beside the output folder ``path``.

    Args:
        path: the output folder the process was exporting into.
        pid: the process id of the (dead) export.

    Returns:
        ``(staged, stage)``: whether it had created its staging folder, and the last stage it
        recorded (``None`` when it recorded none).
    """
    target = _resolve(path)
    pattern = _sibling_pattern(target)
    staged, stage = False, None
    with contextlib.suppress(OSError):
        for name in os.listdir(target.parent):
            match = pattern.match(name[: -len(_BREADCRUMB)] if name.endswith(_BREADCRUMB) else name)
            if match is None or match["kind"] != "staging" or int(match["pid"]) != pid:
                continue
            staged = True
            if name.endswith(_BREADCRUMB):
                stage = _read_stage(target.parent / name) or stage
    return staged, stage


def clean_stale(path: str | os.PathLike[str]) -> None:
    """Remove the temporary folders that dead exports left beside the output folder ``path``
    (restoring a previous folder a killed swap had moved aside), logging a warning per killed
    run that names its last stage; what :func:`atomic_output_dir` does before it stages."""
    target = _resolve(path)
    if target.parent.is_dir():
        _clean_stale(target)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _fsync_path(path: str | os.PathLike[str], *, directory: bool) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if directory else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms (Windows) cannot open a folder: nothing to flush then
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        # file systems that cannot fsync (EINVAL) or a folder on some platforms: nothing to flush
        if not (directory or exc.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every regular file below ``root``, then the folders, to disk before the swap."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            if os.path.isfile(full) and not os.path.islink(full):
                _fsync_path(full, directory=False)
        _fsync_path(folder, directory=True)


def _swap(staging: Path, target: Path) -> None:
    """Put the complete folder ``staging`` at ``target``; the previous ``target`` survives a failure."""
    parent = target.parent
    if not os.path.lexists(target):
        faults.reached("move")
        os.rename(staging, target)
        _fsync_path(parent, directory=True)
        return
    # the new folder keeps the permissions the user gave the old one
    with contextlib.suppress(OSError):
        os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
    backup = _sibling_name(target, "old")
    faults.reached("move")
    os.rename(target, backup)
    try:
        faults.reached("move")
        os.rename(staging, target)
    except BaseException as exc:
        try:
            os.rename(backup, target)
        except OSError as restore_error:
            raise OutputDirectoryError(
                f"output folder {os.fspath(target)!r} could not be replaced ({exc}) nor restored "
                f"({restore_error}); the previous folder is at {os.fspath(backup)!r}: rename it back "
                "by hand",
                path=os.fspath(target),
            ) from exc
        raise
    _fsync_path(parent, directory=True)
    trash = _sibling_name(target, "trash")
    try:
        faults.reached("move")
        os.rename(backup, trash)
    except OSError:
        trash = backup
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.lexists(trash):
        logger.warning("could not remove the previous output folder %s; the next export removes it", trash)


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces the folder ``path`` as a whole.

    The caller writes every file of the export into the yielded folder (a sibling of ``path``,
    ``.<name>.hfexport-staging.<pid>.<host>.<random>``, created with a plain ``mkdir``'s mode). When
    the body returns, the files are flushed to disk (``fsync``) and the folder is swapped in: the
    existing ``path`` is renamed aside, the staging folder renamed to ``path`` (it takes the old
    folder's permission bits), and the old folder deleted. If the body raises, or a rename fails,
    the staging folder is deleted and ``path`` keeps exactly what it had (a missing ``path`` stays
    missing; missing parent folders may have been created). Stale temporary folders of earlier
    killed runs beside ``path`` are cleaned first (see the module docstring for the naming rule).
    A symlink ``path`` is followed: the folder it names is replaced, the link stays.

    Args:
        path: the output folder; it need not exist.
        overwrite: replace a non-empty folder that is not a previous hfexport export.

    Yields:
        The staging folder (``pathlib.Path``), empty.

    Raises:
        OutputDirectoryError: ``path`` cannot receive an export (see :func:`check_output_dir`), or
            neither the swap nor the restore of the previous folder succeeded (the message names
            where the previous folder is).
        OSError: creating the staging folder, flushing, or the swap failed (``path`` unchanged).
    """
    check_output_dir(path, overwrite=overwrite)
    target = _resolve(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if _clean_stale(target):
            check_output_dir(path, overwrite=overwrite)
        staging = _make_staging(target)
    except OSError as exc:
        raise OutputDirectoryError(
            f"output folder {os.fspath(path)!r} cannot be written: creating its staging folder in "
            f"{os.fspath(target.parent)!r} failed ({exc.strerror or exc}); fix the permissions or free "
            "space there, or pick another folder",
            path=os.fspath(path),
        ) from exc
    outermost = not _ACTIVE
    _ACTIVE.append(staging)
    if outermost:
        faults.begin_export()
    try:
        yield staging
        _fsync_tree(staging)
        cwd = _cwd_inside(target)
        if outermost:
            note_stage("swap")
            faults.reached("stage:swap")
        _swap(staging, target)
        if cwd is not None:  # the process was inside the replaced folder: move it into the new one
            with contextlib.suppress(OSError):
                os.chdir(cwd if os.path.isdir(cwd) else target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _ACTIVE.remove(staging)
        if outermost:
            with contextlib.suppress(OSError):
                staging.with_name(staging.name + _BREADCRUMB).unlink()


def _make_staging(target: Path) -> Path:
    """Create and return an empty staging folder beside ``target`` (a fresh random name)."""
    while True:
        staging = _sibling_name(target, "staging")
        try:
            os.mkdir(staging)
            return staging
        except FileExistsError:
            continue


def _cwd_inside(target: Path) -> str | None:
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    if cwd == os.fspath(target) or cwd.startswith(os.fspath(target) + os.sep):
        return cwd
    return None


@contextlib.contextmanager
def atomic_new_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging folder; on success it becomes the folder ``path`` unless one exists.

    For write-once folders such as cache entries, which readers may be using: an existing ``path``
    is never replaced. The staging folder is a sibling of ``path`` named like
    :func:`atomic_output_dir`'s (stale ones of killed runs are cleaned first). When the body
    returns, its files are flushed to disk and it is renamed to ``path``; if ``path`` appeared in
    the meantime (another process built it first), the staging folder is deleted and ``path``
    kept. If the body raises, the staging folder is deleted and ``path`` is not created.

    Args:
        path: the folder to create; missing parent folders are created.

    Yields:
        The staging folder (``pathlib.Path``), empty.

    Raises:
        FileExistsError: ``path`` exists and is not a folder.
        OSError: creating the staging folder, flushing or the rename failed for another reason.
    """
    target = _resolve(path)
    if os.path.lexists(target) and not target.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder; remove it", os.fspath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(target)
    staging = _make_staging(target)
    try:
        yield staging
        _fsync_tree(staging)
        try:
            os.rename(staging, target)
        except OSError as exc:
            # a non-empty folder there: another process finished first (ENOTEMPTY, EEXIST on some systems)
            if not (target.is_dir() and exc.errno in (errno.ENOTEMPTY, errno.EEXIST)):
                raise
            logger.info("%s was created by another process meanwhile; keeping it", target)
            shutil.rmtree(staging, ignore_errors=True)
            return
        _fsync_path(target.parent, directory=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
