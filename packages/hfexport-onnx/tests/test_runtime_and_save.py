"""OnnxRuntimeRunner feeding and errors; OnnxExporter.save: atomic, external data or not."""

from __future__ import annotations

import pytest
import torch

from hfexport.config import OnnxConfig
from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner

ATOL = 1e-5


@pytest.fixture(scope="module")
def program(tiny_encoder_builder):
    model, inputs = tiny_encoder_builder()
    exporter = OnnxExporter()
    return (
        exporter,
        exporter.export(model, inputs, OnnxConfig(dynamic=True, external_data=False)),
        model,
        inputs,
    )


def test_runner_reports_missing_inputs(program):
    _exporter, onnx_program, _model, inputs = program
    runner = OnnxRuntimeRunner(onnx_program)
    with pytest.raises(ValueError, match=r"needs input\(s\) \['attention_mask'\]"):
        runner({"inputs_embeds": inputs["inputs_embeds"]})


def test_runner_names_an_axis_the_graph_holds_static(program):
    # the hidden axis of inputs_embeds is the model's (static in the graph); ONNX Runtime's own
    # error ("Got invalid dimensions for input") named neither the leaf path nor what to do
    _exporter, onnx_program, _model, inputs = program
    runner = OnnxRuntimeRunner(onnx_program)
    embeds = inputs["inputs_embeds"]
    hidden = embeds.shape[-1]
    wider = torch.zeros(*embeds.shape[:-1], hidden + 3)
    with pytest.raises(
        ValueError,
        match=rf"input 'inputs_embeds' axis 2 is {hidden + 3}, .* fixed at {hidden} .* export again",
    ):
        runner({**inputs, "inputs_embeds": wider})
    with pytest.raises(ValueError, match=r"input 'inputs_embeds' has 2 axes .* the ONNX graph takes 3"):
        runner({**inputs, "inputs_embeds": embeds[0]})


def test_runner_ignores_inputs_the_graph_does_not_take(program):
    _exporter, onnx_program, model, inputs = program
    got = OnnxRuntimeRunner(onnx_program)({**inputs, "unused_extra": torch.zeros(3)})
    with torch.no_grad():
        assert (got["last_hidden_state"] - model(**inputs).last_hidden_state).abs().max() <= ATOL


def test_runner_rejects_what_it_cannot_run(tmp_path):
    with pytest.raises(TypeError, match="cannot run a dict"):
        OnnxRuntimeRunner({"not": "a model"})
    with pytest.raises(FileNotFoundError, match="no ONNX model"):
        OnnxRuntimeRunner(tmp_path / "missing.onnx")


def test_save_inside_the_model_file(program, tmp_path):
    exporter, onnx_program, model, inputs = program
    target = tmp_path / "model.onnx"
    exporter.save(onnx_program, target)  # the export chose external_data=False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    got = OnnxRuntimeRunner(target)(inputs)["last_hidden_state"]
    with torch.no_grad():
        assert (got - model(**inputs).last_hidden_state).abs().max() <= ATOL


def test_save_with_external_data_override(program, tmp_path):
    exporter, onnx_program, model, inputs = program
    target = tmp_path / "sub" / "model.onnx"
    exporter.save(onnx_program, target, external_data=True)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    got = OnnxRuntimeRunner(target)(inputs)["last_hidden_state"]
    with torch.no_grad():
        assert (got - model(**inputs).last_hidden_state).abs().max() <= ATOL


@pytest.mark.parametrize("external", [False, True])
def test_failed_save_keeps_the_previous_file_and_leaves_no_debris(program, tmp_path, monkeypatch, external):
    exporter, onnx_program, _model, _inputs = program
    target = tmp_path / "model.onnx"
    target.write_bytes(b"previous good model")

    def broken_save(destination, **kwargs):
        with open(destination, "wb") as fh:
            fh.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(onnx_program, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        exporter.save(onnx_program, target, external_data=external)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert target.read_bytes() == b"previous good model"


def test_save_refuses_a_directory_and_a_foreign_artifact(program, tmp_path):
    exporter, onnx_program, _model, _inputs = program
    with pytest.raises(IsADirectoryError, match="pass a file path"):
        exporter.save(onnx_program, tmp_path)
    with pytest.raises(TypeError, match=r"expects a torch\.onnx\.ONNXProgram"):
        exporter.save(object(), tmp_path / "model.onnx")


def test_exporter_is_found_through_the_registry_and_entry_point():
    from hfexport.auto import AutoHfExporter, get_hf_exporter

    assert get_hf_exporter("onnx") is OnnxExporter
    exporter = AutoHfExporter.from_config({"export_format": "onnx", "dynamic": True})
    assert isinstance(exporter, OnnxExporter)
    assert OnnxExporter.artifact_filename == "model.onnx"
    assert OnnxExporter.package_name == "hfexport-onnx"
    assert set(OnnxExporter.required_packages) == {"torch", "onnx", "onnxscript", "onnxruntime"}


def test_onnx_runtime_messages_go_to_the_cli_log_while_routing(tmp_path, monkeypatch, capfd):
    """ONNX Runtime prints its warnings from C++; the CLI (no -v) routes them to its log file
    (hfexport_onnx.runtime.route_ort_logs), and afterwards ONNX Runtime prints them itself again."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hfexport import cli_logging

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(3, np.float32), "unused_w")],  # no node reads it: ORT warns
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    log = tmp_path / "cli.log"
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(log))
    capfd.readouterr()
    try:
        cli_logging.setup_cli_logging(verbose=False)
        runner = OnnxRuntimeRunner(model)
    finally:
        cli_logging.restore_cli_logging()
    assert runner({"x": torch.tensor([-1.0, 2.0])})["y"].tolist() == [0.0, 2.0]
    assert "Removing initializer" not in capfd.readouterr().err
    assert (
        "WARNING onnxruntime.native: Removing initializer 'unused_w'. It is not used by any node"
        in log.read_text()
    )
    OnnxRuntimeRunner(model)
    assert "Removing initializer 'unused_w'" in capfd.readouterr().err
