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


def test_quantized_graphs_get_transformers_js_q4_and_q4f16_names():
    from hfexport.errors import UnsupportedModelError
    from hfexport_onnx.layouts.transformers_js import transformers_js_dtype

    assert transformers_js_dtype("float32", None) == ("fp32", "")
    assert transformers_js_dtype("float16", None) == ("fp16", "_fp16")
    assert transformers_js_dtype("float32", "int4-weight") == ("q4", "_q4")
    assert transformers_js_dtype("float16", "int4-weight") == ("q4f16", "_q4f16")
    with pytest.raises(UnsupportedModelError) as info:
        transformers_js_dtype("float16", "int8-weight")
    message = str(info.value)
    assert "no file for a float16 graph quantized with int8-weight" in message
    assert "q4 (float32 + int4-weight), q4f16 (float16 + int4-weight)" in message


def test_a_quantization_without_a_transformers_js_dtype_is_refused_by_config():
    from hfexport.config import QuantizationConfig

    for method in ("int8-dynamic", "int8-static", "int8-weight"):
        with pytest.raises(ValueError) as info:
            check_layout(
                "onnx", "transformers.js", config=OnnxConfig(quantization=QuantizationConfig(method))
            )
        message = str(info.value)
        assert f"layout 'transformers.js': --quantize {method} has no transformers.js dtype" in message
        assert "q4f16 (--dtype float16 --quantize int4-weight)" in message
    q4f16 = OnnxConfig(dtype="float16", quantization=QuantizationConfig("int4-weight"))
    assert check_layout("onnx", "transformers.js", config=q4f16).name == "transformers.js"
    # the genai layout does not write float16 quantized graphs; float32 int4 stays its recipe
    with pytest.raises(
        ValueError, match=r"--dtype float16 with --quantize int4-weight is not written for ONNX"
    ):
        check_layout("onnx", "genai", config=q4f16)
    assert check_layout("onnx", "genai", config=OnnxConfig(quantization=QuantizationConfig("int4-weight")))


@pytest.mark.parametrize(
    ("layout", "extra", "shown"),
    [
        (
            "transformers.js",
            ["--quantize", "int8-dynamic"],
            "layout 'transformers.js': --quantize int8-dynamic has no transformers.js dtype; this layout writes "
            "fp32 and fp16 (no --quantize; --dtype float16), q4 (--quantize int4-weight) and q4f16",
        ),
        (
            "genai",
            ["--dtype", "float16", "--quantize", "int4-weight"],
            "allowed: --dtype float32 (the default) with --quantize int4-weight, or --layout transformers.js",
        ),
        (
            "transformers.js",
            ["--dtype", "float16", "--quantize", "int8-dynamic"],
            "quantization 'int8-dynamic' quantizes float32 graphs only; dtype='float16' with it is not allowed",
        ),
    ],
)
def test_q4f16_flags_a_layout_cannot_serve_are_usage_errors_before_loading(tmp_path, layout, extra, shown):
    from hfexport.testing.invoke import export_layout, refusal

    out = tmp_path / "out"
    message = refusal(
        export_layout("onnx", "tiny:llama", out, layout=layout, task="text-generation", extra=extra)
    )
    assert shown in message
    assert not out.exists()


def test_encoder_q4f16_is_written_as_model_q4f16_onnx(tmp_path):
    """An encoder (feature-extraction) at ``dtype="float16"`` + ``int4-weight``: the q4f16 file and
    dtype, float16 output, MatMulNBits with float16 scales; validated against fp32 eager (gates)."""
    import onnx

    from hfexport.config import QuantizationConfig
    from hfexport.testing import tiny_model
    from hfexport_onnx import OnnxExporter

    model, inputs = tiny_model("bert", "feature-extraction")
    model_dir = tmp_path / "model"
    files = _wordpiece_folder(model_dir)
    model.config.to_json_file(model_dir / "config.json")
    out = tmp_path / "out"
    out.mkdir()
    config = OnnxConfig(
        dynamic=False, external_data=False, dtype="float16", quantization=QuantizationConfig("int4-weight")
    )
    exporter = OnnxExporter()
    extra = write_transformers_js(
        LayoutRequest(
            exporter=exporter,
            model=model,
            inputs=inputs,
            config=config,
            task="feature-extraction",
            output_dir=out,
            files=(*files, model_dir / "config.json"),
        )
    )
    assert extra["onnx_file"] == "onnx/model_q4f16.onnx" and extra["transformers_js_dtype"] == "q4f16"
    assert json.loads((out / "config.json").read_text())["transformers.js_config"] == {"dtype": "q4f16"}
    graph = onnx.load(str(out / "onnx" / "model_q4f16.onnx")).graph
    inits = {i.name: i.data_type for i in graph.initializer}
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) >= 6 * model.config.num_hidden_layers  # q, k, v, o, up, down per layer
    assert {inits[n.input[2]] for n in nbits} == {onnx.TensorProto.FLOAT16}
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    hidden = exporter.last_report.validation["sample"][0]
    assert hidden["name"] == "last_hidden_state" and hidden["ok"] and hidden["cosine"] >= 0.98
