"""The core capture workarounds: guard-free sliding-window cache, size-1 batch axes kept dynamic."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch
import torch.fx.experimental._config as fx_config
from packaging.requirements import Requirement
from torch.export import Dim
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

import hfexport.workarounds.torch_export as workarounds
from hfexport import registry
from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.report import ExportReport
from hfexport.testing import tiny_model

ATOL = 1e-4
SLIDING = f"{workarounds.__name__}.sliding_window_update_keeps_dynamic_length"
POOLING = [
    f"{workarounds.__name__}.avg_pool_over_the_whole_map_as_mean",
    f"{workarounds.__name__}.max_pool_over_the_whole_map_as_amax",
    f"{workarounds.__name__}.max_pool1d_as_max_pool2d",
]
SIZE_ONE = f"{workarounds.__name__}.keep_size_one_batch_dynamic"
MOONSHINE = f"{workarounds.__name__}.moonshine_feature_lengths_by_floor_division"
#: the mask, T5Gemma2 and Moonshine capture patches, registered after the pooling ones
LATER = [
    f"{workarounds.__name__}.mask_functions_broadcast_instead_of_vmap",
    f"{workarounds.__name__}.t5gemma2_eoi_embedding_as_where",
    MOONSHINE,
]


def _core_supported() -> dict[str, str]:
    """The ranges the core package declares for its dependencies (``torch>=2.12`` ...)."""
    out = {}
    for line in importlib.metadata.requires("hfexport") or []:
        req = Requirement(line)
        if req.marker is None:
            out[req.name] = str(req.specifier)
    return out


def test_entries_are_registered_under_capture_with_issue_links_and_ranges():
    found = {e.name: e for e in registry.entries("capture", kind="patch")}
    assert {SLIDING, SIZE_ONE} <= set(found)
    assert found[SLIDING].issue == "https://github.com/pytorch/pytorch/issues/161705"
    assert found[SLIDING].paths == ("transformers.cache_utils.DynamicSlidingWindowLayer.update",)
    assert found[SLIDING].versions == {"torch": ">=2.12", "transformers": ">=5.23,<6"}
    assert found[SIZE_ONE].issue == "https://github.com/pytorch/pytorch/issues/157621"
    assert found[SIZE_ONE].paths == ("torch.export.export",)
    assert found[SIZE_ONE].versions == {"torch": ">=2.12"}
    supported = _core_supported()
    assert {"torch", "transformers"} <= set(supported)
    for entry in found.values():
        assert entry.backend == "capture" and entry.description
        assert entry.issue.startswith("https://github.com/")
        assert entry.is_active(), entry.inactive_reason()
        assert not entry.unresolved
        assert not entry.is_stale(supported)


# --------------------------------------------------------------------------------------------
# sliding-window cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 3, 4, 9])
def test_keep_last_equals_the_negative_slice(length):
    x = torch.arange(2 * length * 3).reshape(2, length, 3)
    assert torch.equal(workarounds.keep_last(x, 4, dim=1), x[:, -4:])


class SlidingCacheStep(torch.nn.Module):
    """One sliding-window cache update (window 6), returning the full and the kept states."""

    def forward(self, keys, values):
        layer = DynamicSlidingWindowLayer(sliding_window=6)
        full_keys, _ = layer.update(keys, values)
        return full_keys * 2, layer.keys, layer.values


def _sliding_sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"keys": torch.randn(2, 2, 4, 8, generator=gen), "values": torch.randn(2, 2, 4, 8, generator=gen)}


def test_sliding_window_capture_accepts_sequences_longer_than_the_window():
    original = DynamicSlidingWindowLayer.__dict__["update"]
    report = ExportReport(export_format="test")
    program = capture(SlidingCacheStep(), _sliding_sample(), DynamoConfig(dynamic=True), report)
    assert report.applied["capture_patches"] == [SLIDING, SIZE_ONE, *POOLING, *LATER]
    assert DynamicSlidingWindowLayer.__dict__["update"] is original  # restored after the capture
    keys, values = torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    full, kept_keys, kept_values = program.module()(keys=keys, values=values)
    assert torch.equal(full, keys * 2)
    assert kept_keys.shape == (3, 2, 5, 8)  # window - 1 positions kept
    assert torch.equal(kept_keys, keys[:, :, -5:]) and torch.equal(kept_values, values[:, :, -5:])
    short = torch.randn(1, 2, 3, 8)
    assert torch.equal(program.module()(keys=short, values=short)[1], short)
    kept_sizes = [str(n.meta["val"].shape[2]) for n in program.graph.output_node().args[0][1:]]
    assert all(size.startswith("Min(5, ") for size in kept_sizes), kept_sizes  # bounded by window - 1


def test_without_the_workaround_the_sliding_window_slice_bounds_the_sequence():
    with registry.isolated_registry():
        program = capture(SlidingCacheStep(), _sliding_sample(), DynamoConfig(dynamic=True))
    uppers = [int(r.upper) for r in program.range_constraints.values() if r.upper < 10**6]
    assert uppers and max(uppers) <= 5
    with pytest.raises(AssertionError, match="Guard failed"):
        program.module()(keys=torch.randn(3, 2, 20, 8), values=torch.randn(3, 2, 20, 8))


def test_sliding_window_capture_with_an_explicit_dim_longer_than_the_window():
    seq = Dim("seq", min=1, max=256)
    config = DynamoConfig(dynamic_shapes={"keys": {2: seq}, "values": {2: seq}})
    program = capture(SlidingCacheStep(), _sliding_sample(), config)
    keys = torch.randn(2, 2, 100, 8)
    assert torch.equal(program.module()(keys=keys, values=keys)[1], keys[:, :, -5:])


def test_record_past_layers_run_the_original_update():
    layer = DynamicSlidingWindowLayer(sliding_window=3)
    if not hasattr(layer, "record_past"):
        pytest.skip("this transformers has no record_past")
    calls = []

    def original(self, key_states, value_states, *args, **kwargs):
        calls.append(key_states.shape)
        return key_states, value_states

    update = workarounds.sliding_window_update_keeps_dynamic_length(original)
    layer.record_past = True
    states = torch.randn(1, 1, 4, 2)
    assert update(layer, states, states)[0] is states and calls == [states.shape]


def test_gemma2_captured_dynamic_runs_past_its_sliding_window():
    model, inputs = tiny_model("gemma2")
    window = model.config.sliding_window
    assert window == 32 and inputs["input_ids"].shape[1] < window
    program = capture(model, inputs, DynamoConfig(dynamic=True))
    gen = torch.Generator().manual_seed(1)
    longer = {
        "input_ids": torch.randint(3, model.config.vocab_size, (3, 65), generator=gen),
        "attention_mask": torch.ones(3, 65, dtype=torch.long),
    }
    assert longer["input_ids"].shape[1] > window
    got = program.module()(**longer)
    with torch.no_grad():
        expected = model(**longer)
    assert got.logits.shape == (3, 65, model.config.vocab_size)
    assert (got.logits - expected.logits).abs().max().item() <= ATOL
    assert isinstance(got.past_key_values, DynamicCache)
    for got_layer, expected_layer in zip(got.past_key_values.layers, expected.past_key_values.layers):
        assert got_layer.keys.shape == expected_layer.keys.shape  # sliding layers keep window - 1
        assert (got_layer.keys - expected_layer.keys).abs().max().item() <= ATOL
    assert {layer.keys.shape[2] for layer in got.past_key_values.layers} == {window - 1, 65}


# --------------------------------------------------------------------------------------------
# size-one batch axes
# --------------------------------------------------------------------------------------------


def test_size_one_batch_axis_detection():
    x = torch.zeros(1, 7)
    assert workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": {0: Dim.AUTO, 1: Dim.AUTO}}) == [
        "inputs['x'].shape[0]"
    ]
    assert workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": {0: Dim.DYNAMIC}})
    assert workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": (Dim("b"), None)})
    assert workarounds.dynamic_size_one_batch_axes({"x": [x]}, {"x": [{0: 2 * Dim("b")}]})
    assert not workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": {0: None, 1: Dim.AUTO}})
    assert not workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": {0: Dim.STATIC, 1: Dim.AUTO}})
    assert not workarounds.dynamic_size_one_batch_axes({"x": x}, {"x": None})
    assert not workarounds.dynamic_size_one_batch_axes({"x": torch.zeros(2, 7)}, {"x": {0: Dim.AUTO}})
    # a size-1 axis other than the batch (a single-token decode step) is left to torch
    assert not workarounds.dynamic_size_one_batch_axes(
        {"x": torch.zeros(2, 1)}, {"x": {0: Dim.AUTO, 1: Dim.AUTO}}
    )
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    from hfexport.capture import auto_dynamic_shapes
    from hfexport.pytree import register_cache_pytrees

    register_cache_pytrees()
    found = workarounds.dynamic_size_one_batch_axes({"cache": cache}, auto_dynamic_shapes({"cache": cache}))
    assert found and all(f.startswith("inputs['cache']") for f in found)


class Pool(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x, mask):
        return self.proj(x).mul(mask.unsqueeze(-1)).sum(dim=1)


def test_batch_one_sample_gives_a_program_with_a_dynamic_batch():
    sample = {"x": torch.randn(1, 5, 4), "mask": torch.ones(1, 5)}
    model = Pool().eval()
    original = torch.export.export
    program = capture(model, sample, DynamoConfig(dynamic=True))
    assert torch.export.export is original  # restored after the capture
    other = {"x": torch.randn(3, 9, 4), "mask": torch.ones(3, 9)}
    with torch.no_grad():
        assert torch.allclose(program.module()(**other), model(**other), atol=1e-6, rtol=0)
        assert torch.allclose(program.module()(**sample), model(**sample), atol=1e-6, rtol=0)


def test_without_the_workaround_a_batch_one_sample_specialises_the_batch():
    sample = {"x": torch.randn(1, 5, 4), "mask": torch.ones(1, 5)}
    with registry.isolated_registry():
        program = capture(Pool().eval(), sample, DynamoConfig(dynamic=True))
    with pytest.raises(AssertionError, match=r"Guard failed: x\.size\(\)\[0\] == 1"):
        program.module()(x=torch.randn(3, 9, 4), mask=torch.ones(3, 9))


@pytest.mark.parametrize("how", ["widened sample", "size-oblivious workaround"])
def test_batch_one_llama_captured_dynamic_runs_at_batch_three(how):
    model, inputs = tiny_model("llama", batch_size=1)
    assert inputs["input_ids"].shape[0] == 1
    if how == "widened sample":  # dynamic=True: the core traces the sample at batch 2
        config = DynamoConfig(dynamic=True)
    else:  # explicit dynamic_shapes are never widened: the capture workaround keeps the batch dynamic
        config = DynamoConfig(dynamic_shapes={k: {0: Dim.AUTO, 1: Dim.AUTO} for k in inputs})
    program = capture(model, inputs, config)
    assert program.example_inputs[1]["input_ids"].shape[0] == (2 if how == "widened sample" else 1)
    gen = torch.Generator().manual_seed(2)
    batch3 = {
        "input_ids": torch.randint(3, model.config.vocab_size, (3, 11), generator=gen),
        "attention_mask": torch.ones(3, 11, dtype=torch.long),
    }
    for feed in (batch3, inputs):
        got = program.module()(**feed)
        with torch.no_grad():
            expected = model(**feed)
        assert got.logits.shape == expected.logits.shape
        assert (got.logits - expected.logits).abs().max().item() <= ATOL


def test_size_oblivious_failure_falls_back_to_the_plain_trace_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(workarounds, "_SIZE_ONE_WARNED", False)
    seen = []

    def fake_export(mod, args, kwargs=None, *, dynamic_shapes=None, strict=False):
        seen.append(bool(fx_config.backed_size_oblivious))
        if fx_config.backed_size_oblivious:
            raise RuntimeError("size-oblivious trace is not possible here")
        return "plain"

    export = workarounds.keep_size_one_batch_dynamic(fake_export)
    batch_one = {"x": torch.zeros(1, 3)}
    with caplog.at_level(logging.WARNING, logger=workarounds.__name__):
        assert export(Pool(), (), batch_one, dynamic_shapes={"x": {0: Dim.AUTO}}) == "plain"
        assert export(Pool(), (), batch_one, dynamic_shapes={"x": {0: Dim.AUTO}}) == "plain"
    assert seen == [True, False, True, False]
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "size-oblivious trace failed (RuntimeError: size-oblivious trace is not possible here)"
    ]
    seen.clear()
    assert export(Pool(), (), {"x": torch.zeros(2, 3)}, dynamic_shapes={"x": {0: Dim.AUTO}}) == "plain"
    assert export(Pool(), (torch.zeros(1, 3),), dynamic_shapes=({0: Dim.AUTO},)) == "plain"
    assert seen == [False, True, False]
    assert not fx_config.backed_size_oblivious


class Boom(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("boom while tracing")


def test_workarounds_are_restored_when_the_capture_fails():
    export, update = torch.export.export, DynamicSlidingWindowLayer.__dict__["update"]
    with pytest.raises(Exception, match="boom while tracing"):
        capture(Boom(), {"x": torch.ones(1, 2)}, DynamoConfig(dynamic=True))
    assert torch.export.export is export
    assert DynamicSlidingWindowLayer.__dict__["update"] is update
    assert not fx_config.backed_size_oblivious


def test_dynamic_image_sides_are_not_pinned_by_a_size_one_feature_map():
    # issue 15: ConvNeXt traced on 32x32 has a 1x1 last-stage map; without the size-oblivious trace
    # the sides were guarded to [32, 63] and a 64x64 image was refused
    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.testing import tiny_model
    from hfexport.workarounds.torch_export import dynamic_image_side_axes

    model, inputs = tiny_model("convnext", "image-classification")
    assert dynamic_image_side_axes(inputs, {"pixel_values": {0: None, 2: torch.export.Dim.AUTO}}) == [
        "inputs['pixel_values'].shape[2]"
    ]
    program = capture(model, inputs, DynamoConfig(dynamic=True))
    image = torch.randn(3, 3, 64, 72, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = program.module()(pixel_values=image).logits
        expected = model(pixel_values=image).logits
    assert (got - expected).abs().max().item() < 1e-4


class WholeMapPooler(torch.nn.Module):
    """EfficientNet / ALIGN's pooler shape: a ceil_mode window far larger than the feature map."""

    def __init__(self, kind: str = "avg", kernel: int = 64) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        pool = torch.nn.AvgPool2d if kind == "avg" else torch.nn.MaxPool2d
        self.pool = pool(kernel, ceil_mode=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(pixel_values)).flatten(1)


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_a_pooling_window_over_the_whole_map_is_captured_as_a_reduction(kind):
    found = {e.name: e for e in registry.entries("capture", kind="patch")}
    name = "avg_pool_over_the_whole_map_as_mean" if kind == "avg" else "max_pool_over_the_whole_map_as_amax"
    assert found[f"{workarounds.__name__}.{name}"].issue == "https://github.com/pytorch/pytorch/issues/183528"
    model = WholeMapPooler(kind).eval()
    original = torch.nn.functional.avg_pool2d, torch.nn.functional.max_pool2d
    program = capture(model, {"pixel_values": torch.randn(2, 3, 10, 14)}, DynamoConfig(dynamic=True))
    assert (torch.nn.functional.avg_pool2d, torch.nn.functional.max_pool2d) == original  # restored
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("pool2d" in t for t in targets), targets
    assert ("aten.mean.dim" if kind == "avg" else "aten.amax.default") in targets
    for shape in ((2, 3, 10, 14), (3, 3, 30, 22)):  # two image sizes, both within the window
        image = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[2]))
        with torch.no_grad():
            assert (
                program.module()(pixel_values=image) - model(pixel_values=image)
            ).abs().max().item() < 1e-6
    # the window bounds the sides the program accepts: a map larger than the kernel is refused
    with pytest.raises(AssertionError, match=r"Guard failed: pixel_values.size\(\)\[2\] <= 128"):
        program.module()(pixel_values=torch.randn(1, 3, 260, 20))


