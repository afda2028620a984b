"""The default run's slice of the sweep families added for issue 28: object detection, zero-shot
object detection, image segmentation, depth estimation, time-series forecasting and text-to-audio.

One fast tiny type per family (built by the generic shrink, with the data overlays of
:mod:`hfexport.tiny.presets` where a type needs one), exported with ``dynamic=True`` on every
installed backend, must match eager PyTorch at the sample shape and at the exporter's derived
second shape, with the outputs the task promises (names and shapes below). The whole families
run in ``nox -s zoo`` (``benchmarks/zoo_sweep.py --families object-detection,...``).

* detr (object-detection): ``logits`` ``[2, queries, labels + 1]`` and ``pred_boxes``
  ``[2, queries, 4]``; timm-free (a tiny transformers resnet stands in for timm's resnet50);
  the image batch varies (DETR's sine positions and the resnet keep any image size, but the
  second shape changes the batch);
* owlvit (zero-shot-object-detection): one 4-token text query per image (``input_ids`` /
  ``attention_mask`` ``[2, 4]``): ``logits`` ``[2, patches, 1]`` (each patch's box scored against
  the image's query) and ``pred_boxes`` ``[2, patches, 4]``; the image batch and the query batch
  grow together at the second shape;
* segformer (image-segmentation): ``logits`` ``[2, labels, H/4, W/4]``, image sides double;
* glpn (depth-estimation): ``predicted_depth`` ``[2, H, W]``, image sides double;
* patchtst (time-series-forecasting): ``prediction_outputs`` ``[2, prediction_length, channels]``
  with the scaler's ``loc``/``scale``; the batch varies (the context length is the model's);
  OpenVINO through the ``unfold_as_gather`` node fix (the frontend has no rule for aten.unfold);
* speecht5 (text-to-audio): the teacher-forced forward (``input_ids`` + ``decoder_input_values``)
  gives ``spectrogram`` ``[2, frames * reduction_factor, mel bins]``; text and frame lengths vary;
  ExecuTorch and OpenVINO draw the prenet's eval-mode dropout mask (``torch.bernoulli``) from
  ``torch.rand``, and ExecuTorch keeps the postnet's ``BatchNorm1d`` off XNNPACK (two dynamic axes).
"""

from __future__ import annotations

import importlib.util

import pytest

from hfexport.testing import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: family task -> (model type, {output name: expected sample shape as a function of the model})
SLICE = {
    "object-detection": "detr",
    "zero-shot-object-detection": "owlvit",
    "image-segmentation": "segformer",
    "depth-estimation": "glpn",
    "time-series-forecasting": "patchtst",
    "text-to-audio": "speecht5",
}
BACKENDS = ("dynamo", "onnx", "executorch", "openvino")
#: the tolerance each row of the validation table must meet (the backends' fp32 defaults are
#: tighter for dynamo; the compiled runtimes reorder float sums)
ATOL = {"dynamo": 1e-4, "onnx": 1e-3, "executorch": 1e-3, "openvino": 1e-3}


def _expected_outputs(task: str, model, inputs) -> dict[str, tuple[int, ...]]:
    """The outputs the task promises at the sample shape (name -> shape)."""
    config = model.config
    if task == "object-detection":
        queries = int(config.num_queries)
        return {"logits": (2, queries, int(config.num_labels) + 1), "pred_boxes": (2, queries, 4)}
    if task == "zero-shot-object-detection":  # one text query per image, one box per patch
        vision = config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return {"logits": (2, patches, 1), "pred_boxes": (2, patches, 4)}
    if task == "image-segmentation":
        size = inputs["pixel_values"].shape[-1]
        return {"logits": (2, int(config.num_labels), size // 4, size // 4)}
    if task == "depth-estimation":
        size = inputs["pixel_values"].shape[-1]
        return {"predicted_depth": (2, size, size)}
    if task == "time-series-forecasting":
        return {
            "prediction_outputs": (2, int(config.prediction_length), int(config.num_input_channels)),
            "loc": (2, 1, int(config.num_input_channels)),
        }
    frames = inputs["decoder_input_values"].shape[1] * int(config.reduction_factor)
    return {"spectrogram": (2, frames, int(config.num_mel_bins))}


def _installed(backend: str) -> bool:
    return importlib.util.find_spec(f"hfexport_{backend}") is not None


#: (backend, task) -> a known failure of the slice's type there, named with its cause
# (speecht5's eval-mode prenet torch.bernoulli, aten.bernoulli.p, was one on executorch and openvino until
# their uniform-draw translation, hfexport.workarounds.text_to_audio.register_bernoulli_as_uniform)
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _marks(backend: str, task: str) -> list:
    marks = [pytest.mark.skipif(not _installed(backend), reason=f"hfexport-{backend} is not installed")]
    if (backend, task) in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(backend, task)]))
    return marks


