"""Latency of several ONNX graphs in ONNX Runtime, measured as interleaved rounds.

On a shared machine a graph timed after another sees different load; alternating them round by
round and taking the median of each graph's per-round medians makes ratios comparable.

    python benchmarks/ort_interleaved.py --threads 1 --rounds 15 --mode decode a.onnx b.onnx ...
    python benchmarks/ort_interleaved.py --threads 2 --feed minilm_8x64.npz ours.onnx reference.onnx

``--feed FILE.npz`` runs every graph on the arrays saved under its input names (an encoder's
``input_ids`` / ``attention_mask`` / ``token_type_ids``, e.g. the MiniLM deploy table's 8 x 64
sentences) instead of the decoder feeds below.

Feeds by conventional name (``input_ids``, ``attention_mask``, ``position_ids``, ``cache_position``;
every float input is a KV-cache tensor ``[1, kv_heads, past, head_dim]``): ``decode`` is one token
after a ``--past``-token cache, ``prefill`` ``--prompt`` tokens on an empty cache. Prints one JSON
object per graph (median ms, per-round medians) and its ratio to the first graph: of the medians
(``x_first``) and the median of the per-round ratios (``x_first_paired``, robust to load changing
between rounds; use many short rounds, e.g. ``--rounds 100 --runs 3``). Rounds alternate their
order (first to last, then last to first). ``--cpu-time`` turns ORT's thread spinning off and
also reports the process CPU time per run (``cpu_ms``, ``cpu_x_first_paired``), which a loaded
machine disturbs less than wall time. Give one graph twice (a copy under another path) to see the
noise floor: on a 540 MB decoder graph the order in which the sessions were created moved a copy
by up to 20% (memory placement), on all-MiniLM-L6-v2 by 0.2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _feed(session, sequence: int, past: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feed = {}
    for i in session.get_inputs():
        name = i.name
        if "input_ids" in name:
            feed[name] = rng.integers(3, 1000, (1, sequence)).astype(np.int64)
        elif "attention_mask" in name:
            feed[name] = np.ones((1, past + sequence), np.int64)
        elif "position_ids" in name:
            feed[name] = np.arange(past, past + sequence, dtype=np.int64)[None]
        elif "cache_position" in name:
            feed[name] = np.arange(past, past + sequence, dtype=np.int64)
        elif "float" in i.type:
            feed[name] = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
        else:
            raise SystemExit(f"input {name} ({i.type}) has no feed")
    return feed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("graphs", nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per graph and round")
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--feed", help="an .npz of arrays named like the graphs' inputs (encoder graphs)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="no thread spinning; also report CPU time per run"
    )
    args = parser.parse_args(argv)
    saved = np.load(args.feed) if args.feed else None

    import onnxruntime as ort

    sessions = []
    for path in args.graphs:
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        if args.cpu_time:  # a spinning thread burns CPU time while it waits
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        sequence, past = (1, args.past) if args.mode == "decode" else (args.prompt, 0)
        if saved is not None:
            missing = [i.name for i in session.get_inputs() if i.name not in saved]
            if missing:
                raise SystemExit(f"{path}: inputs {missing} are not in {args.feed} (it has {sorted(saved)})")
            feed = {i.name: saved[i.name] for i in session.get_inputs()}
        else:
            feed = _feed(session, sequence, past, args.kv_heads, args.head_dim)
        for _ in range(3):  # warm-up, excluded
            session.run(None, feed)
        sessions.append((session, feed))
    rounds: list[list[float]] = [[] for _ in sessions]
    cpu_rounds: list[list[float]] = [[] for _ in sessions]
    for r in range(args.rounds):
        order = list(enumerate(sessions))
        for i, (session, feed) in order if r % 2 == 0 else order[::-1]:
            times, cpu = [], []
            for _ in range(args.runs):
                start, start_cpu = time.perf_counter(), time.process_time()
                session.run(None, feed)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            rounds[i].append(statistics.median(times) * 1e3)
            cpu_rounds[i].append(statistics.median(cpu) * 1e3)
    medians = [statistics.median(r) for r in rounds]
    for path, median, per_round, per_round_cpu in zip(args.graphs, medians, rounds, cpu_rounds):
        row = {
            "graph": path,
            "median_ms": round(median, 3),
            "x_first": round(median / medians[0], 3),
            # median over rounds of this graph's time / the first graph's in the same round
            "x_first_paired": round(statistics.median(t / b for t, b in zip(per_round, rounds[0])), 3),
        }
        if args.cpu_time:
            row["cpu_ms"] = round(statistics.median(per_round_cpu), 3)
            row["cpu_x_first_paired"] = round(
                statistics.median(t / b for t, b in zip(per_round_cpu, cpu_rounds[0])), 3
            )
        row["rounds_ms"] = [round(t, 2) for t in per_round]
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
