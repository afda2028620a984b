"""``hfexport bench``'s orchestration: one child process per folder, one table side by side.

:func:`bench_folders` tokenizes the prompt and the quality text once, runs the eager reference
(when given) and every folder in its own child (:mod:`hfexport.bench.child`) one after the other
(never two at once: peak memory is per process and the cores are shared), then scores each
folder's teacher-forced logits against the eager model's with the language-model metrics of
:mod:`hfexport.quality` (perplexity ratio, KL divergence, top-1 agreement over every position).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hfexport.bench.runtimes import FolderRuntime, runtime_for

__all__ = [
    "DEFAULT_PROMPT",
    "BenchRow",
    "bench_folders",
    "folder_size_bytes",
    "prompt_ids_of",
    "render_table",
    "text_chunk_ids",
]

#: the default prompt (23 tokens with SmolLM2's tokenizer), as in the issue's measurements
DEFAULT_PROMPT = (
    "Write a short story about a robot who learns to paint. The robot lives in a small town by the sea and"
)

#: file suffixes that are not part of an artifact's size (reports, checksums, logs)
_NOT_WEIGHTS = (".sha256", ".log")


def folder_size_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` except reports and checksum lists (what ships)."""
    from hfexport.folder import REPORT_NAME

    return sum(
        p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and not p.name.endswith(_NOT_WEIGHTS) and p.name != REPORT_NAME
    )


@dataclass
class BenchRow:
    """One row of the table.

    Attributes:
        label: the folder path (or ``"eager (<spec>)"``).
        runtime: the folder runtime's name (``"eager"`` for the reference).
        size_bytes: the folder's shipped bytes (``None`` for the eager row: its fp32 weights).
        load_s: seconds to open the folder in its runtime.
        prefill_ms: median time to the first new token.
        decode_tokens_per_s: steady decode rate after the first token.
        peak_rss_bytes: the child process's peak resident memory after generation.
        tokens: the new token ids of one greedy run.
        tokens_equal_eager: how many leading new tokens equal the eager model's (``None``
            without a reference).
        text: the text-quality metrics against eager (``perplexity_ratio``, ``kl_divergence``,
            ``top1_agreement_text`` ...) or ``None``.
        note: why a column is empty (no logits from this runtime ...).
        error: the failure, when the folder did not run.
    """

    label: str
    runtime: str
    size_bytes: int | None = None
    load_s: float | None = None
    prefill_ms: float | None = None
    decode_tokens_per_s: float | None = None
    peak_rss_bytes: int | None = None
    tokens: list[int] = field(default_factory=list)
    tokens_equal_eager: int | None = None
    text: dict[str, Any] | None = None
    note: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return asdict(self)


