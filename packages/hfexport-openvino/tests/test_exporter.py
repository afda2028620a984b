"""OpenvinoExporter on a toy module: config checks before capture, leaf-path names, atomic save,
load, the failed-conversion error, and the empty-operand ``aten.cat`` workaround."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.config import OpenvinoConfig
from hfexport.registry import entries
from hfexport_openvino import DeviceUnavailableError, OpenvinoConversionError, OpenvinoExporter
from hfexport_openvino.errors import failed_nodes


def test_config_is_in_the_core_format_table_and_round_trips():
    config = AutoExportConfig.from_dict(
        {"export_format": "openvino", "device": "cpu", "inference_precision_hint": "f32", "stateful": False}
    )
    assert type(config) is OpenvinoConfig
    assert (config.device, config.compress_to_fp16, config.inference_precision_hint, config.stateful) == (
        "CPU",
        False,
        "f32",
        False,
    )
    assert OpenvinoConfig().stateful is True and OpenvinoConfig().device == "CPU"
    assert type(AutoHfExporter.from_config(config)) is OpenvinoExporter


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device", "TPU", "device='TPU' is invalid; allowed: 'CPU', 'GPU', 'NPU'"),
        (
            "inference_precision_hint",
            "int8",
            "inference_precision_hint='int8' is invalid; allowed: None, 'f32'",
        ),
        ("compress_to_fp16", "yes", "compress_to_fp16"),
        ("stateful", 1, "stateful"),
    ],
)
def test_bad_config_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        OpenvinoConfig(**{field: value})


def test_absent_device_is_refused_before_capture(tiny_encoder, monkeypatch):
    import openvino as ov

    if "NPU" in ov.Core().available_devices:
        pytest.skip("this machine has an NPU")
    model, inputs = tiny_encoder
    exporter = OpenvinoExporter()
    called = []
    monkeypatch.setattr("hfexport.capture.capture", lambda *a, **k: called.append(1))
    with pytest.raises(
        DeviceUnavailableError, match=r"device 'NPU' is not present here; available devices: CPU"
    ):
        exporter.export(model, inputs, OpenvinoConfig(device="NPU"))
    assert called == []


def test_precision_hint_the_device_lacks_is_refused(monkeypatch):
    import openvino as ov

    real = ov.Core.get_property

    def fake(self, device, name):
        if name == "OPTIMIZATION_CAPABILITIES":
            return ["FP32", "INT8"]
        return real(self, device, name)

    monkeypatch.setattr(ov.Core, "get_property", fake)
    with pytest.raises(
        DeviceUnavailableError,
        match=r"inference_precision_hint='bf16' is not supported by OpenVINO device 'CPU'.*allowed here: None, 'f32'",
    ):
        OpenvinoExporter(OpenvinoConfig(inference_precision_hint="bf16"))


def test_export_names_io_by_leaf_path_and_validates_at_two_shapes(tiny_encoder, tmp_path):
    model, inputs = tiny_encoder
    exporter = OpenvinoExporter()
    ov_model = exporter.export(model, inputs, OpenvinoConfig(dynamic=True))
    assert [p.get_any_name() for p in ov_model.inputs] == ["inputs_embeds", "attention_mask"]
    assert [p.get_any_name() for p in ov_model.outputs] == ["last_hidden_state"]
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    for stage in (
        "patches",
        "capture",
        "decompose",
        "fx_node_fixes",
        "lower",
        "convert",
        "io_names",
        "validate",
        "validate_second_shape",
    ):
        assert statuses[stage] == "ok", report.summary_lines()
    assert report.validation["second_shape"][0]["shape"] != report.validation["sample"][0]["shape"]
    assert all(row["max_abs_diff"] <= 1e-4 for row in report.validation["sample"])

    target = tmp_path / "out" / "openvino_model.xml"
    exporter.save(ov_model, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["openvino_model.bin", "openvino_model.xml"]
    assert 'element_type="f16"' not in target.read_text()  # compress_to_fp16 defaults to False
    loaded = exporter.load(target)
    outputs = exporter.runner(loaded)(inputs)
    expected = model(**inputs).last_hidden_state
    torch.testing.assert_close(outputs["last_hidden_state"], expected, atol=1e-5, rtol=1e-5)
    names = json.loads(str(loaded.get_rt_info(["hfexport", "io"]).astype(str)))
    assert names == {
        "inputs": {"inputs_embeds": "inputs_embeds", "attention_mask": "attention_mask"},
        "outputs": {"last_hidden_state": "last_hidden_state"},
    }


def test_compress_to_fp16_stores_half_weights_and_save_is_atomic(tiny_encoder, tmp_path, monkeypatch):
    import openvino as ov

    model, inputs = tiny_encoder
    exporter = OpenvinoExporter()
    ov_model = exporter.export(model, inputs, OpenvinoConfig(compress_to_fp16=True, validate=False))
    exporter.save(ov_model, tmp_path / "half" / "openvino_model.xml")
    ov_model.set_rt_info("False", ["hfexport", "compress_to_fp16"])  # as an export without the option
    exporter.save(ov_model, tmp_path / "full" / "openvino_model.xml")
    half, full = (tmp_path / d / "openvino_model.bin" for d in ("half", "full"))
    assert half.stat().st_size < full.stat().st_size
    assert 'element_type="f16"' in (tmp_path / "half" / "openvino_model.xml").read_text()
    assert 'element_type="f16"' not in (tmp_path / "full" / "openvino_model.xml").read_text()

    tmp_path = tmp_path / "atomic"
    tmp_path.mkdir()
    with pytest.raises(ValueError, match=r"saved as \.xml"):
        exporter.save(ov_model, tmp_path / "model.onnx")
    target = tmp_path / "openvino_model.xml"
    target.write_text("old")

    def broken(*args, **kwargs):
        Path(args[1]).write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(ov, "save_model", broken)
    with pytest.raises(OSError, match="disk full"):
        exporter.save(ov_model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openvino_model.xml"]
    assert target.read_text() == "old"


class _Unconvertible(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.zeta(x, x + 1.0)  # aten.special_zeta: no OpenVINO conversion rule


def test_failed_conversion_names_the_fx_node_and_op():
    exporter = OpenvinoExporter()
    with pytest.raises(OpenvinoConversionError) as info:
        exporter.export(_Unconvertible(), {"x": torch.rand(2, 3) + 2.0}, OpenvinoConfig())
    error = info.value
    assert error.stage == "convert"
    assert error.ops == ["aten.special_zeta.default"]
    assert error.nodes == [("special_zeta", "aten.special_zeta.default")]
    assert "failed FX node(s): special_zeta (aten.special_zeta.default)" in str(error)


def test_failed_nodes_parses_openvino_messages():
    message = (
        "Exception happened during conversion of operation cat_3/aten.cat.default with schema NONE\n"
        "Summary:\n-- Conversion is failed for: SequenceMark, aten.cat.default\n"
    )
    assert failed_nodes(message) == [("cat_3", "aten.cat.default")]


def test_empty_cat_operand_fix_is_registered_and_rewrites():
    (entry,) = [e for e in entries("openvino") if e.name.endswith("drop_empty_cat_operands")]
    assert entry.issue.startswith("https://github.com/") and entry.versions == {"openvino": ">=2026.0"}

    class Cat(torch.nn.Module):
        def forward(self, x):
            return torch.cat([torch.tensor([]), x], dim=-2)

    program = torch.export.export(Cat(), (torch.rand(1, 2, 3, 4),))
    node = next(n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default)
    assert len(node.args[0]) == 2
    assert entry.func(program.graph_module, node) is True
    assert len(node.args[0]) == 1
    program.graph_module.recompile()
    import openvino as ov

    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    x = np.random.rand(1, 2, 3, 4).astype(np.float32)
    np.testing.assert_allclose(compiled(x)[0], x)


def test_sym_min_fix_lets_openvino_convert_a_sliding_window_cut():
    """The core's keep_last (sliding-window cache capture workaround) traces to torch.sym_min, which
    OpenVINO's frontend cannot convert; the fix computes it over 0-d tensors, same values."""
    import openvino as ov

    from hfexport.workarounds.torch_export import keep_last

    (entry,) = [e for e in entries("openvino") if e.name.endswith("sym_min_max_as_tensor_ops")]
    assert entry.versions == {"openvino": ">=2026.0"}

    class Cut(torch.nn.Module):
        def forward(self, x):
            return keep_last(x, 4, dim=1) * 2

    length = torch.export.Dim("length", min=2, max=64)
    program = torch.export.export(Cut(), (torch.rand(2, 6, 3),), dynamic_shapes=({1: length},))
    nodes = [n for n in program.graph_module.graph.nodes if n.target is torch.sym_min]
    assert len(nodes) == 1
    with pytest.raises(Exception, match="sym_min"):
        ov.convert_model(program)
    assert entry.func(program.graph_module, nodes[0]) is True
    program.graph_module.recompile()
    assert not [n for n in program.graph_module.graph.nodes if n.target is torch.sym_min]
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    for n in (3, 4, 9):  # shorter than, equal to and longer than the window
        x = np.random.rand(2, n, 3).astype(np.float32)
        np.testing.assert_allclose(compiled(x)[0], x[:, -min(n, 4) :] * 2, rtol=1e-6)


