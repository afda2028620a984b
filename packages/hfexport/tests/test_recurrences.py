"""hfexport.workarounds.recurrences: each form of each recurrence equals transformers' loop in eager."""

from __future__ import annotations

import pytest
import torch

from hfexport.workarounds import recurrences as R

LENGTHS = (1, 7, 40)  # one token, inside one chunk, across three chunks of the chunked form
ATOL = {"scan": 1e-6, "chunked": 1e-5}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("form", R.FORMS)
@pytest.mark.parametrize("length", LENGTHS)
def test_mamba_selective_scan_forms_match_the_loop(form, length):
    from transformers.models.mamba import modeling_mamba

    g = _gen(length)
    b, d, n = 2, 6, 4
    x, dt, z = (torch.randn(b, d, length, generator=g) for _ in range(3))
    B, C = (torch.randn(b, n, length, generator=g) for _ in range(2))
    A = -torch.rand(d, n, generator=g) * 4
    D, bias = torch.randn(d, generator=g), torch.randn(d, generator=g)
    kw = {"D": D, "z": z, "delta_bias": bias, "delta_softplus": True, "return_last_state": True}
    want_y, want_state = modeling_mamba.mamba_selective_scan(x, dt, A, B, C, **kw)
    got_y, got_state = R.mamba_selective_scan_in_form(form, x, dt, A, B, C, **kw)
    assert got_y.shape == want_y.shape == (b, d, length) and got_state.shape == (b, d, n)
    assert (got_y - want_y).abs().max().item() <= ATOL[form]
    assert (got_state - want_state).abs().max().item() <= ATOL[form]
    # without return_last_state only y comes back, as from transformers
    only = R.mamba_selective_scan_in_form(
        form, x, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True
    )
    assert isinstance(only, torch.Tensor) and torch.equal(only, got_y)


