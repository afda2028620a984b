"""Whole-library sweep: export every model type's tiny model on every installed backend.

Repository tooling, not part of any published package: it writes ``docs/coverage.json`` and
``docs/coverage.md`` of this checkout.

For each task family (causal LM, masked LM, seq2seq, image classification, speech) the sweep lists
every model type transformers has a class for, builds its tiny model
(:func:`hfexport.testing.tiny_model` with ``check_eager=True``) and exports it with
``dynamic=True`` on each backend; the exporter validates against eager PyTorch at the sample shape
and at a derived second shape. Each model type runs in its own subprocess
(``benchmarks/zoo_sweep_child.py``: the build, then one export per backend) with a time limit per
step; a backend the subprocess never reached because an earlier one hung or crashed gets a
subprocess of its own. Each run writes JSON files under ``.bench/zoo/`` (one per family and model type);
:func:`merge_results` folds them into the committed ``docs/coverage.json`` so runs on fresh
checkouts and partial runs add up, and :func:`render` turns that into ``docs/coverage.md``.

Run it as ``nox -s zoo -- [options]`` or ``python benchmarks/zoo_sweep.py [options]``
(``--families``, ``--backends``, ``--types``, ``--jobs``, ``--limit``, ``--timeout``,
``--render-only``).

Cell statuses: ``pass``; ``fail`` (stage and one-line reason); ``skip`` (reason: backend not
installed, known upstream limit); a type whose tiny model cannot be built is ``unbuildable``, one
whose eager forward fails is ``eager fails``, a hand-written preset without the family's task is
``not offered``; these are reported in the "tiny model" column and are not export failures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hfexport.config import ExportFormat

__all__ = [
    "BACKENDS",
    "FAILURE_ACTIONS",
    "FAMILIES",
    "FAMILY_TYPES",
    "KNOWN_SKIPS",
    "failure_action",
    "main",
    "merge_results",
    "render",
    "run_sweep",
    "sweep_types",
]

#: family name -> the zoo task its models are built for
FAMILIES: dict[str, str] = {
    "causal-lm": "text-generation",
    "masked-lm": "fill-mask",
    "seq2seq": "text2text-generation",
    "image-classification": "image-classification",
    "speech": "automatic-speech-recognition",
    # issue 28: generation components (encoders, projector, language model, decode) exported with
    # export_for_generation and greedy generation compared with model.generate (zoo_sweep_child.generation_cell)
    "vision-language": "image-text-to-text",
}
# issue 28, families not swept (vision heads, time series, text-to-audio): own block
FAMILIES.update(
    {
        "object-detection": "object-detection",
        "zero-shot-object-detection": "zero-shot-object-detection",
        "image-segmentation": "image-segmentation",
        "depth-estimation": "depth-estimation",
        "time-series": "time-series-forecasting",
        "text-to-audio": "text-to-audio",
    }
)
#: family -> what its exports compute, shown under the family's heading (issue 28 families)
FAMILY_NOTES: dict[str, str] = {
    "object-detection": "The plain forward on `pixel_values`: `logits` and `pred_boxes` per query (DETR-like "
    "heads build timm-free: a tiny transformers resnet stands in for timm's resnet50; 10 queries). The RT-DETR "
    "family's tiny models (rt_detr, rt_detr_v2, d_fine, deimv2, pp_doclayout_*) get variance-preserving weights: "
    "upstream's N(0, 0.01) conv and batch-norm init shrank the features to 1e-6..1e-18, every query scored the "
    "prior bias and top-k chose among exact ties. The pp_ocr* text detectors pass on ExecuTorch since three "
    "ExecuTorch steps no longer guard their image sides at the 32 px sample (XNNPACK layout tags, the dim-order "
    "sort, memory planning's fake re-run of the delegates). rf_detr's window-partition view is planned with a bound "
    "that holds exactly its base's elements (ExecuTorch bounded each axis separately: 33.5 MB inside a 0.5 MB "
    "buffer, method load 0x21); dab-detr's PReLU over a 3-D input is decomposed instead of delegated "
    "(XNNPACK's ChannelsLastTaggedReshapePass converts 4-D tensors only); pp_doclayout_v2's reading-order "
    "softmax, fed by a 1x1-convolution position bias tagged NHWC, gets its NCHW input back (XNNPACK normalised "
    "over the heads: 1.16 off).",
    "zero-shot-object-detection": "The plain forward on `pixel_values` and one text query per image "
    "(`input_ids`): per-patch query logits and boxes. Grounding DINO and MM Grounding DINO build their "
    "phrase masks without `cummax`/`cummin`/`isin` at capture (a masked max/min over token pairs; ONNX and "
    "OpenVINO convert none of the three); their Swin backbone pins the image sides to the sample, as "
    "MaskFormer's. Their contrastive logits (`enc_outputs_class`, an unscaled 64-wide dot product, values near 26) "
    "carry 2.9e-4 of float32 rounding in eager itself, above atol 1e-4: they pass by the float64 reference "
    "(every backend within 4x eager's own error; ONNX was 6.5e-4 off eager at the second shape).",
    "image-segmentation": "The plain forward on `pixel_values`: semantic heads' `logits` (SegFormer, BEiT, DPT, "
    "MobileViT, UperNet) and universal/instance heads' class and mask query logits (Mask2Former, MaskFormer, "
    "OneFormer). EoMT and EoMT-DINOv3 fold their patch tokens back to the config's grid, so they take one image "
    "size (the second shape varies the batch). MaskFormer and OneFormer (Swin backbones) take one image size "
    "too: at the 32 px sample Swin's later stages are no larger than a window, the forward takes its "
    "`min(height, width) <= window_size` branch and the guards pin the sides, which the capture then traces "
    "static (before, ExecuTorch's and OpenVINO's re-traces spent tens of minutes simplifying the sides' size "
    "expressions, pytorch/pytorch#141675). OneFormer also takes its task prompt's token ids (`task_inputs`, "
    "16 in the tiny model) and returns its class and mask logits under two output names each, which OpenVINO's "
    "frontend refused (`is_number(name)`) until each repeated output became a copy of its own; its ExecuTorch "
    "lowering fails in XNNPACK's preprocess (a partition output `aten_cat_default` that is also its input, "
    "a pass-through XNNPACK does not take; not bisected). MobileViT's symbolic `pow` of sizes is rewritten as products "
    "before ExecuTorch's memory planning. rf_detr's window-partition view is planned within its base's buffer "
    "(see object detection).",
    "image-classification": "The plain forward on `pixel_values`: `logits`. ExecuTorch misses: donut-swin's method now loads (its "
    "window view is planned within its base, as rf_detr's) and matches eager at the sample, but its second "
    "shape fails at run time (0x1, not located); swin's `lower` stage did not finish in "
    "1500 s (XNNPACK's preprocess builds an ExportedProgram per partition and each converts the shape guards to "
    "code); pp_lcnet and efficientnet differ at the second shape (pp_lcnet: a freshly loaded method at 64 px is "
    "already 0.044 off eager, and 1.7e19 after a 32 px run; a toy of its blocks does not reproduce it). "
    "convnextv2 had that symptom from its global response norm's broadcasting div chained into a mul in one "
    "XNNPACK partition (the div now stays portable).",
    "depth-estimation": "The plain forward on `pixel_values`: `predicted_depth`. depth_pro splits the image "
    "into patches and merges them by the image size (scale factors 0.25, 0.5, Python loops over the patch "
    "grid), so its image sides are model-fixed (the second shape varies the batch only); its tiny weights are "
    "redrawn variance-preserving (the configured draw reached depths of 813, where float32 reordering alone "
    "exceeds the 1e-4 atol). chmv2's ONNX depth needed onnxscript's no-op rule `Add(x, 0) -> x` kept off its "
    "`+ 1e-8` shift (pattern constants matched within abs_tol 1e-8).",
    "time-series": "The forecasting head's deterministic output: patchtst/patchtsmixer's `prediction_outputs`; "
    "informer, autoformer and time_series_transformer teacher-force the horizon (`future_values`, "
    "`future_time_features`) and output its distribution parameters (`generate` samples from them); timesfm's "
    "mean and quantile forecasts.",
    "text-to-audio": "One forward per type, no generation loop: vits the whole waveform (noise scales 0, so "
    "deterministic); speecht5 the teacher-forced spectrogram decoder (`decoder_input_values`); musicgen the "
    "decoder logits per codebook (`decoder_input_ids` `[batch, codebooks, seq]`, the form the decoder "
    "reshapes its documented `[batch * codebooks, seq]` ids to); seamless_m4t the text "
    "decoder's logits; fastspeech2_conformer the spectrogram with durations (the HiFi-GAN variant the "
    "waveform; one data-dependent frame count, at most 5000); csm, pocket_tts, gradium_phonon_tts, higgs_audio_v2 "
    "and vibevoice their backbone's teacher-forced forward; types without a forward (bark, qwen2_5_omni: "
    "generate only) are 'eager fails'; qwen3_omni_moe's default talker config lacks attributes its model reads "
    "(unbuildable at any size). On ExecuTorch the data-dependent frame counts are bounded: vits' by the default "
    "sequence bound (4096 frames), fastspeech2_conformer's (at most 5000) narrowed by the memory budget "
    "(the tiny model: 1250 frames, batch at most 4, 256 phonemes), so a longer utterance is refused at run time (report.extra['memory_budget']).",
    "vision-language": "`export_for_generation` components (image encoder, projector, language model prefill "
    "and decode) at two shapes, then greedy generation from the components against `model.generate`. Image "
    "encoders that read `image_sizes` as values (LLaVA-NeXT anyres, Pixtral: mistral3, lighton_ocr) are exported "
    "for one image of the sample's size and called once per image (any image count; another size is refused); "
    "so are towers that read `image_grid_thw` as values (kimi_k25, hy_v4_vl, cosmos3_edge: one patch grid, the "
    "second prompt two images of that grid) and packed-patch towers (minicpm_ocr/v4_6, nemotron_h_omni: one "
    "`target_sizes` / `image_grid_hw` grid). BLIP, Kosmos-2/2.5: the language model takes the image features as "
    "an input of its own (cross-attention `encoder_hidden_states` at every step, or `image_embeds` in the "
    "prefill) and is split into image_encoder + prefill + decode of that model; Pix2Struct is an image-only "
    "encoder-decoder prompted with flattened patches. mllama and idefics: the language model takes token ids and "
    "cross-attends to the image, so the steps are the model's own forward given the image features in place of "
    "the image inputs (mllama's projector output as `cross_attention_states`, then the cross-attention K/V from "
    "the cache; idefics' vision output as `image_encoder_embeddings` at every step), a decode step the last row "
    "of the cross-attention mask (mllama's `cross_attention_mask` moves with the prompt, so its ExecuTorch "
    "prefill is planned at the model's positions and validated at a second shape; a text-only mllama prompt runs "
    "the steps on zero image features and a zero mask, which make each cross-attention layer add exactly zero, "
    "as `generate` skipping them does). minicpmv4_7's canvas M-RoPE positions (a thumbnail stretched over the canvas "
    "its slices tile) are computed by the runner. inkling_mm_model's hybrid sliding cache layers (conv states + a "
    "sliding key/value window) are captured as hybrid full-attention layers, so prefill hands its whole cache to a "
    "decode of any length, and its LM head component carries the model's hidden-state divisor. Qwen3.5 language "
    "models (qwen3_5, qwen3_5_moe, minicpm_ocr/v4_6/v4_7) carry the gated delta rule's state through its 64-token "
    "chunks with torch's scan op (dynamo, ONNX) or while_loop op (OpenVINO, whose frontend has no rule for scan), "
    "so their prefill takes any prompt length; ExecuTorch still unrolls upstream's loop at capture and narrows the "
    "prompt bound to the 63 tokens the program's guards accept (its emitter lowers the scan op, but copies the "
    "carry into a buffer it does not resize, so a batch other than the planned one fails at run time, 0x12), so a "
    "longer prefill is refused with the bound; their decode runs on a copy of its linear-attention states (the "
    "runtime returned the in-place writes as extra outputs, as nemotron_h_omni's). glm5_next passes dynamo, ONNX "
    "and OpenVINO (indexer pools padded, its chunked delta attention as a scan, on OpenVINO as a while_loop, a "
    "Reshape to a zero-size tensor keeps its computed shape, and on OpenVINO a concatenation with no elements, "
    "its width-0 value cache, is written as zeros of its size: the Concat dropped the empty step) and ExecuTorch "
    "(its sparse-attention mask's scatter_add takes an int64 index, and a concatenation whose operands are all "
    "empty becomes a full of its symbolic sizes). lfm3_vl's image encoder reads each image's grid as values and "
    "is exported for one patch grid; inkling_mm_model's ExecuTorch image encoder (its vision tower itself) is "
    "planned at 8x its sample's patch rows. ExecuTorch miss: florence2's image encoder has a view planned at the "
    "sample's batch of 2 (2048 elements), so a 3-image prompt fails (0x1; not located); its projector, which "
    "failed in an XNNPACK delegate (0x10) because a [2, 128, 1, 1] sample with permuted strides was read as "
    "channels-last (pytorch/executorch#22520), now runs (sample inputs get row-major strides). "
    "Types without a tiny model: transformers' own defaults leave the config incomplete (no vision config, no "
    "image token id) or the tower needs PIL and timm (timm wrappers: fast_vlm, gemma3n, perception_lm).",
}
# issue 28, first half of the families not swept: task heads, sentence embeddings, dual encoders, audio
FAMILIES.update(
    {
        "text-classification": "text-classification",
        "token-classification": "token-classification",
        "question-answering": "question-answering",
        "sentence-embeddings": "feature-extraction",
        "zero-shot-image-classification": "zero-shot-image-classification",
        "audio-classification": "audio-classification",
    }
)


def _sentence_embedding_backbones(listed: list[str]) -> list[str]:
    """The feature-extraction types that are sentence-embedding backbones: encoders with a masked-LM
    head in transformers (BERT-likes), encoder-decoders (a seq2seq LM class) left out, and so are types
    whose feature-extraction class takes no token ids (perceiver's ``PerceiverModel`` reads inputs an
    input preprocessor already embedded; only its masked-LM head carries the text preprocessor)."""
    from transformers.models.auto import modeling_auto

    masked = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    seq2seq = set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    return [t for t in listed if t in masked and t not in seq2seq and _takes_token_ids(t)]


def _takes_token_ids(model_type: str) -> bool:
    """Whether the ``AutoModel`` class of ``model_type`` (the first, when it maps to several) has an
    ``input_ids`` parameter in its forward."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    name = names[0] if isinstance(names, (tuple, list)) else names
    cls = getattr(transformers, name, None) if name else None
    return cls is not None and "input_ids" in inspect.signature(cls.forward).parameters


