"""The export folder (:mod:`hfexport.folder`): its names defined once, the record round-tripping the
``export_report.json`` files earlier versions wrote, the reader, and the writer a Python user calls
to get a folder :func:`hfexport.load` runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hfexport
from hfexport import auto
from hfexport.atomic import EXPORT_MARKERS, check_output_dir
from hfexport.config import DynamoConfig
from hfexport.errors import OutputDirectoryError
from hfexport.folder import (
    MANIFEST_NAME,
    REPORT_NAME,
    ArtifactEntry,
    ExportFolderError,
    ExportRecord,
    open_export_folder,
    read_export_folder,
    write_export_folder,
)
from hfexport.generation.support import GenerationSupport
from hfexport.integrity import write_checksums
from hfexport.testing import tiny_model
from hfexport.testing.eager_backend import EagerModuleExporter

DATA = Path(__file__).parent / "data" / "export_reports"
#: export_report.json of `hfexport export` before the folder module (tiny models; long report
#: sections shortened): a plain dynamo export, a dynamo generation export, an onnx transformers.js layout
SAMPLES = sorted(DATA.glob("*.json"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_record_round_trips_earlier_files_exactly(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    record = ExportRecord.from_dict(data)
    assert record.to_dict() == data
    assert list(record.to_dict()) == list(data)  # the key order too
    assert record.to_json() == text  # byte for byte, as the writer writes it


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_a_record_built_in_code_writes_the_same_layout(path: Path) -> None:
    """A record filled field by field (as the CLI does) gives the files' keys in their order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    read = ExportRecord.from_dict(data)
    built = ExportRecord(export_format=read.export_format)
    for name in ExportRecord.__dataclass_fields__:
        if not name.startswith("_"):
            setattr(built, name, getattr(read, name))
    if read.layout is not None:  # the CLI keeps every field of the layout's writer in `extra`
        keys = list(data)
        layout_keys = keys[keys.index("runtime") + 1 : keys.index("model")]
        built.files = None
        built.extra = {key: data[key] for key in layout_keys}
    assert built._source_keys is None
    assert list(built.to_dict()) == list(data)
    assert built.to_dict() == data


def test_record_fields_are_typed() -> None:
    plain = ExportRecord.from_dict(json.loads((DATA / "plain_dynamo.json").read_text()))
    assert plain.export_format == "dynamo" and plain.task == "feature-extraction"
    assert plain.artifact == ArtifactEntry("model.pt2", plain.artifact.metadata)
    assert plain.model_class == "BertModel"
    assert [s["name"] for s in plain.stages][:1] == ["prepare_inputs"]
    assert "sample" in plain.validation
    assert not plain.is_generation and plain.layout is None
    generation = ExportRecord.from_dict(json.loads((DATA / "generation_dynamo.json").read_text()))
    assert generation.is_generation and generation.components == ["prefill", "decode"]
    assert generation.artifact is None and set(generation.component_reports) == {"prefill", "decode"}
    layout = ExportRecord.from_dict(json.loads((DATA / "layout_transformers_js.json").read_text()))
    assert layout.layout == "transformers.js" and "onnx_file" in layout.extra


def test_a_record_missing_fields_and_with_unknown_ones_round_trips() -> None:
    data = {"export_format": "onnx", "future_field": {"x": 1}, "report": None}
    record = ExportRecord.from_dict(data)
    assert record.extra == {"future_field": {"x": 1}} and record.model_class is None
    assert record.to_dict() == data and list(record.to_dict()) == list(data)
    record.task = "fill-mask"  # a field set since is written too
    assert record.to_dict() == {**data, "task": "fill-mask"}
    with pytest.raises(ExportFolderError, match="JSON object"):
        ExportRecord.from_dict(["not", "a", "mapping"])  # type: ignore[arg-type]


def test_the_folder_names_are_defined_once() -> None:
    import hfexport.atomic
    import hfexport.generation.persist
    import hfexport.loader

    assert EXPORT_MARKERS == (REPORT_NAME, MANIFEST_NAME)
    assert hfexport.generation.persist.MANIFEST_NAME is MANIFEST_NAME
    assert hfexport.loader.REPORT_NAME is REPORT_NAME
    assert hfexport.loader.ExportFolderError is ExportFolderError
    root = Path(hfexport.__file__).parent
    for path in root.rglob("*.py"):
        if path.parent.name == "folder" or path.parent.name == "testing":
            continue
        text = path.read_text(encoding="utf-8")
        for name in (REPORT_NAME, MANIFEST_NAME):
            assert f'= "{name}"' not in text, f"{path.relative_to(root)} defines {name} again"


