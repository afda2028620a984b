"""The transformers.js layout's Python side: registration, refusals, tokenizer files, the folder it writes.

Running the folder in transformers.js itself (Node) is ``tests-integration/test_transformers_js.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

import hfexport_onnx  # noqa: F401  (registers the layout)
from hfexport.config import OnnxConfig
from hfexport.layouts import LayoutRequest, check_layout
from hfexport_onnx.layouts.transformers_js import (
    _copy_tokenizer,
    check_transformers_js,
    write_transformers_js,
)

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "."]


def _wordpiece_folder(folder):
    """A slow-tokenizer folder (vocab.txt + tokenizer_config.json), no tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 64})
    )
    return sorted(folder.iterdir())


def test_layout_is_registered_with_its_tasks():
    layout = check_layout("onnx", "transformers.js")
    assert layout.needs_tokenizer
    assert layout.tasks == (
        "feature-extraction",
        "fill-mask",
        "text-classification",
        "token-classification",
        "question-answering",
        "text-generation",
    )
    with pytest.raises(ValueError, match=r"serves tasks .*not 'image-classification'.*no onnx layout fits"):
        check_layout("onnx", "transformers.js", model=torch.nn.Linear(2, 2), task="image-classification")


def test_bfloat16_weights_are_refused():
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    reason = check_transformers_js(model, "feature-extraction")
    assert reason is not None and "float32 or float16" in reason and "bfloat16" in reason
    assert check_transformers_js(torch.nn.Linear(2, 2), "feature-extraction") is None


def test_slow_tokenizer_files_are_converted_to_tokenizer_json(tmp_path):
    files = _wordpiece_folder(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    written = _copy_tokenizer(files, out)
    assert written == ["tokenizer.json", "tokenizer_config.json"]
    from tokenizers import Tokenizer

    encoded = Tokenizer.from_file(str(out / "tokenizer.json")).encode("The cats sat.")
    assert encoded.tokens == ["[CLS]", "the", "cat", "##s", "sat", ".", "[SEP]"]
    assert encoded.ids == [2, 5, 6, 10, 7, 11, 3]


def test_a_conversion_that_loses_the_vocabulary_is_refused(tmp_path):
    # the rxnmapper ALBERT folder: vocab.txt + an empty tokenizer_config.json; transformers 5's
    # AutoTokenizer builds a 5-token AlbertTokenizer from it, which must not be shipped
    folder = tmp_path / "model"
    _wordpiece_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "config.json").write_text(json.dumps({"model_type": "albert"}))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError) as info:
        _copy_tokenizer(sorted(folder.iterdir()), out)
    message = str(info.value)
    assert "add tokenizer.json and tokenizer_config.json to the model folder" in message
    assert f"for the {len(VOCAB)} entries of vocab.txt" in message
    assert list(out.iterdir()) == []


def test_no_tokenizer_says_which_files_to_add(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError) as info:
        _copy_tokenizer([], out)
    assert "add tokenizer.json and tokenizer_config.json to the model folder" in str(info.value)
    assert list(out.iterdir()) == []


def test_writer_puts_one_graph_file_under_onnx_without_external_data(tmp_path):
    from hfexport.testing import tiny_model
    from hfexport_onnx import OnnxExporter

    model, inputs = tiny_model("bert", "feature-extraction")
    model_dir = tmp_path / "model"
    files = _wordpiece_folder(model_dir)
    model.config.to_json_file(model_dir / "config.json")
    out = tmp_path / "out"
    out.mkdir()
    config = OnnxConfig(dynamic=False, external_data=False)  # static: seconds, the layout is the point
    extra = write_transformers_js(
        LayoutRequest(
            exporter=OnnxExporter(),
            model=model,
            inputs=inputs,
            config=config,
            task="feature-extraction",
            output_dir=out,
            files=(*files, model_dir / "config.json"),
        )
    )
    assert extra["files"] == ["config.json", "onnx/model.onnx", "tokenizer.json", "tokenizer_config.json"]
    assert extra["onnx_file"] == "onnx/model.onnx" and extra["external_data"] is False
    assert extra["onnx_outputs"][0] == "last_hidden_state"
    assert set(extra["onnx_inputs"]) <= {"input_ids", "attention_mask", "token_type_ids"}
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model.onnx"]
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "bert"
    assert written["transformers.js_config"] == {"dtype": "fp32"}  # no external data to announce
