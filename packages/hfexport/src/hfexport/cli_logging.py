"""Where the command line sends Python warnings and library logging.

Installed by the ``export`` and ``generate`` commands (:func:`setup_cli_logging`), never at library
import: code that imports ``hfexport`` keeps its own logging and warning configuration.

Without ``-v`` the terminal shows hfexport's own messages (loggers ``hfexport*``, warnings whose
category or code comes from an hfexport package, such as ``VersionDriftWarning``) and every record
at ``ERROR`` or above. Everything else (third-party records below ``ERROR``, third-party warnings)
goes to the CLI log file (:func:`log_file_path`), or nowhere when the log file is disabled or
cannot be written. Some torch loggers print through their own stderr handler and never reach
the root logger; the known noisy ones (:data:`NOISY_LOGGERS`) get a filter on the logger itself
that moves their records below ``ERROR`` to the log file.

Python warnings of libraries are routed the same way; seen on CLI runs with torch 2.13: a
``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated`` that torch's own pytree code
raises when a ``LeafSpec`` is copied (reported at ``copyreg.py``) during ONNX export.

Native libraries that print from C++ (ExecuTorch's cpuinfo lines, ONNX Runtime's own logger) are
routed into the log file too: :func:`setup_cli_logging` turns on :mod:`hfexport.native_output`.

With ``-v`` nothing is hidden: the root logger logs at ``DEBUG`` to stderr, warnings print as
Python prints them, torch's and transformers' loggers print through their own handlers, native
libraries print as they do.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import warnings
from pathlib import Path

__all__ = [
    "LOG_FILE_ENV",
    "NOISY_LOGGERS",
    "log_file_path",
    "quiet_progress_bars",
    "restore_cli_logging",
    "setup_cli_logging",
]

#: Environment variable naming the CLI log file; an empty value disables the file.
LOG_FILE_ENV = "HFEXPORT_LOG_FILE"

#: Third-party loggers that print through a handler of their own (torch installs a stderr handler
#: on ``torch``, transformers one on ``transformers``, both with ``propagate=False``), so
#: root-logger configuration cannot reach them. Each maps to the lines it printed on CLI runs (seen
#: with torch 2.13, torchao and transformers 5.24; no upstream issue found for any of them).
NOISY_LOGGERS: dict[str, str] = {
    # torch/utils/_pytree.py:630 (torch >= 2.13): transformers' torchao quantizer imports torchao,
    # which registers Enum subclasses with register_constant(); torch deprecated that in 2.13.
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively "
    "supported by torch.compile ... register_constant() on Enum subclasses is deprecated",
    # torch/onnx/_internal/exporter/_registration.py:107: four lines each time torch.onnx builds
    # its op registry in an environment without torchvision (which no text model needs).
    "torch.onnx._internal.exporter._registration": "torchvision is not installed. Skipping "
    "torchvision::nms (also roi_align, roi_pool, deform_conv2d)",
    # torch/_export/non_strict_utils.py:656: Dim.AUTO on an axis of size 0 or 1 (a one-token
    # decode step, a batch of one) is specialized; hfexport reports what was exported as dynamic.
    "torch._export.non_strict_utils": "dimension inputs['input_ids'].shape[1] 0/1 specialized; "
    "Dim.AUTO was specified along with a sample input with hint = 1",
    # transformers/generation/utils.py (5.24): "[transformers] A decoder-only architecture is being
    # used, but right-padding was detected!" when a generation export records (and checks greedy
    # parity) with model.generate on sample prompts a tokenizer padded on the right; the recorded
    # graphs do not depend on it and the user cannot act on it.
    "transformers.generation.utils": "A decoder-only architecture is being used, but right-padding was "
    "detected! For correct generation results, please set `padding_side='left'` ...",
}

_OWN_PREFIX = "hfexport"
_MARK = "_hfexport_cli"  # attribute marking the handlers and filters this module installs


def _own_dirs() -> tuple[str, ...]:
    """Source folders of the hfexport packages that are imported (for warnings' file names)."""
    found = []
    for name, module in list(sys.modules.items()):
        if "." not in name and name.startswith(_OWN_PREFIX):
            path = getattr(module, "__file__", None)
            if path:
                found.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(found)


def log_file_path() -> Path | None:
    """The CLI log file: ``$HFEXPORT_LOG_FILE``, else ``$XDG_STATE_HOME/hfexport/cli.log``
    (``~/.local/state/hfexport/cli.log``); ``None`` when ``HFEXPORT_LOG_FILE`` is set empty."""
    configured = os.environ.get(LOG_FILE_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured.strip() else None
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hfexport" / "cli.log"


def _is_own(record: logging.LogRecord) -> bool:
    if record.name.startswith(_OWN_PREFIX):
        return True
    return bool(getattr(record, "hfexport_own_warning", False))


class _ToTerminal(logging.Filter):
    """Handler filter: hfexport's records, and anything at ERROR or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or _is_own(record)


class _ToLogFile(logging.Filter):
    """Handler filter: what the terminal does not show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR or _is_own(record))


class _Divert(logging.Filter):
    """Logger filter: a record below ERROR goes to the log file (if any) instead of the logger's
    own handlers."""

    def __init__(self, sink: logging.Handler | None) -> None:
        super().__init__()
        self.sink = sink
        setattr(self, _MARK, True)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if self.sink is not None:
            self.sink.handle(record)
        return False


class _WarningsToLog:
    """``warnings.showwarning`` replacement: warnings become ``py.warnings`` log records (as
    ``logging.captureWarnings`` makes them), marked when they come from hfexport so the terminal
    handler shows them."""

    def __init__(self, previous: object) -> None:
        self.previous = previous
        setattr(self, _MARK, True)

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: object = None,
        line: str | None = None,
    ) -> None:
        if file is not None:  # an explicit target (warnings.showwarning(..., file=f)): keep it
            self.previous(message, category, filename, lineno, file, line)  # type: ignore[operator]
            return
        own = category.__module__.split(".")[0].startswith(_OWN_PREFIX) or os.path.abspath(
            filename
        ).startswith(_own_dirs())
        if own:
            text = f"{category.__name__}: {message}"
        else:
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        logging.getLogger("py.warnings").warning("%s", text, extra={"hfexport_own_warning": own})


