"""The OpenVINO backend's generation hooks: :class:`OpenvinoGenerationSupport`, the
:class:`hfexport.generation.support.GenerationSupport` of
:class:`hfexport_openvino.OpenvinoExporter` (its ``generation_support_class``).

A generation folder holds either the core's stateless components or one stateful decoder
(:mod:`hfexport_openvino.stateful`, whose KV cache is runtime state). The hooks that differ:

- ``component_filename``: ``openvino_model.xml`` for the stateful decoder (the file OpenVINO GenAI
  reads), ``<name>.xml`` otherwise;
- ``component_metadata``: whether the model is stateful, and its inference precision hint;
- ``load_component``: an :class:`~hfexport_openvino.runtime.OpenvinoRunner`, or a
  :class:`~hfexport_openvino.stateful.StatefulDecoder`;
- ``generation_runner``: a :class:`~hfexport_openvino.stateful.StatefulGenerationRunner` over a
  stateful decoder folder, the core's runner otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hfexport.generation.support import GenerationSupport
from hfexport_openvino.runtime import OpenvinoRunner, recorded_precision_hint

__all__ = ["OpenvinoGenerationSupport"]


class OpenvinoGenerationSupport(GenerationSupport):
    """Generation hooks of the OpenVINO backend (see the module docstring)."""

    def component_filename(self, name: str) -> str:
        """``openvino_model.xml`` for the stateful decoder (the file OpenVINO GenAI reads), else ``<name>.xml``."""
        from hfexport_openvino.stateful import STATEFUL_COMPONENT

        return str(self.exporter.artifact_filename) if name == STATEFUL_COMPONENT else f"{name}.xml"

    def component_metadata(self, artifact: Any) -> dict[str, Any]:
        """``{"stateful": bool, "inference_precision_hint": str | None}`` of an ``openvino.Model``."""
        hint = recorded_precision_hint(artifact)
        return {
            "stateful": bool(artifact.has_rt_info(["hfexport", "stateful"])),
            "inference_precision_hint": hint,
        }

    def generation_runner(self, plan: Any, callers: Mapping[str, Any], **runner_kwargs: Any) -> Any:
        """A :class:`~hfexport_openvino.stateful.StatefulGenerationRunner` for a stateful decoder
        folder, else the core's ``GenerationRunner``."""
        from hfexport_openvino.stateful import STATEFUL_COMPONENT, StatefulGenerationRunner

        if list(plan.components) == [STATEFUL_COMPONENT]:
            return StatefulGenerationRunner(plan, callers[STATEFUL_COMPONENT])
        return super().generation_runner(plan, callers, **runner_kwargs)

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """A runner over a saved model: :class:`~hfexport_openvino.runtime.OpenvinoRunner`, or a
        :class:`~hfexport_openvino.stateful.StatefulDecoder` for a stateful decoder (``metadata["stateful"]``).

        Raises:
            FileNotFoundError: no file at ``path`` (from the exporter's ``load``).
        """
        model = self.exporter.load(path)
        if metadata.get("stateful"):
            from hfexport_openvino.stateful import StatefulDecoder

            return StatefulDecoder(model, precision_hint=metadata.get("inference_precision_hint"))
        return OpenvinoRunner(model, precision_hint=metadata.get("inference_precision_hint"))
