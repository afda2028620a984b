"""Run an ``ExportedProgram`` on forward kwargs and name its outputs like the eager model's."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.errors import UnsupportedInputError
from hfexport.inputs.flags import fill_output_flags, program_output_flags
from hfexport.tensors import get_leaf_tensors
from hfexport_dynamo.flat_io import FLAT_SEPARATOR, flat_inputs, leaf_path, takes_flat_inputs

__all__ = ["ProgramRunner", "program_input_names"]


def program_input_names(program: torch.export.ExportedProgram) -> list[str]:
    """The forward kwarg names ``program.module()`` takes, in export order.

    Args:
        program: a program exported from keyword inputs (as :func:`hfexport.capture.capture` does).

    Returns:
        The names, e.g. ``["input_ids", "attention_mask"]``; empty for a program exported from
        positional arguments only. For a program with flat inputs
        (:func:`hfexport_dynamo.flat_io.flatten_program_io`) these are the forward kwargs the leaves
        came from (``cache`` for ``cache__layers__0__keys``).
    """
    spec = program.call_spec.in_spec
    if spec is None:
        return []
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if len(children) < 2 or children[1].type is not dict:
        return []
    names = [str(name) for name in children[1].context]
    if takes_flat_inputs(program):
        names = list(dict.fromkeys(name.split(FLAT_SEPARATOR, 1)[0] for name in names))
    return names


class ProgramRunner:
    """Callable running an ``ExportedProgram``: forward kwargs -> ``{output_leaf_path: tensor}``.

    The module is built once (``program.module()``) on first use. Forward kwargs are given to a
    program with flat inputs (every ``.pt2`` hfexport writes, see :mod:`hfexport_dynamo.flat_io`) as
    their leaves (``cache`` -> ``cache__layers__0__keys`` ...; the same tensor objects, so in-place
    static-cache updates reach the caller's cache). Outputs are flattened with
    :func:`hfexport.tensors.get_leaf_tensors` and flat names mapped back, so they carry the eager
    output's leaf paths (``logits``, ``last_hidden_state``, ``cache.layers.0.keys``, ...).

    The output flags the program was exported with (``use_cache``, ``return_dict``: constant
    inputs of a program captured from kwargs that carried them) may be left out; they are filled
    in with their captured values (:func:`hfexport.inputs.flags.fill_output_flags`).

    Args:
        program: the exported program.

    Raises (on call):
        UnsupportedInputError: the kwargs miss an input the program was exported with, or add
            one it was not exported with (the message lists both sets); an output flag differs
            from its captured value (the message names it).
        ValueError: an input shape violates the program's shape guards (the input shapes, torch's
            guard, e.g. ``Guard failed: input_ids.size()[0] == 1``, and what to do).
    """

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        self.program = program
        self.input_names = program_input_names(program)
        #: ``{flag: value}`` the program takes as constant inputs (filled in when left out)
        self.output_flags = program_output_flags(program)
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
        """Run the program on forward kwargs ``inputs``; return its leaf tensors by path.

        Raises:
            UnsupportedInputError: inputs missing or not taken by the program.
            ValueError: an input breaks one of the program's shape guards (an axis the capture
                fixed): the message names the shapes and what to do
                (:func:`hfexport.generation.runner.shape_guard_error`).
        """
        flat = takes_flat_inputs(self.program)
        inputs = fill_output_flags(inputs, self.output_flags)
        kwargs = flat_inputs(inputs) if flat else dict(inputs)
        expected = self.program.call_spec.in_spec.child(1).context if flat else self.input_names
        if expected:
            missing = [name for name in expected if name not in kwargs]
            extra = sorted(set(kwargs) - set(expected))
            if missing or extra:
                leaves = " (cache leaves are named like cache__layers__0__keys)" if flat else ""
                raise UnsupportedInputError(
                    f"the exported program takes the inputs {list(expected)}{leaves}; missing {missing}, "
                    f"unexpected {extra}. Pass exactly the inputs the model was exported with "
                    "(None where the sample had None)."
                )
        with torch.no_grad():
            try:
                outputs = self.module(**kwargs)
            except AssertionError as exc:  # torch's "Guard failed: ..." on a shape the capture fixed
                from hfexport.generation.runner import shape_guard_error

                error = shape_guard_error(exc, kwargs)
                if error is None:
                    raise
                raise error from exc
        return {leaf_path(name): value for name, value in get_leaf_tensors(outputs).items()}
