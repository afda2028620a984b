"""Quantized ExecuTorch programs: the ``ExecutorchConfig.quantization`` methods.

Two families, applied at different points of the export (each method's ``phase`` and ``apply`` in
:data:`METHODS`; the base exporter's shared capture step,
:meth:`hfexport.exporter.HfExporter.captured_program`, runs them):

- **source transforms** (``8da4w``, ``4w``, ``8w`` and ``embedding_bits``): on a **copy** of the
  model before capture (:func:`quantize_copy`), ``4w`` / ``8w`` swap each ``nn.Linear`` for a
  :class:`~hfexport_executorch.weight_only.WeightOnlyLinear` (run by the quantized kernels'
  ``mixed_linear``, not delegated); for the others torchao's ``quantize_`` replaces the weights of
  ``nn.Linear`` / ``nn.Embedding`` modules with quantized tensor subclasses; the captured graph then holds
  ``torchao.dequantize_affine`` (and, for ``8da4w``, per-token dynamic activation quantization)
  around each linear, which the XNNPACK partitioner recognises and lowers to its quantized kernels
  (4-bit blockwise weights with int8 dynamic activations: ``qp8_f32_qb4w`` GEMMs);
- **PT2E** (``int8-dynamic``): the captured program is annotated by ExecuTorch's
  ``XNNPACKQuantizer`` (symmetric, dynamic per-token activations, per-channel int8 weights),
  observed on calibration inputs, converted and captured again (:func:`pt2e_quantize`).

Transformers' GPT-2 family computes its projections with ``transformers.pytorch_utils.Conv1D`` (an
``addmm`` over a ``[in, out]`` weight) instead of ``nn.Linear``; :func:`conv1d_as_linear` turns
them into equivalent ``nn.Linear`` modules on the copy (:func:`hfexport.linear_forms.conv1d_as_linear`)
so they are quantized too.

The user's model is never modified: every transform runs on ``copy.deepcopy(model)``.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hfexport.config import QuantizationMethod
from hfexport.linear_forms import conv1d_as_linear, matches_any
from hfexport.quantization import QuantizationRequest, QuantizationResult

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "METHODS",
    "SCALE_CHOICES",
    "SOURCE_TRANSFORM_METHODS",
    "WEIGHT_ONLY_METHODS",
    "mse_group_scales",
    "pt2e_quantize",
    "quantize_copy",
    "quantize_program_pt2e",
    "quantize_source",
    "quantized_op_counts",
]

logger = logging.getLogger(__name__)

#: Method name -> what it does and the ``QuantizationConfig`` options it reads
#: (``ExecutorchExporter.quantization_methods``; any other option is refused before capture).
#: ``embedding_bits`` combines with either method: the embeddings are quantized on a copy
#: (:func:`quantize_copy`), 4-bit in groups of ``group_size``, and ``exclude`` keeps named ones float;
#: ``int8-dynamic`` quantizes every linear (PT2E, one global config) and calibrates on the sample
#: inputs only (dynamic activations need no ranges), so it reads neither ``exclude`` for linears nor
#: ``calibration``.
_SOURCE = "hfexport_executorch.quantize:quantize_source"
METHODS: dict[str, QuantizationMethod] = {
    "8da4w": QuantizationMethod(
        "8-bit dynamic per-token activations and 4-bit grouped weights (torchao), XNNPACK kernels",
        options=frozenset({"group_size", "exclude", "embedding_bits"}),
        phase="source",
        apply=_SOURCE,
    ),
    "int8-dynamic": QuantizationMethod(
        "PT2E with ExecuTorch's XNNPACKQuantizer: 8-bit dynamic activations, int8 per-channel weights",
        options=frozenset({"per_channel", "embedding_bits"}),
        options_if={"group_size": ("embedding_bits", 4), "exclude": ("embedding_bits", None)},
        phase="program",
        apply="hfexport_executorch.quantize:quantize_program_pt2e",
        prepare=_SOURCE,
        stage="quantize_pt2e",
    ),
    "4w": QuantizationMethod(
        "4-bit grouped symmetric weights (scales searched for the least squared error, LM head 8-bit "
        "per row), float activations; runs on the quantized kernels' mixed_linear "
        "(not delegated; values stored one per byte, so about the size of 8w)",
        options=frozenset({"group_size", "exclude", "embedding_bits"}),
        phase="source",
        apply=_SOURCE,
    ),
    "8w": QuantizationMethod(
        "8-bit per-row symmetric weights, float activations; runs on the quantized kernels' mixed_linear "
        "(not delegated)",
        options=frozenset({"exclude", "embedding_bits"}),
        options_if={"group_size": ("embedding_bits", 4)},
        phase="source",
        apply=_SOURCE,
    ),
}
# Why ``4w`` / ``8w`` do not use torchao's weight-only form (``IntxWeightOnlyConfig``, as ExecuTorch's LLM
# export builds them) but :class:`hfexport_executorch.weight_only.WeightOnlyLinear`. Verified with
# executorch 1.4.1 / torchao 0.18 on one ``nn.Linear(64, 32)`` and on IgLM-S: the torchao copy is right
# (IgLM-S ``8w`` eager top-1 0.996 vs fp32) and so is the captured program, but XNNPACK has no weight-only
# GEMM: ``GEMMConfig._detect_precision`` calls a dequantized weight with a float activation
# "static quant", whose activation must come from a dequantize, so the linear is decomposed to
# ``permute + addmm``; the partitioner still takes ``dequantize_affine`` with it, and
# ``OpDequantizeAffine`` skips a non-dynamic per-channel(-group) dequantize (it expects a quantized
# GEMM to consume the weight), so the fp32 ``addmm`` gets the raw integers: the program computes
# ``x @ qdata.T + bias`` (scales dropped; IgLM-S top-1 0.13 / 0.19) and stores them as fp32 (1.02x /
# 1.05x the fp32 size). Off XNNPACK there is no kernel: ``to_executorch`` fails with "Missing out
# variants: {'torchao::dequantize_affine'}", and quant fusion has no weight-only linear pattern
# (only embeddings). No upstream issue names this exactly; the closest is pytorch/executorch#9855.
# ``test_upstream_canary_xnnpack_weight_only_linear_drops_the_weight_scales`` pins it.

#: Weight-only linear methods, run by the quantized kernels' ``mixed_linear`` (not delegated).
WEIGHT_ONLY_METHODS = ("4w", "8w")

#: Methods applied to a copy of the model before capture (torchao ``quantize_`` for 8da4w, our
#: :class:`~hfexport_executorch.weight_only.WeightOnlyLinear` for 4w / 8w).
SOURCE_TRANSFORM_METHODS = ("8da4w", "4w", "8w")

#: Elements per scale of grouped 4-bit weights when ``QuantizationConfig.group_size`` is ``None``
#: (ExecuTorch's LLM export default); 8-bit weights and embeddings take one scale per row instead.
DEFAULT_GROUP_SIZE = 32

# Dequantizing/quantizing operators as they appear in the captured and lowered graphs.
_QUANT_OP_MARKERS = (
    "quantize_affine",
    "dequantize_affine",
    "choose_qparams",
    "quantize_per",
    "dequantize_per",
)


def _granularity(group_size: int | None) -> Any:
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group_size is None else PerGroup(group_size)


#: How ``8da4w`` chooses the positive 4-bit scale of each group (``quantize_copy(..., scales=)``):
#: ``"mse"`` (default) searches candidates for the least squared reconstruction error
#: (:func:`mse_group_scales`); ``"hqq_scale_only"`` is torchao's half-quadratic scale fit (our choice
#: before, and ExecuTorch ``export_llm``'s ``use_hqq=True``). Measured on SmolLM2-135M-Instruct real
#: weights, eager copy with the 8-bit head, text metrics vs fp32 (perplexity ratio / KL / top-1):
#: hqq 1.261 / 0.305 / 0.696 (misses the 4-bit gate 1.25), mse: docs/backends/executorch.md.
SCALE_CHOICES = ("mse", "hqq_scale_only")

# candidate scales of the search: amax * shrink / divisor per group (amax / 7 included, so the
# result is never worse than plain symmetric rounding to [-7, 7])
_MSE_SHRINKS = tuple(1.0 - 0.02 * k for k in range(21))  # 1.0, 0.98, ..., 0.60
_MSE_DIVISORS = (7.0, 7.5, 8.0)


def mse_group_scales(
    weight: torch.Tensor, group_size: int, *, bits: int = 4, scale_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Positive symmetric scales (zero point 0) of ``weight`` in groups of ``group_size`` along the
    input dimension, each chosen for the least squared reconstruction error.

    For each group of ``group_size`` consecutive input elements of a row, the candidates are
    ``amax * f / d`` for ``f`` in 1.0, 0.98, ..., 0.60 and ``d`` in 7, 7.5, 8 (scaled to ``bits``:
    ``d * 2**(bits-1) / 8``), where ``amax`` is the group's largest magnitude; each candidate is
    rounded to ``scale_dtype`` first (the dtype the program stores the scales in: bfloat16 for
    ``8da4w``, as XNNPACK stores block scales; the activation dtype for ``4w``, as ``mixed_linear``
    reads them; so the error scored is the one the runtime computes), values are rounded to
    ``[-2**(bits-1), 2**(bits-1) - 1]``, and the candidate with the smallest sum of squared errors
    wins (the first on ties, so ``amax / 7`` when nothing beats it). Shrinking clips a few outliers
    to place the grid finer for the rest of the group. The search is vectorised over all groups
    (one pass per candidate, 63 in all). Scales are positive: XNNPACK refuses a negative block scale
    at load.

    Args:
        weight: float ``[out_features, in_features]``, ``in_features`` a multiple of ``group_size``.
        group_size: elements per scale (e.g. 32).
        bits: weight bits, 2 to 8 (4 for ``8da4w`` and ``4w``).
        scale_dtype: each candidate is rounded to this float dtype before it is scored.

    Returns:
        float32 ``[out_features, in_features // group_size]`` scales, all > 0 (an all-zero group
        gets a tiny positive scale and quantizes to 0).

    Raises:
        ValueError: ``weight`` is not 2-D float, ``in_features`` is not a multiple of
            ``group_size``, or ``bits`` is outside 2..8.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"mse_group_scales needs a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    if group_size <= 0 or weight.shape[1] % group_size:
        raise ValueError(
            f"in_features {weight.shape[1]} is not a multiple of group_size {group_size}: "
            "choose a group size that divides it or exclude the module"
        )
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be 2..8, got {bits}")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    unit = 2 ** (bits - 1) / 8.0
    x = weight.detach().float().reshape(weight.shape[0], -1, group_size)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-8)
    best_scale = torch.empty_like(amax)
    best_err = torch.full_like(amax, float("inf"))
    error = torch.empty_like(x)  # one buffer, in-place ops: ~5x faster than fresh tensors per candidate
    for shrink in _MSE_SHRINKS:
        for divisor in _MSE_DIVISORS:
            scale = (amax * (shrink / (divisor * unit))).to(scale_dtype).float()
            torch.div(x, scale, out=error)
            error.round_().clamp_(qmin, qmax).mul_(scale).sub_(x).square_()
            err = error.sum(-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
    return best_scale.squeeze(-1)


def _mse_8da4w(module: torch.nn.Module, group_size: int) -> None:
    """Replace ``module.weight`` (an ``nn.Linear`` of the copy) with torchao's 8da4w tensor built
    from :func:`mse_group_scales` (4-bit groups, zero point 0, int8 asymmetric per-token dynamic
    activations): the same subclass ``Int8DynamicActivationIntxWeightConfig`` produces, so capture and
    the XNNPACK lowering see the usual ``dequantize_affine`` pattern."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor,
    )

    weight = module.weight.detach()
    scale = mse_group_scales(weight, group_size).to(weight.dtype)
    quantized = IntxUnpackedToInt8Tensor.from_hp(
        weight,
        (1, group_size),
        torch.int4,
        activation_quantization="int8_asym_per_token",
        intx_choose_qparams_algorithm=None,
        custom_scale=scale,
        custom_zero_point=torch.zeros_like(scale, dtype=torch.int8),
    )
    module.weight = torch.nn.Parameter(quantized, requires_grad=False)


