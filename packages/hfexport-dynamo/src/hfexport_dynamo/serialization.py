"""Save and load ``ExportedProgram`` files (``.pt2``) without trusting pickles.

:func:`save` writes with ``torch.export.save`` atomically; when the program's sample inputs hold
objects the weights-only unpickler refuses (a ``DynamicCache`` among the traced inputs), they are
left out of the file, so every ``.pt2`` this package writes loads with ``weights_only`` semantics:
plain ``torch.export.load`` never needs its silent ``weights_only=False`` fallback for them.

:func:`load` verifies the file against a ``checksums.sha256`` next to it
(:func:`hfexport.integrity.verify_file`), refuses a corrupt or ambiguous archive
(:func:`hfexport_dynamo.safety.check_archive`), registers the cache pytree nodes and the custom
operators a program may use, refuses an archive whose content could run code
(:func:`hfexport_dynamo.safety.inspect_pt2`) unless the caller passes ``trust_remote_code=True``,
and then reads it with ``torch.export.load`` under
:func:`hfexport_dynamo.safety.weights_only_loading` (no full unpickling can happen).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from hfexport.atomic import atomic_path
from hfexport.pytree import register_cache_pytrees
from hfexport.registry import apply_patches
from hfexport_dynamo.errors import ArtifactLoadError, CorruptArtifactError, UnsafeArtifactError
from hfexport_dynamo.flat_io import flat_program_io
from hfexport_dynamo.safety import check_archive, inspect_pt2, weights_only_loading
from hfexport_dynamo.workarounds import patches as _patches

__all__ = ["load", "save"]

logger = logging.getLogger(__name__)

# custom-operator namespace -> module whose import registers its operators
_OP_PROVIDERS: dict[str, str] = {
    "transformers": "transformers.integrations.moe",
    "transformers_msa": "transformers.integrations.msa_attention",
}
_OP_TARGET = re.compile(r"torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")


def _weights_only_loadable(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


@contextlib.contextmanager
def _portable_sample_inputs(program: torch.export.ExportedProgram) -> Iterator[bool]:
    """Leave the sample inputs out while saving when weights-only loading would refuse them.

    Yields whether they were left out. The program is untouched after the block.
    """
    original = getattr(program, "_example_inputs", None)
    if original is None or _weights_only_loadable(original):
        yield False
        return
    program._example_inputs = None
    try:
        yield True
    finally:
        program._example_inputs = original


def _keyword_only(program: torch.export.ExportedProgram) -> bool:
    spec = program.module_call_graph[0].signature
    in_spec = spec.in_spec if spec is not None else None
    return (
        in_spec is not None
        and in_spec.type is tuple
        and in_spec.num_children == 2
        and in_spec.child(0).num_children == 0
        and in_spec.child(1).type is dict
    )


def save(program: torch.export.ExportedProgram, path: str | os.PathLike[str]) -> Path:
    """Write ``program`` to ``path`` (``.pt2``) atomically with ``torch.export.save``.

    The file is written next to ``path`` under a temporary name and renamed onto it once
    complete: a failure leaves no partial file and an existing ``path`` untouched. A program taking
    keyword inputs is written with flat inputs and outputs (:func:`hfexport_dynamo.flat_io.flat_program_io`:
    caches and model outputs become named tensor leaves, so stock ``torch.export.load`` runs the
    file in a process that imports only torch); ``program`` itself is unchanged. Sample inputs
    that the weights-only unpickler would refuse (caches among the traced inputs) are not stored,
    so the file loads without full unpickling, with :func:`load` as with ``torch.export.load``.

    Args:
        program: the ``torch.export.ExportedProgram`` to write.
        path: destination; must end with ``.pt2`` (``torch.export.load`` expects it).

    Returns:
        The destination as a ``Path``.

    Raises:
        TypeError: ``program`` is not an ``ExportedProgram``.
        ValueError: ``path`` does not end with ``.pt2``.
    """
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"save expects a torch.export.ExportedProgram, got {type(program).__name__}")
    target = Path(path)
    if target.suffix != ".pt2":
        raise ValueError(
            f"an ExportedProgram file must end with .pt2, got {target.name!r}; e.g. {target.stem}.pt2"
        )
    register_cache_pytrees()
    flat = flat_program_io(program) if _keyword_only(program) else contextlib.nullcontext()
    with flat, _portable_sample_inputs(program) as dropped, atomic_path(target) as tmp:
        if dropped:
            logger.debug("sample inputs of %s hold objects weights-only loading refuses; not stored", target)
        # each weight is written from its storage, not through two whole-tensor copies
        with open(tmp, "wb") as handle, apply_patches(_patches.SAVE_KEY):
            torch.export.save(program, handle)
    return target


def _program_documents(file: IO[bytes]) -> list[Any]:
    file.seek(0)
    documents = []
    with zipfile.ZipFile(file) as zf:
        for name in zf.namelist():
            parts = name.split("/")
            if len(parts) == 3 and parts[1] == "models" and parts[2].endswith(".json"):
                documents.append(json.loads(zf.read(name)))
    return documents


def _strings_under(value: Any, keys: frozenset[str]) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key in keys and isinstance(child, str):
                    yield child
                else:
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _treespec_types(spec_text: str) -> Iterator[str]:
    try:
        spec = json.loads(spec_text)
    except ValueError:
        return
    yield from _strings_under(spec, frozenset({"type"}))


def _register_dependencies(file: IO[bytes]) -> None:
    """Import what a program needs before deserialising: custom operators and model cache classes.

    Only modules of the ``transformers`` package are imported (operator providers listed in
    ``_OP_PROVIDERS`` and modeling files defining a ``Cache`` subclass the in/out specs name).
    """
    import torch.utils._pytree as pytree

    for document in _program_documents(file):
        for target in set(_strings_under(document, frozenset({"target"}))):
            match = _OP_TARGET.match(target)
            if match is None or match.group(1) not in _OP_PROVIDERS:
                continue
            namespace, op = match.groups()
            if not hasattr(getattr(torch.ops, namespace), op):
                with contextlib.suppress(ImportError):
                    importlib.import_module(_OP_PROVIDERS[namespace])
        for spec_text in set(_strings_under(document, frozenset({"in_spec", "out_spec"}))):
            for type_name in _treespec_types(spec_text):
                if type_name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE or not type_name.startswith(
                    "transformers."
                ):
                    continue
                module_name = type_name.rsplit(".", 1)[0]
                with contextlib.suppress(ImportError):
                    importlib.import_module(module_name)
    register_cache_pytrees()


class _CaptureLoadErrors(logging.Handler):
    """Collect the exception ``torch.export.load`` logs before retrying the legacy format."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


