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
- ``prepare_component``: a Qwen-style vision encoder reads its ``cu_seqlens`` as int64
  (:class:`WideSeqlensEncoder`, a workaround of OpenVINO 2026.4.1's frontend);
- ``generation_runner``: a :class:`~hfexport_openvino.stateful.StatefulGenerationRunner` over a
  stateful decoder folder, the core's runner otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.generation.support import GenerationSupport
from hfexport_openvino.runtime import OpenvinoRunner, recorded_precision_hint

__all__ = ["OpenvinoGenerationSupport", "WideSeqlensEncoder"]


#: int32 inputs of a Qwen-style vision encoder whose values become sizes inside the graph
_SEQLENS_INPUTS = ("cu_seqlens", "cu_window_seqlens")


class WideSeqlensEncoder(torch.nn.Module):
    """A Qwen-style vision encoder that reads its ``cu_seqlens`` as int64.

    Workaround (issue 28): OpenVINO 2026.4.1's PyTorch frontend builds the shape of a ``view``
    from sizes read out of the int32 ``cu_seqlens`` as an i32 element next to i64 constants, and
    its ``Concat`` refuses the mix ("Argument element types are inconsistent", conversion of
    ``aten.view`` after the vision attention fails; no upstream issue found). Casting the
    boundaries to int64 first gives i64 sizes; the graph still takes the int32 input the runner
    computes, and the values are the same.

    Args:
        encoder: the vision encoder (its parameters are shared); ``forward(**kwargs)`` takes its kwargs.
    """

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.config = getattr(encoder, "config", None)

    def forward(self, **kwargs: Any) -> Any:
        wide = {
            k: v.long() if k in _SEQLENS_INPUTS and isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        return self.encoder(**wide)


class OpenvinoGenerationSupport(GenerationSupport):
    """Generation hooks of the OpenVINO backend (see the module docstring)."""

    def prepare_component(self, name: str, module: Any, kwargs: Mapping[str, Any], plan: Any) -> Any:
        """A Qwen-style vision encoder taking ``cu_seqlens`` is wrapped in :class:`WideSeqlensEncoder`."""
        if name in getattr(plan, "vision_grid", {}) and any(k in kwargs for k in _SEQLENS_INPUTS):
            return WideSeqlensEncoder(module)
        return module

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
