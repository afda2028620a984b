"""Names of the OpenVINO model's inputs and outputs: the leaf paths of hfexport's naming.

Rule (as for every backend, see ``docs/backends/openvino.md``):

* an **input** is named by the leaf path of the forward kwarg it comes from, as
  :func:`hfexport.tensors.get_leaf_tensors` names it: ``input_ids``, ``attention_mask``,
  ``past_key_values.layers.0.keys``;
* an **output** is named by the leaf path of the eager model output: ``logits``,
  ``last_hidden_state``, ``past_key_values.layers.0.keys``;
* an output whose path is also an input's name gets the suffix :data:`COLLISION_SUFFIX`
  (``.out``), since OpenVINO tensor names are unique within a model;
* an output that is an input returned unchanged (a pass-through: the Result reads the Parameter)
  is the input's tensor, and keeps the input's name (no suffix).

The mapping ``{name: leaf path}`` is also stored in the IR's ``rt_info`` under ``hfexport``
(:data:`RT_INFO_KEY`), so a saved ``openvino_model.xml`` is run by :mod:`hfexport_openvino.runtime`
without the Python objects of the export.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from hfexport.tensors import get_leaf_tensors

__all__ = [
    "COLLISION_SUFFIX",
    "RT_INFO_KEY",
    "IoNames",
    "io_names_from_model",
    "name_model_io",
    "program_io_paths",
]

#: Suffix appended to an output name that is already an input name.
COLLISION_SUFFIX = ".out"
#: ``rt_info`` section holding the JSON ``{"inputs": {...}, "outputs": {...}}`` mapping.
RT_INFO_KEY = "hfexport"


@dataclass
class IoNames:
    """Model tensor names and the leaf paths they stand for.

    Attributes:
        inputs: ``{input name: forward kwarg leaf path}`` in model input order.
        outputs: ``{output name: model output leaf path}`` in model output order.
        output_flags: ``{flag: value}`` the program was exported with (``use_cache`` ...): no
            model inputs; the runner checks a given flag against them and drops it.
    """

    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    output_flags: dict[str, Any] = field(default_factory=dict)


def _key_path(keys: Sequence[Any]) -> str:
    parts = []
    for key in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def _leaf_paths(spec: pytree.TreeSpec, kwargs_only: bool) -> list[str]:
    """Leaf paths of ``spec`` in leaf order, named as :func:`get_leaf_tensors` names real leaves."""
    markers = [torch.empty(0) for _ in range(spec.num_leaves)]
    tree = pytree.tree_unflatten(markers, spec)
    if kwargs_only:
        args, kwargs = tree
        tree = {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    by_id = {id(t): path for path, t in get_leaf_tensors(tree).items()}
    keyed, _ = pytree.tree_flatten_with_path(tree)
    return [by_id.get(id(marker)) or _key_path(keys) for marker, (keys, _leaf) in zip(markers, keyed)]


def program_io_paths(program: torch.export.ExportedProgram) -> tuple[list[str], list[str]]:
    """Leaf paths of the tensor user inputs and user outputs of ``program``, in graph order.

    Args:
        program: a program captured from keyword inputs (:func:`hfexport.capture.capture`).

    Returns:
        ``(inputs, outputs)``: e.g. ``(["input_ids", "attention_mask"], ["logits",
        "past_key_values.layers.0.keys", ...])``; non-tensor (constant) leaves are left out, as
        ``openvino.convert_model`` leaves them out of the model's parameters and results.
    """
    signature = program.graph_signature
    in_paths = _leaf_paths(program.call_spec.in_spec, kwargs_only=True)
    user_inputs = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    inputs = [p for p, s in zip(in_paths, user_inputs) if isinstance(s.arg, TensorArgument)]
    out_paths = _leaf_paths(program.call_spec.out_spec, kwargs_only=False)
    user_outputs = [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    outputs = [p for p, s in zip(out_paths, user_outputs) if isinstance(s.arg, TensorArgument)]
    return inputs, outputs


def name_model_io(ov_model: Any, program: torch.export.ExportedProgram) -> IoNames:
    """Give the converted model's inputs and outputs their leaf-path names; record the mapping.

    Args:
        ov_model: the ``openvino.Model`` that ``openvino.convert_model(program)`` returned.
        program: the program it was converted from.

    Returns:
        The :class:`IoNames` now set on ``ov_model`` (also stored in its ``rt_info``).

    Raises:
        RuntimeError: the model has another number of inputs or outputs than the program's tensor
            user inputs/outputs (the conversion dropped or added one); the message lists both.
    """
    from hfexport.inputs.flags import program_output_flags

    in_paths, out_paths = program_io_paths(program)
    flags = program_output_flags(program)
    _drop_flag_parameters(ov_model, program, flags)
    _drop_constant_parameters(ov_model, program, len(in_paths))
    if not _inputs_line_up(ov_model, program):
        in_paths = _without_unread_inputs(ov_model, program, in_paths)
    if len(ov_model.inputs) != len(in_paths) or len(ov_model.outputs) != len(out_paths):
        raise RuntimeError(
            f"the OpenVINO model has {len(ov_model.inputs)} inputs / {len(ov_model.outputs)} outputs, the "
            f"program {len(in_paths)} ({in_paths}) / {len(out_paths)} ({out_paths}); cannot name them"
        )
    names = IoNames(output_flags=flags)
    for port, path in zip(ov_model.inputs, in_paths):
        port.get_tensor().set_names({path})
        names.inputs[path] = path
    taken = set(names.inputs)
    for port, path in zip(ov_model.outputs, out_paths):
        if _reads_parameter(port):
            # a pass-through output (an input returned as is: OmDet-Turbo's classes_structure) is the
            # Parameter's own tensor: it keeps the input's name (renaming it renamed the input too, and
            # the compiled model kept only the new name: the runner fed nothing and read back an empty
            # tensor where eager returns the input)
            names.outputs[port.get_any_name()] = path
            continue
        name = path
        while name in taken:
            name += COLLISION_SUFFIX
        taken.add(name)
        port.get_tensor().set_names({name})
        names.outputs[name] = path
    record: dict[str, Any] = {"inputs": names.inputs, "outputs": names.outputs}
    if flags:
        record["output_flags"] = flags
    ov_model.set_rt_info(json.dumps(record), [RT_INFO_KEY, "io"])
    return names


def _reads_parameter(port: Any) -> bool:
    """Whether the model output ``port`` is a Parameter's tensor (the input returned unchanged)."""
    node = port.get_node()
    if node.get_type_name() == "Result":  # Model.outputs may give the Result's port or its source's
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Parameter"


