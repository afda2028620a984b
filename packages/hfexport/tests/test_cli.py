"""The console script: `env` lists backends with versions and drift; bad input exits non-zero."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typer.testing import CliRunner

from hfexport import environment
from hfexport.capture import capture
from hfexport.cli import app
from hfexport.config import DynamoConfig
from hfexport.exporter import HfExporter
from hfexport.generation import exported_program_caller

runner = CliRunner()


def test_env_table_lists_every_backend():
    result = runner.invoke(app, ["env"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    for name in ("hfexport-dynamo", "hfexport-onnx", "hfexport-executorch", "torch 2.13"):
        assert name in result.output


def test_env_lists_each_backends_quantization_methods_and_dtypes():
    """`--quantize` points users at `hfexport env`: it shows every method with the options it reads."""
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    backends = {b["format"]: b for b in json.loads(result.output)["backends"]}
    assert list(backends["executorch"]["quantization"]) == ["8da4w", "int8-dynamic", "4w", "8w"]
    assert list(backends["onnx"]["quantization"]) == [
        "int8-dynamic",
        "int8-static",
        "int4-weight",
        "int8-weight",
    ]
    assert backends["onnx"]["quantization"]["int4-weight"]["options"] == (
        "group_size, embedding_bits, exclude, symmetric, accuracy_level"
    )
    assert list(backends["dynamo"]["quantization"]) == ["int8-weight"]
    assert backends["executorch"]["quantization"]["4w"]["options"] == "group_size, embedding_bits, exclude"
    assert backends["executorch"]["dtypes"] == ["float32", "float16", "bfloat16"]
    table = runner.invoke(app, ["env"], env={"COLUMNS": "240"}).output
    assert "quantization methods (hfexport export FORMAT --quantize METHOD)" in table
    assert "mixed_linear" in table and "MatMulNBits" in table


def test_env_json_reports_drift(monkeypatch):
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version", lambda d: "9.9.9" if d == "torch" else real(d))
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["torch"] == "9.9.9"
    backends = {b["format"]: b for b in data["backends"]}
    assert set(backends) == {"dynamo", "onnx", "executorch", "openvino"}
    for b in backends.values():
        if b["tested"].get("torch"):
            assert any(d.startswith("torch 9.9.9") for d in b["drift"]), b


def test_export_rejects_unknown_format_and_missing_model(tmp_path):
    result = runner.invoke(app, ["export", "tflite", str(tmp_path / "out"), "--model", "tiny:bert"])
    assert result.exit_code != 0
    assert "FORMAT must be one of dynamo, onnx, executorch, openvino" in " ".join(result.output.split())
    result = runner.invoke(
        app, ["export", "dynamo", str(tmp_path / "out"), "--model", str(tmp_path / "nope")]
    )
    assert result.exit_code == 2  # a usage error, before the backend is imported
    text = " ".join(result.output.split())  # rich wraps long lines
    assert (
        "Invalid value for --model" in text and "nope' does not exist; allowed: a local model folder" in text
    )
    assert not (tmp_path / "out" / "model.pt2").exists()


def test_generate_needs_exactly_one_prompt_kind(tmp_path):
    result = runner.invoke(app, ["generate", str(tmp_path)])
    assert result.exit_code != 0 and "exactly one of --prompt or --input-ids" in result.output


def test_validation_table_names_a_bare_tensor_output(monkeypatch):
    """A forward returning one tensor (the ExecuTorch llm-runner forward) has an empty leaf path;
    the table still names the row."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import hfexport.cli as cli

    buffer = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=buffer, width=200))
    row = {
        "name": "",
        "shape": [2, 8, 512],
        "max_abs_diff": 1.5e-6,
        "max_rel_diff": 2e-5,
        "atol": 1e-4,
        "ok": True,
    }
    cli._print_validation(SimpleNamespace(validation={"sample": [row]}, extra={}))
    text = buffer.getvalue()
    assert "output 0 (a bare tensor)" in text and "2x8x512" in text and "1.500e-06" in text