def test_a_pooling_with_several_windows_keeps_its_pool_op():
    model = WholeMapPooler("avg", kernel=2).eval()  # 2x2 windows: more than one, not a whole-map mean
    program = capture(model, {"pixel_values": torch.randn(2, 3, 10, 14)}, DynamoConfig(dynamic=True))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "aten.avg_pool2d.default" in targets and "aten.mean.dim" not in targets


class MaskPooler(torch.nn.Module):
    """SEW's frame-mask pooling: ``max_pool1d`` over a ``[batch, 1, frames]`` mask, then a sum so the
    output depends on every pooled value."""

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.max_pool1d(attention_mask.float().unsqueeze(1), kernel_size=2, stride=2)
        return pooled.squeeze(1)


def test_max_pool1d_is_captured_with_a_dynamic_length():
    found = {e.name: e for e in registry.entries("capture", kind="patch")}
    entry = found[f"{workarounds.__name__}.max_pool1d_as_max_pool2d"]
    assert entry.paths == ("torch.nn.functional.max_pool1d",) and entry.versions == {"torch": ">=2.12"}
    original = torch.nn.functional.max_pool1d
    program = capture(
        MaskPooler(), {"attention_mask": torch.ones(2, 8, dtype=torch.long)}, DynamoConfig(dynamic=True)
    )
    assert torch.nn.functional.max_pool1d is original  # restored
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[0, 5:] = 0
    got = program.module()(attention_mask=mask)  # aten.max_pool1d would have fixed the length at 8
    expected = original(mask.float().unsqueeze(1), kernel_size=2, stride=2).squeeze(1)
    assert got.shape == (3, 6) and torch.equal(got, expected)
    assert got[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_without_the_max_pool1d_workaround_the_length_is_specialised():
    model = MaskPooler()
    with registry.isolated_registry():
        program = capture(
            model, {"attention_mask": torch.ones(2, 8, dtype=torch.long)}, DynamoConfig(dynamic=True)
        )
    with pytest.raises(AssertionError, match="Guard failed"):
        program.module()(attention_mask=torch.ones(3, 13, dtype=torch.long))


@pytest.mark.parametrize(
    "args,kwargs",
    [((3,), {}), ((2,), {"stride": 1, "padding": 1}), ((3, 2, 1, 2), {}), ((2,), {"ceil_mode": True})],
)
def test_max_pool1d_replacement_matches_the_original(args, kwargs):
    original = torch.nn.functional.max_pool1d
    replaced = workarounds.max_pool1d_as_max_pool2d(original)
    for shape in ((2, 4, 11), (4, 9)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
        assert torch.equal(replaced(x, *args, **kwargs), original(x, *args, **kwargs))
    values, indices = replaced(torch.randn(1, 2, 6), 2, return_indices=True)  # the original's path
    assert values.shape == indices.shape == (1, 2, 3)


# --------------------------------------------------------------------------------------------
# attention masks of combined mask functions, T5Gemma2's end-of-image embedding
# --------------------------------------------------------------------------------------------


def _two_left_one_right(batch_idx, head_idx, q_idx, kv_idx):
    """An index-based window (T5Gemma2's bidirectional sliding window with left 2, right 1)."""
    distance = q_idx - kv_idx
    return (distance < 3) & (-distance < 2)


class WindowedPaddingMask(torch.nn.Module):
    """``sdpa_mask`` of a combined mask function (``and_masks``), the path transformers vmaps."""

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        batch, length = attention_mask.shape
        mask = masking_utils.sdpa_mask(
            batch_size=batch,
            q_length=length,
            kv_length=length,
            mask_function=masking_utils.and_masks(
                masking_utils.bidirectional_mask_function, _two_left_one_right
            ),
            attention_mask=attention_mask.bool(),
            use_vmap=True,
        )
        return mask.to(torch.float32)


def _padded(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, -3:] = 0
    return mask


_FUNCTORCH_OPS = ("_add_batch_dim", "_remove_batch_dim", "_vmap_increment_nesting")


def _functorch_targets(program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if any(op in str(n.target) for op in _FUNCTORCH_OPS)]


def test_without_the_workaround_a_combined_mask_function_is_captured_with_vmap_ops():
    with registry.isolated_registry():
        program = capture(
            WindowedPaddingMask(), {"attention_mask": _padded(2, 8)}, DynamoConfig(dynamic=True)
        )
    assert _functorch_targets(program)


def test_a_combined_mask_function_is_captured_by_broadcasting_with_the_vmap_values():
    found = {e.name: e for e in registry.entries("capture", kind="patch")}
    entry = found[f"{workarounds.__name__}.mask_functions_broadcast_instead_of_vmap"]
    assert entry.issue == "https://github.com/pytorch/pytorch/issues/153063"
    model = WindowedPaddingMask()
    program = capture(model, {"attention_mask": _padded(2, 8)}, DynamoConfig(dynamic=True))
    assert _functorch_targets(program) == []
    for batch, length in ((2, 8), (3, 13)):
        expected = model(_padded(batch, length))  # eager: the original vmap expansion
        out = program.module()(attention_mask=_padded(batch, length))
        assert out.shape == (batch, 1, length, length)
        assert torch.equal(out, expected)
        assert 0 < expected.sum() < expected.numel()  # both kept and masked positions


def _eoi_embedding():
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextScaledWordEmbedding

    torch.manual_seed(0)
    module = T5Gemma2TextScaledWordEmbedding(12, 4, padding_idx=0, embed_scale=2.0, eoi_token_index=7)
    with torch.no_grad():
        module.eoi_embedding.copy_(torch.randn(4))
    return module.eval()


def _ids_with_eoi(batch: int, length: int) -> torch.Tensor:
    ids = torch.arange(batch * length).reshape(batch, length) % 12
    ids[:, 1] = 7
    return ids


def test_without_the_workaround_t5gemma2_eoi_embedding_is_captured_as_index_put():
    with registry.isolated_registry():
        program = capture(_eoi_embedding(), {"input_ids": _ids_with_eoi(2, 8)}, DynamoConfig(dynamic=True))
    assert any("index_put" in str(n.target) for n in program.graph.nodes)


def test_t5gemma2_eoi_embedding_is_captured_as_where_with_the_eager_values():
    module = _eoi_embedding()
    program = capture(module, {"input_ids": _ids_with_eoi(2, 8)}, DynamoConfig(dynamic=True))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("index_put" in t for t in targets), targets
    for batch, length in ((2, 8), (3, 5)):
        ids = _ids_with_eoi(batch, length)
        with torch.no_grad():
            expected = module(ids)
        out = program.module()(input_ids=ids)
        assert out.shape == (batch, length, 4)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(out[:, 1], module.eoi_embedding.detach().expand(batch, 4), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Moonshine: the convolutions' output length by integer arithmetic
# --------------------------------------------------------------------------------------------


def test_moonshine_output_length_equals_the_original_at_every_accepted_length():
    from transformers.models.moonshine.modeling_moonshine import MoonshinePreTrainedModel

    original = MoonshinePreTrainedModel._get_feat_extract_output_lengths
    for length in range(895, 40_000):  # 895 samples: the first length all three convolutions accept
        assert workarounds.moonshine_output_length(length) == original(None, length), length
    assert workarounds.moonshine_output_length(2640) == 5  # the tiny sample's audio: 5 encoder frames


class MoonshineMaskPath(torch.nn.Module):
    """Moonshine's encoder mask path: the mask taken at every 384th sample, cut to the frame count."""

    def forward(self, attention_mask):
        from transformers.models.moonshine.modeling_moonshine import MoonshinePreTrainedModel

        frames = MoonshinePreTrainedModel._get_feat_extract_output_lengths(self, attention_mask.shape[-1])
        return attention_mask[..., ::384][..., :frames]


def test_moonshine_mask_path_is_captured_with_a_dynamic_audio_length():
    """issue 28: without the patch the program kept 2640 samples (Guard failed: math.trunc(1.0 +
    (-127 + attention_mask.size()[1]) / 64) == 40)."""
    module = MoonshineMaskPath()
    program = capture(
        module, {"attention_mask": torch.ones(2, 2640, dtype=torch.long)}, DynamoConfig(dynamic=True)
    )
    for batch, length in ((3, 4000), (1, 16000)):
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, length // 2 :] = 0
        out = program.module()(attention_mask=mask)
        assert out.shape == (batch, workarounds.moonshine_output_length(length))
        assert torch.equal(out, module(mask))
