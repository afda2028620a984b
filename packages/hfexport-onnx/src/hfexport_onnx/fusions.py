"""ONNX Runtime fusions: rewrite the optimized graph into ORT's fused contrib ops (``OnnxConfig.ort_fusions``).

The rewrites themselves are onnxscript's (``onnxscript.rewriter.ort_fusions``, pattern rules over
``onnx_ir``); this module is our integration: which rewrite runs, in which order, for which
execution provider and graph dtype, and what the report says fused.

Each rewrite is a registry entry of kind :data:`KIND` (``"ort_fusion"``) under the key
``"onnx"`` (both providers) or ``"onnx.cpu"`` / ``"onnx.cuda"`` (one provider), with its targets
the ops it produces and its metadata the onnxscript range it was checked with.
:func:`apply_ort_fusions` runs the active entries for a provider in registration order on an
``onnx_ir.Model`` in place and returns ``{rewrite: count}``.

The rewrites are one table, :data:`ORT_FUSIONS` (name, ops, the rewrite functions, provider,
dtypes, the op a rewrite needs), registered row by row in its order, which is the order they run:
normalizations and rotary embeddings first, then the attention chain (``sdpa`` marks
scaled-dot-product-attention subgraphs, which ``gqa`` / ``mha*`` / ``attention`` consume; ``sdpa``
functions nothing consumed are inlined back at the end), then the activations, then the MatMul
rules (``FusedMatMul``), then the provider-specific rows (the registry runs the ``onnx`` entries
before the ``onnx.<provider>`` ones). ``skip_layer_normalization`` is a CUDA row: ONNX Runtime's
CPU ``SkipLayerNormalization`` kernel is slower than the ``Add`` + ``LayerNormalization`` it
replaces, and the export's ``ort_kernel_fixes`` stage keeps CPU graphs free of it
(:mod:`hfexport_onnx.workarounds.ort_layer_norm`).

Two rewrites are ours, not onnxscript's: ``cached_gqa`` (:mod:`hfexport_onnx.gqa`, right after
``sdpa``: attention over a ``Concat(past, new)`` KV cache as transformers 5 graphs have it ->
``GroupQueryAttention``, which onnxscript 0.7's own ``gqa`` rule does not match) and
``sibling_matmuls_<provider>`` (:mod:`hfexport_onnx.matmul_packing`: MatMuls of one input packed
into one MatMul + Split, after the Attention fusions that pack Q/K/V their own way).
"""

from __future__ import annotations

import collections
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hfexport import registry
from hfexport.config import ORT_FUSION_TARGETS

