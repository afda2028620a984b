"""Quality gates: how close a reduced-precision or quantized artifact stays to the fp32 eager model.

``allclose`` is the wrong test for an fp16 or int8 artifact: its outputs are *meant* to differ
from fp32. Instead each output is scored against the fp32 eager model and the export fails when a
score falls below its gate:

- ``cosine``: for every float output, the cosine similarity of each vector along the last axis
  (one per token for ``[batch, seq, hidden]``, one per sample for ``[batch, hidden]``, one per
  cached position for ``[batch, heads, seq, head_dim]``; the whole tensor for 0-D/1-D outputs),
  padded positions (``attention_mask == 0``) excluded, **averaged** over the vectors. Gated.
- ``cosine_min``: the smallest of those per-vector cosines (recorded; gated only when set).
- ``top1_agreement``: for token logits (an output whose last path part is ``logits`` with three
  axes ``[batch, seq, classes]``: causal and masked LMs, token classifiers), the fraction of
  non-padded positions whose arg-max class equals the eager model's. Gated when the output has
  enough positions that one changed arg-max cannot miss the gate on its own (at least
  ``1 / (1 - gate)`` positions: 10 for 0.9, 50 for 0.98); over fewer (a decode step's single token,
  :func:`top1_gate_applies`) it is recorded, not gated, and ``cosine`` still is.
- ``max_abs_diff``: ``max |artifact - eager|`` (recorded; gated, as an upper bound, only when set).

Integer outputs must equal the eager model's exactly.

KV-cache outputs of a language model (an output set with token ``logits``; cache paths
``cache.*``, ``past_key_values.*``, ``present*``) are gated at ``cosine >=``
:data:`CACHE_COSINE_GATE` (0.9, or the ``cosine`` gate if that is lower; the ``cache_cosine`` gate
when given, by default :data:`CACHE_COSINE_GATE_4BIT` for 4-bit methods): the model is gated on
its logits (top-1 and cosine), which is what a user of the cache sees one step later; the cache
tensors themselves only have to stay recognisably the same vectors (a broken cache scores near 0).
4-bit weights perturb every key/value vector (measured: mean cosine 0.95 on the real GPT-2 IgLM-S
under ExecuTorch ``8da4w``, logits top-1 1.0), which the 0.98 output gate would refuse.

Default gates (:func:`default_quality_gates`): ``cosine >= 0.99`` for fp16/bf16 and 8-bit methods,
``>= 0.98`` for 4-bit methods; ``top1_agreement >= 0.98`` for fp16/bf16, ``>= 0.9`` for any
quantization. ``config.quality_gates`` overrides them by metric name.

The language-model metrics on a shipped text (``perplexity_ratio``, ``kl_divergence``,
``top1_agreement_text``) are measured by :mod:`hfexport.verify.text`; their gate tables
(:data:`TEXT_GATES_8BIT`, :data:`TEXT_GATES_4BIT`) and which of them an export is held to
(:func:`text_gates_for`) live here with the other gates.

Backends do not call this module directly: :meth:`hfexport.exporter.HfExporter.validate` runs
:func:`validate_quality` instead of allclose whenever :func:`quality_gates_for` returns gates
(``config.dtype != "float32"`` or ``config.quantization`` set). A backend that validates outside
``HfExporter.validate`` calls :func:`validate_quality` itself.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hfexport.errors import ExportValidationError
from hfexport.precision import is_quality_gated
from hfexport.verify.compare import Runner, eager_outputs

__all__ = [
    "CACHE_COSINE_GATE",
    "CACHE_COSINE_GATE_4BIT",
    "GATED_METRICS",
    "QUALITY_METRICS",
    "TEXT_GATES_4BIT",
    "TEXT_GATES_8BIT",
    "TEXT_METRICS",
    "UPPER_BOUND_METRICS",
    "OutputQuality",
    "default_quality_gates",
    "default_text_gates",
    "describe_gates",
    "format_quality_table",
    "is_four_bit",
    "output_gates",
    "quality_gates_for",
    "score_outputs",
    "text_default_gates",
    "text_gates_for",
    "top1_gate_applies",
    "validate_quality",
]

logger = logging.getLogger(__name__)

#: the language-model metrics measured on :func:`quality_text` (:func:`text_quality`)
TEXT_METRICS = ("perplexity_ratio", "kl_divergence", "top1_agreement_text")
#: every metric name ``config.quality_gates`` may set
QUALITY_METRICS = ("cosine", "cosine_min", "top1_agreement", "max_abs_diff", "cache_cosine", *TEXT_METRICS)
#: metrics gated by default (the others only when ``quality_gates`` names them); the text metrics
#: are gated by default on quantized causal LMs (:func:`text_gates_for`)
GATED_METRICS = ("cosine", "top1_agreement")
#: metrics where lower is better: the gate is an upper bound
UPPER_BOUND_METRICS = ("max_abs_diff", "perplexity_ratio", "kl_divergence")
_UPPER_BOUND = UPPER_BOUND_METRICS

#: default text gates of an 8-bit quantization (SmolLM2-135M real weights at ONNX int8-weight, 8-bit
#: head, score 1.0006 / 0.0044 / 0.961, see docs/backends/onnx.md)
TEXT_GATES_8BIT = {"perplexity_ratio": 1.05, "kl_divergence": 0.05, "top1_agreement_text": 0.9}
#: default text gates of a 4-bit quantization, set from SmolLM2-135M real weights at ONNX
#: int4-weight defaults (block 32, symmetric, accuracy_level 4, 8-bit head): 1.165 / 0.261 / 0.706,
#: with a margin of about 1.2-1.5x the measured loss (perplexity +16.5% -> +25%, KL 0.26 -> 0.35,
#: top-1 disagreement 0.29 -> 0.35); see docs/backends/onnx.md
TEXT_GATES_4BIT = {"perplexity_ratio": 1.25, "kl_divergence": 0.35, "top1_agreement_text": 0.65}

_FOUR_BIT = re.compile(r"(int4|4w|4bit|nf4|uint4)")

#: Cosine gate of the KV-cache outputs of a language model (see the module docstring); the
#: ``cosine`` gate applies instead when it is lower.
CACHE_COSINE_GATE = 0.9
#: Default ``cache_cosine`` gate of a 4-bit method: 4-bit weights perturb the value projections
#: most. Measured on SmolLM2-135M real weights, ONNX ``int4-weight`` (the ORT GenAI builder's
#: recipe), prefill from an empty past: mean cosine 0.70-0.86 on ``present.*.value`` and
#: 0.92-0.97 on the keys, while its text metrics (perplexity ratio 1.165) beat the builder's own
#: int4 (1.30); a broken cache scores near 0.
CACHE_COSINE_GATE_4BIT = 0.5
_CACHE_OUTPUT = re.compile(r"^(cache|past_key_values|present[a-z_]*)(\.|$)")


def is_four_bit(quantization: Any) -> bool:
    """True for a 4-bit quantization: a method name containing ``int4``/``4w``/``4bit``/``nf4``
    (``int4-weight``, ``8da4w``, ``4w``) or ``embedding_bits == 4``."""
    if quantization is None:
        return False
    method = str(getattr(quantization, "method", quantization))
    return bool(_FOUR_BIT.search(method)) or getattr(quantization, "embedding_bits", None) == 4


def default_quality_gates(dtype: str = "float32", quantization: Any = None) -> dict[str, float]:
    """Default thresholds for an export in ``dtype`` with ``quantization`` (a method name, a
    ``QuantizationConfig`` or ``None``).

    Returns:
        ``{"cosine": ..., "top1_agreement": ...}``: fp16/bf16 only: 0.99 / 0.98; an 8-bit method:
        0.99 / 0.9; a 4-bit method (:func:`is_four_bit`): 0.98 / 0.9 and ``cache_cosine``
        :data:`CACHE_COSINE_GATE_4BIT`. With both a reduced dtype and a quantization the
        quantization's (looser) gates apply.
    """
    if quantization is not None:
        if is_four_bit(quantization):
            return {"cosine": 0.98, "top1_agreement": 0.9, "cache_cosine": CACHE_COSINE_GATE_4BIT}
        return {"cosine": 0.99, "top1_agreement": 0.9}
    return {"cosine": 0.99, "top1_agreement": 0.98}


def quality_gates_for(config: Any, reference: str | None = None) -> dict[str, float] | None:
    """The gates an export with ``config`` is validated with, or ``None`` for plain allclose.

    Gated exports are quantized ones (``config.quantization``) and those whose ``config.dtype``
    differs from the dtype of their eager reference: ``reference`` (e.g. ``"bfloat16"`` for a
    bfloat16 program of a bfloat16 model, which is compared by tolerances instead), or
    ``"float32"`` when not given. ``config.quality_gates`` overrides the defaults by metric name and
    may add ``cosine_min`` / ``max_abs_diff``.

    Raises:
        ValueError: ``quality_gates`` names a metric that does not exist (the message lists
            :data:`QUALITY_METRICS`), or a similarity gate outside ``[0, 1]``.
    """
    overrides = dict(getattr(config, "quality_gates", None) or {})
    unknown = sorted(set(overrides) - set(QUALITY_METRICS))
    if unknown:
        raise ValueError(
            f"quality_gates names unknown metric(s) {unknown}; allowed: {', '.join(QUALITY_METRICS)}"
        )
    for name, value in overrides.items():
        if name not in _UPPER_BOUND and not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"quality_gates[{name!r}]={value!r} is invalid; allowed: a float in [0, 1]")
        if name == "perplexity_ratio" and not float(value) >= 1.0:
            raise ValueError(
                f"quality_gates['perplexity_ratio']={value!r} is invalid; allowed: a float >= 1.0 (an upper "
                "bound on artifact perplexity / eager perplexity)"
            )
        if name == "kl_divergence" and not float(value) >= 0.0:
            raise ValueError(
                f"quality_gates['kl_divergence']={value!r} is invalid; allowed: a float >= 0 (an upper "
                "bound on the mean KL divergence in nats)"
            )
    dtype = str(getattr(config, "dtype", None) or "float32")
    quantized = getattr(config, "quantization", None) is not None
    if reference is not None and not quantized and dtype == reference:
        return None
    if not is_quality_gated(config):
        return None
    quantization = getattr(config, "quantization", None)
    gates = default_quality_gates(dtype, quantization)
    gates.update({k: float(v) for k, v in overrides.items()})
    return gates


def output_gates(gates: Mapping[str, float]) -> dict[str, float]:
    """The per-output gates of ``gates`` (everything but :data:`TEXT_METRICS`)."""
    return {k: float(v) for k, v in gates.items() if k not in TEXT_METRICS}


def default_text_gates(quantization: Any) -> dict[str, float]:
    """Default text gates (:data:`TEXT_METRICS`) of a quantization (a method name or a
    ``QuantizationConfig``): :data:`TEXT_GATES_4BIT` for a 4-bit method (:func:`is_four_bit`),
    else :data:`TEXT_GATES_8BIT`."""
    return dict(TEXT_GATES_4BIT if is_four_bit(quantization) else TEXT_GATES_8BIT)


def text_gates_for(config: Any, reference: str | None = None) -> dict[str, float] | None:
    """The text gates an export of a causal LM with ``config`` is held to, or ``None`` when the text
    metrics are not measured.

    Measured for a quantized export (``config.quantization``; defaults :func:`default_text_gates`,
    overridden by name through ``config.quality_gates``) and for any gated export whose
    ``config.quality_gates`` names a text metric (then only the named ones are gated).

    Raises:
        ValueError: as :func:`quality_gates_for` (unknown metric, a threshold out of range).
    """
    gates = quality_gates_for(config, reference=reference)
    if gates is None:
        return None
    named = {
        k: float(v) for k, v in (getattr(config, "quality_gates", None) or {}).items() if k in TEXT_METRICS
    }
    quantization = getattr(config, "quantization", None)
    if quantization is None:
        return named or None
    return {**default_text_gates(quantization), **named}


def text_default_gates(config: Any, gates: Mapping[str, float] | None) -> tuple[str, ...]:
    """The metrics of ``gates`` (:func:`text_gates_for`) that are defaults, i.e. not named in
    ``config.quality_gates``: applied only when the eager model is not at chance on the text."""
    named = set(getattr(config, "quality_gates", None) or {})
    return tuple(sorted(k for k in gates or {} if k not in named))


@dataclass
class OutputQuality:
    """The quality metrics of one output against the fp32 eager model.

    Attributes:
        name: output leaf path (``logits``, ``last_hidden_state`` ...).
        shape / expected_shape: the artifact's and the eager output's shapes.
        dtype: the artifact output's dtype (``torch.float16`` ...).
        cosine: mean per-vector cosine similarity (``None`` for integer outputs).
        cosine_min: smallest per-vector cosine similarity.
        top1_agreement: arg-max agreement over positions (token logits only, else ``None``).
        max_abs_diff: ``max |artifact - eager|`` (``inf`` for a missing output or shape mismatch).
        compared: number of vectors (or elements, for integer outputs) compared.
        gates: the thresholds applied to this output, by metric.
        failures: ``"metric value vs threshold"`` strings for the gates this output misses.
        ok: no gate missed.
    """

    name: str
    shape: tuple[int, ...]
    expected_shape: tuple[int, ...]
    dtype: str
    cosine: float | None
    cosine_min: float | None
    top1_agreement: float | None
    max_abs_diff: float
    compared: int
    gates: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``inf``/``nan`` as strings); has the ``name``/``shape``/``ok`` keys of
        :class:`hfexport.verify.compare.OutputComparison` rows."""
        out = asdict(self)
        out["kind"] = "quality"
        for key in ("cosine", "cosine_min", "top1_agreement", "max_abs_diff"):
            if isinstance(out[key], float) and not math.isfinite(out[key]):
                out[key] = str(out[key])
        return out