def test_sym_mod_fix_lets_openvino_convert_chunk_padding():
    """Chunked linear attention pads the sequence to a multiple of the chunk with Python's % on a
    SymInt, which OpenVINO's frontend cannot convert; the fix computes it as a - (a // b) * b."""
    import operator

    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("sym_mod_as_floordiv")]
    assert entry.versions == {"openvino": ">=2026.0"}

    class Pad(torch.nn.Module):
        def forward(self, x):
            pad = (4 - x.shape[1] % 4) % 4
            return torch.nn.functional.pad(x, (0, 0, 0, pad)) + 1

    length = torch.export.Dim("length", min=2, max=64)
    program = torch.export.export(Pad(), (torch.rand(2, 6, 3),), dynamic_shapes=({1: length},))
    nodes = [n for n in program.graph_module.graph.nodes if n.target is operator.mod]
    assert nodes
    with pytest.raises(Exception, match="mod"):
        ov.convert_model(program)
    for node in nodes:
        assert entry.func(program.graph_module, node) is True
    program.graph_module.recompile()
    assert not [n for n in program.graph_module.graph.nodes if n.target is operator.mod]
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    for n in (3, 4, 9):  # padded by 1, 0 and 3 rows
        x = np.random.rand(2, n, 3).astype(np.float32)
        expected = np.pad(x, ((0, 0), (0, (4 - n % 4) % 4), (0, 0))) + 1
        np.testing.assert_allclose(compiled(x)[0], expected, rtol=1e-6)


