"""The tiny-model zoo for tests: :mod:`hfexport.tiny` and :mod:`hfexport.sample_inputs`, plus cases.

The tiny models and their sample inputs are core features (the CLI's ``--model tiny:TYPE``, sample
inputs for a checkpoint folder without a tokenizer), so they live in :mod:`hfexport.tiny` and
:mod:`hfexport.sample_inputs`; this module re-exports them for tests. Its :func:`tiny_model` also
builds the model of a shared regression case (``"case:C09-left-padding"``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from hfexport import tiny as _tiny
from hfexport.sample_inputs import make_inputs, modality
from hfexport.tiny import *  # noqa: F403  (hfexport.tiny's names, for tests; tiny_model is replaced below)

__all__ = [*_tiny.__all__, "make_inputs", "modality"]


def tiny_model(
    model_type: str, task: str | None = None, **kwargs: Any
) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """:func:`hfexport.tiny.tiny_model`, or the model and sample inputs of a shared case.

    ``model_type`` may name a shared case, ``"case:C09-left-padding"`` (or a unique prefix such as
    ``"case:C09"``): the case's own model and sample inputs are returned (see
    :func:`hfexport.testing.cases.tiny_model_from_case`); no other argument may then be given.
    Any other ``model_type`` goes to :func:`hfexport.tiny.tiny_model` with ``task`` and ``kwargs``
    (``seed``, ``batch_size``, ``seq_len``, ``attn_implementation``, ``check_eager``, config
    overrides).

    Returns:
        ``(model, sample_inputs)``: a ``PreTrainedModel`` in eval mode and a dict of tensors such
        that ``model(**sample_inputs)`` runs.

    Raises:
        ValueError: a ``"case:"`` name with other arguments, or an unknown or ambiguous case name;
            for other names, what :func:`hfexport.tiny.tiny_model` raises
            (:class:`UnknownModelTypeError`, an unknown task, :class:`TinyModelUnavailable`).
    """
    if model_type.startswith("case:"):
        if task is not None or kwargs:
            raise ValueError("tiny_model('case:...') takes no task, attn_implementation or config overrides")
        from hfexport.testing.cases import load_case, tiny_model_from_case

        return tiny_model_from_case(load_case(model_type.removeprefix("case:")))
    return _tiny.tiny_model(model_type, task, **kwargs)
