"""Flat tensor inputs and outputs for ``ExportedProgram`` files, so stock ``torch.export.load`` runs them.

A program captured from a causal LM takes and returns transformers objects: its input/output
pytree specs name ``transformers.cache_utils.DynamicCache``, ``CausalLMOutputWithPast`` ... and a
process that has not registered those classes as pytree nodes cannot even deserialise the
``.pt2``. The graph itself only ever sees tensors: the specs just say how to split the caller's
objects into leaves and how to rebuild the outputs. :func:`flatten_program_io` replaces the two
specs of the program's root call with flat ones (a dict of named leaves in, a dict of named
leaves out); the graph, its weights and its shape guards are untouched. Afterwards::

    program = torch.export.load("model.pt2")               # torch only: no transformers, no hfexport
    out = program.module()(input_ids=ids, attention_mask=mask,
                           cache__layers__0__keys=k0, cache__layers__0__values=v0, ...)
    out["logits"], out["cache__layers__0__keys"]            # a dict of tensors

Leaf names: a leaf's dotted path (:func:`hfexport.tensors.get_leaf_tensors` spelling:
``cache.layers.0.keys``) with every ``.`` replaced by ``__`` (:func:`flat_name`), because the names
become keyword parameters of the generated ``forward`` and must be Python identifiers. Tensor
kwargs (``input_ids``) keep their names. :func:`leaf_path` maps a flat name back; the mapping is
also recorded in the export report (``extra.flat_io``) and in each generation component's
manifest metadata (:func:`io_names`).

:class:`hfexport_dynamo.runtime.ProgramRunner` does the conversion both ways: it flattens the
caller's forward kwargs (caches included) into flat names and returns outputs keyed by dotted leaf
path, so validation, the generation runner (which rebuilds ``Cache`` objects from the component's
recorded pytree spec) and ``hfexport.load`` (which rebuilds the model output) never see flat names.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.generation.plan import keypath_to_str
from hfexport.pytree import register_cache_pytrees

__all__ = [
    "FLAT_SEPARATOR",
    "flat_inputs",
    "flat_io_names",
    "flat_name",
    "flat_program_io",
    "flatten_program_io",
    "io_names",
    "is_flat",
    "leaf_path",
    "takes_flat_inputs",
]

#: What replaces ``.`` between the parts of a leaf path in a flat name.
FLAT_SEPARATOR = "__"
_SEGMENT = re.compile(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*")


def flat_name(path: str) -> str:
    """The keyword name of the leaf at dotted ``path``: ``cache.layers.0.keys`` -> ``cache__layers__0__keys``.

    Raises:
        ValueError: a part of ``path`` is not letters/digits joined by single underscores (the name
            could not be mapped back to ``path``); the message names the leaf.
    """
    parts = path.split(".")
    bad = [part for part in parts if not _SEGMENT.fullmatch(part)]
    if bad or not parts[0] or parts[0][0].isdigit():
        raise ValueError(
            f"leaf {path!r} cannot be given a flat keyword name (part(s) {bad or [parts[0]]} are not "
            "letters and digits joined by single underscores); rename the input or output"
        )
    return FLAT_SEPARATOR.join(parts)


def leaf_path(name: str) -> str:
    """The dotted leaf path of flat keyword ``name`` (inverse of :func:`flat_name`)."""
    return name.replace(FLAT_SEPARATOR, ".")


def _spec_key_paths(spec: pytree.TreeSpec) -> list[tuple[Any, ...]]:
    """Pytree key paths of ``spec``'s leaves, in flattening order (caches unflattened around stand-ins)."""
    register_cache_pytrees()
    stand_ins = [torch.zeros(1, 1, 1, 1) for _ in range(spec.num_leaves)]
    position = {id(t): i for i, t in enumerate(stand_ins)}
    tree = pytree.tree_unflatten(stand_ins, spec)
    paths: list[tuple[Any, ...] | None] = [None] * spec.num_leaves
    for key_path, value in pytree.tree_flatten_with_path(tree)[0]:
        if id(value) in position:
            paths[position[id(value)]] = tuple(key_path)
    if any(p is None for p in paths):  # pragma: no cover - a node type that drops leaves
        raise ValueError(f"cannot name every leaf of {spec}")
    return [p for p in paths if p is not None]


def _rename_guard_sources(program: torch.export.ExportedProgram, renames: dict[str, str]) -> None:
    """Point the program's stored shape guards (``L['cache']['layers.0.keys'].size()[2] ...``, which
    ``program.module()`` turns into input checks) at the flat input names."""
    codes = getattr(program, "_guards_code", None)
    if not codes:
        return
    ordered = sorted(renames.items(), key=lambda item: -len(item[0]))
    rewritten = []
    for code in codes:
        for old, new in ordered:
            code = code.replace(old, new)
        rewritten.append(code)
    program._guards_code = rewritten


_BUILTIN_NODES = (dict, list, tuple, type(None))


def _is_flat_dict(spec: pytree.TreeSpec | None) -> bool:
    return spec is not None and spec.type is dict and all(child.is_leaf() for child in spec.children())


def _builtin_only(spec: pytree.TreeSpec) -> bool:
    """True when every node of ``spec`` is a dict, list, tuple or None (stock pytree types)."""
    stack = [spec]
    while stack:
        node = stack.pop()
        if node.is_leaf():
            continue
        if node.type not in _BUILTIN_NODES:
            return False
        stack.extend(node.children())
    return True


def takes_flat_inputs(program: torch.export.ExportedProgram) -> bool:
    """True when ``program``'s root call takes keyword leaves only (no positional inputs, no trees)."""
    signature = program.module_call_graph[0].signature
    if signature is None:
        return False
    in_spec = signature.in_spec
    return (
        in_spec.type is tuple
        and in_spec.num_children == 2
        and in_spec.child(0).num_children == 0
        and _is_flat_dict(in_spec.child(1))
    )