def _linear_config(method: str, group_size: int) -> Any:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    # "hqq_scale_only" chooses the 4-bit scales by half-quadratic optimisation: on the real GPT-2
    # (IgLM-S) it lifts the worst per-token cosine of 8da4w logits from 0.953 to 0.980 at the same size
    if method == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4,
            weight_granularity=_granularity(group_size),
            intx_choose_qparams_algorithm="hqq_scale_only",
        )
    raise ValueError(f"quantization method {method!r} is not a torchao linear transform; allowed: '8da4w'")


def _head_config() -> Any:
    """8-bit per-channel weights with 8-bit dynamic per-token activations (``8da8w``): the LM head
    of an ``8da4w`` copy (see :func:`lm_heads`); XNNPACK runs it as a ``qd8_f32_qc8w`` GEMM."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int8, weight_granularity=_granularity(None)
    )


def lm_heads(model: torch.nn.Module) -> list[str]:
    """Qualified names of the language-model heads in ``model``: the ``nn.Linear`` each
    ``PreTrainedModel`` inside it returns from ``get_output_embeddings()`` (``lm_head`` of a causal
    LM, ``model.lm_head`` under the ``llm-runner`` layout's ``RunnerProgram``); ``[]`` when there is none.

    ``8da4w`` and ``4w`` keep these at 8 bits (:data:`HEAD_BITS`): the head's rounding error goes straight
    into the logits over the whole vocabulary, and a head tied to the input embedding cannot share
    the 4-bit copy anyway (the embedding stays float unless ``embedding_bits`` is set).
    """
    names = {id(module): name for name, module in model.named_modules()}
    found = []
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if not callable(getter):
            continue
        try:
            head = getter()
        except (AttributeError, NotImplementedError, TypeError):  # a base model without a head
            continue
        if type(head) is torch.nn.Linear and id(head) in names and names[id(head)] not in found:
            found.append(names[id(head)])
    return found


#: Weight bits of the LM head (:func:`lm_heads`) in an ``8da4w`` copy. Measured on
#: SmolLM2-135M-Instruct real weights (tied 49152 x 576 head), eager torchao copy, text metrics over
#: the quality passage against fp32 (perplexity ratio / KL / top-1): every linear 4-bit (hqq scales,
#: group 32, ExecuTorch ``export_llm``'s recipe) 1.410 / 0.424 / 0.622, which misses the 4-bit text
#: gates; the head at 8 bits (8da8w, per channel) and the rest as before: see docs/backends/executorch.md.
HEAD_BITS = 8


def _embedding_config(bits: int, group_size: int) -> Any:
    from torchao.quantization import IntxWeightOnlyConfig

    if bits == 4:
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=_granularity(group_size))
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=_granularity(None))


def quantize_copy(
    model: torch.nn.Module, quantization: Any, *, scales: str = "mse"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A quantized deep copy of ``model`` for the source-transform methods and ``embedding_bits``.

    Args:
        model: the model being exported (fp32 or the capture dtype); left exactly as it was.
        quantization: a :class:`hfexport.config.QuantizationConfig`. ``method`` in
            :data:`SOURCE_TRANSFORM_METHODS` quantizes every ``nn.Linear`` (and GPT-2 ``Conv1D``,
            turned into ``nn.Linear`` first); ``embedding_bits`` (4 or 8) quantizes every
            ``nn.Embedding`` weight-only (4-bit in groups of ``group_size``, 8-bit one scale per row);
            modules whose qualified name matches an ``exclude`` pattern stay float. A linear whose
            ``in_features`` is not a multiple of the group size (or an embedding whose dim is not)
            stays float too, and is listed under ``"skipped"``.
        scales: how ``8da4w`` picks its 4-bit body scales, one of :data:`SCALE_CHOICES` (``"mse"``:
            :func:`mse_group_scales`; ``"hqq_scale_only"``: torchao's). Other methods ignore it.

    Returns:
        ``(copy, summary)``: the quantized copy and ``{"method", "group_size", "linear": int,
        "embedding": int, "conv1d_as_linear": int, "excluded": [names], "skipped": {name: reason}}``
        (counts of quantized modules); ``8da4w`` and ``4w`` add ``"scales"``, ``"head"`` and
        ``"head_bits"`` (``4w`` always searches its scales, :func:`mse_group_scales`).

    Raises:
        ValueError: ``scales`` is not one of :data:`SCALE_CHOICES`.
    """
    if scales not in SCALE_CHOICES:
        raise ValueError(f"scales={scales!r} is not a known 8da4w scale choice; allowed: {SCALE_CHOICES}")
    from torchao.quantization import quantize_

    method = quantization.method
    group_size = quantization.group_size or DEFAULT_GROUP_SIZE
    quantized = copy.deepcopy(model)
    summary: dict[str, Any] = {
        "method": method,
        "group_size": group_size if method in ("8da4w", "4w") else None,
        "linear": 0,
        "embedding": 0,
        "conv1d_as_linear": 0,
        "excluded": [],
        "skipped": {},
    }
    exclude = tuple(quantization.exclude)
    linear_method = method if method in SOURCE_TRANSFORM_METHODS else None
    if linear_method is not None:
        summary["conv1d_as_linear"] = len(conv1d_as_linear(quantized))

    def wants(kind: type, grouped: bool) -> Any:
        def filter_fn(module: torch.nn.Module, fqn: str) -> bool:
            if type(module) is not kind:
                return False
            if matches_any(fqn, exclude):
                summary["excluded"].append(fqn)
                return False
            width = module.weight.shape[-1]
            if grouped and width % group_size:
                summary["skipped"][fqn] = f"input width {width} is not a multiple of group_size {group_size}"
                return False
            summary["linear" if kind is torch.nn.Linear else "embedding"] += 1
            return True

        return filter_fn

    bits = quantization.embedding_bits
    if bits is not None:
        # embeddings first: a linear tied to an embedding (lm_head) is quantized on its own below
        quantize_(
            quantized, _embedding_config(bits, group_size), filter_fn=wants(torch.nn.Embedding, bits == 4)
        )
    if linear_method in WEIGHT_ONLY_METHODS:
        heads = lm_heads(quantized) if linear_method == "4w" else []
        kept = _replace_weight_only(
            quantized,
            linear_method,
            group_size,
            wants(torch.nn.Linear, linear_method == "4w"),
            heads=heads,
            wanted_head=wants(torch.nn.Linear, False),
        )
        if linear_method == "4w":
            summary.update(scales="mse", head=kept, head_bits=HEAD_BITS if kept else None)
    elif linear_method is not None:
        if linear_method == "8da4w":
            # the LM head at 8 bits (HEAD_BITS): 8-bit weights need no group, so any width is taken
            heads = set(lm_heads(quantized))
            summary["head_bits"] = HEAD_BITS if heads else None
            summary["head"] = []
            take = wants(torch.nn.Linear, False)

            def head_filter(module: torch.nn.Module, fqn: str) -> bool:
                if fqn not in heads or not take(module, fqn):
                    return False
                summary["head"].append(fqn)
                return True

            quantize_(quantized, _head_config(), filter_fn=head_filter)
            body = wants(torch.nn.Linear, True)
            summary["scales"] = scales
            if scales == "mse":
                targets = [m for name, m in quantized.named_modules() if name not in heads and body(m, name)]
                for module in targets:
                    _mse_8da4w(module, group_size)
            else:
                quantize_(
                    quantized,
                    _linear_config(linear_method, group_size),
                    filter_fn=lambda module, fqn: fqn not in heads and body(module, fqn),
                )
        else:
            quantize_(
                quantized, _linear_config(linear_method, group_size), filter_fn=wants(torch.nn.Linear, True)
            )
    if linear_method in ("8da4w", "4w"):
        _refuse_a_group_size_no_linear_takes(quantized, summary, group_size, method)
    return quantized, summary


#: Group sizes offered when the asked one divides no linear's input width: the sizes torchao's 4-bit
#: groups and XNNPACK's blockwise kernels are used with (ExecuTorch's LLM recipes use 32 to 256)
SUGGESTED_GROUP_SIZES = (16, 32, 64, 128, 256)


def _refuse_a_group_size_no_linear_takes(
    copy_: torch.nn.Module, summary: dict[str, Any], group_size: int, method: str
) -> None:
    """Raise when ``group_size`` left every grouped linear of the copy float (each input width is not a
    multiple of it): the artifact would be a float program labelled ``method``.

    Raises:
        ValueError: no linear was quantized in groups and at least one was skipped for its width; the
            message names the widths and the group sizes of :data:`SUGGESTED_GROUP_SIZES` that divide all.
    """
    skipped = summary["skipped"]
    grouped = summary["linear"] - len(summary.get("head") or [])
    if grouped > 0 or not skipped:
        return
    widths = sorted({int(copy_.get_submodule(fqn).weight.shape[-1]) for fqn in skipped})
    fits = [g for g in SUGGESTED_GROUP_SIZES if all(w % g == 0 for w in widths)]
    allowed = ", ".join(map(str, fits)) if fits else f"a divisor of {math.gcd(*widths)}"
    raise ValueError(
        f"quantization.group_size={group_size} divides none of the model's linear input widths "
        f"({', '.join(map(str, widths))}): {method} would leave every linear float; allowed here: {allowed}"
    )


def _replace_weight_only(
    model: torch.nn.Module,
    method: str,
    group_size: int,
    wanted: Any,
    heads: Iterable[str] = (),
    wanted_head: Any = None,
) -> list[str]:
    """Swap every wanted ``nn.Linear`` of ``model`` (in place: ``model`` is the copy) for a
    :class:`hfexport_executorch.weight_only.WeightOnlyLinear`: ``8w`` 8-bit per row; ``4w`` 4-bit per
    group with the least-squared-error scales of :func:`mse_group_scales` (rounded to the linear's
    dtype, which ``mixed_linear`` reads them in), except the linears named in ``heads`` (the LM heads,
    :func:`lm_heads`) that ``wanted_head`` takes: 8 bits per row (:data:`HEAD_BITS`), as ``8da4w``
    keeps them. Returns the names of the heads kept at 8 bits.

    Measured on SmolLM2-135M-Instruct real weights (eager copy, text metrics vs fp32: perplexity
    ratio / KL / top-1): ``amax / 7`` scales with a 4-bit head 1.404 / 0.441 / 0.585, which misses the
    4-bit text gates (1.25 / 0.35 / 0.65); docs/backends/executorch.md has the variants.
    """
    from hfexport_executorch.weight_only import WeightOnlyLinear, ensure_mixed_linear

    ensure_mixed_linear()
    heads = set(heads)
    targets = []
    for name, module in list(model.named_modules()):
        if name in heads:
            if wanted_head is not None and wanted_head(module, name):
                targets.append((name, module, True))
        elif wanted(module, name):
            targets.append((name, module, False))
    kept = []
    for name, module, is_head in targets:
        if is_head:
            replacement = WeightOnlyLinear(module, HEAD_BITS)
            kept.append(name)
        elif method == "4w":
            weight = module.weight.detach()
            scales = mse_group_scales(weight, group_size, scale_dtype=weight.dtype)
            replacement = WeightOnlyLinear(module, 4, group_size, scales=scales)
        else:
            replacement = WeightOnlyLinear(module, 8)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
    return kept


def quantize_source(request: QuantizationRequest) -> QuantizationResult:
    """The ``source`` phase of every method: ``8da4w`` / ``4w`` / ``8w`` and ``embedding_bits`` get
    the quantized copy of :func:`quantize_copy`; ``int8-dynamic`` (whose own phase is ``program``,
    :func:`quantize_program_pt2e`) gets a copy with GPT-2's ``Conv1D`` as ``nn.Linear`` when the
    model has one (``XNNPACKQuantizer`` annotates ``aten.linear`` only: an ``addmm`` would stay
    float), else the model itself.

    Args:
        request: ``target`` the eager model (left as it was), ``quantization`` the config.

    Returns:
        The module to capture; facts as :func:`quantize_copy`'s summary plus ``embedding_bits``
        (and ``per_channel`` for ``int8-dynamic``).
    """
    quantization, model = request.quantization, request.target
    facts: dict[str, Any] = {"method": quantization.method}
    detail = ""
    if quantization.method in SOURCE_TRANSFORM_METHODS or quantization.embedding_bits is not None:
        model, applied = quantize_copy(model, quantization)
        facts.update(applied, embedding_bits=quantization.embedding_bits)
        detail = (
            f"{quantization.method}: {applied['linear']} linear, {applied['embedding']} embedding module(s)"
        )
    elif any(type(m).__name__ == "Conv1D" for m in model.modules()):
        model = copy.deepcopy(model)
        facts["conv1d_as_linear"] = len(conv1d_as_linear(model))
    if quantization.method == "int8-dynamic":
        facts["per_channel"] = quantization.per_channel
    return QuantizationResult(model, facts, detail)


def quantize_program_pt2e(request: QuantizationRequest) -> QuantizationResult:
    """The ``program`` phase of ``int8-dynamic`` (stage ``quantize_pt2e``): :func:`pt2e_quantize` on
    the captured program, calibrated on the capture inputs, then captured again (``request.capture``,
    the exporter's capture with its dynamic-shape fallback).

    Raises:
        ValueError: called outside the capture step (``request.capture`` is ``None``).
    """
    if request.capture is None:
        raise ValueError("quantize_program_pt2e needs request.capture (the program phase of an export)")
    converted = pt2e_quantize(request.target, [request.inputs], per_channel=request.quantization.per_channel)
    return QuantizationResult(request.capture(converted), {}, "XNNPACKQuantizer, dynamic activations")


def pt2e_quantize(
    program: torch.export.ExportedProgram,
    calibration: Iterable[Mapping[str, Any]],
    *,
    per_channel: bool = True,
) -> torch.fx.GraphModule:
    """Quantize a captured program with ExecuTorch's ``XNNPACKQuantizer`` (``int8-dynamic``).

    Args:
        program: the captured ``ExportedProgram`` (its ``module()`` is annotated, not the user's model).
        calibration: forward-kwarg dicts run through the observed module (dynamic activations need
            one pass only to settle the weight observers).
        per_channel: int8 weights with one scale per output channel (True) or per tensor.

    Returns:
        The converted ``GraphModule`` (takes the same forward kwargs); capture it again for lowering.
    """
    from executorch.backends.transforms.duplicate_dynamic_quant_chain import DuplicateDynamicQuantChainPass
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer()
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=True))
    module = program.module()
    _integer_scalar_overloads(module)
    prepared = prepare_pt2e(module, quantizer)
    from hfexport.inputs.flags import fill_output_flags, program_output_flags

    flags = program_output_flags(program)  # constant inputs of a component's program (issue 26)
    with torch.no_grad():
        for batch in calibration:
            prepared(**fill_output_flags(batch, flags))
    converted = convert_pt2e(prepared)
    # one dynamic quantize chain per consumer, so each linear's pattern is self-contained for XNNPACK
    DuplicateDynamicQuantChainPass()(converted)
    return converted


