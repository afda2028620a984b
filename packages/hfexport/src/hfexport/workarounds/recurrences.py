"""Recurrences that keep their sequence axis under ``torch.export``, shared by every backend.

transformers 5.x computes three recurrent constructs, on the CPU path every exporter traces, as a
Python loop over the tokens (``for t in range(seq_len)``):

- the **selective scan** of Mamba (``mamba_selective_scan`` in ``modeling_mamba``, copied verbatim
  into ``modeling_falcon_mamba`` and ``modeling_jamba``): ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t
  x_t``, ``y_t = C_t h_t``;
- RWKV's **time mixing** (``rwkv_linear_attention`` / ``rwkv_linear_attention_cpu`` in
  ``modeling_rwkv``): the WKV numerator and denominator, carried with a running maximum so the
  exponentials do not overflow;
- the **RG-LRU** of RecurrentGemma (``RecurrentGemmaRglru._rnn_scan``): ``h_t = a_t h_{t-1} +
  x_t``, reset where ``position_ids == 0``.

``torch.export`` runs such a loop in Python and records one copy of the body per token of the
sample, so the program only accepts the sample's sequence length (``Guard failed:
input_ids.size()[1] == 8`` on a second length). The loop-free branches transformers has are
closed under export (Mamba's ``associative_scan`` is gated by ``is_torchdynamo_compiling() and
not is_torchdynamo_exporting()``, pytorch/pytorch#146835, huggingface/transformers#43737).

This module expresses each recurrence in a form that keeps the sequence axis symbolic, in one of
two *forms*, chosen per backend by :func:`register_recurrences`:

- ``"scan"``: the loop body, unchanged, under torch's ``scan`` higher-order op
  (``torch._higher_order_ops.scan``): the program holds the body once and iterates it over the
  symbolic length. Same arithmetic, in the same order, as eager (agreement to float32 rounding).
  For backends that lower the op: ``torch.export`` programs (``hfexport-dynamo``) and the ONNX
  translation (an ONNX ``Scan``).
- ``"chunked"``: a loop-free parallel form built from ``cumsum``/``exp``/``matmul`` and a causal
  mask, for runtimes without a loop operator. The sequence is padded to a multiple of
  :data:`CHUNK` tokens; inside a chunk the recurrence is solved as a masked matrix of cumulative
  log-decays (segment sums), between chunks the chunk-final states are combined the same way over
  the chunk axis. Memory grows with ``channels * length * CHUNK`` inside chunks and ``channels *
  chunks**2`` between them; agreement with eager to about 1e-5 relative in float32. RWKV's
  chunked form is one masked ``[L, L]`` weighting per channel (its decay is the same at every
  step). The padding goes in front and the chunk count is one floor division, so torch.export
  keeps the length symbolic (no modulo it would have to prove divisible).

Registered: ``"scan"`` under ``"dynamo"`` and ``"onnx"``; ``"chunked"`` under ``"executorch"`` and
``"openvino"`` (their lowering of the scan op is not established; the chunked form needs none).

Mamba2's ``mamba2_chunk_scan`` (and its copies in bamba, falcon_h1, granitemoehybrid, nemotron_h and
zamba2) is loop-free already, but its padding to whole chunks is a modulo with a branch on it that
bounds the program below one chunk (256 tokens); :func:`mamba2_chunk_scan_padded` pads in front
instead, on every backend.

RWKV's token shift is ``nn.ZeroPad2d((0, 0, 1, -1))``: one zero step in front and the last step
cropped by a *negative* padding. ExecuTorch's portable ``constant_pad_nd`` kernel refuses negative
widths at run time ("Padding values must be non-negative", error 0x12, since pytorch/executorch#18018;
XNNPACK leaves such a pad to the portable kernel since pytorch/executorch#12935), so
:func:`register_time_shift_without_crop` (ExecuTorch only) pads by the non-negative widths and
crops with a slice instead.

The patches are installed around the capture only: the eager model used for validation runs the
original loop.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.registry import register_patch
from hfexport.workarounds.input_preparers import register_export_input_preparer

__all__ = [
    "CHUNK",
    "CHUNK_LOOP_FORMS",
    "CONSTANT_PAD_TARGETS",
    "FORMS",
    "GATED_DELTA_RULE_TARGETS",
    "KDA_CHUNK_TARGETS",
    "MAMBA2_CHUNK_SCAN_TARGETS",
    "MAMBA_SCAN_TARGETS",
    "RG_LRU_TARGETS",
    "RWKV_TARGETS",
    "constant_pad_without_negative_widths",
    "gated_delta_rule_chunks_as_a_loop",
    "gated_delta_rule_chunks_as_a_scan",
    "kda_chunks_as_a_loop",
    "kda_chunks_as_a_scan",
    "linear_recurrence",
    "mamba2_chunk_scan_padded",
    "mamba_selective_scan_in_form",
    "register_chunk_loops",
    "register_recurrences",
    "register_sliced_transpose_per_consumer",
    "register_time_shift_without_crop",
    "rg_lru_scan_in_form",
    "rwkv_rescaled_before_capture",
    "rwkv_time_mixing_in_form",
    "sliced_transpose_per_consumer",
]

logger = logging.getLogger(__name__)

#: The forms a backend may ask for: ``"scan"`` (torch's scan higher-order op) or ``"chunked"``
#: (loop-free segment sums).
FORMS: tuple[str, ...] = ("scan", "chunked")

#: Tokens per chunk of the ``"chunked"`` form.
CHUNK = 16

#: Mamba's sequential selective scan and its verbatim copies (transformers 5.x).
MAMBA_SCAN_TARGETS: tuple[str, ...] = (
    "transformers.models.mamba.modeling_mamba.mamba_selective_scan",
    "transformers.models.falcon_mamba.modeling_falcon_mamba.mamba_selective_scan",
    "transformers.models.jamba.modeling_jamba.mamba_selective_scan",
)
#: RWKV's time mixing (the dispatcher RwkvSelfAttention.forward calls).
RWKV_TARGETS: tuple[str, ...] = ("transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention",)
#: Mamba2's chunked scan and its verbatim copies (transformers 5.x): loop-free already, but its
#: ``pad_size = (chunk_size - L % chunk_size) % chunk_size`` and ``if pad_size > 0`` bound the program
#: to lengths below one chunk (4..255 for a sample of 8); every backend gets the padded call.
MAMBA2_CHUNK_SCAN_TARGETS: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}.mamba2_chunk_scan"
    for name in ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")
)
#: The chunked Kimi delta attention (KDA) of GLM-5-Next's linear-attention layers: a Python loop
#: over the 64-token chunks that capture unrolls (the language model kept the sample's chunk
#: count: ``Guard failed: inputs_embeds.size()[1] <= 64``, issue 28). kimi_linear and
#: bailing_hybrid hold verbatim copies; they are not listed until their cells are re-run with it.
KDA_CHUNK_TARGETS: tuple[str, ...] = (
    "transformers.models.glm5_next.modeling_glm5_next.chunk_kimi_delta_attention",
)
#: The chunked gated delta rule of Qwen3.5's linear-attention layers (``torch_chunk_gated_delta_rule``,
#: transformers 5.24): a Python loop over 64-token chunks that capture unrolls (the program kept the
#: sample's chunk count as a guard, pytorch/pytorch#161178, and served at most 64 tokens). qwen3_next,
#: olmo_hybrid, lara_mini and qwen4_exp hold verbatim copies; they are not listed until their cells are
#: re-run with it.
GATED_DELTA_RULE_TARGETS: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}.torch_chunk_gated_delta_rule"
    for name in ("qwen3_5", "qwen3_5_moe")
)
#: RecurrentGemma's RG-LRU loop.
RG_LRU_TARGETS: tuple[str, ...] = (
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru._rnn_scan",
)

_VERSIONS = {"transformers": ">=5.0,<6"}


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"recurrence form must be one of {FORMS}, got {form!r}")


def _scan(step: Callable[..., Any], init: Any, xs: Any) -> tuple[Any, Any]:
    # imported here: the higher-order op package pulls in dynamo, which the core does not need at import
    from torch._higher_order_ops.scan import scan

    return scan(step, init, xs)


#: The forms of a loop over chunks (:func:`_over_chunks`): torch's scan or while-loop higher-order op.
CHUNK_LOOP_FORMS: tuple[str, ...] = ("scan", "loop")


def _loop_over_chunks(
    step: Callable[..., Any], init: torch.Tensor, xs: tuple[torch.Tensor, ...], out_shape: tuple[Any, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan(step, init, xs)`` written with torch's ``while_loop`` higher-order op.

    OpenVINO's PyTorch frontend (2026.4) converts ``torch.ops.higher_order.while_loop`` into a
    ``Loop`` and has no rule for ``scan``; it also requires every tensor the body reads to be a
    carried input (a lifted ``additional_inputs`` tuple fails with "body_fn must return same
    number of outputs as carried inputs"), so the slices ``xs`` ride along as carried inputs the
    body returns as copies (a body may not return an input as it is). The chunk index is a carried
    int64 scalar; each step's ``[*out_shape]`` output is written into a zero buffer
    ``[chunks, *out_shape]`` by ``index_copy``.

    Args:
        step: ``(carry, tuple of xs[i]) -> (carry, out)``, ``carry`` of ``init``'s shape, strides
            and dtype, ``out`` of ``out_shape`` and ``init``'s dtype.
        init: the initial carry.
        xs: tensors with the iterated axis first (the same length for all).
        out_shape: the shape of one step's output.

    Returns:
        ``(final carry, outputs [len(xs[0]), *out_shape])``, as ``scan``.
    """
    from torch._higher_order_ops.while_loop import while_loop

    xs = tuple(x.contiguous() for x in xs)
    index = torch.zeros((), dtype=torch.int64, device=init.device)
    outs = torch.zeros((xs[0].shape[0], *out_shape), dtype=init.dtype, device=init.device)

    def cond(i: torch.Tensor, carry: torch.Tensor, outs: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        return i < xs[0].shape[0]

    def body(
        i: torch.Tensor, carry: torch.Tensor, outs: torch.Tensor, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        at = i.reshape(1)
        carry, out = step(carry, tuple(x.index_select(0, at).squeeze(0) for x in xs))
        outs = outs.index_copy(0, at, out.unsqueeze(0).contiguous())
        return (i + 1, carry.contiguous(), outs, *(x.clone() for x in xs))

    _, carry, outs, *_ = while_loop(cond, body, (index, init.contiguous(), outs, *xs))
    return carry, outs


def _over_chunks(
    form: str,
    step: Callable[..., Any],
    init: torch.Tensor,
    xs: tuple[torch.Tensor, ...],
    out_shape: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan(step, init, xs)`` in ``form`` (:data:`CHUNK_LOOP_FORMS`): the op, or :func:`_loop_over_chunks`."""
    if form not in CHUNK_LOOP_FORMS:
        raise ValueError(f"chunk loop form must be one of {CHUNK_LOOP_FORMS}, got {form!r}")
    if form == "scan":
        return _scan(step, init, xs)
    return _loop_over_chunks(step, init, xs, out_shape)


# --------------------------------------------------------------------------------------------
# The diagonal linear recurrence h_t = a_t * h_{t-1} + b_t, loop-free
# --------------------------------------------------------------------------------------------


def _pad_time(x: torch.Tensor, pad: Any) -> torch.Tensor:
    """Pad the time axis (dim 1) of ``x`` [B, L, ...] with ``pad`` zeros in front."""
    widths = [0, 0] * (x.dim() - 2) + [pad, 0]
    return F.pad(x, widths)


def _segment_decay(log_a: torch.Tensor) -> torch.Tensor:
    """``[..., T] -> [..., T, T]``: entry (t, s) is ``exp(sum(log_a[s+1..t]))`` for ``s <= t``, else 0.

    Each sum is accumulated on its own (a cumulative sum down the columns of a masked copy), not
    as a difference of two running totals, so long sequences lose no precision to cancellation.
    """
    steps = log_a.shape[-1]
    device = log_a.device
    rows = log_a.unsqueeze(-1).expand(*log_a.shape, steps)  # (t, s) = log_a[t]
    strictly = torch.ones(steps, steps, dtype=torch.bool, device=device).tril(-1)
    sums = torch.cumsum(rows.masked_fill(~strictly, 0.0), dim=-2)  # (t, s) = sum log_a[s+1..t]
    causal = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
    return torch.exp(sums.masked_fill(~causal, float("-inf")))


def linear_recurrence(
    log_a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, *, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``h_t = exp(log_a_t) * h_{t-1} + b_t`` over the time axis without a loop.

    Args:
        log_a: ``[B, L, *C]`` float tensor, the log of each step's decay (``<= 0`` for a stable
            recurrence; ``-inf`` resets the state).
        b: ``[B, L, *C]`` tensor of the same shape, each step's input.
        h0: ``[B, *C]`` initial state, zero when ``None``.
        chunk: tokens per chunk (the time axis is padded to a multiple of it).

    Returns:
        ``(states, last)``: ``states`` ``[B, L, *C]`` (every ``h_t``, float32 or ``b``'s dtype if
        wider) and ``last`` ``[B, *C]`` (``h_{L-1}``; ``L`` must be at least 1).

    Raises:
        ValueError: when ``log_a`` and ``b`` differ in shape or have fewer than 2 dimensions, or
            ``chunk < 1``.
    """
    if log_a.shape != b.shape or log_a.dim() < 2:
        raise ValueError(
            f"linear_recurrence needs log_a and b of one shape [B, L, ...], got {tuple(log_a.shape)} and {tuple(b.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    dtype = torch.promote_types(b.dtype, torch.float32)
    log_a, b = log_a.to(dtype), b.to(dtype)
    batch, length = b.shape[0], b.shape[1]
    channels = b.shape[2:]
    # chunk count written without a modulo, and one chunk more than needed, so that torch.export's
    # symbolic shapes follow it: the padded length is chunks * chunk by construction, and the count is
    # at least 2 for every length (a count of 1 at the sample would specialise size-1 axes). The padding
    # goes in front (decay 1, input 0: the state stays h0 through it), so the real steps are the tail
    chunks = (length + 2 * chunk - 1) // chunk  # one floor division: chunks * chunk stays a product
    pad = chunks * chunk - length
    # reset steps (-inf) would give -inf - -inf = nan in the segment sums: a large negative is exact in float32
    log_a = torch.clamp(log_a, min=-1e4)
    log_a, b = _pad_time(log_a, pad), _pad_time(b, pad)
    # [B, *C, N, T]: channels first so the segment matrices sit on the last two axes
    perm = [0, *range(3, 3 + len(channels)), 1, 2]
    log_a = log_a.reshape(batch, -1, chunk, *channels).permute(*perm)
    b = b.reshape(batch, -1, chunk, *channels).permute(*perm)
    # 1. inside each chunk, from a zero state: h_local[t] = sum_{s<=t} exp(sum log_a[s+1..t]) b[s]
    local = (_segment_decay(log_a) @ b.unsqueeze(-1)).squeeze(-1)  # [B, *C, N, T]
    # 2. the state entering each chunk: combine the chunk-final local states over the chunk axis
    cum = torch.cumsum(log_a, dim=-1)  # decay from the chunk start to each step
    total = cum[..., -1]  # [B, *C, N] decay over a whole chunk
    final = local[..., -1]  # [B, *C, N]
    # entering[n] = sum_{m<n} exp(sum total[m+1..n-1]) final[m]  (+ exp(sum total[0..n-1]) h0)
    shifted = F.pad(total, (1, 0))[..., :-1]  # shifted[n] = total[n-1], decay applied when entering chunk n
    through = _segment_decay(shifted)  # [B, *C, N, N]: (n, m) = exp(sum shifted[m+1..n])
    prior = F.pad(final, (1, 0))[..., :-1]  # prior[m] = final[m-1]: chunk m-1's state, entering chunk m
    entering = (through @ prior.unsqueeze(-1)).squeeze(-1)  # [B, *C, N]
    if h0 is not None:
        entering = entering + torch.exp(torch.cumsum(shifted, dim=-1)) * h0.to(dtype).unsqueeze(-1)
    # 3. every state: local part plus the entering state decayed to the step
    states = local + torch.exp(cum) * entering.unsqueeze(-1)  # [B, *C, N, T]
    inverse = [0, len(channels) + 1, len(channels) + 2, *range(1, len(channels) + 1)]
    states = states.permute(*inverse).reshape(batch, -1, *channels)
    # the real steps are the last `length` (a gather: a slice starting at `pad` would make torch.export
    # ask for a proof that pad >= 0, which it cannot give for a floor division)
    real = torch.arange(length, device=states.device) + pad
    return states.index_select(1, real), states[:, -1]


# --------------------------------------------------------------------------------------------
# Mamba's selective scan
# --------------------------------------------------------------------------------------------


def mamba_selective_scan_in_form(
    form: str,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba's selective scan (transformers' ``mamba_selective_scan`` contract) in ``form``.

    Args:
        form: ``"scan"`` or ``"chunked"`` (see the module docstring).
        hidden_states: ``[B, D, L]`` the convolved inputs ``x``.
        dt: ``[B, D, L]`` time steps (before ``delta_bias`` / softplus).
        A: ``[D, N]`` the (negative) state matrix diagonal.
        B, C: ``[B, N, L]`` the input-dependent projections.
        D: ``[D]`` skip weights, or ``None``.
        z: ``[B, D, L]`` gate, or ``None``.
        delta_bias: ``[D]`` added to ``dt``, or ``None``.
        delta_softplus: apply softplus to ``dt``.
        return_last_state: also return the final state.
        **kwargs: ``use_mambapy`` / ``use_associative_scan`` and others, ignored (one form serves all).

    Returns:
        ``y`` ``[B, D, L]`` in ``hidden_states``' dtype, and the final state ``[B, D, N]`` (float32)
        when ``return_last_state``.

    Raises:
        ValueError: for an unknown ``form``.
    """
    _check_form(form)
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    # time first: [B, L, D, N]
    dt_t = dt.transpose(1, 2).float()
    log_decay = A.float()[None, None] * dt_t[..., None]
    drive = (
        dt_t[..., None]
        * B.transpose(1, 2).float()[:, :, None, :]
        * hidden_states.transpose(1, 2).float()[..., None]
    )
    c_t = C.transpose(1, 2)  # [B, L, N]
    if form == "scan":

        def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            decay, inp, c = xs
            state = torch.exp(decay) * state + inp
            out = torch.matmul(state.to(input_dtype), c.unsqueeze(-1))[..., 0]
            return state, out

        init = torch.zeros_like(drive[:, 0], memory_format=torch.contiguous_format)
        last, ys = _scan(step, init, (log_decay.transpose(0, 1), drive.transpose(0, 1), c_t.transpose(0, 1)))
        y = ys.permute(1, 2, 0)  # [L, B, D] -> [B, D, L]
    else:
        states, last = linear_recurrence(log_decay, drive)
        y = torch.matmul(states.to(input_dtype), c_t.unsqueeze(-1))[..., 0].transpose(1, 2)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    if return_last_state:
        return y, last
    return y


# --------------------------------------------------------------------------------------------
# Mamba2's chunked scan: whole chunks only
# --------------------------------------------------------------------------------------------


def mamba2_chunk_scan_padded(
    original: Callable[..., Any],
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    *args: Any,
    initial_states: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """Call transformers' ``mamba2_chunk_scan`` on whole chunks, so capture keeps the length symbolic.

    The inputs get zero steps in front up to a whole number of chunks, one more than needed (one
    floor division, so ``torch.export`` sees ``L % chunk_size == 0`` and drops the branch on the
    padding, and at least two chunks, so a one-chunk sample specialises nothing); with a zero
    initial state, a zero step leaves the state at zero and outputs zero, so the real steps' outputs
    and the final state are unchanged. The real steps are gathered back from the tail.

    Args:
        original: transformers' ``mamba2_chunk_scan``.
        hidden_states: ``[B, L, H, P]``; dt ``[B, L, H]``; A ``[H]``; B, C ``[B, L, G, N]``.
        chunk_size: the model's chunk size.
        *args, **kwargs: passed on unchanged (``D``, ``dt_bias``, ``return_final_states``, ...).
        initial_states: ``[B, H, P, N]`` or ``None``; with a state the call is passed on unpadded
            (a zero step would decay it).

    Returns:
        What ``original`` returns: ``y [B, L, H, P]``, or ``(y, final_state)``.
    """
    if initial_states is not None:
        return original(
            hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states, **kwargs
        )
    length = hidden_states.shape[1]
    # one chunk more than needed: at least 2 chunks at any length, so a 1-chunk sample does not specialise
    pad = chunk_size * ((length + 2 * chunk_size - 1) // chunk_size) - length

    def front(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, [0, 0] * (x.dim() - 2) + [pad, 0])

    result = original(front(hidden_states), front(dt), A, front(B), front(C), chunk_size, *args, **kwargs)
    real = torch.arange(length, device=hidden_states.device) + pad
    if isinstance(result, tuple):
        return (result[0].index_select(1, real), *result[1:])
    return result.index_select(1, real)


# --------------------------------------------------------------------------------------------
# RWKV's time mixing (WKV)
# --------------------------------------------------------------------------------------------


def rwkv_time_mixing_in_form(
    form: str,
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
    return_state: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """RWKV's WKV time mixing (transformers' ``rwkv_linear_attention`` contract) in ``form``.

    Args:
        form: ``"scan"`` or ``"chunked"``.
        time_decay, time_first: ``[C]`` per-channel decay (``w = -exp(time_decay)`` per step) and
            bonus of the current token.
        key, value: ``[B, L, C]``.
        state: ``(numerator, denominator, max)`` ``[B, C]`` float32 each, or ``None`` (empty).
        return_state: return the final state also when ``state`` is ``None``.

    Returns:
        ``(output [B, L, C] in key's dtype, [numerator, denominator, max] or None)``; the
        returned state holds the same quantities as transformers' CPU loop (the real numerator
        and denominator are ``numerator * exp(max)`` and ``denominator * exp(max)``).

    Raises:
        ValueError: for an unknown ``form``.
    """
    _check_form(form)
    w = -torch.exp(time_decay.float())
    u = time_first.float()
    if state is None:
        num = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den = torch.zeros_like(key[:, 0], dtype=torch.float32)
        mx = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
    else:
        num, den, mx = state
    if form == "scan":
        # the carry must keep one layout through the scan: the state slices arrive strided
        num, den, mx = (t.float().contiguous() for t in (num, den, mx))

        def step(
            carry: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, torch.Tensor]
        ) -> tuple[Any, torch.Tensor]:
            n, d, m = carry
            k, v = xs
            k = k.float()
            top = torch.maximum(m, k + u)
            e1, e2 = torch.exp(m - top), torch.exp(k + u - top)
            out = ((e1 * n + e2 * v) / (e1 * d + e2)).to(key.dtype)
            top = torch.maximum(m + w, k)
            e1, e2 = torch.exp(m + w - top), torch.exp(k - top)
            return (e1 * n + e2 * v, e1 * d + e2, top), out

        (num, den, mx), ys = _scan(step, (num, den, mx), (key.transpose(0, 1), value.transpose(0, 1)))
        output = ys.transpose(0, 1)
    else:
        output, (num, den, mx) = _rwkv_chunked(w, u, key, value, num, den, mx)
    if return_state or state is not None:
        return output, [num, den, mx]
    return output, None


def _rwkv_chunked(
    w: torch.Tensor,
    u: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num: torch.Tensor,
    den: torch.Tensor,
    mx: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """WKV without a loop: the past of step t is ``sum_{s<t} exp(k_s + (t-1-s) w) v_s`` (+ the state).

    The decay ``w`` is the same at every step, so the weight of token ``s`` seen from step ``t``
    is ``k_s + (t-1-s) w``; every weight of a row is shifted by the row's maximum before ``exp``
    (as the loop's running maximum does), so no exponential overflows.
    """
    length = key.shape[1]
    k = key.float()
    v = value.float()
    steps = torch.arange(length, device=key.device, dtype=torch.float32)
    # [L_t, L_s] log weights of past tokens (s < t); the current token carries k_t + u
    lag = steps[:, None] - 1 - steps[None, :]
    past = k[:, None, :, :] + lag[None, :, :, None] * w  # [B, Lt, Ls, C]
    strictly = torch.ones(length, length, dtype=torch.bool, device=key.device).tril(-1)
    past = past.masked_fill(~strictly[None, :, :, None], float("-inf"))
    # the carried state enters at step t with log weight mx + t * w
    carried = mx[:, None, :] + steps[None, :, None] * w  # [B, Lt, C]
    current = k + u  # [B, Lt, C]
    top = torch.maximum(torch.maximum(past.amax(dim=2), carried), current)  # [B, Lt, C]
    e_past = torch.exp(past - top[:, :, None, :])
    e_carried = torch.exp(carried - top)
    e_current = torch.exp(current - top)
    numerator = (e_past * v[:, None, :, :]).sum(dim=2) + e_carried * num[:, None, :] + e_current * v
    denominator = e_past.sum(dim=2) + e_carried * den[:, None, :] + e_current
    output = (numerator / denominator).to(key.dtype)
    # final state: every token decayed to the end, k_s + (L-1-s) w, and the carried state mx + L w
    final_log = k + (length - 1 - steps)[None, :, None] * w  # [B, L, C]
    final_carried = mx + length * w
    new_mx = torch.maximum(final_log.amax(dim=1), final_carried)
    e_tokens = torch.exp(final_log - new_mx[:, None, :])
    e_state = torch.exp(final_carried - new_mx)
    new_num = (e_tokens * v).sum(dim=1) + e_state * num
    new_den = e_tokens.sum(dim=1) + e_state * den
    return output, (new_num, new_den, new_mx)


# --------------------------------------------------------------------------------------------
# RecurrentGemma's RG-LRU
# --------------------------------------------------------------------------------------------


def rg_lru_scan_in_form(
    form: str,
    original: Callable[..., Any],
    module: Any,
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RecurrentGemma's ``RecurrentGemmaRglru._rnn_scan`` in ``form``.

    Args:
        form: ``"scan"`` or ``"chunked"``.
        original: the method replaced, still used for a static one-token input (decoding).
        module: the ``RecurrentGemmaRglru`` instance.
        hidden_states: ``[B, L, W]`` normalised inputs ``x_t``.
        recurrent_gate: ``[B, L, W]`` decays ``a_t``.
        reset: ``[B, L, 1]`` bool, where the state restarts (``position_ids == 0``).
        recurrent_states: ``[B, W]`` initial state, or ``None`` (zeros).
        acc_dtype: accumulation dtype.

    Returns:
        ``(states [B, L, W] in hidden_states' dtype, last state [B, W] in acc_dtype)``.

    Raises:
        ValueError: for an unknown ``form``.
    """
    _check_form(form)
    length = hidden_states.shape[1]
    if isinstance(length, int) and length == 1:
        return original(module, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    gate = (recurrent_gate * ~reset).to(acc_dtype)
    if recurrent_states is None:
        recurrent_states = torch.zeros(
            hidden_states[:, 0].shape, dtype=acc_dtype, device=hidden_states.device
        )
    recurrent_states = recurrent_states.to(acc_dtype).contiguous()
    if form == "scan":
        out_dtype = hidden_states.dtype

        def step(
            state: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            a, x = xs
            state = a * state + x.to(acc_dtype)
            return state, state.to(out_dtype, copy=True)  # a scan output may not alias the carry

        last, ys = _scan(step, recurrent_states, (gate.transpose(0, 1), hidden_states.transpose(0, 1)))
        return ys.transpose(0, 1), last
    states, last = linear_recurrence(torch.log(gate), hidden_states.to(acc_dtype), recurrent_states)
    return states.to(hidden_states.dtype), last.to(acc_dtype)


# --------------------------------------------------------------------------------------------
# Negative padding widths (RWKV's token shift) as a pad and a slice
# --------------------------------------------------------------------------------------------

#: ``nn.ZeroPad2d`` / ``nn.ConstantPad*d``'s forward (RWKV's ``time_shift`` is a ``ZeroPad2d``).
CONSTANT_PAD_TARGETS: tuple[str, ...] = ("torch.nn.modules.padding._ConstantPadNd.forward",)


def constant_pad_without_negative_widths(
    x: torch.Tensor, padding: tuple[int, ...] | list[int], value: float = 0.0
) -> torch.Tensor:
    """``F.pad(x, padding, "constant", value)`` with every negative width done as a slice.

    Args:
        x: any tensor with at least ``len(padding) // 2`` dimensions.
        padding: ``F.pad`` widths, last dimension first (``(left, right, top, bottom, ...)``);
            a negative width removes that many steps on its side.
        value: the fill value.

    Returns:
        The tensor ``F.pad`` returns (same shape and values); the pad it records has only
        non-negative widths, and the crops are ``narrow`` slices.

    Raises:
        ValueError: an odd number of widths, or more pairs than ``x`` has dimensions.
    """
    widths = [int(w) for w in padding]
    if len(widths) % 2 or len(widths) // 2 > x.dim():
        raise ValueError(
            f"padding needs one (before, after) pair per padded dimension, at most {x.dim()} pairs; got {widths}"
        )
    out = F.pad(x, [max(w, 0) for w in widths], "constant", value)
    for pair in range(len(widths) // 2):
        dim = out.dim() - 1 - pair
        before, after = -min(widths[2 * pair], 0), -min(widths[2 * pair + 1], 0)
        if before or after:
            # a side is either padded or cropped, so cropping the padded tensor is exact
            out = out.narrow(dim, before, out.shape[dim] - before - after)
    return out


def _constant_pad_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        if all(int(w) >= 0 for w in self.padding):
            return original(self, input)
        return constant_pad_without_negative_widths(input, tuple(self.padding), self.value)

    return forward


_constant_pad_factory.__name__ = _constant_pad_factory.__qualname__ = "constant_pad_crop_as_slice"


def register_time_shift_without_crop(backend: str, *, versions: Mapping[str, str]) -> None:
    """Register, under ``backend``, ``nn.ZeroPad2d`` / ``ConstantPad*d`` modules with negative
    widths (RWKV's token shift) as a non-negative pad and a slice (see the module docstring).

    Args:
        backend: registry key (the runtime whose pad kernel refuses negative widths).
        versions: distribution -> specifier set of that runtime in which the fix is needed.

    Raises:
        ValueError: an invalid ``backend`` key or ``versions``.
    """
    register_patch(
        backend,
        *CONSTANT_PAD_TARGETS,
        description=(
            "constant padding modules with negative widths (RWKV's token shift ZeroPad2d((0, 0, 1, -1))) as a "
            "pad by the non-negative widths and a slice: the portable constant_pad_nd kernel refuses negative "
            "widths at run time (error 0x12)"
        ),
        issue="https://github.com/pytorch/executorch/pull/18018",
        versions=versions,
    )(_constant_pad_factory)


# --------------------------------------------------------------------------------------------
# RWKV's lazy inference rescaling, done before capture
# --------------------------------------------------------------------------------------------


@register_export_input_preparer(
    "input_ids",
    description=(
        "RWKV: rescale the weights (RwkvModel._rescale_layers) eagerly before capture, as the model's first eval "
        "forward would, instead of tracing the in-place division into the program (ExecuTorch returned more "
        "outputs than the program's spec: 'leaves has length 10 but the spec refers to a pytree that holds 6')"
    ),
    # no upstream issue found; the PR that added RWKV and its in-place inference rescaling
    issue="https://github.com/huggingface/transformers/pull/22797",
    versions=_VERSIONS,
)
def rwkv_rescaled_before_capture(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run RWKV's one-time inference rescaling eagerly, before capture.

    ``RwkvModel.forward`` divides two weight matrices per layer in place by ``2 ** (layer //
    rescale_every)`` the first time it runs in eval mode (and flags it, ``layers_are_rescaled``).
    Captured on a model that never ran, the division and its write-back into the parameters are
    traced; done here, the program holds the rescaled weights as eager inference does.

    Args:
        model: the model being exported (any module; RWKV models are found among its submodules).
        inputs: the forward kwargs, returned unchanged.

    Returns:
        ``inputs``.
    """
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        rescale = getattr(module, "_rescale_layers", None)
        if (
            type(module).__name__ == "RwkvModel"
            and callable(rescale)
            and module.training == getattr(module, "layers_are_rescaled", None)
        ):
            rescale()
    return inputs


# --------------------------------------------------------------------------------------------
# A transpose of a slice with several consumers (RecurrentGemma on XNNPACK)
# --------------------------------------------------------------------------------------------

_TRANSPOSES = ("aten.transpose.int", "aten.permute.default", "aten.permute_copy.default")


def sliced_transpose_per_consumer(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Give each consumer of a transposed slice its own transpose.

    RecurrentGemma's recurrent block transposes a slice of its convolution output
    (``self.conv_1d(x)[..., :seq_len]`` then ``.transpose(1, 2)``) and uses the result twice. The
    XNNPACK partitioner leaves the dynamic slice out and delegates the transpose alone, and the
    delegate then returns that one value twice, which its preprocessing refuses ("Output node
    'aten_permute_copy_default' is already in the inputs ... pass through arguments, which are not
    supported in XNNPACK Delegate", pytorch/executorch#19152, executorch 1.4.1). One transpose per
    consumer gives each delegate output one value; the values are unchanged.

    Args:
        gm: the graph module holding ``node``.
        node: any ``call_function`` node; rewritten when it is a transpose/permute of an
            ``aten.slice`` with more than one consumer.

    Returns:
        True when ``node`` was rewritten.
    """
    if str(node.target) not in _TRANSPOSES or len(node.users) < 2:
        return False
    source = node.args[0] if node.args else None
    if not isinstance(source, torch.fx.Node) or str(source.target) != "aten.slice.Tensor":
        return False
    for user in list(node.users)[1:]:
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_function(node.target, node.args, dict(node.kwargs))
        copy.meta.update(node.meta)
        user.replace_input_with(node, copy)
    return True


def register_sliced_transpose_per_consumer(backend: str, *, versions: Mapping[str, str]) -> None:
    """Register :func:`sliced_transpose_per_consumer` as an FX node fix under ``backend``.

    Args:
        backend: registry key (the XNNPACK lowering).
        versions: distribution -> specifier set in which the fix is needed.

    Raises:
        ValueError: an invalid ``backend`` key or ``versions``.
    """
    from hfexport.registry import register_fx_node_fix

    register_fx_node_fix(
        backend,
        description=(
            "one transpose per consumer of a transposed slice (RecurrentGemma's recurrent block): the XNNPACK "
            "delegate of a lone transpose returned one value twice, which its preprocessing refuses"
        ),
        issue="https://github.com/pytorch/executorch/issues/19152",
        versions=versions,
    )(sliced_transpose_per_consumer)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _mamba_factory(form: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def replacement(*args: Any, **kwargs: Any) -> Any:
            return mamba_selective_scan_in_form(form, *args, **kwargs)

        return replacement

    factory.__name__ = factory.__qualname__ = f"mamba_selective_scan_{form}"
    return factory


def _rwkv_factory(form: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def replacement(*args: Any, **kwargs: Any) -> Any:
            return rwkv_time_mixing_in_form(form, *args, **kwargs)

        return replacement

    factory.__name__ = factory.__qualname__ = f"rwkv_time_mixing_{form}"
    return factory


def _rg_lru_factory(form: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
            return rg_lru_scan_in_form(form, original, self, *args, **kwargs)

        return replacement

    factory.__name__ = factory.__qualname__ = f"rg_lru_scan_{form}"
    return factory


def _mamba2_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        return mamba2_chunk_scan_padded(original, *args, **kwargs)

    return replacement


_mamba2_factory.__name__ = _mamba2_factory.__qualname__ = "mamba2_chunk_scan_whole_chunks"


def _kda_in_form(original: Callable[..., Any], form: str) -> Callable[..., Any]:
    """Replace ``chunk_kimi_delta_attention`` (GLM-5-Next) while capturing: the loop over chunks as
    torch's scan higher-order op (``form="scan"``) or its while-loop op (``form="loop"``, see
    :func:`_loop_over_chunks`), the sequence padded in front.

    Upstream pads the sequence at the end to whole chunks of ``chunk_size`` (64) tokens, solves each
    chunk's delta rule in closed form (a triangular forward substitution over its positions) and
    carries the ``[batch, heads, key_dim, value_dim]`` state from chunk to chunk in a Python loop,
    which capture unrolls for the sample's chunk count. Here the same per-chunk terms are computed
    for all chunks at once and the state is carried by ``scan`` over the chunk axis, so the program
    serves any length. The padding goes in front (zero keys, values, gates and betas leave the
    state unchanged and add nothing to later tokens' attention), so the chunk count is one floor
    division torch.export keeps symbolic (an end padding's modulo would have to be proved
    divisible), and it spans one chunk more than needed, so the count is never 1 (a one-chunk
    sample would be specialised). Only the chunk boundaries move: equal to upstream up to float
    rounding (about 3e-7 in float32).

    Returns:
        ``(core_attn_out [batch, length, heads, value_dim] in the query's dtype, final state
        [batch, heads, key_dim, value_dim] float32 or None)``, as upstream.
    """
    import inspect
    import sys

    l2norm = sys.modules[inspect.unwrap(original).__module__].l2norm  # the modeling file's own

    @functools.wraps(original)
    def chunk_kimi_delta_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = query.dtype
        q, k, v, b, g = (
            x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)
        )
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
        batch, heads, length, key_dim = k.shape
        value_dim = v.shape[-1]
        size = int(chunk_size)
        # one more chunk than the tokens fill, so the count is never 1 (which torch.export would
        # specialise at a one-chunk sample), written as one floor division: the padded length is
        # then size * chunks, divisible by both as torch.export must prove (as for Mamba2 above)
        chunks = (length + 2 * size - 1) // size
        pad = size * chunks - length

        def chunked(x: torch.Tensor) -> torch.Tensor:
            """``[batch, heads, length, d] -> [batch, heads, chunks, size, d]``, zero steps in front."""
            return F.pad(x, [0, 0, pad, 0]).reshape(batch, heads, -1, size, x.shape[-1])

        q = chunked(q * (1 / (query.shape[-1] ** 0.5)))
        k, v, g = chunked(k), chunked(v), chunked(g)
        b = chunked(b[..., None])
        k_beta, v_beta = k * b, v * b
        g = g.cumsum(dim=-2)  # per-channel log-decay accumulated inside each chunk
        device = q.device
        upper = torch.ones(size, size, dtype=torch.bool, device=device).triu(0)
        strictly_upper = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
        # (i, j, c): decay of channel c from position j to i within a chunk (j <= i), else 0
        decay = (
            (g[..., :, None, :] - g[..., None, :, :])
            .masked_fill(strictly_upper[..., None], float("-inf"))
            .exp()
        )
        system = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(upper, 0)
        for i in range(1, size):  # forward substitution of the unit lower-triangular system
            row = system[..., i, :i].clone()
            system[..., i, :i] = row + (row[..., None] * system[..., :i, :i].clone()).sum(-2)
        system = system + torch.eye(size, dtype=system.dtype, device=device)
        u = system @ v_beta
        w = system @ (k_beta * g.exp())
        state = (
            torch.zeros(batch, heads, key_dim, value_dim, dtype=u.dtype, device=device)
            if initial_state is None
            else initial_state.to(u)
        )

        def step(carry: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            q_c, k_c, u_c, g_c, w_c, decay_c = xs
            future = torch.ones(size, size, dtype=torch.bool, device=q_c.device).triu(1)
            intra = (q_c[..., :, None, :] * k_c[..., None, :, :] * decay_c).sum(-1).masked_fill(future, 0)
            fresh = u_c - w_c @ carry
            out = (q_c * g_c.exp()) @ carry + intra @ fresh
            last = g_c[..., -1:, :]
            carry = (
                carry * last.exp().transpose(-1, -2) + (k_c * (last - g_c).exp()).transpose(-1, -2) @ fresh
            )
            return carry, out

        xs = tuple(x.movedim(2, 0) for x in (q, k, u, g, w, decay))
        state, out = _over_chunks(form, step, state, xs, (batch, heads, size, value_dim))
        # the real steps by index (a slice from a symbolic start leaves guards torch.export cannot prove)
        real = torch.arange(length, device=device) + pad
        out = out.movedim(0, 2).flatten(2, 3).index_select(2, real)
        out = out.transpose(1, 2).contiguous().to(dtype)
        return out, (state if output_final_state else None)

    return chunk_kimi_delta_attention


def kda_chunks_as_a_scan(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_kda_in_form` with torch's scan higher-order op (dynamo, ONNX: an ONNX ``Scan``)."""
    return _kda_in_form(original, "scan")


def kda_chunks_as_a_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_kda_in_form` with torch's while-loop higher-order op (OpenVINO: a ``Loop``)."""
    return _kda_in_form(original, "loop")


def _gated_delta_rule_in_form(original: Callable[..., Any], form: str) -> Callable[..., Any]:
    """Replace ``torch_chunk_gated_delta_rule`` (Qwen3.5, Qwen3-Next style linear attention) while
    capturing: the loop over 64-token chunks as torch's scan (``form="scan"``) or while-loop
    (``form="loop"``) higher-order op, the sequence padded in front.

    Upstream pads the sequence at the end to whole chunks, computes every chunk's terms at once
    (the pairwise decays, the UT transform ``(I + L)^-1`` of the chunk's delta-rule system, the
    intra-chunk attention), then carries the ``[batch, v_heads, k_head_dim, v_head_dim]`` state
    through the chunks in a Python loop, which capture unrolls for the sample's chunk count: the
    program keeps that count as a guard (``(L + pad) // 64 == 1``, kept out of the range
    constraints, pytorch/pytorch#161178), so it serves at most 64 tokens. Here the chunk terms are
    the same and the state is carried by the op over the chunk axis, so the program serves any
    length. The padding goes in front: zero keys, values and betas and a zero log-decay leave the
    state unchanged and add nothing to later tokens, as upstream's end padding does; the chunk
    count is one floor division torch.export keeps symbolic, one chunk more than needed so it is
    never 1 (a one-chunk sample would be specialised). The UT transform is upstream's own choice
    (``torch.linalg.solve_triangular`` in eager, the forward substitution under export: the
    modeling module's ``is_torchdynamo_exporting`` is read at each call, as upstream reads it).
    Only the chunk boundaries move: equal to upstream up to float32 rounding.

    Args:
        query, key: ``[batch, length, k_heads, k_head_dim]``.
        value: ``[batch, length, v_heads, v_head_dim]`` (``v_heads`` a multiple of ``k_heads``).
        g: ``[batch, length, v_heads]`` log-decays (<= 0). beta: ``[batch, length, v_heads]``.
        chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel: as upstream.

    Returns:
        ``(core_attn_out [batch, length, v_heads, v_head_dim] in the query's dtype, final state
        [batch, v_heads, k_head_dim, v_head_dim] float32 or None)``, as upstream.
    """
    import inspect
    import sys

    module = sys.modules[inspect.unwrap(original).__module__]  # the modeling file's own helpers
    l2norm = module.l2norm

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = query.dtype
        batch, length, k_heads, key_dim = key.shape
        heads, value_dim = value.shape[-2:]
        if k_heads != heads:  # grouped value heads: each key head serves heads // k_heads of them
            query = query.repeat_interleave(heads // k_heads, dim=2)
            key = key.repeat_interleave(heads // k_heads, dim=2)
        q, k, v, b, g = (
            x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
            for x in (query, key, value, beta, g)
        )
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
        q = q * (q.shape[-1] ** -0.5)
        size = int(chunk_size)
        # one more chunk than the tokens fill (never 1), one floor division (see kda_chunks_as_a_scan)
        chunks = (length + 2 * size - 1) // size
        pad = size * chunks - length
        q, k, v = (F.pad(x, [0, 0, pad, 0]).reshape(batch, heads, -1, size, x.shape[-1]) for x in (q, k, v))
        b, g = (F.pad(x, [pad, 0]).reshape(batch, heads, -1, size) for x in (b, g))
        k_beta, v_beta = k * b[..., None], v * b[..., None]
        g = g.cumsum(dim=-1)  # log-decay accumulated inside each chunk
        device = q.device
        strictly_upper = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
        decay = (g[..., :, None] - g[..., None, :]).masked_fill(strictly_upper, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * decay
        intra = (q @ k.transpose(-1, -2)) * decay
        decayed_k_beta = k_beta * g.exp()[..., None]
        if not module.is_torchdynamo_exporting():
            u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
            w = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
        else:  # forward substitution of the unit lower-triangular system, as upstream under export
            system = -system.tril(-1)
            for i in range(1, size):
                row = system[..., i, :i].clone()
                system[..., i, :i] = row + (row[..., None] * system[..., :i, :i].clone()).sum(-2)
            system = system + torch.eye(size, dtype=system.dtype, device=device)
            u, w = system @ v_beta, system @ decayed_k_beta
        state = (
            torch.zeros(batch, heads, key_dim, value_dim, dtype=u.dtype, device=device)
            if initial_state is None
            else initial_state.to(u)
        )
        q = q * g.exp()[..., None]
        k = k * (g[..., -1:] - g).exp()[..., None]
        chunk_decay = g[..., -1].exp()[..., None, None]

        def step(carry: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            q_c, k_c, u_c, w_c, intra_c, decay_c = xs
            fresh = u_c - w_c @ carry
            out = q_c @ carry + intra_c @ fresh
            carry = carry * decay_c + k_c.transpose(-1, -2) @ fresh
            return carry, out

        xs = tuple(x.movedim(2, 0) for x in (q, k, u, w, intra, chunk_decay))
        state, out = _over_chunks(form, step, state, xs, (batch, heads, size, value_dim))
        # the real steps by index (a slice from a symbolic start leaves guards torch.export cannot prove)
        real = torch.arange(length, device=device) + pad
        out = out.movedim(0, 2).flatten(2, 3).index_select(2, real)
        out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
        return out, (state if output_final_state else None)

    return torch_chunk_gated_delta_rule


def gated_delta_rule_chunks_as_a_scan(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_gated_delta_rule_in_form` with torch's scan higher-order op (dynamo, ONNX)."""
    return _gated_delta_rule_in_form(original, "scan")


def gated_delta_rule_chunks_as_a_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_gated_delta_rule_in_form` with torch's while-loop higher-order op (OpenVINO: a ``Loop``)."""
    return _gated_delta_rule_in_form(original, "loop")


def register_recurrences(backend: str, *, form: str) -> None:
    """Register the three recurrence patches under ``backend`` in ``form``, and Mamba2's padded call.

    Args:
        backend: registry key, e.g. ``"dynamo"`` or ``"executorch.xnnpack"``.
        form: ``"scan"`` where the backend lowers torch's scan higher-order op, ``"chunked"``
            otherwise.

    Raises:
        ValueError: for an unknown ``form`` or an invalid ``backend`` key.
    """
    _check_form(form)
    how = "torch's scan higher-order op" if form == "scan" else "chunked segment sums"
    register_patch(
        backend,
        *MAMBA_SCAN_TARGETS,
        description=(
            f"Mamba selective scan (mamba, falcon_mamba, jamba) as {how} instead of a Python loop over "
            "the tokens, which capture unrolls (the program kept the sample's sequence length)"
        ),
        issue="https://github.com/pytorch/pytorch/issues/146835",
        versions=_VERSIONS,
    )(_mamba_factory(form))
    register_patch(
        backend,
        *RWKV_TARGETS,
        description=(
            f"RWKV time mixing (WKV) as {how} instead of the CPU loop over the tokens, which capture "
            "unrolls (Guard failed: input_ids.size()[1] == 8 on a second length)"
        ),
        # no RWKV issue found upstream; the loop construct and the op that replaces it
        issue="https://github.com/pytorch/pytorch/issues/50688",
        versions=_VERSIONS,
    )(_rwkv_factory(form))
    register_patch(
        backend,
        *RG_LRU_TARGETS,
        description=(
            f"RecurrentGemma RG-LRU as {how} instead of the loop over the tokens, which capture unrolls "
            "(Guard failed: input_ids.size()[1] == 8 on a second length)"
        ),
        # the PR that gave mamba/recurrent_gemma a scan op kept it off under export
        issue="https://github.com/huggingface/transformers/pull/43737",
        versions=_VERSIONS,
    )(_rg_lru_factory(form))
    if form == "scan":
        register_chunk_loops(backend, form="scan")
    register_patch(
        backend,
        *MAMBA2_CHUNK_SCAN_TARGETS,
        description=(
            "Mamba2 chunked scan (mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h, zamba2) on zero-padded "
            "whole chunks, so the program is not bounded to lengths below one chunk"
        ),
        issue="https://github.com/pytorch/pytorch/issues/146835",
        versions=_VERSIONS,
    )(_mamba2_factory)


def register_chunk_loops(
    backend: str,
    *,
    form: str,
    issue_override: str | None = None,
    runtime_versions: Mapping[str, str] | None = None,
) -> None:
    """Register the chunked linear attentions' loops over chunks under ``backend`` in ``form``.

    GLM-5-Next's chunked Kimi delta attention (:data:`KDA_CHUNK_TARGETS`) and Qwen3.5's chunked
    gated delta rule (:data:`GATED_DELTA_RULE_TARGETS`) loop over 64-token chunks in Python; capture
    unrolls the loop at the sample's chunk count and bounds the program to it.

    Args:
        backend: registry key, e.g. ``"dynamo"`` or ``"openvino"``.
        form: ``"scan"`` (torch's scan higher-order op: ``torch.export`` programs, ONNX ``Scan``) or
            ``"loop"`` (torch's while-loop higher-order op: OpenVINO converts it into a ``Loop`` and
            has no rule for ``scan``).
        issue_override: the backend's issue that makes it need this form (default: torch's loop unrolling,
            pytorch/pytorch#146835).
        runtime_versions: the backend runtime's versions the form applies to, added to the
            transformers versions of the entries (e.g. the OpenVINO releases that convert the
            while-loop op).

    Raises:
        ValueError: for a ``form`` outside :data:`CHUNK_LOOP_FORMS` or an invalid ``backend`` key.
    """
    if form not in CHUNK_LOOP_FORMS:
        raise ValueError(f"chunk loop form must be one of {CHUNK_LOOP_FORMS}, got {form!r}")
    if form == "scan":
        how, kda, gdr = (
            "torch's scan higher-order op",
            kda_chunks_as_a_scan,
            gated_delta_rule_chunks_as_a_scan,
        )
        # the loop construct that capture unrolls; the scan op that keeps it
        issue = "https://github.com/pytorch/pytorch/issues/146835"
        versions: dict[str, str] = {"transformers": ">=5.24,<6"}
    else:
        how, kda, gdr = (
            "torch's while-loop higher-order op",
            kda_chunks_as_a_loop,
            gated_delta_rule_chunks_as_a_loop,
        )
        issue = "https://github.com/pytorch/pytorch/issues/146835"
        versions = {"transformers": ">=5.24,<6"}
    issue = issue_override if issue_override is not None else issue
    versions = {**versions, **(runtime_versions or {})}
    register_patch(
        backend,
        *KDA_CHUNK_TARGETS,
        description=(
            f"GLM-5-Next's chunked Kimi delta attention with its loop over 64-token chunks as {how} "
            "(padded in front), which capture unrolled (Guard failed: inputs_embeds.size()[1] <= 64)"
        ),
        issue=issue,
        versions=versions,
    )(kda)
    register_patch(
        backend,
        *GATED_DELTA_RULE_TARGETS,
        description=(
            f"Qwen3.5's chunked gated delta rule with its loop over 64-token chunks as {how} (padded in "
            "front), which capture unrolled at the sample's chunk count: the program kept a guard "
            "(L + pad) // 64 == 1 outside its range constraints and served at most 64 tokens"
        ),
        issue=issue,
        versions=versions,
    )(gdr)
