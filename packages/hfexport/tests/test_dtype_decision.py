"""The export dtype is a decision: auto keeps what the runtime computes well, casts what it does
not; the reference follows the export dtype; checkpoints are read for their dtype and their
integrity before loading; an export that would not fit refuses before loading."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hfexport.capture import capture
from hfexport.checkpoints import check_safetensors, checkpoint_dtype
from hfexport.config import DynamoConfig
from hfexport.errors import CheckpointError, ExportValidationError, InsufficientMemoryError
from hfexport.exporter import HfExporter
from hfexport.generation import exported_program_caller
from hfexport.precision import decide_dtype, model_dtype
from hfexport.testing import tiny_model


class _Exporter(HfExporter):
    """A core-only exporter: ``torch.export`` capture, runs the program, saves with torch.export."""

    export_format = "dynamo"
    config_class = DynamoConfig
    supported_dtypes = ("float32", "float16", "bfloat16")
    native_dtypes = ("float32",)
    runtime_name = "the test runtime"

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def save(self, artifact, path):
        torch.export.save(artifact, str(path))

    def load(self, path, *, trust_remote_code=False):
        return torch.export.load(str(path))


class _KeepsHalf(_Exporter):
    native_dtypes = ("float32", "bfloat16")


@pytest.fixture
def qwen3():
    return tiny_model("qwen3")  # a fresh model per test: some cast it to bfloat16


def test_auto_keeps_a_native_dtype_and_casts_any_other_to_the_first():
    kept = decide_dtype(torch.bfloat16, None, ("float32", "bfloat16"), "PyTorch")
    assert (kept.export, kept.reference, kept.upcasts, kept.gated) == ("bfloat16", "bfloat16", False, False)
    assert kept.summary() == "bfloat16 (the checkpoint's; PyTorch computes bfloat16)"
    cast = decide_dtype("bfloat16", None, ("float32",), "ONNX Runtime's CPU provider")
    assert (cast.export, cast.model, cast.reference, cast.upcasts, cast.gated) == (
        "float32",
        "bfloat16",
        "float32",
        True,
        False,
    )
    assert cast.summary() == (
        "float32 (checkpoint bfloat16; ONNX Runtime's CPU provider computes float32 well here, not bfloat16)"
    )
    # an explicit dtype is used as given; a lower precision than the model's is gated against it
    half = decide_dtype(torch.float32, "float16", ("float32",), "x")
    assert (half.export, half.reference, half.gated, half.reason) == ("float16", "float32", True, "requested")
    assert half.to_dict()["gated"] is True


def test_model_dtype_counts_elements_not_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.LayerNorm(64))
    assert model_dtype(model) == torch.bfloat16  # 4160 bf16 elements beat 128 fp32 ones
    assert model_dtype(torch.nn.ReLU()) == torch.float32


def test_bf16_model_exports_in_float32_against_the_float32_reference_and_comes_back_bf16(qwen3):
    model, inputs = qwen3
    model = model.to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exporter = _Exporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    report = exporter.last_report
    assert report.dtype["export"] == "float32" and report.dtype["upcasts"] and not report.dtype["gated"]
    assert report.dtype["reason"] == "the test runtime computes float32 well here, not bfloat16"
    # the program computes in float32 and matches the float32 eager model at float32 tolerances
    assert {v.dtype for v in program.state_dict.values() if v.is_floating_point()} == {torch.float32}
    rows = {r["name"]: r for r in report.validation["sample"]}
    assert rows["logits"]["atol"] == pytest.approx(1e-4) and rows["logits"]["max_abs_diff"] < 1e-4
    assert "second_shape" in report.validation
    # the user's model is back in bfloat16 with the very same values
    after = model.state_dict()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)


def test_bf16_program_of_a_bf16_model_is_compared_with_the_bf16_model_by_tolerance(qwen3):
    model, inputs = qwen3
    model = model.to(torch.bfloat16)
    exporter = _KeepsHalf()
    exporter.export(model, inputs, DynamoConfig(dynamic=True))
    report = exporter.last_report
    assert report.dtype == {
        "export": "bfloat16",
        "model": "bfloat16",
        "reference": "bfloat16",
        "requested": None,
        "reason": "the test runtime computes bfloat16",
        "upcasts": False,
        "gated": False,
    }
    logits = next(r for r in report.validation["sample"] if r["name"] == "logits")
    assert logits["dtype"] == "torch.bfloat16" and logits["atol"] == pytest.approx(1e-2)  # not fp32's 1e-4
    # quality gates do not apply to an export compared by tolerance: refused before capture
    with pytest.raises(ValueError, match=r"cannot apply: this export computes in bfloat16 like its eager"):
        exporter.export(model, inputs, DynamoConfig(quality_gates={"cosine": 0.9}))


def test_requested_dtype_really_casts_and_is_gated_against_the_float32_model(qwen3):
    model, inputs = qwen3
    exporter = _Exporter()
    # (random weights: top-1 agreement is noise, the gate is lowered; cosine keeps the default)
    program = exporter.export(
        model, inputs, DynamoConfig(dtype="bfloat16", quality_gates={"top1_agreement": 0.5})
    )
    report = exporter.last_report
    assert report.dtype["export"] == "bfloat16" and report.dtype["reference"] == "float32"
    assert {v.dtype for v in program.state_dict.values() if v.is_floating_point()} == {torch.bfloat16}
    assert report.validation["sample"][0]["kind"] == "quality"
    assert next(p for p in model.parameters()).dtype == torch.float32


def test_export_to_path_validates_the_saved_file_and_a_failure_leaves_nothing(qwen3, tmp_path, monkeypatch):
    model, inputs = qwen3
    exporter = _Exporter()
    target = tmp_path / "model.pt2"
    loaded = []
    real_load = _Exporter.load
    monkeypatch.setattr(
        _Exporter, "load", lambda self, path, **kw: loaded.append(path) or real_load(self, path)
    )
    report = exporter.export_to_path(model, inputs, target, DynamoConfig(dynamic=True))
    names = [s.name for s in report.stages]
    assert names[-5:] == ["reference", "save", "load_artifact", "validate", "validate_second_shape"]
    assert target.is_file() and len(loaded) == 1 and loaded[0].name == "model.pt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]  # no staging folder left

    # an artifact that misses its reference: nothing is written, the earlier file stays as it was
    before = target.read_bytes()
    monkeypatch.setattr(
        _Exporter,
        "runner",
        lambda self, artifact: lambda kw: {"logits": torch.zeros(1), "past_key_values": None},
    )
    monkeypatch.setattr(_Exporter, "load_component", lambda self, path, metadata: self.runner(None))
    with pytest.raises(ExportValidationError):
        exporter.export_to_path(model, inputs, target, DynamoConfig(dynamic=True))
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]


def test_release_model_frees_the_weights_once_the_references_exist(qwen3, tmp_path):
    model, inputs = qwen3
    exporter = _Exporter()
    report = exporter.export_to_path(
        model, inputs, tmp_path / "model.pt2", DynamoConfig(), release_model=True
    )
    assert report.validation["sample"][0]["ok"]
    assert all(p.numel() == 0 for p in model.parameters())  # released: the caller loaded it for this export


def _safetensors(path, tensors: dict[str, tuple[str, list[int]]], *, cut: int = 0):
    header, offset = {}, 0
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * (offset - cut))


def test_checkpoint_dtype_and_integrity_are_read_without_loading(tmp_path):
    _safetensors(tmp_path / "model.safetensors", {"a": ("BF16", [64, 64]), "norm": ("F32", [64])})
    assert checkpoint_dtype(tmp_path) == "bfloat16"  # from the header: most elements are bf16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"  # config.json wins (transformers 4 wrote torch_dtype)
    assert check_safetensors(tmp_path) == 64 * 64 + 64
    _safetensors(tmp_path / "model.safetensors", {"a": ("BF16", [64, 64])}, cut=100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: its tensors need \d+ bytes"):
        check_safetensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10")
    with pytest.raises(CheckpointError, match=r"is truncated .* download the checkpoint again"):
        check_safetensors(tmp_path)


def test_an_export_that_would_not_fit_is_refused_with_the_estimate_and_the_options():
    exporter = _Exporter()
    decision = exporter.decide_dtype("bfloat16", DynamoConfig())
    exporter.check_memory(1_000_000, decision, available=10**10)  # fits
    exporter.check_memory(10**12, decision, available=None)  # unknown: passes
    with pytest.raises(InsufficientMemoryError) as info:
        exporter.check_memory(1_500_000_000, decision, available=4 * 10**9)
    message = str(info.value)
    estimate = exporter.estimate_peak_bytes(1_500_000_000, "float32")
    assert estimate == exporter.memory_base_bytes + int(exporter.memory_factor * 6 * 10**9)
    assert "export of 1.50B parameters in float32 (6.00 GB of weights) needs about" in message
    assert "the machine has 4.00 GB available" in message
    assert "--dtype float16 (half the weight bytes)" in message and "--no-validate" in message
    assert "--ignore-memory-estimate" in message


@pytest.mark.parametrize(
    "limit, kept", [(None, True), (0, False)], ids=["small-model-kept", "above-limit-released"]
)
def test_release_model_keeps_a_small_model_until_validation_for_the_float64_reference(
    qwen3, tmp_path, monkeypatch, limit, kept
):
    # a model at most FLOAT64_REFERENCE_MAX_PARAMETERS large keeps its weights while the loaded artifact
    # is validated, so judge_by_float64_reference can run it (the CLI's Grounding DINO export could not);
    # a larger one is released before the artifact is loaded, as before (peak memory near the weights)
    import hfexport.exporter as exporter_module

    if limit is not None:
        monkeypatch.setattr(exporter_module, "FLOAT64_REFERENCE_MAX_PARAMETERS", limit)
    model, inputs = qwen3
    seen: list[int] = []

    class _Records(_Exporter):
        def check_outputs(self, *args, **kwargs):
            seen.append(sum(p.numel() for p in model.parameters()))
            return super().check_outputs(*args, **kwargs)

    report = _Records().export_to_path(
        model, inputs, tmp_path / "model.pt2", DynamoConfig(), release_model=True
    )
    assert report.validation["sample"][0]["ok"]
    assert seen and all((n > 0) is kept for n in seen)
    assert all(p.numel() == 0 for p in model.parameters())  # released once the export is done either way