#: family -> which of its task's model types it sweeps (default: every type of the task)
FAMILY_TYPES: dict[str, Callable[[list[str]], list[str]]] = {
    "sentence-embeddings": _sentence_embedding_backbones,
}

#: the built-in formats, from the core's format table (plugins join with ``--backends``)
BACKENDS: tuple[str, ...] = tuple(member.value for member in ExportFormat)
# mamba, falcon_mamba and jamba are no longer skipped: hfexport.workarounds.recurrences replaces their
# per-token selective scan at capture (scan op on dynamo/onnx, chunked form on executorch/openvino)


def _hand_written_experts_loop(model_type: str, experts: str) -> str:
    """Skip reason for a model type whose experts module loops over the experts the router hit."""
    return (
        f"model-side: transformers 5.24 models/{model_type}/modeling_{model_type}.py, {experts}.forward loops over "
        "`torch.greater(expert_mask.sum(...), 0).nonzero()` and `torch.where(expert_mask[...])` itself, without "
        "@use_experts_implementation, so neither the experts interface nor hfexport's dense/grouped-matmul experts "
        "reach it and capture fails on a data-dependent trip count (GuardOnDataDependentSymNode: Eq(u0, 0); "
        "huggingface/transformers#38518). Needs the experts declared with @use_experts_implementation (3-D "
        "gate_up_proj/down_proj), as mixtral's are"
    )