def test_the_folder_module_imports_no_torch() -> None:
    code = "import sys, hfexport.folder, hfexport.atomic; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_read_export_folder_refuses_what_is_not_an_export(tmp_path) -> None:
    with pytest.raises(ExportFolderError, match="is not a folder"):
        read_export_folder(tmp_path / "missing")
    with pytest.raises(ExportFolderError, match=r"neither generation_manifest\.json nor export_report\.json"):
        read_export_folder(tmp_path)
    (tmp_path / REPORT_NAME).write_text("[1, 2]")
    with pytest.raises(ExportFolderError, match="holds a JSON list, not an object"):
        read_export_folder(tmp_path)
    (tmp_path / REPORT_NAME).write_text("{not json")
    with pytest.raises(ExportFolderError, match="cannot be read as JSON"):
        read_export_folder(tmp_path)


def test_a_layout_folder_with_a_subfolder_is_a_previous_export(tmp_path) -> None:
    """A layout writes onnx/model.onnx: checksums list the file, the folder is the export's own."""
    folder = tmp_path / "js"
    (folder / "onnx").mkdir(parents=True)
    (folder / "onnx" / "model.onnx").write_bytes(b"graph")
    (folder / REPORT_NAME).write_text(json.dumps({"export_format": "onnx", "layout": "transformers.js"}))
    write_checksums(folder)
    check_output_dir(folder)  # replaced without --overwrite
    (folder / "notes").mkdir()  # a folder the export did not write is still refused
    with pytest.raises(OutputDirectoryError, match="notes is not among the files"):
        check_output_dir(folder)


# -- the writer, from Python, with a backend whose artifact is the eager module --------------------
class _ModuleSupport(GenerationSupport):
    def component_metadata(self, artifact):
        return {"module_class": type(artifact).__name__}

    def load_component(self, path, metadata):
        assert metadata == {"module_class": "BertModel"}
        return self.exporter.runner(self.exporter.load(path))


class _ModuleExporter(EagerModuleExporter):
    export_format = "foldertoy"
    generation_support_class = _ModuleSupport


@pytest.fixture
def toy_format():
    auto._EXPORTERS[_ModuleExporter.export_format] = _ModuleExporter
    yield _ModuleExporter
    auto._EXPORTERS.pop(_ModuleExporter.export_format, None)


def test_write_export_folder_from_python_loads_with_hfexport_load(toy_format, tmp_path) -> None:
    model, inputs = tiny_model("bert")
    exporter = toy_format()
    artifact = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    record = write_export_folder(tmp_path / "out", exporter, artifact, model=model, task="feature-extraction")
    written = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert written == record.to_dict()
    assert written["artifact"] == {"file": "model.toy", "metadata": {"module_class": "BertModel"}}
    assert written["report"]["model_class"] == "BertModel" and written["task"] == "feature-extraction"
    assert written["config"]["dynamic"] is True and written["versions"]["hfexport"]
    assert sorted(written["sha256"]) == ["config.json", "model.toy"]
    assert read_export_folder(tmp_path / "out").record == ExportRecord.from_dict(written)
    loaded = hfexport.load(tmp_path / "out")
    with torch.no_grad():
        expected = model(**inputs)
    got = loaded(**inputs)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)


def test_an_unfinished_folder_is_not_written(toy_format, tmp_path) -> None:
    with (
        pytest.raises(OutputDirectoryError, match="was not finished"),
        open_export_folder(tmp_path / "out", toy_format()) as folder,
    ):
        (folder.path / "model.toy").write_text("x")
    assert not (tmp_path / "out").exists()


def test_write_export_folder_needs_an_export_or_a_config(toy_format, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs the export's config"):
        write_export_folder(tmp_path / "out", toy_format(), object())
    assert not (tmp_path / "out").exists()


def test_the_size_change_counts_a_weights_file_beside_the_graph():
    """OpenVINO writes openvino_model.xml (graph) + openvino_model.bin (weights): both are the artifact."""
    from hfexport.config import OpenvinoConfig
    from hfexport.folder.writer import size_change

    sizes = {"openvino_model.xml": 100, "openvino_model.bin": 300, "tokenizer.json": 50, "model.bin.txt": 7}
    change = size_change(
        OpenvinoConfig(quantization="int8-weight"), 1000, sizes, {"model": "openvino_model.xml"}
    )
    assert change == {"eager_float32_bytes": 1000, "artifact_bytes": 400, "ratio": 0.4}
