"""The torch.export capture stages: signature flattening, cache pytrees, stale state, staged report."""

from __future__ import annotations

import json

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export import Dim
from transformers import AutoConfig
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache, StaticCache, StaticLayer

from hfexport.capture import (
    STALE_ATTRIBUTES,
    KwargsModule,
    capture,
    register_stale_attribute,
    reset_stale_state,
    signature_module,
)
from hfexport.config import DynamoConfig
from hfexport.pytree import register_cache_pytrees
from hfexport.report import ExportReport

# --------------------------------------------------------------------------------------------
# signature flattening
# --------------------------------------------------------------------------------------------


class KwargsOnly(torch.nn.Module):
    """A forward that only takes ``**kwargs``, like many remote-code and wrapper models."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]))

    def forward(self, **kwargs):
        return {"out": kwargs["x"] * self.scale + kwargs["y"].sum(dim=-1, keepdim=True)}


class Named(torch.nn.Module):
    def forward(self, x, y=None):
        return x + 1


def test_signature_module_wraps_only_forwards_that_do_not_name_the_inputs():
    named = Named()
    assert signature_module(named, {"x": torch.ones(1)}) is named
    wrapped = signature_module(KwargsOnly(), {"x": torch.ones(3, 2), "y": torch.ones(3, 4)})
    assert isinstance(wrapped, KwargsModule)
    import inspect

    params = inspect.signature(wrapped.forward).parameters
    assert list(params) == ["x", "y"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())


def test_kwargs_forward_exports_with_dynamic_shapes_keyed_by_kwarg_name():
    model = KwargsOnly().eval()
    sample = {"x": torch.randn(3, 2), "y": torch.randn(3, 4)}
    rows = Dim("rows", min=2, max=64)
    program = capture(model, sample, DynamoConfig(dynamic_shapes={"x": {0: rows}, "y": {0: rows}}))
    # the program takes the inputs by name and follows the declared dimension
    other = {"x": torch.randn(9, 2), "y": torch.randn(9, 4)}
    got = program.module()(**other)["out"]
    assert got.shape == (9, 2)
    assert torch.allclose(got, model(**other)["out"], atol=1e-6, rtol=0)
    bounds = {(int(r.lower), int(r.upper)) for r in program.range_constraints.values()}
    assert (2, 64) in bounds


def test_dynamic_shapes_naming_an_unknown_input_is_refused():
    with pytest.raises(ValueError, match=r"dynamic_shapes names \['z'\]"):
        capture(
            KwargsOnly(),
            {"x": torch.randn(3, 2), "y": torch.randn(3, 4)},
            DynamoConfig(dynamic_shapes={"z": {}}),
        )


# --------------------------------------------------------------------------------------------
# cache pytrees
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_config():
    return AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip


def _filled_dynamic_cache(layers: int = 2, seq: int = 3) -> DynamicCache:
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(0)
    for i in range(layers):
        cache.update(torch.randn(1, 2, seq, 8, generator=gen), torch.randn(1, 2, seq, 8, generator=gen), i)
    return cache


def _round_trip(cache):
    register_cache_pytrees()
    leaves, spec = pytree.tree_flatten(cache)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    return leaves, spec, rebuilt


def test_dynamic_cache_round_trip_keeps_class_tensors_and_names():
    cache = _filled_dynamic_cache()
    leaves, spec, rebuilt = _round_trip(cache)
    assert type(rebuilt) is DynamicCache
    assert [type(layer) for layer in rebuilt.layers] == [DynamicLayer, DynamicLayer]
    expected = [cache.layers[0].keys, cache.layers[0].values, cache.layers[1].keys, cache.layers[1].values]
    assert len(leaves) == 4 and all(a is b for a, b in zip(leaves, expected))
    assert rebuilt.layers[1].values is cache.layers[1].values
    assert rebuilt.get_seq_length() == 3
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(cache)[0]]
    assert paths == ["['layers.0.keys']", "['layers.0.values']", "['layers.1.keys']", "['layers.1.values']"]
    # the context is JSON: a program holding the cache can be saved
    assert json.loads(spec.context)["__class__"] == "transformers.cache_utils:DynamicCache"


def test_static_cache_round_trip_keeps_layer_settings(llama_config):
    cache = StaticCache(config=llama_config, max_cache_len=16)
    key = torch.randn(1, 2, 3, 8)
    cache.update(key, torch.randn(1, 2, 3, 8), 0, {"cache_position": torch.arange(3)})
    leaves, _, rebuilt = _round_trip(cache)
    assert type(rebuilt) is StaticCache and all(type(layer) is StaticLayer for layer in rebuilt.layers)
    assert rebuilt.layers[0].max_cache_len == 16
    assert rebuilt.layers[0].keys is cache.layers[0].keys
    assert rebuilt.layers[0].keys.shape == (1, 2, 16, 8)
    assert torch.equal(rebuilt.layers[0].keys[:, :, :3], key)
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def test_encoder_decoder_cache_round_trip_nests_both_caches():
    cache = EncoderDecoderCache(_filled_dynamic_cache(seq=2), _filled_dynamic_cache(seq=5))
    leaves, _, rebuilt = _round_trip(cache)
    assert type(rebuilt) is EncoderDecoderCache
    assert type(rebuilt.self_attention_cache) is DynamicCache
    assert rebuilt.self_attention_cache.get_seq_length() == 2
    assert rebuilt.cross_attention_cache.layers[1].keys is cache.cross_attention_cache.layers[1].keys
    assert len(leaves) == 8


def test_model_defined_cache_class_is_registered_and_keeps_its_extra_state():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    register_cache_pytrees()
    assert MiniMaxCache in pytree.SUPPORTED_NODES
    cache = MiniMaxCache()
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    linear = torch.randn(1, 2, 8, 8)
    cache.set_linear_cache(1, linear)
    leaves, _, rebuilt = _round_trip(cache)
    assert type(rebuilt) is MiniMaxCache
    assert rebuilt.linear_cache[0] == [] and rebuilt.linear_cache[1] is linear
    assert any(leaf is linear for leaf in leaves)
    assert rebuilt.layers[0].keys is cache.layers[0].keys


def test_cache_context_from_a_file_cannot_name_arbitrary_classes():
    register_cache_pytrees()
    _, spec = pytree.tree_flatten(_filled_dynamic_cache(layers=1))
    for forged in ("os:system", "builtins:object", "subprocess:Popen"):
        context = json.loads(spec.context)
        context["__class__"] = forged
        with pytest.raises(ValueError, match="cache context names"):
            pytree.tree_unflatten([torch.ones(1), torch.ones(1)], pytree.TreeSpec(DynamicCache, json.dumps(context),
                                                                                  spec.children()))  # fmt: skip


# --------------------------------------------------------------------------------------------
# stale state
# --------------------------------------------------------------------------------------------


class CachedRotary(torch.nn.Module):
    """Caches its cos table in ``_cos_cached`` on first use (the pattern of older rotary code)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.25]), persistent=False)
        self._cos_cached = None

    def forward(self, x):
        length = x.shape[1]
        if self._cos_cached is None or self._cos_cached.shape[0] < length:
            steps = torch.arange(length, dtype=torch.float32)
            self._cos_cached = torch.cos(steps[:, None] * self.inv_freq)
        return x * self._cos_cached[:length]