#: transformers 5.24 types whose experts module has its own data-dependent loop -> that module's class
_HAND_WRITTEN_EXPERTS = {"dbrx": "DbrxExperts", "longcat_flash": "LongcatFlashExperts"}
#: (backend, model_type) -> reason the cell is skipped, naming the upstream issue or the model-side change
KNOWN_SKIPS: dict[tuple[str, str], str] = {
    **{
        (backend, mt): _hand_written_experts_loop(mt, experts)
        for mt, experts in _HAND_WRITTEN_EXPERTS.items()
        for backend in BACKENDS
    },
}
#: (kind, test, what a user can do) for a failed cell, first match wins; the test gets (stage, reason)
FAILURE_ACTIONS: tuple[tuple[str, Callable[[str, str], bool], str], ...] = (
    (
        "timeout",
        lambda stage, reason: stage == "timeout",
        "The export ran past the sweep's time limit; it may finish given longer "
        "(`nox -s zoo -- --types <type> --backends <backend> --timeout 1800`).",
    ),
    (
        "static",
        lambda stage, reason: "came out static" in reason,
        "The program came out static although `dynamic=True` was asked (the lowering specialised every axis): "
        "export with `--static` at each shape you serve, or use another backend for this type.",
    ),
    (
        "numbers",
        lambda stage, reason: "does not match eager PyTorch" in reason,
        "The artifact's numbers differ from eager PyTorch beyond tolerance, so the export fails rather than "
        "writing it: do not ship a copy of it. `hfexport export <backend> --model tiny:<type> -v` prints the "
        "validation table (each output's max abs diff and tolerance); report it with this cell.",
    ),
    (
        "data-dependent",
        lambda stage, reason: "GuardOnDataDependentSymNode" in reason and stage.startswith("capture"),
        "The forward branches on tensor values, which torch.export cannot capture: no artifact on any backend. "
        "The model-side change is `torch.cond` or a branch-free form of that code.",
    ),
    (
        "fixed-axis",
        lambda stage, reason: "Guard failed" in reason,
        "Capture fixed an axis at the sample's size (the forward branches or loops on it; the guard in the "
        "message names the axis), so the artifact runs at that size only: export with sample inputs of the "
        "size you serve (or `--static`).",
    ),
    (
        "second-shape",
        lambda stage, reason: stage == "validate_second_shape",
        "The artifact runs at the sample's shape but not at a second one (a size from the sample stayed in "
        "the graph): export with sample inputs of the size you serve (or `--static`).",
    ),
    (
        "runtime",
        lambda stage, reason: (
            stage.startswith("validate")
            and ("execute" in reason or "load method" in reason or "bad_alloc" in reason)
        ),
        "The runtime refused the artifact (a kernel missing from its library, or too little memory planned): "
        "it does not run. Use another backend for this type.",
    ),
    (
        "lowering",
        lambda stage, reason: (
            stage in ("lower", "translate", "optimize", "memory_planning", "convert")
            or "failed FX node(s)" in reason
        ),
        "The backend's lowering has no rule for an operation this model uses (or its retrace of the captured "
        "program hit a data-dependent size that capture did not), so no artifact is written: use another "
        "backend for this type (`hfexport export ... -v` prints the operation).",
    ),
    (
        "crash",
        lambda stage, reason: stage == "crash",
        "The process died in native code (the backend's compiler or runtime crashed; the reason names the "
        "signal): no artifact, no Python error. Use another backend for this type and report the crash "
        "upstream with `hfexport export ... -v`.",
    ),
    # vision-language generation cells (issue 28; zoo_sweep_child.generation_cell)
    (
        "decompose",
        lambda stage, reason: stage == "decompose",
        "The model could not be split into generation components (encoders, projector, language model, "
        "decode) from one `generate` call: the reason names the part or the input whose source is unknown. "
        "Export the whole forward instead (`hfexport export <backend> --model tiny:<type> --task "
        "image-text-to-text`), which does not generate.",
    ),
    (
        "generation-mismatch",
        lambda stage, reason: stage == "generate" and "differ from model.generate" in reason,
        "Every component validated, but greedy generation over them gives other tokens than `model.generate` "
        "(the runner's merge of image features, positions or cache differs from the model's): do not generate "
        "from this export; report the cell.",
    ),
    (
        "generation-runner",
        lambda stage, reason: stage == "generate",
        "The components exported but the greedy runner could not drive them at this image + prompt (an input "
        "it cannot supply, or a component refusing the second image shape): the reason names it.",
    ),
    (
        "capture",
        lambda stage, reason: stage.startswith("capture"),
        "torch.export could not capture this forward on this backend's settings: no artifact "
        "(`hfexport export ... -v` prints the capture error).",
    ),
)


