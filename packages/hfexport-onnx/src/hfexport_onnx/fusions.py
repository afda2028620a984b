"""ONNX Runtime fusions: rewrite the optimized graph into ORT's fused contrib ops (``OnnxConfig.ort_fusions``).

The rewrites themselves are onnxscript's (``onnxscript.rewriter.ort_fusions``, pattern rules over
``onnx_ir``); this module is our integration: which rewrite runs, in which order, for which
execution provider and graph dtype, and what the report says fused.

Each rewrite is a registry entry of kind :data:`KIND` (``"ort_fusion"``) under the key
``"onnx"`` (both providers) or ``"onnx.cpu"`` / ``"onnx.cuda"`` (one provider), with its targets
the ops it produces and its metadata the onnxscript range it was checked with.
:func:`apply_ort_fusions` runs the active entries for a provider in registration order on an
``onnx_ir.Model`` in place and returns ``{rewrite: count}``.

Order matters and is the registration order below: normalizations and rotary embeddings first,
then the attention chain (``sdpa`` marks scaled-dot-product-attention subgraphs, which ``gqa`` /
``mha*`` / ``attention`` consume; ``sdpa`` functions nothing consumed are inlined back at the end),
then the activations, then the MatMul rules (``FusedMatMul``). The ``onnx`` entries run before the
``onnx.<provider>`` ones (registry order), whatever their place in this file.

Two rewrites are ours, not onnxscript's: ``cached_gqa`` (:mod:`hfexport_onnx.gqa`, right after
``sdpa``: attention over a ``Concat(past, new)`` KV cache as transformers 5 graphs have it ->
``GroupQueryAttention``, which onnxscript 0.7's own ``gqa`` rule does not match) and
``sibling_matmuls_<provider>`` (:mod:`hfexport_onnx.matmul_packing`: MatMuls of one input packed
into one MatMul + Split, after the Attention fusions that pack Q/K/V their own way).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from typing import Any

from hfexport import registry
from hfexport.config import ORT_FUSION_TARGETS

__all__ = [
    "KIND",
    "PROVIDERS",
    "apply_ort_fusions",
    "check_fusion_target",
    "contrib_op_counts",
    "fusion_entries",
    "register_ort_fusion",
]

logger = logging.getLogger(__name__)

#: Registry kind of the ONNX Runtime fusion rewrites.
KIND = "ort_fusion"
#: ``OnnxConfig.ort_fusions`` value -> the ONNX Runtime execution provider it targets.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

# The onnxscript releases these rewrites were checked with (their names and counts changed before).
_VERSIONS = {"onnxscript": ">=0.7"}
# onnxscript guards its fusions by the ORT version they target, not by provider; we choose per
# provider and dtype (see the review of microsoft/onnxscript#2272).
_ISSUE = "https://github.com/microsoft/onnxscript/pull/2272"

registry.register_kind(
    KIND,
    description="fuse(model: onnx_ir.Model, dtype) -> int rewriting the optimized graph into ONNX Runtime contrib ops",
    targets="ops produced",
)


def register_ort_fusion(
    *ops: str,
    provider: str | None = None,
    description: str,
    issue: str | None = _ISSUE,
    versions: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Register ``fuse(model: onnx_ir.Model, dtype: str) -> int`` (number of rewrites) as an ORT fusion.

    Args:
        *ops: the ops it produces (``"com.microsoft.SkipLayerNormalization"``).
        provider: ``None`` for every provider (key ``"onnx"``), else ``"cpu"`` or ``"cuda"`` (key
            ``"onnx.cpu"`` ...).
        description / issue / versions: registry metadata (see :func:`hfexport.registry.register`).

    Raises:
        ValueError: an unknown provider or invalid metadata.
    """
    if provider is not None and provider not in PROVIDERS:
        raise ValueError(f"provider={provider!r} is invalid; allowed: None, {', '.join(PROVIDERS)}")
    key = "onnx" if provider is None else f"onnx.{provider}"
    return registry.register(
        KIND, key, *ops, description=description, issue=issue, versions=dict(versions or _VERSIONS)
    )


def fusion_entries(provider: str | None = None) -> list[registry.RegistryEntry]:
    """The registered ORT fusions (active or not) that run for ``provider`` (``None``: all)."""
    if provider is None:
        return [e for e in registry.entries(kind=KIND)]
    return registry.entries(f"onnx.{provider}", kind=KIND)


