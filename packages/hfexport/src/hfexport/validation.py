"""Verification that an exported artefact computes what eager PyTorch computes.

Every backend runs its artefact through a *runner* (a callable taking forward kwargs and returning
``{output_name: tensor}``); this module derives a second input shape for dynamic exports, runs
the eager model, compares every output and raises :class:`~hfexport.errors.ExportValidationError`
with the per-output table when a difference is above tolerance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hfexport.errors import ExportValidationError
from hfexport.tensors import get_leaf_tensors

__all__ = [
    "OutputComparison",
    "compare_outputs",
    "default_tolerances",
    "derive_second_inputs",
    "eager_outputs",
    "format_table",
    "validate_artifact",
]

logger = logging.getLogger(__name__)

Runner = Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]

# fp32: atol 1e-4, rtol 1e-3; half precision: 1e-2 both.
_TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float64: (1e-6, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}

# Forward kwargs whose dimension 1 is the (encoder) sequence axis.
_SEQ_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
_DECODER_SEQ_KEYS = (
    "decoder_input_ids",
    "decoder_attention_mask",
    "decoder_position_ids",
    "decoder_inputs_embeds",
)
# Forward kwargs whose only varying axis is the batch.
_BATCH_ONLY_KEYS = ("pixel_values", "input_features", "pixel_mask")
# Forward kwargs with a variable-length raw signal on dimension 1.
_SIGNAL_KEYS = ("input_values",)


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs of ``dtype``: fp32 ``(1e-4, 1e-3)``, fp16/bf16 ``(1e-2, 1e-2)``."""
    return _TOLERANCES.get(dtype, (1e-4, 1e-3))


@dataclass
class OutputComparison:
    """One output compared with eager PyTorch.

    Attributes:
        name: output leaf path (``logits``, ``past_key_values.layers.0.keys``, ...).
        shape: shape of the artefact's output; ``expected_shape`` that of eager PyTorch.
        max_abs_diff: ``max |actual - expected|`` over compared elements (``inf`` on shape mismatch).
        max_rel_diff: ``max |actual - expected| / (|expected| + 1e-12)`` over compared elements.
        atol / rtol: tolerances used; ``ok`` is ``allclose`` under them (NaNs must match).
        compared: how many elements were compared (padded positions excluded).
    """

    name: str
    shape: tuple[int, ...]
    expected_shape: tuple[int, ...]
    dtype: str
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    ok: bool
    compared: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``inf`` as a string)."""
        out = asdict(self)
        for key in ("max_abs_diff", "max_rel_diff"):
            if not math.isfinite(out[key]):
                out[key] = str(out[key])
        return out


def _valid_positions(
    name: str, expected: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Mask of positions whose value is meaningful: padded positions (mask == 0) are excluded."""
    if attention_mask is None or attention_mask.dim() != 2 or expected.dim() < 2:
        return None
    if (
        expected.dim() == 4
        and name.rsplit(".", 1)[-1] in ("keys", "values")
        and (expected.shape[0], expected.shape[2]) == tuple(attention_mask.shape)
    ):
        # cache layers [batch, heads, seq, head_dim]: padded positions hold meaningless states
        return attention_mask.to(torch.bool)[:, None, :, None].expand_as(expected)
    if tuple(expected.shape[:2]) != tuple(attention_mask.shape):
        return None
    keep = attention_mask.to(torch.bool)
    while keep.dim() < expected.dim():
        keep = keep.unsqueeze(-1)
    return keep.expand_as(expected)