def failure_action(stage: str, reason: str) -> tuple[str, str]:
    """``(kind, what a user can do)`` for a failed cell of the coverage page.

    Args:
        stage: the stage the export failed in (``"lower"``, ``"validate_second_shape"``, ``"timeout"`` ...).
        reason: the cell's one-line reason (the first line of the error).

    Returns:
        The first matching entry of :data:`FAILURE_ACTIONS`; ``("unclassified", ...)`` pointing to the
        verbose CLI run otherwise.
    """
    for kind, test, action in FAILURE_ACTIONS:
        if test(stage, reason):
            return kind, action
    return (
        "unclassified",
        "Not classified: `hfexport export <backend> --model tiny:<type> -v` prints the whole error; report it.",
    )


#: (family, backend) -> the share of eagerly running types that must export and validate (percent)
TARGETS: dict[tuple[str, str], int] = {
    ("causal-lm", ExportFormat.DYNAMO.value): 95,
    ("causal-lm", ExportFormat.ONNX.value): 95,
    ("causal-lm", ExportFormat.EXECUTORCH.value): 90,
    # vision-language (issue 28)
    ("vision-language", ExportFormat.DYNAMO.value): 90,
    ("vision-language", ExportFormat.ONNX.value): 90,
    ("vision-language", ExportFormat.EXECUTORCH.value): 85,
    ("vision-language", ExportFormat.OPENVINO.value): 85,
}
# issue 28 targets of the new families (vision heads, time series, text-to-audio; task heads, sentence
# embeddings, dual encoders, audio classification): own block
TARGETS.update(
    {
        (family, backend.value): 90 if backend in (ExportFormat.DYNAMO, ExportFormat.ONNX) else 85
        for family in (
            "object-detection",
            "zero-shot-object-detection",
            "image-segmentation",
            "depth-estimation",
            "time-series",
            "text-to-audio",
            "text-classification",
            "token-classification",
            "question-answering",
            "sentence-embeddings",
            "zero-shot-image-classification",
            "audio-classification",
        )
        for backend in ExportFormat
    }
)
_VERSIONED = ("hfexport", "torch", "transformers")