def _tokenizer_of(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def prompt_ids_of(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids (special tokens not added: every runtime gets the same ids).

    Raises:
        ValueError: the prompt tokenizes to no tokens.
    """
    ids = [int(i) for i in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise ValueError("the prompt tokenizes to no tokens; pass a non-empty --prompt")
    return ids


def text_chunk_ids(tokenizer: Any, *, max_chunk: int) -> list[list[int]]:
    """:func:`hfexport.quality.quality_text` tokenized and cut into prefills of at most
    ``max_chunk`` tokens (:func:`hfexport.quality.text_chunks`).

    Raises:
        ValueError: ``max_chunk`` < 2.
    """
    from hfexport.quality import text_chunks, text_token_ids

    text, _ = text_token_ids(tokenizer)
    return [c[0].tolist() for c in text_chunks(text, max_length=max_chunk)]


def _opener_reference(runtime: FolderRuntime) -> str:
    opener = runtime.opener
    if isinstance(opener, str):
        return opener
    return f"{opener.__module__}:{opener.__qualname__}"


def _run_child(request: dict[str, Any], timeout: float | None) -> tuple[dict[str, Any] | None, str]:
    out_dir = Path(request["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(request["threads"]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run(
        [sys.executable, "-m", "hfexport.bench.child", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if (out_dir / "result.json").is_file():
        return json.loads((out_dir / "result.json").read_text(encoding="utf-8")), ""
    if (out_dir / "error.txt").is_file():
        return None, (out_dir / "error.txt").read_text(encoding="utf-8")
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
    return None, f"the child exited with {proc.returncode}: {' | '.join(tail) or 'no output'}"


def _load_logits(files: Sequence[str]) -> list[Any]:
    import numpy as np
    import torch

    return [torch.from_numpy(np.load(f))[None] for f in files]


def bench_folders(
    folders: Sequence[str | os.PathLike[str]],
    *,
    reference: str | None = None,
    prompt: str = DEFAULT_PROMPT,
    input_ids: Sequence[int] | None = None,
    new_tokens: int = 64,
    runs: int = 3,
    threads: int = 2,
    runtime: str | None = None,
    max_chunk: int = 512,
    quality: bool = True,
    timeout: float | None = None,
) -> list[BenchRow]:
    """Measure each folder in its runtime (and the eager reference), one child at a time.

    Args:
        folders: export folders: ours (any layout or generation folder) or a runtime builder's.
        reference: the checkpoint the folders were exported from (``PATH`` or ``pkg:<name>``):
            adds the eager fp32 row, its greedy tokens for ``tokens_equal_eager`` and the text
            metrics; ``None`` measures speed, memory and size only.
        prompt: the generation prompt, tokenized with the reference's tokenizer (else the first
            folder's ``tokenizer.json``); ``input_ids`` replaces it.
        input_ids: the prompt as token ids (no tokenizer needed).
        new_tokens: greedy new tokens per timed run (>= 2).
        runs: timed runs per measurement (the median is kept).
        threads: intra-op threads each runtime is given.
        runtime: open every folder with this registered runtime instead of the one that claims it.
        max_chunk: the longest teacher-forced prefill of the quality text (tokens); the default
            is the exports' own (:data:`hfexport.quality.TEXT_CHUNK_TOKENS`), so an export's text
            metrics and the bench's of the same artifact agree.
        quality: compute the text metrics (needs ``reference`` and a tokenizer).
        timeout: seconds per child; ``None`` waits.

    Returns:
        The rows, eager first when ``reference`` is given, then ``folders`` in order. A folder
        that fails has ``error`` set; the others still run.

    Raises:
        ValueError: ``new_tokens`` < 2, ``runs`` < 1, no prompt ids can be made (no tokenizer
            and no ``input_ids``), or no runtime claims a folder.
        FileNotFoundError: a folder or the reference does not exist.
    """
    from hfexport.bench.eager import model_folder
    from hfexport.bench.runtimes import import_installed_backends

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (a decode rate needs two tokens), got {new_tokens}")
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    paths = [Path(f) for f in folders]
    import_installed_backends()  # their folder runtimes register on import
    runtimes = [runtime_for(p, runtime) for p in paths]  # every folder is claimed before anything runs
    tokenizer_home = (
        model_folder(reference)
        if reference
        else next(
            (p for p in paths if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()),
            None,
        )
    )
    tokenizer = _tokenizer_of(tokenizer_home) if tokenizer_home is not None else None
    if input_ids is not None:
        prompt_ids = [int(i) for i in input_ids]
    elif tokenizer is None:
        raise ValueError("no tokenizer to encode the prompt: pass --reference MODEL or --input-ids 1,2,3")
    else:
        prompt_ids = prompt_ids_of(tokenizer, prompt)
    chunks = text_chunk_ids(tokenizer, max_chunk=max_chunk) if quality and reference and tokenizer else []
    work = Path(tempfile.mkdtemp(prefix="hfexport-bench-"))
    base = {
        "threads": threads,
        "prompt_ids": prompt_ids,
        "new_tokens": new_tokens,
        "runs": runs,
        "text_chunks": chunks,
    }
    rows: list[BenchRow] = []
    eager_tokens: list[int] | None = None
    eager_logits: list[Any] | None = None
    if reference:
        request = {
            **base,
            "opener": "hfexport.bench.eager:open_eager",
            "folder": reference,
            "out_dir": str(work / "eager"),
        }
        result, error = _run_child(request, timeout)
        row = BenchRow(label=f"eager ({reference})", runtime="eager", error=error)
        if result is not None:
            _fill(row, result)
            eager_tokens = row.tokens
            eager_logits = _load_logits(result["logits_files"]) if result.get("logits_files") else None
        rows.append(row)
    for i, (path, chosen) in enumerate(zip(paths, runtimes, strict=True)):
        request = {
            **base,
            "opener": _opener_reference(chosen),
            "folder": str(path),
            "out_dir": str(work / f"folder{i}"),
        }
        result, error = _run_child(request, timeout)
        row = BenchRow(label=str(path), runtime=chosen.name, size_bytes=folder_size_bytes(path), error=error)
        if result is not None:
            _fill(row, result)
            if eager_tokens is not None:
                row.tokens_equal_eager = _leading_equal(row.tokens, eager_tokens)
            if eager_logits is not None and result.get("logits_files"):
                row.text = _text_metrics(chunks, eager_logits, _load_logits(result["logits_files"]))
            elif chunks and not result.get("logits_files"):
                row.note = result.get("logits_note") or "this runtime gives no logits: no text metrics"
        rows.append(row)
    return rows


def _fill(row: BenchRow, result: dict[str, Any]) -> None:
    row.load_s = result.get("load_s")
    row.prefill_ms = result.get("prefill_ms")
    row.decode_tokens_per_s = result.get("decode_tokens_per_s")
    row.peak_rss_bytes = result.get("peak_rss_bytes")
    row.tokens = list(result.get("tokens") or [])


def _leading_equal(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _text_metrics(chunks: list[list[int]], expected: list[Any], actual: list[Any]) -> dict[str, Any]:
    import torch

    from hfexport.quality import text_quality

    tensors = [torch.as_tensor([c], dtype=torch.int64) for c in chunks]
    result = text_quality(tensors, expected, actual)
    return {
        "perplexity_ratio": round(result.perplexity_ratio, 4),
        "kl_divergence": round(result.kl_divergence, 4),
        "top1_agreement_text": round(result.top1_agreement_text, 4),
        "perplexity_eager": round(result.perplexity_eager, 3),
        "perplexity_artifact": round(result.perplexity_artifact, 3),
        "tokens": result.tokens,
    }


def render_table(rows: Sequence[BenchRow], title: str = "hfexport bench") -> Any:
    """A ``rich`` table of ``rows`` (one per folder) with ratios to the eager row where given."""
    from rich.table import Table

    table = Table(title=title)
    for name in (
        "folder",
        "runtime",
        "size MB",
        "prefill ms",
        "decode tok/s",
        "peak RSS GB",
        "= eager tokens",
        "ppl ratio",
        "KL",
        "top-1 text",
        "note",
    ):
        table.add_column(name, overflow="fold")
    for row in rows:
        text = row.text or {}
        table.add_row(
            row.label,
            row.runtime,
            "-" if row.size_bytes is None else f"{row.size_bytes / 1e6:.1f}",
            "-" if row.prefill_ms is None else f"{row.prefill_ms:.1f}",
            "-" if row.decode_tokens_per_s is None else f"{row.decode_tokens_per_s:.1f}",
            "-" if row.peak_rss_bytes is None else f"{row.peak_rss_bytes / 1e9:.2f}",
            "-" if row.tokens_equal_eager is None else f"{row.tokens_equal_eager}/{len(row.tokens)}",
            f"{text['perplexity_ratio']:.4f}" if text else "-",
            f"{text['kl_divergence']:.4f}" if text else "-",
            f"{text['top1_agreement_text']:.3f}" if text else "-",
            row.error or row.note,
        )
    return table