def compare_outputs(
    expected: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> list[OutputComparison]:
    """Compare artefact outputs with eager outputs, output by output.

    Args:
        expected: ``{name: tensor}`` from eager PyTorch.
        actual: ``{name: tensor}`` from the artefact; every expected name must be present.
        atol / rtol: tolerances; ``None`` picks :func:`default_tolerances` for each output's dtype.
        attention_mask: 2-D ``[batch, seq]`` mask of the inputs; for outputs whose first two
            dimensions are ``[batch, seq]``, positions where it is 0 (padding) are not compared,
            since their values carry no meaning.

    Returns:
        One :class:`OutputComparison` per expected output, in ``expected`` order. A missing
        output or a shape mismatch gives a row with ``ok=False`` and infinite differences.
    """
    rows: list[OutputComparison] = []
    for name, exp in expected.items():
        exp_t = exp.detach()
        a_def, r_def = default_tolerances(exp_t.dtype)
        a_tol = a_def if atol is None else atol
        r_tol = r_def if rtol is None else rtol
        got = actual.get(name)
        if got is None:
            rows.append(
                OutputComparison(
                    name, (), tuple(exp_t.shape), str(exp_t.dtype), math.inf, math.inf, a_tol, r_tol, False, 0
                )
            )
            continue
        got_t = torch.as_tensor(got).detach().to(device=exp_t.device)
        if tuple(got_t.shape) != tuple(exp_t.shape):
            rows.append(
                OutputComparison(
                    name,
                    tuple(got_t.shape),
                    tuple(exp_t.shape),
                    str(exp_t.dtype),
                    math.inf,
                    math.inf,
                    a_tol,
                    r_tol,
                    False,
                    0,
                )
            )
            continue
        if not exp_t.is_floating_point():
            equal = torch.equal(got_t.to(exp_t.dtype), exp_t)
            diff = 0.0 if equal else float((got_t.double() - exp_t.double()).abs().max())
            rows.append(
                OutputComparison(
                    name,
                    tuple(got_t.shape),
                    tuple(exp_t.shape),
                    str(exp_t.dtype),
                    diff,
                    diff,
                    a_tol,
                    r_tol,
                    equal,
                    exp_t.numel(),
                )
            )
            continue
        e64 = exp_t.double()
        g64 = got_t.double()
        keep = _valid_positions(name, e64, attention_mask)
        if keep is not None:
            e64 = e64[keep]
            g64 = g64[keep]
        if e64.numel() == 0:
            rows.append(
                OutputComparison(
                    name,
                    tuple(got_t.shape),
                    tuple(exp_t.shape),
                    str(exp_t.dtype),
                    0.0,
                    0.0,
                    a_tol,
                    r_tol,
                    True,
                    0,
                )
            )
            continue
        nan_match = bool(torch.equal(torch.isnan(e64), torch.isnan(g64)))
        finite = ~(torch.isnan(e64) | torch.isnan(g64))
        abs_diff = (g64 - e64).abs()[finite]
        rel_diff = abs_diff / (e64[finite].abs() + 1e-12)
        max_abs = float(abs_diff.max()) if abs_diff.numel() else 0.0
        max_rel = float(rel_diff.max()) if rel_diff.numel() else 0.0
        ok = nan_match and bool(torch.allclose(g64[finite], e64[finite], atol=a_tol, rtol=r_tol))
        rows.append(
            OutputComparison(
                name,
                tuple(got_t.shape),
                tuple(exp_t.shape),
                str(exp_t.dtype),
                max_abs,
                max_rel,
                a_tol,
                r_tol,
                ok,
                int(e64.numel()),
            )
        )
    return rows


def format_table(rows: list[OutputComparison], title: str = "") -> str:
    """Render comparison rows as a fixed-width text table (one line per output)."""
    head = f"{'output':<44} {'shape':<22} {'max abs diff':>13} {'max rel diff':>13} {'atol':>8}  ok"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "-"
        if r.shape != r.expected_shape:
            shape += f" (eager {'x'.join(map(str, r.expected_shape))})"
        lines.append(
            f"{r.name[:44]:<44} {shape[:22]:<22} {r.max_abs_diff:>13.3e} {r.max_rel_diff:>13.3e} {r.atol:>8.0e}  "
            f"{'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def eager_outputs(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Run ``model(**inputs)`` under ``no_grad`` on copies of the inputs and flatten the result.

    Returns:
        ``{leaf_path: tensor}`` as :func:`hfexport.tensors.get_leaf_tensors` names them
        (``logits``, ``past_key_values.layers.0.keys``, ...).
    """
    from hfexport.tensors import duplicate_leaf_tensors

    with torch.no_grad():
        out = model(**duplicate_leaf_tensors(dict(inputs)))
    return get_leaf_tensors(out)


def _max_positions(config: Any, decoder: bool = False) -> int | None:
    names = (
        ("max_target_positions", "n_positions", "max_position_embeddings")
        if decoder
        else ("max_position_embeddings", "n_positions", "max_source_positions", "n_ctx")
    )
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            configs.append(get_text(decoder=True) if decoder else get_text())
        except TypeError:
            configs.append(get_text())
    for cfg in configs:
        for n in names:
            value = getattr(cfg, n, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _new_length(length: int, limit: int | None, *, minimum: int = 65) -> int:
    target = max(2 * length, minimum)
    if limit is not None:
        target = min(target, limit)
    return max(target, 1)


def derive_second_inputs(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, seed: int = 1
) -> tuple[dict[str, Any] | None, str]:
    """Build a second set of forward kwargs with another batch size and a longer sequence.

    The batch grows by one; the sequence axis of token inputs doubles and reaches at least 65
    tokens, capped by the model's maximum positions. Token ids are drawn (seeded) from the range
    the sample uses; masks are all ones; ``position_ids`` count up; image and audio-feature
    inputs only change batch; raw audio (``input_values``) grows by half.

    Returns:
        ``(second_inputs, reason)``: ``second_inputs`` is ``None`` when no sound second shape
        can be derived (e.g. a cache among the inputs), with ``reason`` saying why.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    if any(v is not None and not isinstance(v, (bool, int, float, str)) for v in others.values()):
        return (
            None,
            f"non-tensor inputs {sorted(others)} (e.g. a cache) need a component-specific second shape",
        )
    if not tensors:
        return None, "no tensor inputs"
    batch = next(iter(tensors.values())).shape[0]
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors.values()):
        return None, "inputs do not share a leading batch dimension"
    new_batch = batch + 1
    config = getattr(model, "config", None)
    enc_len = dec_len = None
    out: dict[str, Any] = dict(others)
    for key, t in tensors.items():
        if key in _SEQ_KEYS or key in _DECODER_SEQ_KEYS:
            decoder = key in _DECODER_SEQ_KEYS
            if t.dim() < 2:
                return None, f"{key} has no sequence axis"
            limit = _max_positions(config, decoder=decoder) if config is not None else None
            if decoder:
                dec_len = dec_len or _new_length(t.shape[1], limit, minimum=2 * t.shape[1] + 1)
                length = dec_len
            else:
                enc_len = enc_len or _new_length(t.shape[1], limit)
                length = enc_len
            shape = (new_batch, length, *t.shape[2:])
            if key.endswith("attention_mask"):
                out[key] = torch.ones(shape, dtype=t.dtype, device=t.device)
            elif key.endswith("position_ids"):
                out[key] = (
                    torch.arange(length, device=t.device).expand(new_batch, length).to(t.dtype).contiguous()
                )
            elif t.is_floating_point():
                out[key] = torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype).to(t.device)
            else:
                low = int(t.min()) if t.numel() else 0
                high = int(t.max()) + 1 if t.numel() else 2
                out[key] = torch.randint(low, max(high, low + 1), shape, generator=gen, dtype=t.dtype).to(
                    t.device
                )
        elif key in _BATCH_ONLY_KEYS:
            reps = [new_batch // batch + 1] + [1] * (t.dim() - 1)
            noise = torch.randn(t.shape, generator=gen).to(t.dtype).to(t.device) * 0.1
            out[key] = (t + noise).repeat(*reps)[:new_batch].contiguous()
        elif key in _SIGNAL_KEYS:
            length = t.shape[1] + t.shape[1] // 2
            out[key] = torch.randn((new_batch, length, *t.shape[2:]), generator=gen).to(t.dtype).to(t.device)
        else:
            return None, f"no rule to derive a second shape for input {key!r} {tuple(t.shape)}"
    if "input_values" in tensors and "attention_mask" in tensors:
        out["attention_mask"] = torch.ones(
            out["input_values"].shape[:2], dtype=tensors["attention_mask"].dtype
        )
    return out, ""


def validate_artifact(
    model: torch.nn.Module,
    run: Runner,
    inputs: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    label: str = "sample",
    raise_on_failure: bool = True,
) -> list[OutputComparison]:
    """Run the artefact and eager PyTorch on ``inputs`` and compare every output.

    Args:
        model: the eager model (in eval mode, flags applied as for the export).
        run: the backend runner: forward kwargs -> ``{output_name: tensor}``.
        inputs: forward kwargs.
        atol / rtol: tolerances (``None``: :func:`default_tolerances` per output dtype).
        label: name of this input set in messages (``"sample"``, ``"second shape"``).
        raise_on_failure: raise when any output is off.

    Returns:
        The comparison rows.

    Raises:
        ExportValidationError: an output is missing, has another shape, or differs beyond
            tolerance; the message holds the table.
    """
    from hfexport.tensors import duplicate_leaf_tensors

    expected = eager_outputs(model, inputs)
    actual = run(duplicate_leaf_tensors(dict(inputs)))
    mask = inputs.get("attention_mask") if isinstance(inputs.get("attention_mask"), torch.Tensor) else None
    rows = compare_outputs(expected, actual, atol=atol, rtol=rtol, attention_mask=mask)
    table = format_table(
        rows,
        title=f"validation on {label} inputs "
        + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor)),
    )
    logger.info("%s", table)
    if raise_on_failure and not all(r.ok for r in rows):
        bad = [r.name for r in rows if not r.ok]
        raise ExportValidationError(
            f"exported artefact does not match eager PyTorch on the {label} inputs for output(s) {bad}:\n{table}\n"
            "Pass a looser atol/rtol if the difference is expected (e.g. reduced precision), or report the model.",
            rows,
        )
    return rows
