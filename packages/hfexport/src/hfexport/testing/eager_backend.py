"""A test backend whose artifact is the eager module itself: the core's whole pipeline (stages,
validation, folders, generation components) without any runtime.

:class:`EagerModuleExporter` captures nothing: stage ``capture`` returns the (prepared) module,
the runner calls it under ``torch.no_grad()``, and a saved file holds only a token naming the
module in this process's memory (:data:`STORE`), so a folder it writes is readable by the same
process only. Subclass it with your own ``export_format`` and register it
(``hfexport.auto._EXPORTERS[fmt] = cls``) for tests of the CLI, folders and generation hooks.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.config import DynamoConfig
from hfexport.exporter import HfExporter
from hfexport.tensors import get_leaf_tensors

__all__ = ["STORE", "EagerModuleExporter"]

#: token -> the module a saved file names (this process only)
STORE: dict[str, torch.nn.Module] = {}


class EagerModuleExporter(HfExporter):
    """A backend whose artifact is the eager module; its files hold a token naming it in memory."""

    export_format = "eagertoy"
    config_class = DynamoConfig
    artifact_filename = "model.toy"

    def _export(self, model: torch.nn.Module, inputs: Any, config: Any, report: Any) -> torch.nn.Module:
        with report.stage("capture"):
            return model

    def runner(self, artifact: torch.nn.Module) -> Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]:
        def run(kwargs: dict[str, Any]) -> Mapping[str, torch.Tensor]:
            with torch.no_grad():
                return get_leaf_tensors(artifact(**kwargs))

        return run

    def save(self, artifact: torch.nn.Module, path: str | os.PathLike[str]) -> None:
        """Write a fresh token naming ``artifact`` (UTF-8 text) to ``path``."""
        token = uuid.uuid4().hex
        STORE[token] = artifact
        Path(path).write_text(token, encoding="utf-8")

    def load(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> torch.nn.Module:
        """The module the token in ``path`` names.

        Raises:
            KeyError: the token was written by another process.
        """
        return STORE[Path(path).read_text(encoding="utf-8")]