def _integer_scalar_overloads(module: torch.fx.GraphModule) -> int:
    """Rewrite ``aten.add.Tensor`` / ``aten.mul.Tensor`` on an integer tensor and a Python scalar to
    their ``.Scalar`` overloads (same result), in place; returns how many nodes changed.

    Workaround for pytorch/executorch#22062 (executorch <= 1.4.1, fixed by pytorch/executorch#22065):
    ``XNNPACKQuantizer.transform_for_annotation`` lifts every scalar operand of ``add.Tensor`` /
    ``mul.Tensor`` into a **float32** buffer, so ``arange(n) + 0`` (a GPT-2 position id) becomes a
    float tensor and the next ``embedding`` fails (``indices ... got torch.FloatTensor``). The quantizer
    only visits the ``.Tensor`` overloads, so integer arithmetic in ``.Scalar`` form is left alone.
    """
    overloads = {
        torch.ops.aten.add.Tensor: torch.ops.aten.add.Scalar,
        torch.ops.aten.mul.Tensor: torch.ops.aten.mul.Scalar,
    }
    changed = 0
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target not in overloads or node.kwargs:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex:
            continue
        if (
            len(node.args) == 2
            and isinstance(node.args[0], torch.fx.Node)
            and isinstance(node.args[1], (int, bool))
        ):
            node.target = overloads[node.target]
            changed += 1
    if changed:
        module.recompile()
    return changed


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    return str(getattr(target, "__name__", None) or target)


