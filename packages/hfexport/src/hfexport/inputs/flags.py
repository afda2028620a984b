"""Output flags (``use_cache``, ``output_attentions``, ``output_hidden_states``, ``return_dict``).

They select outputs rather than feed the graph (python bools are not graph inputs), so
:func:`hfexport.inputs.prepare_for_export` lifts them out of the kwargs and
:func:`apply_output_flags` applies them to the model's configs for the ``with`` body only.

A captured program still takes them (issue 26: an exported component accepts the kwargs it was
exported with): :func:`hfexport.capture.capture` adds the flags of ``report.output_flags`` to the
program's call signature as constants, which ``torch.export`` guards (another value fails). A
runtime whose graph holds no such constant (ONNX, OpenVINO) checks them with
:func:`check_output_flags` and drops them; a runner whose program takes them (``ExportedProgram``,
ExecuTorch) fills the ones a caller leaves out with :func:`fill_output_flags`.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import ModelOutput

from hfexport.errors import UnsupportedInputError
from hfexport.inputs.config_undo import ConfigChanges, model_configs

__all__ = [
    "OUTPUT_FLAG_KEYS",
    "apply_output_flags",
    "check_output_flags",
    "fill_output_flags",
    "program_output_flags",
    "with_output_flags",
]

#: Forward kwargs that select outputs; lifted into the config rather than traced.
OUTPUT_FLAG_KEYS: tuple[str, ...] = ("use_cache", "output_attentions", "output_hidden_states", "return_dict")


_MISSING = object()


def program_output_flags(program: Any) -> dict[str, Any]:
    """The output flags an ``ExportedProgram`` takes as constant inputs, with their captured values.

    Args:
        program: a ``torch.export.ExportedProgram`` (captured by :func:`hfexport.capture.capture`).

    Returns:
        ``{flag: value}`` (e.g. ``{"use_cache": True, "return_dict": True}``); ``{}`` for a program
        captured without flags, or an object that is not an ``ExportedProgram``.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind

    signature = getattr(program, "graph_signature", None)
    if signature is None:
        return {}
    return {
        spec.arg.name: spec.arg.value
        for spec in signature.input_specs
        if spec.kind == InputKind.USER_INPUT
        and isinstance(spec.arg, ConstantArgument)
        and spec.arg.name in OUTPUT_FLAG_KEYS
    }


def _refuse(name: str, given: Any, captured: Any) -> None:
    raise UnsupportedInputError(
        f"{name}={given!r}, but this program was exported with {name}={captured!r}: an output flag selects "
        f"what the graph computes and is fixed at export; pass {name}={captured!r} (or leave it out), or "
        f"export again with {name}={given!r} in the sample inputs"
    )


def fill_output_flags(kwargs: Mapping[str, Any], captured: Mapping[str, Any]) -> dict[str, Any]:
    """Forward kwargs for a program that takes its output flags: ``kwargs`` plus every captured
    flag it leaves out.

    Args:
        kwargs: forward kwargs, with or without the flags.
        captured: ``{flag: value}`` the program was exported with (:func:`program_output_flags`).

    Returns:
        A new dict: ``kwargs`` first, then the missing flags with their captured values.

    Raises:
        UnsupportedInputError: a flag of ``kwargs`` differs from its captured value (the message
            names the flag and both values).
    """
    filled = dict(kwargs)
    for name, value in captured.items():
        if name not in filled:
            filled[name] = value
        elif filled[name] != value:
            _refuse(name, filled[name], value)
    return filled


def check_output_flags(kwargs: Mapping[str, Any], captured: Mapping[str, Any]) -> dict[str, Any]:
    """Forward kwargs for a graph that holds no output flags: ``kwargs`` without them, after each
    given flag was checked against its captured value.

    Args:
        kwargs: forward kwargs, with or without the flags.
        captured: ``{flag: value}`` the graph was exported with (a flag not in it is dropped
            unchecked: the graph was exported without it).

    Returns:
        A new dict without the keys of :data:`OUTPUT_FLAG_KEYS`.

    Raises:
        UnsupportedInputError: a given flag differs from its captured value (the message names it).
    """
    for name, value in captured.items():
        if name in kwargs and kwargs[name] != value:
            _refuse(name, kwargs[name], value)
    return {k: v for k, v in kwargs.items() if k not in OUTPUT_FLAG_KEYS}


def with_output_flags(
    run: Callable[[dict[str, Any]], Any], flags: Mapping[str, Any] | None
) -> Callable[[dict[str, Any]], Any]:
    """``run`` called with the exported kwargs: each call's kwargs get the output flags ``flags``
    the artifact was exported with (:func:`fill_output_flags`); ``run`` itself when there are none."""
    if not flags:
        return run
    captured = dict(flags)

    def call(kwargs: dict[str, Any]) -> Any:
        return run(fill_output_flags(kwargs, captured))

    return call


