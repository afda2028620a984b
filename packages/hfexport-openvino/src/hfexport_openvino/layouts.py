"""The ``genai`` layout: a folder OpenVINO GenAI's ``LLMPipeline(folder, "CPU")`` runs as it is.

``hfexport export openvino --task text-generation --layout genai --model FOLDER OUT`` writes

* ``openvino_model.xml`` / ``.bin``: the stateful decoder (:mod:`hfexport_openvino.stateful`);
* ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml`` (+ ``.bin``): the model folder's
  tokenizer converted with ``openvino_tokenizers.convert_tokenizer``;
* ``config.json``, ``generation_config.json`` and the tokenizer files of the model folder;
* ``generation_manifest.json``, so ``hfexport generate OUT`` runs the same folder.

Registered for the ``openvino`` format when the backend is imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hfexport.layouts import Layout, LayoutRequest, register_layout

__all__ = ["GENAI_LAYOUT", "TOKENIZER_XML", "convert_tokenizer_files", "write_genai_folder"]

#: The tokenizer / detokenizer models OpenVINO GenAI loads from the folder.
TOKENIZER_XML = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")


def _refusal(model: Any, task: str) -> str | None:
    from hfexport_openvino.errors import StatefulExportError
    from hfexport_openvino.stateful import check_stateful_model

    try:
        check_stateful_model(model)
    except StatefulExportError as exc:
        return str(exc)
    return None


def convert_tokenizer_files(folder: Path) -> list[Path]:
    """Convert the tokenizer in ``folder`` into ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml`` there.

    Args:
        folder: a folder holding ``tokenizer.json`` (and ``tokenizer_config.json``).

    Returns:
        The written ``.xml`` and ``.bin`` paths.

    Raises:
        ImportError: ``openvino-tokenizers`` is not installed (``pip install 'hfexport-openvino[genai]'``).
    """
    import openvino as ov
    from transformers import AutoTokenizer

    try:
        from openvino_tokenizers import convert_tokenizer
    except ImportError as exc:
        raise ImportError(
            "the genai layout converts the tokenizer with openvino-tokenizers, which is not installed: "
            "pip install 'hfexport-openvino[genai]'"
        ) from exc
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    models = convert_tokenizer(tokenizer, with_detokenizer=True)
    written = []
    for model, name in zip(models, TOKENIZER_XML):
        ov.save_model(model, folder / name)
        written += [folder / name, (folder / name).with_suffix(".bin")]
    return written


def write_genai_folder(request: LayoutRequest) -> dict[str, Any]:
    """The ``genai`` layout writer (see the module docstring); returns report fields.

    Raises:
        ValueError: ``request.config.stateful`` is False (GenAI's ``LLMPipeline`` runs stateful models).
    """
    from hfexport.generation import save_components

    if not getattr(request.config, "stateful", True):
        raise ValueError("the genai layout writes a stateful decoder; drop stateful=False")
    out = Path(request.output_dir)
    artifacts = request.exporter.export_for_generation(request.model, request.inputs, request.config)
    save_components(request.exporter, artifacts, out, model=request.model, overwrite=True)
    for file in request.files:
        if not (out / Path(file).name).exists():
            shutil.copy2(file, out / Path(file).name)
    if not (out / "config.json").exists():
        request.model.config.to_json_file(out / "config.json")
    generation_config = getattr(request.model, "generation_config", None)
    if generation_config is not None and not (out / "generation_config.json").exists():
        generation_config.to_json_file(out / "generation_config.json")
    tokenizer = convert_tokenizer_files(out)
    return {
        "components": list(artifacts),
        "tokenizer_models": sorted(p.name for p in tokenizer),
        "validation_generation": artifacts.reports[next(iter(artifacts))].validation_generation,
    }


GENAI_LAYOUT = register_layout(
    Layout(
        name="genai",
        export_format="openvino",
        tasks=("text-generation",),
        runtime="openvino-genai",
        description="stateful openvino_model.xml + converted tokenizer: openvino_genai.LLMPipeline(folder) runs it",
        writer="hfexport_openvino.layouts:write_genai_folder",
        needs_tokenizer=True,
        check=_refusal,
    )
)
