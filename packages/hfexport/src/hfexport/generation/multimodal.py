"""Split a vision/audio-language model into encoders, projectors, language model and LM head.

The parts are found by convention (``get_encoder(modality=...)``, ``get_decoder()``, the usual
projector attribute names, ``lm_head``/``get_output_embeddings()``, ``get_input_embeddings()``)
and their forward kwargs are recorded with forward pre-hooks during one short greedy ``generate``
run. Listening on the submodules themselves, rather than on the top-level forward, also catches
an encoder that ``generate`` runs *before* the top-level forward (transformers 5 pre-encodes
images in ``generate`` and hands the features to the forward as ``mm_encoder_outputs``): its
call goes through the encoder module either way.

The step that puts the (projected) features in place of the placeholder tokens' embeddings
(``masked_scatter``) stays outside the graphs; the runner does it. Which output of which
component feeds what is worked out from the recorded values (see :func:`link_inputs`), so the
runner needs no model-specific code.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.tensors import get_leaf_tensors

__all__ = [
    "PROJECTOR_NAMES",
    "TEXT_ENCODER",
    "GridImageFeatures",
    "ImageEmbeds",
    "ImageFeatures",
    "MultimodalLayout",
    "ScaledLMHead",
    "SizedGridImageFeatures",
    "SizedImageFeatures",
    "decompose_multimodal",
    "find_multimodal_layout",
    "head_input_divisor",
    "image_feature_rows",
    "inner_generator",
    "is_multimodal",
    "link_inputs",
    "split_packed_images",
]

logger = logging.getLogger(__name__)

#: Modalities with a dedicated encoder, and the component name each gets.
MODALITIES: dict[str, str] = {"image": "image_encoder", "audio": "audio_encoder"}
#: Component name of the text encoder of an encoder-decoder language model (Florence-2).
TEXT_ENCODER = "encoder"
#: Conventional attribute names of projectors between an encoder and the language model.
PROJECTOR_NAMES: tuple[str, ...] = (
    "multi_modal_projector",
    "connector",
    "embed_vision",
    "embed_audio",
    "aligner",  # DeepSeek-VL
)


@dataclass
class MultimodalLayout:
    """The parts of a multimodal model.

    Attributes:
        encoders: ``{"image_encoder" | "audio_encoder": module}``.
        projectors: ``{component_name: module}``; the first is ``"multi_modal_projector"``, others keep
            their attribute name.
        language_model: the text decoder (``get_decoder()``).
        lm_head: the output projection (``None`` for a model without one).
        embed_tokens: the text token embedding (``get_input_embeddings()``).
    """

    encoders: dict[str, torch.nn.Module] = field(default_factory=dict)
    projectors: dict[str, torch.nn.Module] = field(default_factory=dict)
    language_model: torch.nn.Module | None = None
    lm_head: torch.nn.Module | None = None
    embed_tokens: torch.nn.Module | None = None

    def modules(self) -> dict[str, torch.nn.Module]:
        """Every part by component name, in execution order."""
        out: dict[str, torch.nn.Module] = {**self.encoders, **self.projectors}
        if self.embed_tokens is not None:
            out["embed_tokens"] = self.embed_tokens
        if self.language_model is not None:
            out["language_model"] = self.language_model
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        return out


class ScaledLMHead(torch.nn.Module):
    """The LM head applied to the language model's hidden states divided by a constant.

    Some models scale the last hidden state between the language model and the head in their own
    forward (Inkling: ``hidden_states / logits_mup_width_multiplier``); the split's ``lm_head``
    component then has to carry that step, or the prefill logits come out scaled (the argmax, and
    so greedy tokens, stay the same, which hides it). ``forward(input)`` takes the language model's
    ``last_hidden_state`` rows ``[batch, q, hidden]`` and returns ``head(input / divisor)``
    ``[batch, q, vocab]`` in the head's dtype.

    Args:
        head: the model's LM head (``nn.Linear``).
        divisor: the constant the model divides the hidden states by (see
            :func:`head_input_divisor`).
    """

    def __init__(self, head: torch.nn.Module, divisor: float) -> None:
        super().__init__()
        self.head = head
        self.divisor = float(divisor)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.head(input / self.divisor)


def head_input_divisor(hidden: torch.Tensor, head_input: torch.Tensor) -> float | None:
    """The constant ``c`` with ``head_input == hidden[:, -q:] / c``, when the two differ.

    Args:
        hidden: the language model's recorded ``last_hidden_state`` ``[batch, seq, hidden]``.
        head_input: the LM head's recorded input ``[batch, q, hidden]`` (``q <= seq``: generate
            keeps the last positions, ``logits_to_keep``).

    Returns:
        ``None`` when the head reads the hidden states as they are (or when the shapes do not line
        up: nothing to derive); the divisor (rounded to an integer when it is one up to 1e-5) when
        the head reads them divided by one constant.

    Raises:
        ValueError: the head's input differs from the hidden states by something other than one
            constant factor (a step between the language model and the head the split cannot
            carry); the message names the largest difference.
    """
    if hidden.dim() != 3 or head_input.dim() != 3 or hidden.shape[-1] != head_input.shape[-1]:
        return None
    q = int(head_input.shape[1])
    if q > hidden.shape[1] or hidden.shape[0] != head_input.shape[0]:
        return None
    tail = hidden[:, -q:].to(head_input.dtype)
    if torch.equal(tail, head_input):
        return None
    usable = head_input.abs() > 1e-6
    if not bool(usable.any()):
        raise ValueError("the LM head's recorded input is all zeros while the language model's output is not")
    divisor = float((tail[usable] / head_input[usable]).median())
    if abs(divisor - round(divisor)) <= 1e-5 * max(1.0, abs(divisor)):
        divisor = float(round(divisor))
    if divisor == 0.0 or not torch.allclose(tail / divisor, head_input, rtol=1e-4, atol=1e-6):
        worst = float((tail - head_input).abs().max())
        raise ValueError(
            "the LM head reads the language model's hidden states changed by a step other than one constant "
            f"factor (max difference {worst:.3e}); the split's lm_head component cannot carry it"
        )
    return divisor


def _is_submodule(model: torch.nn.Module, candidate: Any, *, base_model: bool = False) -> bool:
    """True when ``candidate`` is a module inside ``model`` other than itself and, unless
    ``base_model``, other than its base model."""
    if not isinstance(candidate, torch.nn.Module) or candidate is model:
        return False
    if not base_model and candidate is getattr(model, "base_model", None):
        return False
    return any(candidate is m for m in model.modules())


def find_multimodal_layout(model: torch.nn.Module) -> MultimodalLayout:
    """Find the encoders, projectors, language model, LM head and token embedding of ``model``.

    Args:
        model: a ``PreTrainedModel``.

    Returns:
        The :class:`MultimodalLayout`; ``encoders`` is empty for a text-only model (an encoder
        lookup that returns the model itself, or its base model, does not count).
    """
    layout = MultimodalLayout()
    get_encoder = getattr(model, "get_encoder", None)
    if not callable(get_encoder):
        return layout
    seen: list[torch.nn.Module] = []
    # an encoder-decoder whose text encoder also reads the image (T5Gemma 2: its encoder holds the
    # vision tower and takes pixel_values) is a plain encoder-decoder, its encoder one component
    text_encoder = _text_encoder(model)
    for modality, name in MODALITIES.items():
        try:
            encoder = get_encoder(modality=modality)
        except (TypeError, ValueError, AttributeError):
            continue
        if text_encoder is not None and encoder is text_encoder:
            continue
        if _is_submodule(model, encoder) and not any(encoder is s for s in seen):
            layout.encoders[name] = encoder
            seen.append(encoder)
    if not layout.encoders:
        return layout
    owners = [model, getattr(model, "model", None), getattr(model, "base_model", None)]
    for attr in PROJECTOR_NAMES:
        for owner in owners:
            module = getattr(owner, attr, None) if owner is not None else None
            if _is_submodule(model, module) and not any(module is s for s in seen):
                label = "multi_modal_projector" if "multi_modal_projector" not in layout.projectors else attr
                layout.projectors[label] = module
                seen.append(module)
                break
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    # the base model is the decoder of a model whose text decoder holds the vision tower
    # (IDEFICS: IdeficsModel cross-attends to it; issue 28)
    if _is_submodule(model, decoder, base_model=True):
        layout.language_model = _base_decoder(decoder)
    head = getattr(model, "lm_head", None)
    if head is None and callable(getattr(model, "get_output_embeddings", None)):
        head = model.get_output_embeddings()
    if head is None and decoder is not None and layout.language_model is not decoder:
        # the head of the causal LM the split's language model was taken out of (Nemotron-H
        # Omni keeps it there, not on the multimodal model; issue 28)
        head = decoder.get_output_embeddings()
    if _is_submodule(model, head):
        layout.lm_head = head
    embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if _is_submodule(model, embed):
        layout.embed_tokens = embed
    return layout


def _base_decoder(decoder: torch.nn.Module) -> torch.nn.Module:
    """The text decoder without its LM head: ``decoder.get_decoder()`` when ``decoder`` is itself a
    causal LM with an output embedding (BLIP-2's ``get_decoder()`` returns its ``OPTForCausalLM``,
    InstructBLIP's the ``OPTDecoder`` inside it), else ``decoder``; the split's language model
    returns hidden states and the LM head is a component of its own."""
    get_head = getattr(decoder, "get_output_embeddings", None)
    get_inner = getattr(decoder, "get_decoder", None)
    if not (callable(get_head) and callable(get_inner)):
        return decoder
    try:
        head, inner = get_head(), get_inner()
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return decoder
    if head is None or inner is decoder or not any(inner is m for m in decoder.modules()):
        # (the inner decoder may be the causal LM's base model: Nemotron-H Omni's NemotronHModel)
        return decoder
    return inner


def inner_generator(model: torch.nn.Module) -> torch.nn.Module | None:
    """The child of ``model`` that is a generative model of its own (``GenerationMixin``), or
    ``None``.

    BLIP-2, InstructBLIP and Kosmos-2 override ``generate``: it encodes the image and calls the
    inner language model's ``generate`` (``language_model`` / ``text_model``) with the embeddings,
    never the model's own forward. That inner model's forward calls are then the prefill and
    decode steps (:data:`hfexport.generation.recording.GENERATOR`).
    """
    from transformers import GenerationMixin

    for child in model.children():
        if isinstance(child, GenerationMixin) and isinstance(child, torch.nn.Module):
            return child
    return None


def is_multimodal(model: torch.nn.Module) -> bool:
    """True when ``model`` has an image or audio encoder submodule (``get_encoder(modality=...)``)."""
    return bool(find_multimodal_layout(model).encoders)


def _flat(value: Any) -> dict[str, torch.Tensor]:
    leaves = get_leaf_tensors(value)
    return {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to a reshape to ``[-1, hidden]``."""
    if a.numel() != b.numel() or a.dim() == 0 or b.dim() == 0 or a.shape[-1] != b.shape[-1]:
        return False
    return bool(torch.equal(a.reshape(-1, a.shape[-1]).to(b.dtype), b.reshape(-1, b.shape[-1])))


def link_inputs(
    component: str,
    kwargs: Mapping[str, Any],
    prompt: Mapping[str, Any],
    produced: Mapping[str, Mapping[str, torch.Tensor]],
    derived: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Say where each tensor input of an encoder or projector comes from, by value.

    Args:
        component: the component's name (for messages).
        kwargs: its recorded forward kwargs.
        prompt: the generate-style inputs.
        produced: ``{component: {output_path: tensor}}`` of the components that ran before it.
        derived: ``{input_name: grid_key}`` for inputs the runner precomputes from a grid input.

    Returns:
        ``{input_path: source}`` (see :class:`hfexport.generation.plan.GenerationPlan.links`).

    Raises:
        ValueError: an input matches nothing the runner will have (the message names it).
    """
    links: dict[str, dict[str, Any]] = {}
    prompt_tensors = {k: v for k, v in prompt.items() if isinstance(v, torch.Tensor)}
    for path, value in _flat(kwargs).items():
        if derived and path in derived:
            links[path] = {"from": "vision_grid", "key": path, "grid": derived[path]}
            continue
        source = next((k for k, v in prompt_tensors.items() if _equal(v, value)), None)
        if source is not None:
            links[path] = {"from": "prompt", "key": source}
            continue
        # a prompt input with its first two axes merged (IDEFICS' vision tower takes the
        # [batch, images, ...] pixel_values as [batch * images, ...])
        source = next(
            (
                k
                for k, v in prompt_tensors.items()
                if v.dim() == value.dim() + 1 and v.dim() >= 3 and _equal(v.flatten(0, 1), value)
            ),
            None,
        )
        if source is not None:
            links[path] = {"from": "prompt", "key": source, "flatten": True}
            continue
        # a decode step's per-token row of a token-aligned prompt input: the last one, repeated
        # for every new token (Mllama's cross_attention_mask, IDEFICS' image_attention_mask)
        source = next(
            (
                k
                for k, v in prompt_tensors.items()
                if v.dim() >= 2 and value.dim() == v.dim() and v.shape[1] > 1 and _equal(v[:, -1:], value)
            ),
            None,
        )
        if source is not None:
            links[path] = {"from": "prompt", "key": source, "last": True}
            continue
        found = None
        for name, outputs in produced.items():
            for out_path, out in outputs.items():
                if _equal(out, value):
                    found = {"from": "component", "component": name, "output": out_path, "drop_first": False}
                elif out.dim() >= 2 and out.shape[1] > 1 and _equal(out[:, 1:], value):
                    found = {"from": "component", "component": name, "output": out_path, "drop_first": True}
                if found:
                    break
            if found:
                break
        if found is None:
            raise ValueError(
                f"cannot tell where input {path!r} {tuple(value.shape)} of the {component} comes from: it equals no "
                f"generate input ({sorted(prompt_tensors)}) and no output of {sorted(produced)}"
            )
        links[path] = found
    return links


def feature_sources(
    embeds_in: torch.Tensor,
    text_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    produced: Mapping[str, Mapping[str, torch.Tensor]],
) -> dict[str, dict[str, Any]]:
    """Which component output replaced the embeddings of which placeholder token.

    Args:
        embeds_in: the ``inputs_embeds`` the language model received at prefill ``[batch, seq, hidden]``.
        text_embeds: the token embeddings of ``input_ids`` (output of ``embed_tokens``).
        input_ids: the prompt ``[batch, seq]``.
        produced: ``{component: {output_path: tensor}}`` of the encoders and projectors.

    Returns:
        ``{str(token_id): {"component": c, "output": o}}``.

    Raises:
        ValueError: replaced positions hold another token id than a single placeholder per modality,
            or their values match no recorded output.
    """
    changed = (embeds_in != text_embeds).any(dim=-1)
    if not bool(changed.any()):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for token in sorted({int(t) for t in input_ids[changed].tolist()}):
        where = input_ids == token
        values = embeds_in[where]
        match = None
        for name in reversed(list(produced)):  # the last stage (projector) first
            for out_path, tensor in produced[name].items():
                if tensor.is_floating_point() and _same_values(tensor, values):
                    match = {"component": name, "output": out_path}
                    break
            if match:
                break
        if match is None:
            raise ValueError(
                f"the embeddings of placeholder token {token} were replaced by values that match no output of "
                f"{sorted(produced)}; the merge step of this model is not a plain masked_scatter of one output"
            )
        out[str(token)] = match
    return out


#: language-model inputs the runner builds itself at prefill (and the cache, by prefix)
RUNNER_LANGUAGE_INPUTS = frozenset({"inputs_embeds", "attention_mask", "position_ids"})


def language_model_links(
    kwargs: Mapping[str, Any],
    input_ids: torch.Tensor,
    features: Mapping[str, Mapping[str, Any]],
    produced: Mapping[str, Mapping[str, torch.Tensor]],
) -> dict[str, dict[str, Any]]:
    """Say where the language model's other prefill inputs come from, by value (issue 28).

    Qwen3-VL's language model takes, next to the merged embeddings, DeepStack inputs: the bool
    ``visual_pos_masks`` ``[batch, seq]`` (where the placeholder tokens sit) and
    ``deepstack_visual_embeds``, one ``[image tokens, hidden]`` tensor per tapped vision layer (the
    image encoder's ``deepstack_features``), added to the hidden states of the first decoder
    layers.

    Args:
        kwargs: the language model's recorded prefill kwargs.
        input_ids: the prompt ``[batch, seq]``.
        features: :attr:`GenerationPlan.features` (``{placeholder_token_id: source}``).
        produced: ``{component: {output_path: tensor}}`` of the encoders and projectors.

    Returns:
        ``{input_path: source}`` (see :attr:`GenerationPlan.language_inputs`) for every tensor input
        outside :data:`RUNNER_LANGUAGE_INPUTS` and the cache that equals the placeholder mask or a
        component output; an input matching neither is left out (the runner then names it).
    """
    placeholders = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in features:
        placeholders |= input_ids == int(token)
    links: dict[str, dict[str, Any]] = {}
    for path, value in _flat(kwargs).items():
        if path in RUNNER_LANGUAGE_INPUTS or path.split(".")[0] in ("cache", "past_key_values"):
            continue
        if value.dtype == torch.bool and _equal(value, placeholders):
            links[path] = {"from": "placeholders"}
            continue
        for name, outputs in produced.items():
            found = next((o for o, out in outputs.items() if _equal(out, value)), None)
            if found is not None:
                links[path] = {"from": "component", "component": name, "output": found, "drop_first": False}
                break
    return links


def _without_unread_token_types(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop ``mm_token_type_ids`` from a decode call when it does not change the logits.

    ``generate`` keeps passing the multimodal token types at every step, but models that take
    precomputed ``position_ids`` only read them to compute M-RoPE positions at prefill. A graph
    input the computation never reads is an input every runtime must still be fed (and, for
    ExecuTorch, memory-planned); the call is run with and without it to make sure.
    """
    if "mm_token_type_ids" not in kwargs or "position_ids" not in kwargs:
        return kwargs
    import copy

    reduced = {k: v for k, v in kwargs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        full = model(**copy.deepcopy(kwargs)).logits
        token_types = dict(copy.deepcopy(kwargs))
        token_types["mm_token_type_ids"] = torch.ones_like(kwargs["mm_token_type_ids"])
        flipped = model(**token_types).logits
        without = model(**copy.deepcopy(reduced)).logits
    if torch.equal(full, without) and torch.equal(full, flipped):
        return reduced
    return kwargs


class ImageFeatures(torch.nn.Module):
    """The model's own ``get_image_features`` as one component: encoder, in-between steps and projector.

    Used when the encoder's and projector's inputs cannot be told apart from the recorded values
    (InternVL's pixel shuffle, or another reshaping step, sits between them). The encoders and
    projectors are registered as children, so their weights are the component's parameters; the
    owner of ``get_image_features`` is held outside the module tree (the language model is not
    part of this component).

    Args:
        owner: the module defining ``get_image_features`` (the model or its inner ``.model``).
        parts: ``{name: module}`` of the encoders and projectors it calls.
        inputs: the keyword names it is called with (``pixel_values``, ``image_sizes`` ...).

    ``forward(**inputs)`` returns the features ``[rows, hidden]``: a list of per-image tensors (as
    transformers 5 returns them) is concatenated, so the number of images stays a dynamic axis.
    When the result also holds DeepStack features (Granite-Docling: one per tapped vision layer,
    each split per image), it returns ``{"features": [rows, hidden], "deepstack_features":
    [[rows, hidden], ...]}``, each concatenated the same way, so the language model's
    ``deepstack_visual_embeds`` can be linked to them (issue 28).
    """

    def __init__(
        self,
        owner: torch.nn.Module,
        parts: Mapping[str, torch.nn.Module],
        inputs: list[str],
        getter: str = "get_image_features",
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        self.parts = torch.nn.ModuleDict(dict(parts))
        self.input_names = list(inputs)
        self.config = getattr(owner, "config", None)
        #: the owner's feature getter: ``get_image_features``, or ``get_video_features`` for a
        #: video-only model (InstructBLIP-Video; issue 28)
        self.getter = getter

    def forward(self, **kwargs: Any) -> torch.Tensor | dict[str, Any]:
        out = getattr(self._owner, self.getter)(**kwargs)
        rows = image_feature_rows(out)
        deepstack = None if isinstance(out, torch.Tensor) else getattr(out, "deepstack_features", None)
        if not deepstack:
            return rows
        return {"features": rows, "deepstack_features": [image_feature_rows(d) for d in deepstack]}


#: ``get_image_features`` inputs a model reads as values, not only as shapes: LLaVA-NeXT's anyres
#: picks each image's tile grid and unpadding crop from ``image_sizes``, Pixtral (Mistral3) its
#: patch grid and the patch merger's split. A graph taking them as tensors guards on unbacked
#: values (issue 28), so :class:`SizedImageFeatures` holds the size as a constant instead.
SIZE_INPUTS: tuple[str, ...] = ("image_sizes",)


class SizedImageFeatures(ImageFeatures):
    """The model's ``get_image_features`` for one image of one fixed size (a resolution class).

    LLaVA-NeXT, -Video, -OneVision (anyres) and Mistral3 / LightOnOCR (Pixtral) read
    ``image_sizes`` as Python values: the size picks the tile grid, the unpadding crop or the
    patch grid, so the number of feature rows and the graph itself depend on it. The size is held
    here as a constant and the component takes the other inputs of *one* image
    (``pixel_values`` ``[1, ...]``); the runner calls it once per image of the prompt, so the number
    of images stays free, and refuses an image of another size (see
    :attr:`hfexport.generation.plan.GenerationPlan.per_image`). This is the runtimes' own
    approach (one vision graph per resolution class).

    Args:
        owner: the module defining ``get_image_features``.
        parts: ``{name: module}`` of the encoders and projectors it calls.
        inputs: the keyword names of the per-image tensor inputs (``["pixel_values"]``).
        image_size: ``(height, width)`` of the images this component serves.

    ``forward(**inputs)`` returns the image's features ``[rows, hidden]``.
    """

    def __init__(
        self,
        owner: torch.nn.Module,
        parts: Mapping[str, torch.nn.Module],
        inputs: list[str],
        image_size: tuple[int, int],
    ) -> None:
        super().__init__(owner, parts, inputs)
        self.image_size = (int(image_size[0]), int(image_size[1]))

    def forward(self, **kwargs: Any) -> torch.Tensor:
        out = self._owner.get_image_features(**kwargs, image_sizes=[list(self.image_size)])
        return image_feature_rows(out)


#: ``get_image_features`` inputs giving each packed image's patch grid ``(height, width)``, read as
#: values (the tower splits the packed patches per image with ``.tolist()``, builds windows and
#: position ids from them), with the axis of ``pixel_values`` along which the images' patches are
#: packed and the grid's dtype: Nemotron-H Omni's ``image_grid_hw`` (flattened patches one after
#: the other, ``[patches, channels * patch**2]``), MiniCPM-V's ``target_sizes`` (patches side by
#: side in one row, ``[1, channels, patch, patches * patch]``) (issue 28)
GRID_SIZE_INPUTS: dict[str, tuple[int, torch.dtype]] = {
    "image_grid_hw": (0, torch.int64),
    "target_sizes": (-1, torch.int32),
}


class _KnownValues(torch.overrides.TorchFunctionMode):
    """Computes on real tensors, outside the trace, every call whose tensor arguments all hold
    values known at capture (a patch grid held as a constant, and what is computed from it and
    from Python numbers alone: window indices, position ids, sequence boundaries), so that the
    tower's reads of them as Python values (``tolist()``, ``item()``, ``bool()``) and the sizes
    they select (boolean indexing) are numbers, not data-dependent symbols (torch.export gives
    ``GuardOnDataDependentSymNode`` otherwise: a lifted constant is a fake tensor whose values it
    does not track). A known tensor that meets a traced one enters the graph as a constant.

    Calls with a traced tensor or a symbolic number among their arguments run as traced.
    """

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        # id -> tensor; the tensors are kept alive so that their ids are not reused
        self.known: dict[int, torch.Tensor] = {id(t): t for t in known}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch.utils._pytree as pytree
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        symbolic = any(isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool) for v in leaves)
        if symbolic or not all(id(v) in self.known for v in leaves if isinstance(v, torch.Tensor)):
            return func(*args, **kwargs)
        with _disable_current_modes():
            out = func(*args, **kwargs)
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.known[id(value)] = value
        return out


class GridImageFeatures(ImageFeatures):
    """The model's ``get_image_features`` for one image of one fixed patch grid.

    The packed-patch towers of :data:`GRID_SIZE_INPUTS` read each image's grid as Python values,
    so the component holds the grid as a constant (``[[height, width]]``) and takes one image's
    share of ``pixel_values``; the runner calls it once per image (see
    :func:`split_packed_images`). The image count stays free; another grid is refused.

    Args:
        owner: the module defining ``get_image_features``.
        parts: ``{name: module}`` of the encoders and projectors it calls.
        inputs: the keyword names of the per-image tensor inputs (``["pixel_values"]``).
        grid_input: the name of the grid input (``"image_grid_hw"`` or ``"target_sizes"``).
        grid: ``(height, width)`` in patches of the images this component serves.

    ``forward(**inputs)`` returns the image's features ``[rows, hidden]``.
    """

    def __init__(
        self,
        owner: torch.nn.Module,
        parts: Mapping[str, torch.nn.Module],
        inputs: list[str],
        grid_input: str,
        grid: tuple[int, int],
    ) -> None:
        super().__init__(owner, parts, inputs)
        self.grid_input = grid_input
        self.grid = (int(grid[0]), int(grid[1]))

    def forward(self, **kwargs: Any) -> torch.Tensor:
        from torch.utils._python_dispatch import _disable_current_modes

        dtype = GRID_SIZE_INPUTS[self.grid_input][1]
        with _disable_current_modes():
            grid = torch.tensor([list(self.grid)], dtype=dtype)
        # the grid's values, and those of every tensor computed from it alone, are read as Python
        # values where the tower reads them (issue 28)
        with _KnownValues([grid]):
            out = self._owner.get_image_features(**kwargs, **{self.grid_input: grid})
        return image_feature_rows(out)


def split_packed_images(
    values: Mapping[str, torch.Tensor], grid_input: str, grids: torch.Tensor
) -> list[dict[str, torch.Tensor]]:
    """Cut packed image inputs into one dict per image, by the images' patch grids.

    Args:
        values: the image encoder's inputs other than the grid: ``pixel_values`` with the images'
            patches packed along the axis :data:`GRID_SIZE_INPUTS` names for ``grid_input``
            (``[patches, D]`` or ``[1, C, P, patches * P]``); inputs of another layout are cut to
            image ``i`` along axis 0 (``[i : i + 1]``).
        grid_input: ``"image_grid_hw"`` or ``"target_sizes"``.
        grids: int ``[images, 2]``, each image's ``(height, width)`` in patches.

    Returns:
        ``[{name: tensor}]``, one per image, in order.

    Raises:
        ValueError: ``pixel_values``' packed axis is not a whole multiple of the grids' patch count.
    """
    axis = GRID_SIZE_INPUTS[grid_input][0]
    patches = [int(h) * int(w) for h, w in grids.reshape(-1, 2).tolist()]
    total = sum(patches)
    out: list[dict[str, torch.Tensor]] = [{} for _ in patches]
    for name, tensor in values.items():
        if name != "pixel_values":
            for i in range(len(patches)):
                out[i][name] = tensor[i : i + 1]
            continue
        length = int(tensor.shape[axis])
        if total == 0 or length % total:
            raise ValueError(
                f"{name} holds {length} values along axis {axis}, not a whole number per patch of the "
                f"{total} patches {grid_input} describes"
            )
        unit = length // total
        pieces = torch.split(tensor, [n * unit for n in patches], dim=axis)
        for i, piece in enumerate(pieces):
            out[i][name] = piece
    return out


def sized_image_features(
    module: ImageFeatures, kwargs: Mapping[str, Any]
) -> tuple[SizedImageFeatures | GridImageFeatures, dict[str, Any], list[int]] | None:
    """The one-image, fixed-size form of an :class:`ImageFeatures` component whose inputs hold
    :data:`SIZE_INPUTS`, or ``None`` when they hold none.

    Args:
        module: the component over the model's ``get_image_features``.
        kwargs: its recorded inputs, ``image_sizes`` int64 ``[images, 2]`` (height, width) among them.

    Returns:
        ``(component, one_image_kwargs, [height, width])``: every other input cut to its first
        image (``[1, ...]``).

    Raises:
        ValueError: the sample's images are not all of one size (the component serves one
            resolution class: pass images of one size).

    Packed-patch towers (:data:`GRID_SIZE_INPUTS`) get a :class:`GridImageFeatures` and the first
    image's share of the packed inputs (:func:`split_packed_images`); ``[height, width]`` is then
    the patch grid.
    """
    grid_name = next((k for k in GRID_SIZE_INPUTS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if grid_name is not None:
        grids = kwargs[grid_name].reshape(-1, 2)
        if grids.shape[0] == 0 or not bool((grids == grids[:1]).all()):
            raise ValueError(
                f"the sample images have patch grids {grids.tolist()}; the image encoder is exported for one "
                f"patch grid (its {grid_name} are read as values), so give sample images of one size"
            )
        grid = [int(v) for v in grids[0].tolist()]
        names = [k for k in module.input_names if k != grid_name]
        one = split_packed_images({k: kwargs[k] for k in names}, grid_name, grids)[0]
        component = GridImageFeatures(module._owner, dict(module.parts), names, grid_name, (grid[0], grid[1]))
        return component, one, grid
    name = next((k for k in SIZE_INPUTS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if name is None:
        return None
    sizes = kwargs[name].reshape(-1, 2)
    if sizes.shape[0] == 0 or not bool((sizes == sizes[:1]).all()):
        raise ValueError(
            f"the sample images have sizes {sizes.tolist()}; the image encoder is exported for one image size "
            f"(its {name} are read as values), so give sample images of one size"
        )
    size = [int(v) for v in sizes[0].tolist()]
    names = [k for k in module.input_names if k != name]
    one = {k: kwargs[k][:1] for k in names}
    return SizedImageFeatures(module._owner, dict(module.parts), names, (size[0], size[1])), one, size


#: ``get_image_features`` grid inputs (``[images, 3]``: temporal, height and width patches per
#: image) that a tower may read as values (HunYuan-V4-VL, Cosmos3-Edge, Kimi-K2.5: position
#: embeddings resized to each grid with ``F.interpolate``, per-image patch mergers); such a tower
#: is exported for one grid by :class:`SizedGridImageFeatures`.
GRID_INPUTS: tuple[str, ...] = ("image_grid_thw",)


class SizedGridImageFeatures(ImageFeatures):
    """The model's ``get_image_features`` for one image of one fixed patch grid.

    The packed-patch counterpart of :class:`SizedImageFeatures`: a tower that reads
    ``image_grid_thw`` as Python values (``F.interpolate(size=(h, w))`` of its learned position
    grid, a per-image merger reshaped to ``(h, w)``, ``.tolist()`` splits) is exported for the
    sample's first grid, held here as a constant; the component takes the packed patches of *one*
    image (``pixel_values`` ``[t * h * w, patch_dim]``) and the runner calls it once per image,
    refusing an image of another grid (:attr:`hfexport.generation.plan.GenerationPlan.per_image`).
    Captured under the ``capture.vision_language.fixed_grid`` patches, which let the fake tensors
    of ``torch.export`` keep the grid's values (:mod:`hfexport.workarounds.vision_language`).

    Args:
        owner: the module defining ``get_image_features``.
        parts: ``{name: module}`` of the encoders and projectors it calls.
        inputs: the keyword names of the per-image tensor inputs (``["pixel_values"]``).
        grid: ``(t, h, w)`` patches of the images this component serves.
        grid_name: the keyword the grid is passed as (``"image_grid_thw"``).

    ``forward(**inputs)`` returns the image's features ``[rows, hidden]``.
    """

    def __init__(
        self,
        owner: torch.nn.Module,
        parts: Mapping[str, torch.nn.Module],
        inputs: list[str],
        grid: tuple[int, int, int],
        grid_name: str = "image_grid_thw",
    ) -> None:
        super().__init__(owner, parts, inputs)
        self.grid = tuple(int(v) for v in grid)
        self.grid_name = grid_name

    def forward(self, **kwargs: Any) -> torch.Tensor:
        grid = torch.tensor([list(self.grid)], dtype=torch.int64)
        return image_feature_rows(self._owner.get_image_features(**kwargs, **{self.grid_name: grid}))


def sized_grid_image_features(
    module: ImageFeatures, kwargs: Mapping[str, Any]
) -> tuple[SizedGridImageFeatures, dict[str, Any], list[int]] | None:
    """The one-image, fixed-grid form of an :class:`ImageFeatures` component whose inputs hold
    one of :data:`GRID_INPUTS`, or ``None`` when they hold none.

    Args:
        module: the component over the model's ``get_image_features``.
        kwargs: its recorded inputs: ``image_grid_thw`` int64 ``[images, 3]`` and the packed
            ``pixel_values`` ``[sum(t * h * w), patch_dim]``.

    Returns:
        ``(component, one_image_kwargs, [t, h, w])``: ``pixel_values`` cut to the first image's
        ``t * h * w`` patches.

    Raises:
        ValueError: the sample's images do not all have one grid (the component serves one grid:
            give sample images of one size).
    """
    name = next((k for k in GRID_INPUTS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if name is None:
        return None
    grids = kwargs[name].reshape(-1, 3)
    if grids.shape[0] == 0 or not bool((grids == grids[:1]).all()):
        raise ValueError(
            f"the sample images have patch grids {grids.tolist()}; the image encoder is exported for one grid "
            f"(its {name} is read as values), so give sample images of one size"
        )
    grid = [int(v) for v in grids[0].tolist()]
    patches = grid[0] * grid[1] * grid[2]
    names = [k for k in module.input_names if k != name]
    one = {k: kwargs[k][:patches] for k in names}
    component = SizedGridImageFeatures(
        module._owner, dict(module.parts), names, (grid[0], grid[1], grid[2]), name
    )
    return component, one, grid


def image_feature_rows(out: Any) -> torch.Tensor:
    """The features of a ``get_image_features`` result as one ``[rows, hidden]`` tensor.

    Args:
        out: a tensor, a list/tuple of per-image tensors, or a model output whose
            ``pooler_output`` (transformers 5) or ``last_hidden_state`` holds them.

    Raises:
        TypeError: none of these holds a tensor.
    """
    for attr in ("pooler_output", "last_hidden_state", "image_embeds"):
        value = getattr(out, attr, None)
        if value is not None and not isinstance(out, torch.Tensor):
            out = value
            break
    if isinstance(out, torch.Tensor):
        return out.reshape(-1, out.shape[-1])
    if isinstance(out, list | tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in out], dim=0)
    raise TypeError(f"get_image_features returned {type(out).__name__}, which holds no feature tensor")


def _image_features_component(
    model: torch.nn.Module, layout: MultimodalLayout, inputs: Mapping[str, Any], *, precompute: bool = True
) -> tuple[ImageFeatures, dict[str, Any], dict[str, Any] | None, dict[str, str]] | None:
    """``(ImageFeatures, kwargs, grid settings, derived)`` over the model's ``get_image_features``,
    or ``None`` when it has none.

    When the image encoder is a Qwen-style patch-grid tower (:func:`vision_grid_settings`) and the
    call takes ``image_grid_thw`` (HyperCLOVAX-Vision-V2: a Qwen2.5-VL tower behind a projector
    the layout does not name), the kwargs also carry the tower's precomputed rotary position ids,
    ``cu_seqlens`` and window index (``get_image_features`` hands them down through ``**kwargs``),
    and ``derived`` maps each of them to ``"image_grid_thw"`` for :func:`link_inputs`, provided the
    features come out the same with them as without (otherwise none are added, ``settings`` is
    ``None``). ``precompute=False`` (a tower exported for one grid) adds none.
    """
    import inspect

    from hfexport.generation.vision_inputs import vision_grid_inputs, vision_grid_settings

    params: Mapping[str, Any] = {}
    getter: Any = None
    # get_video_features: a video-only model's (InstructBLIP-Video's frames; issue 28)
    getter_name = next(
        (
            name
            for name in ("get_image_features", "get_video_features")
            if any(
                callable(getattr(o, name, None))
                for o in (model, getattr(model, "model", None))
                if o is not None
            )
        ),
        "get_image_features",
    )
    for owner in (model, getattr(model, "model", None)):
        getter = getattr(owner, getter_name, None) if owner is not None else None
        if not callable(getter):
            continue
        try:
            params = inspect.signature(getter).parameters
        except (TypeError, ValueError):
            return None
        if "pixel_values" in params or "flattened_patches" in params:  # Kosmos-2.5's patches
            break
        # a getter that only forwards *args / **kwargs to its base model's (MiniCPM-V): the base
        # model's names the inputs (issue 28)
    else:
        if not callable(getter):
            return None
    kwargs = {k: v for k, v in inputs.items() if k in params and isinstance(v, torch.Tensor)}
    if "pixel_values" not in kwargs and "flattened_patches" not in kwargs:  # Kosmos-2.5's patches
        return None
    encoder = layout.encoders.get("image_encoder")
    grid = "image_grid_thw"
    settings = (
        vision_grid_settings(encoder) if precompute and encoder is not None and grid in kwargs else None
    )
    derived: dict[str, str] = {}
    parts = {**layout.encoders, **layout.projectors}
    if settings is not None:
        extra = vision_grid_inputs(kwargs[grid], settings)
        given = {**kwargs, **{k: v for k, v in extra.items() if k not in kwargs}}
        # kept only when the tower reads them as computed here (MiniMax-M3-VL's tower does not)
        with torch.no_grad():
            plain = _flat(ImageFeatures(owner, parts, list(kwargs))(**kwargs))
            precomputed = _flat(ImageFeatures(owner, parts, list(given))(**given))
        if plain.keys() == precomputed.keys() and all(_equal(plain[k], precomputed[k]) for k in plain):
            kwargs, derived = given, {k: grid for k in extra}
        else:
            settings = None
    return ImageFeatures(owner, parts, list(kwargs), getter_name), kwargs, settings, derived


def _text_encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The text encoder of an encoder-decoder multimodal model (``get_encoder()`` without a
    modality), or ``None`` for a decoder-only language model."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    try:
        encoder = model.get_encoder()
    except (TypeError, ValueError, AttributeError):
        return None
    return encoder if _is_submodule(model, encoder) else None


def _drop_unused_modalities(
    layout: MultimodalLayout, parts: dict[str, torch.nn.Module], calls: Mapping[str, list[Any]]
) -> list[str]:
    """Leave out the encoders and projectors of a modality the prompt does not carry (issue 28:
    dots3_note has an audio encoder, and an image prompt never calls it), when ``generate`` called
    at least one encoder: the components then serve prompts of the sample's modalities. With no
    encoder called, nothing is dropped (the caller reports the prompt as carrying no modality).
    Changes ``layout`` and ``parts`` in place.

    Returns:
        The names dropped.
    """
    if not any(calls.get(name) for name in layout.encoders):
        return []
    dropped = [
        name for name in [*layout.encoders, *layout.projectors] if name in parts and not calls.get(name)
    ]
    for name in dropped:
        parts.pop(name)
        layout.encoders.pop(name, None)
        layout.projectors.pop(name, None)
    if dropped:
        logger.info(
            "generate() did not call %s: left out of the components (a modality the prompt lacks)", dropped
        )
    return dropped


def _mrope_layout(
    inputs: Mapping[str, Any],
    recorded: torch.Tensor,
    mrope: Mapping[str, Any],
    features: Mapping[str, Any],
) -> str | None:
    """``"row_separated"`` when the prefill's recorded M-RoPE positions are HunYuan-VL's layout
    (:func:`hfexport.generation.vision_inputs.row_separated_mrope_position_ids`),
    ``"newline_column"`` when they are Qwen2-VL's over a grid one column wider (HunYuan-V4-VL's
    newline token per merged row, ``mrope_position_ids(newline_columns=1)``), ``None`` (the
    Qwen2-VL default) otherwise; decided by value on the sample prompt (issue 28)."""
    from hfexport.generation.vision_inputs import mrope_position_ids, row_separated_mrope_position_ids

    ids, grid = inputs.get("input_ids"), inputs.get("image_grid_thw")
    if not isinstance(ids, torch.Tensor) or not isinstance(grid, torch.Tensor):
        return None
    types = inputs.get("mm_token_type_ids")
    if not isinstance(types, torch.Tensor):
        types = torch.zeros_like(ids)
        for token in features:
            types = types.masked_fill(ids == int(token), 1)
    mask, merge, channels = inputs.get("attention_mask"), mrope["spatial_merge_size"], mrope["channels"]
    try:
        qwen, _ = mrope_position_ids(ids, types, grid, merge, mask)
        if torch.equal(qwen[-channels:], recorded.to(qwen.dtype)):
            return None
    except ValueError:
        pass
    try:
        newline, _ = mrope_position_ids(ids, types, grid, merge, mask, newline_columns=1)
        if torch.equal(newline[-channels:], recorded.to(newline.dtype)):
            return "newline_column"
    except ValueError:
        pass
    try:
        rows, _ = row_separated_mrope_position_ids(ids, types, grid, merge, mask, channels)
    except ValueError:
        return None
    return "row_separated" if torch.equal(rows, recorded.to(rows.dtype)) else None


def _canvas_mrope(
    model: torch.nn.Module, inputs: Mapping[str, Any], recorded: torch.Tensor
) -> dict[str, Any] | None:
    """The plan's :attr:`~hfexport.generation.plan.GenerationPlan.mrope` entry when the prefill's
    recorded M-RoPE positions are the canvas layout of the prompt's ``target_sizes`` crops
    (MiniCPM-V 4.7: :func:`hfexport.generation.vision_inputs.canvas_mrope_position_ids`), told by
    value at a merge of 4 or 2 patches per side; ``None`` otherwise (issue 28).

    Returns:
        ``{"layout": "canvas", "spatial_merge_size": m, "channels": c, "markers": {...}}``.
    """
    from hfexport.generation.vision_inputs import canvas_markers, canvas_mrope_position_ids

    ids, sizes, types = (inputs.get(k) for k in ("input_ids", "target_sizes", "mm_token_type_ids"))
    if not all(isinstance(v, torch.Tensor) for v in (ids, sizes, types)):
        return None
    markers = canvas_markers(model.config)
    channels = int(recorded.shape[0])
    for merge in (4, 2):
        try:
            positions = canvas_mrope_position_ids(
                ids, types, sizes, merge, inputs.get("attention_mask"), markers
            )
        except ValueError:
            continue
        if torch.equal(positions[-channels:], recorded.to(positions.dtype)):
            return {"layout": "canvas", "spatial_merge_size": merge, "channels": channels, "markers": markers}
    return None


class ImageEmbeds(ImageFeatures):
    """The model's own ``get_image_features`` as one component, its result kept in the layout the
    language model takes it in (``[images, tokens, hidden]``: Kosmos-2's ``image_embeds``) rather
    than flattened to rows: for a language model that takes the image features as an input of its
    own instead of at placeholder tokens (see :func:`_decompose_inner_generator`).

    ``forward(**inputs)`` returns the ``pooler_output`` (transformers 5), else the
    ``last_hidden_state``, else the tensor ``get_image_features`` returns.

    Raises:
        TypeError: (on call) the result holds no tensor.
    """

    def forward(self, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        out = self._owner.get_image_features(**kwargs)
        for attr in ("pooler_output", "last_hidden_state", "image_embeds"):
            value = getattr(out, attr, None)
            if isinstance(value, torch.Tensor) and not isinstance(out, torch.Tensor):
                return value
        if isinstance(out, torch.Tensor):
            return out
        raise TypeError(f"get_image_features returned {type(out).__name__}, which holds no feature tensor")


#: step inputs the runner builds itself for an inner language model's prefill and decode calls
STEP_RUNNER_INPUTS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids"}
)


def _step_tensors(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensor inputs of a prefill/decode call other than :data:`STEP_RUNNER_INPUTS` and the cache."""
    return {
        path: value
        for path, value in _flat(kwargs).items()
        if path not in STEP_RUNNER_INPUTS and path.split(".")[0] not in ("cache", "past_key_values")
    }


def _prompt_edit(inputs: Mapping[str, Any], prefill: Mapping[str, Any]) -> dict[str, int]:
    """How ``generate`` rewrote the prompt ids before the inner language model's prefill (see
    :attr:`hfexport.generation.plan.GenerationPlan.prompt_edit`), told by value.

    Raises:
        ValueError: the prefill's ids are neither the prompt's nor a prefix of it with a constant
            first token (the message shows both shapes).
    """
    given, seen = inputs.get("input_ids"), prefill.get("input_ids")
    if not isinstance(given, torch.Tensor) or not isinstance(seen, torch.Tensor) or _equal(given, seen):
        return {}
    length = int(seen.shape[-1])
    edit: dict[str, int] = {}
    if seen.shape[0] == given.shape[0] and 0 < length <= given.shape[-1]:
        if length < given.shape[-1]:
            edit["drop_last"] = int(given.shape[-1]) - length
        first = seen[:, :1]
        if bool(torch.equal(seen[:, 1:], given[:, 1:length])) and bool((first == first[0, 0]).all()):
            if not torch.equal(first, given[:, :1]):
                edit["first_token"] = int(first[0, 0])
            return edit
    raise ValueError(
        f"the language model's prefill took input_ids {tuple(seen.shape)} that are not the prompt's "
        f"{tuple(given.shape)}, nor a prefix of it with one first token: generate() rewrites the prompt in a way "
        "the runner cannot repeat"
    )


def _filled_in_masks(
    generator: torch.nn.Module, prefill: dict[str, Any], steps: Mapping[str, torch.Tensor]
) -> list[str]:
    """The all-ones ``*attention_mask`` step inputs (BLIP's ``encoder_attention_mask`` over the image
    features) whose absence gives the same logits: the forward builds them itself, so they are no
    graph input (each runtime would have to be fed and, for ExecuTorch, plan it)."""
    import copy

    names = [
        path
        for path, value in steps.items()
        if path.endswith("attention_mask")
        and path in prefill
        and not value.is_floating_point()
        and bool((value == 1).all())
    ]
    if not names:
        return []
    with torch.no_grad():
        full = generator(**copy.deepcopy(prefill)).logits
        without = generator(**copy.deepcopy({k: v for k, v in prefill.items() if k not in names})).logits
    return names if torch.equal(full, without) else []


def _cross_attending_steps(
    model: torch.nn.Module,
    sources: list[Mapping[str, Any]],
    recording: Any,
    plan: Any,
    produced: Mapping[str, Mapping[str, torch.Tensor]],
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The whole model's prefill and decode kwargs for a language model that takes token ids and
    cross-attends to the image features, or ``None`` when the model is not one.

    Mllama's text model reads ``cross_attention_states`` (the projector's output) at prefill and
    its cross-attention K/V from the cache after; IDEFICS' decoder reads
    ``image_encoder_embeddings`` (the vision tower's output) at every decode step. Neither takes
    ``inputs_embeds`` merged at placeholder tokens, so the split's steps are the model's own
    forward, its prefill given that input (the image component's output, in the component's
    layout) in place of the image inputs the image components read.

    Args:
        model: the multimodal model.
        sources: recorded kwargs to look for the feature input in: the language model's prefill
            call, then the model's decode call.
        recording: the :class:`~hfexport.generation.recording.Recording` of ``generate``.
        plan: the plan, its :attr:`~hfexport.generation.plan.GenerationPlan.links` filled in.
        produced: ``{component: {output_path: tensor}}`` of the image components.

    Returns:
        ``(prefill_kwargs, decode_kwargs, without_image)``, or ``None`` when no floating point input
        of ``sources`` that the model's forward accepts holds an image component's output, or when
        the prefill given it differs from the recorded one (logits beyond 1e-5). ``without_image``
        is :func:`_image_free_inputs`' answer: how the steps run a text-only prompt, ``{}`` when
        they cannot.
    """
    import copy
    import inspect

    try:
        accepted = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    feature: tuple[str, torch.Tensor] | None = None
    for kwargs in sources:
        for path, value in _flat(kwargs).items():
            key = path.split(".")[0]
            if key not in accepted or key in ("cache", "past_key_values") or not value.is_floating_point():
                continue
            match = next(
                (
                    out
                    for outputs in produced.values()
                    for out in outputs.values()
                    if _same_values(out, value)
                ),
                None,
            )
            if match is not None and path == key:
                feature = (key, match)
                break
        if feature is not None:
            break
    if feature is None:
        return None
    image_keys = {
        source["key"]
        for links in plan.links.values()
        for source in links.values()
        if source.get("from") == "prompt"
    }
    prefill = {k: v for k, v in recording.prefill.items() if k not in image_keys}
    prefill[feature[0]] = feature[1]
    with torch.no_grad():
        expected = model(**copy.deepcopy(dict(recording.prefill))).logits
        got = model(**copy.deepcopy(prefill)).logits
    if expected.shape != got.shape or not torch.allclose(expected, got, atol=1e-5, rtol=0):
        logger.info(
            "%s: its prefill given %s in place of %s differs from generate()'s; not split as a cross-attending model",
            type(model).__name__,
            feature[0],
            sorted(image_keys),
        )
        return None
    return prefill, dict(recording.decode), _image_free_inputs(model, prefill, feature[0])


def _image_free_inputs(
    model: torch.nn.Module, prefill: Mapping[str, Any], feature: str
) -> dict[str, dict[str, Any]]:
    """How the steps of a cross-attending language model run a text-only prompt: ``{input: {"zeros":
    [axes after the batch (and, with "token_aligned", the tokens)], "dtype": d[, "token_aligned":
    True]}}``, or ``{}`` when the model's text-only logits are not what the steps give.

    ``model.generate`` without an image skips the cross-attention layers (Mllama: no
    ``cross_attention_states``, no ``cross_attention_mask``), a branch the exported steps do not
    hold. Zero image features with a zero cross-attention mask give the same numbers through them:
    the cross-attended keys and values are zero (Mllama's projections have no bias), and every text
    row of the mask is masked out, which zeroes the gated MLP's part (``full_text_row_masked_out_mask``),
    so each cross-attention layer adds exactly zero. That is checked here on the recorded prompt:
    the prefill given the zeros against the model given the text inputs alone, equal logits
    (within 1e-6) or ``{}`` (the runner then refuses a text-only prompt, naming the image inputs).

    Args:
        model: the multimodal model (its forward is the steps' forward).
        prefill: the prefill step's kwargs, the image features in place of the image inputs.
        feature: the input holding the image features (``cross_attention_states``).
    """
    import copy

    ids = prefill.get("input_ids")
    value = prefill.get(feature)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(value, torch.Tensor):
        return {}
    # token-aligned prompt inputs that mark what each token sees of the image ([batch, seq, ...])
    aligned = [
        k
        for k, v in prefill.items()
        if k not in (feature, "input_ids", "attention_mask", "position_ids")
        and isinstance(v, torch.Tensor)
        and v.dim() >= 3
        and tuple(v.shape[:2]) == tuple(ids.shape)
    ]
    zeroed = {
        **prefill,
        feature: torch.zeros_like(value),
        **{k: torch.zeros_like(prefill[k]) for k in aligned},
    }
    text = {k: v for k, v in prefill.items() if k != feature and k not in aligned}
    try:
        with torch.no_grad():
            expected = model(**copy.deepcopy(text)).logits
            got = model(**copy.deepcopy(zeroed)).logits
    except Exception as exc:  # a model that needs the image inputs: no text-only path
        logger.info("%s: no text-only path through its steps (%s)", type(model).__name__, exc)
        return {}
    if expected.shape != got.shape or not torch.allclose(expected, got, atol=1e-6, rtol=0):
        logger.info(
            "%s: its steps given zero %s differ from its text-only forward; a text-only prompt is refused",
            type(model).__name__,
            [feature, *aligned],
        )
        return {}
    out: dict[str, dict[str, Any]] = {
        feature: {
            "zeros": [int(d) for d in value.shape[1:]],
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    }
    for k in aligned:
        t = prefill[k]
        out[k] = {
            "zeros": [int(d) for d in t.shape[2:]],
            "dtype": str(t.dtype).removeprefix("torch."),
            "token_aligned": True,
        }
    return out


def _takes_image_input(calls: list[Mapping[str, Any]]) -> bool:
    """True when an inner language model's first recorded call takes the image features as an
    input of its own: a floating point tensor other than ``inputs_embeds`` and the cache, and no
    ``inputs_embeds`` (Kosmos-2.5's ``image_embeds``; BLIP-2's OPT takes merged ``inputs_embeds``)."""
    if not calls:
        return False
    tensors = _step_tensors(calls[0])
    if isinstance(calls[0].get("inputs_embeds"), torch.Tensor):
        return False
    return any(v.is_floating_point() for k, v in tensors.items() if k != "inputs_embeds")


def _decompose_inner_generator(
    model: torch.nn.Module,
    layout: MultimodalLayout,
    inputs: Mapping[str, Any],
    generator: torch.nn.Module,
    *,
    generation_config: Any = None,
    multi_token_decode: bool = False,
    steps_from_generator: bool = False,
) -> Any:
    """Split a model whose ``generate`` encodes the image and hands the features to an inner
    language model's ``generate`` as an input of that model's own (issue 28): BLIP's text decoder
    cross-attends to them (``encoder_hidden_states``, a per-prompt constant input of every step),
    Kosmos-2's text model places ``image_embeds`` at ``image_embeds_position_mask`` in its prefill.

    Components: the image encoder (and projectors) whose outputs the steps take, or the model's
    ``get_image_features`` as one :class:`ImageEmbeds` component when no recorded output equals
    them (Kosmos-2 normalises and projects after its vision tower); ``prefill`` and ``decode``, the
    inner model's first and later forward calls. :attr:`GenerationPlan.step_inputs` says where each
    step's other inputs come from, :attr:`GenerationPlan.prompt_edit` how ``generate`` rewrote the
    prompt; the end-of-sequence and padding ids are the ones the model hands to the inner
    ``generate`` (BLIP: ``[SEP]`` ends a caption).

    Args:
        steps_from_generator: take the inner model's forward calls as the steps although the
            model's own forward is called too (Kosmos-2.5: the forward computes the image features
            and calls the inner model with them).

    Returns:
        A :class:`hfexport.generation.decompose.Decomposition` ``{"image_encoder" [| projectors] |
        "prefill" | "decode": (module, kwargs)}`` with its plan.

    Raises:
        ValueError: a step input matches no prompt input nor image feature (the message names it),
            or the prompt was rewritten in a way the runner cannot repeat.
        RuntimeError: ``generate`` failed, or the inner model's forward was not called.
    """
    from hfexport.generation.components import Decomposition, describe_components, token_ids_of
    from hfexport.generation.plan import GenerationPlan
    from hfexport.generation.recording import GENERATOR, record_generation

    parts: dict[str, torch.nn.Module] = {
        name: module
        for name, module in {**layout.encoders, **layout.projectors}.items()
        if module is not generator
    }
    handed: dict[str, Any] = {}
    original = generator.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        # the end-of-sequence / padding ids the model's generate hands to the inner one
        handed.update({k: kwargs[k] for k in ("eos_token_id", "pad_token_id") if kwargs.get(k) is not None})
        return original(*args, **kwargs)

    generator.generate = spy  # type: ignore[method-assign]
    try:
        recording = record_generation(
            model,
            # on copies: BLIP's generate writes its BOS into the prompt's input_ids in place
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            submodules={**parts, GENERATOR: generator},
            record_outputs=True,
            steps_from=GENERATOR if steps_from_generator else None,
        )
    finally:
        del generator.generate
    if recording.caller != GENERATOR:
        raise RuntimeError(
            f"{type(model).__name__}.generate() did not step {type(generator).__name__}'s forward; nothing to split"
        )
    calls, outputs = recording.capture.calls, recording.capture.outputs
    _drop_unused_modalities(layout, parts, calls)
    missing = [name for name in parts if not calls[name]]
    if missing:
        raise ValueError(
            f"generate() never called {missing} of {type(model).__name__}; check that the inputs carry the "
            "modality (pixel_values) and its placeholder tokens"
        )
    token_ids = token_ids_of(generator)
    token_ids.update(token_ids_of(model))
    for key, value in handed.items():
        value = value.tolist() if isinstance(value, torch.Tensor) else value
        token_ids[key] = (
            [int(v) for v in value] if key == "eos_token_id" and isinstance(value, list) else value
        )
        if key == "eos_token_id" and not isinstance(value, list):
            token_ids[key] = [int(value)]
    plan = GenerationPlan(
        architecture="multimodal",
        model_class=type(model).__name__,
        cache_kind=recording.cache_kind,
        max_cache_len=recording.max_cache_len,
        multi_token_decode=multi_token_decode,
        token_ids=token_ids,
    )
    prefill, decode = dict(recording.prefill), dict(recording.decode)
    plan.prompt_edit = _prompt_edit(inputs, prefill)
    prompt = dict(inputs)
    if plan.prompt_edit:
        length = int(prefill["input_ids"].shape[-1])
        prompt["input_ids"] = prefill["input_ids"]
        if isinstance(inputs.get("attention_mask"), torch.Tensor):
            prompt["attention_mask"] = inputs["attention_mask"][:, :length]
    steps = {"prefill": _step_tensors(prefill), "decode": _step_tensors(decode)}
    dropped = _filled_in_masks(generator, prefill, steps["prefill"])
    if dropped:
        prefill = {k: v for k, v in prefill.items() if k not in dropped}
        decode = {k: v for k, v in decode.items() if k not in dropped}
        steps = {
            step: {k: v for k, v in values.items() if k not in dropped} for step, values in steps.items()
        }
    components: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {}
    produced: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for name, module in parts.items():
            kwargs = calls[name][0]
            plan.links[name] = link_inputs(name, kwargs, prompt, produced)
            produced[name] = _flat(outputs[name][0])
            components[name] = (module, kwargs)
        plan.step_inputs = {
            step: link_inputs(step, values, prompt, produced) for step, values in steps.items()
        }
    except ValueError as exc:
        # a step between the vision tower and the language model (Kosmos-2's normalisation and
        # projection): the model's get_image_features as one component
        fallback = _image_features_component(model, layout, inputs)
        if fallback is None or fallback[2] is not None:
            raise
        features, kwargs, _, _ = fallback
        module = ImageEmbeds(features._owner, dict(features.parts), features.input_names)
        with torch.no_grad():
            produced = {"image_encoder": {"": module(**kwargs)}}
        try:
            plan.links = {"image_encoder": link_inputs("image_encoder", kwargs, prompt, {})}
            plan.step_inputs = {
                step: link_inputs(step, values, prompt, produced) for step, values in steps.items()
            }
        except ValueError as again:
            raise ValueError(f"{exc}; nor do the model's get_image_features outputs: {again}") from exc
        components = {"image_encoder": (module, kwargs)}
        logger.info("%s: image features exported as one component (%s)", type(model).__name__, exc)
    components["prefill"] = (generator, prefill)
    components["decode"] = (generator, decode)
    plan.components = list(components)
    decomposition = Decomposition(components, plan, model)
    describe_components(decomposition)
    return decomposition


def decompose_multimodal(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    generation_config: Any = None,
    multi_token_decode: bool = False,
    include_decode: bool = False,
    per_image_grid: bool = False,
) -> Any:
    """Record the kwargs of every multimodal part from one short greedy ``generate`` run.

    Args:
        model: a multimodal ``PreTrainedModel`` (see :func:`is_multimodal`).
        inputs: generate-style inputs as the processor returns them (``input_ids``,
            ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` ...).
        generation_config: optional ``GenerationConfig`` (cache settings are kept; copied).
        multi_token_decode: capture a two-token decode step (with ``include_decode``).
        include_decode: also return the ``decode`` component (the whole model at a decode step).
        per_image_grid: export the image features for one image of the sample's patch grid
            (:class:`SizedGridImageFeatures`), for a tower that reads ``image_grid_thw`` as values
            (:func:`hfexport.generation.export.export_components` retries with it when the grid
            tower's capture fails on a data-dependent value).

    Returns:
        A :class:`hfexport.generation.decompose.Decomposition`:
        ``{"image_encoder" | "audio_encoder" | "multi_modal_projector" | "embed_tokens" |
        "language_model" | "lm_head" [| "decode"]: (module, kwargs)}`` with its plan. For an
        encoder-decoder language model (Florence-2): ``... "embed_tokens" | "encoder" (the text
        encoder, taking the merged ``inputs_embeds``) | "prefill" | "decode"`` (the whole model's
        first and later decoder steps, taking ``encoder_outputs``); ``include_decode`` is implied.

    Raises:
        ValueError: no modality encoder or no language model found (nothing to split), a part
            that ``generate`` never called, or inputs whose source cannot be told.
        RuntimeError: ``generate`` failed.
    """
    from hfexport.generation.components import Decomposition, describe_components, token_ids_of
    from hfexport.generation.plan import GenerationPlan
    from hfexport.generation.recording import GENERATOR, record_generation
    from hfexport.generation.vision_inputs import vision_grid_inputs, vision_grid_settings

    layout = find_multimodal_layout(model)
    if not layout.encoders or layout.language_model is None:
        raise ValueError(
            f"no multimodal submodules found in {type(model).__name__}: it needs an image/audio encoder "
            "(get_encoder(modality='image'|'audio')) and a language model (get_decoder()); "
            "use decompose_prefill_decode for text-only models"
        )
    parts = layout.modules()
    text_encoder = _text_encoder(model)
    if text_encoder is not None:
        # an encoder-decoder language model (Florence-2's BART): the merged embeddings go through
        # its text encoder, and generate() calls the encoder and the whole model's decoder steps,
        # never the language model's own forward (issue 28)
        parts = {k: v for k, v in parts.items() if k != "language_model"}
        parts[TEXT_ENCODER] = text_encoder
    generator = inner_generator(model)
    generator_is_part = generator is not None and any(generator is part for part in parts.values())
    recorded = dict(parts) if generator is None or generator_is_part else {**parts, GENERATOR: generator}
    if generator is not None:
        # BLIP's generate writes its BOS into the caller's input_ids in place: record on copies, so
        # the prompt the runner rewrites is told from the one given
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        given = dict(inputs)
    try:
        recording = record_generation(
            model,
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            if generator is not None
            else inputs,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            submodules=recorded,
            record_outputs=True,
            decoder_masks={"language_model": layout.language_model} if text_encoder is None else None,
        )
    except RuntimeError as exc:
        if not generator_is_part or "bypasses its forward" not in str(exc):
            raise
        # the inner generative model is the split's language model itself and takes the image
        # features as an input of its own (Kosmos-2's image_embeds at image_embeds_position_mask,
        # BLIP's cross-attention encoder_hidden_states), not merged at placeholder token ids
        assert generator is not None
        return _decompose_inner_generator(
            model,
            layout,
            given,
            generator,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
        )
    calls, outputs = recording.capture.calls, recording.capture.outputs
    generator_label = next((name for name, part in recorded.items() if part is generator), None)
    if generator_label is not None and _takes_image_input(calls.get(generator_label) or []):
        # the model's forward computes the image features and hands them to its inner language
        # model as an input of that model's own (Kosmos-2.5's image_embeds): that model's calls
        # are the steps
        assert generator is not None
        return _decompose_inner_generator(
            model,
            layout,
            inputs,
            generator,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            steps_from_generator=True,
        )
    _drop_unused_modalities(layout, parts, calls)
    missing = [name for name in parts if not calls[name]]
    if [m for m in missing if m != "lm_head"]:
        raise ValueError(
            f"generate() never called {missing} of {type(model).__name__}; check that the inputs carry the "
            "modality (pixel_values / input_features) and its placeholder tokens"
        )
    components: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {}
    plan = GenerationPlan(
        architecture="multimodal",
        model_class=type(model).__name__,
        cache_kind=recording.cache_kind,
        max_cache_len=recording.max_cache_len,
        multi_token_decode=multi_token_decode,
        token_ids=token_ids_of(model),
    )
    produced: dict[str, dict[str, torch.Tensor]] = {}
    lm_kwargs = calls[TEXT_ENCODER if text_encoder is not None else "language_model"][0]
    embeds_in = lm_kwargs.get("inputs_embeds")
    text: torch.Tensor | None = None
    if isinstance(embeds_in, torch.Tensor) and "embed_tokens" in parts and "input_ids" in inputs:
        text = next(iter(_flat(outputs["embed_tokens"][0]).values()))
    try:
        if per_image_grid:
            raise ValueError("the image tower reads its patch grid as values: one image of one grid per call")
        for name in [*layout.encoders, *layout.projectors]:
            module = parts[name]
            kwargs = calls[name][0]
            derived: dict[str, str] = {}
            settings = vision_grid_settings(module) if "grid_thw" in kwargs else None
            if settings is not None:
                plan.vision_grid[name] = settings
                extra = vision_grid_inputs(kwargs["grid_thw"], settings)
                kwargs = {**kwargs, **{k: v for k, v in extra.items() if k not in kwargs}}
                derived = {k: "grid_thw" for k in extra}
            plan.links[name] = link_inputs(name, kwargs, inputs, produced, derived)
            produced[name] = _flat(outputs[name][0])
            components[name] = (module, kwargs)
        if text is not None:
            plan.features = feature_sources(embeds_in, text, inputs["input_ids"], produced)
    except ValueError as exc:
        # a step between the recorded parts (InternVL's pixel shuffle ...): one component running
        # the model's own get_image_features instead (issue 28)
        fallback = _image_features_component(model, layout, inputs, precompute=not per_image_grid)
        if fallback is None or text is None:
            raise
        module, kwargs, settings, derived = fallback
        components.clear()
        plan.links.clear()
        plan.vision_grid.clear()
        plan.per_image.clear()
        if settings is not None:
            plan.vision_grid["image_encoder"] = settings
        sized = sized_image_features(module, kwargs) if settings is None else None
        gridded = sized_grid_image_features(module, kwargs) if per_image_grid and sized is None else None
        try:
            if gridded is not None:
                # the patch grid is read as values (HunYuan-V4-VL, Cosmos3-Edge): one image per call
                module, one, grid = gridded
                patches = grid[0] * grid[1] * grid[2]
                images = int(kwargs[module.grid_name].shape[0])
                with torch.no_grad():
                    rows = torch.cat(
                        [
                            module(**{k: kwargs[k][i * patches : (i + 1) * patches] for k in one})
                            for i in range(images)
                        ]
                    )
                plan.links["image_encoder"] = {k: {"from": "prompt", "key": k} for k in one}
                plan.per_image["image_encoder"] = {module.grid_name: grid}
                kwargs = one
                produced = {"image_encoder": {"": rows}}
            elif sized is None:
                with torch.no_grad():
                    produced = {"image_encoder": _flat(module(**kwargs))}
                plan.links["image_encoder"] = link_inputs("image_encoder", kwargs, inputs, {}, derived)
            else:
                # the image size is read as values (anyres, Pixtral): one image of one size per call
                module, one, size = sized
                if isinstance(module, GridImageFeatures):
                    grids = kwargs[module.grid_input]
                    pieces = split_packed_images({k: kwargs[k] for k in one}, module.grid_input, grids)
                    entry: dict[str, Any] = {"grid": size, "grid_input": module.grid_input}
                else:
                    images = int(kwargs[module.input_names[0]].shape[0])
                    pieces = [{k: kwargs[k][i : i + 1] for k in one} for i in range(images)]
                    entry = {"image_sizes": size}
                with torch.no_grad():
                    rows = torch.cat([module(**piece) for piece in pieces])
                plan.links["image_encoder"] = {k: {"from": "prompt", "key": k} for k in one}
                plan.per_image["image_encoder"] = entry
                kwargs = one
                produced = {"image_encoder": {"": rows}}
            plan.features = feature_sources(embeds_in, text, inputs["input_ids"], produced)
        except ValueError as again:
            raise ValueError(f"{exc}; nor do the model's get_image_features outputs: {again}") from exc
        components["image_encoder"] = (module, kwargs)
        logger.info("%s: image features exported as one component (%s)", type(model).__name__, exc)
    if text_encoder is None and not isinstance(embeds_in, torch.Tensor) and produced:
        # the language model takes token ids and cross-attends to the image (Mllama's
        # cross_attention_states, IDEFICS' image_encoder_embeddings): the whole model's steps,
        # given the image features in place of the image inputs (issue 28)
        steps = _cross_attending_steps(model, [lm_kwargs, recording.decode], recording, plan, produced)
        if steps is not None:
            prefill, decode, without_image = steps
            plan.step_inputs = {
                "prefill": link_inputs("prefill", _step_tensors(prefill), inputs, produced),
                "decode": link_inputs("decode", _step_tensors(decode), inputs, produced),
            }
            # a text-only prompt runs the steps with zero image features and masks (checked equal to
            # the model's text-only forward): each such source says so
            for step_links in plan.step_inputs.values():
                for path, source in step_links.items():
                    key = source.get("key") if source.get("from") == "prompt" else path
                    if key in without_image:
                        source["without_image"] = dict(without_image[key])
            components["prefill"] = (model, prefill)
            components["decode"] = (model, decode)
            plan.components = list(components)
            decomposition = Decomposition(components, plan, model)
            describe_components(decomposition)
            return decomposition
    if "embed_tokens" in parts:
        components["embed_tokens"] = (parts["embed_tokens"], calls["embed_tokens"][0])
    if text_encoder is not None:
        components[TEXT_ENCODER] = (text_encoder, lm_kwargs)
        components["prefill"] = (model, recording.prefill)
        components["decode"] = (model, recording.decode)
        plan.components = list(components)
        decomposition = Decomposition(components, plan, model)
        describe_components(decomposition)
        return decomposition
    components["language_model"] = (layout.language_model, lm_kwargs)
    if text is not None:
        plan.language_inputs = language_model_links(lm_kwargs, inputs["input_ids"], plan.features, produced)
    position_ids = lm_kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        merge = next((s["spatial_merge_size"] for s in plan.vision_grid.values()), None)
        vision_config = getattr(model.config, "vision_config", None)
        merge = merge or getattr(vision_config, "spatial_merge_size", None)
        canvas = _canvas_mrope(model, inputs, position_ids) if merge is None else None
        if canvas is not None:
            plan.mrope = canvas
        elif merge is None:
            raise ValueError(
                f"{type(model).__name__} takes 3-D (M-RoPE) position ids but has no spatial_merge_size, and its "
                "prefill's position ids are not the canvas layout of its target_sizes crops either: the runner "
                "cannot compute them"
            )
        else:
            plan.mrope = {"spatial_merge_size": int(merge), "channels": int(position_ids.shape[0])}
            rope_layout = _mrope_layout(inputs, position_ids, plan.mrope, plan.features)
            if rope_layout is not None:
                plan.mrope["layout"] = rope_layout
    if layout.lm_head is not None and calls["lm_head"]:
        head, head_kwargs = layout.lm_head, calls["lm_head"][0]
        hidden = _flat(outputs["language_model"][0]).get("last_hidden_state")
        head_input = head_kwargs.get("input")
        if isinstance(hidden, torch.Tensor) and isinstance(head_input, torch.Tensor):
            # the model's forward may scale the hidden states before its head (Inkling divides them
            # by logits_mup_width_multiplier): the lm_head component carries that step (issue 28)
            try:
                divisor = head_input_divisor(hidden, head_input)
            except ValueError as exc:
                logger.warning("%s: %s; the lm_head component is the head alone", type(model).__name__, exc)
                divisor = None
            if divisor is not None:
                head = ScaledLMHead(head, divisor)
                logger.info(
                    "%s: the LM head reads the hidden states divided by %g", type(model).__name__, divisor
                )
        components["lm_head"] = (head, head_kwargs)
    if include_decode:
        # the inner language model when the model's generate hands the embeddings to its generate
        stepper = generator if recording.caller == GENERATOR and generator is not None else model
        components["decode"] = (stepper, _without_unread_token_types(stepper, recording.decode))
    plan.components = list(components)
    decomposition = Decomposition(components, plan, model)
    describe_components(decomposition)
    return decomposition
