"""Capture workarounds of the time-series forecasters (key ``"capture.time_series"``, issue 28).

Each entry is a :func:`hfexport.registry.register_patch` under :data:`KEY`, a scope of the core's
``"capture"`` key: :func:`hfexport.capture.capture` installs it (with the ``"capture"`` entries)
around ``torch.export.export`` whichever backend asked for the capture, but only when the captured
module holds a module of one of the forecasters' modeling files (:func:`capture_key`), and puts
the original back afterwards (also when the capture fails); the eager model the exporter
validates against runs the original code.

- :func:`unpadded_series_attend_everywhere`: autoformer's and informer's encoder/decoder build
  their (all-visible) bidirectional attention mask as a tensor while ``torch.export`` traces,
  where eager builds none; autoformer's auto-correlation and informer's distilled encoder (a
  convolution halves the length between layers) add that tensor at a shape it does not have.
  With no mask given, the patch returns no mask, as eager does.
- :func:`distributions_skip_argument_checks`: ``torch.distributions`` checks its parameters
  (``constraint.check(value).all()`` as a Python bool), which ``torch.export`` cannot decide
  (``GuardOnDataDependentSymNode: Eq(u0, 1)``); the teacher-forced forecasters (informer,
  autoformer, time_series_transformer) build their output distribution for the loss. The checks
  are off while capturing.
- :func:`timesfm_batched_series`: TimesFM 1/2 and 2.5 read ``past_values`` as a list of series
  (``[ts[-n:] for ts in past_values]`` then a per-series padding loop), which capture unrolls over
  the batch: the program keeps the sample's batch (``Guard failed: past_values.size()[0] == 2``).
  For a 2-D ``past_values`` tensor the patch runs the same code on the whole batch at once.
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.registry import register_patch
from hfexport.workarounds.scopes import holds_module_from
from hfexport.workarounds.torch_export import BACKEND as CAPTURE

#: Registry key of these patches: a scope of ``"capture"``, applied by :func:`capture_key`'s choice.
KEY = f"{CAPTURE}.time_series"
BACKEND = KEY

#: transformers modeling modules whose models the capture patches of this module concern
FORECASTER_MODULES: tuple[str, ...] = tuple(
    f"transformers.models.{name}.modeling_{name}"
    for name in ("autoformer", "informer", "time_series_transformer", "timesfm", "timesfm2_5")
)


def capture_key(module: torch.nn.Module) -> str:
    """The registry key :func:`hfexport.capture.capture` installs patches from for ``module``.

    Args:
        module: the module about to be captured (a model, or a wrapper holding one).

    Returns:
        :data:`KEY` (``"capture.time_series"``: the ``"capture"`` entries and this module's) when
        ``module`` or one of its submodules is defined in one of :data:`FORECASTER_MODULES`;
        ``"capture"`` otherwise, so other models' reports do not list these patches.
    """
    return KEY if holds_module_from(module, FORECASTER_MODULES) else CAPTURE


__all__ = [
    "AUTOCORRELATION_TARGETS",
    "BIDIRECTIONAL_MASK_TARGETS",
    "CAPTURE",
    "FFT_TARGETS",
    "FORECASTER_MODULES",
    "KEY",
    "LANCZOS_COEFFICIENTS",
    "LANCZOS_G",
    "TIMESFM_FORWARD_TARGETS",
    "TIMESFM_PREPROCESS_TARGETS",
    "batched_context",
    "capture_key",
    "circular_cross_correlation",
    "distributions_skip_argument_checks",
    "lgamma_elementary",
    "real_dft_matrices",
    "register_lgamma_elementary",
    "register_real_autocorrelation",
    "timesfm_batched_preprocess",
    "timesfm_batched_series",
    "unpadded_series_attend_everywhere",
]

_TRANSFORMERS = {"transformers": ">=5.23,<6"}

# --------------------------------------------------------------------------------------------
# Bidirectional masks of autoformer / informer
# --------------------------------------------------------------------------------------------

#: the mask builder as imported by the modeling modules whose attention cannot take the tensor
BIDIRECTIONAL_MASK_TARGETS: tuple[str, ...] = (
    "transformers.models.autoformer.modeling_autoformer.create_bidirectional_mask",
    "transformers.models.informer.modeling_informer.create_bidirectional_mask",
)


@register_patch(
    BACKEND,
    *BIDIRECTIONAL_MASK_TARGETS,
    description=(
        "autoformer / informer: no attention mask when none is given (as eager), instead of the all-visible "
        "mask tensor transformers builds while exporting, which autoformer's auto-correlation and informer's "
        "distilled encoder add at a shape it does not have"
    ),
    # the bidirectional mask interface (transformers 5) left autoformer out ("some exceptions, like
    # autoformer, have been ignored for now"); no issue filed for the export-only tensor mask
    issue="https://github.com/huggingface/transformers/pull/41265",
    versions=_TRANSFORMERS,
)
def unpadded_series_attend_everywhere(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``create_bidirectional_mask`` in autoformer's and informer's modeling modules.

    transformers skips the bidirectional mask (returns ``None``) when no position is padded, but
    never while ``torch.export`` traces (``_ignore_bidirectional_mask_sdpa`` returns False then),
    so the captured forward adds an all-visible ``[batch, 1, q, kv]`` tensor to the scores.
    autoformer's auto-correlation scores are ``[batch * heads, q, head_dim]`` (``RuntimeError:
    shape '[s11, 2, 8, 8]' is invalid for input of size 512*s11``) and informer's encoder halves
    the length between layers with its distilling convolution while the mask keeps the input
    length (``The size of tensor a (4) must match the size of tensor b (8)``). Both forwards pass
    no mask of their own (``past_observed_mask`` feeds the scaler, not the attention), so with
    ``attention_mask=None`` (and no extra mask function) the replacement returns ``None``: the
    same attention as the all-visible mask, and what eager computes. Any other call runs the
    original.
    """

    @functools.wraps(original)
    def create_bidirectional_mask(*args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        extra = kwargs.get("or_mask_function") is not None or kwargs.get("and_mask_function") is not None
        if mask is None and not extra:
            return None
        return original(*args, **kwargs)

    return create_bidirectional_mask


# --------------------------------------------------------------------------------------------
# torch.distributions argument checks
# --------------------------------------------------------------------------------------------


@register_patch(
    BACKEND,
    "torch.distributions.Distribution._validate_args",
    description=(
        "torch.distributions: no argument/sample checks while capturing (informer, autoformer and "
        "time_series_transformer build their output distribution for the loss); the checks branch on tensor "
        "values, a data-dependent guard Eq(u0, 1)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/135061",
    versions={"torch": ">=2.12"},
)
def distributions_skip_argument_checks(original: Any) -> bool:
    """Set the class default ``Distribution._validate_args`` to False while capturing.

    With validation on (torch's default outside ``python -O``), ``Distribution.__init__`` and
    ``log_prob`` test every parameter and sample against its constraint and raise ``ValueError``
    on a violation; the test turns a tensor into a Python bool, which non-strict ``torch.export``
    cannot trace (pytorch/pytorch#135061). The values the distribution computes do not depend on
    the checks, so the captured program is the same computation without them. A distribution
    built with an explicit ``validate_args=True`` still checks (and still fails to capture).

    Returns:
        False (the replacement class attribute), whatever ``original`` was.
    """
    return False


# --------------------------------------------------------------------------------------------
# TimesFM: a batch of series as one tensor
# --------------------------------------------------------------------------------------------

TIMESFM_FORWARD_TARGETS: tuple[str, ...] = (
    "transformers.models.timesfm.modeling_timesfm.TimesFmModelForPrediction.forward",
    "transformers.models.timesfm2_5.modeling_timesfm2_5.TimesFm2_5ModelForPrediction.forward",
)
TIMESFM_PREPROCESS_TARGETS: tuple[str, ...] = (
    "transformers.models.timesfm.modeling_timesfm.TimesFmModelForPrediction._preprocess",
    "transformers.models.timesfm2_5.modeling_timesfm2_5.TimesFm2_5ModelForPrediction._preprocess",
)

#: the model whose forward currently runs with a time-major batch (see :func:`timesfm_batched_series`)
_TIME_MAJOR: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hfexport_timesfm_time_major", default=None
)


def batched_context(
    series: torch.Tensor, context_length: int, horizon_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad or cut a batch of equal-length series to ``context_length`` steps.

    The batched form of TimesFM's per-series ``_preprocess``: a series shorter than the context
    gets leading zeros, marked padded (1.0) in the padding indicator; a longer one keeps its last
    ``context_length`` steps. The horizon's positions are never padded (0.0).

    Args:
        series: ``[batch, steps]`` float tensor (every series has ``steps`` values; ``steps`` is a
            plain int or a backed size, the branch is taken on it).
        context_length: the model's context length (> 0).
        horizon_length: the number of forecast steps the padding indicator also covers (>= 0).

    Returns:
        ``(values, padding)``: ``values`` ``[batch, context_length]`` and ``padding``
        ``[batch, context_length + horizon_length]``, both of ``series``' dtype and device.

    Raises:
        ValueError: ``series`` is not 2-D.
    """
    if series.dim() != 2:
        raise ValueError(f"batched_context takes [batch, steps] series, got shape {tuple(series.shape)}")
    batch, steps = series.shape
    options = {"dtype": series.dtype, "device": series.device}
    if steps < context_length:
        front = context_length - steps
        values = torch.cat([series.new_zeros(batch, front), series], dim=1)
        padding = torch.cat(
            [torch.ones(batch, front, **options), torch.zeros(batch, steps + horizon_length, **options)],
            dim=1,
        )
        return values, padding
    values = series[:, steps - context_length :] if steps > context_length else series
    return values, torch.zeros(batch, context_length + horizon_length, **options)


@register_patch(
    BACKEND,
    *TIMESFM_PREPROCESS_TARGETS,
    description=(
        "TimesFM / TimesFM 2.5: pad or cut the whole batch of series at once when the forward hands the "
        "batch over as one tensor (the partner of timesfm_batched_series)"
    ),
    issue="https://github.com/huggingface/transformers/pull/45233",
    versions=_TRANSFORMERS,
)
def timesfm_batched_preprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``TimesFm*ModelForPrediction._preprocess`` while capturing.

    Inside a forward run by :func:`timesfm_batched_series`, ``inputs`` is a one-element list
    holding the whole batch time-major (``[steps, batch]``, see there); the replacement pads or
    cuts it with :func:`batched_context` and returns ``(values [batch, context], padding [batch,
    context + horizon])`` plus, when ``freq`` is given, the frequencies as int32 ``[batch, 1]``,
    which is what the original returns for the same series one by one. Outside such a forward it
    runs the original.
    """

    @functools.wraps(original)
    def _preprocess(self: Any, inputs: Any, freq: Any = None, context_len: int | None = None) -> Any:
        if _TIME_MAJOR.get() != id(self):
            return original(self, inputs, freq, context_len)
        (time_major,) = inputs
        series = time_major.transpose(0, 1)
        values, padding = batched_context(
            series, int(context_len if context_len is not None else self.context_len), int(self.horizon_len)
        )
        if freq is None:
            return values, padding
        frequencies = torch.as_tensor(freq, device=series.device)[: series.shape[0]]
        return values, padding, frequencies.to(torch.int32).reshape(-1, 1)

    return _preprocess


@register_patch(
    BACKEND,
    *TIMESFM_FORWARD_TARGETS,
    description=(
        "TimesFM / TimesFM 2.5: a 2-D past_values runs as one batch instead of a Python list of series, "
        "which capture unrolled over the batch (the program kept the sample's batch size)"
    ),
    issue="https://github.com/huggingface/transformers/pull/45233",
    versions=_TRANSFORMERS,
)
def timesfm_batched_series(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``TimesFm*ModelForPrediction.forward`` while capturing.

    The forecasting heads take ``past_values`` as a sequence of 1-D series of any lengths and
    walk it in Python: ``[ts[-n:] for ts in past_values]``, a per-series minimum, and
    ``_preprocess``'s per-series padding loop, then ``torch.stack``. Traced on a ``[batch, steps]``
    tensor that loop runs ``batch`` times, so the program only takes the sample's batch
    (transformers PR #45233 proposes a tensor path upstream). The replacement hands the original
    the batch as a single time-major series, ``[past_values.T]``: the original's
    ``ts[-n:]`` then cuts the last ``n`` steps of every series at once and its minimum is the
    minimum over the batch (what the per-series minima's minimum is), and
    :func:`timesfm_batched_preprocess` turns it back into ``[batch, context]``. When ``freq`` is
    omitted it passes zeros ``[batch]`` (the original's default of frequency 0 per series).

    Runs the original unchanged for anything else: ``past_values`` not a 2-D tensor (a list of
    series), or ``window_size`` given (the trend/residual split doubles the series one by one).
    """
    import inspect

    takes_freq = "freq" in inspect.signature(original).parameters

    @functools.wraps(original)
    def forward(self: Any, past_values: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (
            not isinstance(past_values, torch.Tensor)
            or past_values.dim() != 2
            or args
            or kwargs.get("window_size") is not None
        ):
            return original(self, past_values, *args, **kwargs)
        if takes_freq and kwargs.get("freq") is None:
            kwargs["freq"] = torch.zeros(past_values.shape[0], dtype=torch.int32, device=past_values.device)
        token = _TIME_MAJOR.set(id(self))
        try:
            return original(self, [past_values.transpose(0, 1)], **kwargs)
        finally:
            _TIME_MAJOR.reset(token)

    return forward


# --------------------------------------------------------------------------------------------
# lgamma from elementary operations
# --------------------------------------------------------------------------------------------

#: Lanczos approximation of the gamma function, g = 7 with 9 terms (the standard coefficients,
#: relative error below 1e-13 in float64; float32 rounding dominates in float32)
LANCZOS_G = 7.0
LANCZOS_COEFFICIENTS: tuple[float, ...] = (
    0.99999999999980993,
    676.5203681218851,
    -1259.1392167224028,
    771.32342877765313,
    -176.61502916214059,
    12.507343278686905,
    -0.13857109526572012,
    9.9843695780195716e-6,
    1.5056327351493116e-7,
)


def lgamma_elementary(x: torch.Tensor) -> torch.Tensor:
    """``log|Gamma(x)|`` from ``log``, ``sin``, ``abs``, divisions and ``where``.

    The Lanczos approximation (:data:`LANCZOS_G`, :data:`LANCZOS_COEFFICIENTS`) for ``x >= 0.5``
    and the reflection formula ``lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x)`` below, both
    computed for every element and chosen with ``torch.where`` (no data-dependent branch). In
    float32, within 2e-6 of ``torch.lgamma`` for ``x > 0`` (relative, or absolute where
    ``|lgamma| < 1``) and within 2e-5 next to the poles of negative ``x``; in float64 within 1e-13;
    ``+inf`` at the poles (0, -1, -2, ...) as ``torch.lgamma``.

    Args:
        x: a floating point tensor of any shape (float16/bfloat16 are computed in float32).

    Returns:
        A tensor of ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` is not a floating point tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"lgamma_elementary takes a floating point tensor, got {getattr(x, 'dtype', type(x))}"
        )
    dtype = x.dtype
    work = x if dtype in (torch.float32, torch.float64) else x.float()
    reflect = work < 0.5
    z = torch.where(reflect, 1.0 - work, work) - 1.0
    series = torch.full_like(z, LANCZOS_COEFFICIENTS[0])
    for index, coefficient in enumerate(LANCZOS_COEFFICIENTS[1:], start=1):
        series = series + coefficient / (z + float(index))
    t = z + (LANCZOS_G + 0.5)
    upper = 0.5 * math.log(2.0 * math.pi) + (z + 0.5) * torch.log(t) - t + torch.log(series)
    # |sin(pi x)| from the fractional part, which is exact: pi * x itself rounds away the zeros
    fraction = work - torch.floor(work)
    lower = math.log(math.pi) - torch.log(torch.abs(torch.sin(math.pi * fraction))) - upper
    return torch.where(reflect, lower, upper).to(dtype)


def register_lgamma_elementary(backend: str) -> None:
    """Register, under ``backend``, a patch serving ``torch.lgamma`` with :func:`lgamma_elementary`.

    ``aten.lgamma`` has no ONNX operator (torch.onnx: ``No ONNX function found for prims.lgamma``),
    is outside ExecuTorch's core ATen opset (``SpecViolationError``) and has no OpenVINO
    conversion rule; ``torch.distributions`` (StudentT's ``log_prob``, the forecasters' loss) calls
    it. Only a backend whose lowering lacks the operator registers the patch; dynamo keeps the
    exact kernel.

    Args:
        backend: the registry key (``"onnx"``, ``"executorch"``, ``"openvino"``).

    Raises:
        ValueError: ``backend`` is not a valid registry key.
    """

    def lgamma_from_elementary_ops(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def lgamma(input: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not isinstance(input, torch.Tensor) or not input.is_floating_point():
                return original(input, *args, **kwargs)  # out=..., integer input: torch decides
            return lgamma_elementary(input)

        return lgamma

    lgamma_from_elementary_ops.__qualname__ = f"lgamma_from_elementary_ops[{backend}]"
    register_patch(
        backend,
        "torch.lgamma",
        description=(
            "torch.lgamma as the Lanczos approximation in log/sin/div/where (StudentT log_prob in the forecasters' "
            "loss): the lowering has no lgamma operator"
        ),
        # ONNX has no Lgamma operator and torch.onnx no translation (the issue); ExecuTorch's core ATen
        # opset leaves aten.lgamma out and OpenVINO 2026.4's frontend has no rule for it
        issue="https://github.com/pytorch/pytorch/issues/109369",
        versions={"torch": ">=2.12"},
    )(lgamma_from_elementary_ops)


# --------------------------------------------------------------------------------------------
# Autoformer's auto-correlation in real arithmetic
# --------------------------------------------------------------------------------------------

#: the method that computes autoformer's FFT auto-correlation (inside a longer forward)
AUTOCORRELATION_TARGETS: tuple[str, ...] = (
    "transformers.models.autoformer.modeling_autoformer.AutoformerAttention.forward",
)
#: the FFT functions that, inside one of :data:`AUTOCORRELATION_TARGETS`, defer to real arithmetic
FFT_TARGETS: tuple[str, ...] = ("torch.fft.rfft", "torch.fft.irfft")

#: True while a forward of :data:`AUTOCORRELATION_TARGETS` runs under :func:`register_real_autocorrelation`
_IN_AUTOCORRELATION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hfexport_autoformer_autocorrelation", default=False
)


def real_dft_matrices(
    n: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> tuple[torch.Tensor, ...]:
    """The real DFT matrices of a length-``n`` real signal and of the inverse of its half spectrum.

    With ``bins = n // 2 + 1`` (the one-sided spectrum ``torch.fft.rfft`` returns) and the angle
    ``2 pi ((f * t) mod n) / n`` (reduced modulo ``n`` in integers, then computed in float64):

    - ``cos [bins, n]`` and ``sin [bins, n]``: ``rfft(x)[f] = sum_t x[t] (cos - i sin)[f, t]``;
    - ``inverse_cos [bins, n]`` and ``inverse_sin [bins, n]``: the same angles times ``w_f / n``,
      with ``w_f = 1`` for the DC bin (and the Nyquist bin of an even ``n``) and 2 for the others,
      so ``irfft(X, n)[t] = sum_f Re(X)[f] inverse_cos[f, t] - Im(X)[f] inverse_sin[f, t]``
      (the imaginary parts of the DC and Nyquist bins drop out, as in ``irfft``).

    Args:
        n: the signal length (> 0).
        dtype: floating point dtype of the matrices.
        device: their device (default: torch's default device).

    Returns:
        ``(cos, sin, inverse_cos, inverse_sin)``, each ``[n // 2 + 1, n]`` of ``dtype``.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"real_dft_matrices takes a positive int length, got {n!r}")
    # from numpy arrays already of the dtype: constants of the captured program, not arange/cos
    # nodes or float64 constants and a cast in it (bfloat16, which numpy lacks, goes through float32)
    numpy_dtype = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16"}.get(
        dtype, "float32"
    )
    return tuple(
        torch.tensor(matrix.astype(numpy_dtype), device=device).to(dtype) for matrix in _real_dft_arrays(n)
    )


@functools.lru_cache(maxsize=16)
def _real_dft_arrays(n: int) -> tuple[Any, ...]:
    import numpy as np

    bins = n // 2 + 1
    angle = (np.arange(bins).reshape(-1, 1) * np.arange(n).reshape(1, -1) % n) * (2.0 * math.pi / n)
    weight = np.full((bins, 1), 2.0 / n)
    weight[0] = 1.0 / n
    if n % 2 == 0:
        weight[-1] = 1.0 / n
    cos, sin = np.cos(angle), np.sin(angle)
    matrices = (cos, sin, weight * cos, weight * sin)
    for matrix in matrices:
        matrix.setflags(write=False)
    return matrices


def circular_cross_correlation(query: torch.Tensor, key: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """``irfft(rfft(query, n, dim) * conj(rfft(key, n, dim)), n, dim)`` in real arithmetic.

    The circular cross-correlation ``r[tau] = sum_t q[(t + tau) mod n] k[t]`` along ``dim`` of
    the two signals cut or zero-padded to ``n`` steps (as ``rfft``'s ``n`` does), for every
    position of the other axes: the one-sided spectra as matrix products with
    :func:`real_dft_matrices` (``Re Q = q cos^T``, ``Im Q = -q sin^T``), the product with the
    conjugate spectrum from their real and imaginary parts, and the inverse as two more matrix
    products. No complex tensor and no FFT operator: ``matmul``, ``mul``, ``add``/``sub`` and the
    constant ``[n // 2 + 1, n]`` matrices only, so a lowering without complex dtypes takes it.
    ``O(n^2)`` per signal instead of ``O(n log n)``; autoformer's ``n`` is its context or horizon
    length, fixed by the config. In float32 within 1e-5 (relative to the largest value) of the
    FFT path for ``n`` up to a few hundred.

    Args:
        query: real floating point tensor; ``dim`` is its time axis (a static length).
        key: real floating point tensor of ``query``'s shape, dtype and device.
        n: the FFT length (> 0, a plain int).
        dim: the time axis.

    Returns:
        The correlation, ``query``'s shape with ``n`` steps along ``dim``, of ``query``'s dtype.

    Raises:
        TypeError: ``query`` or ``key`` is not a real floating point tensor.
        ValueError: their shapes differ, or ``n`` is not a positive int.
    """
    for name, value in (("query", query), ("key", key)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(
                f"circular_cross_correlation takes real floating point tensors, got {name} of "
                f"{getattr(value, 'dtype', type(value))}"
            )
    if query.shape != key.shape:
        raise ValueError(
            f"circular_cross_correlation takes query and key of one shape, got {tuple(query.shape)} "
            f"and {tuple(key.shape)}"
        )
    cos, sin, inverse_cos, inverse_sin = real_dft_matrices(n, query.dtype, query.device)
    q = _fit_length(torch.movedim(query, dim, -1), n)
    k = _fit_length(torch.movedim(key, dim, -1), n)
    q_cos, q_sin = torch.matmul(q, cos.t()), torch.matmul(q, sin.t())
    k_cos, k_sin = torch.matmul(k, cos.t()), torch.matmul(k, sin.t())
    real = q_cos * k_cos + q_sin * k_sin  # Re(Q conj(K))
    imaginary = q_cos * k_sin - q_sin * k_cos  # Im(Q conj(K))
    correlation = torch.matmul(real, inverse_cos) - torch.matmul(imaginary, inverse_sin)
    return torch.movedim(correlation, -1, dim)


def _fit_length(signal: torch.Tensor, n: int) -> torch.Tensor:
    """``signal`` (time last) cut or zero-padded to ``n`` steps, as ``torch.fft.rfft(n=n)`` does."""
    steps = signal.shape[-1]
    if steps > n:
        return signal[..., :n]
    if steps < n:
        return torch.nn.functional.pad(signal, (0, n - steps))
    return signal


class _Deferred:
    """A complex spectrum not computed yet: any use but the ones a subclass defers computes it.

    Torch functions (``__torch_function__``), tensor methods and attributes (``__getattr__``) and
    the arithmetic operators get the complex tensor :meth:`materialize` returns, so code that does
    something else with it computes what it computed before (in complex arithmetic).
    """

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        values = _materialized((*args, *kwargs.values()))
        return func(*values[: len(args)], **dict(zip(kwargs, values[len(args) :], strict=True)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


def _forward_operator(name: str) -> None:
    def left(self: _Deferred, other: Any) -> Any:
        return getattr(self.materialize(), f"__{name}__")(*_materialized((other,)))

    def right(self: _Deferred, other: Any) -> Any:
        return getattr(self.materialize(), f"__r{name}__")(*_materialized((other,)))

    setattr(_Deferred, f"__{name}__", left)
    setattr(_Deferred, f"__r{name}__", right)


for _name in ("add", "sub", "mul", "truediv", "matmul", "pow"):
    _forward_operator(_name)


class _DeferredSpectrum(_Deferred):
    """``rfft(signal, n, dim)`` (conjugated or not) kept as its real signal.

    Made by the ``torch.fft.rfft`` replacement inside autoformer's attention. ``torch.conj``
    flips the flag; the product of a spectrum and a conjugated one (same ``n``, axis and shape)
    is a :class:`_DeferredCrossSpectrum`. Any other use computes the spectrum with the original
    ``rfft`` (:class:`_Deferred`).
    """

    def __init__(
        self, signal: torch.Tensor, n: int, dim: int, rfft: Callable[..., Any], conjugate: bool = False
    ) -> None:
        self.signal, self.n, self.dim = signal, n, dim % signal.dim()
        self.rfft, self.conjugate = rfft, conjugate

    def materialize(self) -> torch.Tensor:
        spectrum = self.rfft(self.signal, n=self.n, dim=self.dim)
        return torch.conj(spectrum) if self.conjugate else spectrum

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.conj, torch.Tensor.conj) and len(args) == 1 and not kwargs:
            (spectrum,) = args
            if type(spectrum) is _DeferredSpectrum:
                return _DeferredSpectrum(
                    spectrum.signal, spectrum.n, spectrum.dim, spectrum.rfft, not spectrum.conjugate
                )
        return super().__torch_function__(func, types, args, kwargs)

    def __mul__(self, other: Any) -> Any:
        if (
            isinstance(other, _DeferredSpectrum)
            and other.conjugate != self.conjugate
            and (other.n, other.dim, other.signal.shape) == (self.n, self.dim, self.signal.shape)
        ):
            query, key = (other, self) if self.conjugate else (self, other)
            return _DeferredCrossSpectrum(query, key)
        return super().__mul__(other)


class _DeferredCrossSpectrum(_Deferred):
    """``rfft(query) * conj(rfft(key))``, kept as the two real signals until ``irfft`` takes it."""

    def __init__(self, query: _DeferredSpectrum, key: _DeferredSpectrum) -> None:
        self.query, self.key, self.n, self.dim = query, key, query.n, query.dim

    def materialize(self) -> torch.Tensor:
        return self.query.materialize() * self.key.materialize()


def _materialized(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v.materialize() if isinstance(v, _Deferred) else v for v in values)


def register_real_autocorrelation(backend: str, *, issue: str, versions: Mapping[str, str]) -> None:
    """Register, under ``backend``, autoformer's auto-correlation without complex tensors.

    ``AutoformerAttention.forward`` computes the auto-correlation of queries and keys as
    ``irfft(rfft(q) * conj(rfft(k)))`` along the time axis: complex64 tensors and the
    ``aten._fft_r2c`` / ``aten._conj`` / ``aten._fft_c2r`` operators, which ExecuTorch's edge
    dialect refuses (``SpecViolationError`` on a complex64 ``aten.mul``) and OpenVINO's
    ``torch.export`` frontend has no rule for. Two patches, both installed by
    ``apply_patches(backend)``:

    - on :data:`AUTOCORRELATION_TARGETS`: the forward runs the original with a flag set;
    - on :data:`FFT_TARGETS`: with the flag set, ``torch.fft.rfft`` returns the signal deferred
      (``torch.conj`` of it and the product of a spectrum with a conjugated one stay deferred)
      and ``torch.fft.irfft`` of that product (same ``n``, default norm) is
      :func:`circular_cross_correlation`. Anything else, or without the flag, runs the original.

    The forward itself (top-k delays, aggregation) is transformers' code, unchanged.

    Args:
        backend: the registry key (``"executorch"``, ``"openvino"``).
        issue: the upstream issue of that backend's missing complex/FFT support.
        versions: the backend's version range the patches are needed in.

    Raises:
        ValueError: ``backend`` is not a valid registry key.
    """

    def autocorrelation_scope(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            token = _IN_AUTOCORRELATION.set(True)
            try:
                return original(*args, **kwargs)
            finally:
                _IN_AUTOCORRELATION.reset(token)

        return forward

    def fft_in_real_arithmetic(original: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, "__name__", "").endswith("irfft"):  # torch.fft.irfft is named fft_irfft

            @functools.wraps(original)
            def irfft(input: Any, n: Any = None, dim: int = -1, norm: Any = None, **kwargs: Any) -> Any:
                if (
                    isinstance(input, _DeferredCrossSpectrum)
                    and n == input.n
                    and dim % input.query.signal.dim() == input.dim
                    and norm in (None, "backward")
                    and not kwargs
                ):
                    return circular_cross_correlation(
                        input.query.signal, input.key.signal, input.n, input.dim
                    )
                return original(*_materialized((input,)), n, dim, norm, **kwargs)

            return irfft

        @functools.wraps(original)
        def rfft(input: Any, n: Any = None, dim: int = -1, norm: Any = None, **kwargs: Any) -> Any:
            if (
                _IN_AUTOCORRELATION.get()
                and isinstance(input, torch.Tensor)
                and input.is_floating_point()
                and isinstance(n, int)
                and norm in (None, "backward")
                and not kwargs
            ):
                return _DeferredSpectrum(input, n, dim, original)
            return original(input, n, dim, norm, **kwargs)

        return rfft

    autocorrelation_scope.__qualname__ = f"autocorrelation_scope[{backend}]"
    fft_in_real_arithmetic.__qualname__ = f"fft_in_real_arithmetic[{backend}]"
    register_patch(
        backend,
        *AUTOCORRELATION_TARGETS,
        description=(
            "autoformer: the attention forward marks where torch.fft.rfft/irfft compute the auto-correlation, "
            "which fft_in_real_arithmetic then computes without complex tensors"
        ),
        issue=issue,
        versions={**_TRANSFORMERS, **versions},
    )(autocorrelation_scope)
    register_patch(
        backend,
        *FFT_TARGETS,
        description=(
            "autoformer: the FFT auto-correlation irfft(rfft(q) * conj(rfft(k))) as real DFT matrix products "
            "(the lowering takes no complex64 tensors / FFT operators)"
        ),
        issue=issue,
        versions=dict(versions),
    )(fft_in_real_arithmetic)
