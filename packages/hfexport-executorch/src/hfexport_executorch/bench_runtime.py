"""ExecuTorch's LLM runner as an ``hfexport bench`` folder runtime.

Claims a folder with ``model.pte`` and ``tokenizer.json`` (our ``--layout llm-runner`` export, or
``export_llm``'s ``.pte`` put next to its tokenizer) and generates with ExecuTorch's own
``TextLLMRunner`` (greedy, temperature 0). The runner takes text, so the prompt ids are decoded
with the folder's tokenizer and re-encoded by the runner; the generated ids are recovered from
the pieces it streams. Times come from the runner's own ``Stats`` (first token, inference end).
Text metrics run the program's ``forward(tokens, input_pos)`` in ``executorch.runtime`` over
each chunk from position 0, with a freshly loaded method (empty KV cache) per chunk, one token
per step when the program returns the last position's logits only.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfexport.bench.runtimes import FolderRuntime, register_folder_runtime


def claims(folder: Path) -> bool:
    """True for a folder ``TextLLMRunner`` loads: ``model.pte`` next to ``tokenizer.json``, and, when
    the folder has hfexport's ``export_report.json``, written with ``--layout llm-runner`` (a plain
    ExecuTorch export has ``model.pte`` too, but not the runner's ``forward(tokens, input_pos)``)."""
    if not ((folder / "model.pte").is_file() and (folder / "tokenizer.json").is_file()):
        return False
    report = folder / "export_report.json"
    if not report.is_file():
        return True  # a folder another tool wrote (export_llm's .pte beside its tokenizer)
    try:
        return json.loads(report.read_text(encoding="utf-8")).get("layout") == "llm-runner"
    except (OSError, ValueError, AttributeError):
        return False


def _llm_runner_module() -> Any:
    """ExecuTorch's compiled ``_llm_runner`` extension, loaded directly (the Python package
    around it imports torch's export stack, which the runner itself never uses)."""
    import torch  # noqa: F401  (the extension links libtorch)

    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("executorch is not installed; pip install hfexport-executorch")
    base = Path(next(iter(spec.submodule_search_locations))) / "extension" / "llm" / "runner"
    so = next((f for f in os.listdir(base) if f.startswith("_llm_runner") and f.endswith(".so")), None)
    if so is None:
        raise ImportError(f"executorch has no compiled LLM runner in {base}")
    loader = importlib.machinery.ExtensionFileLoader("_llm_runner", str(base / so))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_llm_runner", loader))
    loader.exec_module(module)
    return module


def _register_custom_op_kernels(pte: Path) -> list[str]:
    """Register ExecuTorch's LLM custom-op kernels (``llama::*``) in this process when the program
    calls them: the wheel's runtime starts without them (ours with the custom ops and ``export_llm``'s
    programs both call them). Loads ``libcustom_ops_aot_lib`` from the executorch install with
    ``torch.ops.load_library`` (it registers the kernels in the ``_portable_lib`` that
    ``TextLLMRunner`` links); self-contained, as this module is loaded from its file in the
    measuring child (:func:`hfexport.bench.runtimes.load_opener`).

    Returns:
        The ``llama::`` operators the program names (``[]``: nothing loaded).

    Raises:
        RuntimeError: the program calls ``llama::`` kernels and the library is not in the install.
    """
    import mmap
    import re

    import torch

    with open(pte, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        needed = sorted({m.group(0).decode() for m in re.finditer(rb"llama::[A-Za-z0-9_]+", data)})
    if not needed:
        return []
    spec = importlib.util.find_spec("executorch")
    base = Path(next(iter(spec.submodule_search_locations or ()))) if spec else None
    ops = base / "extension" / "llm" / "custom_ops" if base else None
    libs = sorted(ops.glob("*custom_ops_aot_lib.*")) if ops and ops.is_dir() else []
    if not libs:
        raise RuntimeError(
            f"{pte} calls {', '.join(needed)}, and this executorch install has no "
            "extension/llm/custom_ops/libcustom_ops_aot_lib to register them; re-export with --no-custom-ops"
        )
    torch.ops.load_library(str(libs[0]))
    return needed


class LlmRunnerFolder:
    """One ``model.pte`` + ``tokenizer.json`` folder opened with ``TextLLMRunner``."""

    logits_note = ""

    def __init__(self, folder: Path, threads: int) -> None:
        from tokenizers import Tokenizer

        self._folder = folder
        self._module = _llm_runner_module()
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # a copy without a decoder streams raw pieces, which map back to ids one to one
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        data["decoder"] = None
        self._plain_dir = tempfile.mkdtemp(prefix="hfexport-bench-tok-")
        plain = Path(self._plain_dir) / "tokenizer.json"
        plain.write_text(json.dumps(data), encoding="utf-8")
        ids_of = dict(data["model"]["vocab"])
        ids_of.update({t["content"]: t["id"] for t in data.get("added_tokens") or ()})
        self._ids_of = ids_of
        _register_custom_op_kernels(folder / "model.pte")
        self.runner = self._module.TextLLMRunner(str(folder / "model.pte"), str(plain))

    def timed_generate(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy generation timed by the runner's ``Stats``: ``(new ids, seconds to the first
        token, seconds of the whole generation)``."""
        pieces: list[str] = []
        stats: list[Any] = []
        config = self._module.GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=0.0)
        self.runner.reset()
        self.runner.generate(self._tokenizer.decode(list(ids)), config, pieces.append, stats.append)
        stat = stats[-1]
        first = (stat.first_token_ms - stat.inference_start_ms) / 1e3
        total = (stat.inference_end_ms - stat.inference_start_ms) / 1e3
        return [int(self._ids_of[p]) for p in pieces if p in self._ids_of], first, total

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy new token ids (at most ``max_new_tokens``)."""
        return self.timed_generate(ids, max_new_tokens)[0]

    def logits(self, ids: Sequence[int]) -> Any:
        """Teacher-forced logits over ``ids`` (float32 ``[len(ids), vocab]``) from the program's
        ``forward(tokens, input_pos)``: one prefill when it returns every position's logits,
        else one decode step per token (the runner's programs return the last position only)."""
        import numpy as np
        import torch
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(str(self._folder / "model.pte"))
        method = program.load_method("forward")  # a fresh method: an empty KV cache
        tokens = torch.tensor([list(ids)], dtype=torch.long)
        logits = method.execute([tokens, torch.tensor([0], dtype=torch.long)])[0].float().numpy()
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] == len(ids):
            return np.asarray(logits, dtype=np.float32)
        method = program.load_method("forward")
        rows = [
            method.execute([tokens[:, i : i + 1], torch.tensor([i], dtype=torch.long)])[0]
            .float()
            .numpy()
            .reshape(-1)
            for i in range(len(ids))
        ]
        return np.stack(rows).astype(np.float32)


def open_folder(folder: Path, threads: int) -> LlmRunnerFolder:
    """Opener of :data:`EXECUTORCH_LLM_RUNNER` (``threads`` is the runner's default pool)."""
    return LlmRunnerFolder(folder, threads)


#: ExecuTorch TextLLMRunner folders (``--layout llm-runner``)
EXECUTORCH_LLM_RUNNER = register_folder_runtime(
    FolderRuntime(
        name="executorch-llm-runner",
        description="model.pte + tokenizer.json, run by ExecuTorch's TextLLMRunner",
        claims="hfexport_executorch.bench_runtime:claims",
        opener="hfexport_executorch.bench_runtime:open_folder",
        priority=10,
    )
)