def test_quantization_options_fill_the_quantization_config(tmp_path, monkeypatch):
    # issue 12: every QuantizationConfig field has its export option (each with a method that reads it)
    import hfexport.checkpoints
    import hfexport.cli as cli

    made = []
    config_for = cli._config_for
    monkeypatch.setattr(cli, "_config_for", lambda *a, **k: made.append(config_for(*a, **k)) or made[-1])

    def stop(*args, **kwargs):
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(hfexport.checkpoints, "load_model", stop)
    args = ["export", "executorch", str(tmp_path / "out"), "--model", "tiny:gpt2", "--quantize", "8da4w"]
    args += ["--embedding-bits", "4", "--group-size", "64", "--quantize-exclude", "lm_head"]
    args += ["--quantize-exclude", "transformer.h.0.*"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "stop before loading" in " ".join(result.output.split())
    (config,) = made
    assert config.quantization.to_dict() == {
        "method": "8da4w",
        "group_size": 64,
        "embedding_bits": 4,
        "per_channel": True,
        "exclude": ["lm_head", "transformer.h.0.*"],
        "calibration": None,
        "num_calibration_samples": 32,
        "symmetric": None,
        "accuracy_level": None,
    }
    made.clear()
    result = runner.invoke(app, [*args[:7], "--embedding-bits", "8"])
    assert result.exit_code == 1 and made[0].quantization.embedding_bits == 8
    assert made[0].quantization.per_channel is True and made[0].quantization.exclude == ()

    made.clear()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n", encoding="utf-8")
    args = ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:gpt2", "--quantize", "int8-static"]
    args += ["--per-tensor", "--calibration", str(prompts), "--calibration-samples", "3"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "stop before loading" in " ".join(result.output.split())
    assert made[0].quantization.to_dict() == {
        "method": "int8-static",
        "group_size": None,
        "embedding_bits": None,
        "per_channel": False,
        "exclude": [],
        "calibration": str(prompts),
        "num_calibration_samples": 3,
        "symmetric": None,
        "accuracy_level": None,
    }

    made.clear()
    args = ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:gpt2", "--quantize", "int4-weight"]
    result = runner.invoke(app, [*args, "--asymmetric", "--accuracy-level", "0", "--group-size", "64"])
    assert result.exit_code == 1 and "stop before loading" in " ".join(result.output.split())
    assert made[0].quantization.symmetric is False and made[0].quantization.accuracy_level == 0
    assert made[0].quantization.group_size == 64


def test_ort_fusions_outside_the_targets_names_them_without_python_none(tmp_path):
    result = runner.invoke(
        app,
        ["export", "onnx", str(tmp_path / "out"), "--model", "tiny:bert", "--ort-fusions", "gpu"],
        env={"COLUMNS": "240", "NO_COLOR": "1"},
    )
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert (
        "Invalid value for --ort-fusions: 'gpu' is not a fusion target; --ort-fusions must be one of: "
        "cpu, cuda (or omit it for a graph without fused ops)"
    ) in text
    assert "None" not in text


def test_export_help_documents_the_quantization_options():
    result = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "240", "NO_COLOR": "1"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    assert (
        "--embedding-bits <4|8>" in text
        and "4 or 8 bits (executorch; onnx int4-weight: the bits of a tied LM head" in text
    )
    for option in ("--group-size", "--per-tensor", "--quantize-exclude", "--calibration-samples"):
        assert option in text


@dataclasses.dataclass
class _HalfToyConfig(DynamoConfig):
    export_format: str = "clihalf"


class _HalfToyExporter(HfExporter):
    """Core capture; the artifact is the ``ExportedProgram`` (float16 runs on CPU under torch); its
    file holds 200 kB of zeros, so the size line has something to show."""

    export_format = "clihalf"
    config_class = _HalfToyConfig
    artifact_filename = "model.toy"
    supported_dtypes = ("float32", "float16")

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def save(self, artifact, path):
        Path(path).write_bytes(bytes(200_000))


def test_generation_export_summary_shows_every_component_size_and_greedy_parity(tmp_path, monkeypatch):
    """The summary of a gated generation export (float16 here) has what a plain export's has: the
    quality table of every component (prefill too), the size line, and greedy parity vs
    model.generate; export_report.json records every component's report."""
    from hfexport import auto

    monkeypatch.setitem(auto._EXPORTERS, "clihalf", _HalfToyExporter)
    monkeypatch.setitem(auto._CONFIGS, "clihalf", _HalfToyConfig)
    out = tmp_path / "gen"
    args = ["export", "clihalf", str(out), "--model", "tiny:llama", "--task", "text-generation"]
    result = runner.invoke(app, [*args, "--dtype", "float16"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0, result.output

    saved = json.loads((out / "export_report.json").read_text())
    assert saved["components"] == ["prefill", "decode"]
    assert sorted(saved["component_reports"]) == ["decode", "prefill"]
    prefill = saved["component_reports"]["prefill"]
    assert prefill["component"] == "prefill" and prefill["validation"]["sample"][0]["kind"] == "quality"
    parity = saved["report"]["extra"]["greedy_parity"]  # the decode component's report
    assert saved["report"]["component"] == "decode" and "error" not in parity

    # quality of both components, each table titled with its component
    gates = "gated: mean per-vector cosine >= 0.99 (cosine)"
    assert f"quality vs fp32 eager: prefill, sample inputs ({gates}" in text
    assert f"quality vs fp32 eager: decode, sample inputs ({gates}" in text
    logits = next(r for r in prefill["validation"]["sample"] if r["name"] == "logits")
    assert f"{logits['cosine']:.4f}" in text and f"{logits['top1_agreement']:.4f}" in text

    # size: each component's file (200 kB) against the fp32 eager weights
    change = saved["size_change"]
    assert {name: c["bytes"] for name, c in change["components"].items()} == {
        "prefill": 200_000,
        "decode": 200_000,
    }
    eager_mb = change["eager_float32_bytes"] / 1e6
    ratio = 200_000 / change["eager_float32_bytes"]
    assert (
        f"size: fp32 eager weights {eager_mb:.1f} MB -> prefill 0.2 MB ({ratio:.2f}x), decode 0.2 MB "
        f"({ratio:.2f}x) (0.4 MB in all)"
    ) in text

    # greedy parity, as recorded
    if parity["tokens_equal"]:
        assert "greedy parity vs model.generate: tokens equal (16 of 16 new tokens)" in text
    else:
        row, index = parity["first_divergence"]
        assert (
            f"greedy parity vs model.generate: tokens differ; {parity['matching_prefix']} of 16 new tokens "
            f"equal, first divergence at new token {index} (row {row})"
        ) in text


def test_greedy_parity_and_size_lines_render_each_case():
    import hfexport.cli as cli

    differ = {
        "new_tokens": 16,
        "first_divergence": [1, 2],
        "matching_prefix": 2,
        "tokens_equal": False,
        "top1_agreement": 0.8333,
    }
    assert cli._greedy_parity_line(differ) == (
        "[bold]greedy parity[/] vs model.generate: tokens differ; 2 of 16 new tokens equal, first divergence "
        "at new token 2 (row 1); logits top-1 agreement 0.8333 over the steps run on the same prefix"
    )
    equal = {"new_tokens": 16, "first_divergence": None, "matching_prefix": 16, "tokens_equal": True}
    assert cli._greedy_parity_line(equal).endswith("tokens equal (16 of 16 new tokens)")
    failed = {"new_tokens": 16, "error": "RuntimeError: no decode"}
    assert cli._greedy_parity_line(failed).endswith("could not run (RuntimeError: no decode)")
    plain = {"eager_float32_bytes": 90_900_000, "artifact_bytes": 24_300_000, "ratio": 0.2673}
    assert cli._size_line(plain) == "[bold]size[/]: fp32 eager weights 90.9 MB -> artifact 24.3 MB (0.27x)"


def test_the_export_console_names_a_prompt_length_the_memory_budget_narrowed():
    # fresh-user trial (issue 28): ExecuTorch's memory budget narrowed tiny T5's prompt bound to 1024 and
    # the export's console said nothing; the limit is the smallest sequence bound over the components
    from types import SimpleNamespace

    from hfexport.cli import _sequence_limit_line

    def report(*axes):
        return SimpleNamespace(
            dynamic_axes=[dict(zip(("meaning", "max", "note"), a), status="dynamic") for a in axes]
        )

    encoder = report(("batch", 8, ""), ("sequence", 1024, "memory budget"))
    encoder.extra = {"memory_budget": {"budget_bytes": 2**30}}
    decode = report(("sequence", 4096, ""), ("decoder sequence", 4096, ""))
    line = _sequence_limit_line([encoder, decode])
    assert line.startswith("[bold]prompt length[/] up to 1024 tokens (memory budget)")
    assert "exceed the budget (1 GiB)" in line
    encoder.extra = {"memory_budget": {"budget_bytes": 4 * 2**30}}  # exported with --max-dynamic-bytes 4GiB
    assert "exceed the budget (4 GiB)" in _sequence_limit_line(
        [encoder]
    ) and "(e.g. 8GiB)" in _sequence_limit_line([encoder])
    assert "a larger --max-dynamic-bytes (e.g. 4GiB)" in line
    # no bounded sequence axis: nothing printed
    assert _sequence_limit_line([report(("sequence", None, ""))]) is None
    assert _sequence_limit_line([SimpleNamespace(dynamic_axes=None)]) is None


def test_the_export_console_names_every_prompt_bound_and_its_source():
    # fresh-user trial: the line was printed only for a bound the memory budget narrowed; tiny llama's
    # ExecuTorch prefill (planned at its 512 positions) and mllama's (9 tokens, from the capture's guards)
    # said nothing. The source comes from ExecuTorch's report.dynamic_bounds, else the axis note.
    from types import SimpleNamespace

    from hfexport.cli import _sequence_limit_line

    def component(limit, source=None, note=""):
        axes = [
            {
                "input": "input_ids",
                "axis": 1,
                "meaning": "sequence",
                "status": "dynamic",
                "max": limit,
                "note": note,
            }
        ]
        bounds = (
            {"axes": [{"input": "input_ids", "axis": 1, "max": limit, "source": source}]} if source else None
        )
        return SimpleNamespace(dynamic_axes=axes, dynamic_bounds=bounds, extra={})

    llama = [component(512, "config.max_position_embeddings"), component(512, "user")]
    assert _sequence_limit_line(llama) == (
        "[bold]prompt length[/] up to 512 tokens (config.max_position_embeddings): the model's maximum "
        "positions; a longer prompt is refused at run time"
    )
    mllama = [
        component(
            9, "user; narrowed to the input guards by sequence_bounds_from_input_guards", "model-bounded"
        ),
        component(512, "user"),
    ]
    assert _sequence_limit_line(mllama) == (
        "[bold]prompt length[/] up to 9 tokens (model-bounded): the capture's input guards bound it; a longer "
        "prompt is refused at run time"
    )
    t5 = [component(4096, "default sequence bound (the config declares no maximum positions)")]
    assert _sequence_limit_line(t5).startswith(
        "[bold]prompt length[/] up to 4096 tokens (default bound: the config declares no maximum positions); "
        "a longer one needs ExecutorchConfig(dynamic_shapes=...) with a larger Dim(max=...)"
    )
    # another backend's recorded range (no memory plan): named, not said to be refused
    assert _sequence_limit_line([component(9, note="model-bounded")]) == (
        "[bold]prompt length[/] up to 9 tokens (model-bounded): the capture's input guards bound it"
    )
    # ONNX MiniLM (README): the capture's range ends at the model's positions, named from config.json
    positions = {512: "config.max_position_embeddings"}
    assert _sequence_limit_line([component(512)], generation=False, positions=positions) == (
        "[bold]sequence length[/] up to 512 tokens (config.max_position_embeddings): the model's maximum positions"
    )
    assert _sequence_limit_line([component(512)], generation=False) == (
        "[bold]sequence length[/] up to 512 tokens (the captured program's range)"
    )
    assert _sequence_limit_line([component(1, "config.n_positions")], generation=False) == (
        "[bold]sequence length[/] up to 1 token (config.n_positions): the model's maximum positions; a longer "
        "sequence is refused at run time"
    )


def test_config_positions_names_every_maximum_position_attribute(tmp_path):
    from hfexport.cli import _config_positions

    assert _config_positions(tmp_path) == {}  # no config.json
    config = {"max_position_embeddings": 512, "text_config": {"max_position_embeddings": 128}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _config_positions(tmp_path) == {
        512: "config.max_position_embeddings",
        128: "config.text_config.max_position_embeddings",
    }
