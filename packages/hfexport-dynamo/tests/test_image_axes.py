"""Image axes of a dynamic export: what the program keeps dynamic, what the model fixes (issue 15)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from hfexport.config import DynamoConfig
from hfexport.testing import tiny_model
from hfexport.validation import derive_second_inputs
from hfexport_dynamo import DynamoExporter


def _export(model_type, task="image-classification"):
    model, inputs = tiny_model(model_type, task)
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    return model, inputs, program, exporter.last_report


def test_vit_image_size_is_reported_static_and_kept_by_the_second_shape():
    # ViT without interpolate_pos_encoding adds a 4x4 position grid: the capture fixes 32x32
    model, inputs, _program, report = _export("vit")
    summary = report.dynamic_axes_summary
    assert "pixel_values image height/width: static 32 (model-fixed)" in summary, summary
    sides = [a for a in report.dynamic_axes if a["meaning"] in ("image height", "image width")]
    assert [(a["axis"], a["status"], a["max"]) for a in sides] == [(2, "static", 32), (3, "static", 32)]
    assert {s.name: s.status for s in report.stages}["validate_second_shape"] == "ok"
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert reason == "" and tuple(second["pixel_values"].shape) == (3, 3, 32, 32)
    assert all(row["ok"] and tuple(row["shape"]) == (3, 3) for row in report.validation["second_shape"])


def test_convnext_sides_stay_dynamic_and_the_second_shape_grows_them():
    # ConvNeXt's last stage is 1x1 on 32x32 images: without the size-oblivious capture the sides
    # came out as [32, 63] and a 64x64 image was refused
    model, inputs, program, report = _export("convnext")
    summary = report.dynamic_axes_summary
    assert "pixel_values image height/width: dynamic [32, inf]" in summary, summary
    second, reason = derive_second_inputs(model, inputs, program_axes=report.dynamic_axes)
    assert reason == "" and tuple(second["pixel_values"].shape) == (3, 3, 64, 64)
    assert {s.name: s.status for s in report.stages}["validate_second_shape"] == "ok"
    image = torch.randn(3, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = program.module()(pixel_values=image).logits
        expected = model(pixel_values=image).logits
    assert (got - expected).abs().max().item() < 1e-4


def test_llava_second_shape_keeps_the_image_tokens():
    # issue 15: the derived prompt dropped its 16 <image> tokens per row ("Image features and image
    # tokens do not match, tokens: 0"); a dynamic prompt length now validates at 65 tokens
    model, inputs = tiny_model("llava")
    token = model.config.image_token_id
    assert (inputs["input_ids"] == token).sum(-1).tolist() == [16, 16]
    sequence = Dim("sequence", min=2, max=128)
    config = DynamoConfig(dynamic_shapes={"input_ids": {1: sequence}, "attention_mask": {1: sequence}})
    exporter = DynamoExporter()
    exporter.export(model, inputs, config)
    report = exporter.last_report
    assert {s.name: s.status for s in report.stages}["validate_second_shape"] == "ok"
    rows = {row["name"]: row for row in report.validation["second_shape"]}
    assert tuple(rows["logits"]["shape"]) == (2, 65, model.config.text_config.vocab_size)
    assert all(row["ok"] for row in rows.values())
    assert report.dynamic_axes_summary == [
        "input_ids sequence: dynamic [2, 128]",
        "attention_mask sequence: dynamic [2, 128]",
    ]


def test_a_shape_guard_failure_is_a_value_error_saying_what_to_do():
    # fresh-user trial: an image of another size than the export's fixed side raised torch's bare
    # "AssertionError: Guard failed: pixel_values.size()[2] == 32" from the program's module

    from hfexport_dynamo.runtime import ProgramRunner

    class FixedSide(torch.nn.Module):
        def forward(self, pixel_values):
            return pixel_values.reshape(pixel_values.shape[0], -1) @ torch.ones(3 * 32 * 32, 2)

    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(
        FixedSide(),
        (),
        {"pixel_values": torch.randn(2, 3, 32, 32)},
        dynamic_shapes={"pixel_values": {0: batch}},
    )
    runner = ProgramRunner(program)
    assert runner({"pixel_values": torch.ones(3, 3, 32, 32)})[""].shape == (3, 2)
    with pytest.raises(ValueError, match=r"\[1, 3, 48, 48\].*Guard failed.*resize images"):
        runner({"pixel_values": torch.ones(1, 3, 48, 48)})
