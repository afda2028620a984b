"""ONNX Runtime GenAI as an ``hfexport bench`` folder runtime.

Claims any folder with a ``genai_config.json`` (our ``--layout genai`` export and the output of
ONNX Runtime GenAI's own model builder alike) and runs it with ``onnxruntime_genai`` alone:
``og.Model(folder)``, a greedy ``og.Generator``, and for the text metrics the ``logits`` output
of one ``append_tokens`` prefill (``generator.get_output("logits")``, ``[1, seq, vocab]``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfexport.bench.runtimes import FolderRuntime, per_position_logits, register_folder_runtime


def claims(folder: Path) -> bool:
    """True for a folder ``onnxruntime_genai.Model`` reads (it holds ``genai_config.json``)."""
    return (folder / "genai_config.json").is_file()


class GenaiFolder:
    """One ``genai_config.json`` folder opened with ``onnxruntime_genai``."""

    logits_note = ""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self._og = og
        config = og.Config(str(folder))
        # the decoder session's intra-op threads, as every runtime of the table gets
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}})
        )
        self.model = og.Model(config)

    def _generator(self, max_length: int) -> Any:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=max_length)
        return self._og.Generator(self.model, params)

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy new token ids (at most ``max_new_tokens``)."""
        import numpy as np

        generator = self._generator(len(ids) + max_new_tokens)
        generator.append_tokens(np.asarray([list(ids)], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return [int(t) for t in generator.get_sequence(0)][len(ids) :]

    def timed_generate(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy generation timed in one run: ``(new ids, seconds to the first, seconds to the last)``."""
        import time

        import numpy as np

        generator = self._generator(len(ids) + max_new_tokens)
        start = time.perf_counter()
        generator.append_tokens(np.asarray([list(ids)], dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter() - start
        while not generator.is_done():
            generator.generate_next_token()
        total = time.perf_counter() - start
        return [int(t) for t in generator.get_sequence(0)][len(ids) :], first, total

    def logits(self, ids: Sequence[int]) -> Any:
        """Logits of one prefill over ``ids``: float32 ``[len(ids), vocab]``, or ``None`` (and a
        note) when the graph returns only the last position."""
        import numpy as np

        generator = self._generator(len(ids))
        generator.append_tokens(np.asarray([list(ids)], dtype=np.int32))
        logits, note = per_position_logits(generator.get_output("logits"), len(ids))
        self.logits_note = note
        return logits


def open_folder(folder: Path, threads: int) -> GenaiFolder:
    """Opener of :data:`ONNXRUNTIME_GENAI`."""
    return GenaiFolder(folder, threads)


#: ONNX Runtime GenAI folders (``--layout genai``, ``onnxruntime_genai.models.builder`` output)
ONNXRUNTIME_GENAI = register_folder_runtime(
    FolderRuntime(
        name="onnxruntime-genai",
        description="a folder with genai_config.json, run by onnxruntime_genai.Model",
        claims="hfexport_onnx.bench_runtime:claims",
        opener="hfexport_onnx.bench_runtime:open_folder",
        priority=10,
    )
)
