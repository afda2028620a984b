"""The second shape of generation components, whose inputs hold a KV cache.

Derivation (no export): a decode step gets another past length (and batch), with the cache
tensors, the mask and the positions to match, a static cache keeps its shape and moves its write
position, a prefill keeps its empty cache, the program's ranges are respected, unsupported caches
say why. Export (the core-only ``ProgramExporter``: ``hfexport.capture`` + ``ExportedProgram``): the
decode component is validated at the second shape and the report records it; a decode graph that is
wrong only at other past lengths fails the export, so the check cannot silently stop running.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.errors import ExportValidationError
from hfexport.exporter import HfExporter
from hfexport.generation import ComponentExportError, decompose_prefill_decode, exported_program_caller
from hfexport.generation.second_shape import derive_cache_second_inputs
from hfexport.inputs import apply_output_flags, prepare_for_export
from hfexport.testing import tiny_model
from hfexport.validation import derive_second_inputs, describe_second_shape

STATIC = GenerationConfig(cache_implementation="static", max_cache_len=32)


class ProgramExporter(HfExporter):
    """Core-only exporter: the artifact is the ``ExportedProgram`` from ``hfexport.capture``."""

    export_format = "dynamo"
    config_class = DynamoConfig
    artifact_filename = "model.pt2"

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def save(self, artifact, path):  # pragma: no cover - not saved here
        raise NotImplementedError


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _component(model, inputs, name, *, static=False, multi_token_decode=True):
    parts = decompose_prefill_decode(
        model, inputs, generation_config=STATIC if static else None, multi_token_decode=multi_token_decode
    )
    module, kwargs = parts[name]
    _, prepared, flags = prepare_for_export(module, kwargs)
    return module, prepared, flags


def _eager_logits(model, inputs, flags):
    from hfexport.tensors import duplicate_leaf_tensors

    with apply_output_flags(model, flags), torch.no_grad():
        return model(**duplicate_leaf_tensors(dict(inputs))).logits


def test_decode_gets_another_past_length_and_batch_with_a_growing_cache(llama) -> None:
    model, inputs = llama
    module, sample, flags = _component(model, inputs, "decode")
    keys_before = sample["cache"].layers[0].keys.clone()
    second, reason = derive_second_inputs(module, sample, config=DynamoConfig(dynamic=True))
    assert reason == "" and second is not None
    cache = second["cache"]
    heads, dim = keys_before.shape[1], keys_before.shape[3]
    assert int(cache.get_seq_length()) == 17  # 2 * 8 + 1
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(3, heads, 17, dim)] * 2
    assert second["input_ids"].shape == (3, 2)  # the query length stays
    assert torch.equal(second["attention_mask"], torch.ones(3, 19, dtype=torch.int64))
    assert second["position_ids"].tolist() == [[17, 18]] * 3
    assert torch.equal(sample["cache"].layers[0].keys, keys_before), "the sample's cache is left alone"
    # the cache holds the sample's states repeated (plus noise of 0.1): close to them, not equal
    assert 0 < float((cache.layers[0].keys[:2, :, :8] - keys_before).abs().max()) < 1.0
    # the eager reference on the derived cache object is the eager model on a cache built from the
    # same tensors by transformers' own update path
    rebuilt = DynamicCache(config=module.config)
    for i, layer in enumerate(cache.layers):
        rebuilt.update(layer.keys.clone(), layer.values.clone(), i)
    torch.testing.assert_close(
        _eager_logits(module, second, flags),
        _eager_logits(module, {**second, "cache": rebuilt}, flags),
        atol=0,
        rtol=0,
    )


def test_a_static_cache_keeps_its_shape_and_moves_its_write_position(llama) -> None:
    model, inputs = llama
    module, sample, flags = _component(model, inputs, "decode", static=True)
    second, reason = derive_cache_second_inputs(module, sample, reuse=True)
    assert reason == "" and second is not None
    layer, before = second["cache"].layers[0], sample["cache"].layers[0]
    assert layer.keys.shape == (3, before.keys.shape[1], 32, before.keys.shape[3])
    assert int(layer.cumulative_length) == 17 and int(before.cumulative_length) == 8
    # positions 0-16 hold the sample's 8 states repeated (no noise when the sample's tokens are
    # reused), row 2 repeats row 0; the positions from the write position on are zeros
    assert torch.equal(layer.keys[:2, :, :8], before.keys[:, :, :8])
    assert torch.equal(layer.keys[:2, :, 8:16], before.keys[:, :, :8])
    assert torch.equal(layer.keys[2], layer.keys[0])
    assert not layer.keys[:, :, 17:].any()
    assert torch.equal(second["input_ids"][:2], sample["input_ids"])  # the sample's tokens
    assert second["attention_mask"].shape == (3, 19) and second["position_ids"].tolist() == [[17, 18]] * 3
    assert torch.isfinite(_eager_logits(module, second, flags)).all()

    described = describe_second_shape(sample, second)
    assert described["past_length"] == [8, 17] and described["cache_kind"] == "static"
    assert described["cache_positions"] == 32
    assert described["values"] == [
        {
            "input": "cache.layers.*.cumulative_length",
            "meaning": "cache write position",
            "sample": 8,
            "second": 17,
        }
    ]
    changed = {(c["input"], c["axis"]): (c["sample"], c["second"]) for c in described["changed"]}
    assert changed[("cache.layers.*.keys", 0)] == (2, 3)
    assert ("cache.layers.*.keys", 2) not in changed, "a static cache's positions axis does not change"
    assert changed[("attention_mask", 1)] == (10, 19)
    assert described["inputs"]["cache.layers.0.keys"] == [3, before.keys.shape[1], 32, before.keys.shape[3]]
    assert described["summary"].startswith(
        "past length 8 -> 17 (static cache: its tensors keep 32 positions)"
    )
    assert "cache write position 8 -> 17" in described["summary"]


def test_the_program_ranges_bound_the_second_shape(llama) -> None:
    model, inputs = llama
    module, sample, _ = _component(model, inputs, "decode")
    axes = [
        {"input": "input_ids", "axis": 0, "status": "static", "min": 2, "max": 2},
        {"input": "attention_mask", "axis": 1, "status": "dynamic", "min": 4, "max": 12},
    ]
    second, reason = derive_second_inputs(module, sample, program_axes=axes)
    assert reason == "" and second is not None
    assert int(second["cache"].get_seq_length()) == 10  # past + 2 new tokens <= 12
    assert second["input_ids"].shape[0] == 2 and second["attention_mask"].shape == (2, 12)
    # a planned bound on the cache's own position axis (ExecuTorch names cache leaves) counts too
    second, _ = derive_second_inputs(
        module, sample, program_axes=[{"input": "cache.layers.0.keys", "axis": 2, "min": 1, "max": 9}]
    )
    assert int(second["cache"].get_seq_length()) == 9
    # nothing can change: no second shape, and the reason names both
    frozen = [axes[0], {"input": "attention_mask", "axis": 1, "status": "static", "min": 10, "max": 10}]
    second, reason = derive_second_inputs(module, sample, program_axes=frozen)
    assert second is None
    assert "neither the batch" in reason and "holds attention_mask axis 1 static" in reason


def test_a_static_cache_bounds_the_past_below_its_length() -> None:
    # a fresh model: generate() reuses a model's earlier static cache when it is long enough
    model, inputs = tiny_model("llama")
    parts = decompose_prefill_decode(
        model,
        inputs,
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=14),
        multi_token_decode=True,
    )
    module, kwargs = parts["decode"]
    _, sample, _ = prepare_for_export(module, kwargs)
    second, _ = derive_second_inputs(module, sample)
    assert int(second["cache"].get_seq_length()) == 11  # past + 2 new tokens <= max_cache_len - 1


def test_a_prefill_keeps_its_empty_cache(llama) -> None:
    model, inputs = llama
    for static, length in ((False, 65), (True, 31)):
        module, sample, flags = _component(model, inputs, "prefill", static=static)
        second, reason = derive_second_inputs(module, sample)
        assert reason == "" and second is not None
        assert second["cache"] is not sample["cache"] and int(second["cache"].get_seq_length()) == 0
        assert second["input_ids"].shape == (3, length)  # a static cache takes max_cache_len - 1 = 31
        assert second["position_ids"][0].tolist() == list(range(length))
        assert _eager_logits(module, second, flags).shape[:2] == (3, length)
        described = describe_second_shape(sample, second)
        assert described["past_length"] == [0, 0]
        assert described["summary"] == (
            f"batch 2 -> 3 (input_ids, position_ids, attention_mask); "
            f"sequence 8 -> {length} (input_ids, position_ids, attention_mask)"
        )


def test_caches_without_a_rule_say_why(llama) -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model, inputs = llama
    module, sample, _ = _component(model, inputs, "decode")
    sliding = sample["cache"]
    sliding.layers[0].__class__ = DynamicSlidingWindowLayer
    try:
        second, reason = derive_second_inputs(module, sample)
    finally:
        sliding.layers[0].__class__ = type(sliding.layers[1])
    assert second is None and "DynamicSlidingWindowLayer" in reason
    mask_4d = {**sample, "attention_mask": torch.ones(2, 1, 2, 10)}
    second, reason = derive_second_inputs(module, mask_4d)
    assert second is None and "not a 2-D mask over past + new positions" in reason


@pytest.mark.slow
def test_the_decode_component_is_validated_at_a_second_past_length(llama, monkeypatch) -> None:
    import hfexport.verify.compare as validation

    model, inputs = llama
    eager_pasts: list[int] = []
    eager = validation.eager_outputs

    def counting(module, these):
        eager_pasts.append(int(these["cache"].get_seq_length()))
        return eager(module, these)

    monkeypatch.setattr(validation, "eager_outputs", counting)
    parts = ProgramExporter().export_for_generation(
        model, inputs, DynamoConfig(dynamic=True), components=["decode"]
    )
    assert eager_pasts == [8, 17], "eager PyTorch ran at the sample and at the second past length"
    report = parts.reports["decode"]
    record = report.second_shape
    assert record["past_length"] == [8, 17] and record["cache_kind"] == "dynamic"
    assert report.input_names["cache.layers.0.keys"]["shape"][2] == 8
    assert record["inputs"]["cache.layers.0.keys"][2] == 17
    stage = next(s for s in report.stages if s.name == "validate_second_shape")
    assert stage.status == "ok" and stage.detail.startswith("past length 8 -> 17; batch 2 -> 3")
    rows = report.validation["second_shape"]
    logits = next(r for r in rows if r["name"] == "logits")
    assert logits["shape"][0] == 3, "the rows come from the run at the second shape"
    assert all(r["ok"] and float(r["max_abs_diff"]) <= r["atol"] for r in rows)


@pytest.mark.slow
def test_a_decode_graph_wrong_only_at_other_past_lengths_fails_the_export(llama) -> None:
    model, inputs = llama

    class WrongElsewhere(ProgramExporter):
        def runner(self, artifact):
            run = super().runner(artifact)

            def call(kwargs):
                out = dict(run(kwargs))
                if int(kwargs["cache"].get_seq_length()) != 8:  # right at the sample's past length only
                    out["logits"] = out["logits"] + 1e-2
                return out

            return call

    with pytest.raises(ComponentExportError) as info:
        WrongElsewhere().export_for_generation(
            model, inputs, DynamoConfig(dynamic=True), components=["decode"]
        )
    cause = info.value.__cause__
    assert isinstance(cause, ExportValidationError)
    assert "second shape" in str(cause) and "logits" in str(cause)
