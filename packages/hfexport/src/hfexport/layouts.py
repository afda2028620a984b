"""Runtime layouts: export folders that a runtime's own loader reads, with no hfexport at run time.

A *layout* is a named folder shape that one runtime's standard tooling loads: ONNX Runtime
GenAI's ``Model(folder)`` (``genai``), transformers.js's ``pipeline(task, folder)``
(``transformers.js``), ExecuTorch's ``TextLLMRunner`` (``llm-runner``), ... Backends announce the
layouts they can write with :func:`register_layout` when they are imported (as they register their
workarounds); the CLI's ``hfexport export FORMAT --layout NAME`` and :func:`check_layout` consult
this table, so a third-party backend adds layouts the same way.

A layout's writer replaces the default "artifact + config" folder contents: it is called inside
the atomic staging folder (:func:`hfexport.atomic.atomic_output_dir`) and writes every file the
runtime needs (graphs, runtime config, tokenizer files). The CLI adds ``export_report.json`` and
``checksums.sha256`` afterwards, as for every export.

Writer signature (a callable or a lazy ``"module:function"`` string)::

    writer(request: LayoutRequest) -> dict[str, Any]   # extra fields for export_report.json
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TOKENIZER_FILES",
    "Layout",
    "LayoutRequest",
    "check_layout",
    "get_layout",
    "layouts",
    "register_layout",
    "tokenizer_files",
]

#: File names of a tokenizer as transformers saves it (any subset makes a tokenizer folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "added_tokens.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class LayoutRequest:
    """Everything a layout writer gets.

    Attributes:
        exporter: the backend's :class:`hfexport.exporter.HfExporter` instance (its ``export``,
            ``export_for_generation``, ``save`` and stage callback are available).
        model: the eager ``PreTrainedModel`` in eval mode (fp32 unless the config says otherwise).
        inputs: sample forward kwargs (tensors, batch first).
        config: the backend's export config.
        task: the task name (``"text-generation"``, ``"feature-extraction"``, ...).
        output_dir: the staging folder to write into (empty; renamed into place on success).
        files: model-folder files to carry over (config, tokenizer, generation config), as the
            loader found them; writers copy what their runtime reads.
    """

    exporter: Any
    model: Any
    inputs: Mapping[str, Any]
    config: Any
    task: str
    output_dir: Path
    files: Sequence[Path] = ()


@dataclass(frozen=True)
class Layout:
    """One runtime layout a backend can write.

    Attributes:
        name: the ``--layout`` value (``"genai"``, ``"transformers.js"``, ``"llm-runner"``).
        export_format: the backend's format key (``"onnx"``, ``"executorch"``, ...).
        tasks: the tasks the layout serves; any other task is refused before capture.
        runtime: the loader that reads it, for messages and docs (``"onnxruntime-genai"``).
        description: one line for ``--help`` and docs.
        writer: a callable or lazy ``"module:function"`` taking a :class:`LayoutRequest`.
        needs_tokenizer: the runtime loads tokenizer files from the folder; a model without them
            is refused before capture with the list of files to add.
        check: optional callable or ``"module:function"`` ``(model, task) -> str | None`` returning
            why this model cannot be served (e.g. "the cache is not causal"), or ``None``.
        check_config: optional callable or ``"module:function"`` ``(config) -> str | None``
            returning why the export config cannot be served (a dtype / quantization combination
            the runtime has no file for ...), or ``None``; checked before the model is loaded.
    """

    name: str
    export_format: str
    tasks: tuple[str, ...]
    runtime: str
    description: str
    writer: Callable[[LayoutRequest], dict[str, Any]] | str
    needs_tokenizer: bool = False
    check: Callable[[Any, str], str | None] | str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    check_config: Callable[[Any], str | None] | str | None = None

    def resolve_writer(self) -> Callable[[LayoutRequest], dict[str, Any]]:
        """The writer callable (imports a lazy ``"module:function"`` target)."""
        return _resolve(self.writer)

    def refusal(self, model: Any, task: str) -> str | None:
        """Why ``model`` cannot be written in this layout for ``task``, or ``None`` (``model=None``:
        the task alone is checked, as before a model is loaded)."""
        if task not in self.tasks:
            return f"layout {self.name!r} serves tasks {', '.join(self.tasks)}, not {task!r}"
        if self.check is None or model is None:
            return None
        return _resolve(self.check)(model, task)

    def config_refusal(self, config: Any) -> str | None:
        """Why the export ``config`` (dtype, quantization ...) cannot be written in this layout, or
        ``None`` (also when the layout declares no ``check_config``)."""
        if self.check_config is None or config is None:
            return None
        return _resolve(self.check_config)(config)


_LAYOUTS: dict[tuple[str, str], Layout] = {}


def _resolve(target: Any) -> Any:
    if callable(target):
        return target
    module, _, attr = str(target).partition(":")
    return getattr(importlib.import_module(module), attr)


def register_layout(layout: Layout) -> Layout:
    """Announce ``layout`` for its backend (idempotent for an equal entry).

    Raises:
        ValueError: another layout of the same name is already registered for that format.
    """
    key = (layout.export_format, layout.name)
    existing = _LAYOUTS.get(key)
    if existing is not None and existing != layout:
        raise ValueError(
            f"layout {layout.name!r} is already registered for {layout.export_format!r} "
            f"(writer {existing.writer!r}); pick another name"
        )
    _LAYOUTS[key] = layout
    return layout


def layouts(export_format: str | None = None) -> list[Layout]:
    """Registered layouts (of one format, or all), sorted by format and name."""
    return sorted(
        (lay for (fmt, _), lay in _LAYOUTS.items() if export_format in (None, fmt)),
        key=lambda lay: (lay.export_format, lay.name),
    )


def get_layout(export_format: str, name: str) -> Layout:
    """The layout ``name`` of ``export_format``.

    Raises:
        ValueError: no such layout for that format; the message names the format's layouts and
            the formats that have a layout of that name.
    """
    found = _LAYOUTS.get((export_format, name))
    if found is not None:
        return found
    own = ", ".join(lay.name for lay in layouts(export_format)) or "none"
    elsewhere = [lay.export_format for lay in layouts() if lay.name == name]
    hint = f"; {name!r} is a layout of {', '.join(elsewhere)}" if elsewhere else ""
    raise ValueError(f"unknown layout {name!r} for {export_format}; {export_format} layouts: {own}{hint}")


def tokenizer_files(files: Sequence[Path]) -> list[Path]:
    """The tokenizer files among ``files`` (by name, see :data:`TOKENIZER_FILES`)."""
    return [Path(f) for f in files if Path(f).name in TOKENIZER_FILES]


def check_layout(
    export_format: str,
    name: str,
    *,
    model: Any = None,
    task: str | None = None,
    files: Sequence[Path] = (),
    config: Any = None,
) -> Layout:
    """Check that ``name`` can be written for this format, task and model, before any capture.

    Args:
        export_format: backend format key.
        name: layout name.
        model: the eager model (``None``: no model or tokenizer check, e.g. before the model is loaded).
        task: the task name (``None`` to skip the task, model and tokenizer checks).
        files: the model folder's files; layouts with ``needs_tokenizer`` need a tokenizer among them
            (checked with a model).
        config: the export config (``None``: not checked); the layout's ``check_config`` says
            whether it can write an export of that dtype / quantization.

    Returns:
        The :class:`Layout`.

    Raises:
        ValueError: unknown layout; a task the layout does not serve or a model it cannot (the
            message names the layouts of this format that serve the task); a missing tokenizer
            (the message says which files to add); a config the layout cannot serve (the message
            names what it allows).
    """
    layout = get_layout(export_format, name)
    reason = layout.config_refusal(config)
    if reason is not None:
        raise ValueError(f"layout {name!r}: {reason}")
    if task is None:
        return layout
    reason = layout.refusal(model, task)
    if reason is not None:
        fitting = [lay.name for lay in layouts(export_format) if lay.refusal(model, task) is None]
        alternatives = (
            f"layouts of {export_format} that fit: {', '.join(fitting)}"
            if fitting
            else f"no {export_format} layout fits; drop --layout for the default export"
        )
        raise ValueError(f"{reason}; {alternatives}")
    if model is None:
        return layout  # before loading: the tokenizer files are known once the model folder is read
    if layout.needs_tokenizer and not any(
        f.name in ("tokenizer.json", "tokenizer_config.json") for f in tokenizer_files(files)
    ):
        raise ValueError(
            f"layout {name!r} needs the tokenizer next to the model ({layout.runtime} loads it from the "
            "folder): add tokenizer.json (and tokenizer_config.json) to the model folder, e.g. "
            "tokenizer.save_pretrained(model_folder)"
        )
    return layout