def _drop_flag_parameters(
    ov_model: Any, program: torch.export.ExportedProgram, flags: dict[str, Any]
) -> None:
    """Remove the parameters ``openvino.convert_model`` made of the program's output flags
    (``use_cache`` ...: constant inputs the graph never reads; OpenVINO 2026.x turns them into
    unused model parameters), so the model takes the tensor inputs only, as every other runtime's."""
    if not flags:
        return
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(ov_model.inputs) != len(user_inputs):
        return  # the conversion already left them out
    parameters = list(ov_model.get_parameters())
    for spec, parameter in zip(user_inputs, parameters):
        if isinstance(spec.arg, TensorArgument) or spec.arg.name not in flags:
            continue
        if not any(target for output in parameter.outputs() for target in output.get_target_inputs()):
            ov_model.remove_parameter(parameter)


def _drop_constant_parameters(
    ov_model: Any, program: torch.export.ExportedProgram, tensor_inputs: int
) -> None:
    """Remove the parameters ``openvino.convert_model`` made of the program's other constant
    (non-tensor) inputs, those that are not output flags: a Mixture-of-Experts language model's
    ``output_router_logits=False`` (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V's text model, issue 28).

    OpenVINO 2026.4 turns every ``ConstantArgument`` user input into a model parameter of dynamic
    element type and rank that nothing reads; the model then has more inputs than the program has
    tensor inputs and the runtime would ask for a value no caller has. Only unread parameters of
    dynamic element type are removed, and no more of them than the model has inputs in excess, so a
    tensor input the graph happens not to read is kept (its name is the program's).
    """
    excess = len(ov_model.inputs) - tensor_inputs
    if excess <= 0:
        return
    if not any(
        s.kind == InputKind.USER_INPUT and not isinstance(s.arg, TensorArgument)
        for s in program.graph_signature.input_specs
    ):
        return
    for parameter in list(ov_model.get_parameters()):
        if excess <= 0:
            break
        unread = not any(target for output in parameter.outputs() for target in output.get_target_inputs())
        if unread and parameter.get_element_type().is_dynamic():
            ov_model.remove_parameter(parameter)
            excess -= 1


