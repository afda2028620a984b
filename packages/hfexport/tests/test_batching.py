"""widen_unit_batch: which batch-1 samples are traced as batch 2, and the capture that uses it."""

from __future__ import annotations

import torch
from torch.export import Dim
from transformers import DynamicCache

from hfexport.batching import widen_unit_batch
from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.report import ExportReport

DYNAMIC = DynamoConfig(dynamic=True)


def test_batch_one_inputs_and_cache_tensors_are_repeated_to_two():
    ids = torch.tensor([[4, 5, 6]])
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    traced, reason = widen_unit_batch({"input_ids": ids, "cache": cache, "use_cache": True}, DYNAMIC)
    assert reason.startswith(
        "batch 1 repeated to 2 for tracing (cache.layers.0.keys, cache.layers.0.values, input_ids)"
    )
    assert traced["input_ids"].tolist() == [[4, 5, 6], [4, 5, 6]] and traced["use_cache"] is True
    assert traced["cache"].layers[0].keys.shape == (2, 2, 3, 8)
    assert torch.equal(traced["cache"].layers[0].keys[1], cache.layers[0].keys[0])
    assert cache.layers[0].keys.shape == (1, 2, 3, 8) and ids.shape == (1, 3)  # the caller's inputs are kept


def test_nothing_is_widened_when_the_batch_is_ambiguous_or_the_caller_decides():
    ids = torch.ones(1, 5, dtype=torch.int64)
    cases = [
        ({"input_ids": ids, "image_grid_thw": torch.tensor([[1, 4, 4]])}, DYNAMIC),  # unknown size-1 input
        ({"inputs_embeds": torch.randn(1, 5, 8), "position_ids": torch.zeros(3, 1, 5)}, DYNAMIC),  # M-RoPE
        ({"input_ids": torch.ones(2, 5, dtype=torch.int64)}, DYNAMIC),  # already batch 2
        ({"input_ids": ids}, DynamoConfig()),  # static export
        ({"input_ids": ids}, DynamoConfig(dynamic_shapes={"input_ids": {1: Dim("seq", max=8)}})),  # explicit
    ]
    for inputs, config in cases:
        traced, reason = widen_unit_batch(inputs, config)
        assert reason == "" and all(traced[k] is v for k, v in inputs.items()), inputs


class Pool(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (input_ids.float() * attention_mask).sum(dim=1, keepdim=True) / attention_mask.sum(
            dim=1, keepdim=True
        )


def test_capture_of_a_batch_one_sample_runs_at_other_batches_and_reports_it():
    inputs = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "attention_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
    }
    report = ExportReport(export_format="dynamo", model_class="Pool")
    program = capture(Pool(), inputs, DYNAMIC, report)
    assert report.extra["trace_inputs"].startswith("batch 1 repeated to 2")
    for batch in (1, 3):
        feed = {
            "input_ids": torch.arange(batch * 6).reshape(batch, 6),
            "attention_mask": torch.ones(batch, 6),
        }
        assert torch.allclose(program.module()(**feed), Pool()(**feed))