def test_sym_mod_fix_keeps_python_remainder_signs_and_stays_symbolic():
    """a - (a // b) * b is Python's % for every sign (floor division), and the rewritten program
    retraces (run_decompositions, as OpenVINO's frontend does) with no unbacked symbol."""
    import operator

    assert [a - (a // b) * b for a in (-7, 7) for b in (-3, 3)] == [a % b for a in (-7, 7) for b in (-3, 3)]
    (entry,) = [e for e in entries("openvino") if e.name.endswith("sym_mod_as_floordiv")]

    class Pad(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.pad(x, (0, (4 - x.shape[1] % 4) % 4))

    length = torch.export.Dim("length", min=2, max=64)
    program = torch.export.export(Pad(), (torch.rand(2, 6),), dynamic_shapes=({1: length},))
    for node in [n for n in program.graph_module.graph.nodes if n.target is operator.mod]:
        assert entry.func(program.graph_module, node) is True
    program.graph_module.recompile()
    retraced = program.run_decompositions({})
    targets = [n.target for n in retraced.graph_module.graph.nodes]
    assert operator.mod not in targets and torch.ops.aten._local_scalar_dense.default not in targets
    assert retraced.module()(torch.rand(2, 9)).shape == (2, 12)


def test_sym_pow_fix_writes_small_powers_as_products():
    """A SymInt ** 2 (what the decomposition of a symbolic matmul rebuilds in MobileViT / Swin) has no
    OpenVINO conversion; the fix writes it as a product and the converted model computes the same."""
    import operator

    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("sym_pow_as_products")]
    assert entry.versions == {"openvino": ">=2026.0"}

    class Square(torch.nn.Module):
        def forward(self, x):
            return x.new_ones(x.shape[1] ** 2) * 3

    length = torch.export.Dim("length", min=2, max=64)
    program = torch.export.export(Square(), (torch.rand(2, 6),), dynamic_shapes=({1: length},))
    nodes = [n for n in program.graph_module.graph.nodes if n.target is operator.pow]
    assert len(nodes) == 1
    with pytest.raises(Exception, match="pow"):
        ov.convert_model(program)
    assert entry.func(program.graph_module, nodes[0]) is True
    program.graph_module.recompile()
    targets = [n.target for n in program.graph_module.graph.nodes]
    assert operator.pow not in targets and targets.count(operator.mul) == 1
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    for n in (3, 7):
        np.testing.assert_array_equal(
            compiled(np.random.rand(2, n).astype(np.float32))[0], np.full(n * n, 3.0)
        )


def test_a_decomposed_program_reaches_the_frontend_as_its_graph_not_for_a_second_retrace():
    """decompose_like_openvino's result goes to convert_model as the frontend's FX decoder (no second
    run_decompositions); any other program goes as it is. Both convert to the same numbers."""
    import openvino as ov
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    from hfexport_openvino.decompositions import decompose_like_openvino, frontend_input

    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.silu(x @ x.transpose(-1, -2)).mean(-1)

    length = torch.export.Dim("length", min=2, max=64)
    program = torch.export.export(Net(), (torch.rand(2, 6, 3),), dynamic_shapes=({1: length},))
    assert frontend_input(program) is program
    decomposed = decompose_like_openvino(program)
    decoder = frontend_input(decomposed)
    assert isinstance(decoder, TorchFXPythonDecoder)
    x = np.random.rand(2, 9, 3).astype(np.float32)
    expected = Net()(torch.from_numpy(x)).numpy()
    for model in (program, decoder):
        compiled = ov.Core().compile_model(
            ov.convert_model(model), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        np.testing.assert_allclose(compiled(x)[0], expected, rtol=1e-5)


def test_complex_rotary_converts_as_real_pairs_and_matches_eager_at_two_shapes():
    """aten.polar has no OpenVINO conversion (deepseek_v2, llama4 failed in convert); the program fix
    rewrites the complex rotary into real pairs and the IR matches eager at two shapes."""
    from hfexport.testing.programs import ComplexRotary

    (entry,) = [e for e in entries("openvino") if e.name.endswith("complex_rotary_as_real_pairs")]
    assert entry.versions == {"openvino": ">=2026.0"} and "op_support.py" in entry.issue
    model = ComplexRotary().eval()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    exporter = OpenvinoExporter()
    exporter.export(model, {"input_ids": ids}, OpenvinoConfig(dynamic=True))
    report = exporter.last_report
    assert any(n.endswith("complex_rotary_as_real_pairs") for n in report.applied["fx_program_fixes"])
    rows = report.validation["sample"] + report.validation["second_shape"]
    assert len(rows) == 2 and all(float(r["max_abs_diff"]) <= 1e-5 for r in rows), rows


def test_precision_hint_is_recorded_and_used_by_the_runner(tiny_encoder, tmp_path):
    import openvino as ov

    from hfexport_openvino import OpenvinoRunner

    model, inputs = tiny_encoder
    exporter = OpenvinoExporter()
    ov_model = exporter.export(model, inputs, OpenvinoConfig(inference_precision_hint="f32", validate=False))
    exporter.save(ov_model, tmp_path / "openvino_model.xml")
    runner = OpenvinoRunner(tmp_path / "openvino_model.xml")
    assert runner.precision_hint == "f32"
    runner(inputs)
    assert runner._request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32


def test_fully_masked_sdpa_rows_stay_finite():
    """openvino#35959: a boolean SDPA mask with an all-False row gives NaN in OpenVINO; the fix keeps it finite."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("finite_sdpa_mask")]
    assert entry.issue == "https://github.com/openvinotoolkit/openvino/issues/35959"

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([[[[False, False, False], [True, False, False], [True, True, False]]]])
    program = torch.export.export(Attention(), (q, k, v, mask))
    feed = [t.numpy() for t in (q, k, v, mask)]
    unfixed = ov.Core().compile_model(ov.convert_model(program), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.isnan(unfixed(feed)[0][0, 0, 0]).all()  # the upstream fault: once it is gone, retire the fix
    node = next(n for n in program.graph_module.graph.nodes if "scaled_dot_product" in str(n.target))
    assert entry.func(program.graph_module, node) is True
    program.graph_module.recompile()
    fixed = ov.Core().compile_model(ov.convert_model(program), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out = fixed(feed)[0]
    assert np.isfinite(out).all()
    expected = Attention()(q, k, v, mask).numpy()
    np.testing.assert_allclose(out[0, 0, 1:], expected[0, 0, 1:], atol=1e-6)


@pytest.mark.parametrize(("dim", "size", "step"), [(-2, 4, 4), (1, 3, 2), (2, 2, 1)])
def test_unfold_fix_lets_openvino_convert_patch_extraction(dim, size, step):
    """patchtst / patchtsmixer extract patches with Tensor.unfold, which OpenVINO's frontend cannot
    convert; the fix gathers the window positions (index_select, view, permute), same values, and
    the batch stays dynamic."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("unfold_as_gather")]
    assert entry.versions == {"openvino": ">=2026.0"} and entry.issue.startswith("https://github.com/")

    class Patches(torch.nn.Module):
        def forward(self, x):
            return x.unfold(dim, size, step) * 2

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Patches(), (torch.rand(2, 10, 3),), dynamic_shapes=({0: batch},))
    nodes = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.unfold.default]
    assert len(nodes) == 1
    assert entry.func(program.graph_module, nodes[0]) is True
    program.graph_module.recompile()
    assert not [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.unfold.default]
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    for b in (2, 5):
        x = torch.rand(b, 10, 3)
        np.testing.assert_allclose(compiled(x.numpy())[0], (x.unfold(dim, size, step) * 2).numpy(), rtol=1e-6)


def test_unfold_fix_leaves_a_symbolic_unfolded_axis_alone():
    (entry,) = [e for e in entries("openvino") if e.name.endswith("unfold_as_gather")]

    class Patches(torch.nn.Module):
        def forward(self, x):
            return x.unfold(1, 2, 2)

    length = torch.export.Dim("length", min=4, max=64)
    program = torch.export.export(Patches(), (torch.rand(2, 10, 3),), dynamic_shapes=({1: 2 * length},))
    (node,) = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.unfold.default]
    assert entry.func(program.graph_module, node) is False  # the window count would be symbolic