#: stderr lines that are a runtime's log chatter, never the reason a child died: native source-location
#: logs (``[cpuinfo_utils.cpp:125] ...``), glog-style lines (``W1203 10:07:18.962 19849 file.py:630] ...``)
#: and Python warnings (``file.py:12: UserWarning: ...``)
_WARNING_LINE = re.compile(r"^\S+\.py:\d+: \w*Warning:")
_LOG_LINE = re.compile(
    r"^\s*(?:\[[\w./-]+\.(?:c|cc|cpp|cxx|h|hpp):\d+\]"
    r"|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ "
    r"|\S+\.py:\d+: \w*Warning:)"
)


def crash_reason(stderr: str, exit_code: int, signum: int | None) -> str:
    """One line (at most 300 characters) saying why a sweep child died.

    Args:
        stderr: everything the child wrote to stderr.
        exit_code: its exit status (ignored when ``signum`` is set).
        signum: the signal that killed it, or None when it exited.

    Returns:
        The last stderr line that is not log chatter (see ``_LOG_LINE``; a warning's source line
        goes with it); prefixed with the signal's
        name (``"killed by SIGSEGV: ..."``) when a signal killed the child; ``"exit N"`` or
        ``"killed by SIGNAME"`` alone when stderr holds nothing else.
    """
    lines: list[str] = []
    after_warning = False
    for line in stderr.splitlines():
        # a Python warning is two lines: the message, then the indented source line it points at
        skip = bool(_LOG_LINE.match(line)) or (after_warning and line[:1].isspace())
        after_warning = bool(_WARNING_LINE.match(line))
        if line.strip() and not skip:
            lines.append(line.strip())
    last = lines[-1] if lines else ""
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return (f"killed by {name}: {last}" if last else f"killed by {name}")[:300]
    return (last or f"exit {exit_code}")[:300]


#: this folder (``benchmarks/``), where the child's module lives
HERE = Path(__file__).resolve().parent
#: the child process (``zoo_sweep_child.py`` next to this file): build, then one export per backend
_TYPE_CHILD = _TYPE_CHILD_DEFAULT = (
    f"import sys; sys.path.insert(0, {str(HERE)!r}); from zoo_sweep_child import main; main()"
)


