"""Run an ``ExportedProgram`` on forward kwargs and name its outputs like the eager model's."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.errors import UnsupportedInputError
from hfexport.tensors import get_leaf_tensors

__all__ = ["ProgramRunner", "program_input_names"]


def program_input_names(program: torch.export.ExportedProgram) -> list[str]:
    """The forward kwarg names ``program.module()`` takes, in export order.

    Args:
        program: a program exported from keyword inputs (as :func:`hfexport.capture.capture` does).

    Returns:
        The names, e.g. ``["input_ids", "attention_mask"]``; empty for a program exported from
        positional arguments only.
    """
    spec = program.call_spec.in_spec
    if spec is None:
        return []
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if len(children) < 2 or children[1].type is not dict:
        return []
    return [str(name) for name in children[1].context]


class ProgramRunner:
    """Callable running an ``ExportedProgram``: forward kwargs -> ``{output_leaf_path: tensor}``.

    The module is built once (``program.module()``) on first use. Outputs are flattened with
    :func:`hfexport.tensors.get_leaf_tensors`, so they carry the eager output's names
    (``logits``, ``last_hidden_state``, ``cache.layers.0.keys``, ...).

    Args:
        program: the exported program.

    Raises (on call):
        UnsupportedInputError: the kwargs miss an input the program was exported with, or add
            one it was not exported with (the message lists both sets).
        AssertionError: an input shape violates the program's shape guards (torch's message,
            e.g. ``Guard failed: input_ids.size()[0] == 1``).
    """

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        self.program = program
        self.input_names = program_input_names(program)
        self._module: torch.nn.Module | None = None
        self._lock = threading.Lock()

    @property
    def module(self) -> torch.nn.Module:
        """``program.module()``, built on first access."""
        with self._lock:
            if self._module is None:
                self._module = self.program.module()
            return self._module

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run the program on forward kwargs ``inputs``; return its leaf tensors by path."""
        if self.input_names:
            missing = [name for name in self.input_names if name not in inputs]
            extra = sorted(set(inputs) - set(self.input_names))
            if missing or extra:
                raise UnsupportedInputError(
                    f"the exported program takes the inputs {self.input_names}; missing {missing}, "
                    f"unexpected {extra}. Pass exactly the inputs the model was exported with "
                    "(None where the sample had None)."
                )
        with torch.no_grad():
            outputs = self.module(**dict(inputs))
        return get_leaf_tensors(outputs)