class _ScaledEmbedding(torch.nn.Embedding):
    """Gemma 3's scaled word embedding in small: a lookup times a constant (non-persistent) buffer."""

    def __init__(self) -> None:
        super().__init__(32, 8)
        self.embed_scale = torch.nn.Buffer(torch.tensor(8.0**0.5), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"output": super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)}


def test_an_output_folded_into_its_producer_keeps_its_recorded_name():
    """issue 28: compiling folds the scale into the lookup table and the output port carries the
    producer's tensor name as well; the runner must return it under the recorded name ("output"),
    not get_any_name()'s internal one (gemma3's embed_tokens failed validation as missing)."""
    torch.manual_seed(0)
    model = _ScaledEmbedding().eval()
    exporter = OpenvinoExporter()
    ids = torch.randint(0, 32, (2, 5))
    ov_model = exporter.export(model, {"input_ids": ids}, OpenvinoConfig(dynamic=True))
    assert {s.name: s.status for s in exporter.last_report.stages}["validate"] == "ok"
    other = torch.randint(0, 32, (3, 9))
    got = exporter.runner(ov_model)({"input_ids": other})
    assert list(got) == ["output"]
    with torch.no_grad():
        torch.testing.assert_close(got["output"], model(other)["output"], atol=1e-6, rtol=0)