def _tensor_placeholders(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The placeholder nodes of the program's tensor user inputs, in input order."""
    by_name = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    return [
        by_name[s.arg.name]
        for s in program.graph_signature.input_specs
        if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument) and s.arg.name in by_name
    ]


def _inputs_line_up(ov_model: Any, program: torch.export.ExportedProgram) -> bool:
    """Whether the model's parameters match the program's tensor inputs one by one (count, a static
    element type, the rank): the condition for naming them by position."""
    placeholders = _tensor_placeholders(program)
    if len(ov_model.inputs) != len(placeholders):
        return False
    for port, node in zip(ov_model.inputs, placeholders):
        val = node.meta.get("val")
        rank = port.get_partial_shape().rank
        if port.get_element_type().is_dynamic() or not isinstance(val, torch.Tensor):
            return False
        if rank.is_static and rank.get_length() != val.dim():
            return False
    return True


def _without_unread_inputs(
    ov_model: Any, program: torch.export.ExportedProgram, in_paths: list[str]
) -> list[str]:
    """Line the model's parameters up with the program's inputs when the conversion dropped tensor
    inputs the graph never reads and kept parameters of constant inputs instead.

    OpenVINO 2026.4 leaves a tensor input the graph does not read out of the model (T5Gemma-2's
    prefill takes ``pixel_values`` and reads the precomputed ``encoder_outputs`` only), yet turns an
    empty cache and the ``use_cache`` constant into unread parameters of dynamic element type and
    rank: the counts still agreed, the names went to the wrong parameters (``pixel_values`` on the
    mask) and the CPU plugin refused the dynamic-rank parameter at compile time ("Check
    '!shape.rank().is_dynamic()' failed", issue 28). Here every unread parameter of dynamic element
    type is removed (no program tensor input has one) and the unread tensor inputs are left out of
    the names, provided the model then lines up with the remaining inputs; otherwise nothing is
    changed (the caller's count check reports the mismatch). The runtime feeds and checks the
    model's inputs only, so callers may still pass the left-out inputs.

    Returns:
        The input paths to name the model's parameters with, in order.
    """
    placeholders = _tensor_placeholders(program)
    if len(placeholders) != len(in_paths):
        return in_paths
    read = [(path, node) for path, node in zip(in_paths, placeholders) if node.users]
    parameters = list(ov_model.get_parameters())
    removable = {
        index
        for index, parameter in enumerate(parameters)
        if parameter.get_element_type().is_dynamic()
        and not any(target for output in parameter.outputs() for target in output.get_target_inputs())
    }
    kept = [parameter for index, parameter in enumerate(parameters) if index not in removable]
    if len(kept) != len(read):
        return in_paths
    for parameter, (_, node) in zip(kept, read):
        rank = parameter.get_partial_shape().rank
        if rank.is_static and rank.get_length() != node.meta["val"].dim():
            return in_paths
    for index in sorted(removable):
        ov_model.remove_parameter(parameters[index])
    return [path for path, _ in read]


def io_names_from_model(ov_model: Any) -> IoNames:
    """The :class:`IoNames` recorded by :func:`name_model_io` (or the tensor names themselves).

    Works on an ``openvino.Model`` and on a ``CompiledModel``'s ports alike: a model without the
    ``rt_info`` record maps every input/output name to itself.
    """
    try:
        data = json.loads(str(ov_model.get_rt_info([RT_INFO_KEY, "io"]).astype(str)))
        return IoNames(dict(data["inputs"]), dict(data["outputs"]), dict(data.get("output_flags") or {}))
    except Exception:  # not recorded (a model from elsewhere): the names are the paths
        return IoNames(
            {p.get_any_name(): p.get_any_name() for p in ov_model.inputs},
            {p.get_any_name(): p.get_any_name() for p in ov_model.outputs},
        )