def _wrap_forward_return_dict(model: torch.nn.Module, return_dict: bool) -> Callable[[], None]:
    """Make ``model(...)`` return a tuple (False) or a ModelOutput (True); return the undo.

    The wrapper is a method bound to ``model`` (``types.MethodType``), not a closure over it: a
    ``copy.deepcopy(model)`` taken inside the ``with`` body (a backend's quantized copy) then calls
    the copy's own forward. A closure would keep calling the original model, so the copy's
    transformed weights would never be traced (measured: an ExecuTorch ``8da4w`` generation export
    of GPT-2 captured the fp32 weights, since generation sample inputs carry ``return_dict``).
    """
    previous = model.__dict__.get("forward", _MISSING)
    original = model.forward
    if previous is _MISSING:
        original = None  # resolved on the bound instance at call time (the copy's own forward)

    @functools.wraps(type(model).forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if return_dict and getattr(getattr(self, "config", None), "return_dict", True) is False:
            kwargs.setdefault("return_dict", True)
        inner = original if original is not None else type(self).forward.__get__(self)
        output = inner(*args, **kwargs)
        if not return_dict and isinstance(output, ModelOutput):
            output = output.to_tuple()
        return output

    model.forward = types.MethodType(forward, model)

    def undo() -> None:
        if previous is _MISSING:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = previous

    return undo


@contextlib.contextmanager
def apply_output_flags(model: Any, output_flags: Mapping[str, Any]) -> Iterator[None]:
    """Apply output flags to the model for the duration of the ``with`` body.

    Each flag but ``return_dict`` is set on ``model.config`` (created if the config lacks it)
    and on every other config of the model that already has the attribute: nested sub-configs
    (``text_config``, ``vision_config``, ...) and the configs of sub-models; transformers reads
    ``use_cache``, ``output_attentions`` and ``output_hidden_states`` from there when the kwarg
    is absent.

    ``return_dict`` is not written to the config: in transformers 5.x ``config.return_dict``
    is read by every nested sub-model, so ``False`` there makes the inner model return a tuple
    to an outer model that expects a ``ModelOutput``. Instead ``model.forward`` is wrapped on
    the instance: with ``False`` a ``ModelOutput`` result is turned into ``output.to_tuple()``
    (None fields dropped, as transformers does); with ``True`` nothing changes unless the
    config says ``return_dict=False``, in which case ``return_dict=True`` is passed.

    On exit, also when the body raises, every config is put back exactly as it was: previous
    values restored, attributes that did not exist deleted, side effects of property setters
    undone; the forward wrapper is removed.

    Args:
        model: a ``PreTrainedModel`` (a ``torch.nn.Module`` with a transformers ``config``).
        output_flags: ``{name: value}``, typically the ``output_flags`` returned by
            :func:`prepare_for_export` (``use_cache``, ``output_attentions``,
            ``output_hidden_states``, ``return_dict``). ``None`` values are ignored.

    Yields:
        Nothing; the model is configured inside the ``with`` body.

    Raises:
        UnsupportedInputError: a flag is refused by the config, e.g. ``output_attentions=True``
            with an attention implementation other than ``eager`` (nothing stays changed).
        TypeError: ``model`` has no transformers config and a flag has a non-None value (with no
            flags, a plain module passes through unchanged).
    """
    root = getattr(model, "config", None)
    if not isinstance(root, PreTrainedConfig):
        if not any(value is not None for value in output_flags.values()):
            yield  # a plain module: no config flags to apply
            return
        raise TypeError(
            f"apply_output_flags needs a model with a transformers config to apply {sorted(output_flags)}, got "
            f"{type(model).__name__}; pass flags of a plain module as forward kwargs (prepare_for_export keeps them)"
        )
    changes = ConfigChanges()
    undo_forward: Callable[[], None] | None = None
    configs = model_configs(model)
    try:
        for name, value in output_flags.items():
            if value is None:
                continue
            if name == "return_dict":
                undo_forward = _wrap_forward_return_dict(model, bool(value))
                continue
            for config in configs:
                if config is root or hasattr(config, name):
                    try:
                        changes.setattr(config, name, value)
                    except ValueError as error:
                        raise UnsupportedInputError(
                            f"cannot set {name}={value!r} on {type(config).__name__} for export: {error} "
                            + (
                                "Load the model with attn_implementation='eager' to export attention weights, "
                                "or drop output_attentions from the inputs."
                                if name == "output_attentions"
                                else f"Drop {name} from the inputs."
                            )
                        ) from error
        yield
    finally:
        if undo_forward is not None:
            undo_forward()
        changes.undo()