class _FirstColumnSqueezed(torch.nn.Module):
    """mBART's ``shift_tokens_right`` in small: a ``[batch, 1]`` gather squeezed without naming the axis."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        last = (ids.ne(0).sum(dim=1) - 1).unsqueeze(-1)
        return ids.gather(1, last).squeeze() * 3


def test_squeeze_fix_names_the_static_unit_axes_so_a_dynamic_batch_runs():
    """issue 28: OpenVINO's Squeeze takes the dynamic batch axis of an axis-less squeeze as one that may
    be 1 and fails at inference on a batch of 2 ("Can not clone with new dims"); mBART's and PLBart's
    text classification failed validation so. The fix names the axes the traced program drops."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("squeeze_static_unit_axes")]
    assert entry.versions == {"openvino": ">=2026.0"} and entry.issue.startswith("https://github.com/")
    batch = torch.export.Dim("batch", min=2, max=64)
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    program = torch.export.export(_FirstColumnSqueezed(), (ids,), dynamic_shapes=({0: batch, 1: None},))
    program = program.run_decompositions()
    (node,) = [n for n in program.graph_module.graph.nodes if "aten.squeeze" in str(n.target)]
    assert entry.func(program.graph_module, node) is True
    assert (node.target, node.args[1]) == (torch.ops.aten.squeeze.dims, [1])
    program.graph_module.recompile()
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    for rows in (ids, torch.tensor([[4, 0, 0, 0], [5, 6, 0, 0], [7, 8, 9, 10]])):
        np.testing.assert_array_equal(compiled(rows.numpy())[0], _FirstColumnSqueezed()(rows).numpy())


