"""Run an OpenVINO model on forward kwargs: what validation and generation call.

:class:`OpenvinoRunner` compiles an ``openvino.Model`` (or a saved ``openvino_model.xml``) with
``openvino.Core().compile_model`` on the configured device, feeds every model input by name from
the leaf tensors of the forward kwargs and returns ``{leaf_path: torch.Tensor}`` named like the
eager model's outputs (see :mod:`hfexport_openvino.naming`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hfexport.errors import UnsupportedInputError
from hfexport.tensors import get_leaf_tensors
from hfexport_openvino.naming import io_names_from_model

__all__ = [
    "PRECISION_KEY",
    "OpenvinoRunner",
    "compile_properties",
    "output_port_name",
    "recorded_precision_hint",
]

#: ``rt_info`` path where the export records ``OpenvinoConfig.inference_precision_hint``.
PRECISION_KEY = ["hfexport", "inference_precision_hint"]


def recorded_precision_hint(model: Any) -> str | None:
    """The precision hint an export recorded in ``model``'s ``rt_info``, or ``None``."""
    if model.has_rt_info(PRECISION_KEY):
        return str(model.get_rt_info(PRECISION_KEY).astype(str))
    return None


def compile_properties(precision_hint: str | None) -> dict[str, str]:
    """``compile_model`` properties for a precision hint: ``{"INFERENCE_PRECISION_HINT": hint}``.

    ``None`` compiles with ``"f32"``: the CPU plugin otherwise runs bf16 on CPUs that have it,
    which no fp32 tolerance survives.
    """
    return {"INFERENCE_PRECISION_HINT": precision_hint or "f32"}


def _numpy(name: str, tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise UnsupportedInputError(
            f"input {name!r} is bfloat16, which numpy cannot hold; feed the OpenVINO model float32 inputs"
        )
    return tensor.detach().to("cpu").contiguous().numpy()


class OpenvinoRunner:
    """A compiled OpenVINO model fed with forward kwargs: ``runner(kwargs) -> {leaf_path: tensor}``.

    Args:
        model: an ``openvino.Model`` or the path of an ``openvino_model.xml`` (its ``.bin`` next to it).
        device: the OpenVINO device (``"CPU"`` ...).
        precision_hint: ``INFERENCE_PRECISION_HINT``; ``None`` takes the one the export recorded
            (:func:`recorded_precision_hint`), else ``"f32"`` (see :func:`compile_properties`).

    Raises (on call):
        UnsupportedInputError: the kwargs miss an input the model takes (the message lists the
            model's inputs and what was given), or give an output flag (``use_cache`` ...) another
            value than the model was exported with (flags are no model inputs: checked, dropped).

    An input of the exported program that the converted model has no Parameter for (the
    converter drops inputs nothing reads) must still be given, and is not fed.

    The model is compiled on first call; one infer request per runner, calls are serialised.
    """

    def __init__(self, model: Any, device: str = "CPU", precision_hint: str | None = None) -> None:
        import openvino as ov

        self.core = ov.Core()
        self.model = (
            self.core.read_model(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else model
        )
        self.names = io_names_from_model(self.model)
        self.device = device
        self.precision_hint = precision_hint or recorded_precision_hint(self.model)
        self._request: Any = None
        self._lock = threading.Lock()

    @property
    def input_names(self) -> list[str]:
        """The model's input names (leaf paths), in order."""
        return list(self.names.inputs)

    def _compiled(self) -> Any:
        if self._request is None:
            compiled = self.core.compile_model(
                self.model, self.device, compile_properties(self.precision_hint)
            )
            self._request = compiled.create_infer_request()
        return self._request

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run the model on forward kwargs ``inputs``; return ``{output leaf path: tensor}``."""
        from hfexport.inputs.flags import check_output_flags

        leaves = get_leaf_tensors(check_output_flags(inputs, self.names.output_flags))
        missing = [path for path in self.names.inputs.values() if path not in leaves]
        if missing:
            raise UnsupportedInputError(
                f"the OpenVINO model takes the inputs {list(self.names.inputs.values())}; missing {missing} "
                f"(given {sorted(leaves)}). Pass the inputs the model was exported with."
            )
        with self._lock:
            request = self._compiled()
            # an input the program never reads (OmDet-Turbo's classes_structure once its run-time
            # assertion is erased) has no port in the compiled model: it is checked, not fed
            ports = {name for port in request.model_inputs for name in port.get_names()}
            feed = {
                name: _numpy(path, leaves[path]) for name, path in self.names.inputs.items() if name in ports
            }
            results = request.infer(feed)
            out: dict[str, torch.Tensor] = {}
            for port, value in results.items():
                name = output_port_name(port, self.names.outputs)
                out[self.names.outputs.get(name, name)] = torch.from_numpy(np.array(value, copy=True))
        return out


def output_port_name(port: Any, recorded: Mapping[str, str]) -> str:
    """The name of a compiled model's output ``port`` under which the export recorded it.

    Compilation may merge an output's tensor with the tensor it was computed from (a multiply by
    a constant folded into a ``Gather``'s table, as in Gemma 3's scaled embedding), so the port
    carries several names, and ``get_any_name()`` may return the internal one (``"4"``) rather
    than the recorded ``"output"`` (issue 28). The recorded name wins; without one among the
    port's names, ``get_any_name()``.

    Args:
        port: an output port of a ``CompiledModel`` or ``Model``.
        recorded: ``{output name: leaf path}`` of the export (:attr:`IoNames.outputs`).
    """
    names = port.get_names()
    return next((name for name in sorted(names) if name in recorded), None) or port.get_any_name()
