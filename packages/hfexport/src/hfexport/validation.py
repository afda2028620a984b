"""Verification that an exported artifact computes what eager PyTorch computes.

Every backend runs its artifact through a *runner* (a callable taking forward kwargs and returning
``{output_name: tensor}``); this module derives a second input shape for dynamic exports, runs
the eager model, compares every output and raises :class:`~hfexport.errors.ExportValidationError`
with the per-output table when a difference is above tolerance.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hfexport.conventions import (
    DECODER,
    SIGNAL,
    TEXT,
    InputRole,
    input_role,
    max_positions,
    modality_of,
    placeholder_token_ids,
)
from hfexport.errors import ExportValidationError
from hfexport.program_axes import choose_size
from hfexport.tensors import get_leaf_tensors

__all__ = [
    "TOKEN_VALUES",
    "OutputComparison",
    "ValidationSet",
    "compare_outputs",
    "default_tolerances",
    "derive_second_inputs",
    "describe_second_shape",
    "eager_outputs",
    "fit_static_spatial_axes",
    "format_table",
    "validate_artifact",
]

logger = logging.getLogger(__name__)

#: the second-shape summary when no input axis could change (the program is static)
NOTHING_VARIED = "no axis changed"

Runner = Callable[[dict[str, Any]], Mapping[str, torch.Tensor]]

# fp32: atol 1e-4, rtol 1e-3; half precision: 1e-2 both.
_TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float64: (1e-6, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}

# Input kinds whose values a second shape cannot invent: they say where image tokens sit
# (``mm_token_type_ids``), describe images (``image_grid_thw``) or count cache positions.
_NO_VALUE_RULE = ("modality_types", "grid", "cache_positions", "cache", "encoder_outputs")
# Input kinds whose values follow from their shape alone (random ids/embeddings, ones, counts).
_GENERATED = ("ids", "type_ids", "embeds", "mask", "positions", "signal")
# Token inputs that reuse the sample's real tokens with ``token_values="sample"``; masks become
# ones and positions count up, which is what an unpadded row of reused tokens has.
_FROM_SAMPLE = ("ids", "type_ids", "embeds")
#: what ``derive_second_inputs(token_values=...)`` accepts
TOKEN_VALUES = ("auto", "sample", "random")


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs of ``dtype``: fp32 ``(1e-4, 1e-3)``, fp16/bf16 ``(1e-2, 1e-2)``."""
    return _TOLERANCES.get(dtype, (1e-4, 1e-3))


@dataclass
class ValidationSet:
    """One input set an export is validated on, with the eager model's outputs on it.

    Attributes:
        label: ``"sample"`` or ``"second shape"`` (messages and table titles).
        stage: the report stage its comparison runs in (``validate`` / ``validate_second_shape``).
        inputs: forward kwargs, in the eager reference's dtype.
        detail: the stage detail (``"sample inputs"``, the second shape's summary).
        expected: ``{leaf path: tensor}`` of the eager model on ``inputs`` (filled by
            ``HfExporter.reference_outputs``).
        text: the eager side of the language-model text metrics run with this set
            (:class:`hfexport.quality.TextReference`; the sample set of a quantized causal LM), or ``None``.
    """

    label: str
    stage: str
    inputs: dict[str, Any]
    detail: str = ""
    expected: dict[str, torch.Tensor] | None = None
    text: Any = None

    @property
    def key(self) -> str:
        """The ``report.validation`` key: the label with ``_`` for spaces (``second_shape``)."""
        return self.label.replace(" ", "_")


@dataclass
class OutputComparison:
    """One output compared with eager PyTorch.

    Attributes:
        name: output leaf path (``logits``, ``past_key_values.layers.0.keys``, ...).
        shape: shape of the artifact's output; ``expected_shape`` that of eager PyTorch.
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
    """Compare artifact outputs with eager outputs, output by output.

    Args:
        expected: ``{name: tensor}`` from eager PyTorch.
        actual: ``{name: tensor}`` from the artifact; every expected name must be present.
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
        keep = _valid_positions(name, exp_t, attention_mask)
        stats = _float_diff(exp_t, got_t, keep, a_tol, r_tol)
        if stats is None:  # every position is padding
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
        max_abs, max_rel, ok, compared = stats
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
                compared,
            )
        )
    return rows


#: Elements compared at once by :func:`_float_diff` (float64 chunks of 32 MB): a real LM's logits
#: (3 x 65 x 151936, 30M elements) are compared without whole-tensor float64 copies.
_CHUNK = 1 << 22


