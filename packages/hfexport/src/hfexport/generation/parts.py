"""Adapters that make a submodule exportable as a generation component.

- :class:`ComponentModule`: the export machinery reads and restores transformers configs (output
  flags, attention implementation); a bare ``nn.Embedding`` or ``nn.Linear`` has none, and its
  output is a bare tensor, whose leaf path is the empty string (no name for a graph output). The
  wrapper gives such a part its model's config and names its output ``output``.
- :func:`mark_transformed_source` / :func:`transformed_source_of`: a backend's transformed copy of
  the model (``HfExporter.generation_source``, e.g. quantized once for every component) carries
  its summary on each module, so the backend's export recognises a component of it.
- :class:`FunctionalCacheModule`: a static cache is updated in place, which ``torch.export``
  records as a mutation of the graph's inputs. Runtimes that do not write mutated inputs back
  (ExecuTorch returns them as extra outputs) get a graph that copies the cache first and returns
  the updated copy: paired cache inputs and outputs, no input mutation.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

__all__ = [
    "OUTPUT_NAME",
    "ComponentModule",
    "FunctionalCacheModule",
    "WithoutModalityOutputs",
    "exportable_module",
    "mark_transformed_source",
    "transformed_source_of",
]

#: Output name of a wrapped part whose forward returns a bare tensor.
OUTPUT_NAME = "output"


class ComponentModule(torch.nn.Module):
    """``part`` with ``config`` attached; a bare tensor output is returned as ``{"output": tensor}``.

    Args:
        part: the submodule (its parameters are shared, not copied).
        config: the transformers config of the model it belongs to.
    """

    def __init__(self, part: torch.nn.Module, config: PreTrainedConfig) -> None:
        super().__init__()
        self.part = part
        self.config = config

    def forward(self, **kwargs: Any) -> Any:
        output = self.part(**kwargs)
        if isinstance(output, torch.Tensor):
            return {OUTPUT_NAME: output}
        return output


def exportable_module(module: torch.nn.Module, parent_config: Any) -> torch.nn.Module:
    """``module`` itself when it is a ``PreTrainedModel`` (its outputs are named), else a
    :class:`ComponentModule` with the module's own config or, without one, its model's.

    A plain ``nn.Module`` that keeps a config (a projector such as Aya Vision's, or
    :class:`hfexport.generation.multimodal.ImageFeatures`) may still return a bare tensor, whose
    empty leaf path no backend can use as a graph output name (issue 28), so it is wrapped too.
    Without any transformers config the module is returned as it is.
    """
    from transformers import PreTrainedModel

    own = getattr(module, "config", None)
    if isinstance(module, PreTrainedModel):
        return module
    if isinstance(own, PreTrainedConfig):
        return ComponentModule(module, own)
    if not isinstance(parent_config, PreTrainedConfig):
        return module
    return ComponentModule(module, parent_config)


class WithoutModalityOutputs(torch.nn.Module):
    """A whole-model prefill that takes the raw images, without the encoder outputs in its output.

    transformers 5 returns the encoded images next to the logits (``image_outputs``: one
    ``pooler_output`` and one ``image_tokens`` entry per image, Apertus 1.5), an output tree whose
    length is the sample's image count; the generation runner reads the logits and the cache only.
    ``forward`` returns the model's output without ``image_outputs`` / ``audio_outputs`` (issue 28).

    Args:
        model: the ``PreTrainedModel`` (its parameters are shared, not copied).
    """

    #: model output fields dropped
    DROPPED: tuple[str, ...] = ("image_outputs", "audio_outputs")

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kwargs: Any) -> Any:
        output = self.model(**kwargs)
        if not any(output.get(name) is not None for name in self.DROPPED if hasattr(output, "get")):
            return output
        kept = {k: v for k, v in output.items() if k not in self.DROPPED}
        return type(output)(**kept)


class FunctionalCacheModule(torch.nn.Module):
    """Run ``module`` on copies of the caches among its kwargs, so the graph mutates no input.

    The updated copies come back in the output (``cache.layers.0.keys`` ...), as with a growing
    cache; the caller passes them to the next step.

    Args:
        module: the component module (its parameters are shared, not copied).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.inner = module
        config = getattr(module, "config", None)
        if config is not None:
            self.config = config

    def forward(self, **kwargs: Any) -> Any:
        from transformers.cache_utils import Cache

        from hfexport.tensors import duplicate_leaf_tensors

        copied = {k: duplicate_leaf_tensors(v) if isinstance(v, Cache) else v for k, v in kwargs.items()}
        return self.inner(**copied)


# module of a transformed generation source -> (summary, weak ref to its original counterpart), set
# by mark_transformed_source: a side table of ours, nothing is written on torch's modules
_TRANSFORMED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict[str, Any], Any]] = (
    weakref.WeakKeyDictionary()
)


def mark_transformed_source(
    copy: torch.nn.Module, original: torch.nn.Module, summary: dict[str, Any]
) -> None:
    """Mark every module of ``copy`` (a transformed deep copy of ``original`` with the same module
    names) with ``summary`` and a weak reference to its counterpart in ``original``; see
    :func:`transformed_source_of`. ``original`` is not touched."""
    originals = dict(original.named_modules(remove_duplicate=False))
    for path, module in copy.named_modules(remove_duplicate=False):
        counterpart = originals.get(path)
        _TRANSFORMED[module] = (summary, weakref.ref(counterpart) if counterpart is not None else None)


def transformed_source_of(module: torch.nn.Module) -> tuple[dict[str, Any], torch.nn.Module | None] | None:
    """``(summary, original counterpart or None)`` when ``module`` or one of its submodules (a
    component wrapper around a part of the copy) was marked by :func:`mark_transformed_source`
    (the outermost marked module's), else ``None``."""
    for part in module.modules():
        marked = _TRANSFORMED.get(part)
        if marked is not None:
            summary, ref = marked
            return summary, (ref() if ref is not None else None)
    return None
