"""Save exported generation components to a folder and run generation from it.

Layout of an output folder::

    prefill.onnx, decode.onnx, ...        one file per component (the backend's own format)
    generation_manifest.json              the manifest (see :data:`MANIFEST_NAME`)
    checksums.sha256                      SHA-256 of every file (``sha256sum -c checksums.sha256``)

The manifest names the format, the component files, the cache kind and length, the special token
ids and the full :class:`~hfexport.generation.plan.GenerationPlan` (component input structures
and output names), so :func:`generate_from_dir` can run greedy generation with nothing but the
folder and the backend package installed.

Backends plug in through their exporter's ``generation_support``
(:class:`hfexport.generation.support.GenerationSupport`): ``component_filename`` and
``component_metadata`` (JSON-safe facts the loader will need, stored per component) at save time,
``load_component`` and ``generation_runner`` at load time. The exporter class that loads a folder is the one registered for the manifest's ``format``
(:func:`hfexport.auto.get_hf_exporter`); nothing named in the manifest is ever imported.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hfexport.folder.contents import MANIFEST_NAME, MANIFEST_VERSION
from hfexport.generation.plan import GenerationPlan
from hfexport.generation.runner import Caller, GenerationRunner

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "generate_from_dir",
    "load_components",
    "load_runner",
    "new_tokens_start",
    "read_manifest",
    "save_components",
]

logger = logging.getLogger(__name__)

# MANIFEST_NAME (the manifest's file name) and MANIFEST_VERSION (its layout's version, bumped on
# incompatible changes) are the export folder's, defined once in hfexport.folder.contents


def save_components(
    exporter: Any,
    artifacts: Mapping[str, Any],
    output_dir: str | os.PathLike[str],
    *,
    model: Any = None,
    plan: GenerationPlan | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write one file per component and ``generation_manifest.json`` as the folder ``output_dir``.

    Args:
        exporter: the ``HfExporter`` that produced ``artifacts`` (its ``save`` writes each file;
            its ``generation_support`` names each file, ``component_filename``, e.g.
            ``decode.onnx``, and gives each component's manifest metadata, ``component_metadata``).
        artifacts: ``{component: artifact}`` as ``export_for_generation`` returns it.
        output_dir: the folder (created if needed). It is replaced as a whole by
            :func:`hfexport.atomic.atomic_output_dir`: once everything was written the new folder
            takes its place (files of an earlier export are gone); on error nothing is left behind
            and the existing folder is untouched. It must be new, empty or a previous export
            (holding ``generation_manifest.json`` or ``export_report.json``) unless ``overwrite``.
        model: the exported model (optional): its generation config refreshes the token ids.
        plan: the generation plan; defaults to ``artifacts.plan``.
        overwrite: replace ``output_dir`` even if it holds other files (they are deleted).

    Returns:
        The paths written (component files, the manifest and ``checksums.sha256``, sorted), in
        their final place.

    Raises:
        ValueError: no plan (``artifacts`` is not what ``export_for_generation`` returned and no
            ``plan`` is given), or the artifacts do not match the plan's components.
        OutputDirectoryError: (a ``ValueError``) ``output_dir`` is a file, not writable, or a
            non-empty folder that is not a previous export and ``overwrite`` is false; checked
            before anything is written.
        OSError: a file cannot be written (nothing is left behind).
    """
    from hfexport.atomic import atomic_output_dir
    from hfexport.generation.decompose import token_ids_of
    from hfexport.integrity import write_checksums

    plan = plan if plan is not None else getattr(artifacts, "plan", None)
    if plan is None:
        raise ValueError(
            "save_components needs the generation plan: pass what export_for_generation returned, or plan="
        )
    if sorted(artifacts) != sorted(plan.components):
        raise ValueError(
            f"artifacts {sorted(artifacts)} do not match the plan's components {plan.components}"
        )
    export_format = str(exporter.export_format or getattr(artifacts, "export_format", ""))
    token_ids = dict(plan.token_ids)
    if model is not None:
        token_ids.update({k: v for k, v in token_ids_of(model).items() if v not in (None, [])})
    target = Path(output_dir)
    files: dict[str, str] = {}
    components: dict[str, dict[str, Any]] = {}
    support = exporter.generation_support
    with atomic_output_dir(target, overwrite=overwrite) as staging:
        for name in plan.components:
            filename = support.component_filename(name)
            exporter.save(artifacts[name], staging / filename)
            files[name] = filename
            components[name] = {"file": filename, "metadata": support.component_metadata(artifacts[name])}
        plan_dict = plan.to_dict()
        plan_dict["token_ids"] = token_ids
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "format": export_format,
            "architecture": plan.architecture,
            "cache": {"kind": plan.cache_kind, "max_cache_len": plan.max_cache_len},
            "token_ids": token_ids,
            "files": files,
            "components": components,
            "plan": plan_dict,
        }
        (staging / MANIFEST_NAME).write_text(
            json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        write_checksums(staging)
        written = sorted(p.relative_to(staging) for p in staging.rglob("*") if p.is_file())
    return [target / p for p in written]


def read_manifest(output_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``generation_manifest.json``.

    Raises:
        FileNotFoundError: the folder has no manifest (it was not written by
            ``hfexport export ... --task text-generation`` / :func:`save_components`).
        ValueError: a manifest that is not a JSON object, of a newer layout, or one naming missing
            component files (the message names the file).
    """
    path = Path(output_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no {MANIFEST_NAME} in {Path(output_dir)}; export with `hfexport export <format> --task "
            "text-generation` or hfexport.generation.save_components first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); it should hold the generation manifest that "
            "save_components writes: re-export the folder"
        ) from None
    if not isinstance(manifest, dict):
        raise ValueError(
            f"{path} holds a JSON {type(manifest).__name__}, not the generation manifest object that "
            "save_components writes: re-export the folder"
        )
    if int(manifest.get("manifest_version", 0)) > MANIFEST_VERSION:
        raise ValueError(
            f"{path} has manifest version {manifest['manifest_version']}, newer than this hfexport reads "
            f"({MANIFEST_VERSION}); upgrade hfexport"
        )
    missing = [f for f in manifest.get("files", {}).values() if not (Path(output_dir) / f).is_file()]
    if missing:
        raise ValueError(f"{path} names component files that are missing: {missing}")
    return manifest


def _exporter_for(manifest: Mapping[str, Any], output_dir: str | os.PathLike[str]) -> Any:
    """An exporter of the manifest's format, from the registered exporters only.

    Raises:
        ValueError: the manifest names no format (or not a string).
        MissingBackendError (an ``ImportError``): no installed backend provides the format; the
            message lists the installed formats (and the pip command for a built-in one).
    """
    from hfexport.auto import available_export_formats, get_hf_exporter
    from hfexport.errors import MissingBackendError

    path = Path(output_dir) / MANIFEST_NAME
    export_format = manifest.get("format")
    if not isinstance(export_format, str) or not export_format:
        raise ValueError(
            f'{path} names no export format ("format": {export_format!r}); export the folder again'
        )
    try:
        cls = get_hf_exporter(export_format)
    except MissingBackendError as exc:
        installed = ", ".join(available_export_formats()) or "none"
        raise MissingBackendError(
            f"{path} was written with export format {export_format!r}, which no installed backend provides "
            f"(installed formats: {installed}): {exc}"
        ) from exc
    return cls()


def load_components(
    output_dir: str | os.PathLike[str], *, exporter: Any = None
) -> tuple[GenerationPlan, dict[str, Caller]]:
    """Load the components saved in ``output_dir`` with their backend.

    Each component is loaded by ``exporter.generation_support.load_component(path, metadata)``:
    the backend's own, safe loader (:meth:`hfexport.generation.support.GenerationSupport.load_component`). Nothing named in the
    manifest is imported: its ``format`` selects a registered exporter, and the pytree node types
    of the components' inputs come from a fixed list (:func:`hfexport.pytree.register_known_pytrees`).

    Args:
        output_dir: a folder written by :func:`save_components`.
        exporter: the ``HfExporter`` to load with; default: a new instance of the exporter
            registered for the manifest's ``format`` (:func:`hfexport.auto.get_hf_exporter`).

    Returns:
        ``(plan, {component: caller})``, ready for :class:`GenerationRunner`.

    Every file ``checksums.sha256`` lists is verified first, and the component files must be
    listed (:func:`hfexport.integrity.verify_checksums`); a folder without the list is loaded
    with a warning.

    Raises:
        IntegrityError: a file does not match its SHA-256 in ``checksums.sha256``, a listed file
            is missing, or a component file is not listed; nothing was loaded.
        FileNotFoundError / ValueError: see :func:`read_manifest`; also ``ValueError`` when
            ``exporter`` is of another format than the manifest's.
        MissingBackendError (an ``ImportError``): no installed backend provides the manifest's
            format (the message lists the installed formats, and the pip command for a built-in).
        NotImplementedError: the backend cannot load saved artifacts.
    """
    from hfexport.integrity import verify_checksums

    verify_checksums(output_dir)  # every listed file, before the manifest or a component is read
    manifest = read_manifest(output_dir)
    plan = GenerationPlan.from_dict(manifest["plan"])
    entries = {name: manifest["components"][name] for name in plan.components}
    verify_checksums(output_dir, [entry["file"] for entry in entries.values()])
    if exporter is None:
        exporter = _exporter_for(manifest, output_dir)
    elif exporter.export_format != manifest.get("format"):
        raise ValueError(
            f"{Path(output_dir) / MANIFEST_NAME} holds {manifest.get('format')!r} components; "
            f"{type(exporter).__name__} loads {exporter.export_format!r} ones"
        )
    callers: dict[str, Caller] = {}
    for name, entry in entries.items():
        path = Path(output_dir) / entry["file"]
        callers[name] = exporter.generation_support.load_component(path, entry.get("metadata", {}))
    return plan, callers


def load_runner(
    output_dir: str | os.PathLike[str], *, exporter: Any = None, **runner_kwargs: Any
) -> GenerationRunner:
    """A :class:`GenerationRunner` over the components saved in ``output_dir``.

    ``exporter`` is passed to :func:`load_components` (default: the manifest format's registered
    exporter); the runner is ``exporter.generation_support.generation_runner(plan, callers,
    **runner_kwargs)`` (:meth:`hfexport.generation.support.GenerationSupport.generation_runner`: a
    :class:`GenerationRunner` unless the backend runs its components its own way).
    """
    if exporter is None:
        from hfexport.integrity import verify_checksums

        verify_checksums(output_dir)  # before the manifest is read, as load_components does
        exporter = _exporter_for(read_manifest(output_dir), output_dir)
    plan, callers = load_components(output_dir, exporter=exporter)
    # the backend's runner (a stateful decoder's own loop), by default the core's GenerationRunner
    return exporter.generation_support.generation_runner(plan, callers, **runner_kwargs)


def new_tokens_start(plan: GenerationPlan, prompt_length: int) -> int:
    """Where the new tokens begin in a sequence :meth:`GenerationRunner.generate` returns for one
    prompt of ``prompt_length`` tokens.

    ``1`` for an encoder-decoder (the decoder start token comes first); else the prompt's length as
    the runner returns it: shortened by the plan's prompt rewrite (``prompt_edit["drop_last"]``:
    BLIP's ``generate`` drops the processor's closing ``[SEP]``), which the runner repeats.
    """
    if plan.architecture == "encoder_decoder":
        return 1
    return prompt_length - int((plan.prompt_edit or {}).get("drop_last", 0))


def generate_from_dir(
    output_dir: str | os.PathLike[str],
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int = 20,
    *,
    exporter: Any = None,
    **inputs: Any,
) -> list[int]:
    """Greedy generation with the components saved in ``output_dir``.

    Args:
        output_dir: a folder written by :func:`save_components`.
        input_ids: one prompt: a list of token ids, or an int tensor ``[seq]`` / ``[1, seq]``.
        max_new_tokens: how many tokens to generate at most.
        exporter: the ``HfExporter`` loading the components (default: the one registered for the
            manifest's format; see :func:`load_components`).
        **inputs: other generate-style inputs (``attention_mask``, ``pixel_values`` ...).

    Returns:
        The generated token ids (the prompt, or the decoder start token, not included); shorter
        than ``max_new_tokens`` when an end-of-sequence token came first (it is included).

    Raises:
        ValueError: an empty prompt or several prompts (use :func:`load_runner` for batches).
        FileNotFoundError / ImportError / NotImplementedError / IntegrityError: see
            :func:`load_components`.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(
            f"generate_from_dir takes one non-empty prompt (a list of ids), got shape {tuple(ids.shape)}; "
            "for a batch use hfexport.generation.load_runner(output_dir).generate(input_ids, attention_mask)"
        )
    runner = load_runner(output_dir, exporter=exporter)
    sequences = runner.generate(ids[None], max_new_tokens=max_new_tokens, **inputs)
    start = new_tokens_start(runner.plan, ids.numel())
    return [int(t) for t in sequences[0, start:].tolist()]