def _float_diff(
    expected: torch.Tensor, actual: torch.Tensor, keep: torch.Tensor | None, atol: float, rtol: float
) -> tuple[float, float, bool, int] | None:
    """``(max abs diff, max rel diff, allclose, compared)`` of two same-shape float tensors over the
    positions ``keep`` marks (all when ``None``), or ``None`` when no position is kept.

    Computed in float64 chunks of :data:`_CHUNK` elements. ``allclose`` is ``torch.allclose``'s
    rule (``|a - e| <= atol + rtol * |e|``, equal infinities agreeing) over the positions where
    neither side is NaN, and NaNs must sit at the same positions; the differences skip NaN positions.
    """
    flat_e = expected.reshape(-1)
    flat_a = actual.reshape(-1)
    flat_k = keep.reshape(-1) if keep is not None else None
    max_abs = max_rel = 0.0
    ok = True
    compared = 0
    for start in range(0, flat_e.numel(), _CHUNK):
        e = flat_e[start : start + _CHUNK].to(torch.float64, copy=True)  # in-place ops below
        a = flat_a[start : start + _CHUNK].to(torch.float64, copy=True)
        if flat_k is not None:
            k = flat_k[start : start + _CHUNK]
            e, a = e[k], a[k]
        if e.numel() == 0:
            continue
        compared += e.numel()
        e_nan, a_nan = torch.isnan(e), torch.isnan(a)
        if not torch.equal(e_nan, a_nan):
            ok = False
        finite = ~(e_nan | a_nan)
        if not bool(finite.all()):
            e, a = e[finite], a[finite]
        if e.numel() == 0:
            continue
        diff = torch.where(a == e, 0.0, (a - e).abs_())  # equal infinities differ by 0, as in allclose
        e_abs = e.abs_()
        max_abs = max(max_abs, float(diff.max()))
        ok = ok and bool((diff <= atol + rtol * e_abs).all())
        max_rel = max(max_rel, float((diff / (e_abs + 1e-12)).max()))
    return None if compared == 0 else (max_abs, max_rel, ok, compared)


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


def _new_length(length: int, limit: int | None, *, minimum: int = 65) -> int:
    target = max(2 * length, minimum)
    if limit is not None:
        target = min(target, limit)
    return max(target, 1)