def is_flat(program: torch.export.ExportedProgram) -> bool:
    """True when ``program``'s root call takes keyword leaves only and its outputs name no
    non-builtin pytree node (so ``torch.export.load`` reads it without registering any class)."""
    signature = program.module_call_graph[0].signature
    return (
        takes_flat_inputs(program)
        and signature is not None
        and (signature.out_spec is None or _builtin_only(signature.out_spec))
    )


def io_names(program: torch.export.ExportedProgram) -> dict[str, dict[str, str]]:
    """``{"inputs": {flat_name: leaf_path}, "outputs": {flat_name: leaf_path}}`` of a flat program.

    ``"outputs"`` is present when the program returns a flat dict (:func:`flatten_program_io`
    rewrote its outputs); ``{}`` for a program that does not take flat inputs.
    """
    if not takes_flat_inputs(program):
        return {}
    signature = program.module_call_graph[0].signature
    names = {"inputs": {str(n): leaf_path(str(n)) for n in signature.in_spec.child(1).context}}
    if _is_flat_dict(signature.out_spec):
        names["outputs"] = {str(n): leaf_path(str(n)) for n in signature.out_spec.context}
    return names


def flatten_program_io(program: torch.export.ExportedProgram) -> dict[str, dict[str, str]]:
    """Make ``program``'s root call take and return flat dicts of named leaves, in place.

    Outputs that hold only tensors in dicts, lists and tuples (which stock pytree reads) are left
    as they are; outputs naming any other node type (a ``ModelOutput``, a ``Cache``) become one
    dict ``{flat_name: tensor}``. Only the root call's input and output pytree specs change (and the stored sample inputs, to
    match); the graph, weights, range constraints and guards are kept. Positional inputs are
    refused: every program hfexport captures takes keyword inputs only.

    Args:
        program: an ``ExportedProgram`` captured from keyword inputs.

    Returns:
        :func:`io_names` of the result: ``{"inputs": {flat: path}, "outputs": {flat: path}}``.

    Raises:
        ValueError: the program takes positional inputs, or a leaf path cannot be a keyword name
            (see :func:`flat_name`).
    """
    signature = program.module_call_graph[0].signature
    in_spec, out_spec = signature.in_spec, signature.out_spec
    if in_spec.type is not tuple or in_spec.num_children != 2 or in_spec.child(0).num_children:
        raise ValueError("only programs captured from keyword inputs can be given flat inputs")
    in_paths = _spec_key_paths(in_spec.child(1))
    in_names = [flat_name(keypath_to_str(p)) for p in in_paths]
    rewrite_outputs = out_spec is not None and not _builtin_only(out_spec)
    out_names = [flat_name(keypath_to_str(p)) for p in _spec_key_paths(out_spec)] if rewrite_outputs else []
    _rename_guard_sources(
        program,
        {
            "L" + pytree.keystr(path): "L" + pytree.keystr((pytree.MappingKey(name),))
            for path, name in zip(in_paths, in_names, strict=True)
        },
    )
    placeholder = 0
    signature.in_spec = pytree.tree_structure(((), dict.fromkeys(in_names, placeholder)))
    if rewrite_outputs:
        signature.out_spec = pytree.tree_structure(dict.fromkeys(out_names, placeholder))
    signature.forward_arg_names = list(in_names)
    examples = getattr(program, "_example_inputs", None)
    if examples is not None:
        leaves = pytree.tree_leaves(examples)
        program._example_inputs = ((), dict(zip(in_names, leaves, strict=True)))
    return io_names(program)


@contextlib.contextmanager
def flat_program_io(program: torch.export.ExportedProgram) -> Iterator[dict[str, dict[str, str]]]:
    """Give ``program`` flat inputs/outputs (:func:`flatten_program_io`) for the block, then restore it.

    :func:`hfexport_dynamo.save` writes every keyword-input program inside this block, so the
    in-memory program keeps returning the eager output objects (``program.module()(**kw).logits``)
    while the ``.pt2`` on disk is the flat one stock ``torch.export.load`` reads.

    Yields:
        The names, as :func:`flatten_program_io` returns them.

    Raises:
        ValueError: see :func:`flatten_program_io` (the program is left as it was).
    """
    signature = program.module_call_graph[0].signature
    saved = (
        signature.in_spec,
        signature.out_spec,
        signature.forward_arg_names,
        getattr(program, "_example_inputs", None),
        list(getattr(program, "_guards_code", None) or []),
    )
    try:
        yield flatten_program_io(program)
    finally:
        signature.in_spec, signature.out_spec, signature.forward_arg_names = saved[:3]
        program._example_inputs = saved[3]
        if hasattr(program, "_guards_code"):
            program._guards_code = saved[4]


def flat_io_names(program: torch.export.ExportedProgram) -> dict[str, dict[str, str]]:
    """The names :func:`flatten_program_io` would give ``program`` (``{}`` when it cannot be
    flattened: positional inputs), without changing it."""
    if takes_flat_inputs(program) and is_flat(program):
        return io_names(program)
    try:
        with flat_program_io(program) as names:
            return names
    except ValueError:
        return {}


def flat_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Forward kwargs (tensors, ``Cache`` objects, model outputs, ``None``) -> ``{flat_name: leaf}``.

    Leaves are the same objects (no copies), so in-place updates a program makes to a static cache
    reach the caller's cache. ``None`` values have no leaves and are dropped, as the capture did.
    """
    register_cache_pytrees()
    flat, _ = pytree.tree_flatten_with_path(dict(inputs))
    return {flat_name(keypath_to_str(path)): value for path, value in flat}
