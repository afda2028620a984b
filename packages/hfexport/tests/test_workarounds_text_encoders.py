"""The text encoders' capture workarounds (hfexport.workarounds.text_encoders, issue 28).

Funnel's relative positions and decoder upsampling: the replacements give the original's tensors
exactly, are in place only inside ``apply_patches``, and the captured program of a tiny Funnel
takes another sequence length with eager's numbers (without them it keeps the sample's length).
Tiny models only (each case a few seconds).
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from transformers import CanineConfig, FunnelConfig
from transformers.models.canine import modeling_canine
from transformers.models.funnel import modeling_funnel

from hfexport import registry
from hfexport.registry import apply_patches
from hfexport.testing import tiny_model
from hfexport.workarounds import text_encoders

POSITIONS = f"{text_encoders.__name__}.funnel_relative_positions_from_sizes"
UPSAMPLE = f"{text_encoders.__name__}.funnel_upsample_always_sliced"
SHIFT = f"{text_encoders.__name__}.funnel_relative_shift_by_index"


def _attribute(path: str):
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError:
        module_name, _, cls = module_name.rpartition(".")
        return getattr(importlib.import_module(module_name), cls).__dict__[attr]


def test_entries_are_registered_under_the_capture_scope_with_issue_links_and_ranges():
    assert text_encoders.KEY == "capture.text_encoders"
    found = {e.name: e for e in registry.entries(text_encoders.KEY, kind="patch")}
    assert found[POSITIONS].paths == text_encoders.FUNNEL_POSITION_TARGETS
    assert found[UPSAMPLE].paths == text_encoders.FUNNEL_UPSAMPLE_TARGETS
    assert found[SHIFT].paths == text_encoders.FUNNEL_SHIFT_TARGETS
    for name in (POSITIONS, UPSAMPLE, SHIFT):
        assert found[name].issue == "https://github.com/huggingface/transformers/pull/6908"
        assert found[name].description
        assert found[name].is_active(), found[name].inactive_reason()
        assert not found[name].unresolved, found[name].unresolved


def test_patches_are_in_place_only_inside_apply_patches_and_restored_after_an_error():
    paths = (
        *text_encoders.FUNNEL_POSITION_TARGETS,
        *text_encoders.FUNNEL_UPSAMPLE_TARGETS,
        *text_encoders.FUNNEL_SHIFT_TARGETS,
    )
    before = {path: _attribute(path) for path in paths}
    with apply_patches("capture"):  # the parent key alone: none of them
        assert all(_attribute(path) is before[path] for path in paths)
    with pytest.raises(RuntimeError, match="boom"), apply_patches(text_encoders.KEY):
        for path in paths:
            assert _attribute(path) is not before[path], path
        raise RuntimeError("boom")
    for path in paths:
        assert _attribute(path) is before[path], path


def test_capture_key_picks_the_scope_for_funnel_only():
    funnel, _ = tiny_model("funnel", "feature-extraction")
    assert text_encoders.capture_key(funnel) == text_encoders.KEY
    assert text_encoders.capture_key(torch.nn.Sequential(funnel)) == text_encoders.KEY
    bert, _ = tiny_model("bert", "feature-extraction")
    assert text_encoders.capture_key(bert) is None


@pytest.mark.parametrize(
    ("separate_cls", "truncate_seq", "block_sizes"),
    list(itertools.product([True, False], [True, False], [[1, 1], [1, 1, 1], [2, 1, 1, 1]])),
)
def test_funnel_position_embeds_equal_the_originals_at_every_length(separate_cls, truncate_seq, block_sizes):
    config = FunnelConfig(
        d_model=16, separate_cls=separate_cls, truncate_seq=truncate_seq, block_sizes=block_sizes
    )
    structure = modeling_funnel.FunnelAttentionStructure(config).eval()
    compared = 0
    for seq_len in range(1, 20):
        cpu = torch.device("cpu")
        try:
            expected = structure.get_position_embeds(seq_len, torch.float32, cpu)
        except RuntimeError:  # too short for its blocks: the original gathers past its table
            with pytest.raises(RuntimeError, match="out of bounds"):
                text_encoders.funnel_relative_position_embeds(structure, seq_len, torch.float32, cpu)
            continue
        compared += 1
        got = text_encoders.funnel_relative_position_embeds(structure, seq_len, torch.float32, cpu)
        assert len(got) == len(expected) == len(block_sizes)
        for (want_plain, want_pooled), (got_plain, got_pooled) in zip(expected, got):
            assert torch.equal(got_plain, want_plain), seq_len
            assert (got_pooled is None) == (want_pooled is None), seq_len
            if want_pooled is not None:
                assert torch.equal(got_pooled, want_pooled), seq_len
    assert compared >= 8


def test_pooled_positions_follow_stride_pool_pos():
    structure = modeling_funnel.FunnelAttentionStructure(FunnelConfig(separate_cls=True, truncate_seq=True))
    plain = modeling_funnel.FunnelAttentionStructure(FunnelConfig(separate_cls=False))
    for seq_len in range(1, 12):
        for owner, sep, trunc in ((structure, True, True), (plain, False, True)):
            listed = list(range(seq_len))
            positions = text_encoders.PooledPositions.of_length(seq_len)
            for block in (1, 2):
                listed = owner.stride_pool_pos(listed, block)
                positions = positions.pooled(block, sep, trunc)
                assert positions.size == len(listed)
                assert (positions.first, positions.last) == (listed[0], listed[-1])


@pytest.mark.parametrize(("separate_cls", "truncate_seq"), list(itertools.product([True, False], repeat=2)))
def test_funnel_upsample_equals_the_original(separate_cls, truncate_seq):
    gen = torch.Generator().manual_seed(0)
    for pooled_len, stride in ((3, 2), (4, 2), (2, 4), (5, 4)):
        x = torch.randn(2, pooled_len, 6, generator=gen)
        for target_len in range(1, stride * pooled_len + 1):
            try:
                expected = modeling_funnel.upsample(x, stride, target_len, separate_cls, truncate_seq)
            except RuntimeError:
                continue
            got = text_encoders.funnel_upsample(x, stride, target_len, separate_cls, truncate_seq)
            assert torch.equal(got, expected), (pooled_len, stride, target_len)


@pytest.mark.parametrize("shift", [1, 2])
def test_funnel_relative_shift_selects_the_originals_scores_exactly(shift):
    """Every (query length, context length) the attention builds: rel = 2 * context + shift - 1, the
    queries as many as the keys (shift 1) or pooled to about half (shift 2)."""
    gen = torch.Generator().manual_seed(shift)
    compared = 0
    for context_len in range(1, 12):
        rel = 2 * context_len + shift - 1
        for seq_len in {context_len, (context_len + 1) // 2, 1}:
            scores = torch.randn(2, 3, seq_len, rel, generator=gen)
            expected = modeling_funnel._relative_shift_gather(scores, context_len, shift)
            got = text_encoders.funnel_relative_shift(scores, context_len, shift)
            assert got.shape == (2, 3, seq_len, context_len)
            assert torch.equal(got, expected), (seq_len, context_len)
            compared += 1
    assert compared >= 25


def _text_dynamic(inputs):
    auto = torch.export.Dim.AUTO
    return {name: {0: auto, 1: auto} for name in inputs}


def _longer(inputs, seq_len=13):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 90, (3, seq_len), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize(
    ("model_type", "seq_len", "width"),
    [
        # the program kept the sample's length (Guard failed: input_ids.size()[1] == 8)
        ("funnel", 13, "d_model"),
        # capture failed on (mask > 0).any().item() (GuardOnDataDependentSymNode: Eq(u1, 1)); ~10 s,
        # the default run captures Longformer once, with its global token (classification test below)
        pytest.param("longformer", 11, "hidden_size", marks=pytest.mark.extended),
        # the program kept the sample's length (Guard failed: attention_mask.size()[1] == 8); 140
        # characters are two local-attention windows of 128
        pytest.param("canine", 140, "hidden_size", marks=pytest.mark.extended),  # ~15 s
    ],
)
def test_program_takes_another_sequence_length_and_matches_eager(model_type, seq_len, width):
    """issue 28: captured with the patches, the program runs at a second length equal to eager."""
    model, inputs = tiny_model(model_type, "feature-extraction")
    assert set(inputs) == {"input_ids", "attention_mask"}
    longer = _longer(inputs, seq_len=seq_len)
    with torch.no_grad():
        expected = model(**longer).last_hidden_state
        with apply_patches(text_encoders.KEY):
            program = torch.export.export(
                model, (), dict(inputs), dynamic_shapes=_text_dynamic(inputs), strict=False
            )
        got = program.module()(**longer).last_hidden_state
    assert got.shape == expected.shape == (3, seq_len, getattr(model.config, width))
    assert float(expected.abs().max()) > 1e-3
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.extended  # ~15 s; says when transformers' Funnel no longer needs the patches
def test_funnel_program_keeps_the_sample_length_without_the_patches():
    model, inputs = tiny_model("funnel", "feature-extraction")
    with torch.no_grad(), pytest.raises(Exception, match=r"specialized it to be a constant \(8\)|== 8"):
        program = torch.export.export(
            model, (), dict(inputs), dynamic_shapes=_text_dynamic(inputs), strict=False
        )
        program.module()(**_longer(inputs))


SLIDING_RECORD = f"{text_encoders.__name__}.sliding_window_records_global_slots"
SLIDING_CLS = f"{text_encoders.__name__}.sliding_window_records_cls_global_mask"
SLIDING_ATTENTION = f"{text_encoders.__name__}.sliding_window_attention_with_static_sizes"
SLIDING_PAD = f"{text_encoders.__name__}.sliding_window_pads_to_a_window_multiple"


def test_sliding_window_entries_are_registered_with_their_targets():
    found = {e.name: e for e in registry.entries(text_encoders.KEY, kind="patch")}
    assert found[SLIDING_RECORD].paths == text_encoders.SLIDING_WINDOW_MODEL_TARGETS
    assert found[SLIDING_CLS].paths == text_encoders.SLIDING_WINDOW_CLS_HEAD_TARGETS
    assert found[SLIDING_ATTENTION].paths == text_encoders.SLIDING_WINDOW_ATTENTION_TARGETS
    assert found[SLIDING_PAD].paths == text_encoders.SLIDING_WINDOW_PAD_TARGETS
    for name in (SLIDING_RECORD, SLIDING_CLS, SLIDING_ATTENTION, SLIDING_PAD):
        assert found[name].issue == "https://github.com/huggingface/transformers/pull/33694"
        assert found[name].is_active(), found[name].inactive_reason()
        assert not found[name].unresolved, found[name].unresolved
    longformer, _ = tiny_model("longformer", "feature-extraction")
    assert text_encoders.capture_key(longformer) == text_encoders.KEY


def test_longformer_patched_forward_equals_eager_with_and_without_a_global_mask():
    model, inputs = tiny_model("longformer", "feature-extraction")
    global_mask = torch.zeros_like(inputs["input_ids"])
    global_mask[:, 0] = 1  # <s> attends globally
    global_mask[1, 3] = 1  # and a second token in one row: transformers pads the other row's slot
    with torch.no_grad():
        local = model(**inputs).last_hidden_state
        with_global = model(**inputs, global_attention_mask=global_mask).last_hidden_state
        with apply_patches(text_encoders.KEY):
            patched_local = model(**inputs).last_hidden_state
            patched_global = model(**inputs, global_attention_mask=global_mask).last_hidden_state
    assert not torch.allclose(local, with_global, atol=1e-4)  # the global path changes the numbers
    torch.testing.assert_close(patched_local, local, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(patched_global, with_global, atol=1e-6, rtol=1e-6)
    assert not hasattr(model.config, "onnx_export") or model.config.onnx_export is False


def _small_window_layer():
    """A Longformer self-attention of window 4 (w = 2), so a 10-token sequence spans 5 blocks."""
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    torch.manual_seed(0)
    config = LongformerConfig(
        hidden_size=16, num_attention_heads=2, attention_window=[4], num_hidden_layers=1
    )
    return LongformerSelfAttention(config, layer_id=0).eval()


@pytest.mark.parametrize(
    ("global_rows", "slots"),
    [
        ({}, 0),  # no global token: the local path
        ({0: [0], 1: [0]}, 1),  # the <s> token of every row: one slot
        ({0: [0]}, 1),  # <s> global in one row only (transformers' padded slot in the other)
        ({0: [1, 6], 1: [9]}, None),  # any tokens, unequal counts: a slot per position
    ],
)
def test_sliding_window_self_attention_equals_the_layer(global_rows, slots):
    layer = _small_window_layer()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 12, 16, generator=gen)
    mask = torch.zeros(2, 12)
    mask[1, -3:] = -10000.0  # padding at the end of the second row
    for row, positions in global_rows.items():
        mask[row, positions] = 10000.0
    masked, is_global = mask < 0, mask > 0
    with torch.no_grad():
        (expected,) = layer(
            hidden,
            attention_mask=mask,
            is_index_masked=masked,
            is_index_global_attn=is_global,
            is_global_attn=bool(is_global.any()),
        )
        got = text_encoders.sliding_window_self_attention(
            layer, hidden, mask, masked, is_global, global_slots=slots
        )
    assert got.shape == (2, 12, 16)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_sliding_window_self_attention_refuses_bad_shapes_and_slots():
    layer = _small_window_layer()
    mask = torch.zeros(1, 8)
    with pytest.raises(ValueError, match=r"hidden_states must be \(batch, seq, 16\)"):
        text_encoders.sliding_window_self_attention(layer, torch.zeros(1, 8, 15), mask, mask < 0, mask > 0)
    with pytest.raises(ValueError, match="global_slots must be None or >= 0"):
        text_encoders.sliding_window_self_attention(
            layer, torch.zeros(1, 8, 16), mask, mask < 0, mask > 0, global_slots=-1
        )


@pytest.mark.extended  # ~10 s; says when transformers' Longformer no longer needs the patches
def test_longformer_capture_fails_without_the_patches():
    model, inputs = tiny_model("longformer", "feature-extraction")
    with torch.no_grad(), pytest.raises(Exception, match="data-dependent"):
        torch.export.export(model, (), dict(inputs), dynamic_shapes=_text_dynamic(inputs), strict=False)


CANINE_BLOCKS = f"{text_encoders.__name__}.canine_local_attention_in_blocks"


def test_canine_entry_is_registered_with_its_target_and_issue():
    found = {e.name: e for e in registry.entries(text_encoders.KEY, kind="patch")}
    assert found[CANINE_BLOCKS].paths == text_encoders.CANINE_LOCAL_ATTENTION_TARGETS
    assert found[CANINE_BLOCKS].issue == "https://github.com/huggingface/transformers/issues/47491"
    assert found[CANINE_BLOCKS].is_active(), found[CANINE_BLOCKS].inactive_reason()
    assert not found[CANINE_BLOCKS].unresolved, found[CANINE_BLOCKS].unresolved
    canine, _ = tiny_model("canine", "feature-extraction")
    assert text_encoders.capture_key(canine) == text_encoders.KEY


def _canine_attention(width, **layout):
    config = CanineConfig(hidden_size=16, num_attention_heads=2, attention_probs_dropout_prob=0.0)
    strides = {
        f"attend_{side}_chunk_{what}": width for side in ("from", "to") for what in ("width", "stride")
    }
    torch.manual_seed(0)
    return modeling_canine.CanineAttention(config, local=True, **{**strides, **layout}).eval()


def _canine_mask(batch, seq_len, pads):
    mask = torch.ones(batch, seq_len)
    for row, pad in enumerate(pads):
        if pad:
            mask[row, seq_len - pad :] = 0
    return mask[:, None, :].expand(batch, seq_len, seq_len).contiguous()  # CanineModel's 3-D mask


@pytest.mark.parametrize("seq_len", [1, 3, 4, 5, 8, 11, 12])
def test_canine_blocks_equal_the_original_windows(seq_len):
    """Windows of 4: one or several, the last full or short; row 1 padded over a whole window (every
    key of its last window masked: the original spreads those rows' weight evenly)."""
    attention = _canine_attention(4)
    gen = torch.Generator().manual_seed(seq_len)
    states = torch.randn(3, seq_len, 16, generator=gen)
    mask = _canine_mask(3, seq_len, pads=[0, min(seq_len - 1, 6), 1])
    assert text_encoders.canine_runs_in_blocks(attention, mask, False)
    with torch.no_grad():
        (expected,) = attention(states, mask)
        (got,) = text_encoders.canine_block_local_attention(attention, states, mask)
    assert got.shape == expected.shape == (3, seq_len, 16)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_canine_other_layouts_and_attention_outputs_run_the_original():
    states = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    mask = _canine_mask(2, 10, pads=[0, 2])
    overlapping = _canine_attention(4, attend_from_chunk_width=6, attend_to_chunk_width=6)
    first_to_all = _canine_attention(4, first_position_attends_to_all=True)
    tiling = _canine_attention(4)
    assert not text_encoders.canine_runs_in_blocks(overlapping, mask, False)
    assert not text_encoders.canine_runs_in_blocks(first_to_all, mask, False)
    assert not text_encoders.canine_runs_in_blocks(tiling, mask, True)
    assert not text_encoders.canine_runs_in_blocks(tiling, None, False)
    with torch.no_grad():
        expected = first_to_all(states, mask)[0]
        probs = tiling(states, mask, output_attentions=True)
        with apply_patches(text_encoders.KEY):
            got = first_to_all(states, mask)[0]
            patched_probs = tiling(states, mask, output_attentions=True)
    assert torch.equal(got, expected)
    assert len(patched_probs) == len(probs) == 1 + 3  # the output and one probability map per window
    assert torch.equal(patched_probs[0], probs[0])


class _LocalAttention(torch.nn.Module):
    """A CANINE local attention layer on its own, as CanineModel calls it (3-D mask from a 2-D one)."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states, attention_mask):
        seq_len = hidden_states.shape[1]
        mask = attention_mask[:, None, :].float().expand(-1, seq_len, -1)
        return self.attention(hidden_states, mask)[0]


def test_canine_local_attention_program_takes_other_lengths_and_window_counts():
    """issue 28: captured at 3 positions (one window of 4) with the patch, the layer's program runs at
    5, 8 and 13 positions (two to four windows) equal to eager (without it: Guard failed: ... == 3)."""
    layer = _LocalAttention(_canine_attention(4))
    gen = torch.Generator().manual_seed(2)
    sample = (torch.randn(2, 3, 16, generator=gen), torch.ones(2, 3, dtype=torch.long))
    dynamic = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},) * 2
    with torch.no_grad(), apply_patches(text_encoders.KEY):
        program = torch.export.export(layer, sample, dynamic_shapes=dynamic, strict=False).module()
    for seq_len in (5, 8, 13):
        states = torch.randn(3, seq_len, 16, generator=gen)
        mask = torch.ones(3, seq_len, dtype=torch.long)
        mask[1, -min(seq_len - 1, 5) :] = 0
        with torch.no_grad():
            expected = layer(states, mask)
            got = program(states, mask)
        assert got.shape == (3, seq_len, 16)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.extended  # ~10 s; says when transformers' CANINE no longer needs the patch
def test_canine_program_keeps_the_sample_length_without_the_patch():
    model, inputs = tiny_model("canine", "feature-extraction")
    with torch.no_grad(), pytest.raises(Exception, match=r"specialized it to be a constant \(8\)|== 8"):
        program = torch.export.export(
            model, (), dict(inputs), dynamic_shapes=_text_dynamic(inputs), strict=False
        )
        program.module()(**_longer(inputs))


def test_longformer_classification_program_with_its_cls_global_token_matches_eager():
    """issue 28: the sequence-classification head puts global attention on <s> itself; captured
    with the patches (capture failed on Eq(u0, 1)) and named batch / sequence dims as ExecuTorch
    gives them (the solver failed on the padded length's divisibility guards: Cannot create Dim
    with inconsistent min=1, max=1), the program takes other lengths and batches with eager's
    logits, padded rows included."""
    model, inputs = tiny_model("longformer", "text-classification")
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=511)
    with torch.no_grad():
        with apply_patches(text_encoders.KEY):
            program = torch.export.export(
                model,
                (),
                dict(inputs),
                dynamic_shapes={name: {0: batch, 1: seq} for name in inputs},
                strict=False,
            )
        for seq_len in (8, 13):
            longer = _longer(inputs, seq_len=seq_len)
            expected = model(**longer).logits
            local_only = model(**longer, global_attention_mask=torch.zeros_like(longer["input_ids"])).logits
            got = program.module()(**longer).logits
            assert got.shape == expected.shape == (3, model.config.num_labels)
            assert not torch.allclose(expected, local_only, atol=1e-5)  # <s>'s global attention counts
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["longformer", "led"])
def test_window_padding_equals_the_original_at_every_length(model_type):
    model, _ = tiny_model(model_type, "feature-extraction")
    owner = model if model_type == "longformer" else model.get_encoder()
    window = max(owner.config.attention_window)
    for seq_len in (1, 7, window, window + 3):
        ids = torch.arange(seq_len).repeat(2, 1) + 5
        call = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "inputs_embeds": None,
            "pad_token_id": 1,
        }
        if model_type == "longformer":
            call |= {"token_type_ids": torch.zeros_like(ids), "position_ids": None}
        expected = owner._pad_to_window_size(**call)
        with apply_patches(text_encoders.KEY):
            got = owner._pad_to_window_size(**call)
        assert got[0] == expected[0] == -seq_len % window
        for mine, theirs in zip(got[1:], expected[1:], strict=True):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)