def _reuse_length(length: int, limit: int | None) -> int:
    """Sequence length of a second shape that reuses the sample's tokens: a quarter shorter (at
    least one token, never below 2), so every position stays inside the lengths the sample shows
    the model (a real LM's fp32 predictions, and so its top-1 agreement, degrade past them: IgLM-S
    at 122 -> 244 tokens, see :func:`derive_second_inputs`); a sample too short for that grows as
    with drawn ids."""
    shorter = length - max(1, length // 4)
    if shorter >= 2:
        return shorter if limit is None else min(shorter, limit)
    return _new_length(length, limit)


def _generate(t: torch.Tensor, role: InputRole, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` for an input whose values follow from its shape (see ``_GENERATED``):
    masks are ones, positions count up along the sequence axis, floats are standard normal, ids
    are drawn from the range the sample uses."""
    if role.kind == "mask":
        return torch.ones(shape, dtype=t.dtype, device=t.device)
    if role.kind == "positions" and role.sequence_axis is not None:
        length = shape[role.sequence_axis]
        view = [1] * len(shape)
        view[role.sequence_axis] = length
        return torch.arange(length, device=t.device).view(view).expand(shape).to(t.dtype).contiguous()
    if t.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype).to(t.device)
    low = int(t.min()) if t.numel() else 0
    high = int(t.max()) + 1 if t.numel() else 2
    return torch.randint(low, max(high, low + 1), shape, generator=gen, dtype=t.dtype).to(t.device)


def _reuse_sample_tokens(config: Any, token_values: str) -> bool:
    """Whether derived token inputs reuse the sample's tokens (see :func:`derive_second_inputs`)."""
    if token_values not in TOKEN_VALUES:
        raise ValueError(f"token_values={token_values!r} is invalid; allowed: {', '.join(TOKEN_VALUES)}")
    if token_values != "auto":
        return token_values == "sample"
    from hfexport.precision import is_quality_gated

    return is_quality_gated(config)


def _real_positions(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{sequence group: bool [batch, seq]}``: the positions a 2-D mask of the group marks as real
    tokens (``mask != 0``); a group without such a mask is absent (every position is real)."""
    found: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if (
            role is not None
            and role.kind == "mask"
            and role.sequence is not None
            and (t.dim(), role.batch_axis, role.sequence_axis) == (2, 0, 1)
        ):
            found.setdefault(role.sequence, t != 0)
    return found


def _from_sample(
    t: torch.Tensor, role: InputRole, shape: tuple[int, ...], real: torch.Tensor | None
) -> torch.Tensor | None:
    """``shape`` filled with the sample's own tokens: derived row ``i`` is the real (unmasked)
    tokens of sample row ``i % batch``, repeated along the sequence axis and cut to the new length
    (a row without a real token is taken whole). ``None`` when the layout is not ``[batch, seq, ...]``
    with the trailing axes of the sample, or the sample has no token."""
    if (
        (role.batch_axis, role.sequence_axis) != (0, 1)
        or t.dim() < 2
        or tuple(shape[2:]) != tuple(t.shape[2:])
    ):
        return None
    batch, length = int(t.shape[0]), int(shape[1])
    if batch == 0 or int(t.shape[1]) == 0:
        return None
    if real is not None and tuple(real.shape) != tuple(t.shape[:2]):
        real = None
    rows = []
    for row in range(int(shape[0])):
        source = t[row % batch]
        if real is not None and bool(real[row % batch].any()):
            source = source[real[row % batch].to(source.device)]
        reps = [-(-length // int(source.shape[0]))] + [1] * (source.dim() - 1)
        rows.append(source.repeat(*reps)[:length])
    return torch.stack(rows).contiguous()


def _tile(t: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """``t`` repeated (or cut) along every axis to ``shape``; floats get 0.1-scaled noise so repeated
    rows differ."""
    out = t
    for axis, size in enumerate(shape):
        current = int(out.shape[axis])
        if current == 0:
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
        if size > current:
            reps = [1] * out.dim()
            reps[axis] = -(-size // current)
            out = out.repeat(*reps)
        out = out.narrow(axis, 0, size)
    if out.is_floating_point():
        out = out + torch.randn(tuple(out.shape), generator=gen).to(out.dtype).to(out.device) * 0.1
    return out.contiguous()


def derive_second_inputs(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    seed: int = 1,
    config: Any = None,
    program_axes: Sequence[Mapping[str, Any]] | None = None,
    token_values: str = "auto",
) -> tuple[dict[str, Any] | None, str]:
    """Build a second set of forward kwargs of another shape, to validate a dynamic export.

    What an axis means comes from the input-role table (:mod:`hfexport.conventions.roles`).

    With explicit ``config.dynamic_shapes``, only the axes declared dynamic change (a named
    ``Dim``, a derived ``Dim``, ``Dim.AUTO`` or ``Dim.DYNAMIC``; ``None``, ints, ``Dim.STATIC`` and
    absent axes are static), each within its declared ``min``/``max`` and, for token axes, the
    model's maximum positions. Axes that must have one size (a named ``Dim`` used twice; the batch
    axes of one modality; the axes of one sequence group, e.g. ``input_ids``/``attention_mask``)
    change together, and only when every one of them is declared dynamic. The batch grows by one,
    a token sequence to ``max(2 * length, 65)``, raw audio by half, image sides double, other axes
    double; a size outside the range falls back to the nearest size inside it (>= 2) that differs
    from the sample, or the axis stays.

    Without ``dynamic_shapes`` (``dynamic=True``), the batch grows by one, token sequences double
    and reach at least 65 tokens (capped by the model's maximum positions), image sides double
    (every input of one modality takes the same new height and width: ``pixel_values`` and
    ``pixel_mask``), audio features only change batch, raw audio (``input_values``) grows by half.
    With ``program_axes`` (what the captured program made of each axis, as
    :func:`hfexport.program_axes.program_input_axes` gives and the export report records in
    ``report.dynamic_axes``), an image side the program holds static (ViT: its position
    embeddings fix the image size) keeps its size, and one the program bounds takes the size
    nearest to double inside its range; token and batch axes are not fitted, so a program that
    specialised them still fails the second shape.

    Values: masks are ones, ``position_ids`` count up, token ids are drawn (seeded) from the range
    the sample uses, floats are standard normal. With ``token_values="sample"`` (the default for a
    quality-gated export: the gates score agreement with the fp32 model on the inputs, which only
    means something on inputs like the sample) the token inputs (``input_ids``,
    ``token_type_ids``, ``inputs_embeds`` and their decoder counterparts) reuse the sample instead:
    derived row ``i`` holds the real tokens (mask != 0) of sample row ``i % batch``, repeated along
    the sequence if needed, so the ids are the sample's, the mask is all ones and ``position_ids``
    count up consistently. The token sequence then gets a quarter *shorter* (at least 2 tokens;
    a sample of 1-2 tokens grows as above) instead of doubling: past the lengths the sample shows,
    a real LM leaves what it was trained on (IgLM-S, GPT-2 on ~120-token antibody chains, 8da4w:
    top-1 agreement 0.94 over positions 0-63 and 0.75 over 192-255 of the sample repeated to 244
    tokens, with fp32's own mean top probability falling from 0.81 to 0.62), so a gate there would
    score the model, not the export. The batch still grows by one. A prompt with placeholder
    tokens keeps the longer sequence. Other inputs (images, features, unknown names)
    are the sample repeated along the changed axes, plus noise for floats. A prompt holding
    placeholder tokens of a present modality (LLaVA's ``<image>`` tokens next to
    ``pixel_values``; the ids come from :func:`hfexport.conventions.placeholder_token_ids`) keeps
    them: derived row ``i`` has the placeholders of sample row ``i % batch`` at the same positions
    (its image is that row's, tiled), no drawn id equals a placeholder id, and the image size
    stays, so the count matches the features the encoder produces for the new batch. When the
    program holds the batch of such a modality's input static (LLaVA's one feature tensor per
    image fixes the image batch at capture), the batch of every input keeps its size and the
    prompt length alone changes.

    Inputs holding a transformers ``Cache`` (the prefill and decode steps of a generation export):
    an empty cache (a prefill) stays empty while the other inputs change by the rules above; a
    filled cache (a decode step) gets another past length, and the batch changes when the program
    keeps it dynamic, with the cache tensors, the mask, ``position_ids`` and ``cache_position``
    consistent with the new past; a static cache keeps its shape and moves its write position
    (:func:`hfexport.generation.second_shape.derive_cache_second_inputs`, which also lists the caches
    it has no rule for).

    Args:
        model: the eager model (its config gives the maximum positions).
        inputs: the prepared forward kwargs.
        seed: seed for the random values.
        config: the export config; its ``dynamic_shapes`` select the axes (``None``: the
            ``dynamic=True`` rule above).
        program_axes: the captured program's axis outcomes (list of dicts with ``input``,
            ``axis``, ``status``, ``min``, ``max``); ``None``: image sides are taken as dynamic.
        token_values: ``"sample"`` (token inputs reuse the sample's tokens), ``"random"`` (drawn
            ids) or ``"auto"``: ``"sample"`` when quality gates apply to ``config``
            (:func:`hfexport.quality.quality_gates_for`: a reduced dtype or a quantization), else
            ``"random"``.

    Returns:
        ``(second_inputs, reason)``: ``second_inputs`` is ``None`` when no sound second shape
        can be derived (a cache or an input without a rule, no dynamic axis that can change),
        with ``reason`` saying why; else ``reason`` is ``""``.

    Raises:
        ValueError: ``token_values`` not one of :data:`TOKEN_VALUES`.
    """
    reuse = _reuse_sample_tokens(config, token_values)
    from hfexport.generation.second_shape import derive_cache_second_inputs, find_cache

    found = find_cache(inputs)
    if found is not None:
        if get_leaf_tensors(found[1]):  # a filled cache: another past length
            return derive_cache_second_inputs(
                model, inputs, config=config, program_axes=program_axes, seed=seed, reuse=reuse
            )
        return _derive_with_empty_cache(
            model,
            inputs,
            found,
            seed=seed,
            config=config,
            program_axes=program_axes,
            token_values=token_values,
        )
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
    explicit = getattr(config, "dynamic_shapes", None) if config is not None else None
    if explicit:
        derived, reason = _derive_declared(model, tensors, others, explicit, gen, reuse=reuse)
        if derived is not None and program_axes:
            derived = fit_static_spatial_axes(derived, program_axes)
        return derived, reason
    batch = next(iter(tensors.values())).shape[0]
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors.values()):
        return None, "inputs do not share a leading batch dimension"
    config_ = getattr(model, "config", None)
    placeholders = _prompt_placeholders(tensors, config_)
    new_batch = batch if _placeholder_batch_fixed(tensors, placeholders, program_axes) else batch + 1
    real = _real_positions(tensors) if reuse else {}
    lengths: dict[str, int] = {}
    out: dict[str, Any] = dict(others)
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None or role.batch_axis != 0 or role.kind in _NO_VALUE_RULE:
            return None, f"no rule to derive a second shape for input {key!r} {tuple(t.shape)}"
        if role.sequence in (TEXT, DECODER) and role.sequence_axis is not None:
            decoder = role.sequence == DECODER
            sample = int(t.shape[role.sequence_axis])
            if role.sequence not in lengths:
                limit, _ = max_positions(config_, decoder=decoder)
                if reuse and not placeholders:
                    lengths[role.sequence] = _reuse_length(sample, limit)
                elif decoder:
                    lengths[role.sequence] = _new_length(sample, limit, minimum=2 * sample + 1)
                else:
                    lengths[role.sequence] = _new_length(sample, limit)
                if program_axes is not None:  # a bounded range (chunked forward): a size it takes
                    lengths[role.sequence] = _bounded_size(
                        program_axes, key, role.sequence_axis, sample, lengths[role.sequence]
                    )
            shape = list(t.shape)
            shape[0], shape[role.sequence_axis] = new_batch, lengths[role.sequence]
            reused = (
                _from_sample(t, role, tuple(shape), real.get(role.sequence))
                if reuse and role.kind in _FROM_SAMPLE
                else None
            )
            out[key] = reused if reused is not None else _generate(t, role, tuple(shape), gen)
        elif role.sequence == SIGNAL and role.sequence_axis is not None:
            sample = int(t.shape[role.sequence_axis])
            length = lengths.setdefault(SIGNAL, sample + sample // 2)
            shape = (new_batch, length, *t.shape[2:])
            if role.kind == "mask":
                out[key] = torch.ones(shape, dtype=t.dtype)
            else:
                out[key] = torch.randn(shape, generator=gen).to(t.dtype).to(t.device)
        elif role.spatial_axes:
            shape = list(t.shape)
            shape[0] = new_batch
            for side, axis in zip(("height", "width"), role.spatial_axes):
                sample = int(t.shape[axis])
                # a prompt with image tokens has one token per vision feature: keep the image size
                grow = sample > 1 and role.modality not in placeholders
                size = 2 * sample if grow else sample
                if grow and program_axes is not None:
                    size = _program_size(program_axes, key, axis, sample, size)
                shape[axis] = lengths.setdefault(f"{role.modality}.{side}", size)
            out[key] = _tile(t, tuple(shape), gen) if t.is_floating_point() else _tile_exact(t, tuple(shape))
        else:
            reps = [new_batch // batch + 1] + [1] * (t.dim() - 1)
            noise = torch.randn(t.shape, generator=gen).to(t.dtype).to(t.device) * 0.1
            out[key] = (t + noise).repeat(*reps)[:new_batch].contiguous()
    return _keep_placeholders(tensors, out, placeholders)


def _placeholder_batch_fixed(
    tensors: Mapping[str, torch.Tensor],
    placeholders: Mapping[str, int],
    program_axes: Sequence[Mapping[str, Any]] | None,
) -> bool:
    """Whether the program holds static the batch of an input whose placeholders fill the prompt.

    The prompt's placeholder tokens are tied to the images (one token per vision feature), so with
    the image batch fixed by the program (transformers 5.24 LLaVA returns one feature tensor per
    image, so the output structure, and with it the image batch, is fixed at capture; the report
    reads ``"pixel_values batch: static 2 (model-fixed)"``), a second shape can only keep the batch
    of every input and change the prompt length."""
    if not placeholders or not program_axes:
        return False
    for entry in program_axes:
        key = entry.get("input")
        t = tensors.get(str(key))
        if t is None or entry.get("status") != "static":
            continue
        role = input_role(str(key), t.dim(), present=tensors)
        if role is not None and role.modality in placeholders and entry.get("axis") == role.batch_axis:
            return True
    return False


def describe_second_shape(sample: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """What a second shape changed with respect to the sample, as the export report records it
    (``report.second_shape``).

    Args:
        sample: the sample forward kwargs.
        second: the second forward kwargs (same keys).

    Returns:
        A JSON-safe dict: ``inputs`` (``{leaf path: shape}`` of ``second``, as ``report.input_names``
        names the sample's leaves); ``changed`` (one entry per changed axis: ``input``, ``axis``,
        ``meaning`` such as ``"batch"``, ``"sequence"`` or ``"past length"``, ``sample``,
        ``second``; the layers of a cache that change alike share one entry named
        ``cache.layers.*.keys``); ``values`` (0-d leaves whose value changed, e.g. a static cache's
        write position ``cache.layers.*.cumulative_length``); for inputs holding a cache
        ``past_length`` ``[sample, second]`` and ``cache_kind`` (``"dynamic"`` / ``"static"``, the
        latter with ``cache_positions``, the fixed length of its tensors); and ``summary``, one line
        such as ``"past length 8 -> 17; batch 2 -> 3 (input_ids, ...)"``.
    """
    import re

    from hfexport.generation.second_shape import cache_past_length, find_cache, static_cache_length
    from hfexport.program_axes import axis_meaning

    before, after = get_leaf_tensors(dict(sample)), get_leaf_tensors(dict(second))
    found = find_cache(second)
    cache_key = found[0] if found is not None else None
    top = {k: v for k, v in second.items() if isinstance(v, torch.Tensor)}
    grouped: dict[tuple[str, int, str, int, int], None] = {}
    values: dict[tuple[str, str, Any, Any], None] = {}
    for path, new in after.items():
        old = before.get(path)
        if old is None:
            continue
        in_cache = cache_key is not None and path.startswith(f"{cache_key}.")
        name = re.sub(r"\.layers\.\d+\.", ".layers.*.", path) if in_cache else path
        if new.dim() == 0 and old.dim() == 0:
            if new.numel() and not torch.equal(new, old.to(new.dtype)):
                meaning = "cache write position" if path.endswith("cumulative_length") else "value"
                values[(name, meaning, old.item(), new.item())] = None
            continue
        if new.dim() != old.dim():
            continue
        for axis, (a, b) in enumerate(zip(old.shape, new.shape)):
            if a == b:
                continue
            if in_cache:
                meaning = {0: "batch", 2: "past length"}.get(axis, f"axis {axis}")
            elif path in top:
                meaning = axis_meaning(path, top[path], axis, top)
            else:
                meaning = f"axis {axis}"
            grouped[(name, axis, meaning, int(a), int(b))] = None
    out: dict[str, Any] = {
        "inputs": {path: list(t.shape) for path, t in after.items()},
        "changed": [
            {"input": n, "axis": a, "meaning": m, "sample": x, "second": y} for n, a, m, x, y in grouped
        ],
        "values": [{"input": n, "meaning": m, "sample": x, "second": y} for n, m, x, y in values],
    }
    lines: list[str] = []
    if found is not None:
        sample_cache = sample.get(found[0])
        past = [
            cache_past_length(sample_cache) if sample_cache is not None else 0,
            cache_past_length(found[1]),
        ]
        capacity = static_cache_length(found[1])
        out["past_length"] = past
        out["cache_kind"] = "static" if capacity is not None else "dynamic"
        if capacity is not None:
            out["cache_positions"] = capacity
        if past[0] != past[1]:
            lines.append(
                f"past length {past[0]} -> {past[1]}"
                + (f" (static cache: its tensors keep {capacity} positions)" if capacity is not None else "")
            )
    by_change: dict[tuple[str, int, int], list[str]] = {}
    for name, _, meaning, a, b in grouped:
        if meaning == "past length":
            continue  # said once above
        by_change.setdefault((meaning, a, b), []).append(name)
    for (meaning, a, b), names in by_change.items():
        lines.append(f"{meaning} {a} -> {b} ({', '.join(dict.fromkeys(names))})")
    for name, meaning, a, b in values:
        lines.append(f"{meaning} {a} -> {b} ({name})")
    out["summary"] = "; ".join(lines) or NOTHING_VARIED
    return out


def _derive_with_empty_cache(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    found: tuple[str, Any],
    **derive: Any,
) -> tuple[dict[str, Any] | None, str]:
    """The second shape of a prefill: the inputs other than the (empty) cache change as without it,
    token sequences no longer than a static cache takes (``max_cache_len - 1``: a mask as long as
    the cache takes another branch in transformers), ``cache_position`` counting the new prompt; the
    cache stays empty (a copy)."""
    from hfexport.generation.second_shape import static_cache_length

    cache_key, cache = found
    rest = {k: v for k, v in inputs.items() if k not in (cache_key, "cache_position")}
    derived, reason = derive_second_inputs(model, rest, **derive)
    if derived is None:
        return None, reason
    tensors = {k: v for k, v in derived.items() if isinstance(v, torch.Tensor)}
    capacity = static_cache_length(cache)
    length = None
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None or role.sequence not in (TEXT, DECODER) or role.sequence_axis is None:
            continue
        if capacity is not None and int(t.shape[role.sequence_axis]) > capacity - 1:
            derived[key] = t.narrow(role.sequence_axis, 0, capacity - 1).contiguous()
        length = int(derived[key].shape[role.sequence_axis])
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key == cache_key:
            out[key] = copy.deepcopy(cache)
        elif key == "cache_position" and isinstance(value, torch.Tensor):
            if length is None:
                return None, "cache_position next to no token sequence: no rule to derive it"
            out[key] = torch.arange(length, dtype=value.dtype, device=value.device)
        else:
            out[key] = derived[key]
    return out, ""


def _prompt_placeholders(tensors: Mapping[str, torch.Tensor], config: Any) -> dict[str, int]:
    """``{modality: placeholder token id}`` for the modalities whose input is present and whose
    placeholder token occurs in a text ``ids`` input (LLaVA: ``pixel_values`` and ``<image>``
    tokens in ``input_ids``)."""
    present = {modality_of(k) for k in tensors}
    ids = [
        t
        for k, t in tensors.items()
        if (role := input_role(k, t.dim(), present=tensors)) is not None and role.kind == "ids"
    ]
    found: dict[str, int] = {}
    for modality, token in placeholder_token_ids(config).items():
        if modality in present and any(bool((t == token).any()) for t in ids):
            found[modality] = token
    return found


def _keep_placeholders(
    sample: Mapping[str, torch.Tensor], out: dict[str, Any], placeholders: Mapping[str, int]
) -> tuple[dict[str, Any] | None, str]:
    """Put the prompt's placeholder tokens back into the derived token ids.

    A multimodal model replaces each placeholder token (``<image>``) by one feature of its
    encoder, and checks that the counts match. Derived row ``i`` repeats sample row ``i % batch``
    (images are tiled the same way), so it gets that row's placeholders at the same positions;
    drawn ids that happen to equal a placeholder id become another id.
    """
    if not placeholders:
        return out, ""
    tokens = set(placeholders.values())
    for key, t in sample.items():
        role = input_role(key, t.dim(), present=sample)
        new = out.get(key)
        if role is None or role.kind != "ids" or not isinstance(new, torch.Tensor) or new is t:
            continue
        axis = role.sequence_axis
        if axis != 1 or new.dim() != 2:
            continue
        used = sorted({int(v) for v in t.unique()} - tokens)
        filler = used[0] if used else 0
        new = new.clone()
        for token in tokens:
            new[new == token] = filler
        batch = int(t.shape[0])
        for row in range(int(new.shape[0])):
            source = t[row % batch]
            hits = (source.unsqueeze(-1) == torch.tensor(sorted(tokens), dtype=t.dtype)).any(-1)
            positions = hits.nonzero().flatten()
            if positions.numel() and int(positions.max()) >= int(new.shape[1]):
                return None, (
                    f"{key!r} holds placeholder tokens up to position {int(positions.max())}, beyond the derived "
                    f"length {int(new.shape[1])}; pass second_inputs explicitly"
                )
            new[row, positions] = source[positions]
        out[key] = new
    return out, ""


def _tile_exact(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` repeated (or cut) along every axis to ``shape``, without noise (integer masks)."""
    out = t
    for axis, size in enumerate(shape):
        current = int(out.shape[axis])
        if size > current and current > 0:
            reps = [1] * out.dim()
            reps[axis] = -(-size // current)
            out = out.repeat(*reps)
        out = out.narrow(axis, 0, size)
    return out.contiguous()


def _program_size(
    program_axes: Sequence[Mapping[str, Any]], key: str, axis: int, sample: int, preferred: int
) -> int:
    """``preferred`` fitted to what the program holds for ``key``/``axis``: the sample size for a
    static axis, the size nearest ``preferred`` inside the range of a dynamic one; ``preferred``
    for an axis the program does not list."""
    for entry in program_axes:
        if entry.get("input") != key or entry.get("axis") != axis:
            continue
        if entry.get("status") == "static":
            return sample
        low = int(entry.get("min") or 0)
        high = entry.get("max")
        return choose_size(sample, preferred, low, int(high) if high is not None else None)
    return preferred


def _bounded_size(
    program_axes: Sequence[Mapping[str, Any]], key: str, axis: int, sample: int, preferred: int
) -> int:
    """``preferred`` moved inside the range of ``key``/``axis`` when the program bounds it from
    above; unchanged for an unbounded, static or unlisted axis (a specialised sequence stays
    derived, so the second-shape validation reports it)."""
    for entry in program_axes:
        if entry.get("input") == key and entry.get("axis") == axis:
            if entry.get("status") == "dynamic" and entry.get("max") is not None:
                # below the bound itself: a chunked forward often takes a path of its own at an exact
                # multiple of the chunk (no padding), which the program may exclude by a guard
                low, high = int(entry.get("min") or 0), int(entry["max"])
                return choose_size(sample, preferred, low, max(high - 1, low))
            break
    return preferred


def fit_static_spatial_axes(
    second: Mapping[str, Any], program_axes: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Narrow the image sides of derived second inputs to what the captured program takes.

    A model whose forward fixes its image size (ViT without position interpolation) is captured
    with static sides; a dynamic side may also be bounded. Only the spatial axes of the
    input-role table are narrowed (leading rows and columns kept): a batch or sequence axis the
    program holds static stays as derived, so the second-shape validation still reports a
    specialised token axis.

    Args:
        second: the derived forward kwargs.
        program_axes: the program's axis outcomes (``input``, ``axis``, ``status``, ``min``,
            ``max``), as :func:`hfexport.program_axes.program_input_axes` gives them.

    Returns:
        A new dict; inputs without a spatial axis beyond the program's size are the same objects.
    """
    limits = {
        (str(e.get("input")), int(e.get("axis", -1))): e.get("max")
        for e in program_axes
        if e.get("max") is not None
    }
    tensors = {k: v for k, v in second.items() if isinstance(v, torch.Tensor)}
    out = dict(second)
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None:
            continue
        value = t
        for axis in role.spatial_axes:
            limit = limits.get((key, axis))
            if limit is not None and int(value.shape[axis]) > int(limit):
                value = value.narrow(axis, 0, int(limit))
        if value is not t:
            out[key] = value.contiguous()
    return out


# -- second shape from explicit dynamic_shapes ----------------------------------------------------
@dataclass
class _Declared:
    """One axis declared dynamic: its ``Dim`` name (``None`` for a hint), range and derivation."""

    name: str | None
    low: int
    high: int | None
    derived: tuple[str, Callable[[int], int]] | None = None


def _finite_int(value: Any) -> int | None:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(as_float) or as_float >= 2**62:
        return None
    return int(value)


def _declared(leaf: Any) -> _Declared | None:
    """The dynamic declaration of one ``dynamic_shapes`` leaf, or ``None`` for a static axis."""
    if leaf is None or isinstance(leaf, (bool, int)):
        return None
    hint_type = getattr(leaf, "type", None)
    if type(leaf).__name__ == "_DimHint" and hint_type is not None:
        if hint_type.name == "STATIC":
            return None
        return _Declared(None, _finite_int(leaf.min) or 0, _finite_int(leaf.max))
    root, fn = getattr(leaf, "root", None), getattr(leaf, "fn", None)
    if root is not None and callable(fn):
        return _Declared(None, 0, None, derived=(str(getattr(root, "__name__", root)), fn))
    if hasattr(leaf, "__name__") and hasattr(leaf, "min") and hasattr(leaf, "max"):
        return _Declared(str(leaf.__name__), _finite_int(leaf.min) or 0, _finite_int(leaf.max))
    return None


def _axis_specs(spec: Any, ndim: int) -> list[tuple[int, Any]]:
    if isinstance(spec, Mapping):
        return [(a, leaf) for a, leaf in spec.items() if isinstance(a, int) and 0 <= a < ndim]
    if isinstance(spec, (list, tuple)):
        return list(enumerate(spec))[:ndim]
    return []


def _derive_declared(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    others: dict[str, Any],
    spec: Any,
    gen: torch.Generator,
    *,
    reuse: bool = False,
) -> tuple[dict[str, Any] | None, str]:
    if not isinstance(spec, Mapping):
        return None, "dynamic_shapes is not a dict keyed by forward kwarg name; no second shape derived"
    declared: dict[tuple[str, int], _Declared] = {}
    for key, t in tensors.items():
        for axis, leaf in _axis_specs(spec.get(key), t.dim()):
            found = _declared(leaf)
            if found is not None:
                declared[(key, axis)] = found
    if not declared:
        return (
            None,
            "dynamic_shapes declares no dynamic axis (every axis is static): the program takes one shape",
        )

    parent: dict[tuple[str, int], tuple[str, int]] = {
        node: node for node, d in declared.items() if not d.derived
    }

    def find(node: tuple[str, int]) -> tuple[str, int]:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def union(a: tuple[str, int], b: tuple[str, int]) -> None:
        parent[find(a)] = find(b)

    # what each axis means, from the role table
    meaning: dict[tuple[str, int], str] = {}
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for key, t in tensors.items():
        role = input_role(key, t.dim(), present=tensors)
        if role is None:
            continue
        if role.batch_axis is not None:
            meaning[(key, role.batch_axis)] = "batch"
            groups.setdefault(("batch", role.modality), []).append((key, role.batch_axis))
        if role.sequence_axis is not None and role.sequence is not None:
            meaning[(key, role.sequence_axis)] = role.sequence
            groups.setdefault(("sequence", role.sequence), []).append((key, role.sequence_axis))
        for side, axis in zip(("height", "width"), role.spatial_axes):
            meaning[(key, axis)] = "spatial"
            groups.setdefault((side, role.modality), []).append((key, axis))
    blocked: set[tuple[str, int]] = set()
    notes: list[str] = []
    for members in groups.values():
        dynamic = [m for m in members if m in parent]
        static = [m for m in members if m not in declared]
        if not dynamic:
            continue
        if static:
            blocked.update(dynamic)
            notes.append(
                f"{static[0][0]} axis {static[0][1]} is static but must match the dynamic "
                f"{dynamic[0][0]} axis {dynamic[0][1]}"
            )
            continue
        for m in dynamic[1:]:
            union(m, dynamic[0])
    by_name: dict[str, tuple[str, int]] = {}
    for node, d in declared.items():
        if d.name is not None and node in parent:
            if d.name in by_name:
                union(node, by_name[d.name])
            else:
                by_name[d.name] = node

    sets: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for node in parent:
        sets.setdefault(find(node), []).append(node)
    config_ = getattr(model, "config", None)
    placeholders = _prompt_placeholders(tensors, config_)
    priority = (TEXT, DECODER, SIGNAL, "batch", "spatial")
    sizes: dict[tuple[str, int], int] = {}
    for members in sets.values():
        if any(m in blocked for m in members):
            continue
        kinds = [meaning.get(m, "other") for m in members]
        kind = min(kinds, key=lambda k: priority.index(k) if k in priority else len(priority))
        sample = int(tensors[members[0][0]].shape[members[0][1]])
        low = max(declared[m].low for m in members)
        highs = [declared[m].high for m in members if declared[m].high is not None]
        if kind in (TEXT, DECODER):
            limit, _ = max_positions(config_, decoder=kind == DECODER)
            if limit is not None:
                highs.append(limit)
        high = min(highs) if highs else None
        if kind == "batch":
            preferred = sample + 1
        elif kind in (TEXT, DECODER) and reuse and not placeholders:
            preferred = _reuse_length(sample, None)
        elif kind == TEXT:
            preferred = _new_length(sample, None)
        elif kind == DECODER:
            preferred = _new_length(sample, None, minimum=2 * sample + 1)
        elif kind == SIGNAL:
            preferred = sample + sample // 2
        else:
            preferred = 2 * sample
        size = choose_size(sample, preferred, low, high)
        if size == sample:
            notes.append(
                f"{members[0][0]} axis {members[0][1]} has no other size in its range [{max(low, 2)}, {high}]"
            )
            continue
        for m in members:
            sizes[m] = size
    for node, d in declared.items():
        if d.derived is not None:
            root_node = by_name.get(d.derived[0])
            if root_node is not None and root_node in sizes:
                sizes[node] = int(d.derived[1](sizes[root_node]))
    if not sizes:
        return None, "no declared dynamic axis can take another size: " + "; ".join(notes)
    for key, t in tensors.items():
        # integer inputs the role table does not know (cu_seqlens, grid_thw ...) usually describe the
        # other inputs' layout: values drawn for a new size would not describe them any more
        if input_role(key, t.dim(), present=tensors) is None and not t.is_floating_point():
            return None, (
                f"input {key!r} {tuple(t.shape)} holds integers the input-role table has no rule for; "
                "their values may depend on the other inputs' sizes, so pass second_inputs explicitly"
            )

    real = _real_positions(tensors) if reuse else {}
    out: dict[str, Any] = dict(others)
    for key, t in tensors.items():
        changed = {axis: size for (k, axis), size in sizes.items() if k == key}
        if not changed:
            out[key] = t
            continue
        shape = tuple(changed.get(axis, int(n)) for axis, n in enumerate(t.shape))
        role = input_role(key, t.dim(), present=tensors)
        if role is not None and role.kind in _NO_VALUE_RULE:
            return None, f"no rule to derive the values of {key!r} {tuple(t.shape)} at another shape"
        named = {role.batch_axis, role.sequence_axis} if role is not None else set()
        if role is not None and role.kind in _GENERATED and set(changed) <= named:
            reused = (
                _from_sample(t, role, shape, real.get(role.sequence or ""))
                if reuse and role.kind in _FROM_SAMPLE
                else None
            )
            out[key] = reused if reused is not None else _generate(t, role, shape, gen)
        else:
            out[key] = _tile(t, shape, gen)
    return _keep_placeholders(tensors, out, placeholders)


def validate_artifact(
    model: torch.nn.Module,
    run: Runner,
    inputs: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    label: str = "sample",
    raise_on_failure: bool = True,
    expected: Mapping[str, torch.Tensor] | None = None,
) -> list[OutputComparison]:
    """Run the artifact and eager PyTorch on ``inputs`` and compare every output.

    Args:
        model: the eager model (in eval mode, flags applied as for the export).
        run: the backend runner: forward kwargs -> ``{output_name: tensor}``.
        inputs: forward kwargs.
        atol / rtol: tolerances (``None``: :func:`default_tolerances` per output dtype).
        label: name of this input set in messages (``"sample"``, ``"second shape"``).
        raise_on_failure: raise when any output is off.
        expected: the eager outputs on ``inputs`` when already computed (``None``: run ``model``).

    Returns:
        The comparison rows.

    Raises:
        ExportValidationError: an output is missing, has another shape, or differs beyond
            tolerance; the message holds the table.
    """
    from hfexport.tensors import duplicate_leaf_tensors

    if expected is None:
        expected = eager_outputs(model, inputs)
    actual = run(duplicate_leaf_tensors(dict(inputs)))
    mask = inputs.get("attention_mask") if isinstance(inputs.get("attention_mask"), torch.Tensor) else None
    rows = compare_outputs(dict(expected), actual, atol=atol, rtol=rtol, attention_mask=mask)
    table = format_table(
        rows,
        title=f"validation on {label} inputs "
        + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor)),
    )
    logger.info("%s", table)
    if raise_on_failure and not all(r.ok for r in rows):
        bad = [r.name for r in rows if not r.ok]
        raise ExportValidationError(
            f"exported artifact does not match eager PyTorch on the {label} inputs for output(s) {bad}:\n{table}\n"
            "Pass a looser atol/rtol if the difference is expected (e.g. reduced precision), or report the model.",
            rows,
        )
    return rows