CASES = [
    pytest.param(backend, task, id=f"{backend}-{task}", marks=_marks(backend, task))
    for task in SLICE
    for backend in BACKENDS
]


@pytest.mark.parametrize(("backend", "task"), CASES)
def test_family_slice_exports_and_matches_at_two_shapes(backend, task):
    from hfexport.auto import AutoExportConfig, AutoHfExporter

    model, inputs = tiny_model(SLICE[task], task, check_eager=True)
    expected = _expected_outputs(task, model, inputs)
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    exporter.export(model, inputs, config)
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    assert statuses["validate"] == "ok", report.summary_lines()
    assert statuses["validate_second_shape"] == "ok", report.summary_lines()
    sample, second = report.validation["sample"], report.validation["second_shape"]
    shapes = {row["name"]: tuple(row["shape"]) for row in sample}
    for name, shape in expected.items():
        assert shapes.get(name) == shape, (name, shapes)
    second_shapes = {row["name"]: tuple(row["shape"]) for row in second}
    first = next(iter(expected))
    assert second_shapes[first] != shapes[first]  # a genuinely different shape ran
    for row in sample + second:
        assert row["ok"] and float(row["max_abs_diff"]) <= ATOL[backend], row


def test_slice_types_are_offered_for_their_tasks():
    from hfexport.testing import known_model_types, supported_tasks

    for task, model_type in SLICE.items():
        assert model_type in known_model_types(task)
        assert task in supported_tasks(model_type)


# --- the other time-series types, each on the backends it passes (issue 28) ---------------------

#: model type -> (output checked, the backends it passes); each export runs at the sample batch 2
#: and the second shape's batch 3 (the context and horizon lengths are the model's)
TIME_SERIES = {
    # the capture workarounds of hfexport.workarounds.time_series: no tensor mask, no distribution
    # checks; torch.lgamma from elementary operations on onnx / executorch / openvino (the loss);
    # on executorch, circular padding (informer's distilling and autoformer's trend convolutions)
    # as slices + cat, which keeps the batch dynamic through to_edge
    "informer": ("params", ("dynamo", "onnx", "executorch", "openvino")),
    "time_series_transformer": ("params", ("dynamo", "onnx", "executorch", "openvino")),
    # plus, on executorch / openvino, the FFT auto-correlation as real DFT matrix products
    "autoformer": ("params", ("dynamo", "onnx", "executorch", "openvino")),
    # the batch of series as one tensor instead of a Python loop over the batch
    "timesfm": ("mean_predictions", ("dynamo", "onnx", "executorch", "openvino")),
    "timesfm2_5": ("mean_predictions", ("dynamo", "onnx", "executorch", "openvino")),
    # aten.unfold as a gather (OpenVINO); the other backends are the slice's patchtst
    "patchtsmixer": ("prediction_outputs", ("openvino",)),
}
#: the default run keeps two cheap dynamo exports (~10 s each): informer for the mask and
#: distribution-check patches, timesfm for the batch of series (the slice's patchtst covers the
#: OpenVINO unfold rewrite); every other case runs with -m extended (ONNX / ExecuTorch / OpenVINO
#: exports of these take 20-120 s each)
TIME_SERIES_DEFAULT = {("informer", "dynamo"), ("timesfm", "dynamo")}
TIME_SERIES_CASES = [
    pytest.param(
        model_type,
        backend,
        id=f"{backend}-{model_type}",
        marks=[
            pytest.mark.skipif(not _installed(backend), reason=f"hfexport-{backend} is not installed"),
            *(() if (model_type, backend) in TIME_SERIES_DEFAULT else (pytest.mark.extended,)),
        ],
    )
    for model_type, (_, backends) in TIME_SERIES.items()
    for backend in backends
]


@pytest.mark.parametrize(("model_type", "backend"), TIME_SERIES_CASES)
def test_time_series_type_exports_and_matches_at_two_batch_sizes(model_type, backend):
    from hfexport.auto import AutoExportConfig, AutoHfExporter

    task = "time-series-forecasting"
    model, inputs = tiny_model(model_type, task, check_eager=True)
    output = TIME_SERIES[model_type][0]
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    exporter.export(model, inputs, config)
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    assert statuses["validate"] == "ok", report.summary_lines()
    assert statuses["validate_second_shape"] == "ok", report.summary_lines()
    sample, second = report.validation["sample"], report.validation["second_shape"]
    batch = {
        name: {row["name"]: tuple(row["shape"]) for row in rows}
        for name, rows in (("s", sample), ("t", second))
    }
    first = next(name for name in batch["s"] if name == output or name.startswith(f"{output}."))
    assert batch["s"][first][0] == 2 and batch["t"][first][0] == 3, batch
    horizon = int(getattr(model.config, "prediction_length", None) or model.config.horizon_length)
    assert horizon in batch["s"][first][1:], (first, batch["s"][first])
    for row in sample + second:
        assert row["ok"] and float(row["max_abs_diff"]) <= ATOL[backend], row
