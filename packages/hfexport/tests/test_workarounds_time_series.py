"""The time-series forecasters' capture workarounds (hfexport.workarounds.time_series, issue 28).

Each patch is checked for its registry metadata, for being in place only inside
``apply_patches`` (and restored after, also when the block raises), and for giving the eager
numbers; the TimesFM patch also for a program that takes another batch size, and lgamma for its
accuracy against ``torch.lgamma``. Tiny models only (each case a few seconds).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hfexport import registry
from hfexport.registry import apply_patches, isolated_registry
from hfexport.testing import tiny_model
from hfexport.workarounds import time_series

TASK = "time-series-forecasting"
MASKS = f"{time_series.__name__}.unpadded_series_attend_everywhere"
CHECKS = f"{time_series.__name__}.distributions_skip_argument_checks"
TIMESFM = f"{time_series.__name__}.timesfm_batched_series"
TIMESFM_PRE = f"{time_series.__name__}.timesfm_batched_preprocess"


def _attribute(path: str):
    module_name, _, attr = path.rpartition(".")
    owner_path = module_name
    try:
        owner = importlib.import_module(owner_path)
    except ImportError:  # a class attribute: pkg.mod.Class.attr
        module_name, _, cls = owner_path.rpartition(".")
        owner = getattr(importlib.import_module(module_name), cls)
    return owner.__dict__.get(attr, getattr(owner, attr))


def test_entries_are_registered_under_the_capture_scope_with_issue_links_and_ranges():
    assert time_series.KEY == "capture.time_series"
    found = {e.name: e for e in registry.entries(time_series.KEY, kind="patch")}
    assert {MASKS, CHECKS, TIMESFM, TIMESFM_PRE} <= set(found)
    assert found[MASKS].paths == time_series.BIDIRECTIONAL_MASK_TARGETS
    assert found[CHECKS].paths == ("torch.distributions.Distribution._validate_args",)
    assert found[CHECKS].issue == "https://github.com/pytorch/pytorch/issues/135061"
    assert found[TIMESFM].paths == time_series.TIMESFM_FORWARD_TARGETS
    assert found[TIMESFM].issue == "https://github.com/huggingface/transformers/pull/45233"
    for name in (MASKS, CHECKS, TIMESFM, TIMESFM_PRE):
        entry = found[name]
        assert entry.description and entry.issue.startswith("https://github.com/")
        assert entry.is_active(), entry.inactive_reason()
        assert not entry.unresolved, entry.unresolved


def test_patches_are_in_place_only_inside_apply_patches_and_restored_after_an_error():
    paths = (
        *time_series.BIDIRECTIONAL_MASK_TARGETS,
        *time_series.TIMESFM_FORWARD_TARGETS,
        *time_series.TIMESFM_PREPROCESS_TARGETS,
    )
    before = {path: _attribute(path) for path in paths}
    # torch's default is __debug__ (True), but torch._dynamo's first use sets it False for the
    # process (eval_frame: Distribution.set_default_validate_args(False)): restored, not assumed
    validate_before = torch.distributions.Distribution._validate_args
    with apply_patches("capture"):  # the parent key alone: none of them
        assert all(_attribute(path) is before[path] for path in paths)
    with pytest.raises(RuntimeError, match="boom"), apply_patches(time_series.KEY):
        for path in paths:
            assert _attribute(path) is not before[path], path
        assert torch.distributions.Distribution._validate_args is False
        raise RuntimeError("boom")
    for path in paths:
        assert _attribute(path) is before[path], path
    assert torch.distributions.Distribution._validate_args is validate_before


def test_capture_key_picks_the_scope_for_forecasters_only():
    forecaster, _ = tiny_model("informer", TASK)
    assert time_series.capture_key(forecaster) == time_series.KEY
    wrapper = torch.nn.Sequential(forecaster)  # a wrapper holding one: still a forecaster
    assert time_series.capture_key(wrapper) == time_series.KEY
    patchtst, _ = tiny_model("patchtst", TASK)  # needs none of these patches
    assert time_series.capture_key(patchtst) == "capture"
    assert time_series.capture_key(torch.nn.Linear(2, 2)) == "capture"


def test_mask_patch_returns_no_mask_only_when_none_is_given():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "built"

    patched = time_series.unpadded_series_attend_everywhere(original)
    assert patched(config=None, inputs_embeds=None, attention_mask=None) is None
    assert calls == []
    mask = torch.ones(2, 8)
    assert patched(config=None, inputs_embeds=None, attention_mask=mask) == "built"
    assert patched(None, None, mask) == "built"
    assert patched(config=None, inputs_embeds=None, attention_mask=None, and_mask_function=len) == "built"
    assert len(calls) == 3


@pytest.mark.parametrize(
    "model_type",
    [
        "informer",  # both patches (mask, distribution checks); the others behind extended: ~10 s each
        pytest.param("autoformer", marks=pytest.mark.extended),
        pytest.param("time_series_transformer", marks=pytest.mark.extended),
    ],
)
def test_teacher_forced_forecasters_capture_and_match_eager_at_another_batch(model_type):
    model, inputs = tiny_model(model_type, TASK)
    dynamic = {key: {0: torch.export.Dim.AUTO} for key in inputs}
    with torch.no_grad():
        expected = model(**{k: torch.cat([v, v[:1]]) for k, v in inputs.items()})
        with apply_patches(time_series.KEY):
            program = torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
        got = program.module()(**{k: torch.cat([v, v[:1]]) for k, v in inputs.items()})
    assert got.params[0].shape == (3, model.config.prediction_length)
    for mine, theirs in zip(got.params, expected.params, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)


def test_teacher_forced_forecaster_fails_to_capture_without_the_patches():
    model, inputs = tiny_model("informer", TASK)
    dynamic = {key: {0: torch.export.Dim.AUTO} for key in inputs}
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)


@pytest.mark.parametrize("model_type", ["timesfm", pytest.param("timesfm2_5", marks=pytest.mark.extended)])
def test_timesfm_captures_the_batch_as_one_tensor(model_type):
    model, inputs = tiny_model(model_type, TASK)
    series = inputs["past_values"]
    assert series.shape[0] == 2
    with torch.no_grad(), apply_patches(time_series.KEY):
        program = torch.export.export(
            model,
            (),
            {"past_values": series},
            dynamic_shapes={"past_values": {0: torch.export.Dim.AUTO}},
            strict=False,
        )
    wider = torch.cat([series, series[:1] * 2.0, series[1:] + 1.0])
    with torch.no_grad():
        expected = model(past_values=wider)
        got = program.module()(past_values=wider)
    assert got.mean_predictions.shape == (4, expected.mean_predictions.shape[1])
    torch.testing.assert_close(got.mean_predictions, expected.mean_predictions, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.full_predictions, expected.full_predictions, atol=1e-5, rtol=1e-5)


def test_timesfm_patch_keeps_a_list_of_series_on_the_original_path():
    model, inputs = tiny_model("timesfm", TASK)
    series = [inputs["past_values"][0], inputs["past_values"][1, 16:]]  # two lengths: padded
    with torch.no_grad():
        expected = model(past_values=series)
        with apply_patches(time_series.KEY):
            got = model(past_values=series)
            batched = model(past_values=inputs["past_values"])
        plain = model(past_values=inputs["past_values"])
    torch.testing.assert_close(got.mean_predictions, expected.mean_predictions, atol=0, rtol=0)
    torch.testing.assert_close(batched.mean_predictions, plain.mean_predictions, atol=1e-6, rtol=1e-6)


def test_batched_context_pads_and_cuts_like_the_per_series_preprocess():
    series = torch.arange(1.0, 7.0).reshape(2, 3)
    values, padding = time_series.batched_context(series, 5, 2)
    assert values.tolist() == [[0, 0, 1, 2, 3], [0, 0, 4, 5, 6]]
    assert padding.tolist() == [[1, 1, 0, 0, 0, 0, 0]] * 2
    values, padding = time_series.batched_context(series, 2, 1)
    assert values.tolist() == [[2, 3], [5, 6]] and padding.shape == (2, 3) and not padding.any()
    with pytest.raises(ValueError, match=r"\[batch, steps\]"):
        time_series.batched_context(series[0], 2, 1)


def test_lgamma_elementary_matches_torch_lgamma():
    x = torch.linspace(-9.9, 40.0, 4001)
    reference = torch.lgamma(x.double())
    finite = torch.isfinite(reference)
    got32 = time_series.lgamma_elementary(x).double()
    error = (got32 - reference).abs() / reference.abs().clamp_min(1.0)
    assert error[finite & (x > 0)].max() < 2e-6
    assert error[finite].max() < 2e-5
    got64 = time_series.lgamma_elementary(x.double())
    assert ((got64 - reference).abs() / reference.abs().clamp_min(1.0))[finite].max() < 1e-12
    poles = time_series.lgamma_elementary(torch.tensor([0.0, -1.0, -2.0, -7.0]))
    assert torch.isinf(poles).all() and (poles > 0).all()
    assert time_series.lgamma_elementary(torch.tensor([1.0, 2.0], dtype=torch.float16)).dtype == torch.float16
    with pytest.raises(TypeError, match="floating point"):
        time_series.lgamma_elementary(torch.tensor([1, 2]))


def test_register_lgamma_elementary_serves_torch_lgamma_under_its_key_only():
    original = torch.lgamma
    with isolated_registry():
        time_series.register_lgamma_elementary("demo")
        (entry,) = registry.entries("demo")
        assert entry.paths == ("torch.lgamma",)
        assert entry.issue == "https://github.com/pytorch/pytorch/issues/109369"
        x = torch.tensor([0.3, 2.5, 7.0])
        with apply_patches("demo"):
            assert torch.lgamma is not original
            torch.testing.assert_close(torch.lgamma(x), original(x), atol=2e-6, rtol=2e-6)
            program = torch.export.export(_LgammaRatio(), (x,), strict=False)
        assert torch.lgamma is original
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("lgamma" in target for target in targets), targets


class _LgammaRatio(torch.nn.Module):
    def forward(self, x):
        return torch.lgamma(0.5 * (x + 2.0)) - torch.lgamma(x)


def test_backends_register_lgamma_where_their_lowering_lacks_it():
    installed = []
    for backend in ("onnx", "executorch", "openvino"):
        try:
            importlib.import_module(f"hfexport_{backend}")
        except ImportError:
            continue
        installed.append(backend)
    keys = {e.backend for e in registry.entries(kind="patch") if e.paths == ("torch.lgamma",)}
    assert set(installed) <= keys
    assert "dynamo" not in keys and "capture" not in keys


# --- autoformer's auto-correlation in real arithmetic (executorch / openvino) -------------------


def _fft_correlation(query, key, n, dim):
    spectrum = torch.fft.rfft(query, n=n, dim=dim) * torch.conj(torch.fft.rfft(key, n=n, dim=dim))
    return torch.fft.irfft(spectrum, n=n, dim=dim)


@pytest.mark.parametrize(
    ("steps", "n", "dim"), [(24, 24, 1), (25, 25, 1), (48, 48, -1), (20, 24, 1), (30, 24, 1)]
)
def test_circular_cross_correlation_matches_the_fft_path(steps, n, dim):
    # even and odd lengths (the Nyquist bin), the time axis inside or last, rfft's zero padding and cut
    generator = torch.Generator().manual_seed(steps + n)
    shape = (6, steps, 5) if dim == 1 else (6, 5, steps)
    query = torch.randn(shape, generator=generator)
    key = torch.randn(shape, generator=generator)
    expected = _fft_correlation(query, key, n, dim)
    got = time_series.circular_cross_correlation(query, key, n, dim)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # float32: within 1e-6 of the largest |value| (the FFT path itself is ~2e-7 off the float64 sum)
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    # in float64, the definition r[tau] = sum_t q[(t + tau) mod n] k[t] to rounding
    q64, k64 = (time_series._fit_length(x.double().movedim(dim, -1), n) for x in (query, key))
    direct = torch.stack([(torch.roll(q64, -tau, -1) * k64).sum(-1) for tau in range(n)], -1).movedim(-1, dim)
    got64 = time_series.circular_cross_correlation(query.double(), key.double(), n, dim)
    torch.testing.assert_close(got64, direct, atol=1e-10, rtol=0)


def test_circular_cross_correlation_rejects_bad_input():
    x = torch.randn(2, 8, 3)
    with pytest.raises(TypeError, match="real floating point"):
        time_series.circular_cross_correlation(x.to(torch.complex64), x, 8, 1)
    with pytest.raises(TypeError, match=r"key of torch\.int64"):
        time_series.circular_cross_correlation(x, x.long(), 8, 1)
    with pytest.raises(ValueError, match="of one shape"):
        time_series.circular_cross_correlation(x, x[:, :4], 8, 1)
    with pytest.raises(ValueError, match="positive int length"):
        time_series.circular_cross_correlation(x, x, 0, 1)


def _autoformer_attention():
    from transformers.models.autoformer.modeling_autoformer import AutoformerAttention

    torch.manual_seed(0)
    return AutoformerAttention(embed_dim=16, num_heads=2, autocorrelation_factor=2).eval()


def test_register_real_autocorrelation_patches_under_its_key_only_and_restores():
    from transformers.models.autoformer.modeling_autoformer import AutoformerAttention

    rfft, irfft, forward = torch.fft.rfft, torch.fft.irfft, AutoformerAttention.forward
    with isolated_registry():
        time_series.register_real_autocorrelation(
            "demo", issue="https://github.com/o/r/issues/1", versions={"torch": ">=2.12"}
        )
        found = {e.paths: e for e in registry.entries("demo", kind="patch")}
        assert set(found) == {time_series.AUTOCORRELATION_TARGETS, time_series.FFT_TARGETS}
        assert all(e.issue == "https://github.com/o/r/issues/1" and e.is_active() for e in found.values())
        x = torch.randn(2, 8, 3)
        with pytest.raises(RuntimeError, match="boom"), apply_patches("demo"):
            assert torch.fft.rfft is not rfft and AutoformerAttention.forward is not forward
            # outside autoformer's attention the FFT is the original one (a complex tensor)
            spectrum = torch.fft.rfft(x, n=8, dim=1)
            assert isinstance(spectrum, torch.Tensor) and spectrum.dtype == torch.complex64
            torch.testing.assert_close(torch.fft.irfft(spectrum, n=8, dim=1), x)
            raise RuntimeError("boom")
    assert (torch.fft.rfft, torch.fft.irfft, AutoformerAttention.forward) == (rfft, irfft, forward)


def test_deferred_spectrum_gives_the_complex_spectrum_to_any_other_use():
    x = torch.randn(2, 8, 3)
    spectrum = torch.fft.rfft(x, n=8, dim=1)
    deferred = time_series._DeferredSpectrum(x, 8, 1, torch.fft.rfft)
    torch.testing.assert_close(torch.abs(deferred), spectrum.abs())  # a torch function
    torch.testing.assert_close(deferred.real, spectrum.real)  # an attribute
    torch.testing.assert_close(deferred + 1.0, spectrum + 1.0)  # an operator
    torch.testing.assert_close(torch.conj(deferred) * 2.0, spectrum.conj() * 2.0)
    cross = deferred * torch.conj(time_series._DeferredSpectrum(x.flip(1), 8, 1, torch.fft.rfft))
    assert isinstance(cross, time_series._DeferredCrossSpectrum)
    torch.testing.assert_close(torch.fft.irfft(cross, n=8, dim=1), _fft_correlation(x, x.flip(1), 8, 1))


def test_autoformer_attention_captures_without_complex_tensors_and_matches_eager():
    attention = _autoformer_attention()
    hidden = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    wider = torch.randn(3, 12, 16, generator=torch.Generator().manual_seed(2))
    with isolated_registry(), torch.no_grad():
        time_series.register_real_autocorrelation(
            "demo", issue="https://github.com/o/r/issues/1", versions={"torch": ">=2.12"}
        )
        expected = [attention(hidden)[0], attention(wider)[0]]
        with apply_patches("demo"):
            eager_patched = attention(hidden)[0]
            program = torch.export.export(
                attention, (hidden,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False
            )
        got = [program.module()(hidden)[0], program.module()(wider)[0]]
    torch.testing.assert_close(eager_patched, expected[0], atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("fft" in target or "conj" in target for target in targets), targets
    dtypes = {getattr(node.meta.get("val"), "dtype", None) for node in program.graph.nodes}
    assert not any(dtype is not None and dtype.is_complex for dtype in dtypes), dtypes


def test_backends_register_the_real_autocorrelation_where_their_lowering_lacks_complex_tensors():
    installed = []
    for backend in ("executorch", "openvino"):
        try:
            importlib.import_module(f"hfexport_{backend}")
        except ImportError:
            continue
        installed.append(backend)
    keys = {e.backend for e in registry.entries(kind="patch") if e.paths == time_series.FFT_TARGETS}
    assert set(installed) <= keys
    assert not keys & {"dynamo", "onnx", "capture", time_series.KEY}  # they keep the exact FFT
