"""``hfexport bench FOLDER [FOLDER ...]``: export folders measured in their own runtimes, side by side.

Each folder (ours, or a runtime builder's output) is opened by the runtime that reads its shape
(:mod:`hfexport.bench.runtimes`: ONNX Runtime GenAI, OpenVINO GenAI, ExecuTorch's LLM runner,
hfexport's generation runner; backends register theirs), in its own process, and measured the same
way: time to the first token, decode tokens per second, peak memory, size, greedy tokens against
the eager model and the language-model text metrics of :mod:`hfexport.quality` (perplexity ratio,
KL divergence, top-1 agreement) against the eager fp32 checkpoint.
"""

from __future__ import annotations

from hfexport.bench.run import DEFAULT_PROMPT, BenchRow, bench_folders, folder_size_bytes, render_table
from hfexport.bench.runtimes import (
    HFEXPORT_GENERATION,
    FolderRuntime,
    OpenedFolder,
    folder_runtimes,
    register_folder_runtime,
    runtime_for,
)

__all__ = [
    "DEFAULT_PROMPT",
    "HFEXPORT_GENERATION",
    "BenchRow",
    "FolderRuntime",
    "OpenedFolder",
    "bench_folders",
    "folder_runtimes",
    "folder_size_bytes",
    "register_folder_runtime",
    "render_table",
    "runtime_for",
]
