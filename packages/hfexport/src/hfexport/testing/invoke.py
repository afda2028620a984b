"""Running the ``hfexport`` command line in-process from tests: ``hfexport export FORMAT --layout ...``.

:func:`export_layout` runs one export into a layout, :func:`refusal` checks that the CLI refused a
command as a usage error and returns its message folded to one line (:func:`folded`), so tests can
match the words without caring where the terminal wrapped them or drew a box.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from click.testing import Result
from typer.testing import CliRunner

from hfexport.cli import app

__all__ = ["WIDE", "export_layout", "folded", "invoke", "refusal"]

#: the environment of every invocation: a wide terminal, so rich does not wrap messages mid-phrase
WIDE = {"COLUMNS": "2000"}
_BOX = "│╭╮╰╯─"


def invoke(args: Sequence[str]) -> Result:
    """Run ``hfexport ARGS`` in this process (``typer.testing.CliRunner``, a 2000-column terminal).

    Returns:
        The ``click`` result: ``exit_code``, ``output`` (stdout and stderr), ``exception``.
    """
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


def export_layout(
    export_format: str,
    model: str | Path,
    out: Path,
    *,
    layout: str,
    task: str | None,
    extra: Sequence[str] = (),
) -> Result:
    """Run ``hfexport export EXPORT_FORMAT OUT --model MODEL [--task TASK] --layout LAYOUT [EXTRA...]``.

    Args:
        export_format: the format (``"onnx"``, ``"executorch"`` ...).
        model: a model folder, ``tiny:TYPE`` or ``pkg:NAME`` (what ``--model`` takes).
        out: the output folder.
        layout: the ``--layout`` name (``"genai"``, ``"llm-runner"``, ``"transformers.js"`` ...).
        task: the ``--task``; ``None`` leaves it to the CLI (``auto``).
        extra: more options, appended as given (``["--dtype", "float16"]``).

    Returns:
        The ``click`` result (see :func:`invoke`); the caller asserts on its ``exit_code``.
    """
    args = ["export", export_format, str(out), "--model", str(model)]
    if task is not None:
        args += ["--task", task]
    return invoke([*args, "--layout", layout, *extra])


def folded(output: str) -> str:
    """``output`` with the box-drawing characters of rich's panels removed and every run of white
    space (line breaks included) folded to one space."""
    for ch in _BOX:
        output = output.replace(ch, " ")
    return " ".join(output.split())


def refusal(result: Result) -> str:
    """The message of a command the CLI refused as a usage error, folded to one line (:func:`folded`).

    Raises:
        AssertionError: the command did not exit with status 2 (the output is in the message).
    """
    assert result.exit_code == 2, result.output
    return folded(result.output)
