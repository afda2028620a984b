"""Names of the ONNX graph inputs and outputs.

Rule (documented in ``docs/backends/onnx.md``):

* a graph **input** is named by the leaf path of the forward kwarg it comes from, as
  :func:`hfexport.tensors.get_leaf_tensors` names it: ``input_ids``, ``attention_mask``,
  ``past_key_values.layers.0.keys``;
* a graph **output** is named by the leaf path of the eager model output: ``logits``,
  ``last_hidden_state``, ``cache.layers.0.keys``;
* an output whose path is also the name of an input (a cache passed in and returned updated)
  gets the suffix ``.out`` (``past_key_values.layers.0.keys.out``); the suffix is repeated in the
  unlikely case that the suffixed name is taken as well;
* a forward that returns a bare tensor has one output whose leaf path is the empty string; its
  graph output is named :data:`BARE_OUTPUT_NAME` (``output``): ONNX treats an empty value name as
  "no value", and onnxscript's optimizer gives such an output a generated name (issue 28).

The mapping graph name -> leaf path is stored in the model's ``metadata_props`` (keys
:data:`INPUTS_KEY` and :data:`OUTPUTS_KEY`, JSON objects), so a saved ``model.onnx`` can be run
by :mod:`hfexport_onnx.runtime` without the Python objects of the export.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from hfexport.tensors import get_leaf_tensors

__all__ = [
    "BARE_OUTPUT_NAME",
    "COLLISION_SUFFIX",
    "INPUTS_KEY",
    "OUTPUTS_KEY",
    "IoNames",
    "assign_io_names",
    "graph_output_names",
    "io_names_from_metadata",
    "program_io_paths",
]

logger = logging.getLogger(__name__)

#: Suffix appended to an output name that is already the name of a graph input.
COLLISION_SUFFIX = ".out"
#: Graph name of the output of a forward that returns a bare tensor (leaf path ``""``).
BARE_OUTPUT_NAME = "output"
#: ``metadata_props`` key holding ``{graph input name: leaf path}`` (JSON).
INPUTS_KEY = "hfexport.inputs"
#: ``metadata_props`` key holding ``{graph output name: leaf path}`` (JSON).
OUTPUTS_KEY = "hfexport.outputs"
#: ``metadata_props`` key holding ``{output flag: value}`` the graph was exported with (JSON;
#: written only when there are flags). The graph takes no such input; the runner checks them.
OUTPUT_FLAGS_KEY = "hfexport.output_flags"


@dataclass
class IoNames:
    """Graph names and the leaf paths they stand for.

    Attributes:
        inputs: ``{graph input name: forward kwarg leaf path}``, in graph order.
        outputs: ``{graph output name: model output leaf path}``, in graph order.
        pruned_inputs: leaf paths of tensor inputs the graph does not take (unused by the model).
        output_flags: ``{flag: value}`` the program was exported with (``use_cache`` ...); not
            graph inputs (``torch.onnx`` drops constant inputs): the runner checks a given flag
            against them and drops it.
    """

    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    pruned_inputs: list[str] = field(default_factory=list)
    output_flags: dict[str, Any] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, str]:
        """The ``metadata_props`` entries recording this mapping (and the output flags, if any)."""
        entries = {INPUTS_KEY: json.dumps(self.inputs), OUTPUTS_KEY: json.dumps(self.outputs)}
        if self.output_flags:
            entries[OUTPUT_FLAGS_KEY] = json.dumps(self.output_flags)
        return entries


def _key_path(keys: Sequence[Any]) -> str:
    parts: list[str] = []
    for key in keys:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(str(key.name))
        else:
            parts.append(str(key))
    return ".".join(parts)


def _leaf_paths(spec: pytree.TreeSpec, strip_args: bool) -> list[str]:
    """Leaf paths of a pytree spec, in leaf order.

    Rebuilds the structure with a distinct marker tensor per leaf and names each marker the way
    :func:`get_leaf_tensors` names the leaves of a real model input/output; a leaf that walk does
    not report (e.g. a tensor inside a cache that is not cache state) falls back to its pytree
    key path.
    """
    markers = [torch.empty(0) for _ in range(spec.num_leaves)]
    tree = pytree.tree_unflatten(markers, spec)
    if strip_args:
        args, kwargs = tree
        tree = {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    by_id = {id(t): path for path, t in get_leaf_tensors(tree).items()}
    keyed, _ = pytree.tree_flatten_with_path(tree)
    paths = []
    for marker, (keys, _leaf) in zip(markers, keyed):
        paths.append(by_id.get(id(marker)) or _key_path(keys))
    return paths


def program_io_paths(program: torch.export.ExportedProgram) -> tuple[dict[str, str], list[str]]:
    """Leaf paths of an exported program's user inputs and user outputs.

    Args:
        program: a program captured from keyword inputs (``args=()``), as
            :func:`hfexport.capture.capture` produces.

    Returns:
        ``(inputs, outputs)``: ``inputs`` maps the placeholder name of every tensor user input
        to its leaf path (``{"input_ids": "input_ids", "past_key_values_layers_0_keys":
        "past_key_values.layers.0.keys"}``); ``outputs`` lists the leaf path of every tensor
        user output in output order.
    """
    in_paths = _leaf_paths(program.call_spec.in_spec, strip_args=True)
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    inputs: dict[str, str] = {}
    for spec, path in zip(user_inputs, in_paths):
        if isinstance(spec.arg, TensorArgument):
            inputs[spec.arg.name] = path
    out_paths = _leaf_paths(program.call_spec.out_spec, strip_args=False)
    user_outputs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    outputs = [path for spec, path in zip(user_outputs, out_paths) if isinstance(spec.arg, TensorArgument)]
    return inputs, outputs


def graph_output_names(output_paths: Sequence[str], input_names: Sequence[str]) -> list[str]:
    """Graph output names for the output leaf paths ``output_paths``.

    The empty leaf path (a bare tensor output) becomes :data:`BARE_OUTPUT_NAME`; then the collision
    rule: outputs named like an input get :data:`COLLISION_SUFFIX`.

    >>> graph_output_names(["logits", "cache.layers.0.keys"], ["input_ids", "cache.layers.0.keys"])
    ['logits', 'cache.layers.0.keys.out']
    >>> graph_output_names([""], ["x"])
    ['output']

    Raises:
        ValueError: two outputs share a leaf path.
    """
    duplicates = sorted({p for p in output_paths if list(output_paths).count(p) > 1})
    if duplicates:
        raise ValueError(f"two outputs of the program share the leaf path(s) {duplicates}")
    taken = set(input_names) | set(output_paths)
    names = []
    for path in output_paths:
        name = path or BARE_OUTPUT_NAME
        if name in input_names:
            name += COLLISION_SUFFIX
            while name in taken:
                name += COLLISION_SUFFIX
        taken.add(name)
        names.append(name)
    return names


def _unique(base: str, used: set[str]) -> str:
    i = 0
    while f"{base}__{i}" in used:
        i += 1
    return f"{base}__{i}"


def assign_io_names(model: Any, program: torch.export.ExportedProgram) -> IoNames:
    """Rename the inputs and outputs of ``model``'s main graph to leaf paths, in place.

    Args:
        model: the ``onnx_ir.Model`` translated from ``program`` (``ONNXProgram.model``).
        program: the exported program it was translated from (the one passed to
            ``torch.onnx.export``).

    Returns:
        The :class:`IoNames` applied; it is also written to ``model.metadata_props``.

    Raises:
        ValueError: the graph's inputs or outputs cannot be matched to the program's user inputs
            and outputs (a translation that added or dropped outputs).

    An output that is also a graph input, an initializer or another output's value gets an
    ``Identity`` node, so every output has its own value to name.
    """
    import onnx_ir as ir

    graph = model.graph
    input_paths, output_paths = program_io_paths(program)
    initializer_names = set(graph.initializers)
    graph_inputs = [v for v in graph.inputs if v.name not in initializer_names]

    from hfexport.inputs.flags import program_output_flags

    names = IoNames(output_flags=program_output_flags(program))
    # Inputs: by placeholder name, falling back to position when torch.onnx renamed them.
    by_name = {v.name: v for v in graph_inputs}
    matched = [(by_name[n], p) for n, p in input_paths.items() if n in by_name]
    if len(matched) == len(graph_inputs):
        pairs = matched
        names.pruned_inputs = [p for n, p in input_paths.items() if n not in by_name]
    elif len(graph_inputs) == len(input_paths):
        pairs = list(zip(graph_inputs, input_paths.values()))
    else:
        raise ValueError(
            f"cannot match ONNX graph inputs {[v.name for v in graph_inputs]} to the program inputs "
            f"{list(input_paths)}"
        )

    used = {v.name for v in graph_inputs} | initializer_names
    for node in graph.all_nodes():  # every value name, subgraphs included
        used.update(o.name for o in node.outputs if o.name)
    target_input_names = [p for _, p in pairs]
    # Free every target name first (an internal value may already carry it).
    targets = set(target_input_names) | set(graph_output_names(output_paths, target_input_names))
    wanted = {id(v) for v, _ in pairs}
    for node in graph.all_nodes():
        for out in node.outputs:
            if out.name in targets:
                out.name = _unique(out.name, used)
                used.add(out.name)
    for value in graph_inputs:
        if value.name in targets and id(value) not in wanted:
            value.name = _unique(value.name, used)
    for value, path in pairs:
        value.name = path
        names.inputs[path] = path

    outputs = list(graph.outputs)
    if len(outputs) != len(output_paths):
        raise ValueError(
            f"the ONNX graph has {len(outputs)} outputs but the program has {len(output_paths)} tensor user "
            f"outputs ({output_paths}); cannot name them"
        )
    out_names = graph_output_names(output_paths, target_input_names)
    seen: set[int] = set()
    for index, (value, name, path) in enumerate(zip(outputs, out_names, output_paths)):
        if value.is_graph_input() or value.is_initializer() or id(value) in seen or value.producer() is None:
            identity = ir.Node("", "Identity", [value], num_outputs=1)
            graph.append(identity)
            new_value = identity.outputs[0]
            new_value.shape = value.shape
            new_value.type = value.type
            graph.outputs[index] = new_value
            value = new_value
        seen.add(id(value))
        value.name = name
        names.outputs[name] = path
    model.metadata_props.update(names.to_metadata())
    return names


def io_names_from_metadata(metadata: Mapping[str, str]) -> IoNames | None:
    """Read the mapping written by :func:`assign_io_names` from ``metadata_props``.

    Returns:
        The :class:`IoNames`, or ``None`` when the model carries no hfexport mapping.

    Raises:
        ValueError: the metadata is present but not valid JSON objects.
    """
    if INPUTS_KEY not in metadata or OUTPUTS_KEY not in metadata:
        return None
    try:
        inputs = json.loads(metadata[INPUTS_KEY])
        outputs = json.loads(metadata[OUTPUTS_KEY])
    except json.JSONDecodeError as exc:
        raise ValueError(f"model metadata {INPUTS_KEY}/{OUTPUTS_KEY} is not valid JSON: {exc}") from exc
    if not isinstance(inputs, dict) or not isinstance(outputs, dict):
        raise ValueError(f"model metadata {INPUTS_KEY}/{OUTPUTS_KEY} must be JSON objects")
    try:
        flags = json.loads(metadata.get(OUTPUT_FLAGS_KEY) or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"model metadata {OUTPUT_FLAGS_KEY} is not valid JSON: {exc}") from exc
    if not isinstance(flags, dict):
        raise ValueError(f"model metadata {OUTPUT_FLAGS_KEY} must be a JSON object")
    return IoNames(inputs=dict(inputs), outputs=dict(outputs), output_flags=dict(flags))
