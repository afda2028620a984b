"""Check that generation over exported components gives what ``model.generate`` gives."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.conventions import TEXT, names_with
from hfexport.generation.runner import GenerationRunner, accepted_input_keys

__all__ = ["GenerationParity", "compare_with_generate"]

#: Inputs ``GenerationRunner.generate`` takes positionally (the prompt's token ids and mask, from
#: the input-role table); everything else goes as keywords.
_PROMPT_KEYS = names_with(sequence=TEXT, kind=("ids", "mask"))


@dataclass
class GenerationParity:
    """Greedy generation from exported components next to ``model.generate(do_sample=False)``.

    Attributes:
        sequences: the runner's output ``[batch, length]``.
        reference: ``model.generate``'s output.
        max_logit_diff: the largest ``|runner - generate|`` over the logits of every generated
            position (``inf`` when the runs have different lengths).
        first_mismatch: ``(row, position)`` of the first differing token, or ``None``.
        reference_logits: ``generate``'s logits, one ``[batch, vocab]`` tensor per new token (the
            runner's are ``runner.last_logits``).
    """

    sequences: torch.Tensor
    reference: torch.Tensor
    max_logit_diff: float
    first_mismatch: tuple[int, int] | None
    reference_logits: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    @property
    def tokens_equal(self) -> bool:
        """Same tokens, same length."""
        return self.first_mismatch is None and self.sequences.shape == self.reference.shape

    def check(self, atol: float = 1e-4) -> None:
        """Raise ``AssertionError`` (with both sequences) unless the tokens are equal and every
        step's logits are within ``atol``."""
        if not self.tokens_equal or not self.max_logit_diff <= atol:
            raise AssertionError(
                f"generation over the exported components differs from model.generate: first token mismatch "
                f"{self.first_mismatch}, max logit diff {self.max_logit_diff:.3e} (atol {atol:.0e})\n"
                f"exported: {self.sequences.tolist()}\ngenerate: {self.reference.tolist()}"
            )


def compare_with_generate(
    runner: GenerationRunner,
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    max_new_tokens: int = 20,
    generation_config: Any = None,
) -> GenerationParity:
    """Run ``runner`` and ``model.generate`` greedily on the same inputs and compare.

    Args:
        runner: a :class:`GenerationRunner` over the exported components.
        model: the eager model.
        inputs: generate-style inputs (``input_ids``, ``attention_mask``, ``pixel_values`` ...).
        max_new_tokens: tokens to generate.
        generation_config: the ``GenerationConfig`` the components were exported with (its cache
            settings are used for the reference run; copied).

    Returns:
        A :class:`GenerationParity`.
    """
    from transformers import GenerationConfig

    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.do_sample = False
    config.num_beams = 1
    config.max_new_tokens = max_new_tokens
    config.output_logits = True
    config.return_dict_in_generate = True
    with torch.no_grad():
        reference = model.generate(**dict(inputs), generation_config=config)
    # model.generate takes the whole sample; the runner refuses inputs no exported component reads
    # (a processor's token_type_ids the split leaves unused), so only those it reads are passed
    accepted = accepted_input_keys(runner.plan) if isinstance(runner, GenerationRunner) else None
    extra = {k: v for k, v in inputs.items() if k not in _PROMPT_KEYS and (accepted is None or k in accepted)}
    sequences = runner.generate(
        inputs.get("input_ids"), inputs.get("attention_mask"), max_new_tokens=max_new_tokens, **extra
    )
    mismatch = None
    length = min(sequences.shape[1], reference.sequences.shape[1])
    differ = (sequences[:, :length] != reference.sequences[:, :length]).nonzero()
    if differ.numel():
        row, col = (int(v) for v in differ[0])
        mismatch = (row, col)
    elif sequences.shape != reference.sequences.shape:
        mismatch = (0, length)
    if len(runner.last_logits) == len(reference.logits):
        diff = max(
            float((ours - theirs.float()).abs().max())
            for ours, theirs in zip(runner.last_logits, reference.logits)
        )
    else:
        diff = float("inf")
    return GenerationParity(sequences, reference.sequences, diff, mismatch, tuple(reference.logits))