def check_fusion_target(target: str | None) -> None:
    """Refuse a fusion target the installed ONNX Runtime cannot run, before capture.

    Raises:
        ValueError: ``target`` not in ``("cpu", "cuda")``, or its execution provider is not in
            ``onnxruntime.get_available_providers()`` (e.g. ``"cuda"`` without onnxruntime-gpu);
            the message names the available targets.
    """
    if target is None:
        return
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    usable = [name for name, provider in PROVIDERS.items() if provider in available]
    if target not in ORT_FUSION_TARGETS or PROVIDERS.get(target) not in available:
        raise ValueError(
            f"ort_fusions={target!r} needs ONNX Runtime's {PROVIDERS.get(target, target)}, which the installed "
            f"onnxruntime {ort.__version__} does not ship (it has {', '.join(sorted(available))}); "
            f"allowed here: None, {', '.join(map(repr, usable))}"
            + ("; install onnxruntime-gpu for 'cuda'" if target == "cuda" else "")
        )


def contrib_op_counts(model: Any) -> dict[str, int]:
    """``{"Domain.Op": count}`` of the nodes outside the default ONNX domain (the fused ops)."""
    counts = collections.Counter(
        f"{node.domain}.{node.op_type}"
        for node in model.graph.all_nodes()
        if node.domain not in ("", "ai.onnx")
    )
    return dict(sorted(counts.items()))


def _pre_optimize(model: Any) -> None:
    """Shape inference, the onnxscript optimizer and its shape rewrites: the fusions match on
    known shapes and folded constants."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import shape_optimization
    from onnxscript.rewriter.rules.common import _gemm_to_matmul_add

    rewrite(model, [_gemm_to_matmul_add.gemm_to_matmul_add_rule])
    common_passes.ShapeInferencePass()(model)
    optimize(model)
    shape_optimization.rules.apply_to_model(model)
    optimize(model)


def _post_optimize(model: Any) -> None:
    """Inline what no fusion consumed, fold, and tidy initializers as ORT expects them."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize

    optimize(model)
    ir.passes.Sequential(
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1),
        common_passes.RemoveInitializersFromInputsPass(),
        common_passes.ShapeInferencePass(),
    )(model)


def apply_ort_fusions(model: Any, provider: str, *, dtype: str = "float32") -> dict[str, int]:
    """Run the active ORT fusions for ``provider`` on ``model`` in place.

    Args:
        model: an ``onnx_ir.Model`` (``ONNXProgram.model``), already optimized.
        provider: ``"cpu"`` or ``"cuda"``.
        dtype: the graph's compute dtype (``"float32"``, ``"float16"``); fusions whose op has no
            kernel for it on ``provider`` skip themselves (they return 0).

    Returns:
        ``{entry short name: number of rewrites}`` for every entry that ran, in order (0 included).

    Raises:
        Exception: whatever a rewrite raises, with a note naming it.
    """
    _pre_optimize(model)
    counts: dict[str, int] = {}
    for entry in registry.active_entries(KIND, f"onnx.{provider}"):
        short = entry.name.rsplit(".", 1)[-1].removeprefix("fuse_")
        try:
            counts[short] = int(entry.func(model, dtype))
        except Exception as exc:
            exc.add_note(f"while applying the ORT fusion {entry.name} ({provider})")
            raise
    _post_optimize(model)
    return counts


def _fuse(func_path: str, **kwargs: Any) -> Callable[[Any], int]:
    module_name, name = func_path.rsplit(".", 1)

    def run(model: Any) -> int:
        import importlib

        return int(getattr(importlib.import_module(module_name), name)(model, **kwargs))

    return run


_UP = "onnxscript.rewriter.ort_fusions"
#: where our GroupQueryAttention rewrite puts the rotary embedding (see :mod:`hfexport_onnx.gqa`)
GQA_ROTARY = "gqa"