def test_squeeze_fix_leaves_a_squeeze_of_static_axes_alone():
    (entry,) = [e for e in entries("openvino") if e.name.endswith("squeeze_static_unit_axes")]

    class Static(torch.nn.Module):
        def forward(self, x):
            return x.squeeze()

    program = torch.export.export(Static(), (torch.rand(1, 4, 1),))
    (node,) = [n for n in program.graph_module.graph.nodes if "aten.squeeze" in str(n.target)]
    assert entry.func(program.graph_module, node) is False  # no symbolic axis: nothing OpenVINO misreads


class _WidthZeroCache(torch.nn.Module):
    """A cache of values of width 0 (GLM-5-Next's indexed attention) extended by one step's values."""

    def forward(self, past: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([past, step[..., :0]], dim=2), step * 2


def test_empty_cat_fix_keeps_the_joined_length_of_a_width_zero_cache():
    """issue 28: OpenVINO's Concat leaves out inputs with no elements, so GLM-5-Next's decode step
    returned its width-0 value cache one token short (1x1x12x0 for eager's 1x1x13x0); the fix writes
    a cat with no elements as zeros of its size."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("empty_cat_as_zeros")]
    assert entry.versions == {"openvino": ">=2026.0"} and entry.issue.startswith("https://github.com/")
    past, step = torch.zeros(1, 1, 12, 0), torch.rand(1, 1, 1, 4)
    shapes = ({2: torch.export.Dim("length", min=2, max=512)}, None)

    def lengths(program: torch.export.ExportedProgram) -> list[int]:
        compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
        return [compiled([torch.zeros(1, 1, n, 0).numpy(), step.numpy()])[0].shape[2] for n in (12, 5)]

    program = torch.export.export(_WidthZeroCache(), (past, step), dynamic_shapes=shapes)
    assert lengths(program) == [12, 5]  # the upstream behaviour: the step's empty values are dropped
    program = torch.export.export(_WidthZeroCache(), (past, step), dynamic_shapes=shapes)
    (node,) = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert entry.func(program.graph_module, node) is True
    program.graph_module.recompile()
    assert lengths(program) == [13, 6]

    # a cat with elements is left alone
    class Cat(torch.nn.Module):
        def forward(self, past: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
            return torch.cat([past, step], dim=2)

    other = torch.export.export(Cat(), (torch.zeros(1, 1, 12, 4), step))
    (node,) = [n for n in other.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert entry.func(other.graph_module, node) is False


def test_index_add_fix_lets_openvino_convert_a_temporal_merge():
    """issue 28: Kimi-K2.5's one-grid image encoder merges its patches with index_add, which
    OpenVINO's torch.export frontend failed to convert (openvinotoolkit/openvino#35628); the fix
    writes it as scatter_add over the expanded index."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("index_add_as_scatter_add")]

    class Merge(torch.nn.Module):
        def forward(self, x):
            index = torch.tensor([2, 0, 1, 2, 0, 3])
            return x.new_zeros(4, x.shape[1]).index_add(0, index, x * 2)

    x = torch.rand(6, 5)
    program = torch.export.export(Merge(), (x,))
    nodes = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.index_add.default]
    assert len(nodes) == 1
    with pytest.raises(Exception, match="index_add"):
        ov.convert_model(program)
    assert entry.func(program.graph_module, nodes[0]) is True
    program.graph_module.recompile()
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU")
    np.testing.assert_allclose(compiled(x.numpy())[0], Merge()(x).numpy(), rtol=1e-6, atol=1e-6)