def _child_module() -> Any:
    """``zoo_sweep_child`` (next to this file), loaded once in this process (for the forked children)."""
    module = sys.modules.get("zoo_sweep_child")
    if module is None:
        spec = importlib.util.spec_from_file_location("zoo_sweep_child", HERE / "zoo_sweep_child.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["zoo_sweep_child"] = module
        spec.loader.exec_module(module)
    return module


def _run_lines(
    code: str, args: Sequence[str], timeout: float
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Run ``code`` in a fresh interpreter (own process group); return the JSON lines it printed and,
    when it did not exit cleanly, a ``fail`` record (stage ``timeout`` or ``crash``) saying why."""
    if _FORK["enabled"] and code == _TYPE_CHILD_DEFAULT:
        return _fork_lines(args, timeout)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    error = None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        error = {"status": "fail", "stage": "timeout", "reason": f"no result within {timeout:.0f} s"}
    records = [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]
    if error is None and proc.returncode != 0:
        signum = -proc.returncode if proc.returncode < 0 else None
        error = {"status": "fail", "stage": "crash", "reason": crash_reason(err, proc.returncode, signum)}
    if error is not None:
        error["seconds"] = round(time.perf_counter() - start, 1)
    return records, error


#: run the type child as a fork of this process (imports already paid) instead of a new interpreter
_FORK = {"enabled": False}


#: Modules a backend's first export imports lazily (inside its stages, not with the exporter), and
#: that a forked type child would otherwise import again every time: for ExecuTorch,
#: ``executorch.exir`` (with the torch compiler stack it pulls in: 6-30 s depending on the load,
#: counted in every ExecuTorch cell's seconds), the XNNPACK partitioner and the runtime bindings.
#: Importing them creates no thread, so the fork stays safe.
PRELOAD_MODULES: dict[str, tuple[str, ...]] = {
    "executorch": (
        "hfexport_executorch.lowering",
        "executorch.backends.xnnpack.partition.xnnpack_partitioner",
        "executorch.runtime",
    ),
}


def _preload(backends: Sequence[str]) -> None:
    """Import what every type child needs (torch, transformers, the backends' exporters and the
    modules of :data:`PRELOAD_MODULES`) once in the sweeping process, so forked children start
    with it."""
    from hfexport.auto import get_hf_exporter

    _child_module()  # with hfexport.testing: transformers

    for backend in backends:
        try:
            get_hf_exporter(backend)
            for module in PRELOAD_MODULES.get(backend, ()):
                importlib.import_module(module)
        except ImportError:
            continue


def _fork_lines(args: Sequence[str], timeout: float) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """:func:`_run_lines` for the type child, as a fork of this process (POSIX): same records, same
    time limit (the child has its own session and is killed with it), same crash reason (the last
    line the child wrote to stderr)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as err_file:
        records, error, status = _forked(args, timeout, start, err_file)
        if error is None and status != 0:
            err_file.seek(0)
            signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            error = {
                "status": "fail",
                "stage": "crash",
                "reason": crash_reason(err_file.read(), code, signum),
            }
    if error is not None:
        error["seconds"] = round(time.perf_counter() - start, 1)
    return records, error


def _forked(
    args: Sequence[str], timeout: float, start: float, err_file: Any
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 1
        try:
            os.setsid()
            os.close(read_fd)
            os.dup2(write_fd, 1)
            os.dup2(err_file.fileno(), 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            _child_module().main(list(args))
            code = 0
        except BaseException:  # a crash of the child must never run the parent's code
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    error = None
    deadline = start + timeout
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            os.killpg(pid, signal.SIGKILL)
            error = {"status": "fail", "stage": "timeout", "reason": f"no result within {timeout:.0f} s"}
            break
        ready, _, _ = select.select([read_fd], [], [], min(left, 5.0))
        if ready:
            data = os.read(read_fd, 65536)
            if not data:
                break
            chunks.append(data)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    out = b"".join(chunks).decode(errors="replace")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], error, status


def _run_child(code: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter and return its last JSON line (or the failure record)."""
    records, error = _run_lines(code, args, timeout)
    if error is not None or not records:
        return error or {"status": "fail", "stage": "crash", "reason": "no result printed"}
    return records[-1]


def installed_backends() -> list[str]:
    """Backends whose package is installed (``hfexport.auto.available_export_formats``)."""
    from hfexport.auto import available_export_formats

    return [b for b in BACKENDS if b in available_export_formats()]


def versions() -> dict[str, str]:
    """Installed versions of the packages the coverage page names: the core's, then each installed
    backend package and the distributions it was tested with (its exporter's ``tested_versions``)."""
    from hfexport.auto import KNOWN_BACKEND_PACKAGES, available_export_formats, get_hf_exporter

    names = list(_VERSIONED)
    for fmt in available_export_formats():
        try:
            cls = get_hf_exporter(fmt)
        except ImportError:
            continue
        names += [KNOWN_BACKEND_PACKAGES.get(fmt, cls.package_name), *cls.tested_versions]
    found = {}
    for dist in dict.fromkeys(names):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def sweep_types(family: str, types: Iterable[str] | None = None, limit: int | None = None) -> list[str]:
    """The model types of ``family`` transformers has a class for, sorted (narrowed by
    :data:`FAMILY_TYPES`, filtered by ``types``, cut to the first ``limit``)."""
    from hfexport.testing import known_model_types

    listed = known_model_types(FAMILIES[family])
    if family in FAMILY_TYPES:
        listed = FAMILY_TYPES[family](listed)
    if types is not None:
        wanted = set(types)
        listed = [t for t in listed if t in wanted]
    return listed[:limit] if limit else listed


def _result_path(out_dir: Path, family: str, model_type: str) -> Path:
    return out_dir / f"{family}--{model_type}.json"


def _sweep_one(
    family: str,
    model_type: str,
    backends: Sequence[str],
    installed: Sequence[str],
    timeout: float,
    out_dir: Path,
) -> dict[str, Any]:
    task = FAMILIES[family]
    path = _result_path(out_dir, family, model_type)
    row = json.loads(path.read_text()) if path.exists() else {}
    row.update({"family": family, "task": task, "model_type": model_type})
    cells = row.setdefault("backends", {})
    todo = []
    for backend in backends:
        if backend not in installed:
            cells[backend] = {"status": "skip", "reason": f"hfexport-{backend} is not installed"}
        elif (backend, model_type) in KNOWN_SKIPS:
            cells[backend] = {"status": "skip", "reason": KNOWN_SKIPS[(backend, model_type)]}
        else:
            todo.append(backend)
    # one interpreter builds the model and exports it on every backend (imports paid once)
    records, error = _run_lines(
        _TYPE_CHILD, [model_type, task, ",".join(todo) or "-"], timeout * (1 + len(todo))
    )
    builds = [r for r in records if r.get("kind") == "build"]
    build = (
        {k: v for k, v in builds[0].items() if k != "kind"}
        if builds
        else {**(error or {}), "status": "unbuildable"}
    )
    row["build"] = build
    done = {r["backend"]: {k: v for k, v in r.items() if k not in ("kind", "backend")} for r in records[1:]}
    for backend in backends:
        if build["status"] != "ok":
            cells.pop(backend, None)
            continue
        if backend in todo:
            if backend in done:
                cells[backend] = done[backend]
            elif error is not None and not any(b in done for b in todo[todo.index(backend) :]):
                # the backend the child was on when it died or ran out of time: that is its result
                cells[backend] = dict(error)
                error = None
            else:  # a later backend the dead child never reached: its own child
                alone = _run_child(_TYPE_CHILD, ["--no-build", model_type, task, backend], timeout)
                cells[backend] = {k: v for k, v in alone.items() if k not in ("kind", "backend")}
        print(f"  {family:<20} {model_type:<28} {backend:<10} {_cell_text(cells[backend])}", flush=True)
    if build["status"] != "ok":
        print(f"  {family:<20} {model_type:<28} {build['status']}: {build.get('reason', '')}", flush=True)
    row["updated"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    path.write_text(json.dumps(row, indent=2) + "\n")
    return row


def run_sweep(
    families: Sequence[str],
    backends: Sequence[str],
    types: Sequence[str] | None,
    *,
    jobs: int = 1,
    limit: int | None = None,
    timeout: float = 300.0,
    out_dir: Path,
    done: Sequence[dict[str, Any]] = (),
    fork: bool = False,
) -> list[dict[str, Any]]:
    """Build and export every selected model type; write one JSON per (family, type) to ``out_dir``.

    Args:
        families: keys of :data:`FAMILIES`.
        backends: names among :data:`BACKENDS` (uninstalled ones become ``skip`` cells).
        types: only these model types (``None`` = all of each family).
        jobs: model types swept in parallel (each type is its own subprocess).
        limit: at most this many types per family (the first in sorted order).
        timeout: seconds allowed per step (the build and each export); a type's subprocess gets
            the sum of its steps' allowances.
        out_dir: the results folder (created; existing results of other backends are kept).
        done: result rows already recorded (e.g. ``docs/coverage.json``'s); a (family, type) whose
            row has a cell for every selected backend, or whose tiny model does not run, is not
            swept again.
        fork: run each type's child as a fork of this process, which imports torch, transformers
            and the backends once (POSIX; about half of a tiny type's wall time is imports),
            instead of a fresh interpreter.

    Returns:
        The result rows written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    installed = installed_backends()
    _FORK["enabled"] = fork and hasattr(os, "fork")
    if _FORK["enabled"]:
        _preload([b for b in backends if b in installed])
    finished = {
        (r["family"], r["model_type"])
        for r in done
        if r["build"].get("status") != "ok" or all(b in r.get("backends", {}) for b in backends)
    }
    work = [(f, t) for f in families for t in sweep_types(f, types, limit) if (f, t) not in finished]
    run = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "families": list(families),
        "backends": list(backends),
        "types": list(types) if types else None,
        "limit": limit,
        "timeout_s": timeout,
        "partial": bool(types or limit or set(families) != set(FAMILIES) or set(backends) != set(BACKENDS)),
    }
    (out_dir / "_run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(
        f"sweeping {len(work)} (family, type) pairs on {', '.join(backends)} with {jobs} job(s)", flush=True
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(
            pool.map(lambda ft: _sweep_one(ft[0], ft[1], backends, installed, timeout, out_dir), work)
        )
    return rows


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _cell_text(
    cell: dict[str, Any] | None, notes: dict[str, int] | None = None, actions: dict[str, str] | None = None
) -> str:
    """One table cell; with ``notes``, a skip reason becomes a numbered note under the table (the
    same reason, e.g. a model-side construct, usually applies to every backend of a type); with
    ``actions``, a failure names what a user can do (``[fixed-axis]``, listed under the table)."""
    if cell is None:
        return "-"
    status = cell.get("status")
    if status == "pass":
        return "pass"
    # object reprs carry a memory address that changes every run (<function sym_max at 0x7fc7...>)
    reason = _ADDRESS.sub("", str(cell.get("reason", ""))).replace("|", "\\|").replace("\n", " ")
    if status == "skip":
        if notes is None:
            return f"skip: {reason}"
        number = notes.setdefault(reason, len(notes) + 1)
        return f"skip [{number}]"
    stage = str(cell.get("stage", "?"))
    if actions is None:
        return f"**fail** ({stage}): {reason}"
    kind, action = failure_action(stage, str(cell.get("reason", "")))
    actions[kind] = action
    return f"**fail** ({stage}) [{kind}]: {reason}"


def merge_results(out_dir: Path, results: Path) -> dict[str, Any]:
    """Fold the per-type result files of ``out_dir`` into the committed results file ``results``.

    ``results`` (``docs/coverage.json``) keeps every row the sweeps have produced so far, so runs
    on fresh checkouts and partial runs add up. A row from ``out_dir`` replaces the stored row of the
    same (family, model type) when it is newer (its ``updated`` time); backend cells the new row did
    not run are kept from the stored one. The latest ``_run.json`` becomes the file's ``run``.

    Args:
        out_dir: folder of ``<family>--<type>.json`` rows and ``_run.json`` (may be missing).
        results: the JSON file to update (created when missing).

    Returns:
        The merged document: ``{"run": {...}, "rows": [row, ...]}`` with rows sorted by family, type.
    """
    doc = json.loads(results.read_text()) if results.exists() else {"run": {}, "rows": []}
    rows = {(r["family"], r["model_type"]): r for r in doc.get("rows", [])}
    run_file = out_dir / "_run.json"
    if run_file.exists():
        doc["run"] = json.loads(run_file.read_text())
    for path in sorted(out_dir.glob("*--*.json")) if out_dir.exists() else []:
        new = json.loads(path.read_text())
        key = (new["family"], new["model_type"])
        old = rows.get(key)
        if old is not None and old.get("updated", "") > new.get("updated", ""):
            continue
        if old is not None and new["build"].get("status") == "ok":
            new["backends"] = {**old.get("backends", {}), **new.get("backends", {})}
        rows[key] = new
    doc["rows"] = [rows[k] for k in sorted(rows)]
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def render(
    out_dir: Path, target: Path, results: Path | None = None, known: dict[str, list[str]] | None = None
) -> str:
    """Render ``docs/coverage.md`` from the sweep results; returns the text written.

    Args:
        out_dir: the per-type results of the latest run (``.bench/zoo``).
        target: the page to write.
        results: the committed results file; when given, ``out_dir`` is first folded into it
            (:func:`merge_results`) and the page shows every row it holds.
        known: family -> every model type it has (default :func:`sweep_types` per family); the page
            says how many of them the results cover.

    The page gives, per family, the counts per backend (pass / fail / skip among the types whose
    tiny model runs eagerly) at the top, then one row per model type (sorted) and one column per
    backend.
    """
    if results is not None:
        doc = merge_results(out_dir, results)
        run, rows = doc["run"], doc["rows"]
    else:
        run_file = out_dir / "_run.json"
        run = json.loads(run_file.read_text()) if run_file.exists() else {}
        rows = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*--*.json"))]
    backends = [b for b in BACKENDS if any(b in r.get("backends", {}) for r in rows)]
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    date = max((r.get("updated", "") for r in rows), default=run.get("date", ""))
    lines = ["# Architecture coverage", ""]
    lines.append(
        "Generated by `nox -s zoo` (`benchmarks/zoo_sweep.py`): every model type transformers has a class "
        "for, per task family, built as a tiny random-weight model (`tiny:<model_type>`) and exported with "
        "`dynamic=True`, validated against eager PyTorch at the sample shape and at a second shape; each "
        "type in its own subprocess (build, then every backend) with a time limit per step."
    )
    lines.append("")
    lines.append(f"- Date: {date[:10]} (UTC; last result {date})")
    vers = run.get("versions", {})
    lines.append("- Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    if known is None:
        known = {family: sweep_types(family) for family in FAMILIES}
    swept = {f: {r["model_type"] for r in rows if r["family"] == f} for f in FAMILIES}
    runnable = [r for r in rows if r["build"].get("status") == "ok"]
    not_run = {b: sum(1 for r in runnable if b not in r.get("backends", {})) for b in backends}
    short = [f for f in known if not set(known[f]) <= swept.get(f, set())]
    if short or any(not_run.values()):
        parts = [f"{f} {len(swept.get(f, set()) & set(known[f]))} of {len(known[f])} types" for f in known]
        complete = [b for b in backends if not not_run[b]]
        partial = [
            f"{b} ({not_run[b]} of {len(runnable)} cells not run, `-`)" for b in backends if not_run[b]
        ]
        where = f"complete on {', '.join(complete)}; " if complete and not short else ""
        lines += [
            "",
            f"> **Partial sweep** ({', '.join(parts)}; {where}partial on "
            f"{', '.join(partial) or ', '.join(backends)}). Counts cover the types swept so far; run "
            "`nox -s zoo` for the rest (results add up in `docs/coverage.json`).",
        ]
    lines += ["", "## Counts", ""]
    lines.append("| family | types | tiny model runs | " + " | ".join(backends) + " |")
    lines.append("|---|---|---|" + "---|" * len(backends))
    for family in families:
        fam = [r for r in rows if r["family"] == family]
        runnable = [r for r in fam if r["build"]["status"] == "ok"]
        cells = []
        for backend in backends:
            got = [r["backends"].get(backend, {}).get("status") for r in runnable]
            passed, failed, skipped = got.count("pass"), got.count("fail"), got.count("skip")
            ran = passed + failed
            goal = TARGETS.get((family, backend))
            verdict = ""
            if len(fam) < len(known.get(family, ())):  # the family itself is only partly swept
                verdict = f"; {len(fam)} of {len(known[family])} types swept"
                if goal is not None:
                    verdict += f", target {goal}% not judged yet"
            elif ran + skipped < len(runnable):  # the backend has not seen every runnable type yet
                verdict = f"; {ran + skipped} of {len(runnable)} types run"
                if goal is not None:
                    verdict += f", target {goal}% not judged yet"
            elif goal is not None and ran:
                verdict = f", target {goal}%: {'met' if 100 * passed / ran >= goal else '**missed**'}"
            share = f" ({100 * passed / ran:.0f}%{verdict})" if ran else ""
            if ran + skipped == 0:
                cells.append("not run yet")
                continue
            cells.append(f"{passed} pass / {failed} fail / {skipped} skip{share}")
        lines.append(f"| {family} | {len(fam)} | {len(runnable)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Percentages are passes among the types whose tiny model runs eagerly and were exported. "
        "Cells: `pass`; `fail` (stage) [kind]: first line of the error, the kind's remedy listed under the "
        "family's table; `skip`: reason; `n/a`: no tiny model; "
        "`-`: not run by the sweeps so far.",
    ]
    for family in families:
        fam = sorted((r for r in rows if r["family"] == family), key=lambda r: r["model_type"])
        lines += ["", f"## {family} (`{FAMILIES[family]}`)", ""]
        if family in FAMILY_NOTES:  # issue 28 families: what the export computes
            lines += [FAMILY_NOTES[family], ""]
        lines.append("| model type | tiny model | " + " | ".join(backends) + " |")
        lines.append("|---|---|" + "---|" * len(backends))
        notes: dict[str, int] = {}
        actions: dict[str, str] = {}
        for r in fam:
            build = r["build"]
            if build["status"] == "ok":
                tiny = f"ok ({build.get('params', 0) / 1e6:.2f}M params)"
                cells = [_cell_text(r["backends"].get(b), notes, actions) for b in backends]
            else:
                reason = str(build.get("reason", "")).replace("|", "\\|")
                tiny = f"{build['status']} ({build.get('stage', '?')}): {reason}"
                cells = ["n/a"] * len(backends)
            lines.append(f"| {r['model_type']} | {tiny} | " + " | ".join(cells) + " |")
        if notes:
            lines += ["", "Skips:", ""]
            lines += [f"{number}. {reason}" for reason, number in notes.items()]
        if actions:
            lines += ["", "Failures, by kind (what you can do):", ""]
            lines += [f"- `{kind}`: {actions[kind]}" for kind in sorted(actions)]
    text = "\n".join(lines) + "\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return text


def main(argv: Sequence[str] | None = None, root: Path | None = None) -> int:
    """Command line of the sweep (see the module docstring); returns the exit status.

    ``root`` is the checkout whose ``.bench/zoo`` and ``docs/`` are written (default: the one holding
    this file).
    """
    root = root or HERE.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--types", default=None, help="comma list of model types (default: all)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="at most N types per family")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per step (build, each export)")
    parser.add_argument("--out", type=Path, default=root / ".bench" / "zoo")
    parser.add_argument("--doc", type=Path, default=root / "docs" / "coverage.md")
    parser.add_argument(
        "--results",
        type=Path,
        default=root / "docs" / "coverage.json",
        help="committed results, merged across runs",
    )
    parser.add_argument(
        "--fresh-interpreters",
        action="store_true",
        help="start every type's child as a new interpreter instead of a fork of the sweep (slower)",
    )
    parser.add_argument(
        "--only-missing",
        action="store_true",
        help="skip types whose results (in --out or --results) already cover every selected backend",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="only render the page from --out and --results"
    )
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    backends = [b for b in args.backends.split(",") if b]
    if unknown or any(b not in BACKENDS for b in backends):
        parser.error(f"families must be among {', '.join(FAMILIES)}; backends among {', '.join(BACKENDS)}")
    if not args.render_only:
        types = [t for t in args.types.split(",") if t] if args.types else None
        run_sweep(
            families,
            backends,
            types,
            jobs=args.jobs,
            limit=args.limit,
            timeout=args.timeout,
            out_dir=args.out,
            done=merge_results(args.out, args.results)["rows"] if args.only_missing else (),
            fork=not args.fresh_interpreters,
        )
    render(args.out, args.doc, results=args.results)
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