def load(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> torch.export.ExportedProgram:
    """Load an ``ExportedProgram`` written by :func:`save` (or ``torch.export.save``).

    Registers the cache pytree nodes (so programs taking or returning ``DynamicCache``,
    ``EncoderDecoderCache``... load) and imports the transformers modules providing custom
    operators the graph calls (``transformers::grouped_mm_fallback`` of mixture-of-experts layers)
    or cache classes its input/output specs name.

    Always, before torch reads anything:

    - when a ``checksums.sha256`` sits next to the file and lists it, the file's SHA-256 must
      match (:func:`hfexport.integrity.verify_file`; without one a warning is logged once per
      folder and loading proceeds);
    - the archive must be a readable zip that every zip reader reads the same way
      (:func:`hfexport_dynamo.safety.check_archive`): no duplicate member names, no names
      torch's reader would confuse, no hidden bytes, every member passing its CRC check.

    Unless ``trust_remote_code`` is True, the archive is then inspected without executing
    anything (:func:`hfexport_dynamo.safety.inspect_pt2`, reading members through torch's own
    reader) and refused when it holds content that could run code: pickles the weights-only
    unpickler refuses (``torch.export.load`` would retry them with full unpickling), TorchScript
    or opaque objects, AOTInductor libraries, graph nodes calling non-operators, or guard/shape
    expressions that are not arithmetic. ``torch.export.load`` then runs under
    :func:`hfexport_dynamo.safety.weights_only_loading`, so even content the inspection missed
    cannot reach full unpickling.

    Args:
        path: the ``.pt2`` file.
        trust_remote_code: skip the inspection and the weights-only guard and let
            ``torch.export.load`` unpickle everything. Only for files whose origin you trust:
            unpickling can run arbitrary code. The checksum and archive-structure checks still run.

    Returns:
        The ``ExportedProgram``; ``program.module()(**forward_kwargs)`` runs it.

    Raises:
        FileNotFoundError: no file at ``path``.
        hfexport.errors.IntegrityError: the file's SHA-256 differs from the one ``checksums.sha256``
            next to it records (the message names the file and both digests).
        CorruptArtifactError: not a valid ``torch.export`` archive (truncated, not a zip, a member
            failing its CRC check); the message says to re-export it.
        UnsafeArtifactError: the archive is ambiguous (duplicate member names and the like; also
            with ``trust_remote_code=True``), or the inspection found content that could run code
            (the message lists each finding); nothing from the file was unpickled or executed.
        ArtifactLoadError: torch could not deserialise the file (the message has torch's reason,
            e.g. a custom operator that is not registered or another schema version).
    """
    from hfexport.integrity import verify_file

    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no ExportedProgram file at {source}")
    verify_file(source)
    register_cache_pytrees()
    with open(source, "rb") as handle:
        if trust_remote_code:
            check_archive(handle, path=str(source))
        else:
            problems = inspect_pt2(handle, path=str(source))
            if problems:
                listed = "\n".join(f"  - {p}" for p in problems[:20])
                more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
                raise UnsafeArtifactError(
                    f"refusing to load {source}: it holds content that could run code while loading or running:\n"
                    f"{listed}{more}\nRe-export the model with hfexport_dynamo (its files load without "
                    "unpickling), or pass trust_remote_code=True only if you trust the file's origin.",
                    path=str(source),
                    problems=problems,
                )
        try:
            _register_dependencies(handle)
        except (zipfile.BadZipFile, ValueError) as exc:
            raise CorruptArtifactError(
                f"{source} is not a valid torch.export archive (.pt2): {exc}. The file is truncated or "
                "corrupt: re-export it (or download it again).",
                path=str(source),
                reason=str(exc),
            ) from exc
        handle.seek(0)
        capture = _CaptureLoadErrors()
        torch_logger = logging.getLogger("torch.export")
        torch_logger.addHandler(capture)
        try:
            with apply_patches(_patches.LOAD_KEY) if trust_remote_code else weights_only_loading(str(source)):
                program = torch.export.load(handle)
        except UnsafeArtifactError:
            raise
        except Exception as exc:
            cause = capture.errors[0] if capture.errors else exc
            if isinstance(cause, UnsafeArtifactError):
                raise cause from None
            raise ArtifactLoadError(
                f"torch.export.load could not read {source}: {type(cause).__name__}: {cause}".rstrip()
                + "\nIf a custom operator is missing, import the package that defines it before loading."
            ) from cause
        finally:
            torch_logger.removeHandler(capture)
    return program
