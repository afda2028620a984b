"""Greedy generation over exported components.

The core owns the loop; a backend only supplies, per component, a *caller*: a function taking the
component's forward kwargs (tensors, caches and model outputs, rebuilt from the component's
recorded pytree spec) and returning ``{output_leaf_path: tensor}`` (``logits``,
``cache.layers.0.keys``, ...), which is exactly what ``HfExporter.runner(artifact)`` returns.

The loop reproduces ``generate(do_sample=False)``: argmax of the last position's logits; after a
row emits an end-of-sequence token it receives the pad token; generation stops when every row has
finished or ``max_new_tokens`` tokens were produced. Between steps the cache travels as the
tensors the previous call returned (a growing cache) or as the same preallocated tensors updated in
place (a static cache); the 2-D padding mask grows by one column of ones per token and position ids
continue from the last one (``generate``'s own bookkeeping). A forced end-of-sequence token at the
last position (``forced_eos_token_id``, BART's) is applied; other logits processors configured in
the model's generation config (repetition penalty, suppressed tokens ...) are not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.generation.plan import GenerationPlan
from hfexport.tensors import get_leaf_tensors

__all__ = [
    "SHORTEST_PROMPT",
    "Caller",
    "GenerationRunner",
    "ShapeGuardError",
    "accepted_input_keys",
    "callers_from_exporter",
    "check_input_batch",
    "check_input_keys",
    "exported_program_caller",
    "how_to_pass",
    "shape_guard_error",
]

logger = logging.getLogger(__name__)

Caller = Callable[[dict[str, Any]], Mapping[str, Any]]

_CACHE_PREFIX = "cache."
_ENCODER_PREFIX = "encoder_outputs."

#: inputs the runner builds itself for a text decoder or an encoder-decoder's steps (from the
#: prompt, the cache and the encoder's outputs): never a ``**inputs`` key of :meth:`GenerationRunner.generate`
_RUNNER_BUILT = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "encoder_outputs"})


#: the fewest prompt tokens an export takes: a captured program gives every dynamic axis traced at
#: size >= 2 the lower end 2 (``torch.export`` specialises sizes 0 and 1), and the decode step of
#: a 1-token prompt reads a cache of 1 position (a 2-token prompt for a plan whose
#: :attr:`GenerationPlan.prompt_edit` drops tokens: BLIP's minimum is 3)
SHORTEST_PROMPT = 2


def _shortest_reason(plan: GenerationPlan) -> str:
    drop = int(plan.prompt_edit.get("drop_last", 0))
    if not drop:
        return " (the exported steps take 2 positions or more)"
    return (
        f" ({plan.model_class}.generate() leaves out the last {drop} prompt token(s), and the exported steps "
        "take 2 positions or more: a processor-built prompt of the special tokens and at least one word)"
    )


class ShapeGuardError(ValueError):
    """An exported program refused its inputs on a shape condition it was captured with (a
    ``ValueError``; see :func:`shape_guard_error`)."""


def how_to_pass(key: str) -> str:
    """The two ways to give the generate input ``key`` (a tensor): the Python keyword argument and
    the command line's ``--inputs`` file (the advice of the runner's missing-input errors)."""
    return (
        f"pass it to generate() / generate_from_dir() as the keyword argument {key}=..., or with "
        f"`hfexport generate --inputs FILE.safetensors` as the tensor named {key!r} in that file"
    )


def _missing_input(component: str, key: str, detail: str = "") -> ValueError:
    """The ``ValueError`` of a component input the caller did not give."""
    return ValueError(
        f"the {component} takes the input {key!r}, which was not given{detail}; {how_to_pass(key)}"
    )


def accepted_input_keys(plan: GenerationPlan) -> set[str]:
    """The ``**inputs`` keys :meth:`GenerationRunner.generate` reads for ``plan`` (besides
    ``input_ids`` and ``attention_mask``, its own arguments).

    Those are the prompt inputs of the image encoders and of the language model's steps
    (:attr:`GenerationPlan.links`, :attr:`GenerationPlan.step_inputs`: ``pixel_values``,
    Kosmos-2's ``image_embeds_position_mask`` ...), the per-image sizes the runner cuts images by
    (``image_sizes``, ``image_grid_thw``, a packed grid input), the M-RoPE inputs
    (``image_grid_thw``, ``mm_token_type_ids``), ``decoder_input_ids`` for a model with an
    encoder, and for a text decoder or encoder-decoder every top-level input of its components the
    runner does not build itself (``token_type_ids``, T5Gemma 2's ``pixel_values`` ...; a nested
    input by its leaf path, ``extra.scale``, and its top-level name, ``extra``).
    """
    keys: set[str] = set()
    for sources in (*plan.links.values(), *plan.step_inputs.values()):
        keys.update(str(s["key"]) for s in sources.values() if s.get("from") == "prompt")
    for entry in plan.per_image.values():
        keys.update(k for k in ("image_sizes", "image_grid_thw") if k in entry)
        if "grid_input" in entry:
            keys.add(str(entry["grid_input"]))
    if plan.mrope is not None:
        keys.update(("image_grid_thw", "mm_token_type_ids"))
    if plan.architecture == "encoder_decoder" or "encoder" in plan.components:
        keys.add("decoder_input_ids")
    if plan.architecture != "multimodal":
        for io in plan.io.values():
            for leaf in io.leaves:
                path = str(leaf["path"])
                top = path.split(".", 1)[0]
                if leaf["tensor"] and top not in _RUNNER_BUILT:
                    keys.update((path, top))
    return keys


def check_input_keys(plan: GenerationPlan, inputs: Mapping[str, Any]) -> None:
    """Refuse ``**inputs`` of :meth:`GenerationRunner.generate` that no exported component reads.

    Raises:
        ValueError: a key (with a value other than ``None``) outside :func:`accepted_input_keys`;
            the message lists the keys the components take.
    """
    accepted = accepted_input_keys(plan)
    unknown = sorted(k for k, v in inputs.items() if v is not None and k not in accepted)
    if unknown:
        takes = ", ".join(sorted(accepted)) or "none besides input_ids and attention_mask"
        raise ValueError(
            f"no exported component of this {plan.model_class} takes the input(s) {unknown}; the components "
            f"take: {takes}. Leave the others out (with `hfexport generate --inputs FILE.safetensors`: out of "
            "the file)"
        )


#: ``**inputs`` of :meth:`GenerationRunner.generate` whose axis 0 is the prompt batch whatever the
#: model: the token-aligned ones (mllama's ``cross_attention_mask``, IDEFICS' ``image_attention_mask``,
#: Kosmos-2's ``image_embeds_position_mask``, ``mm_token_type_ids``, ``token_type_ids``, a decoder
#: prompt) and mllama's per-prompt image layout (``aspect_ratio_ids``, ``aspect_ratio_mask``).
#: ``pixel_values`` is not among them: LLaVA's axis 0 counts the images, which one prompt may hold
#: several of.
PROMPT_BATCH_INPUTS = (
    "cross_attention_mask",
    "image_attention_mask",
    "image_embeds_position_mask",
    "mm_token_type_ids",
    "token_type_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
)


def check_input_batch(batch: int, inputs: Mapping[str, Any]) -> None:
    """Refuse ``**inputs`` of :meth:`GenerationRunner.generate` made for another number of prompts.

    Before this check a batch-2 ``cross_attention_mask`` with a batch-1 prompt (mllama) failed
    inside an exported program, with a shape guard about the image sides (dynamo) or an ExecuTorch
    error code, after the components were loaded.

    Args:
        batch: the prompt's batch size (dim 0 of ``input_ids``).
        inputs: the other generate inputs; those of :data:`PROMPT_BATCH_INPUTS` that are tensors of
            at least one dimension are checked.

    Raises:
        ValueError: such an input's dim 0 differs from ``batch``; the message names the input, its
            shape and the prompt's batch.
    """
    wrong = [
        (key, tuple(value.shape))
        for key in PROMPT_BATCH_INPUTS
        if isinstance(value := inputs.get(key), torch.Tensor) and value.dim() >= 1 and value.shape[0] != batch
    ]
    if wrong:
        listed = ", ".join(f"{key} {list(shape)}" for key, shape in wrong)
        raise ValueError(
            f"the prompt has batch {batch} (dim 0 of input_ids) but {listed} "
            f"{'has' if len(wrong) == 1 else 'have'} another batch on dim 0; give these inputs for the same "
            f"{'prompt' if batch == 1 else f'{batch} prompts'} (e.g. tensor[:{batch}] of a processor's batch)"
        )


def exported_program_caller(program: torch.export.ExportedProgram) -> Caller:
    """A caller running ``program.module()`` (the in-place cache updates of the graph happen on the inputs).

    The output flags the program was exported with (``use_cache`` ...) may be left out of the
    kwargs: they are filled in with their captured values (:func:`hfexport.inputs.flags.fill_output_flags`).

    Returns:
        ``kwargs -> {output_leaf_path: tensor}``.

    Raises (on call):
        UnsupportedInputError: a flag differs from the value the program was exported with.
        ValueError: the inputs break one of the program's shape guards ("Guard failed: ..."), with
            the input shapes and what to do (torch raises a bare ``AssertionError``).
    """
    from hfexport.inputs.flags import fill_output_flags, program_output_flags

    module = program.module()
    flags = program_output_flags(program)

    def call(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            try:
                return get_leaf_tensors(module(**fill_output_flags(kwargs, flags)))
            except AssertionError as exc:
                error = shape_guard_error(exc, kwargs)
                if error is None:
                    raise
                raise error from exc

    return call


def shape_guard_error(exc: AssertionError, inputs: Mapping[str, Any]) -> ShapeGuardError | None:
    """The user-facing error for an ``ExportedProgram`` refusing inputs on a shape guard.

    ``program.module()`` checks the captured shape conditions on every call and raises a bare
    ``AssertionError("Guard failed: pixel_values.size()[2] == 32")`` when an input breaks one.

    Args:
        exc: the error the program's module raised.
        inputs: the forward kwargs it was called with (their leaf shapes go into the message).

    Returns:
        A :class:`ShapeGuardError` (a ``ValueError``) naming the input shapes, the guard and what to
        do, or ``None`` when ``exc`` is not a guard failure (re-raise it as it is).
    """
    if "Guard failed" not in str(exc):
        return None
    shapes = {k: list(v.shape) for k, v in get_leaf_tensors(dict(inputs)).items()}
    return ShapeGuardError(
        f"the inputs {shapes} break a shape condition the program was captured with ({exc}): an axis the "
        "model fixed at export (an image side its vision tower computes its grid from) or a size outside "
        "the exported range; give inputs of the exported sizes (resize images to the sample's size), or "
        "export again with sample inputs of the size you serve"
    )


def callers_from_exporter(exporter: Any, artifacts: Mapping[str, Any]) -> dict[str, Caller]:
    """One caller per component from a backend exporter: ``exporter.runner(artifact)``."""
    return {name: exporter.runner(artifact) for name, artifact in artifacts.items()}


def _only(outputs: Mapping[str, Any], component: str) -> torch.Tensor:
    tensors = [v for v in outputs.values() if v is not None]
    if len(tensors) != 1:
        raise RuntimeError(f"component {component!r} returned {sorted(outputs)}; one output was expected")
    return torch.as_tensor(tensors[0])


def _output(produced: Mapping[str, Mapping[str, torch.Tensor]], component: str, path: str) -> torch.Tensor:
    """Output ``path`` of an earlier component; ``""`` is the sole output of a bare-tensor forward.

    A projector returning one tensor (LLaVA's) is recorded under the empty leaf path, while a
    runtime names its single output itself (``output``, ``output_0`` ...).
    """
    outputs = produced[component]
    if path in outputs:
        return outputs[path]
    if path == "":
        return _only(outputs, component)
    raise KeyError(
        f"component {component!r} returned {sorted(outputs)}, not the output {path!r} the plan links"
    )


def _exported_size_rows(
    component: str, prompt: Mapping[str, Any], key: str, exported: list[int], what: str, axes: str
) -> torch.Tensor:
    """The prompt's per-image sizes ``prompt[key]`` as int rows ``[images, len(exported)]``, checked
    against the one size a per-image component was exported for (``image_sizes``,
    ``image_grid_thw``, a packed tower's grid input).

    Raises:
        ValueError: ``key`` is missing from the prompt, or a row holds another size than
            ``exported`` (resize the image, or export with sample images of that size).
    """
    given = prompt.get(key)
    if given is None:
        raise ValueError(
            f"the {component} was exported for images of {what} {exported} and needs {key}; {how_to_pass(key)}"
        )
    rows = torch.as_tensor(given).reshape(-1, len(exported))
    other = sorted({tuple(int(v) for v in row) for row in rows.tolist()} - {tuple(exported)})
    if other:
        raise ValueError(
            f"the {component} was exported for images of {what} {exported} {axes} and the prompt has images of "
            f"{what} {[list(o) for o in other]}; resize them to the exported size, or export with sample images "
            "of that size"
        )
    return rows


def _text_positions(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(torch.int64)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


class GenerationRunner:
    """Greedy generation over the components of a :class:`GenerationPlan`.

    Args:
        plan: the plan of the exported components (``decomposition.plan``, or a loaded manifest's).
        callers: ``{component: caller}``, one for every component of the plan.
        prefill_with_decode: run the prompt through the ``decode`` graph on an empty cache (a
            zeroed static cache, or a growing cache of 0 positions) instead of the ``prefill``
            graph. The decode graph needs a symbolic query length (``multi_token_decode=True``,
            ``dynamic=True``). Implied when the plan of a decoder-only model has no ``prefill``.

    Raises:
        ValueError: a component of the plan has no caller, or ``prefill_with_decode`` without a
            multi-token decode graph of a decoder-only model.
    """

    def __init__(
        self, plan: GenerationPlan, callers: Mapping[str, Caller], *, prefill_with_decode: bool = False
    ) -> None:
        missing = [c for c in plan.components if c not in callers]
        if missing:
            raise ValueError(f"no caller for component(s) {missing}; the plan has {plan.components}")
        if plan.architecture == "decoder" and "prefill" not in plan.components:
            prefill_with_decode = True
        if prefill_with_decode and (plan.architecture != "decoder" or not plan.multi_token_decode):
            raise ValueError(
                "prefilling through the decode graph needs a decoder-only model and a multi-token decode graph "
                "(export with multi_token_decode=True and dynamic=True)"
            )
        self.plan = plan
        self.callers = dict(callers)
        self.prefill_with_decode = prefill_with_decode
        #: logits ``[batch, vocab]`` of each generated position of the last :meth:`generate` call.
        self.last_logits: list[torch.Tensor] = []

    # -- one component call ------------------------------------------------------------------------
    def _call(
        self,
        component: str,
        values: Mapping[str, Any],
        cache: Mapping[str, torch.Tensor],
        encoder: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        io = self.plan.io[component]

        def value_of(path: str) -> torch.Tensor:
            if path in values and values[path] is not None:
                return values[path]
            if path.startswith(_CACHE_PREFIX) and path[len(_CACHE_PREFIX) :] in cache:
                return cache[path[len(_CACHE_PREFIX) :]]
            if (
                encoder is not None
                and path.startswith(_ENCODER_PREFIX)
                and path[len(_ENCODER_PREFIX) :] in encoder
            ):
                return encoder[path[len(_ENCODER_PREFIX) :]]
            given = sorted(k for k, v in values.items() if v is not None)
            raise _missing_input(
                f"component {component!r}", path, f" (the runner has {given}, cache {sorted(cache)[:4]}...)"
            )

        kwargs = io.build(value_of)
        outputs = self.callers[component](kwargs)
        return {k: torch.as_tensor(v) for k, v in outputs.items() if v is not None}

    @staticmethod
    def _cache_from(outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k[len(_CACHE_PREFIX) :]: v for k, v in outputs.items() if k.startswith(_CACHE_PREFIX)}

    def _empty_cache(self, batch: int) -> dict[str, torch.Tensor]:
        """The decode graph's cache inputs holding no token: zeros of the full static length, or
        zero positions on the sequence axis of a growing cache."""
        cache: dict[str, torch.Tensor] = {}
        for leaf in self.plan.io["decode"].leaves:
            path = leaf["path"]
            if not (leaf["tensor"] and path.startswith(_CACHE_PREFIX)):
                continue
            shape = list(leaf["shape"])
            if shape:
                shape[0] = batch
            if self.plan.cache_kind == "dynamic" and len(shape) == 4:
                shape[2] = 0
            cache[path[len(_CACHE_PREFIX) :]] = torch.zeros(shape, dtype=getattr(torch, leaf["dtype"]))
        return cache

    # -- the loop ----------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor | list[int] | list[list[int]] | None,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 20,
        **inputs: Any,
    ) -> torch.Tensor:
        """Generate greedily from a prompt.

        Args:
            input_ids: int64 ``[batch, seq]`` (or a list of ids for one prompt). Left padding is
                expressed by ``attention_mask``. ``None`` for an encoder-decoder whose encoder
                reads another input alone (VisionEncoderDecoder: ``pixel_values=``, with an
                optional ``decoder_input_ids=`` prompt).
            attention_mask: ``[batch, seq]`` (1 = token, 0 = padding); ``None`` means no padding.
                Without ``input_ids``: the encoder input's own mask (Pix2Struct's ``[batch,
                patches]``), passed to the encoder and the decoder steps as given.
            max_new_tokens: how many tokens to generate at most (>= 1).
            **inputs: other generate-style inputs the components need: for multimodal models
                ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` ...

        Returns:
            int64 ``[batch, seq + n]`` (decoder-only and multimodal: the prompt then the new tokens,
            as ``generate`` returns them) or ``[batch, 1 + n]`` (encoder-decoder: the decoder start
            token then the new tokens), ``n <= max_new_tokens``.

        Raises:
            ValueError: ``max_new_tokens < 1``; a static cache too short for the prompt plus
                ``max_new_tokens``; a mask whose shape differs from ``input_ids``; no
                ``input_ids`` for a plan other than an encoder-decoder's.
            ValueError: an input of :data:`PROMPT_BATCH_INPUTS` has another batch than the prompt
                (:func:`check_input_batch`).
            ValueError: a component needs an input that was not given, named with the component and
                how to pass it (a component given none of its prompt inputs is left out instead: a
                text-only prompt of a vision-language model); a key of ``inputs`` that no component
                takes (:func:`check_input_keys`, the message lists the keys they take).
            ShapeGuardError (a ``ValueError``): an exported program refused the inputs on a shape
                condition; for a prompt shorter than :data:`SHORTEST_PROMPT` (plus the tokens the
                plan's ``prompt_edit`` drops: BLIP 3) the message says the minimum.
            ValueError (multimodal): placeholder tokens without the image inputs they stand for, or a
                text-only prompt for a language model that takes image features as its own inputs
                and has no image-free path (a cross-attending model whose steps take zero features
                for it, Mllama, runs the prompt: :attr:`GenerationPlan.step_inputs`).
        """
        check_input_keys(self.plan, inputs)
        if input_ids is None:
            ids = self._encoder_only_prompt(inputs)
        else:
            ids = torch.as_tensor(input_ids, dtype=torch.int64)
        if ids.dim() == 1:
            ids = ids[None]
        check_input_batch(int(ids.shape[0]), inputs)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        mask = (
            torch.ones_like(ids)
            if attention_mask is None
            else torch.as_tensor(attention_mask).to(torch.int64)
        )
        if input_ids is None and attention_mask is not None:
            # an encoder-decoder prompted with an image alone whose mask is over the image's
            # patches (Pix2Struct's flattened patches): the encoder's, and the decoder's
            # cross-attention mask, as generate() passes it
            pass
        elif mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}"
            )
        arch = self.plan.architecture
        if self.plan.cache_kind == "static" and self.plan.max_cache_len is not None:
            needed = (1 if arch == "encoder_decoder" else ids.shape[1]) + max_new_tokens
            if needed > self.plan.max_cache_len:
                raise ValueError(
                    f"the static cache holds {self.plan.max_cache_len} positions but this run needs {needed} "
                    f"(prompt {ids.shape[1]} + {max_new_tokens} new tokens); export with a larger max_cache_len"
                )
        try:
            if arch == "encoder_decoder":
                return self._generate_encoder_decoder(ids, mask, max_new_tokens, inputs)
            if (
                arch == "multimodal"
                and "prefill" in self.plan.components
                and "encoder" not in self.plan.components
            ):
                # the language model takes the image features as an input of its own (BLIP, Kosmos-2)
                return self._generate_with_image_inputs(ids, mask, max_new_tokens, inputs)
            if arch == "multimodal" and "encoder" in self.plan.components:
                # encoder-decoder language model (Florence-2): the merged embeddings feed the text encoder
                embeds, _ = self._multimodal_embeddings(ids, inputs, mask)
                encoded = self._call("encoder", {"inputs_embeds": embeds, "attention_mask": mask}, {})
                decoder_prompt = {k: v for k, v in inputs.items() if k == "decoder_input_ids"}
                return self._generate_encoder_decoder(
                    ids, mask, max_new_tokens, decoder_prompt, encoded=encoded
                )
            logits, cache, positions, state = self._prefill(ids, mask, inputs)
            return self._decode_loop(ids, mask, logits, cache, positions, max_new_tokens, state)
        except ShapeGuardError as exc:
            # a dynamic axis traced at >= 2 keeps 2 as its lower end in an ExportedProgram: a 1-token
            # prompt (BLIP: 3 tokens, as its generate() drops the closing [SEP]) breaks the decode's guard
            shortest = SHORTEST_PROMPT + int(self.plan.prompt_edit.get("drop_last", 0))
            if input_ids is not None and ids.shape[1] < shortest:
                raise ShapeGuardError(
                    f"the prompt has {ids.shape[1]} token(s); this export takes prompts of at least {shortest} "
                    f"tokens{_shortest_reason(self.plan)}: give a longer prompt ({exc})"
                ) from exc
            raise

    def _encoder_only_prompt(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The empty ``[batch, 0]`` token prompt of an encoder-decoder run from its encoder's other
        inputs alone (VisionEncoderDecoder's ``pixel_values``), the batch read from them.

        Raises:
            ValueError: not an encoder-decoder plan, or no encoder input with a batch axis given.
        """
        if self.plan.architecture != "encoder_decoder":
            raise ValueError(f"input_ids is required: this plan is {self.plan.architecture!r}")
        batch = next(
            (
                int(torch.as_tensor(v).shape[0])
                for k, v in inputs.items()
                if k != "decoder_input_ids" and isinstance(v, torch.Tensor) and v.dim() >= 1
            ),
            None,
        )
        if batch is None:
            raise ValueError(
                "without input_ids the encoder's own inputs are needed (pixel_values=... for an image encoder)"
            )
        return torch.zeros(batch, 0, dtype=torch.int64)

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
        if self.plan.architecture == "multimodal":
            return self._prefill_multimodal(ids, mask, inputs)
        out, positions, values = self._text_prefill(ids, mask, inputs)
        state = {"token_type_ids": values["token_type_ids"]}
        return out["logits"][:, -1, :], self._cache_from(out), positions, state

    def prefill_logits(
        self, input_ids: torch.Tensor | list[int], attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced logits of one prefill over a text prompt (what perplexity is measured on).

        Args:
            input_ids: int64 ``[batch, seq]`` (or a list of ids for one prompt).
            attention_mask: ``[batch, seq]``; ``None`` means no padding.

        Returns:
            The prefill component's logits, ``[batch, seq, vocab]`` in the artifact's dtype.

        Raises:
            NotImplementedError: an encoder-decoder or multimodal plan (their prefill takes more
                than text).
        """
        if self.plan.architecture != "decoder":
            raise NotImplementedError(
                f"prefill_logits runs text-only decoders; this plan is {self.plan.architecture!r}"
            )
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        if ids.dim() == 1:
            ids = ids[None]
        mask = (
            torch.ones_like(ids)
            if attention_mask is None
            else torch.as_tensor(attention_mask).to(torch.int64)
        )
        return self._text_prefill(ids, mask, {})[0]["logits"]

    def _text_prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[Mapping[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
        """Run the text prefill: ``(outputs, position_ids, the values fed)``."""
        positions = _text_positions(mask)
        values = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **inputs}
        values.update(get_leaf_tensors({k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}))
        if "token_type_ids" not in values:
            values["token_type_ids"] = torch.zeros_like(ids)
        if "mm_token_type_ids" not in values:
            values["mm_token_type_ids"] = torch.zeros_like(ids)
        if self.prefill_with_decode:
            out = self._call("decode", values, self._empty_cache(ids.shape[0]))
        else:
            out = self._call("prefill", values, {})
        return out, positions, values

    def _multimodal_embeddings(
        self, ids: torch.Tensor, inputs: Mapping[str, Any], mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
        """Run the encoders and projectors of the plan's links, embed ``ids`` and put each
        component output in place of its placeholder tokens' embeddings.

        Returns:
            ``(embeddings [batch, seq, hidden], {component: its outputs})``.
        """
        plan = self.plan
        produced = self._run_image_components(ids, inputs, mask)
        embeds = _only(self._call("embed_tokens", {"input": ids, "input_ids": ids}, {}), "embed_tokens")
        for token, source in plan.features.items():
            where = ids == int(token)
            count = int(where.sum())
            if source["component"] not in produced and source["component"] in plan.links:
                if count:
                    raise ValueError(
                        f"the prompt has {count} placeholder tokens {token} but none of the image inputs "
                        f"{self._prompt_inputs_of(source['component'])} they stand for; pass them to generate() as "
                        "keyword arguments (with `hfexport generate`: as tensors of those names in the --inputs "
                        "FILE.safetensors), or drop the placeholder tokens for a text-only prompt"
                    )
                continue
            features = _output(produced, source["component"], source["output"])
            flat = features.reshape(-1, features.shape[-1])
            if count != flat.shape[0]:
                raise ValueError(
                    f"the prompt has {count} placeholder tokens {token} but the {source['component']} produced "
                    f"{flat.shape[0]} feature rows"
                )
            embeds = embeds.masked_scatter(where[..., None], flat.to(embeds.dtype))
        return embeds, produced

    def _run_image_components(
        self, ids: torch.Tensor, inputs: Mapping[str, Any], mask: torch.Tensor | None = None
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Run the encoders and projectors of the plan's links in order: ``{component: its outputs}``.

        Raises:
            ValueError: a component needs a prompt input that was not given (named, with how to pass it).
        """
        from hfexport.generation.vision_inputs import vision_grid_inputs

        plan = self.plan
        prompt = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids) if mask is None else mask,
            **inputs,
        }
        produced: dict[str, dict[str, torch.Tensor]] = {}
        skipped = self._components_without_inputs(prompt)
        for component, links in plan.links.items():
            if component in skipped:
                continue
            values: dict[str, Any] = {}
            derived: dict[str, torch.Tensor] = {}
            for path, source in links.items():
                kind = source["from"]
                if kind == "prompt":
                    if prompt.get(source["key"]) is None:
                        raise _missing_input(component, source["key"])
                    values[path] = torch.as_tensor(prompt[source["key"]])
                    if source.get("flatten"):  # [batch, images, ...] as [batch * images, ...]
                        values[path] = values[path].flatten(0, 1)
                elif kind == "component":
                    tensor = _output(produced, source["component"], source["output"])
                    values[path] = tensor[:, 1:] if source.get("drop_first") else tensor
            for path, source in links.items():
                if source["from"] == "vision_grid":
                    if not derived:
                        derived = vision_grid_inputs(values[source["grid"]], plan.vision_grid[component])
                    values[path] = derived[source["key"]]
            if component in plan.per_image:
                produced[component] = self._call_per_image(component, values, prompt)
            else:
                produced[component] = self._call(component, values, {})
        return produced

    def _generate_with_image_inputs(
        self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, inputs: Mapping[str, Any]
    ) -> torch.Tensor:
        """Generate with a language model that takes the image features as an input of its own
        (:attr:`GenerationPlan.step_inputs`: BLIP's cross-attended ``encoder_hidden_states`` at every
        step, Kosmos-2's ``image_embeds`` in the prefill): the prompt rewritten as ``generate``
        rewrites it (:attr:`GenerationPlan.prompt_edit`), the image components, ``prefill``, then
        ``decode`` per token with the step inputs linked to it.

        Returns:
            int64 ``[batch, rewritten prompt length + n]``.

        Raises:
            ValueError: a step or image component needs a prompt input that was not given (named,
                with the component and how to pass it).
            ValueError: the prompt is too short for the rewrite.
        """
        plan = self.plan
        drop = int(plan.prompt_edit.get("drop_last", 0))
        if drop:
            if ids.shape[1] <= drop:
                raise ValueError(
                    f"{plan.model_class}.generate() leaves out the last {drop} prompt token(s); the prompt has "
                    f"{ids.shape[1]}: give the prompt as its processor builds it, of at least {drop + SHORTEST_PROMPT} "
                    "tokens (the exported steps take 2 positions or more after the rewrite)"
                )
            ids, mask = ids[:, :-drop], mask[:, :-drop]
        if plan.prompt_edit.get("first_token") is not None:
            ids = ids.clone()
            ids[:, 0] = int(plan.prompt_edit["first_token"])
        produced = self._run_image_components(ids, inputs, mask)
        prompt = {"input_ids": ids, "attention_mask": mask, **inputs}
        # a text-only prompt (no image input at all) of a cross-attending model whose steps take zero
        # image features and masks for it (Mllama; GenerationPlan.step_inputs' "without_image")
        text_only = not produced and self._image_free(prompt)

        def zeros(source: Mapping[str, Any]) -> torch.Tensor:
            spec = source["without_image"]
            tokens = (1 if source.get("last") else int(ids.shape[1]),) if spec.get("token_aligned") else ()
            shape = (int(ids.shape[0]), *tokens, *(int(d) for d in spec["zeros"]))
            return torch.zeros(shape, dtype=getattr(torch, str(spec.get("dtype", "float32"))))

        def linked(step: str) -> dict[str, torch.Tensor]:
            values: dict[str, torch.Tensor] = {}
            for path, source in plan.step_inputs.get(step, {}).items():
                if text_only:
                    values[path] = zeros(source)
                    continue
                if source["from"] == "prompt":
                    if prompt.get(source["key"]) is None:
                        raise _missing_input(f"{step} step", source["key"])
                    tensor = torch.as_tensor(prompt[source["key"]])
                    # a decode step's row of a token-aligned input (Mllama's cross_attention_mask)
                    values[path] = tensor[:, -1:] if source.get("last") else tensor
                else:
                    if source["component"] not in produced:
                        raise ValueError(
                            f"the {step} step takes {path!r} from the {source['component']}, which this prompt "
                            f"gives none of the image inputs {self._prompt_inputs_of(source['component'])} for: "
                            "this model's language model takes the image as an input of its own and its export "
                            "has no image-free path; pass the image (generate(pixel_values=...), or `hfexport "
                            "generate --inputs FILE.safetensors` holding it)"
                        )
                    tensor = _output(produced, source["component"], source["output"])
                    values[path] = tensor[:, 1:] if source.get("drop_first") else tensor
            return values

        positions = _text_positions(mask)
        values = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **linked("prefill")}
        out = self._call("prefill", values, {})
        return self._decode_loop(
            ids,
            mask,
            out["logits"][:, -1, :],
            self._cache_from(out),
            positions,
            max_new_tokens,
            {},
            constants=linked("decode"),
        )

    def _image_free(self, prompt: Mapping[str, Any]) -> bool:
        """Whether ``prompt`` is a text-only turn the steps can run without an image: it gives none of
        the image components' prompt inputs nor any prompt input of the steps, and every step input
        has a ``"without_image"`` record (:attr:`GenerationPlan.step_inputs`: zero image features and
        cross-attention masks, checked at export to give the model's text-only logits)."""
        sources = [s for step in self.plan.step_inputs.values() for s in step.values()]
        if not sources or not all("without_image" in s for s in sources):
            return False
        image_keys = {k for component in self.plan.links for k in self._prompt_inputs_of(component)}
        image_keys |= {s["key"] for s in sources if s["from"] == "prompt"}
        return all(prompt.get(k) is None for k in image_keys)

    def _components_without_inputs(self, prompt: Mapping[str, Any]) -> set[str]:
        """The encoder and projector components a text-only prompt leaves out.

        A component is left out when the prompt gives none of the inputs it reads from the prompt
        (an image encoder without ``pixel_values``), or when it reads an output of a component
        left out (the projector after that encoder): ``model.generate`` then embeds the text
        alone. A component given some of its prompt inputs but not all still raises (a
        ``ValueError`` naming the missing one) when it is called.
        """
        skipped: set[str] = set()
        for component, links in self.plan.links.items():
            from_prompt = [link["key"] for link in links.values() if link["from"] == "prompt"]
            upstream = {link["component"] for link in links.values() if link["from"] == "component"}
            if (from_prompt and all(prompt.get(key) is None for key in from_prompt)) or upstream & skipped:
                skipped.add(component)
        return skipped

    def _prompt_inputs_of(self, component: str) -> list[str]:
        """The prompt inputs ``component`` reads, itself or through the components it reads from."""
        keys: set[str] = set()
        pending, seen = [component], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            for link in self.plan.links.get(name, {}).values():
                if link["from"] == "prompt":
                    keys.add(link["key"])
                elif link["from"] == "component":
                    pending.append(link["component"])
        return sorted(keys)

    def _call_per_image(
        self, component: str, values: Mapping[str, torch.Tensor], prompt: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        """Call an image encoder exported for one image of one size (:attr:`GenerationPlan.per_image`)
        once per image and concatenate its outputs along axis 0.

        Each input is cut to one image (``[i : i + 1]``) and, where the prompt's tensor is larger
        than the graph's on a later axis (the padding of a batch of images: LLaVA-NeXT's tiles,
        Pixtral's padded sides), cut to the graph's size there, as the model does itself. The pixel
        sides of a tiled input (5-D ``[images, tiles, channels, height, width]``: every tile is
        resized to the model's crop size) must equal the graph's: they are never cut.

        Raises:
            ValueError: the prompt's ``image_sizes`` are missing or hold another size than the one
                the component was exported for, the inputs disagree on the number of images, or
                a tiled input's tiles have other pixel sides than the graph's.
        """
        entry = self.plan.per_image[component]
        if "grid_input" in entry:
            return self._call_per_packed_grid(component, values, prompt, entry)
        if "image_grid_thw" in entry:
            return self._call_per_grid(component, values, prompt)
        size = [int(v) for v in entry["image_sizes"]]
        sizes = _exported_size_rows(component, prompt, "image_sizes", size, "size", "(height, width)")
        counts = {int(v.shape[0]) for v in values.values()}
        if len(counts) != 1 or counts != {int(sizes.shape[0])}:
            raise ValueError(
                f"the {component}'s inputs hold {sorted(counts)} images but image_sizes has {int(sizes.shape[0])} rows"
            )
        shapes = {
            leaf["path"]: leaf["shape"] for leaf in self.plan.io[component].leaves if leaf.get("tensor")
        }
        outputs: list[dict[str, torch.Tensor]] = []
        for i in range(int(sizes.shape[0])):
            one: dict[str, torch.Tensor] = {}
            for path, tensor in values.items():
                piece = tensor[i : i + 1]
                recorded = shapes.get(path)
                if recorded is not None and len(recorded) == piece.dim():
                    if piece.dim() == 5 and list(piece.shape[-2:]) != [int(n) for n in recorded[-2:]]:
                        raise ValueError(
                            f"the {component} was exported for tiles of {[int(n) for n in recorded[-2:]]} pixels "
                            f"(height, width) and the prompt's {path} has tiles of {list(piece.shape[-2:])}; "
                            "resize the tiles to the model's crop size, as its image processor does"
                        )
                    piece = piece[(slice(None), *(slice(0, int(n)) for n in recorded[1:]))]
                one[path] = piece
            outputs.append(self._call(component, one, {}))
        return {key: torch.cat([out[key] for out in outputs], dim=0) for key in outputs[0]}

    def _call_per_grid(
        self, component: str, values: Mapping[str, torch.Tensor], prompt: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        """Call an image encoder exported for one image of one patch grid (``per_image`` holds
        ``{"image_grid_thw": [t, h, w]}``) once per image and concatenate its outputs along axis 0.

        The packed inputs (``pixel_values`` ``[sum(t * h * w), patch_dim]``) are cut into
        ``t * h * w`` rows per image, in the order of the prompt's ``image_grid_thw`` rows.

        Raises:
            ValueError: the prompt's ``image_grid_thw`` is missing or holds another grid than the one
                the component was exported for (resize the image), or the packed inputs do not hold
                ``t * h * w`` rows per image.
        """
        grid = [int(v) for v in self.plan.per_image[component]["image_grid_thw"]]
        grids = _exported_size_rows(
            component, prompt, "image_grid_thw", grid, "patch grid", "(temporal, height, width)"
        )
        patches = grid[0] * grid[1] * grid[2]
        images = int(grids.shape[0])
        for path, tensor in values.items():
            if int(tensor.shape[0]) != images * patches:
                raise ValueError(
                    f"the {component}'s input {path} has {int(tensor.shape[0])} rows; {images} images of grid "
                    f"{grid} take {images * patches}"
                )
        outputs = [
            self._call(component, {p: t[i * patches : (i + 1) * patches] for p, t in values.items()}, {})
            for i in range(images)
        ]
        return {key: torch.cat([out[key] for out in outputs], dim=0) for key in outputs[0]}

    def _call_per_packed_grid(
        self,
        component: str,
        values: Mapping[str, torch.Tensor],
        prompt: Mapping[str, Any],
        entry: Mapping[str, Any],
    ) -> dict[str, torch.Tensor]:
        """Call an image encoder exported for one image of one patch grid (a packed-patch tower:
        :data:`hfexport.generation.multimodal.GRID_SIZE_INPUTS`) once per image of the prompt, its
        ``pixel_values`` cut by the prompt's grids (:func:`~hfexport.generation.multimodal.split_packed_images`),
        and concatenate its outputs along axis 0.

        Raises:
            ValueError: the prompt has no grid input or holds another grid than the exported one.
        """
        from hfexport.generation.multimodal import split_packed_images

        name = str(entry["grid_input"])
        grid = [int(v) for v in entry["grid"]]
        grids = _exported_size_rows(component, prompt, name, grid, "patch grid", "(height, width)")
        outputs = [self._call(component, one, {}) for one in split_packed_images(values, name, grids)]
        return {key: torch.cat([out[key] for out in outputs], dim=0) for key in outputs[0]}

    def _prefill_multimodal(
        self, ids: torch.Tensor, mask: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
        from hfexport.generation.vision_inputs import (
            canvas_mrope_position_ids,
            mrope_position_ids,
            row_separated_mrope_position_ids,
        )

        plan = self.plan
        embeds, produced = self._multimodal_embeddings(ids, inputs, mask)
        if plan.mrope is not None:
            token_types = inputs.get("mm_token_type_ids")
            if token_types is None:
                token_types = torch.zeros_like(ids)
                for token in plan.features:
                    token_types = token_types.masked_fill(ids == int(token), 1)
            grid = inputs.get("image_grid_thw")
            if grid is None:
                grid = torch.zeros(0, 3, dtype=torch.int64)
            channels = int(plan.mrope.get("channels", 4))
            if plan.mrope.get("layout") == "canvas":  # MiniCPM-V 4.7 (issue 28)
                sizes = inputs.get("target_sizes")
                positions = canvas_mrope_position_ids(
                    ids,
                    torch.as_tensor(token_types),
                    torch.zeros(0, 2, dtype=torch.int64) if sizes is None else torch.as_tensor(sizes),
                    int(plan.mrope["spatial_merge_size"]),
                    mask,
                    plan.mrope.get("markers") or {},
                )
            elif plan.mrope.get("layout") == "row_separated":  # HunYuan-VL (issue 28)
                positions, _ = row_separated_mrope_position_ids(
                    ids,
                    torch.as_tensor(token_types),
                    torch.as_tensor(grid),
                    plan.mrope["spatial_merge_size"],
                    mask,
                    channels,
                )
            else:
                positions, _ = mrope_position_ids(
                    ids,
                    torch.as_tensor(token_types),
                    torch.as_tensor(grid),
                    plan.mrope["spatial_merge_size"],
                    mask,
                    newline_columns=1 if plan.mrope.get("layout") == "newline_column" else 0,
                )
            positions = positions[-channels:]
        else:
            positions = _text_positions(mask)
        values = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions}
        skipped = self._components_without_inputs({"input_ids": ids, **inputs})
        for path, source in plan.language_inputs.items():  # DeepStack (Qwen3-VL) and the like
            if source.get("component") in skipped:
                raise ValueError(
                    f"the language_model takes {path!r} from the {source['component']}, which this text-only "
                    "prompt does not run (the export holds no image-free language model path); pass an image, "
                    "or export the text model alone for text-only prompts"
                )
            if source["from"] == "placeholders":
                where = torch.zeros_like(ids, dtype=torch.bool)
                for token in plan.features:
                    where |= ids == int(token)
                values[path] = where
            else:
                values[path] = _output(produced, source["component"], source["output"])
        out = self._call("language_model", values, {})
        hidden = out["last_hidden_state"]
        logits = _only(
            self._call("lm_head", {"input": hidden[:, -1:], "hidden_states": hidden[:, -1:]}, {}), "lm_head"
        )
        return logits[:, -1, :], self._cache_from(out), positions, {}

    def _decode_loop(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        logits: torch.Tensor,
        cache: dict[str, torch.Tensor],
        positions: torch.Tensor,
        max_new_tokens: int,
        state: dict[str, Any],
        *,
        token_key: str = "input_ids",
        encoder: Mapping[str, torch.Tensor] | None = None,
        grow_mask: bool = True,
        constants: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        eos = torch.tensor(self.plan.eos_token_ids, dtype=torch.int64)
        pad = self.plan.token_ids.get("pad_token_id")
        if pad is None:
            pad = int(eos[0]) if eos.numel() else 0
        batch = ids.shape[0]
        finished = torch.zeros(batch, dtype=torch.bool)
        last = positions[..., -1:]
        token_types = state.get("token_type_ids")
        new_tokens: list[torch.Tensor] = []
        self.last_logits = []
        forced_eos = self.plan.token_ids.get("forced_eos_token_id") or []
        for step in range(max_new_tokens):
            self.last_logits.append(logits.float())
            token = logits.argmax(dim=-1).to(torch.int64)
            if forced_eos and step == max_new_tokens - 1:
                # generate()'s forced end-of-sequence at the last position (the lowest of the ids:
                # they all get the same score and argmax takes the first)
                token = torch.full_like(token, min(int(e) for e in forced_eos))
            if eos.numel():
                token = torch.where(finished, torch.full_like(token, int(pad)), token)
                finished |= torch.isin(token, eos)
            new_tokens.append(token)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if grow_mask:
                mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            last = last + 1
            values: dict[str, Any] = {
                token_key: token[:, None],
                "attention_mask": mask,
                "position_ids": last,
                "mm_token_type_ids": torch.zeros(batch, 1, dtype=torch.int64),
                "token_type_ids": token_types[:, -1:]
                if token_types is not None
                else torch.zeros(batch, 1, dtype=torch.int64),
                **dict(constants or {}),
            }
            out = self._call("decode", values, cache, encoder)
            logits = out["logits"][:, -1, :]
            cache = {**cache, **self._cache_from(out)}
        return torch.cat([ids, torch.stack(new_tokens, dim=1)], dim=1)

    def _generate_encoder_decoder(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        inputs: Mapping[str, Any],
        *,
        encoded: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        inputs = dict(inputs)
        given = inputs.pop("decoder_input_ids", None)
        if encoded is None:
            encoded = self._call("encoder", {"input_ids": ids, "attention_mask": mask, **inputs}, {})
        start = self.plan.token_ids.get("decoder_start_token_id")
        if start is None:
            start = self.plan.token_ids.get("bos_token_id")
        if start is None:
            raise ValueError(
                "the model has no decoder_start_token_id (nor bos_token_id) to start decoding with"
            )
        decoder_ids = torch.full((ids.shape[0], 1), int(start), dtype=torch.int64)
        if given is not None:
            # a decoder prompt is continued as generate() continues it: after the start token,
            # which is put first unless some row already begins with it
            prompt = torch.as_tensor(given, dtype=torch.int64)
            prompt = prompt[None] if prompt.dim() == 1 else prompt
            prompt = prompt.expand(ids.shape[0], -1) if prompt.shape[0] == 1 else prompt
            starts = bool((prompt[:, :1] == int(start)).any()) if prompt.shape[1] else False
            decoder_ids = prompt if starts else torch.cat([decoder_ids, prompt], dim=1)
        return self._run_decoder(decoder_ids, mask, max_new_tokens, encoded, inputs)

    def _run_decoder(
        self,
        decoder_ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        encoded: Mapping[str, torch.Tensor],
        prompt: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """The decoder steps of an encoder-decoder: ``prefill`` on ``decoder_ids`` (the start token,
        or a given decoder prompt), then ``decode`` per token; ``[batch, len(decoder_ids) + n]``.
        The prefill also gets the prompt's other inputs, as ``generate`` passes them (T5Gemma 2's
        prefill takes ``pixel_values`` next to the encoder outputs; issue 28)."""
        values = {**dict(prompt or {}), "decoder_input_ids": decoder_ids, "attention_mask": mask}
        out = self._call("prefill", values, {}, encoded)
        positions = torch.zeros_like(decoder_ids)
        return self._decode_loop(
            decoder_ids,
            mask,
            out["logits"][:, -1, :],
            self._cache_from(out),
            positions,
            max_new_tokens,
            {},
            token_key="decoder_input_ids",
            encoder=encoded,
            grow_mask=False,
        )