def _remove_ours(logger: logging.Logger) -> None:
    for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(handler)
        handler.close()
    for flt in [f for f in logger.filters if getattr(f, _MARK, False)]:
        logger.removeFilter(flt)


_saved_root_level: list[int] = []


_progress_bars_disabled: list[bool] = []  # True while quiet_progress_bars() has them off


def quiet_progress_bars() -> None:
    """Turn transformers' tqdm bars (``Loading weights: 100%|...``) off for the rest of a non-verbose
    command; :func:`restore_cli_logging` turns them back on. Call it where transformers is being
    imported anyway (before loading a model), so usage errors never import it."""
    if _saved_root_level and logging.getLogger().level <= logging.DEBUG:
        return  # -v: show everything
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        _progress_bars_disabled.append(True)


def restore_cli_logging() -> None:
    """Undo :func:`setup_cli_logging`: remove its handlers and filters, restore the root logger's
    level and ``warnings.showwarning``, end native output routing. The commands call it when they end, so running them in a
    process (tests, notebooks) leaves that process's logging as it was."""
    from hfexport.native_output import set_routing

    set_routing(False)
    root = logging.getLogger()
    _remove_ours(root)
    for name in NOISY_LOGGERS:
        _remove_ours(logging.getLogger(name))
    if isinstance(warnings.showwarning, _WarningsToLog):
        warnings.showwarning = warnings.showwarning.previous  # type: ignore[assignment]
    if _saved_root_level:
        root.setLevel(_saved_root_level.pop())
        _saved_root_level.clear()
    if _progress_bars_disabled:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
        _progress_bars_disabled.clear()


def setup_cli_logging(verbose: bool) -> Path | None:
    """Route warnings and library logging for one CLI command (see the module docstring).

    Args:
        verbose: ``-v``: show everything on stderr, with debug logging.

    Returns:
        The log file third-party records go to (created on the first record), or ``None``
        (verbose, or the file is disabled or cannot be created).

    Calling it again replaces what the previous call installed; :func:`restore_cli_logging`
    removes it. Handlers and filters of others are left alone.
    """
    restore_cli_logging()
    root = logging.getLogger()
    _saved_root_level.append(root.level)
    terminal = logging.StreamHandler()  # sys.stderr as of now (CliRunner swaps it per call)
    terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    setattr(terminal, _MARK, True)
    root.addHandler(terminal)
    if verbose:
        root.setLevel(logging.DEBUG)
        return None

    root.setLevel(logging.WARNING)
    terminal.addFilter(_ToTerminal())
    sink: logging.Handler | None = None
    path = log_file_path()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            sink = logging.handlers.RotatingFileHandler(
                path, maxBytes=2_000_000, backupCount=1, encoding="utf-8", delay=True
            )
        except OSError:
            path, sink = None, None
    if sink is not None:
        sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        sink.addFilter(_ToLogFile())
        setattr(sink, _MARK, True)
        root.addHandler(sink)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_Divert(sink))
    warnings.showwarning = _WarningsToLog(warnings.showwarning)  # type: ignore[assignment]
    from hfexport.native_output import set_routing

    set_routing(True)  # native libraries' own output -> <library>.native loggers -> the log file
    return path
