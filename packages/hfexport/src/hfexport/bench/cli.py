"""The ``hfexport bench`` command (registered on :data:`hfexport.cli.app`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from hfexport.bench.run import DEFAULT_PROMPT

# a piped table keeps its columns whole (rich would fold them to 80 columns without a terminal)
console = Console(highlight=False, width=None if sys.stdout.isatty() else 250)
err_console = Console(stderr=True, highlight=False)


def bench_command(
    folders: Annotated[
        list[Path],
        typer.Argument(
            metavar="FOLDER...",
            help="Export folders: ours (a layout or generation folder) or a runtime builder's output.",
        ),
    ],
    reference: Annotated[
        str | None,
        typer.Option(
            help="The checkpoint they came from (PATH or pkg:<name>): adds the eager fp32 row, "
            "greedy-token agreement and text metrics (perplexity ratio, KL, top-1)."
        ),
    ] = None,
    prompt: Annotated[str, typer.Option(help="Generation prompt.")] = DEFAULT_PROMPT,
    input_ids: Annotated[
        str | None, typer.Option("--input-ids", help="The prompt as comma-separated token ids.")
    ] = None,
    new_tokens: Annotated[int, typer.Option(help="Greedy new tokens per timed run (at least 2).")] = 64,
    runs: Annotated[int, typer.Option(help="Timed runs per measurement; the median is kept.")] = 3,
    threads: Annotated[int, typer.Option(help="Intra-op threads given to each runtime.")] = 2,
    runtime: Annotated[
        str | None,
        typer.Option(
            help="Open every folder with this registered runtime (default: the one that claims it)."
        ),
    ] = None,
    no_quality: Annotated[bool, typer.Option("--no-quality", help="Skip the text metrics.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the rows as JSON instead of a table.")
    ] = False,
) -> None:
    """Measure export folders in their own runtimes, one process each, and print one table.

    Columns: size, time to first token (prefill ms), decode tokens/s, peak RSS, greedy tokens equal
    to the eager model's, and with --reference the text metrics on hfexport's quality passage.
    Exit code 2 for bad arguments, 1 when any folder failed to run (its row says why).
    """
    from hfexport.bench.run import bench_folders, render_table

    if new_tokens < 2:
        raise typer.BadParameter(f"must be at least 2, got {new_tokens}", param_hint="--new-tokens")
    if runs < 1:
        raise typer.BadParameter(f"must be at least 1, got {runs}", param_hint="--runs")
    ids = None
    if input_ids is not None:
        try:
            ids = [int(x) for x in input_ids.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(
                "takes comma-separated integers, e.g. 1,2,3", param_hint="--input-ids"
            ) from None
        if not ids or min(ids) < 0:
            raise typer.BadParameter(
                "takes at least one non-negative token id, e.g. 1,2,3", param_hint="--input-ids"
            )
    if threads < 1:
        raise typer.BadParameter(f"must be at least 1, got {threads}", param_hint="--threads")
    for folder in folders:
        if not folder.exists():
            raise typer.BadParameter(f"{folder} does not exist", param_hint="FOLDER")
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder} is not a folder", param_hint="FOLDER")
    try:
        rows = bench_folders(
            folders,
            reference=reference,
            prompt=prompt,
            input_ids=ids,
            new_tokens=new_tokens,
            runs=runs,
            threads=threads,
            runtime=runtime,
            quality=not no_quality,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        console.print_json(json.dumps([row.to_dict() for row in rows]))
    else:
        console.print(render_table(rows))
    if any(row.error for row in rows):
        raise typer.Exit(code=1)
