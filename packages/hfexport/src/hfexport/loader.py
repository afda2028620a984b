"""``hfexport.load(OUTPUT_DIR)``: one call that runs whatever an export folder holds.

>>> model = hfexport.load("out/")                      # any installed backend, plain or generation
>>> model(input_ids=ids, attention_mask=mask).logits   # a ModelOutput named like the eager model's
>>> model.generate(input_ids=ids, max_new_tokens=20)   # generation folders: greedy, like model.generate

What the folder holds is read from its own files (:func:`hfexport.folder.read_export_folder`),
never from a backend name in this module:

- ``generation_manifest.json`` (``hfexport export FORMAT --task text-generation``,
  :func:`hfexport.generation.save_components`): a generation export; its ``format`` names the
  exporter, whose ``load_component`` loads each component and
  :class:`hfexport.generation.runner.GenerationRunner` drives them;
- ``export_report.json`` (``hfexport export FORMAT``): a plain export; its ``export_format`` names
  the exporter and its ``artifact`` entry the file and the metadata the exporter's
  ``load_component`` takes.

Before anything is read, every file listed in the folder's ``checksums.sha256`` is checked
(:func:`hfexport.integrity.verify_checksums`). Outputs come back as the ``ModelOutput`` class the
eager model returns (found from the exported class recorded in the report, else from
``config.json``'s ``architectures``), rebuilt from the runner's ``{leaf_path: tensor}``: a
``cache.layers.{i}.keys/values`` group becomes a ``DynamicCache`` (an ``EncoderDecoderCache`` for
``self_attention_cache`` / ``cross_attention_cache``), ``hidden_states.{i}`` a tuple.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.folder.contents import REPORT_NAME, ExportFolderError, read_export_folder

__all__ = ["ExportFolderError", "ExportedModel", "load"]

logger = logging.getLogger(__name__)

_OUTPUT_CLASS = re.compile(r"\b([A-Z][A-Za-z0-9]*Output[A-Za-z0-9]*)\b")


def _exporter(export_format: Any, source: Path) -> Any:
    from hfexport.auto import get_hf_exporter
    from hfexport.errors import MissingBackendError

    if not isinstance(export_format, str) or not export_format:
        raise ExportFolderError(f"{source} names no export format; export the folder again")
    try:
        return get_hf_exporter(export_format)()
    except MissingBackendError as exc:
        raise MissingBackendError(f"{source.parent} holds a {export_format!r} export: {exc}") from exc


def output_class(model_class: str | None) -> type | None:
    """The ``ModelOutput`` subclass ``transformers.<model_class>.forward`` returns, or ``None``.

    Only attributes of the ``transformers`` package are looked up (nothing else is imported); the
    class comes from the forward's return annotation (``tuple | CausalLMOutputWithPast``).
    """
    if not model_class or not model_class.isidentifier():
        return None
    import transformers
    from transformers.utils import ModelOutput

    with contextlib.suppress(Exception):
        cls = getattr(transformers, model_class)
        annotation = inspect.signature(cls.forward).return_annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        for candidate in candidates:
            if isinstance(candidate, type) and issubclass(candidate, ModelOutput):
                return candidate
        namespace = vars(sys.modules[cls.__module__])
        for name in _OUTPUT_CLASS.findall(str(annotation)):
            found = namespace.get(name) or getattr(transformers.modeling_outputs, name, None)
            if isinstance(found, type) and issubclass(found, ModelOutput):
                return found
    return None


def _dynamic_cache(leaves: Mapping[str, torch.Tensor]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    layers = sorted({int(k.split(".")[1]) for k in leaves if k.startswith("layers.")})
    for index in layers:
        cache.update(leaves[f"layers.{index}.keys"], leaves[f"layers.{index}.values"], index)
    return cache


def _rebuild(field: str, leaves: dict[str, torch.Tensor]) -> Any:
    """One output field from its leaves ``{sub_path: tensor}`` (``""`` for a tensor field)."""
    if set(leaves) == {""}:
        return leaves[""]
    if any(k.startswith("self_attention_cache.") for k in leaves):
        from transformers import EncoderDecoderCache

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: v for k, v in leaves.items() if k.startswith(prefix)}

        return EncoderDecoderCache(
            _dynamic_cache(part("self_attention_cache.")), _dynamic_cache(part("cross_attention_cache."))
        )
    if all(re.fullmatch(r"layers\.\d+\.(keys|values)", k) for k in leaves):
        return _dynamic_cache(leaves)
    if all(k.isdigit() for k in leaves):
        return tuple(leaves[k] for k in sorted(leaves, key=int))
    return {k: v for k, v in leaves.items()}


def to_model_output(outputs: Mapping[str, torch.Tensor], cls: type | None) -> Any:
    """``{leaf_path: tensor}`` -> ``cls(**fields)`` (a plain ``ModelOutput`` when ``cls`` is ``None``
    or lacks a field), caches rebuilt as ``DynamicCache`` / ``EncoderDecoderCache``."""
    from transformers.utils import ModelOutput

    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for path, value in outputs.items():
        field, _, rest = path.partition(".")
        grouped.setdefault(field, {})[rest] = value
    fields = {name: _rebuild(name, leaves) for name, leaves in grouped.items()}
    if cls is not None:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) <= known:
            return cls(**fields)
        logger.warning(
            "outputs %s are not all fields of %s; returning a ModelOutput", sorted(fields), cls.__name__
        )
    return ModelOutput(**fields)


class ExportedModel:
    """An export folder, loaded: call it like the eager model, and ``generate`` for generation folders.

    Made by :func:`load`. Attributes: ``path`` (the folder), ``export_format`` (``"dynamo"`` ...),
    ``task`` (from the report, may be ``None``), ``is_generation`` (a generation folder),
    ``output_class`` (the ``ModelOutput`` subclass outputs are returned as, or ``None``),
    ``runner`` (plain folders: the backend's ``{leaf_path: tensor}`` caller) and
    ``generation_runner`` (generation folders: the :class:`~hfexport.generation.runner.GenerationRunner`).
    """

    def __init__(
        self,
        path: Path,
        export_format: str,
        *,
        task: str | None,
        output_class: type | None,
        runner: Any = None,
        generation_runner: Any = None,
    ) -> None:
        self.path = path
        self.export_format = export_format
        self.task = task
        self.output_class = output_class
        self.runner = runner
        self.generation_runner = generation_runner
        self.is_generation = generation_runner is not None

    def __call__(self, **forward_kwargs: Any) -> Any:
        """Run the export on forward kwargs, as ``model(**forward_kwargs)``.

        Args:
            **forward_kwargs: the inputs the model was exported with (``input_ids`` int64
                ``[batch, seq]``, ``attention_mask`` ...; a ``Cache`` where the export took one). A
                generation folder runs its ``prefill`` component (``position_ids`` are derived from
                the mask when not given), or ``decode`` when a non-empty ``cache`` /
                ``past_key_values`` is passed.

        Returns:
            The eager model's ``ModelOutput`` class (``CausalLMOutputWithPast(logits=..., cache=...)``,
            ``BaseModelOutput(last_hidden_state=...)``) with float tensors shaped like eager's.

        Raises:
            UnsupportedInputError: (plain dynamo folders) inputs missing or not exported; other
                backends raise their runtime's error for inputs the artifact does not take.
            KeyError: a generation component needs an input that was not given.
        """
        if self.runner is not None:
            outputs = self.runner(dict(forward_kwargs))
        else:
            outputs = self._call_component(dict(forward_kwargs))
        return to_model_output(outputs, self.output_class)

    def _call_component(self, kwargs: dict[str, Any]) -> Mapping[str, torch.Tensor]:
        from hfexport.tensors import get_leaf_tensors

        runner = self.generation_runner
        cache = kwargs.pop("past_key_values", None)
        cache = kwargs.pop("cache", cache)
        leaves = get_leaf_tensors(cache) if cache is not None else {}
        component = "decode" if leaves or "prefill" not in runner.plan.components else "prefill"
        mask = kwargs.get("attention_mask")
        if "position_ids" not in kwargs and mask is not None:
            positions = (mask.to(torch.int64).cumsum(-1) - 1).clamp(min=0)
            kwargs["position_ids"] = positions[:, -kwargs["input_ids"].shape[1] :]
        values = {**kwargs, **{f"cache.{k}": v for k, v in leaves.items()}}
        return runner._call(component, values, {})

    def generate(
        self,
        input_ids: torch.Tensor | list[int] | list[list[int]],
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 20,
        **inputs: Any,
    ) -> torch.Tensor:
        """Greedy generation, the same tokens as ``model.generate(..., do_sample=False)``.

        Args:
            input_ids: int64 ``[batch, seq]`` (or a list of ids for one prompt).
            attention_mask: ``[batch, seq]``, 1 = token, 0 = (left) padding; ``None``: no padding.
            max_new_tokens: at most this many new tokens (>= 1).
            **inputs: other generate-style inputs (``pixel_values`` ...).

        Returns:
            int64 ``[batch, seq + n]``: the prompt then the new tokens (encoder-decoder: the decoder
            start token then the new tokens), as ``model.generate`` returns them.

        Raises:
            ExportFolderError: the folder holds a plain export (no generation components).
            ValueError: see :meth:`hfexport.generation.runner.GenerationRunner.generate`.
        """
        if self.generation_runner is None:
            raise ExportFolderError(
                f"{self.path} holds a plain {self.export_format} export, which cannot generate; export with "
                f"`hfexport export {self.export_format} --task text-generation OUTPUT_DIR` for generation"
            )
        return self.generation_runner.generate(
            input_ids, attention_mask, max_new_tokens=max_new_tokens, **inputs
        )

    def __repr__(self) -> str:
        kind = "generation" if self.is_generation else "plain"
        return f"ExportedModel({str(self.path)!r}, format={self.export_format!r}, {kind})"


def load(output_dir: str | os.PathLike[str]) -> ExportedModel:
    """Load an export folder with the backend that wrote it and return a callable model.

    Args:
        output_dir: a folder written by ``hfexport export FORMAT OUTPUT_DIR`` (plain) or
            ``hfexport export FORMAT --task text-generation OUTPUT_DIR`` / ``save_components``
            (generation).

    Returns:
        An :class:`ExportedModel`: ``model(**forward_kwargs)`` -> ``ModelOutput``;
        ``model.generate(input_ids=..., max_new_tokens=...)`` for generation folders.

    Raises:
        ExportFolderError: (a ``ValueError``) ``output_dir`` is not a folder, holds neither
            ``generation_manifest.json`` nor ``export_report.json``, holds a runtime layout
            (``--layout``) without a ``generation_manifest.json`` (load it with its runtime's own
            loader), or its files are unreadable. A layout folder that carries the manifest (the
            OpenVINO ``genai`` layout) loads like a generation folder, as ``hfexport generate`` runs it.
        hfexport.errors.IntegrityError: a file differs from its SHA-256 in ``checksums.sha256``
            (checked before anything is loaded; the message names the file).
        MissingBackendError: (an ``ImportError``) the backend that wrote the folder is not
            installed; the message has the ``pip install`` command.
        The backend loader's errors (e.g. ``hfexport_dynamo.UnsafeArtifactError``).
    """
    from hfexport.generation.persist import load_runner, read_manifest

    # names the folder, its record and manifest; every file checksums.sha256 lists is verified first
    contents = read_export_folder(output_dir)
    folder, record = contents.path, contents.record
    if contents.layout and not contents.is_generation:
        # a layout that also carries our generation manifest (OpenVINO GenAI's) runs here as well,
        # as `hfexport generate` runs it; the others are for their runtime's loader alone
        raise ExportFolderError(
            f"{folder} holds the {contents.layout!r} layout for {(record.runtime if record else None) or 'another runtime'}; "
            "load it with that runtime's own loader (see docs/backends)"
        )
    cls = output_class(contents.model_class())
    task = record.task if record is not None else None
    if contents.is_generation:
        manifest = read_manifest(folder)
        exporter = _exporter(manifest.get("format"), contents.manifest_path)
        runner = load_runner(folder, exporter=exporter)
        if cls is None:  # the record names a class transformers does not export: config.json's
            cls = output_class(contents.architecture())
        if cls is None and runner.plan.architecture in ("decoder", "multimodal"):
            from transformers.modeling_outputs import CausalLMOutputWithPast

            cls = CausalLMOutputWithPast
        return ExportedModel(
            folder,
            exporter.export_format,
            task=task or "text-generation",
            output_class=cls,
            generation_runner=runner,
        )
    assert record is not None  # read_export_folder: a folder without a manifest has a record
    exporter = _exporter(record.export_format, contents.report_path)
    entry = record.artifact
    filename = (entry.file if entry is not None else None) or exporter.artifact_filename
    path = folder / filename
    if not path.is_file():
        raise ExportFolderError(
            f"{folder} has no {filename}, the artifact its {REPORT_NAME} names; export it again"
        )
    caller = exporter.generation_support.load_component(path, entry.metadata if entry is not None else {})
    return ExportedModel(folder, exporter.export_format, task=task, output_class=cls, runner=caller)
