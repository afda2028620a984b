"""What native libraries print themselves, brought into Python logging while the CLI keeps the
terminal quiet.

Some runtimes write from C++ straight to the process's stderr (file descriptor 2), past
``sys.stderr`` and Python logging, so :mod:`hfexport.cli_logging` cannot route them:

- ExecuTorch 1.4.1's Python runtime prints five ``[cpuinfo_utils.cpp:...]`` lines ("Reading file
  /sys/devices/soc0/image_version", "Failed to open midr file ...", "CPU info and manual query on #
  of cpus dont match.") when the first XNNPACK program is loaded (``Program.load_method``, which
  creates the thread pool). They are ``ET_LOG(Info, ...)`` records of
  ``extension/threadpool/cpuinfo_utils.cpp``; the minimum log level is fixed when ExecuTorch is
  compiled (``ET_MIN_LOG_LEVEL``) and the Python runtime has no setting for it (no upstream issue
  found).
- ONNX Runtime logs warnings such as "Removing initializer 'pooler.dense.weight'. It is not used by
  any node ..." (``graph.cc CleanUnusedInitializersAndNodeArgs``) through its own default logger,
  also from the sessions ``onnxruntime.quantization`` creates internally.

Library code that imports hfexport sees them exactly as the libraries print them. The CLI turns
routing on (:func:`set_routing`, from :func:`hfexport.cli_logging.setup_cli_logging` without
``-v``) and off again (:func:`hfexport.cli_logging.restore_cli_logging`). While it is on:

- every router a backend registered (:func:`register_native_router`) has been called with
  ``True``: it points a library's own logging at Python logging (ONNX Runtime:
  ``set_default_logger_callback``); it is called with ``False`` when routing ends;
- :func:`captured_stderr`, which a backend puts around a call that prints to file descriptor 2
  with no setting to stop it, redirects fd 2 into a temporary file for that call and then logs each
  line.

The records go to the logger ``<library>.native`` (:func:`native_logger`), set to ``DEBUG`` while
routing is on, so the CLI's log file receives every one (a third-party name: the terminal shows them
only at ``ERROR``). With ``-v`` routing stays off and the libraries print as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "captured_stderr",
    "is_routing",
    "native_logger",
    "register_native_router",
    "set_routing",
]

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_routers: dict[str, Callable[[bool], None]] = {}
_routing: list[bool] = [False]
_levelled: set[str] = set()  # native loggers whose level routing set (reset when it ends)


def native_logger(library: str) -> logging.Logger:
    """The logger that receives ``library``'s native messages: ``<library>.native``
    (``"onnxruntime.native"``, ``"executorch.native"``); ``DEBUG`` while routing is on."""
    log = logging.getLogger(f"{library}.native")
    if _routing[0] and library not in _levelled:
        log.setLevel(logging.DEBUG)
        _levelled.add(library)
    return log


def is_routing() -> bool:
    """Whether native output is being routed into logging (the CLI without ``-v``)."""
    return _routing[0]


def _call(library: str, router: Callable[[bool], None], on: bool) -> None:
    try:
        router(on)
    except Exception as exc:  # routing is cosmetic: it must never fail an export
        logger.debug("routing the native output of %s %s failed: %s", library, "on" if on else "off", exc)


def register_native_router(library: str, router: Callable[[bool], None]) -> None:
    """Register ``router(on)``, which sends ``library``'s own log messages to
    :func:`native_logger` (``on=True``) or back to where the library prints them (``on=False``).

    Called by a backend at import; registering ``library`` again replaces its router (a module
    imported twice). When routing is already on, the router is called with ``True`` at once. A
    router should import its library lazily (it is called only when routing turns on) and may
    raise: the error is logged at DEBUG and ignored.
    """
    with _lock:
        _routers[library] = router
        if _routing[0]:
            native_logger(library)
            _call(library, router, True)


def set_routing(on: bool) -> None:
    """Turn routing on or off (see the module docstring); calling it twice is harmless.

    On: every registered router is called with ``True``. Off: each with ``False``, and the
    ``<library>.native`` loggers get their level back (``NOTSET``).
    """
    with _lock:
        if _routing[0] == on:
            return
        _routing[0] = on
        for library, router in list(_routers.items()):
            if on:
                native_logger(library)
            _call(library, router, on)
        if not on:
            for library in _levelled:
                logging.getLogger(f"{library}.native").setLevel(logging.NOTSET)
            _levelled.clear()


@contextlib.contextmanager
def captured_stderr(library: str) -> Iterator[None]:
    """While routing is on, send what the body writes to file descriptor 2 (C/C++ code included)
    to :func:`native_logger` of ``library``, one INFO record per non-empty line, after the body.

    Args:
        library: the library whose call the body makes (names the logger).

    With routing off, or when fd 2 cannot be duplicated, the body runs unchanged. Keep the body to
    the one native call: Python writes to ``sys.stderr`` during it land in the log as well.
    """
    if not _routing[0]:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()  # text Python buffered before the call stays on the terminal
    try:
        saved = os.dup(2)
    except OSError:
        saved = -1
    if saved < 0:
        yield
        return
    with tempfile.TemporaryFile(prefix="hfexport-native-") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", errors="replace")
            log = native_logger(library)
            for line in text.splitlines():
                if line.strip():
                    log.info("%s", line.rstrip())