def quantized_op_counts(edge: Any, method: str = "forward") -> dict[str, Any]:
    """Count quantized computations in a lowered edge program.

    Args:
        edge: the ``EdgeProgramManager`` after ``to_edge_transform_and_lower``.
        method: the program method.

    Returns:
        ``{"delegated_quantized_linear": int, "portable_quantized_linear": int,
        "quantized_embedding": int, "delegated_quant_ops": {op: count}, "portable_quant_ops": {op: count}}``:
        a linear (``aten.linear`` / ``addmm`` / ``mm``) or embedding counts as quantized when its weight
        comes from a dequantize node, and every ``quantized_decomposed.mixed_linear`` (``4w`` / ``8w``)
        is one; ``*_quant_ops`` count the (de)quantize / choose-qparams nodes.
    """
    gm = edge.exported_program(method).graph_module
    counts = {
        "delegated_quantized_linear": 0,
        "portable_quantized_linear": 0,
        "quantized_embedding": 0,
    }
    quant_ops: dict[str, collections.Counter[str]] = {
        "delegated": collections.Counter(),
        "portable": collections.Counter(),
    }

    def visit(graph: torch.fx.Graph, where: str) -> None:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            name = _target_name(node)
            if "mixed_linear" in name:  # 4w / 8w: the weight-only linear kernel itself
                counts[f"{where}_quantized_linear"] += 1
                continue
            if any(marker in name for marker in _QUANT_OP_MARKERS):
                quant_ops[where][name] += 1
                continue
            base = name.split(".")[-2] if name.count(".") else name
            weight_index = {"linear": 1, "addmm": 2, "mm": 1, "embedding": 0}.get(base)
            if weight_index is None or len(node.args) <= weight_index:
                continue
            weight = node.args[weight_index]
            # addmm/mm take the transposed weight: look through one permute/transpose
            if isinstance(weight, torch.fx.Node) and any(
                t in _target_name(weight) for t in ("permute", "transpose", "t_copy", ".t.")
            ):
                weight = weight.args[0]
            if isinstance(weight, torch.fx.Node) and "dequantize" in _target_name(weight):
                if base == "embedding":
                    counts["quantized_embedding"] += 1
                else:
                    counts[f"{where}_quantized_linear"] += 1

    for node in gm.graph.nodes:
        if node.op == "call_function" and _target_name(node) == "executorch_call_delegate":
            lowered = getattr(gm, node.args[0].target)
            original = getattr(lowered, "original_module", None)
            if original is not None:
                visit(original.graph, "delegated")
    visit(gm.graph, "portable")
    counts["delegated_quant_ops"] = dict(quant_ops["delegated"].most_common())
    counts["portable_quant_ops"] = dict(quant_ops["portable"].most_common())
    return counts
