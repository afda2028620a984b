"""Whole-library sweep: tiny model of every model type, exported on every backend; writes docs/coverage.md.

Run with ``nox -s zoo -- [--families causal-lm] [--backends dynamo,onnx] [--types llama,granite]
[--jobs 2] [--limit 10] [--timeout 300]`` or ``uv run python benchmarks/zoo_sweep.py ...``.
The logic lives in :mod:`hfexport.testing.sweep`; results go to ``.bench/zoo/*.json`` (gitignored).
"""

from __future__ import annotations

from pathlib import Path

from hfexport.testing.sweep import main

if __name__ == "__main__":
    raise SystemExit(main(root=Path(__file__).resolve().parents[1]))
