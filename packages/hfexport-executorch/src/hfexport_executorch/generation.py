"""The ExecuTorch backend's generation hooks: :class:`ExecutorchGenerationSupport`, the
:class:`hfexport.generation.support.GenerationSupport` of
:class:`hfexport_executorch.ExecutorchExporter` (its ``generation_support_class``), and the
functions it calls.

The greedy loop lives in the core (:class:`hfexport.generation.GenerationRunner`); each component
call is an :class:`hfexport_executorch.runtime.ExecutorchRunner`. The hooks that differ from the
core's defaults:

- ``supports_empty_growing_cache = False``: the runtime cannot run a decode graph on a growing
  cache of 0 positions, so a decode-only export on a dynamic cache is refused;
- ``component_metadata`` / ``load_component`` (:func:`component_metadata` / :func:`load_component`):
  a ``.pte`` file holds the flat program only, so the pytree specs of the program's inputs and
  outputs (caches and model outputs included) go into the manifest and the runner is rebuilt from
  file and specs;
- ``prepare_component`` (:func:`prepare_component`): static-cache components, and components whose
  filled linear-attention or state-space states transformers writes in place, get paired cache
  inputs/outputs;
- ``component_config`` (:func:`component_config`): decode-step components, and a multimodal model's prompt components, get bounded dynamic axes;
- ``generation_source``: the quantized copy every component is captured from.

:func:`patchify_conv3d_as_matmul` (re-exported; registered in
:mod:`hfexport_executorch.workarounds.patches`, key ``executorch``) computes the patch-embedding
Conv3d of Qwen-style vision encoders as a matmul, which the runtime can execute.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.conventions import TEXT, max_positions, names_with
from hfexport.generation.support import GenerationSupport
from hfexport.pytree import register_known_pytrees
from hfexport_executorch.workarounds.patches import patchify_conv3d_as_matmul

__all__ = [
    "ExecutorchGenerationSupport",
    "component_config",
    "component_metadata",
    "load_component",
    "patchify_conv3d_as_matmul",
    "prepare_component",
]


def _modules(spec: pytree.TreeSpec) -> list[str]:
    found: list[str] = []
    stack = [spec]
    while stack:
        node = stack.pop()
        module = getattr(node.type, "__module__", None)
        if module and module not in ("builtins", "collections") and module not in found:
            found.append(module)
        stack.extend(node.children())
    return found


def component_metadata(artifact: Any) -> dict[str, Any]:
    """The program's input/output pytree specs, the modules defining their node types (for
    information only: :func:`load_component` never imports them), the delegate backend the
    runtime needs (e.g. ``XnnpackBackend``) and, for a program exported with output flags, their
    values (``output_flags``: constant inputs the runtime requires, filled in by the runner)."""
    from hfexport.inputs.flags import program_output_flags
    from hfexport_executorch.backends import runtime_backend

    program = artifact.exported_program("forward")
    spec = program.call_spec
    metadata = {
        "in_spec": pytree.treespec_dumps(spec.in_spec),
        "out_spec": pytree.treespec_dumps(spec.out_spec),
        "modules": sorted(set(_modules(spec.in_spec)) | set(_modules(spec.out_spec))),
        "required_backend": runtime_backend(artifact),
    }
    flags = program_output_flags(program)
    if flags:
        metadata["output_flags"] = flags
    return metadata


def load_component(path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
    """Load a saved ``.pte`` component and return its caller (forward kwargs -> ``{leaf path: tensor}``).

    The specs' node types must be registered: the fixed list of
    :func:`hfexport.pytree.register_known_pytrees` is, and nothing named in ``metadata``
    (``"modules"``) is imported, since a manifest may come from someone else.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the manifest lacks the component's pytree specs (written by an older hfexport),
            or they name a node type that is not registered.
        hfexport.errors.IntegrityError: the file differs from its SHA-256 in the folder's
            ``checksums.sha256`` (:func:`hfexport.integrity.verify_file`).
    """
    from hfexport.integrity import verify_file
    from hfexport_executorch.runtime import ExecutorchRunner

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ExecuTorch program at {path}")
    verify_file(path)
    if "in_spec" not in metadata or "out_spec" not in metadata:
        raise ValueError(f"the generation manifest has no input/output specs for {path}; export it again")
    register_known_pytrees()
    try:
        in_spec = pytree.treespec_loads(metadata["in_spec"])
        out_spec = pytree.treespec_loads(metadata["out_spec"])
    except NotImplementedError as exc:
        raise ValueError(
            f"the input/output specs of {path} name a type that is not registered ({exc}); hfexport never "
            "imports modules named by a saved manifest: import the module that defines it before loading"
        ) from exc
    return ExecutorchRunner(
        os.fspath(path),
        in_spec,
        out_spec,
        required_backend=metadata.get("required_backend"),
        output_flags=dict(metadata.get("output_flags") or {}),
    )


def _states_written_in_place(cache: Any) -> bool:
    """Whether ``cache`` holds filled linear-attention or state-space states, which transformers
    5.24 writes with ``copy_`` (``LinearAttentionLayer.update_conv_state`` /
    ``update_recurrent_state``: Qwen3.5's gated delta-net layers, Nemotron-H's Mamba2 layers)."""
    for layer in getattr(cache, "layers", ()):
        for attr in ("conv_states", "recurrent_states"):
            states = getattr(layer, attr, None)  # {state index: tensor}, filled lazily
            values = states.values() if isinstance(states, Mapping) else states
            if isinstance(values, Iterable) and any(isinstance(t, torch.Tensor) for t in values):
                return True
    return False


def prepare_component(name: str, module: Any, kwargs: Mapping[str, Any], plan: Any) -> Any:
    """Give components whose cache is updated in place paired cache inputs/outputs.

    The ExecuTorch runtime returns a mutated graph input as an extra output and leaves the input
    as it was, so an in-place cache update would be lost between calls. The component runs on a
    copy of the cache (:class:`hfexport.generation.parts.FunctionalCacheModule`) and returns the
    updated copy, which the generation runner passes to the next call. This applies to a static
    cache, and to a growing cache whose linear-attention or state-space states are filled (the
    decode step of a hybrid model: transformers writes them with ``copy_``, and the program's two
    extra outputs per layer kind did not fit the recorded output spec: "treespec.unflatten(leaves):
    `leaves` has length 7 but the spec refers to a pytree that holds 5 items", issue 28).
    """
    from transformers.cache_utils import Cache

    from hfexport.generation.parts import FunctionalCacheModule

    caches = [v for v in kwargs.values() if isinstance(v, Cache)]
    if caches and (plan.cache_kind == "static" or any(_states_written_in_place(c) for c in caches)):
        return FunctionalCacheModule(module)
    return module


# Token-aligned inputs of the (encoder) text sequence group, from the core input-role table.
_TOKEN_KEYS = names_with(sequence=TEXT, kind=("ids", "embeds", "type_ids", "modality_types"))


#: patches (rows of a Qwen-style vision encoder's inputs) a program is memory-planned for
MAX_VISION_PATCHES = 4096


def _bounded_patch_axis(module: Any, kwargs: Mapping[str, Any], config: Any) -> Any:
    """A Qwen-style vision encoder varies along axis 0 only (the core's rule for it), bounded here
    by :data:`MAX_VISION_PATCHES`: without a bound the patch axis had no role and was planned at the
    sample's patch count, so a larger image failed at run time (issue 28)."""
    from torch.export import Dim

    from hfexport.generation.shapes import dynamic_shapes_by_rule
    from hfexport.inputs import prepare_for_export

    patches = Dim.AUTO(min=1, max=MAX_VISION_PATCHES)

    def rule(path: str, tensor: torch.Tensor) -> dict[int, Any] | None:
        return {0: patches} if tensor.dim() >= 1 and tensor.shape[0] > 1 else None

    _, prepared, _ = prepare_for_export(module, kwargs)
    return config.replace(dynamic_shapes=dynamic_shapes_by_rule(prepared, rule))


def _is_image_features(module: Any) -> bool:
    """True for the model's own ``get_image_features`` as one component (possibly wrapped)."""
    from hfexport.generation.multimodal import ImageFeatures

    return isinstance(module, ImageFeatures) or isinstance(getattr(module, "part", None), ImageFeatures)


def _bounded_image_rows(module: Any, kwargs: Mapping[str, Any], config: Any) -> Any:
    """The leading axis of an image encoder's inputs, bounded by how far it may grow.

    Axis 0 of an image encoder's ``pixel_values`` counts images, tiles or patches. The backend
    bounds it by its batch role (:data:`~hfexport_executorch.bounds.DEFAULT_MAX_BATCH` images), and
    never below the sample: an axis that counts patches (Inkling's vision tower takes
    ``pixel_values`` ``[patches, t, h, w, c]``, 32 rows for one image) was planned at the sample's
    rows and a second prompt of 48 was refused (issue 28). A leading axis whose sample size is
    above the batch bound counts more than images, so it gets ``DEFAULT_MAX_BATCH`` times its
    sample size (as many images of the sample's patch count as the batch bound allows). Axes
    already bounded, and those within the batch bound, are kept; the other axes keep the spec
    they had (the core's, or ``Dim.AUTO`` on every axis as ``dynamic=True`` gives).

    Args:
        module: the image encoder component (a vision tower, or an
            :class:`hfexport.generation.multimodal.ImageFeatures`).
        kwargs: its inputs (``pixel_values`` ``[rows, ...]``).
        config: its config (``dynamic=True``; ``dynamic_shapes`` possibly set by the core).

    Returns:
        ``config`` with those axes as ``Dim.AUTO(min=1, max=DEFAULT_MAX_BATCH * rows)``; ``config``
        itself when no input's leading axis is above the batch bound.
    """
    from torch.export import Dim

    from hfexport.capture import auto_dynamic_shapes
    from hfexport.inputs import prepare_for_export
    from hfexport_executorch.bounds import DEFAULT_MAX_BATCH

    _, prepared, _ = prepare_for_export(module, kwargs)
    tall = {
        key: int(value.shape[0])
        for key, value in prepared.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > DEFAULT_MAX_BATCH
    }
    if not tall:
        return config
    shapes = dict(config.dynamic_shapes or auto_dynamic_shapes(prepared))
    changed = False
    for key, rows in tall.items():
        spec = shapes.get(key)
        if not isinstance(spec, Mapping):
            continue
        leaf = spec.get(0)
        if type(leaf).__name__ == "_DimHint" and getattr(leaf, "max", None) is None:
            shapes[key] = {**spec, 0: Dim.AUTO(min=1, max=DEFAULT_MAX_BATCH * rows)}
            changed = True
    return config.replace(dynamic_shapes=shapes) if changed else config


#: components of a multimodal plan that take the whole prompt (image tokens included) at prefill
_MULTIMODAL_PROMPT_COMPONENTS = ("embed_tokens", "language_model")


def component_config(name: str, module: Any, kwargs: Mapping[str, Any], plan: Any, config: Any) -> Any:
    """Bounded dynamic axes for the decode-step components exported with ``dynamic=True``.

        The backend bounds ``Dim.AUTO`` axes by role (batch, the sequence axis of ``input_ids`` /
        ``attention_mask``, the cache's sequence axis) and plans any other axis at its sample size.
        A decode step breaks those roles: the mask (``past + q`` positions, or the static cache's
        length) is not the new-token axis, M-RoPE ``position_ids`` carry the new tokens on axis 2, and
        with a static cache the mask is an axis of its own. So every dynamic axis of a component that
        takes a filled or preallocated cache gets a bounded hint ``Dim.AUTO(min=1, max=N)`` (the
        backend keeps hints that carry a bound; ``torch.export`` still works out which axes are equal):
        the batch up to the backend's batch bound; the new tokens, the mask and a growing cache's
        positions up to the model's maximum positions, or, with a static cache, up to
        ``max_cache_len - 1`` (transformers pads a shorter mask to the cache length and the trace keeps
        that branch; the runner never feeds the last generated token back). A sparse-attention indexer's 3-D
        ``indexer_keys`` [batch, positions, dim] grow on axis 1 like the cache. A static cache's tensors
        vary along the batch only. A multimodal model's ``embed_tokens`` and ``language_model`` get the
    same batch and length bounds on their prompt inputs (``input``, ``inputs_embeds``, the mask and
    positions); so do the ``prefill`` and ``decode`` of a language model that takes the image features
    as an input of its own (:attr:`~hfexport.generation.plan.GenerationPlan.step_inputs`: the
    features vary along the batch, a token-aligned prompt input along the batch and the prompt),
    and the image-token axis of the language model's DeepStack inputs
    (``deepstack_visual_embeds.<layer>`` ``[image tokens, hidden]``) gets the length bound, as the
    image tokens are part of the prompt. The leading axis of a multimodal model's image encoder
    (images, tiles or patches) is bounded by :func:`_bounded_image_rows`. Axes of size
    1 in the sample stay static. Explicit
        ``dynamic_shapes`` are kept; a prefill on an empty growing cache and encoder-decoder components
        are left to the backend's roles, which fit them.
    """
    from transformers.cache_utils import Cache

    from hfexport.tensors import get_leaf_tensors

    caches = [v for v in kwargs.values() if isinstance(v, Cache)]
    static = plan.cache_kind == "static" and bool(plan.max_cache_len)
    # a multimodal model's text components take the prompt with its image tokens: the embedding's
    # ``input`` and the language model's ``inputs_embeds`` have no role the backend bounds, and
    # would be planned at the sample's prompt length (issue 28)
    prompt_component = plan.architecture == "multimodal" and name in _MULTIMODAL_PROMPT_COMPONENTS
    # the steps of a language model that takes the image features as an input of its own (BLIP's
    # encoder_hidden_states, Kosmos-2's image_embeds and image_embeds_position_mask): those inputs
    # have no role either, and were planned at the sample's batch and prompt length (issue 28)
    step_inputs = dict(getattr(plan, "step_inputs", {}).get(name) or {})
    prompt_component = prompt_component or bool(step_inputs)
    if name in getattr(plan, "vision_grid", {}) and getattr(config, "dynamic", False):
        return _bounded_patch_axis(module, kwargs, config)
    if (
        plan.architecture == "multimodal"
        and name not in getattr(plan, "per_image", {})
        and getattr(config, "dynamic", False)
        and (name == "image_encoder" or _is_image_features(module))
    ):
        config = _bounded_image_rows(module, kwargs, config)
    if not getattr(config, "dynamic", False) or getattr(config, "dynamic_shapes", None):
        return config
    if not prompt_component and (
        plan.architecture == "encoder_decoder"
        or not caches
        or (not static and not any(get_leaf_tensors(cache) for cache in caches))
    ):
        return config
    from torch.export import Dim

    from hfexport.generation.shapes import dynamic_shapes_by_rule
    from hfexport.inputs import prepare_for_export
    from hfexport_executorch.bounds import DEFAULT_MAX_BATCH, DEFAULT_MAX_SEQUENCE

    if static:
        limit = int(plan.max_cache_len) - 1
    else:
        positions, _ = max_positions(getattr(module, "config", None), decoder=True)
        limit = int(positions or DEFAULT_MAX_SEQUENCE)
    batch = Dim.AUTO(min=1, max=DEFAULT_MAX_BATCH)
    length = Dim.AUTO(min=1, max=limit)
    image_tokens = Dim.AUTO(min=1, max=limit)

    def axes(pairs: dict[int, Any], tensor: torch.Tensor) -> dict[int, Any] | None:
        kept = {axis: dim for axis, dim in pairs.items() if tensor.shape[axis] > 1}
        return kept or None

    def rule(path: str, tensor: torch.Tensor) -> dict[int, Any] | None:
        key = path.split(".", 1)[0]
        if key in _TOKEN_KEYS or (prompt_component and key in ("input", "inputs_embeds")):
            return axes({0: batch, 1: length}, tensor)
        if key == "position_ids":
            return axes({0: batch, 1: length} if tensor.dim() == 2 else {1: batch, 2: length}, tensor)
        if key == "attention_mask" and tensor.dim() == 2:
            return axes({0: batch, 1: length}, tensor)
        if prompt_component and key == "deepstack_visual_embeds":
            # [image tokens, hidden] per tapped vision layer (Granite-Docling, Qwen3-VL): the image
            # tokens are part of the prompt, so they are bounded by its length (planned at the
            # sample's 2 rows, a 3-tile second prompt was refused, issue 28)
            return axes({0: image_tokens}, tensor) if tensor.dim() == 2 else None
        if key == "cache" and (".conv_states." in path or ".recurrent_states." in path):
            # linear-attention / state-space states ([batch, channels, kernel], [batch, heads, key,
            # value]) have no positions axis; their batch is the prompt's (MiniCPM-V 4.6's Qwen3.5
            # decode was planned at the sample's 2 rows and a 3-image prompt refused, issue 28)
            return axes({0: batch}, tensor)
        if key == "cache" and tensor.dim() == 4:
            return axes({0: batch} if static else {0: batch, 2: length}, tensor)
        if key == "cache" and tensor.dim() == 3 and path.endswith("keys"):
            # a sparse-attention indexer's keys [batch, positions, head dim] (dots3_note's
            # cache.layers.N.indexer_keys, issue 28): positions on axis 1
            return axes({0: batch} if static else {0: batch, 1: length}, tensor)
        if path in step_inputs:
            # a prompt input aligned with the tokens ([batch, seq]: Kosmos-2's
            # image_embeds_position_mask) varies with the prompt; the image features per prompt
            # ([batch, image tokens, hidden]) along the batch only (their token count is the model's)
            # ([batch, seq, ...] token-aligned masks of a cross-attending model: Mllama's
            # cross_attention_mask, IDEFICS' image_attention_mask; a decode step's row of them,
            # "last", keeps its one row)
            source = step_inputs[path]
            text = (
                source.get("from") == "prompt"
                and not source.get("last")
                and tensor.dim() >= 2
                and (tensor.dim() == 2 or tokens is None or tensor.shape[1] == tokens)
            )
            return axes({0: batch, 1: length} if text else {0: batch}, tensor)
        return None

    ids = kwargs.get("input_ids")
    tokens = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
    _, prepared, _ = prepare_for_export(module, kwargs)
    shapes = dynamic_shapes_by_rule(prepared, rule)
    if second_shape_skip_reason(name, prepared, plan) is not None:
        return config.replace(dynamic_shapes=shapes, validate_second_shape=False)
    return config.replace(dynamic_shapes=shapes)


def second_shape_skip_reason(name: str, kwargs: Mapping[str, Any], plan: Any) -> str | None:
    """Why the step ``name`` of a language model that takes the image features as an input of its own
    is exported without a second-shape check, or ``None`` when it gets one.

    A step input fed by an image component's output with no entry in the input-role table (BLIP's
    ``encoder_hidden_states``, Kosmos-2's ``image_embeds``) would have its batch grown apart from the
    prompt's by the derived second shape (BLIP: 4 rows against 3), which eager refuses; such a step
    is checked by greedy generation at a second image prompt instead. Inputs with a role (Mllama's
    ``cross_attention_states``, issue 28) share the prompt's batch, and the step is validated at a
    second shape like any other component.

    Args:
        name: the component (``"prefill"``, ``"decode"``).
        kwargs: its sample kwargs (tensors by input path).
        plan: the generation plan (its :attr:`~hfexport.generation.plan.GenerationPlan.step_inputs`).

    Returns:
        The reason (it names the inputs), or ``None``.
    """
    from hfexport.conventions import input_role

    step_inputs = dict(getattr(plan, "step_inputs", {}).get(name) or {})
    missing = []
    for path, source in step_inputs.items():
        if source.get("from") != "component":
            continue
        key = path.split(".", 1)[0]
        value = kwargs.get(key)
        if input_role(key, value.dim() if isinstance(value, torch.Tensor) else None) is None:
            missing.append(f"{path!r} (from the {source.get('component')})")
    if not missing:
        return None
    return (
        f"the {name} step takes {', '.join(missing)} with no entry in the input-role table, so a derived second "
        "shape would grow its batch apart from the prompt's; the step is checked by greedy generation at a second "
        "image prompt instead"
    )


class ExecutorchGenerationSupport(GenerationSupport):
    """Generation hooks of the ExecuTorch backend (see the module docstring)."""

    #: A growing (dynamic) cache of 0 positions cannot be fed to a program: the runtime's
    #: ``make_tensor_ptr`` asserts that the strides torch gives a tensor with a 0-size axis are the
    #: ones it recomputes, and aborts the process (closest upstream discussion: pytorch/executorch
    #: PR 19006). A dynamic-cache decode graph therefore cannot serve the prefill here: export the
    #: ``prefill`` component as well (a static cache has no 0-size axis and can).
    supports_empty_growing_cache = False

    def prepare_component(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> torch.nn.Module:
        """Components whose cache is updated in place (a static cache; filled linear-attention or
        state-space states) get paired cache inputs/outputs instead (the runtime returns a mutated
        input as an extra output and leaves the input as it was); see :func:`prepare_component`."""
        return prepare_component(name, module, kwargs, plan)

    def component_config(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any, config: Any
    ) -> Any:
        """Bounded dynamic axes for decode-step components exported with ``dynamic=True``; see
        :func:`component_config`."""
        return component_config(name, module, kwargs, plan, config)

    def second_shape_skip_reason(
        self, name: str, module: torch.nn.Module, kwargs: Mapping[str, Any], plan: Any
    ) -> str | None:
        """Why :meth:`component_config` turned the second shape off for ``name``; see
        :func:`second_shape_skip_reason`."""
        from hfexport.inputs import prepare_for_export

        _, prepared, _ = prepare_for_export(module, kwargs)
        return second_shape_skip_reason(name, prepared, plan)

    def component_metadata(self, artifact: Any) -> dict[str, Any]:
        """The program's input/output pytree specs and the delegate backend it needs (a ``.pte``
        holds the flat program only); see :func:`component_metadata`."""
        return component_metadata(artifact)

    def load_component(self, path: str | os.PathLike[str], metadata: Mapping[str, Any]) -> Any:
        """An :class:`~hfexport_executorch.runtime.ExecutorchRunner` over a saved ``.pte``, rebuilt
        from the file and the specs in ``metadata``; see :func:`load_component`.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: ``metadata`` lacks the specs, or they name an unregistered node type.
            hfexport.errors.IntegrityError: the file differs from its SHA-256 in ``checksums.sha256``.
        """
        return load_component(path, metadata)
