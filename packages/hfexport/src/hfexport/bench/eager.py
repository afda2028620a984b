"""The eager PyTorch reference row of ``hfexport bench``: the checkpoint itself, in fp32.

Opened like a folder (:class:`hfexport.bench.runtimes.OpenedFolder`) so it is measured by the same
child (:mod:`hfexport.bench.child`) with the same timing as every artifact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def model_folder(spec: str) -> Path:
    """The local folder of a model spec: ``PATH`` as it is, ``pkg:<import_name>`` resolved
    (:func:`hfexport.checkpoints.resolve_package_model`).

    Raises:
        FileNotFoundError: the folder does not exist (``tiny:`` specs have no folder, no tokenizer).
    """
    if spec.startswith("pkg:"):
        from hfexport.checkpoints import resolve_package_model

        return resolve_package_model(spec[len("pkg:") :])
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--reference {spec!r} is not a model folder; pass a local checkpoint folder or pkg:<import_name>"
        )
    return path


class EagerModel:
    """The checkpoint's causal LM in fp32 eval mode: greedy ``generate`` and a forward's logits."""

    logits_note = ""

    def __init__(self, spec: str, threads: int) -> None:
        import torch

        from hfexport.checkpoints import load_model

        torch.set_num_threads(max(1, int(threads)))
        self.model = load_model(str(spec), task="text-generation").model.float().eval()

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        import torch

        prompt = torch.as_tensor([list(ids)], dtype=torch.int64)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return [int(t) for t in out[0, prompt.shape[1] :].tolist()]

    def logits(self, ids: Sequence[int]) -> Any:
        import torch

        with torch.no_grad():
            return (
                self.model(input_ids=torch.as_tensor([list(ids)], dtype=torch.int64))
                .logits[0]
                .float()
                .numpy()
            )


def open_eager(spec: Path, threads: int) -> EagerModel:
    """Opener of the eager row (``spec`` is the ``--reference`` string carried as a path)."""
    return EagerModel(str(spec), threads)