@pytest.mark.parametrize("form", R.FORMS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_rwkv_time_mixing_forms_match_the_loop(form, length, with_state):
    from transformers.models.rwkv import modeling_rwkv

    g = _gen(100 + length)
    b, c = 2, 5
    key = torch.randn(b, length, c, generator=g) * 3  # large keys exercise the running maximum
    value = torch.randn(b, length, c, generator=g)
    decay, first = torch.randn(c, generator=g), torch.randn(c, generator=g)
    state = None
    if with_state:
        state = [
            torch.randn(b, c, generator=g),
            torch.rand(b, c, generator=g) + 0.5,
            torch.randn(b, c, generator=g),
        ]

    def copy(s):
        return None if s is None else [t.clone() for t in s]

    want, want_state = modeling_rwkv.rwkv_linear_attention_cpu(decay, first, key, value, copy(state), True)
    got, got_state = R.rwkv_time_mixing_in_form(form, decay, first, key, value, copy(state), True)
    assert (got - want).abs().max().item() <= ATOL[form]
    # the state's representation may differ by the scale exp(max): compare the real sums it stands for
    for i in (0, 1):
        real_got = got_state[i] * torch.exp(got_state[2])
        real_want = want_state[i] * torch.exp(want_state[2])
        assert torch.allclose(real_got, real_want, rtol=1e-4, atol=1e-5)
    # no state asked for, none returned
    assert R.rwkv_time_mixing_in_form(form, decay, first, key, value)[1] is None


@pytest.mark.parametrize("form", R.FORMS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_rg_lru_forms_match_the_loop(form, length, with_state):
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    g = _gen(200 + length)
    b, w = 2, 6
    x = torch.randn(b, length, w, generator=g)
    gate = torch.rand(b, length, w, generator=g)
    positions = torch.tensor([[0, *range(1, length)], [3, *range(4, 3 + length)]])[:, :length]
    reset = positions[:, :, None] == 0  # the first row restarts at its first token, the second does not
    state = torch.randn(b, w, generator=g) if with_state else None
    original = RecurrentGemmaRglru._rnn_scan
    want, want_last = original(None, x, gate, reset, state)
    got, got_last = R.rg_lru_scan_in_form(form, original, None, x, gate, reset, state)
    assert got.shape == want.shape and got_last.dtype == torch.float32
    assert (got - want).abs().max().item() <= ATOL[form]
    assert (got_last - want_last).abs().max().item() <= ATOL[form]


def test_linear_recurrence_solves_the_recurrence_with_an_initial_state_across_chunks():
    g = _gen(7)
    log_a = -torch.rand(2, 37, 3, generator=g) * 2
    b = torch.randn(2, 37, 3, generator=g)
    h0 = torch.randn(2, 3, generator=g)
    h, want = h0, []
    for t in range(37):
        h = torch.exp(log_a[:, t]) * h + b[:, t]
        want.append(h)
    states, last = R.linear_recurrence(log_a, b, h0, chunk=8)
    assert torch.allclose(states, torch.stack(want, 1), atol=1e-5)
    assert torch.allclose(last, h, atol=1e-5)


def test_bad_arguments_raise_typed_errors_that_say_what_is_allowed():
    x = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="one of \\('scan', 'chunked'\\)"):
        R.mamba_selective_scan_in_form("loop", x, x, torch.zeros(4, 3), x, x)
    with pytest.raises(ValueError, match="one shape"):
        R.linear_recurrence(torch.zeros(1, 4, 2), torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        R.linear_recurrence(x, x, chunk=0)
    with pytest.raises(ValueError, match="one of"):
        R.register_recurrences("dynamo", form="unrolled")


def test_the_targets_are_the_loops_transformers_still_has():
    # Retire a patch when its target no longer loops over the tokens (or is gone).
    import importlib
    import inspect

    for path in (*R.MAMBA_SCAN_TARGETS, *R.RWKV_TARGETS):
        module, name = path.rsplit(".", 1)
        target = getattr(importlib.import_module(module), name)
        assert callable(target), path
    from transformers.models.mamba import modeling_mamba
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru
    from transformers.models.rwkv import modeling_rwkv

    assert "for index in range(seq_len):" in inspect.getsource(modeling_mamba.mamba_selective_scan)
    assert "for current_index in range(seq_length):" in inspect.getsource(
        modeling_rwkv.rwkv_linear_attention_cpu
    )
    assert "for t in range(hidden_states.shape[1]):" in inspect.getsource(RecurrentGemmaRglru._rnn_scan)


@pytest.mark.parametrize("length", LENGTHS)
def test_mamba2_chunk_scan_on_whole_chunks_matches_the_unpadded_call(length):
    from transformers.models.mamba2 import modeling_mamba2

    g = _gen(300 + length)
    b, h, p, groups, n, chunk = 2, 4, 3, 2, 5, 16
    x = torch.randn(b, length, h, p, generator=g)
    dt = torch.randn(b, length, h, generator=g)
    A = -torch.rand(h, generator=g) * 3
    B, C = (torch.randn(b, length, groups, n, generator=g) for _ in range(2))
    kw = {"D": torch.randn(h, generator=g), "dt_bias": torch.randn(h, generator=g), "dt_softplus": True}
    original = modeling_mamba2.mamba2_chunk_scan
    want_y, want_state = original(x, dt, A, B, C, chunk, return_final_states=True, **kw)
    got_y, got_state = R.mamba2_chunk_scan_padded(
        original, x, dt, A, B, C, chunk, return_final_states=True, **kw
    )
    assert got_y.shape == want_y.shape == (b, length, h, p)
    assert (got_y - want_y).abs().max().item() <= 1e-5
    assert (got_state - want_state).abs().max().item() <= 1e-5
    # with an initial state the call is passed on as it is
    state = torch.randn(b, h, p, n, generator=g)
    assert torch.equal(
        R.mamba2_chunk_scan_padded(original, x, dt, A, B, C, chunk, initial_states=state, **kw),
        original(x, dt, A, B, C, chunk, initial_states=state, **kw),
    )


@pytest.mark.parametrize(
    "padding", [(0, 0, 1, -1), (0, 0, -1, 1), (-2, 1), (1, -1, -1, 2), (0, 0, 0, 0), (-1, -1, 0, 0, 1, 0)]
)
def test_a_negative_padding_width_as_a_slice_equals_the_pad(padding):
    x = torch.randn(2, 5, 4, generator=_gen(7))
    want = torch.nn.functional.pad(x, padding, "constant", 0.5)
    got = R.constant_pad_without_negative_widths(x, padding, 0.5)
    assert got.shape == want.shape and torch.equal(got, want)


def test_rwkv_token_shift_captures_without_a_negative_pad_width_under_the_patch():
    # RWKV's time_shift; ExecuTorch's portable constant_pad_nd refuses a negative width at run time (0x12)
    from hfexport.registry import apply_patches, isolated_registry

    shift = torch.nn.ZeroPad2d((0, 0, 1, -1))
    x = torch.randn(2, 6, 3, generator=_gen(8))
    dims = ({1: torch.export.Dim("length", min=2, max=64)},)

    def pads(program):
        return [
            list(n.args[1])
            for n in program.graph.nodes
            if n.op == "call_function" and str(n.target).split(".")[1:2] in (["pad"], ["constant_pad_nd"])
        ]

    assert any(min(p) < 0 for p in pads(torch.export.export(shift, (x,), dynamic_shapes=dims)))
    with isolated_registry():
        R.register_time_shift_without_crop("pad-check", versions={"torch": ">=2.0"})
        with apply_patches("pad-check") as entries:
            assert [e.name.split(".")[-1] for e in entries] == ["constant_pad_crop_as_slice"]
            program = torch.export.export(shift, (x,), dynamic_shapes=dims)
    assert pads(program) and all(min(p) >= 0 for p in pads(program))
    for length in (2, 6, 40):
        y = torch.randn(2, length, 3, generator=_gen(length))
        assert torch.equal(program.module()(y), shift(y))


def test_negative_padding_widths_refuse_a_bad_padding():
    with pytest.raises(ValueError, match="one \\(before, after\\) pair"):
        R.constant_pad_without_negative_widths(torch.zeros(2, 3), (1, 2, 3))
    with pytest.raises(ValueError, match="at most 2 pairs"):
        R.constant_pad_without_negative_widths(torch.zeros(2, 3), (1, 1, 1, 1, 1, 1))


def test_rwkv_is_rescaled_before_capture_as_its_first_eval_forward_would():
    from hfexport.testing import tiny_model
    from hfexport.workarounds.input_preparers import apply_export_input_preparers

    model, inputs = tiny_model("rwkv", "text-generation", seed=0)
    model.config.rescale_every = 1  # every layer's weights divided (the tiny config's 6 divides none)
    backbone = model.rwkv
    assert not backbone.layers_are_rescaled and not model.training
    weight = backbone.blocks[1].attention.output.weight.detach().clone()
    prepared = apply_export_input_preparers(model, dict(inputs))
    assert prepared.keys() == inputs.keys()
    assert backbone.layers_are_rescaled
    torch.testing.assert_close(backbone.blocks[1].attention.output.weight, weight / 2)
    apply_export_input_preparers(model, dict(inputs))  # once only
    torch.testing.assert_close(backbone.blocks[1].attention.output.weight, weight / 2)


class _SlicedTransposeTwice(torch.nn.Module):
    """RecurrentGemma's pattern: a transposed slice used by two consumers."""

    def forward(self, x):
        y = x[:, :, : x.shape[2] - 1].transpose(1, 2)
        return y.sum(dim=1), y * 2


def test_a_transposed_slice_gets_one_transpose_per_consumer():
    x = torch.randn(2, 3, 6, generator=_gen(11))
    program = torch.export.export(_SlicedTransposeTwice(), (x,))
    gm = program.graph_module

    def transposes():
        return [n for n in gm.graph.nodes if str(n.target) == "aten.transpose.int"]

    (only,) = transposes()
    assert len(only.users) == 2
    rewritten = [
        R.sliced_transpose_per_consumer(gm, n) for n in list(gm.graph.nodes) if n.op == "call_function"
    ]
    assert rewritten.count(True) == 1
    gm.recompile()
    assert [len(n.users) for n in transposes()] == [1, 1]
    module = _SlicedTransposeTwice()
    for got, want in zip(program.module()(x), module(x), strict=True):
        assert torch.equal(got, want)
    # a transpose of anything but a slice, or with one consumer, is left alone
    assert not any(
        R.sliced_transpose_per_consumer(gm, n) for n in list(gm.graph.nodes) if n.op == "call_function"
    )


def test_kda_chunks_as_a_scan_matches_the_loop_and_exports_for_any_chunk_count():
    # GLM-5-Next's chunked Kimi delta attention loops over 64-token chunks in Python: a one-chunk
    # sample was specialised (Guard failed: inputs_embeds.size()[1] <= 64, issue 28); here a one-chunk
    # sample of 3 tokens serves 4, 5 and 23 (several chunks)
    from torch.export import Dim
    from transformers.models.glm5_next import modeling_glm5_next

    original = modeling_glm5_next.chunk_kimi_delta_attention
    scanned = R.kda_chunks_as_a_scan(original)

    def split(x):
        batch, length = x.shape[:2]
        q, k, v, g = (x[..., 8 * i : 8 * (i + 1)].reshape(batch, length, 2, 4) for i in range(4))
        return q, k, v, -g.abs() * 0.5, x[..., 32:34].sigmoid()

    class Attention(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            # chunks of 4 (the models use 64): the same construct, a short trace
            return self.fn(*split(x), chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def sample(length):
        return torch.randn(1, length, 34, generator=torch.Generator().manual_seed(length))

    shapes = ({1: Dim("length", min=2, max=512)},)
    with pytest.raises(Exception, match="Constraints violated"):
        torch.export.export(Attention(original), (sample(3),), dynamic_shapes=shapes)
    program = torch.export.export(Attention(scanned), (sample(3),), dynamic_shapes=shapes)
    for length in (3, 4, 5, 23):
        expected, expected_state = Attention(original)(sample(length))
        for fn in (Attention(scanned), program.module()):
            got, state = fn(sample(length))
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(state, expected_state, atol=2e-6, rtol=1e-5)


def _gated_delta_rule_inputs(length, *, k_heads=2, v_heads=4, dim=8, state=False):
    gen = _gen(length)
    q, k = (torch.randn(1, length, k_heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(1, length, v_heads, dim, generator=gen)
    g = -torch.rand(1, length, v_heads, generator=gen)  # log-decays <= 0
    beta = torch.rand(1, length, v_heads, generator=gen)
    initial = torch.randn(1, v_heads, dim, dim, generator=gen) if state else None
    return (q, k, v), {"g": g, "beta": beta, "initial_state": initial}


@pytest.mark.parametrize("form", R.CHUNK_LOOP_FORMS)
def test_gated_delta_rule_in_either_form_matches_the_loop_across_64_token_chunks(form):
    # Qwen3.5's chunked gated delta rule, its own 64-token chunks, grouped value heads, with and
    # without a carried state: one chunk (17), across a boundary (64 + 5), three chunks (130)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    replaced = R._gated_delta_rule_in_form(original, form)
    for length, state in ((17, False), (69, True), (130, False)):
        args, kwargs = _gated_delta_rule_inputs(length, state=state)
        kwargs |= {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
        want, want_state = original(*args, **kwargs)
        got, got_state = replaced(*args, **kwargs)
        assert got.shape == want.shape == (1, length, 4, 8) and got_state.shape == (1, 4, 8, 8)
        assert (got - want).abs().max().item() <= 1e-5, (length, state)
        assert (got_state - want_state).abs().max().item() <= 1e-5, (length, state)
    with pytest.raises(ValueError, match="chunk loop form must be one of"):
        R.register_chunk_loops("dynamo", form="chunked")


def test_gated_delta_rule_as_a_scan_exports_for_any_chunk_count():
    # upstream's loop over chunks is unrolled at the sample's count: with a dynamic length the export
    # is refused (the length is specialised); the scan form serves one chunk and several
    from torch.export import Dim
    from transformers.models.qwen3_5 import modeling_qwen3_5

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    scanned = R.gated_delta_rule_chunks_as_a_scan(original)

    class Attention(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, q, k, v, g, beta):
            # chunks of 4 (the models use 64): the same construct, a short trace
            return self.fn(q, k, v, g=g, beta=beta, chunk_size=4, output_final_state=True)

    def sample(length):
        (q, k, v), kw = _gated_delta_rule_inputs(length, k_heads=2, v_heads=2, dim=4)
        return q, k, v, kw["g"], kw["beta"]

    length = Dim("length", min=2, max=512)
    shapes = ({1: length}, {1: length}, {1: length}, {1: length}, {1: length})
    with pytest.raises(Exception, match="Constraints violated"):
        torch.export.export(Attention(original), sample(3), dynamic_shapes=shapes)
    program = torch.export.export(Attention(scanned), sample(3), dynamic_shapes=shapes)
    for n in (3, 4, 5, 23):
        expected, expected_state = Attention(original)(*sample(n))
        got, state = program.module()(*sample(n))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
