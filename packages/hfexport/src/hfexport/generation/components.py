"""The result of a decomposition: :class:`Decomposition` (``{component: (module, kwargs)}`` plus
the :class:`~hfexport.generation.plan.GenerationPlan`), the description of its components' inputs
and outputs (:func:`describe_components`) and the model's special token ids (:func:`token_ids_of`).

Shared by :mod:`hfexport.generation.decompose` (decoder-only, encoder-decoder) and
:mod:`hfexport.generation.multimodal`, below both of them in the import graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.generation.plan import ComponentIO, GenerationPlan
from hfexport.tensors import duplicate_leaf_tensors, get_leaf_tensors

__all__ = ["Decomposition", "describe_components", "token_ids_of"]


class Decomposition(dict):
    """``{component_name: (module, forward_kwargs)}`` plus the :class:`GenerationPlan` (``.plan``)
    and the decomposed model (``.model``).

    A plain dict for everything else: ``decomposition["decode"]`` is ``(model, kwargs)``.
    """

    def __init__(
        self,
        components: Mapping[str, tuple[torch.nn.Module, dict[str, Any]]],
        plan: GenerationPlan,
        model: torch.nn.Module | None = None,
    ) -> None:
        super().__init__(components)
        self.plan = plan
        self.model = model


def token_ids_of(model: Any) -> dict[str, Any]:
    """Special token ids from the model's generation config (falling back to its config).

    Returns:
        ``{"eos_token_id": list[int], "pad_token_id": int | None, "bos_token_id": int | None,
        "decoder_start_token_id": int | None}``, plus ``"forced_eos_token_id"`` (``list[int]``)
        when the generation config forces an end-of-sequence token at the last position (BART,
        Florence-2), as ``generate`` does.
    """
    sources = [getattr(model, "generation_config", None), getattr(model, "config", None)]
    get_text = getattr(getattr(model, "config", None), "get_text_config", None)
    if callable(get_text):
        sources.append(get_text())
    out: dict[str, Any] = {}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
        value = next(
            (getattr(s, name) for s in sources if s is not None and getattr(s, name, None) is not None), None
        )
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        out[name] = value
    eos = out["eos_token_id"]
    out["eos_token_id"] = (
        [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    )
    forced = getattr(getattr(model, "generation_config", None), "forced_eos_token_id", None)
    if isinstance(forced, torch.Tensor):
        forced = forced.tolist()
    if forced is not None:
        out["forced_eos_token_id"] = [
            int(e) for e in (forced if isinstance(forced, (list, tuple)) else [forced])
        ]
    return out


def describe_components(decomposition: Decomposition) -> None:
    """Fill ``decomposition.plan.io`` from the prepared kwargs and the eager outputs of each component.

    The kwargs are prepared as :meth:`hfexport.exporter.HfExporter.export` prepares them (output
    flags lifted, data-dependent inputs precomputed), so the recorded pytree spec is the exported
    graph's input structure; each component runs once eagerly (on copies) for its output names.
    """
    from hfexport.generation.parts import exportable_module
    from hfexport.inputs import apply_output_flags, prepare_for_export

    parent_config = getattr(decomposition.model, "config", None)
    for name, (part, kwargs) in decomposition.items():
        module = exportable_module(part, parent_config)
        _, prepared, flags = prepare_for_export(module, kwargs)
        with contextlib.ExitStack() as stack:
            if flags:
                stack.enter_context(apply_output_flags(module, flags))
            stack.enter_context(torch.no_grad())
            output = module(**duplicate_leaf_tensors(prepared))
        decomposition.plan.io[name] = ComponentIO.from_kwargs(prepared, list(get_leaf_tensors(output)))
