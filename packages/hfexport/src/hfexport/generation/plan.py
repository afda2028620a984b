"""The generation plan: which components exist, what each one takes and returns, and how the
runner feeds them.

A :class:`GenerationPlan` is plain data (it round-trips through JSON, it is what
``generation_manifest.json`` stores) so that exported components can be run without the eager
model: the runner rebuilds every component's forward kwargs from the recorded pytree spec
(:class:`ComponentIO`), filling each tensor leaf by its path (``input_ids``,
``cache.layers.0.keys``, ``encoder_outputs.last_hidden_state`` ...).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.pytree import register_cache_pytrees, register_known_pytrees

__all__ = ["ComponentIO", "GenerationPlan", "keypath_to_str"]

logger = logging.getLogger(__name__)

#: Architectures a plan describes.
ARCHITECTURES = ("decoder", "encoder_decoder", "multimodal")
#: Cache kinds.
CACHE_KINDS = ("dynamic", "static")


def keypath_to_str(path: tuple[Any, ...]) -> str:
    """Dotted name of a pytree key path, as :func:`hfexport.tensors.get_leaf_tensors` spells paths."""
    parts: list[str] = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        else:  # pragma: no cover - other key kinds are not produced for kwargs
            parts.append(str(key))
    return ".".join(parts)


def _simple(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _node_modules(spec: pytree.TreeSpec) -> list[str]:
    """Python modules defining the node types of ``spec`` (imported before loading it again)."""
    found: list[str] = []
    stack = [spec]
    while stack:
        node = stack.pop()
        module = getattr(node.type, "__module__", None)
        if module and module not in ("builtins", "collections") and module not in found:
            found.append(module)
        stack.extend(node.children())
    return found


@dataclass
class ComponentIO:
    """What one exported component takes and returns.

    Attributes:
        treespec: ``torch.utils._pytree.treespec_dumps`` of the component's prepared forward kwargs
            (the dict the graph was traced with, caches and model outputs included).
        leaves: one entry per pytree leaf, in flattening order: ``{"path": str, "tensor": bool}``
            plus, for tensors, the sample ``"shape"`` and ``"dtype"``, and for constants their
            JSON ``"value"``.
        outputs: output leaf paths in the order eager PyTorch returns them (``logits``,
            ``cache.layers.0.keys``, ...).
        modules: Python modules defining the cache and model-output classes named in
            :attr:`treespec`, recorded for information only: loading never imports them (a manifest
            may come from someone else); :meth:`spec` registers a fixed list of node types instead
            (:func:`hfexport.pytree.register_known_pytrees`).
    """

    treespec: str
    leaves: list[dict[str, Any]]
    outputs: list[str]
    modules: list[str] = field(default_factory=list)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], outputs: list[str]) -> ComponentIO:
        """Describe prepared forward kwargs ``kwargs`` and eager output paths ``outputs``.

        Raises:
            ValueError: a non-tensor leaf is not JSON-safe (``None``, bool, int, float, str).
        """
        register_cache_pytrees()
        flat, spec = pytree.tree_flatten_with_path(dict(kwargs))
        leaves: list[dict[str, Any]] = []
        for path, value in flat:
            name = keypath_to_str(path)
            if isinstance(value, torch.Tensor):
                leaves.append(
                    {
                        "path": name,
                        "tensor": True,
                        "shape": list(value.shape),
                        "dtype": str(value.dtype).removeprefix("torch."),
                    }
                )
            elif _simple(value):
                leaves.append({"path": name, "tensor": False, "value": value})
            else:
                raise ValueError(
                    f"input {name!r} is a {type(value).__name__}, which a generation manifest cannot hold"
                )
        return cls(
            treespec=pytree.treespec_dumps(spec),
            leaves=leaves,
            outputs=list(outputs),
            modules=_node_modules(spec),
        )

    @property
    def tensor_paths(self) -> list[str]:
        """Paths of the tensor leaves, in flattening order."""
        return [leaf["path"] for leaf in self.leaves if leaf["tensor"]]

    def spec(self) -> pytree.TreeSpec:
        """The loaded :class:`~torch.utils._pytree.TreeSpec`.

        The node types are the ones registered in this process plus the fixed list of
        :func:`hfexport.pytree.register_known_pytrees` (transformers' caches and model outputs);
        :attr:`modules` is never imported.

        Raises:
            ValueError: the spec names a node type that is not registered (the message names it);
                import the module defining it before loading.
        """
        register_known_pytrees()
        try:
            return pytree.treespec_loads(self.treespec)
        except NotImplementedError as exc:
            raise ValueError(
                f"a generation component's input structure names a type that is not registered ({exc}); "
                "hfexport never imports modules named by a saved manifest: import the module that defines "
                "it (and call hfexport.pytree.register_cache_pytrees() for a cache class) before loading"
            ) from exc

    def build(self, value_of: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        """Build the forward kwargs: tensor leaves from ``value_of(path)``, constants as recorded.

        A floating point tensor whose recorded dtype is another floating point dtype is cast to
        it (a float32 ``pixel_values`` or empty cache for a float16 graph, see :meth:`in_dtype`),
        and so is an integer tensor recorded as floating point (Qwen3-Omni's language model takes
        its M-RoPE ``position_ids`` as float32, which the runner computes as int64; issue 28);
        other integer and bool tensors are passed as given.

        Raises:
            KeyError: ``value_of`` has no value for a path (it should name the path).
        """
        values: list[Any] = []
        for leaf in self.leaves:
            if not leaf["tensor"]:
                values.append(leaf.get("value"))
                continue
            value = value_of(leaf["path"])
            recorded = getattr(torch, str(leaf.get("dtype")), None)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(recorded, torch.dtype)
                and recorded.is_floating_point
                and value.dtype != recorded
                and value.dtype != torch.bool
            ):
                value = value.to(recorded)
            values.append(value)
        return pytree.tree_unflatten(values, self.spec())

    def in_dtype(self, dtype: str) -> ComponentIO:
        """A copy whose floating point tensor leaves are recorded in ``dtype`` (``"float16"`` ...):
        what a component exported with ``config.dtype=dtype`` takes (integer leaves unchanged)."""
        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype) or not target.is_floating_point:
            raise ValueError(f"dtype={dtype!r} is not a floating point torch dtype")
        leaves = []
        for leaf in self.leaves:
            recorded = getattr(torch, str(leaf.get("dtype")), None) if leaf["tensor"] else None
            if isinstance(recorded, torch.dtype) and recorded.is_floating_point:
                leaf = {**leaf, "dtype": dtype}
            leaves.append(leaf)
        return dataclasses.replace(self, leaves=leaves)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ComponentIO:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(data))


@dataclass
class GenerationPlan:
    """Everything the greedy runner needs to know about a set of exported components.

    Attributes:
        architecture: ``"decoder"`` (prefill/decode), ``"encoder_decoder"`` (encoder/prefill/decode)
            or ``"multimodal"`` (encoders, projectors, embed_tokens, language_model, lm_head, decode).
        model_class: class name of the decomposed model.
        cache_kind: ``"dynamic"`` (the cache grows, returned by each call) or ``"static"``
            (preallocated ``max_cache_len`` positions, updated in place).
        max_cache_len: static cache length (``None`` for dynamic caches).
        multi_token_decode: the decode graph was captured with a query of several tokens.
        components: component names in execution order.
        token_ids: ``eos_token_id`` (list), ``pad_token_id``, ``bos_token_id``,
            ``decoder_start_token_id`` from the model's generation config.
        links: multimodal only: ``{component: {input_path: source}}`` for encoder and projector
            inputs; a source is ``{"from": "prompt", "key": k}`` (a generate input; with
            ``"last": True`` its last row along axis 1, ``[batch, 1, ...]``: a decode step's row of a
            token-aligned prompt input, Mllama's ``cross_attention_mask``; with ``"flatten": True``
            its first two axes merged, IDEFICS' ``[batch * images, ...]`` ``pixel_values``),
            ``{"from": "vision_grid", "key": k, "grid": g}`` (precomputed from the grid input ``g``)
            or ``{"from": "component", "component": c, "output": o, "drop_first": bool}``.
        features: multimodal only: ``{placeholder_token_id (str): {"component": c, "output": o}}``:
            which output replaces the embeddings of which placeholder token.
        language_inputs: multimodal only: ``{input_path: source}`` for the language model's inputs
            other than ``inputs_embeds``, ``attention_mask``, ``position_ids`` and the cache, which
            the runner builds itself (Qwen3-VL's DeepStack: ``visual_pos_masks`` and
            ``deepstack_visual_embeds.<layer>``); a source is ``{"from": "placeholders"}`` (the
            bool ``[batch, seq]`` mask of the placeholder tokens of :attr:`features`) or a component
            output as in :attr:`links`.
        vision_grid: ``{component: settings}`` for Qwen-style vision encoders (see
            :func:`hfexport.generation.vision_inputs.vision_grid_settings`).
        mrope: ``{"spatial_merge_size": m, "channels": c}`` when the language model takes M-RoPE position ids
            (``c`` rotary axes), with ``"layout": "row_separated"`` for HunYuan-VL's layout (see
            :func:`hfexport.generation.vision_inputs.row_separated_mrope_position_ids`), ``"newline_column"``
            for HunYuan-V4-VL's (Qwen2-VL's over a grid one column wider; Qwen2-VL's without it),
            ``"canvas"`` for MiniCPM-V 4.7's (its crops laid out on an image canvas, with the
            ``"markers"`` ids; see :func:`hfexport.generation.vision_inputs.canvas_mrope_position_ids`).
        per_image: multimodal only: ``{component: {"image_sizes": [height, width]}}`` for an image
            encoder exported for one image of one size (LLaVA-NeXT's anyres, Pixtral: the model
            reads the image sizes as values; see
            :class:`hfexport.generation.multimodal.SizedImageFeatures`). The runner calls it once
            per image (each input cut to that image) and concatenates the outputs; a prompt whose
            ``image_sizes`` hold another size is refused. ``{component: {"image_grid_thw": [t, h,
            w]}}`` likewise for a tower that reads its patch grid as values (HunYuan-V4-VL,
            Cosmos3-Edge: :class:`hfexport.generation.multimodal.SizedGridImageFeatures`): the packed
            ``pixel_values`` are cut into ``t * h * w`` rows per image, another grid is refused.
            A packed-patch tower (MiniCPM-V,
            Nemotron-H Omni) has ``{"grid": [height, width], "grid_input": name}`` instead: one
            image of one patch grid per call, its share of the packed ``pixel_values`` cut by the
            prompt's grid input (see :class:`hfexport.generation.multimodal.GridImageFeatures`).
        step_inputs: multimodal only, for a language model that takes the image features as an
            input of its own (issue 28: BLIP's text decoder cross-attends to them as
            ``encoder_hidden_states`` at every step, Kosmos-2's places ``image_embeds`` at
            ``image_embeds_position_mask`` in the prefill): ``{"prefill" | "decode": {input_path:
            source}}`` for the step's inputs other than the token ids, the padding mask, the
            position ids and the cache, which the runner builds itself; a source is as in
            :attr:`links`. Empty for a model whose features replace placeholder token embeddings.
            A source with ``"without_image": {"zeros": [axes], "dtype": d[, "token_aligned": True]}``
            is given zeros of ``[batch, (tokens,) *axes]`` for a text-only prompt (Mllama's
            ``cross_attention_states`` and ``cross_attention_mask``: zero features with a zero mask
            make each cross-attention layer add exactly zero, as ``generate`` skipping them does;
            checked at decomposition), instead of refusing it.
        prompt_edit: multimodal only: how the model's ``generate`` rewrites the prompt before its
            language model's prefill: ``{"drop_last": n}`` (the last ``n`` tokens and mask columns
            are left out) and ``{"first_token": id}`` (the first token of every row is replaced);
            BLIP's ``generate`` drops the processor's closing ``[SEP]`` and puts its BOS first. The
            runner applies it and returns the rewritten prompt followed by the new tokens, as
            ``generate`` does. Empty when the prompt is taken as given.
        io: ``{component: ComponentIO}``.
    """

    architecture: str
    model_class: str
    cache_kind: str = "dynamic"
    max_cache_len: int | None = None
    multi_token_decode: bool = False
    components: list[str] = field(default_factory=list)
    token_ids: dict[str, Any] = field(default_factory=dict)
    links: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    language_inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    vision_grid: dict[str, dict[str, Any]] = field(default_factory=dict)
    mrope: dict[str, Any] | None = None
    per_image: dict[str, dict[str, Any]] = field(default_factory=dict)
    step_inputs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    prompt_edit: dict[str, int] = field(default_factory=dict)
    io: dict[str, ComponentIO] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; allowed: {', '.join(ARCHITECTURES)}")
        if self.cache_kind not in CACHE_KINDS:
            raise ValueError(f"cache_kind={self.cache_kind!r}; allowed: {', '.join(CACHE_KINDS)}")

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids (possibly empty)."""
        eos = self.token_ids.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``io`` entries as dicts)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "io"}
        out["io"] = {name: io.to_dict() for name, io in self.io.items()}
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationPlan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown keys or invalid values.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown generation plan field(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        values["io"] = {name: ComponentIO.from_dict(io) for name, io in dict(values.get("io", {})).items()}
        return cls(**values)
