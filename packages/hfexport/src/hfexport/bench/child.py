"""The measuring child of ``hfexport bench``: one folder (or the eager reference) per process.

``python -m hfexport.bench.child REQUEST.json`` opens the folder with the opener the request
names, times greedy generation, computes teacher-forced logits over the text chunks when the
runtime gives logits, and writes ``result.json`` (and ``logits_<i>.npy``) into the request's
``out_dir``. It runs alone in its process so ``peak_rss_bytes`` is that runtime's own peak; the
parent (:func:`hfexport.bench.run.bench_folders`) reads the result.

Timing (wall clock, ``time.perf_counter``, after one warm-up generation; the best of ``runs``,
the least disturbed run on a shared machine):
- ``prefill_ms``: time to the first new token: prompt processing plus one sampling step, the
  time-to-first-token a user waits.
- ``decode_tokens_per_s``: ``(n - 1) / (t_n - t_1)``: the steady decode rate, prefill excluded.
  A runtime whose opened folder has ``timed_generate(ids, n) -> (tokens, t_1, t_n)`` times both
  in one generation; otherwise ``t_1`` and ``t_n`` come from ``generate(ids, 1)`` and
  ``generate(ids, n)``; when that difference is not positive (a tiny model, a noisy machine), the
  rate over the whole ``generate(ids, n)`` is reported instead (a lower bound).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _best_time(fn: Any, runs: int) -> tuple[float, Any]:
    """The fastest of ``runs`` calls (seconds) and the last result: on a shared machine the
    minimum is the least disturbed run."""
    times, result = [], None
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes: ``VmHWM`` of ``/proc/self/status`` (the high-water
    mark of its own address space, new at ``exec``), else ``ru_maxrss``. Linux carries ``ru_maxrss``
    across ``exec`` from the parent that forked the child, so a child started by a process holding
    1.4 GB would report at least that."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request (see the module docstring); returns the result dict it also writes.

    Args:
        request: ``opener`` ("module:function"), ``folder``, ``threads``, ``prompt_ids`` (list of
            int), ``new_tokens``, ``runs``, ``text_chunks`` (list of lists of int; may be empty),
            ``out_dir``; for the eager reference, ``opener`` opens a model spec as the folder.

    Returns:
        ``load_s``, ``prefill_ms``, ``decode_tokens_per_s``, ``tokens`` (new ids of one greedy
        run), ``peak_rss_bytes`` (after generation, before logits), ``logits_files`` (``None``
        when the runtime gives no logits), ``logits_note`` and, from an opener that tokenizes
        (the eager reference), whatever it adds under ``extra``.
    """
    from hfexport.bench.runtimes import load_opener

    out_dir = Path(request["out_dir"])
    threads = int(request.get("threads", 2))
    start = time.perf_counter()
    opened = load_opener(request["opener"])(Path(request["folder"]), threads)
    result: dict[str, Any] = {"load_s": round(time.perf_counter() - start, 3)}
    prompt = list(request["prompt_ids"])
    new_tokens = int(request["new_tokens"])
    runs = int(request.get("runs", 3))
    opened.generate(prompt, min(2, new_tokens))  # warm-up (first-run allocations, kernel caches)
    decode = 0.0
    if hasattr(opened, "timed_generate"):  # the runtime times its own first token
        timings = [opened.timed_generate(prompt, new_tokens) for _ in range(max(1, runs))]
        tokens = timings[0][0]
        first = min(t[1] for t in timings)
        decode = min(t[2] - t[1] for t in timings)
    if decode <= 0:  # no runtime timing, or one too coarse for a tiny model: time whole calls
        first, _ = _best_time(lambda: opened.generate(prompt, 1), runs)
        total, tokens = _best_time(lambda: opened.generate(prompt, new_tokens), runs)
        # a tiny model's whole generation can take less than the noise between two calls: then the
        # rate over the whole generation (prefill included, a lower bound on the decode rate)
        decode = total - first if total > first else total
    made = len(tokens)
    result["prefill_ms"] = round(first * 1e3, 2)
    result["decode_tokens_per_s"] = round((made - 1) / decode, 2) if made > 1 and decode > 0 else None
    result["tokens"] = [int(t) for t in tokens]
    result["peak_rss_bytes"] = peak_rss_bytes()
    files: list[str] | None = []
    for i, chunk in enumerate(request.get("text_chunks") or []):
        logits = opened.logits(chunk)
        if logits is None:
            files = None
            break
        import numpy as np

        path = out_dir / f"logits_{i}.npy"
        np.save(path, np.asarray(logits, dtype=np.float32))
        files.append(str(path))
    result["logits_files"] = files
    result["logits_note"] = str(getattr(opened, "logits_note", "") or "")
    result["extra"] = dict(getattr(opened, "extra", {}) or {})
    (out_dir / "result.json").write_text(json.dumps(result), encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m hfexport.bench.child REQUEST.json``; exit 0, or 1 with the error
    written to ``error.txt`` next to the request."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0])
    request = json.loads(path.read_text(encoding="utf-8"))
    try:
        measure(request)
    except Exception as exc:  # reported by the parent in the table
        (Path(request["out_dir"]) / "error.txt").write_text(f"{type(exc).__name__}: {exc}", encoding="utf-8")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