def _keep_mask(name: str, expected: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool mask over ``expected.shape[:-1]`` (the vectors) of positions that carry meaning."""
    if attention_mask is None or attention_mask.dim() != 2 or expected.dim() < 3:
        return None
    mask = attention_mask.to(torch.bool)
    if (
        expected.dim() == 4
        and name.rsplit(".", 1)[-1] in ("keys", "values")
        and (expected.shape[0], expected.shape[2]) == tuple(mask.shape)
    ):
        return mask[:, None, :].expand(expected.shape[:3])
    if tuple(expected.shape[:2]) != tuple(mask.shape):
        return None
    keep = mask
    while keep.dim() < expected.dim() - 1:
        keep = keep.unsqueeze(-1)
    return keep.expand(expected.shape[:-1])


#: Elements scored at once by :func:`_vector_scores` (float64 chunks of 32 MB).
_CHUNK = 1 << 22


def _vector_scores(
    expected: torch.Tensor, actual: torch.Tensor, keep: torch.Tensor | None, *, logits: bool
) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """Per-vector cosines (float64, 1-D, the kept vectors), the max abs difference over elements
    where neither side is NaN (``inf`` when the NaN counts differ), and for token logits the per-
    vector arg-max agreement (bool, 1-D; else ``None``).

    Vectors run along the last axis (a 0-D/1-D tensor is one vector); ``keep`` marks the vectors
    that count (``expected.shape[:-1]``). Computed in float64 chunks of about :data:`_CHUNK`
    elements, so a real LM's logits need no whole-tensor float64 copies. An artifact with NaNs
    where eager has none scores cosine 0.
    """
    width = expected.shape[-1] if expected.dim() >= 2 else max(expected.numel(), 1)
    e_rows = expected.reshape(-1, width)
    a_rows = actual.reshape(-1, width)
    k_rows = keep.reshape(-1) if keep is not None else None
    step = max(1, _CHUNK // width)
    cosines: list[torch.Tensor] = []
    agrees: list[torch.Tensor] = []
    max_abs = 0.0
    nan_e = nan_a = 0
    tiny = 1e-12
    for start in range(0, e_rows.shape[0], step):
        e = e_rows[start : start + step].double()
        a = a_rows[start : start + step].double()
        e_nan, a_nan = torch.isnan(e), torch.isnan(a)
        nan_e += int(e_nan.sum())
        nan_a += int(a_nan.sum())
        finite = ~(e_nan | a_nan)
        diff = (a - e).abs()[finite]
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        if k_rows is not None:
            k = k_rows[start : start + step]
            e, a, a_nan_rows = e[k], a[k], a_nan[k].any(-1) & ~e_nan[k].any(-1)
        else:
            a_nan_rows = a_nan.any(-1) & ~e_nan.any(-1)
        if logits:
            agrees.append(e.argmax(-1) == a.argmax(-1))
        e, a = torch.nan_to_num(e), torch.nan_to_num(a)
        dot = (e * a).sum(-1)
        norm_e, norm_a = e.norm(dim=-1), a.norm(dim=-1)
        cos = dot / (norm_e * norm_a).clamp_min(tiny)
        cos = torch.where((norm_e <= tiny) & (norm_a <= tiny), torch.ones_like(cos), cos)
        cosines.append(torch.where(a_nan_rows, torch.zeros_like(cos), cos))
    if nan_e != nan_a:
        max_abs = math.inf
    cos_all = torch.cat(cosines) if cosines else torch.zeros(0, dtype=torch.float64)
    if nan_a and not nan_e:
        cos_all = torch.zeros(1, dtype=torch.float64)  # NaNs where eager has none: no similarity
    return cos_all, max_abs, (torch.cat(agrees) if logits else None)


def top1_gate_applies(threshold: float, positions: int) -> bool:
    """Whether a ``top1_agreement >= threshold`` gate is meaningful over ``positions`` compared
    positions: only when one changed arg-max cannot miss it on its own, i.e.
    ``positions * (1 - threshold) >= 1`` (a 0.9 gate needs 10 positions; a single decode token
    flips between 0 and 1 on a near-tie, which says nothing about the artifact). A gate of 0 or
    below (it cannot be missed) and a gate of 1 or above (exact agreement, asked for) always apply.

    Args:
        threshold: the gate, a fraction in ``[0, 1]``.
        positions: the number of non-padded positions compared.
    """
    return threshold <= 0 or threshold >= 1 or positions * (1.0 - float(threshold)) >= 1.0 - 1e-9


def _is_token_logits(name: str, tensor: torch.Tensor) -> bool:
    return name.rsplit(".", 1)[-1] == "logits" and tensor.dim() == 3


def score_outputs(
    expected: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    *,
    gates: Mapping[str, float],
    attention_mask: torch.Tensor | None = None,
) -> list[OutputQuality]:
    """Score artifact outputs against fp32 eager outputs and apply ``gates``.

    Args:
        expected: ``{name: tensor}`` of the fp32 eager model.
        actual: ``{name: tensor}`` of the artifact (any float dtype; compared in float64).
        gates: ``{metric: threshold}`` (see :data:`QUALITY_METRICS`); a metric absent from it is
            recorded only. The KV-cache outputs of a language model get
            ``{"cosine": gates["cache_cosine"]}`` instead when given, else
            ``{"cosine": min(gates["cosine"], CACHE_COSINE_GATE)}`` (module docstring).
        attention_mask: 2-D ``[batch, seq]`` mask of the inputs; padded positions are not scored.

    Returns:
        One :class:`OutputQuality` per expected output, in ``expected`` order; a missing output or a
        shape mismatch is a failed row with ``max_abs_diff = inf``.
    """
    rows: list[OutputQuality] = []
    language_model = any(_is_token_logits(n, torch.as_tensor(t)) for n, t in expected.items())
    cache_gates: dict[str, float] = {}
    if "cache_cosine" in gates:
        cache_gates = {"cosine": float(gates["cache_cosine"])}
    elif "cosine" in gates:
        cache_gates = {"cosine": min(float(gates["cosine"]), CACHE_COSINE_GATE)}
    gates = {k: v for k, v in gates.items() if k != "cache_cosine"}
    for name, exp in expected.items():
        exp_t = exp.detach()
        got = actual.get(name)
        if got is None or tuple(torch.as_tensor(got).shape) != tuple(exp_t.shape):
            got_shape = () if got is None else tuple(torch.as_tensor(got).shape)
            why = "missing from the artifact's outputs" if got is None else f"shape {got_shape} != eager"
            rows.append(
                OutputQuality(
                    name, got_shape, tuple(exp_t.shape), str(exp_t.dtype), None, None, None, math.inf, 0,
                    dict(gates), [why], False,
                )
            )  # fmt: skip
            continue
        got_t = torch.as_tensor(got).detach().to(device=exp_t.device)
        if not exp_t.is_floating_point():
            equal = torch.equal(got_t.to(exp_t.dtype), exp_t)
            diff = 0.0 if equal else float((got_t.double() - exp_t.double()).abs().max())
            rows.append(
                OutputQuality(
                    name, tuple(got_t.shape), tuple(exp_t.shape), str(got_t.dtype), None, None, None, diff,
                    exp_t.numel(), {}, [] if equal else ["integer output differs from eager"], equal,
                )
            )  # fmt: skip
            continue
        keep = _keep_mask(name, exp_t, attention_mask)
        cos, max_abs, agree = _vector_scores(exp_t, got_t, keep, logits=_is_token_logits(name, exp_t))
        top1: float | None = None
        if agree is not None:
            top1 = float(agree.double().mean()) if agree.numel() else 1.0
        row = OutputQuality(
            name,
            tuple(got_t.shape),
            tuple(exp_t.shape),
            str(got_t.dtype),
            float(cos.mean()) if cos.numel() else 1.0,
            float(cos.min()) if cos.numel() else 1.0,
            top1,
            max_abs,
            int(cos.numel()),
        )
        row_gates = cache_gates if language_model and _CACHE_OUTPUT.match(name) else gates
        for metric, threshold in row_gates.items():
            value = getattr(row, metric, None)
            if value is None:
                continue
            if metric == "top1_agreement" and not top1_gate_applies(threshold, int(agree.numel())):
                continue  # one flipped arg-max alone would miss it: recorded, not gated
            row.gates[metric] = float(threshold)
            missed = value > threshold if metric in _UPPER_BOUND else not value >= threshold
            if missed:
                relation = "<=" if metric in _UPPER_BOUND else ">="
                row.failures.append(f"{metric} = {value:.4f} (gate {relation} {threshold})")
        row.ok = not row.failures
        rows.append(row)
    return rows


#: what each gated metric is, as shown next to its threshold
_GATE_WORDING = {
    "cosine": "mean per-vector cosine",
    "cosine_min": "min per-vector cosine",
    "top1_agreement": "top-1 agreement (fraction of positions)",
    "max_abs_diff": "max |artifact - eager|",
    "cache_cosine": "mean per-vector cosine of the KV-cache outputs",
}


def describe_gates(gates: Mapping[str, float]) -> str:
    """One line saying exactly what is gated: ``{"cosine": 0.99}`` -> ``"gated: mean per-vector
    cosine >= 0.99 (cosine); min cosine recorded, not gated"``. The statistic (mean / min /
    fraction) and the bound's direction come with each metric name; ``cosine_min`` is named as
    recorded-only unless it is gated itself."""
    if not gates:
        return "no quality gates"
    parts = [
        f"{_GATE_WORDING.get(k, k)} {'<=' if k in _UPPER_BOUND else '>='} {v:g} ({k})"
        for k, v in gates.items()
    ]
    text = "gated: " + "; ".join(parts)
    if "cosine" in gates and "cosine_min" not in gates:
        text += "; min cosine recorded, not gated"
    return text


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def format_quality_table(rows: list[OutputQuality], title: str = "") -> str:
    """Render quality rows as a fixed-width text table (one line per output)."""
    head = (
        f"{'output':<40} {'shape':<18} {'cos mean':>8} {'cos min':>8} {'top-1':>8} {'max abs diff':>13}  ok"
    )
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "-"
        lines.append(
            f"{r.name[:40]:<40} {shape[:18]:<18} {_fmt(r.cosine):>8} {_fmt(r.cosine_min):>8} "
            f"{_fmt(r.top1_agreement):>8} {r.max_abs_diff:>13.3e}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def _artifact_inputs(inputs: Mapping[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    from hfexport.tensors import cast_leaf_tensors, duplicate_leaf_tensors

    copied = duplicate_leaf_tensors(dict(inputs))
    if dtype is None or dtype == torch.float32:
        return copied
    return cast_leaf_tensors(copied, dtype)


def validate_quality(
    model: torch.nn.Module,
    run: Runner,
    inputs: Mapping[str, Any],
    *,
    gates: Mapping[str, float],
    dtype: str | torch.dtype | None = None,
    label: str = "sample",
    raise_on_failure: bool = True,
    expected: Mapping[str, torch.Tensor] | None = None,
) -> list[OutputQuality]:
    """Run the eager reference ``model`` and the artifact on ``inputs`` and score every output.

    Args:
        model: the eager model **in float32** (the reference; the user's model after capture).
        run: the backend runner: forward kwargs -> ``{output_name: tensor}``.
        inputs: forward kwargs in float32; the artifact gets a copy with floating point tensors
            (caches included) cast to ``dtype``.
        gates: ``{metric: threshold}``, e.g. from :func:`quality_gates_for`.
        dtype: the artifact's compute dtype (``"float16"``, ``torch.bfloat16``; ``None``/float32:
            inputs unchanged).
        label: name of this input set in messages (``"sample"``, ``"second shape"``).
        raise_on_failure: raise when a gate is missed.
        expected: the eager outputs on ``inputs`` when already computed (``None``: run ``model``).

    Returns:
        The :class:`OutputQuality` rows.

    Raises:
        ExportValidationError: an output is missing, has another shape, or misses a gate; the
            message names the output, the metric, its value, the threshold and how to override it.
    """
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if expected is None:
        expected = eager_outputs(model, inputs)
    actual = run(_artifact_inputs(inputs, torch_dtype))
    mask = inputs.get("attention_mask") if isinstance(inputs.get("attention_mask"), torch.Tensor) else None
    rows = score_outputs(dict(expected), actual, gates=gates, attention_mask=mask)
    table = format_quality_table(
        rows,
        title=f"quality on {label} inputs vs fp32 eager "
        + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor))
        + f" ({describe_gates(gates)})",
    )
    logger.info("%s", table)
    if raise_on_failure and not all(r.ok for r in rows):
        missed = "; ".join(f"{r.name or 'output'}: {', '.join(r.failures)}" for r in rows if not r.ok)
        metrics = sorted({f.split(" = ")[0] for r in rows for f in r.failures})
        # the suggested gate is the lowest measured value, rounded down: one that this artifact passes
        example = {
            m: math.floor(
                min(float(getattr(r, m)) for r in rows if any(f.startswith(f"{m} = ") for f in r.failures))
                * 100
            )
            / 100
            for m in metrics
            if m in gates and m not in _UPPER_BOUND
        }
        override = (
            f"Lower the missed gate if the loss is acceptable (config.quality_gates={example}, CLI "
            + " ".join(f"--gate {m}={v}" for m, v in example.items())
            + ")"
            if example
            else "Raise the missed bound if the loss is acceptable (config.quality_gates / CLI --gate)"
        )
        raise ExportValidationError(
            f"the artifact misses its quality gates against the fp32 eager model on the {label} inputs: "
            f"{missed}.\n{table}\n"
            f"{override}; for a quantized export, excluding sensitive layers (quantization.exclude) also "
            "helps. Random-weight models score low on top-1 agreement: gate with real weights.",
            rows,
        )
    return rows