__all__ = [
    "KIND",
    "ORT_FUSIONS",
    "PROVIDERS",
    "OrtFusion",
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
    reshaped = gemm_inputs_to_rank_2(model)
    if reshaped:
        logger.debug("%d Gemm input(s) from fused attention ops reshaped to rank 2", reshaped)
    _post_optimize(model)
    return counts


#: contrib ops whose output 0 is ``[batch, sequence, hidden]`` (ONNX Runtime's contrib op schemas)
_RANK_3_OUTPUT_OPS = frozenset({"MultiHeadAttention", "Attention", "GroupQueryAttention"})


def gemm_inputs_to_rank_2(model: Any) -> int:
    """Put a ``Reshape(x, [-1, K])`` in front of every ``Gemm`` whose ``A`` input is output 0 of a
    fused attention op (:data:`_RANK_3_OUTPUT_OPS`), in place.

    A model that flattens the attention output to 2-D before a ``Gemm`` (GPT-2's ``Conv1D``: ``view(-1,
    n)`` + ``addmm`` with no bias left after the optimizer folds it into an ``Add``) keeps that
    ``Reshape`` only until onnxscript's ``MultiHeadAttention`` fusion (checked with onnxscript 0.7.2)
    takes it as the attention's own output reshape and hands the ``Gemm`` the op's 3-D
    ``[batch, sequence, hidden]`` output: ONNX Runtime then refuses the model ("Gemm: Input 0 expected
    to have rank 2 but has rank 3"). onnxscript's own ``gemm_to_matmul_add`` rule, which would remove
    that ``Gemm``, needs a bias input and a constant target shape, so it does not match there. No
    upstream issue found. A reshape of an already 2-D input is a no-op, so every such ``Gemm`` gets one.

    Args:
        model: an ``onnx_ir.Model`` after the fusions.

    Returns:
        The number of reshapes inserted.
    """
    import numpy as np
    import onnx_ir as ir

    count = 0
    for node in list(model.graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        a, b = node.inputs[0], node.inputs[1]
        producer = a.producer() if a is not None else None
        if producer is None or producer.op_type not in _RANK_3_OUTPUT_OPS or producer.outputs[0] is not a:
            continue
        trans_a = node.attributes.get("transA")
        if trans_a is not None and trans_a.as_int():
            continue
        trans_b = node.attributes.get("transB")
        if b is None or b.shape is None or not isinstance(b.shape[0], int) or not isinstance(b.shape[1], int):
            continue
        k = b.shape[1] if trans_b is not None and trans_b.as_int() else b.shape[0]
        target = ir.Value(
            name=f"{node.name or 'gemm'}_rank2_shape",
            const_value=ir.tensor(np.array([-1, k], dtype=np.int64)),
        )
        model.graph.register_initializer(target)
        flat = ir.node("Reshape", inputs=[a, target], name=f"{node.name or 'gemm'}_rank2")
        flat.outputs[0].name = f"{a.name}_rank2"
        model.graph.insert_before(node, flat)
        node.replace_input_with(0, flat.outputs[0])
        count += 1
    return count


_UP = "onnxscript.rewriter.ort_fusions"
#: where our GroupQueryAttention rewrite puts the rotary embedding (see :mod:`hfexport_onnx.gqa`)
GQA_ROTARY = "gqa"
#: the op the attention-projection fusions build on (they skip a graph without it)
_MHA = "MultiHeadAttention"


@dataclass(frozen=True)
class OrtFusion:
    """One row of :data:`ORT_FUSIONS`: a rewrite into ONNX Runtime contrib ops, and when it runs.

    Attributes:
        name: the report's name of the rewrite (``report.applied["ort_fusions"]`` says
            ``"<name> x<count>"``); the registry entry is ``hfexport_onnx.fusions.fuse_<name>``.
        ops: the ops it produces (the registry entry's targets).
        description: one line for ``hfexport patches``.
        rewrites: what runs, in order, each ``rewrite(model: onnx_ir.Model, **kwargs) -> int``
            (rewrites made): a dotted path, imported when the fusion first runs (onnxscript's
            ``ort_fusions`` functions, our :mod:`hfexport_onnx.gqa` and
            :mod:`hfexport_onnx.matmul_packing`), or a function; the counts are summed.
        kwargs: keyword arguments of every rewrite.
        provider: ``None`` for every execution provider (registry key ``"onnx"``), else ``"cpu"``
            or ``"cuda"`` (``"onnx.cpu"`` ...; those run after every ``"onnx"`` row).
        dtypes: the graph compute dtypes it runs for (``None``: all); for another it counts 0
            (the op has no kernel for it on the provider).
        requires_op: it counts 0 unless the graph has a node of this op type (it rewrites one).
        then: a pass run on the model after the rewrites (``cos_sin_cache``: common
            subexpression elimination of the caches it made).
        issue: the upstream issue the integration follows; ``None`` for our own optimizations,
            which no upstream fix will replace.
    """

    name: str
    ops: tuple[str, ...]
    description: str
    rewrites: tuple[str | Callable[..., int], ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    provider: str | None = None
    dtypes: tuple[str, ...] | None = None
    requires_op: str | None = None
    then: Callable[[Any], None] | None = None
    issue: str | None = _ISSUE


def _eliminate_common_subexpressions(model: Any) -> None:
    import onnx_ir.passes.common as common_passes

    common_passes.CommonSubexpressionEliminationPass()(model)


def _fused_matmul_rules(model: Any) -> int:
    """onnxscript's ORT pattern rules (Transpose/scale around MatMul -> ``FusedMatMul``, softmax,
    group norm); returns the ``FusedMatMul`` nodes they added."""
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import _core

    optimize(model)  # inline the SDPA functions no attention fusion consumed before matching MatMuls
    before = collections.Counter(n.op_type for n in model.graph.all_nodes())
    rewrite(model, _core.ORT_PATTERN_REWRITE_RULES)
    after = collections.Counter(n.op_type for n in model.graph.all_nodes())
    return max(after["FusedMatMul"] - before["FusedMatMul"], 0)


_PACKING = (
    "MatMuls of one input with constant weights (llama gate/up projections) -> one MatMul over the "
    "concatenated weights + Split: same bytes read, fewer kernels per decode step (our rewrite: "
    "hfexport_onnx.matmul_packing)"
)
_ATTENTION = "Q/K/V projections + MultiHeadAttention -> com.microsoft.Attention (packed QKV weights"

#: The ORT fusions, in the order they run: normalizations and rotary embeddings, then the attention
#: chain (``sdpa`` marks scaled-dot-product-attention subgraphs that ``gqa`` / ``mha*`` /
#: ``attention`` consume), the activations, the MatMul rules, then the provider-specific rows.
#: Each row is registered as one registry entry of kind :data:`KIND` (see :func:`register_ort_fusion`).
ORT_FUSIONS: tuple[OrtFusion, ...] = (
    # -- normalizations
    OrtFusion(
        "erf_gelu",
        ("com.microsoft.Gelu",),
        "Erf-based GELU subgraph -> com.microsoft.Gelu (onnxscript fuse_erfgelu)",
        (f"{_UP}.erfgelu.fuse_erfgelu",),
    ),
    OrtFusion(
        "rms_normalization",
        ("SimplifiedLayerNormalization",),
        "RMS normalization subgraph -> SimplifiedLayerNormalization (onnxscript fuse_rms_normalization)",
        (f"{_UP}.rms_normalization.fuse_rms_normalization",),
    ),
    OrtFusion(
        "skip_rms_normalization",
        ("com.microsoft.SkipSimplifiedLayerNormalization",),
        "residual Add + SimplifiedLayerNormalization -> com.microsoft.SkipSimplifiedLayerNormalization",
        (f"{_UP}.skip_normalization.fuse_skip_rms_normalization",),
    ),
    # -- rotary embeddings
    OrtFusion(
        "rotary_embedding",
        ("com.microsoft.RotaryEmbedding",),
        "rotate-half rotary embedding subgraph -> com.microsoft.RotaryEmbedding",
        (f"{_UP}.rotary_embedding.fuse_rotary_embedding",),
    ),
    OrtFusion(
        "cos_sin_cache",
        ("com.microsoft.RotaryEmbedding",),
        "cos/sin computed from position ids -> a precomputed cos/sin cache input of RotaryEmbedding",
        (f"{_UP}.cos_sin_cache.fuse_cos_sin_cache",),
        then=_eliminate_common_subexpressions,
    ),
    OrtFusion(
        "partial_rotary_embedding",
        ("com.microsoft.RotaryEmbedding",),
        "rotary embedding over part of the head dimension -> RotaryEmbedding on a slice",
        (f"{_UP}.rotary_embedding.fuse_partial_rotary_embedding",),
    ),
    # -- attention
    OrtFusion(
        "sdpa",
        ("SDPA (intermediate)",),
        "mark scaled-dot-product attention subgraphs for the attention fusions (inlined back if unused)",
        (f"{_UP}.sdpa.fuse_sdpa",),
        kwargs={"apply_shape_inference": True},
    ),
    OrtFusion(
        "cached_gqa",
        ("com.microsoft.GroupQueryAttention",),
        "SDPA over Concat(past, new) KV caches, repeat_kv and a rotate-half rotary embedding, as "
        "transformers 5 graphs have them (positions * inv_freq, boolean mask via GatherND) -> "
        "com.microsoft.GroupQueryAttention with packed QKV, the rotary inside (do_rotary, cos/sin from "
        "inv_freq, position_ids), seqlens_k/total length from the shapes and the mask as attention_bias "
        "(our rewrite: hfexport_onnx.gqa)",
        ("hfexport_onnx.gqa.fuse_cached_gqa",),
        kwargs={"rotary": GQA_ROTARY},
        issue="https://github.com/microsoft/onnxscript/pull/2461",  # GatherND-built masks: unmerged
    ),
    OrtFusion(
        "gqa",
        ("com.microsoft.GroupQueryAttention",),
        "SDPA over a concatenated KV cache with grouped heads -> com.microsoft.GroupQueryAttention",
        (f"{_UP}.gqa.fuse_gqa",),
    ),
    OrtFusion(
        "packed_qkv_for_gqa",
        ("com.microsoft.GroupQueryAttention",),
        "GroupQueryAttention on slices of one projection -> GroupQueryAttention with packed QKV",
        (f"{_UP}.gqa_packed_qkv.fuse_qkv_gqa",),
    ),
    OrtFusion(
        "mha",
        ("com.microsoft.MultiHeadAttention",),
        "SDPA with head split/merge reshapes (and an optional cache) -> com.microsoft.MultiHeadAttention",
        (f"{_UP}.mha.fuse_mha1", f"{_UP}.mha.fuse_mha2"),
    ),
    OrtFusion(
        "mha_scale",
        ("com.microsoft.MultiHeadAttention",),
        "query pre-scaling folded into MultiHeadAttention's scale attribute",
        (f"{_UP}.mha_scale.fuse_mha_scale",),
    ),
    OrtFusion(
        "mha_bias",
        ("com.microsoft.MultiHeadAttention",),
        "Q/K/V projection biases moved into MultiHeadAttention's bias input",
        (f"{_UP}.mha_bias.fuse_mha_bias",),
        requires_op=_MHA,
    ),
    # -- activations and MatMuls
    OrtFusion(
        "gelu",
        ("com.microsoft.FastGelu",),
        "tanh-approximated GELU subgraph -> com.microsoft.FastGelu",
        (f"{_UP}.gelu.fuse_gelu",),
    ),
    OrtFusion(
        "bias_gelu",
        ("com.microsoft.BiasGelu",),
        "bias Add + Gelu -> com.microsoft.BiasGelu",
        (f"{_UP}.bias_gelu.fuse_bias_gelu",),
    ),
    OrtFusion(
        "sdpa_via_mha",
        ("com.microsoft.MultiHeadAttention",),
        "remaining SDPA subgraphs (no reshape pattern matched) -> MultiHeadAttention",
        (f"{_UP}.sdpa_via_mha.replace_sdpa_by_mha",),
    ),
    OrtFusion(
        "matmul_rules",
        ("com.microsoft.FusedMatMul",),
        "Transpose/scale around MatMul -> com.microsoft.FusedMatMul; softmax/group-norm pattern rules",
        (_fused_matmul_rules,),
    ),
    # -- provider rows (registry key "onnx.<provider>": after every "onnx" row)
    OrtFusion(
        "attention_cpu",
        ("com.microsoft.Attention",),
        f"{_ATTENTION}); fp32 only on CPU (ORT's CPU Attention kernel is float-only)",
        (f"{_UP}.attention.fuse_attention",),
        provider="cpu",
        dtypes=("float32",),
        requires_op=_MHA,
    ),
    OrtFusion(
        "attention_cuda",
        ("com.microsoft.Attention",),
        f"{_ATTENTION}, fp32/fp16)",
        (f"{_UP}.attention.fuse_attention",),
        provider="cuda",
        requires_op=_MHA,
    ),
    # CUDA only: ORT's CPU SkipLayerNormalization kernel is a scalar loop, 7x slower than Add +
    # LayerNormalization (hfexport_onnx.workarounds.ort_layer_norm); on the CPU the export's
    # ort_kernel_fixes stage keeps the pair out of the session's own fusion instead
    OrtFusion(
        "skip_layer_normalization",
        ("com.microsoft.SkipLayerNormalization",),
        "residual Add + LayerNormalization -> com.microsoft.SkipLayerNormalization (CUDA only: the CPU "
        "kernel is a scalar loop, see hfexport_onnx.workarounds.ort_layer_norm)",
        (f"{_UP}.skip_normalization.fuse_skip_layer_normalization",),
        provider="cuda",
    ),
    # MatMul packing runs after the Attention fusions, which pack Q/K/V their own way; not
    # workarounds (issue=None): ONNX Runtime's own graph optimizers do not pack MatMuls
    OrtFusion(
        "sibling_matmuls_cpu",
        ("MatMul+Split",),
        _PACKING,
        ("hfexport_onnx.matmul_packing.pack_sibling_matmuls",),
        provider="cpu",
        issue=None,
    ),
    OrtFusion(
        "sibling_matmuls_cuda",
        ("MatMul+Split",),
        _PACKING,
        ("hfexport_onnx.matmul_packing.pack_sibling_matmuls",),
        provider="cuda",
        issue=None,
    ),
)


def _resolve(rewrite: str | Callable[..., int]) -> Callable[..., int]:
    if callable(rewrite):
        return rewrite
    module_name, name = rewrite.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), name)


def _entry_function(fusion: OrtFusion) -> Callable[[Any, str], int]:
    """The registry entry's ``fuse(model, dtype) -> int`` for ``fusion`` (named ``fuse_<name>``)."""

    def fuse(model: Any, dtype: str) -> int:
        if fusion.dtypes is not None and dtype not in fusion.dtypes:
            return 0
        if fusion.requires_op is not None and not any(
            n.op_type == fusion.requires_op for n in model.graph.all_nodes()
        ):
            return 0
        count = sum(int(_resolve(rewrite)(model, **fusion.kwargs)) for rewrite in fusion.rewrites)
        if fusion.then is not None:
            fusion.then(model)
        return count

    fuse.__name__ = fuse.__qualname__ = f"fuse_{fusion.name}"
    fuse.__doc__ = fusion.description
    return fuse


for _fusion in ORT_FUSIONS:  # one registry entry per row, in table order
    globals()[f"fuse_{_fusion.name}"] = register_ort_fusion(
        *_fusion.ops, provider=_fusion.provider, description=_fusion.description, issue=_fusion.issue
    )(_entry_function(_fusion))
del _fusion
