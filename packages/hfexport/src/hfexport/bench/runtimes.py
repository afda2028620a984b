"""The runtimes ``hfexport bench`` opens folders in: a registry of folder shapes and their openers.

A *folder runtime* recognises one folder shape (ONNX Runtime GenAI's ``genai_config.json`` folder,
OpenVINO GenAI's stateful IR folder, ExecuTorch's ``TextLLMRunner`` ``.pte``, hfexport's own
generation folder ...) and opens it in that runtime's own API. It does not care who wrote the
folder: the runtime builders' output (``onnxruntime_genai.models.builder``, optimum-intel,
ExecuTorch ``export_llm``) is benchmarked by the same opener as ours, which is what makes the
table side by side.

Backends register theirs when imported (next to their layouts); the core registers the one for
its own generation folders (:data:`HFEXPORT_GENERATION`). Claims are cheap file checks run in the
parent; the opener is a lazy ``"module:function"`` imported only in the measuring child process,
so the child's peak memory holds that runtime alone.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "HFEXPORT_GENERATION",
    "FolderRuntime",
    "OpenedFolder",
    "folder_runtimes",
    "import_installed_backends",
    "load_opener",
    "per_position_logits",
    "register_folder_runtime",
    "resolve",
    "runtime_for",
]


class OpenedFolder(Protocol):
    """A folder opened in its runtime (what a :attr:`FolderRuntime.opener` returns).

    Attributes:
        logits_note: why :meth:`logits` returns ``None`` for this folder ("" when it does not).
    """

    logits_note: str

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy generation from the prompt ``ids`` (one sequence); returns the new token ids only
        (at most ``max_new_tokens``; fewer when an end-of-sequence token came first)."""

    def logits(self, ids: Sequence[int]) -> Any:
        """Teacher-forced next-token logits of one prefill over ``ids``: a float32 numpy array
        ``[len(ids), vocab]``, or ``None`` when the runtime's API gives no logits."""


@dataclass(frozen=True)
class FolderRuntime:
    """One runtime ``hfexport bench`` can open a folder in.

    Attributes:
        name: the runtime's name in the table (``"onnxruntime-genai"``).
        description: one line for ``hfexport bench --help`` and errors.
        claims: ``(folder: Path) -> bool``, or a lazy ``"module:function"``: True when the folder
            has this runtime's shape. Runs in the parent; must not import the runtime.
        opener: ``(folder: Path, threads: int) -> OpenedFolder``, or a lazy ``"module:function"``
            (imported in the measuring child only).
        priority: claims are tried from the highest priority down (a specific shape before a
            generic one); ties in registration order.
    """

    name: str
    description: str
    claims: Callable[[Path], bool] | str
    opener: Callable[[Path, int], OpenedFolder] | str
    priority: int = 0


_RUNTIMES: dict[str, FolderRuntime] = {}


def resolve(target: Any) -> Any:
    """A callable as it is, or the attribute a ``"module:function"`` string names (imported now).

    Raises:
        ValueError: a string without ``":"``.
        ImportError / AttributeError: the module or attribute does not exist.
    """
    if callable(target):
        return target
    module, sep, attr = str(target).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{target!r} is not a 'module:function' reference")
    return getattr(importlib.import_module(module), attr)


