"""``hfexport.load(OUTPUT_DIR)`` runs a folder of any backend: plain exports of a tiny BERT written by
``hfexport export {dynamo,onnx,executorch}`` and a dynamo generation folder of a tiny llama."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

import hfexport
from hfexport.checkpoints import load_model
from hfexport.cli import app
from hfexport.errors import IntegrityError, MissingBackendError
from hfexport.loader import ExportFolderError
from hfexport.testing.folders import tiny_model_folder

_TOLERANCE = {"dynamo": 1e-5, "onnx": 1e-4, "executorch": 1e-4}


def _export(fmt: str, out, *extra: str) -> None:
    result = CliRunner().invoke(app, ["export", fmt, str(out), *extra], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output[-3000:]


@pytest.fixture(scope="module")
def bert():
    loaded = load_model("tiny:bert", "auto")
    with torch.no_grad():
        expected = loaded.model(**loaded.inputs)
    return loaded.inputs, expected


@pytest.mark.parametrize(
    "fmt",
    [
        "dynamo",
        pytest.param("onnx", marks=pytest.mark.extended),
        pytest.param("executorch", marks=pytest.mark.extended),
    ],
)
def test_load_plain_folder_returns_the_eager_output_class(fmt, bert, tmp_path):
    if importlib.util.find_spec(f"hfexport_{fmt}") is None:
        pytest.skip(f"hfexport-{fmt} is not installed in this environment")
    inputs, expected = bert
    _export(fmt, tmp_path / "out", "--model", "tiny:bert")
    model = hfexport.load(tmp_path / "out")
    assert model.export_format == fmt and not model.is_generation
    got = model(**inputs)
    assert type(got) is type(expected)  # BaseModelOutputWithPoolingAndCrossAttentions
    assert list(got.keys()) == list(expected.keys()) == ["last_hidden_state", "pooler_output"]
    for name in expected:
        assert got[name].shape == expected[name].shape
        assert (got[name] - expected[name]).abs().max().item() <= _TOLERANCE[fmt], name
    with pytest.raises(ExportFolderError, match=r"plain .* export, which cannot generate"):
        model.generate(inputs["input_ids"], max_new_tokens=2)


@pytest.mark.slow
def test_load_generation_folder_generates_like_model_generate(tmp_path):
    folder = tiny_model_folder("llama", tmp_path / "llama")
    _export("dynamo", tmp_path / "gen", "--model", str(folder), "--task", "text-generation")
    model = hfexport.load(tmp_path / "gen")
    assert model.is_generation and model.output_class.__name__ == "CausalLMOutputWithPast"
    eager = load_model(str(folder), "text-generation").model
    prompt = torch.tensor([[5, 9, 13, 21, 34, 55]])
    expected = eager.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
    )
    got = model.generate(input_ids=prompt, max_new_tokens=12)
    assert got.tolist() == expected.tolist()
    # a forward call runs the prefill and returns eager's logits and a DynamicCache
    out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        reference = eager(input_ids=prompt, attention_mask=torch.ones_like(prompt))
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert (out.logits - reference.logits).abs().max().item() <= 1e-5
    assert type(out.cache).__name__ == "DynamicCache"
    assert torch.allclose(out.cache.layers[1].keys, reference.cache.layers[1].keys, atol=1e-5)


def test_load_refuses_what_is_not_an_export(tmp_path):
    with pytest.raises(ExportFolderError, match="is not a folder"):
        hfexport.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportFolderError, match=r"neither generation_manifest\.json nor export_report\.json"):
        hfexport.load(tmp_path / "empty")


def test_load_checks_checksums_and_names_the_missing_backend(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    _export("dynamo", folder, "--model", "tiny:bert")
    data = bytearray((folder / "model.pt2").read_bytes())
    data[-100] ^= 0xFF
    (folder / "model.pt2").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.pt2"):
        hfexport.load(folder)

    other = tmp_path / "other"
    other.mkdir()
    (other / "export_report.json").write_text(json.dumps({"export_format": "tflite"}))
    with pytest.raises(MissingBackendError, match="'tflite' export"):
        hfexport.load(other)
    (other / "export_report.json").write_text(json.dumps({"export_format": "onnx"}))
    import hfexport.auto as auto

    def not_installed(name):  # as on a machine without hfexport-onnx
        raise auto._missing_backend(name)

    monkeypatch.setattr(auto, "get_hf_exporter", not_installed)
    with pytest.raises(MissingBackendError, match=r"pip install hfexport-onnx"):
        hfexport.load(other)


def test_a_python_user_writes_a_folder_hfexport_load_runs(tmp_path):
    """No CLI: export with the API, write the folder with hfexport.folder.write_export_folder, load it."""
    if importlib.util.find_spec("hfexport_dynamo") is None:
        pytest.skip("hfexport-dynamo is not installed in this environment")
    from hfexport import AutoHfExporter, DynamoConfig
    from hfexport.folder import write_export_folder
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    exporter = AutoHfExporter.from_config(DynamoConfig(dynamic=True))
    program = exporter.export(model, inputs)
    record = write_export_folder(tmp_path / "out", exporter, program, model=model, task="feature-extraction")
    assert record.artifact.file == "model.pt2" and record.model_class == "BertModel"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "checksums.sha256",
        "config.json",
        "export_report.json",
        "model.pt2",
    ]
    loaded = hfexport.load(tmp_path / "out")
    assert loaded.export_format == "dynamo" and loaded.task == "feature-extraction"
    with torch.no_grad():
        expected = model(**inputs)
    got = loaded(**inputs)
    assert type(got) is type(expected)
    for name in expected:
        assert (got[name] - expected[name]).abs().max().item() <= 1e-5, name


@pytest.mark.slow
def test_a_python_user_writes_a_generation_folder_hfexport_load_generates(tmp_path):
    if importlib.util.find_spec("hfexport_dynamo") is None:
        pytest.skip("hfexport-dynamo is not installed in this environment")
    from hfexport import AutoHfExporter, DynamoConfig
    from hfexport.folder import write_export_folder

    folder = tiny_model_folder("llama", tmp_path / "llama")
    loaded = load_model(str(folder), "text-generation")
    exporter = AutoHfExporter.from_config(DynamoConfig(dynamic=True))
    artifacts = exporter.export_for_generation(loaded.model, loaded.inputs)
    record = write_export_folder(tmp_path / "gen", exporter, artifacts, model=loaded.model)
    assert record.components == list(artifacts) and record.task == "text-generation"
    model = hfexport.load(tmp_path / "gen")
    assert model.is_generation
    prompt = torch.tensor([[5, 9, 13, 21, 34, 55]])
    expected = loaded.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False
    )
    assert model.generate(input_ids=prompt, max_new_tokens=8).tolist() == expected.tolist()