def test_stale_table_from_eager_forward_is_not_baked_into_the_trace_and_is_restored():
    model = CachedRotary().eval()
    model(torch.ones(1, 16, 2))  # eager forward leaves a 16-row table behind
    stale = model._cos_cached
    program = capture(model, {"x": torch.randn(2, 8, 2)}, DynamoConfig(dynamic=True))
    assert model._cos_cached is stale  # restored object, not a traced value
    # the trace recomputed the table: a sequence longer than the stale table runs and is right
    x = torch.randn(3, 40, 2)
    expected = x * torch.cos(torch.arange(40, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.25]))
    assert torch.allclose(program.module()(x=x), expected, atol=1e-6, rtol=0)
    assert not any(t.shape == (16, 2) for t in program.constants.values())


def test_without_the_reset_the_stale_table_limits_the_program(monkeypatch):
    # proves the test above can fail: with nothing to reset, the 16-row table bounds the sequence
    monkeypatch.setattr("hfexport.capture.STALE_ATTRIBUTES", {})
    model = CachedRotary().eval()
    model(torch.ones(1, 16, 2))
    program = capture(model, {"x": torch.randn(2, 8, 2)}, DynamoConfig(dynamic=True))
    with pytest.raises(AssertionError, match=r"Guard failed: x\.size\(\)\[1\] <= 16"):
        program.module()(x=torch.randn(3, 40, 2))


def test_trace_does_not_leave_a_traced_value_on_a_module_that_had_none():
    model = CachedRotary().eval()
    capture(model, {"x": torch.randn(2, 8, 2)}, DynamoConfig(dynamic=True))
    assert model._cos_cached is None
    assert torch.equal(model(torch.ones(1, 4, 2))[0], torch.cos(torch.arange(4.0)[:, None] * model.inv_freq))


def test_reset_restores_after_an_error_and_takes_registered_names(monkeypatch):
    monkeypatch.setattr("hfexport.capture.STALE_ATTRIBUTES", dict(STALE_ATTRIBUTES))
    register_stale_attribute("_rope_table", empty=0)
    with pytest.raises(ValueError, match="identifier"):
        register_stale_attribute("not a name")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0]._rope_table = 7
    with pytest.raises(RuntimeError, match="boom"), reset_stale_state(model) as cleared:
        assert cleared == ["0._rope_table"] and model[0]._rope_table == 0
        raise RuntimeError("boom")
    assert model[0]._rope_table == 7


# --------------------------------------------------------------------------------------------
# staged report
# --------------------------------------------------------------------------------------------


def test_record_stages_names_every_capture_step():
    report = ExportReport(export_format="test")
    capture(Named(), {"x": torch.randn(2, 3)}, DynamoConfig(dynamic=True), report, record_stages=True)
    assert [s.name for s in report.stages] == [
        "capture.cache_pytrees",
        "capture.signature",
        "capture.dynamic_shapes",
        "capture.reset_stale_state",
        "capture.patches",
        "capture.torch_export",
    ]
    assert all(s.status == "ok" for s in report.stages)
    quiet = ExportReport(export_format="test")
    capture(Named(), {"x": torch.randn(2, 3)}, DynamoConfig(), quiet)
    assert quiet.stages == [] and "dynamic_shapes" in quiet.extra
