"""Fault injection for hfexport's own reliability tests (``tests-integration/test_faults.py``).

Inert unless the environment variable ``HFEXPORT_FAULT`` is set: each hook then costs one
``os.environ`` lookup (a stage start, a folder swap's rename), and no audit hook is installed.
Set, it names one point and what happens there::

    HFEXPORT_FAULT=<point>:<kind>

Points:

- ``stage:<name>``: when the report's stage recorder (:meth:`hfexport.report.ExportReport.stage`)
  starts the stage ``<name>`` (``capture``, ``lower``, ``save``, ``validate``, ...; the stage list
  of ``export_report.json`` gives them), inside the stage, so a raised error is that stage's failure.
- ``move:<n>``: before the ``n``-th rename (from 1) of an output folder's swap
  (:func:`hfexport.atomic.atomic_output_dir`): with a previous folder, 1 moves it aside, 2 moves the
  new folder in, 3 moves the previous one to the trash.
- ``write:<n>``: the ``n``-th file opened for writing, or renamed into place, inside a staging
  folder of ours (``.hfexport-staging.`` in a parent folder's name): the backend's files (as far as
  Python writes them: native serializers such as OpenVINO's are seen only at their rename), the
  model's config, ``export_report.json``, ``checksums.sha256``. Counted per export: the count
  restarts when an outermost staging folder is created. Seen through a Python audit hook
  (:func:`sys.addaudithook`), installed only when such a fault is asked for.

Kinds: ``kill`` (SIGKILL to the process itself: what the out-of-memory killer sends), ``memory``
(``MemoryError``), ``interrupt`` (``KeyboardInterrupt``, as Ctrl-C raises it), ``enospc`` and
``eio`` (``OSError`` with that errno, as a full or failing disk gives).

``HFEXPORT_FAULT_TRACE=<file>`` appends every point reached (``stage:capture``, ``move:1``,
``write:2 <path>``), one per line, so a test learns the points from a clean run.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

__all__ = ["FAULT_ENV", "KINDS", "TRACE_ENV", "FaultSpecError", "begin_export", "reached"]

#: the variable naming the fault
FAULT_ENV = "HFEXPORT_FAULT"
#: the variable naming a file that receives every point reached
TRACE_ENV = "HFEXPORT_FAULT_TRACE"
#: what a fault can do
KINDS = ("kill", "memory", "interrupt", "enospc", "eio")

_counts = {"move": 0, "write": 0}
_hook_installed: list[bool] = []


class FaultSpecError(ValueError):
    """``HFEXPORT_FAULT`` is not ``<point>:<kind>`` with a known point and kind."""


def _parse(spec: str) -> tuple[str, str, str]:
    """``(point kind, point argument, fault kind)`` of ``spec``; raises :class:`FaultSpecError`."""
    where, _, kind = spec.strip().rpartition(":")
    point, _, arg = where.partition(":")
    if point not in ("stage", "move", "write") or not arg or kind not in KINDS:
        raise FaultSpecError(
            f"{FAULT_ENV}={spec!r} is invalid; allowed: stage:<name>:<kind>, move:<n>:<kind> or "
            f"write:<n>:<kind>, kind one of {', '.join(KINDS)}"
        )
    return point, arg, kind


def _trace(point: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(point + "\n")


def _fire(kind: str, point: str, path: str | None = None) -> None:
    where = f"injected fault at {point}"
    if kind == "kill":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "memory":
        raise MemoryError(where)
    if kind == "interrupt":
        raise KeyboardInterrupt(where)
    code = errno.ENOSPC if kind == "enospc" else errno.EIO
    raise OSError(code, f"{os.strerror(code)} ({where})", path)


def reached(point: str, number: int | None = None) -> None:
    """Hook: the export reached ``point`` (``"stage:capture"``, or ``"move"`` with its number).

    Args:
        point: ``"stage:<name>"``, or ``"move"`` (counted per export; ``number`` overrides).
        number: the point's number, for counted points.

    Raises:
        MemoryError, KeyboardInterrupt, OSError: the fault ``HFEXPORT_FAULT`` asks for here.
        FaultSpecError: ``HFEXPORT_FAULT`` is malformed.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec and not os.environ.get(TRACE_ENV):
        return
    if point in _counts:
        _counts[point] = number if number is not None else _counts[point] + 1
        point = f"{point}:{_counts[point]}"
    _trace(point)
    if spec:
        kind_of, arg, kind = _parse(spec)
        if point == f"{kind_of}:{arg}":
            _fire(kind, point)


def begin_export() -> None:
    """Hook: an outermost staging folder was created; the move and write counts restart. Installs
    the write hook when ``HFEXPORT_FAULT`` asks for a write fault or a trace is kept."""
    spec = os.environ.get(FAULT_ENV)
    if not spec and not os.environ.get(TRACE_ENV):
        return
    _counts.update(move=0, write=0)
    if not _hook_installed and (os.environ.get(TRACE_ENV) or _parse(spec or "")[0] == "write"):
        sys.addaudithook(_audit)
        _hook_installed.append(True)


# opened to write new content (a read-write open of an existing file, e.g. to map it, is not)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _in_staging(path: object) -> bool:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str | os.PathLike):
        return False
    return ".hfexport-staging." in os.path.dirname(os.path.abspath(os.fspath(path)))


def _audit(event: str, args: tuple[object, ...]) -> None:
    """The audit hook: a file opened for writing (``open``) or renamed (``os.rename``, which
    ``os.replace`` raises too) into a staging folder is a write point."""
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax") if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
    elif event == "os.rename":
        path, writing = args[1], True
    else:
        return
    if not writing or not _in_staging(path):
        return
    spec = os.environ.get(FAULT_ENV)
    if not spec and not os.environ.get(TRACE_ENV):
        return
    _counts["write"] += 1
    point = f"write:{_counts['write']}"
    _trace(f"{point} {os.path.basename(os.fspath(path))}")  # type: ignore[arg-type]
    if spec:
        kind_of, arg, kind = _parse(spec)
        if point == f"{kind_of}:{arg}":
            _fire(kind, point, os.fspath(path))  # type: ignore[arg-type]