# -- normalizations --------------------------------------------------------------------------------
@register_ort_fusion(
    "com.microsoft.Gelu",
    description="Erf-based GELU subgraph -> com.microsoft.Gelu (onnxscript fuse_erfgelu)",
)
def fuse_erf_gelu(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.erfgelu.fuse_erfgelu")(model)


@register_ort_fusion(
    "SimplifiedLayerNormalization",
    description="RMS normalization subgraph -> SimplifiedLayerNormalization (onnxscript fuse_rms_normalization)",
)
def fuse_rms_normalization(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.rms_normalization.fuse_rms_normalization")(model)


@register_ort_fusion(
    "com.microsoft.SkipLayerNormalization",
    description="residual Add + LayerNormalization -> com.microsoft.SkipLayerNormalization",
)
def fuse_skip_layer_normalization(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.skip_normalization.fuse_skip_layer_normalization")(model)


@register_ort_fusion(
    "com.microsoft.SkipSimplifiedLayerNormalization",
    description="residual Add + SimplifiedLayerNormalization -> com.microsoft.SkipSimplifiedLayerNormalization",
)
def fuse_skip_rms_normalization(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.skip_normalization.fuse_skip_rms_normalization")(model)


# -- rotary embeddings -----------------------------------------------------------------------------
@register_ort_fusion(
    "com.microsoft.RotaryEmbedding",
    description="rotate-half rotary embedding subgraph -> com.microsoft.RotaryEmbedding",
)
def fuse_rotary_embedding(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.rotary_embedding.fuse_rotary_embedding")(model)


@register_ort_fusion(
    "com.microsoft.RotaryEmbedding",
    description="cos/sin computed from position ids -> a precomputed cos/sin cache input of RotaryEmbedding",
)
def fuse_cos_sin_cache(model: Any, dtype: str) -> int:
    import onnx_ir.passes.common as common_passes

    count = _fuse(f"{_UP}.cos_sin_cache.fuse_cos_sin_cache")(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    return count


@register_ort_fusion(
    "com.microsoft.RotaryEmbedding",
    description="rotary embedding over part of the head dimension -> RotaryEmbedding on a slice",
)
def fuse_partial_rotary_embedding(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.rotary_embedding.fuse_partial_rotary_embedding")(model)


# -- attention ------------------------------------------------------------------------------------
@register_ort_fusion(
    "SDPA (intermediate)",
    description="mark scaled-dot-product attention subgraphs for the attention fusions (inlined back if unused)",
)
def fuse_sdpa(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.sdpa.fuse_sdpa", apply_shape_inference=True)(model)


@register_ort_fusion(
    "com.microsoft.GroupQueryAttention",
    description="SDPA over Concat(past, new) KV caches, repeat_kv and a rotate-half rotary embedding, as "
    "transformers 5 graphs have them (positions * inv_freq, boolean mask via GatherND) -> "
    "com.microsoft.GroupQueryAttention with packed QKV, the rotary inside (do_rotary, cos/sin from "
    "inv_freq, position_ids), seqlens_k/total length from the shapes and the mask as attention_bias "
    "(our rewrite: hfexport_onnx.gqa)",
    issue="https://github.com/microsoft/onnxscript/pull/2461",  # GatherND-built masks: unmerged
)
def fuse_cached_gqa(model: Any, dtype: str) -> int:
    from hfexport_onnx.gqa import fuse_cached_gqa as fuse

    return fuse(model, rotary=GQA_ROTARY)


@register_ort_fusion(
    "com.microsoft.GroupQueryAttention",
    description="SDPA over a concatenated KV cache with grouped heads -> com.microsoft.GroupQueryAttention",
)
def fuse_gqa(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.gqa.fuse_gqa")(model)


@register_ort_fusion(
    "com.microsoft.GroupQueryAttention",
    description="GroupQueryAttention on slices of one projection -> GroupQueryAttention with packed QKV",
)
def fuse_packed_qkv_for_gqa(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.gqa_packed_qkv.fuse_qkv_gqa")(model)


@register_ort_fusion(
    "com.microsoft.MultiHeadAttention",
    description="SDPA with head split/merge reshapes (and an optional cache) -> com.microsoft.MultiHeadAttention",
)
def fuse_mha(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.mha.fuse_mha1")(model) + _fuse(f"{_UP}.mha.fuse_mha2")(model)


@register_ort_fusion(
    "com.microsoft.MultiHeadAttention",
    description="query pre-scaling folded into MultiHeadAttention's scale attribute",
)
def fuse_mha_scale(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.mha_scale.fuse_mha_scale")(model)


@register_ort_fusion(
    "com.microsoft.MultiHeadAttention",
    description="Q/K/V projection biases moved into MultiHeadAttention's bias input",
)
def fuse_mha_bias(model: Any, dtype: str) -> int:
    if not any(n.op_type == "MultiHeadAttention" for n in model.graph.all_nodes()):
        return 0
    return _fuse(f"{_UP}.mha_bias.fuse_mha_bias")(model)


@register_ort_fusion(
    "com.microsoft.Attention",
    provider="cpu",
    description="Q/K/V projections + MultiHeadAttention -> com.microsoft.Attention (packed QKV weights); "
    "fp32 only on CPU (ORT's CPU Attention kernel is float-only)",
)
def fuse_attention_cpu(model: Any, dtype: str) -> int:
    if dtype != "float32" or not any(n.op_type == "MultiHeadAttention" for n in model.graph.all_nodes()):
        return 0
    return _fuse(f"{_UP}.attention.fuse_attention")(model)


@register_ort_fusion(
    "com.microsoft.Attention",
    provider="cuda",
    description="Q/K/V projections + MultiHeadAttention -> com.microsoft.Attention (packed QKV weights, fp32/fp16)",
)
def fuse_attention_cuda(model: Any, dtype: str) -> int:
    if not any(n.op_type == "MultiHeadAttention" for n in model.graph.all_nodes()):
        return 0
    return _fuse(f"{_UP}.attention.fuse_attention")(model)


# -- activations and MatMuls ------------------------------------------------------------------------
@register_ort_fusion(
    "com.microsoft.FastGelu", description="tanh-approximated GELU subgraph -> com.microsoft.FastGelu"
)
def fuse_gelu(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.gelu.fuse_gelu")(model)


@register_ort_fusion("com.microsoft.BiasGelu", description="bias Add + Gelu -> com.microsoft.BiasGelu")
def fuse_bias_gelu(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.bias_gelu.fuse_bias_gelu")(model)


@register_ort_fusion(
    "com.microsoft.MultiHeadAttention",
    description="remaining SDPA subgraphs (no reshape pattern matched) -> MultiHeadAttention",
)
def fuse_sdpa_via_mha(model: Any, dtype: str) -> int:
    return _fuse(f"{_UP}.sdpa_via_mha.replace_sdpa_by_mha")(model)


@register_ort_fusion(
    "com.microsoft.FusedMatMul",
    description="Transpose/scale around MatMul -> com.microsoft.FusedMatMul; softmax/group-norm pattern rules",
)
def fuse_matmul_rules(model: Any, dtype: str) -> int:
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import _core

    optimize(model)  # inline the SDPA functions no attention fusion consumed before matching MatMuls
    before = collections.Counter(n.op_type for n in model.graph.all_nodes())
    rewrite(model, _core.ORT_PATTERN_REWRITE_RULES)
    after = collections.Counter(n.op_type for n in model.graph.all_nodes())
    return max(after["FusedMatMul"] - before["FusedMatMul"], 0)


# -- MatMul packing: provider keys run after the generic entries (registry order: "onnx", then
# "onnx.<provider>"), so the Attention fusions, which pack Q/K/V themselves, took their MatMuls first
_PACKING = (
    "MatMuls of one input with constant weights (llama gate/up projections) -> one MatMul over the "
    "concatenated weights + Split: same bytes read, fewer kernels per decode step (our rewrite: "
    "hfexport_onnx.matmul_packing)"
)


# not workarounds (issue=None): ONNX Runtime's own graph optimizers do not pack MatMuls
@register_ort_fusion("MatMul+Split", provider="cpu", description=_PACKING, issue=None)
def fuse_sibling_matmuls_cpu(model: Any, dtype: str) -> int:
    from hfexport_onnx.matmul_packing import pack_sibling_matmuls

    return pack_sibling_matmuls(model)


@register_ort_fusion("MatMul+Split", provider="cuda", description=_PACKING, issue=None)
def fuse_sibling_matmuls_cuda(model: Any, dtype: str) -> int:
    from hfexport_onnx.matmul_packing import pack_sibling_matmuls

    return pack_sibling_matmuls(model)