def test_antialiased_bilinear_fix_lets_openvino_convert_a_position_grid_resize():
    """issue 28: Cosmos3-Edge's one-grid image encoder resizes its learned position grid with
    F.interpolate(antialias=True); OpenVINO's torch.export frontend has no rule for
    aten._upsample_bilinear2d_aa. The fix writes it as two products with the filter weights."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("antialiased_bilinear_as_matmuls")]

    class Resize(torch.nn.Module):
        def __init__(self, size):
            super().__init__()
            self.size = size

        def forward(self, x):
            return torch.nn.functional.interpolate(x, size=self.size, mode="bilinear", antialias=True) * 2

    for size in ((3, 5), (11, 4)):  # shrinking and growing
        model, x = Resize(size), torch.rand(1, 3, 8, 6)
        # the node fixes see the decomposed graph (the exporter decomposes before them)
        program = torch.export.export(model, (x,)).run_decompositions()
        target = torch.ops.aten._upsample_bilinear2d_aa.default
        nodes = [n for n in program.graph_module.graph.nodes if n.target is target]
        assert len(nodes) == 1
        with pytest.raises(Exception, match="_upsample_bilinear2d_aa"):
            ov.convert_model(program)
        assert entry.func(program.graph_module, nodes[0]) is True
        program.graph_module.recompile()
        # f32 inference (the CPU plugin may otherwise compute the products in bf16)
        compiled = ov.Core().compile_model(
            ov.convert_model(program), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        np.testing.assert_allclose(compiled(x.numpy())[0], model(x).numpy(), rtol=1e-5, atol=1e-6)


class _StreamsFlattened(torch.nn.Module):
    """GLM-5-Next's hyper-connection input: ``[batch, seq, 4, 64]`` streams viewed as ``[batch, seq, -1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fn = torch.nn.Parameter(torch.randn(24, 256))

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        batch, seq = embeds.shape[:2]
        streams = embeds.unsqueeze(2).expand(-1, -1, 4, -1).contiguous()
        return torch.nn.functional.linear(streams.view(batch, seq, -1), self.fn)


def test_view_fix_writes_the_static_size_of_the_inferred_axis():
    """issue 28: OpenVINO inferred GLM-5-Next's hyper-connection streams.view(batch, seq, -1) as
    [?, ?, 1] in its language model and convert failed a MatMul check; the fix writes the traced
    static size instead of -1 (the program is the same). The frontend's misreading needs the whole
    language model to show; here: the rewrite, a symbolic -1 left alone, and the converted values."""
    import openvino as ov

    (entry,) = [e for e in entries("openvino") if e.name.endswith("view_sizes_without_inferred_static_axis")]
    assert entry.versions == {"openvino": ">=2026.0"} and entry.issue.startswith("https://github.com/")
    dims = {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=1024)}
    embeds = torch.randn(2, 5, 64)
    program = torch.export.export(_StreamsFlattened(), (embeds,), dynamic_shapes=(dims,))
    (node,) = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.aten.view.default]
    assert -1 in node.args[1]
    assert entry.func(program.graph_module, node) is True
    assert node.args[1][-1] == 256 and -1 not in node.args[1]
    assert entry.func(program.graph_module, node) is False  # nothing left to write

    class Symbolic(torch.nn.Module):
        def forward(self, x):
            return x.view(x.shape[0], -1)

    flat = torch.export.export(Symbolic(), (torch.randn(2, 6),), dynamic_shapes=({1: torch.export.Dim("n")},))
    (view,) = [n for n in flat.graph_module.graph.nodes if n.target is torch.ops.aten.view.default]
    assert entry.func(flat.graph_module, view) is False  # the -1 axis is symbolic: left to the runtime
    program.graph_module.recompile()
    compiled = ov.Core().compile_model(ov.convert_model(program), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    for rows in (embeds, torch.randn(3, 7, 64)):
        want = program.module()(rows).detach().numpy()
        np.testing.assert_allclose(compiled(rows.numpy())[0], want, rtol=1e-5, atol=1e-5)