def load_opener(reference: str) -> Any:
    """The opener a ``"package.module:function"`` names, imported WITHOUT running the package's
    ``__init__`` when the package is not imported yet: a backend's ``__init__`` imports torch and
    its exporter, which would inflate the measuring child's peak memory with what the runtime
    itself never loads. The module is loaded from its file under a private name; it may import
    the core (:mod:`hfexport.bench.runtimes`) and its runtime only.

    Raises:
        ValueError: not a ``"module:function"`` reference.
        ImportError: the module's file cannot be found.
        AttributeError: the function is not in the module.
    """
    import importlib.util
    import sys

    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{reference!r} is not a 'module:function' reference")
    top, _, rest = module_name.partition(".")
    if not rest or top in sys.modules or top == "hfexport":
        return resolve(reference)
    package = importlib.util.find_spec(top)  # a top-level find_spec does not run the package
    if package is None or not package.submodule_search_locations:
        raise ImportError(f"cannot find the package {top!r} of the bench opener {reference!r}")
    base = Path(next(iter(package.submodule_search_locations))).joinpath(*rest.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        raise ImportError(f"cannot find {module_name} ({path}) for the bench opener {reference!r}")
    spec = importlib.util.spec_from_file_location(f"_hfexport_bench_{top}_{rest.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attr)


def per_position_logits(logits: Any, positions: int) -> tuple[Any, str]:
    """A runtime's logits output as ``[positions, vocab]`` float32, or why it is not.

    Args:
        logits: the array a runtime returned for one prefill (``[1, seq, vocab]`` or ``[seq, vocab]``).
        positions: the number of tokens prefilled.

    Returns:
        ``(array, "")``, or ``(None, note)`` when the output holds fewer rows than ``positions``
        (a graph that returns the last position's logits only).
    """
    import numpy as np

    array = np.asarray(logits, dtype=np.float32)
    array = array.reshape(-1, array.shape[-1])
    if array.shape[0] != positions:
        return None, f"the artifact returns logits for {array.shape[0]} of {positions} positions"
    return array, ""


def register_folder_runtime(runtime: FolderRuntime) -> FolderRuntime:
    """Add ``runtime`` to the table (a later registration of the same name replaces it).

    Returns:
        ``runtime``, so a module can keep it as a constant.

    Raises:
        TypeError: ``runtime`` is not a :class:`FolderRuntime`.
    """
    if not isinstance(runtime, FolderRuntime):
        raise TypeError(f"register_folder_runtime takes a FolderRuntime, got {type(runtime).__name__}")
    _RUNTIMES[runtime.name] = runtime
    return runtime


def folder_runtimes() -> list[FolderRuntime]:
    """The registered runtimes, highest priority first."""
    ordered = list(_RUNTIMES.values())
    return sorted(ordered, key=lambda r: -r.priority)


def import_installed_backends() -> dict[str, str]:
    """Import every installed backend (entry-point group ``hfexport.exporters``), so the folder
    runtimes they register are in the table.

    Returns:
        ``{format: why it failed to import}`` for the backends that did not import (the others
        registered their runtimes); an empty dict when all did.
    """
    from hfexport.auto import available_export_formats, get_hf_exporter

    failed: dict[str, str] = {}
    for name in available_export_formats():
        try:
            get_hf_exporter(name)
        except Exception as exc:  # a broken optional backend must not stop the others
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def runtime_for(folder: str | Path, name: str | None = None) -> FolderRuntime:
    """The runtime that opens ``folder``: the one named ``name``, else the first that claims it.

    Raises:
        FileNotFoundError: ``folder`` is not a folder.
        ValueError: ``name`` is not registered, or no registered runtime claims the folder (the
            message lists the runtimes and what each opens).
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder; hfexport bench takes export folders")
    known = folder_runtimes()
    listing = "; ".join(f"{r.name}: {r.description}" for r in known) or "none registered"
    if name is not None:
        for runtime in known:
            if runtime.name == name:
                return runtime
        raise ValueError(f"no folder runtime named {name!r}; registered: {listing}")
    for runtime in known:
        if resolve(runtime.claims)(path):
            return runtime
    files = ", ".join(sorted(p.name for p in path.iterdir())[:12]) or "nothing"
    raise ValueError(
        f"no installed runtime opens {path} (it holds: {files}); registered runtimes: {listing}. "
        "hfexport bench runs generation folders (hfexport export FORMAT --task text-generation, or a "
        "--layout for a runtime's own loader); for another folder shape, install the backend package "
        "whose runtime reads it"
    )


def _is_generation_folder(folder: Path) -> bool:
    from hfexport.folder import MANIFEST_NAME

    path = folder / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


class _GenerationFolder:
    """hfexport's own generation folder (``save_components``) run by its generation runner."""

    logits_note = ""

    def __init__(self, folder: Path, threads: int) -> None:
        import torch

        from hfexport.generation import load_runner

        torch.set_num_threads(max(1, int(threads)))
        self.runner = load_runner(folder)

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        import torch

        prompt = torch.as_tensor([list(ids)], dtype=torch.int64)
        with torch.no_grad():
            out = self.runner.generate(prompt, max_new_tokens=max_new_tokens)
        return [int(t) for t in out[0, prompt.shape[1] :].tolist()]

    def logits(self, ids: Sequence[int]) -> Any:
        import torch

        prompt = torch.as_tensor([list(ids)], dtype=torch.int64)
        with torch.no_grad():
            logits = self.runner.prefill_logits(prompt)
        return logits[0].float().numpy()


def _open_generation_folder(folder: Path, threads: int) -> OpenedFolder:
    return _GenerationFolder(folder, threads)


#: hfexport's own generation folders (``hfexport export FORMAT --task text-generation``), any backend.
HFEXPORT_GENERATION = register_folder_runtime(
    FolderRuntime(
        name="hfexport",
        description="a generation folder written by hfexport (its generation manifest), run by hfexport.generation",
        claims=_is_generation_folder,
        opener=_open_generation_folder,
        priority=-10,
    )
)
