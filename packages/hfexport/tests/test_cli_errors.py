"""CLI and config errors (issue 14 items 7, 10, 11, 16; issue 10 start-up cost).

Each bad input is checked for its error type or exit code and the first line of its message;
usage errors must come before torch is imported; library noise must stay off the terminal.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfexport import cli_logging
from hfexport.cli import app
from hfexport.config import (
    ONNX_MIN_OPSET,
    ONNX_STATIC_MAX_OPSET,
    DynamoConfig,
    ExecutorchConfig,
    OnnxConfig,
    onnx_opset_range,
)

runner = CliRunner()


@pytest.fixture(autouse=True)
def _cli_log_in_tmp(tmp_path, monkeypatch):
    """In-process CLI runs log to the test's folder, not the user's ~/.local/state."""
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(tmp_path / "cli-test.log"))


def _invoke(args: list[str]):
    """Run the CLI in-process, wide enough that rich does not wrap paths inside words."""
    return runner.invoke(app, args, env={"COLUMNS": "2000"})


# lines torch printed on every CLI run before the fix (see hfexport.cli_logging.NOISY_LOGGERS)
NOISE = ("is an Enum subclass", "torchvision is not installed", "DeprecationWarning", "FutureWarning")


def _text(result_output: str) -> str:
    """CLI output without rich's box drawing and line wrapping."""
    for ch in "│╭╮╰╯─":
        result_output = result_output.replace(ch, " ")
    return " ".join(result_output.split())


# --------------------------------------------------------------------------------------------------
# item 7: tolerances
# --------------------------------------------------------------------------------------------------
TOL_ALLOWED = "is invalid; allowed: a finite, non-negative float or None"


@pytest.mark.parametrize("cls", [DynamoConfig, OnnxConfig, ExecutorchConfig])
@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("atol", math.nan, "nan"),
        ("rtol", math.nan, "nan"),
        ("atol", math.inf, "inf"),
        ("rtol", math.inf, "inf"),
        ("rtol", -math.inf, "-inf"),
        ("rtol", -1e-3, "-0.001"),
    ],
)
def test_non_finite_or_negative_tolerance_is_rejected_at_construction(cls, field, value, shown):
    with pytest.raises(ValueError) as info:
        cls(**{field: value})
    assert str(info.value) == f"{field}={shown} {TOL_ALLOWED}"


def test_non_finite_tolerance_is_rejected_from_json_dict_and_replace():
    with pytest.raises(ValueError, match=r"^atol=nan is invalid"):
        DynamoConfig.from_json_string('{"export_format": "dynamo", "atol": NaN}')
    with pytest.raises(ValueError, match=r"^rtol=inf is invalid"):
        OnnxConfig.from_dict({"rtol": float("inf")})
    with pytest.raises(ValueError, match=r"^rtol=inf is invalid"):
        DynamoConfig().replace(rtol=math.inf)
    ok = DynamoConfig(atol=0, rtol=0.0)
    assert (ok.atol, ok.rtol) == (0, 0.0)


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        (["--atol", "nan"], f"Invalid value for --atol: atol=nan {TOL_ALLOWED}"),
        (["--rtol", "inf"], f"Invalid value for --rtol: rtol=inf {TOL_ALLOWED}"),
        (["--rtol=-0.5"], f"Invalid value for --rtol: rtol=-0.5 {TOL_ALLOWED}"),
    ],
)
def test_cli_bad_tolerance_is_a_usage_error(tmp_path, args, first_line):
    result = _invoke(["export", "dynamo", str(tmp_path / "out"), "--model", "tiny:bert", *args])
    assert result.exit_code == 2, result.output
    assert first_line in _text(result.output)
    assert not (tmp_path / "out").exists()


def test_cli_rtol_reaches_the_config(tmp_path, monkeypatch):
    import hfexport.auto

    seen = []

    def capture(config):
        seen.append(config)
        raise RuntimeError("stop after the config")

    monkeypatch.setattr(hfexport.auto.AutoHfExporter, "from_config", staticmethod(capture))
    result = _invoke(
        ["export", "dynamo", str(tmp_path / "out"), "--model", "tiny:bert", "--atol", "1e-30", "--rtol", "0"]
    )
    assert result.exit_code == 1, result.output
    assert "export failed in stage 'setup': RuntimeError: stop after the config" in _text(result.output)
    assert (seen[0].atol, seen[0].rtol) == (1e-30, 0.0)


# --------------------------------------------------------------------------------------------------
# item 10: opset range
# --------------------------------------------------------------------------------------------------
def test_opset_range_is_the_installed_onnxscript_converters():
    from onnxscript.version_converter import _version_converter

    lowest, highest, source = onnx_opset_range()
    assert (lowest, highest) == (ONNX_MIN_OPSET, _version_converter.SUPPORTED_MAX_ONNX_OPSET)
    assert source.startswith("the opsets the installed onnxscript ")
    assert OnnxConfig(opset_version=highest).opset_version == highest
    assert OnnxConfig(opset_version=ONNX_MIN_OPSET).opset_version == ONNX_MIN_OPSET


@pytest.mark.parametrize("opset", [99, 10**6, 17, 0, -18])
def test_opset_outside_the_range_is_rejected(opset):
    lowest, highest, source = onnx_opset_range()
    with pytest.raises(ValueError) as info:
        OnnxConfig(opset_version=opset)
    assert str(info.value).startswith(
        f"opset_version={opset} is invalid; allowed: an int from {lowest} to {highest} ({source}) or None"
    )
    with pytest.raises(ValueError, match=rf"^opset_version={opset} is invalid"):
        OnnxConfig.from_dict({"opset_version": opset})


def test_opset_just_above_the_range_is_rejected_and_a_string_too():
    _, highest, _ = onnx_opset_range()
    with pytest.raises(ValueError, match=rf"^opset_version={highest + 1} is invalid; allowed: an int from"):
        OnnxConfig(opset_version=highest + 1)
    with pytest.raises(ValueError, match=r"^opset_version='20' is invalid; allowed: an int from"):
        OnnxConfig(opset_version="20")


def test_opset_range_without_onnxscript_uses_the_static_bound(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a)
    )
    monkeypatch.delitem(sys.modules, "onnxscript.version_converter._version_converter", raising=False)
    onnx_opset_range.cache_clear()
    try:
        assert onnx_opset_range() == (ONNX_MIN_OPSET, ONNX_STATIC_MAX_OPSET, "onnxscript is not installed")
        assert OnnxConfig(opset_version=ONNX_STATIC_MAX_OPSET).opset_version == ONNX_STATIC_MAX_OPSET
        with pytest.raises(ValueError) as info:
            OnnxConfig(opset_version=ONNX_STATIC_MAX_OPSET + 1)
        assert str(info.value).startswith(
            f"opset_version={ONNX_STATIC_MAX_OPSET + 1} is invalid; allowed: an int from 18 to "
            f"{ONNX_STATIC_MAX_OPSET} (onnxscript is not installed) or None"
        )
    finally:
        onnx_opset_range.cache_clear()


def test_config_opset_check_imports_neither_torch_nor_onnxscript():
    code = (
        "import sys; from hfexport.config import OnnxConfig, onnx_opset_range\n"
        "OnnxConfig(opset_version=20)\n"
        "try:\n    OnnxConfig(opset_version=99)\nexcept ValueError as e:\n    print(e)\n"
        "print(sorted(m for m in ('torch', 'onnxscript', 'onnx', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first, modules = out.strip().splitlines()
    assert first.startswith("opset_version=99 is invalid; allowed: an int from 18 to ")
    assert modules == "[]"


def test_cli_opset_out_of_range_is_a_usage_error(tmp_path):
    _, highest, _ = onnx_opset_range()
    result = _invoke(["export", "onnx", str(tmp_path / "out"), "--model", "tiny:bert", "--opset", "99"])
    assert result.exit_code == 2, result.output
    assert (
        f"Invalid value for --opset: opset_version=99 is invalid; allowed: an int from 18 to {highest}"
        in _text(result.output)
    )


# --------------------------------------------------------------------------------------------------
# item 11: generate
# --------------------------------------------------------------------------------------------------
def _generation_folder(tmp_path: Path, *, vocab_in: str = "config", vocab_size: int = 10) -> Path:
    """A folder that passes the CLI's checks but whose component files are missing."""
    folder = tmp_path / "gen"
    folder.mkdir()
    manifest = {
        "manifest_version": 1,
        "format": "dynamo",
        "architecture": "decoder",
        "files": {"prefill": "prefill.pt2", "decode": "decode.pt2"},
    }
    if vocab_in == "manifest":
        manifest["vocab_size"] = vocab_size
    (folder / "generation_manifest.json").write_text(json.dumps(manifest))
    config = {"model_type": "llama"}
    if vocab_in == "config":
        config["vocab_size"] = vocab_size
    elif vocab_in == "text_config":
        config["text_config"] = {"vocab_size": vocab_size}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_generate_missing_folder_is_a_usage_error(tmp_path):
    missing = tmp_path / "nope"
    result = _invoke(["generate", str(missing), "--input-ids", "1,2"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for OUTPUT_DIR: {missing} does not exist" in _text(result.output)


def test_generate_folder_without_manifest_is_a_usage_error(tmp_path):
    result = _invoke(["generate", str(tmp_path), "--input-ids", "1,2"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for OUTPUT_DIR: {tmp_path} holds no generation_manifest.json; export one with" in (
        _text(result.output)
    )
    (tmp_path / "generation_manifest.json").write_text("{not json")
    result = _invoke(["generate", str(tmp_path), "--input-ids", "1,2"])
    assert result.exit_code == 2, result.output
    assert (
        f"Invalid value for OUTPUT_DIR: {tmp_path / 'generation_manifest.json'} cannot be read as JSON"
        in (_text(result.output))
    )


@pytest.mark.parametrize("value", ["0", "-1"])
def test_generate_max_new_tokens_below_one_is_a_usage_error(tmp_path, value):
    folder = _generation_folder(tmp_path)
    result = _invoke(["generate", str(folder), "--input-ids", "1", f"--max-new-tokens={value}"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --max-new-tokens: must be at least 1, got {value}" in _text(result.output)


@pytest.mark.parametrize(
    ("ids", "first_line"),
    [
        ("", "Invalid value for --input-ids: gives no token ids; pass at least one"),
        (",", "Invalid value for --input-ids: gives no token ids; pass at least one"),
        ("-1,2", "Invalid value for --input-ids: token ids must be >= 0, got [-1]"),
        ("1,x", "Invalid value for --input-ids: takes comma-separated integers, e.g. 1,2,3"),
        (
            "3,10,12",
            "Invalid value for --input-ids: token ids [10, 12] are outside the vocabulary [0, 10) "
            "of the exported model",
        ),
    ],
)
def test_generate_bad_ids_are_usage_errors(tmp_path, ids, first_line):
    folder = _generation_folder(tmp_path)
    result = _invoke(["generate", str(folder), f"--input-ids={ids}"])
    assert result.exit_code == 2, result.output
    assert first_line in _text(result.output)


@pytest.mark.parametrize("vocab_in", ["manifest", "text_config"])
def test_generate_reads_the_vocabulary_from_manifest_or_text_config(tmp_path, vocab_in):
    folder = _generation_folder(tmp_path, vocab_in=vocab_in, vocab_size=5)
    result = _invoke(["generate", str(folder), "--input-ids", "4,5"])
    assert result.exit_code == 2, result.output
    assert "token ids [5] are outside the vocabulary [0, 5)" in _text(result.output)


def test_generate_failure_is_one_message_and_traceback_only_with_verbose(tmp_path):
    folder = _generation_folder(tmp_path)
    result = _invoke(["generate", str(folder), "--input-ids", "1,2", "--max-new-tokens", "2"])
    assert result.exit_code == 1, result.output
    failed = [line for line in result.output.splitlines() if line.startswith("generate failed: ")]
    assert len(failed) == 1, result.output
    assert failed[0].startswith("generate failed: ValueError: ")
    assert "names component files that are missing: ['prefill.pt2', 'decode.pt2']" in _text(result.output)
    assert "rerun with -v for the traceback" in _text(result.output)
    assert "Traceback" not in result.output
    result = _invoke(["generate", str(folder), "--input-ids", "1,2", "-v"])
    assert result.exit_code == 1, result.output
    assert any(line.startswith("generate failed: ValueError: ") for line in result.output.splitlines())
    assert "Traceback" in result.output


# --------------------------------------------------------------------------------------------------
# start-up: argument handling before torch
# --------------------------------------------------------------------------------------------------
_IN_SUBPROCESS = """
import json, sys, time
t0 = time.perf_counter()
from hfexport.cli import app
try:
    app(sys.argv[2:], prog_name="hfexport")
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "onnxscript") if m in sys.modules)
with open(sys.argv[1], "w") as fh:
    json.dump({"code": code, "heavy": heavy, "seconds": time.perf_counter() - t0}, fh)
"""


def _run_cli(tmp_path: Path, *args: str) -> tuple[dict, str]:
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-c", _IN_SUBPROCESS, str(result_file), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    return json.loads(result_file.read_text()), proc.stdout + proc.stderr


def test_cli_module_import_does_not_import_torch():
    code = "import hfexport.cli, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["--help"], 0, "Usage: hfexport"),
        (["export", "--help"], 0, "--rtol"),
        (["generate", "--help"], 0, "--verbose"),
        (["export", "dynamo", "OUT", "--model", "tiny:bert", "--bogus"], 2, "No such option: --bogus"),
        (
            ["export", "onnx", "OUT", "--model", "tiny:bert", "--opset", "abc"],
            2,
            "Invalid value for '--opset'",
        ),
        (
            ["export", "onnx", "OUT", "--model", "tiny:bert", "--opset", "99"],
            2,
            "opset_version=99 is invalid",
        ),
        (["export", "dynamo", "OUT", "--model", "tiny:bert", "--atol", "nan"], 2, "atol=nan is invalid"),
        (["export", "dynamo", "--model", "tiny:bert"], 2, "Missing argument 'OUTPUT_DIR'"),
        (["generate", "GEN", "--input-ids", "1", "--max-new-tokens", "0"], 2, "must be at least 1, got 0"),
        (["generate", "MISSING", "--input-ids", "1"], 2, "does not exist"),
        (
            ["export", "dynamo", "OUT", "--model", "MISSING"],
            2,
            "does not exist; allowed: a local model folder",
        ),
        (
            ["export", "dynamo", "OUT", "--model", "tiny:bert", "--task", "bogus"],
            2,
            "unknown task 'bogus'; allowed",
        ),
        (["generate", "GEN", "--input-ids", "1,99"], 2, "outside the vocabulary [0, 10)"),
    ],
)
def test_help_and_usage_errors_do_not_import_torch(tmp_path, args, code, expected):
    folder = _generation_folder(tmp_path)
    names = {"OUT": str(tmp_path / "out"), "GEN": str(folder), "MISSING": str(tmp_path / "missing")}
    result, output = _run_cli(tmp_path, *[names.get(a, a) for a in args])
    assert result["code"] == code, output
    assert expected in _text(output)
    assert result["heavy"] == [], f"{args} imported {result['heavy']} ({result['seconds']:.2f}s)"
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# item 16: library noise goes to the log, -v shows it
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    state = (list(root.handlers), root.level, warnings.showwarning)
    yield
    cli_logging.restore_cli_logging()
    root.handlers[:] = state[0]
    root.setLevel(state[1])
    warnings.showwarning = state[2]


def test_setup_routes_third_party_records_and_warnings_to_the_log(
    tmp_path, monkeypatch, capsys, restore_logging
):
    from hfexport.environment import VersionDriftWarning

    log = tmp_path / "cli.log"
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(log))
    assert cli_logging.setup_cli_logging(verbose=False) == log
    logging.getLogger("torch.utils._pytree").warning("<enum 'X'> is an Enum subclass (noise)")
    logging.getLogger("some.library").warning("third-party warning record")
    logging.getLogger("some.library").error("third-party error record")
    logging.getLogger("hfexport.capture").warning("our own warning")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's future change", FutureWarning, stacklevel=1)
        warnings.warn("installed versions differ", VersionDriftWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ERROR some.library: third-party error record",
        "WARNING hfexport.capture: our own warning",
        "WARNING py.warnings: VersionDriftWarning: installed versions differ",
    ]
    logged = log.read_text()
    assert "WARNING torch.utils._pytree: <enum 'X'> is an Enum subclass (noise)" in logged
    assert "WARNING some.library: third-party warning record" in logged
    assert "FutureWarning: a library's future change" in logged
    assert "our own warning" not in logged and "third-party error record" not in logged


def test_setup_verbose_shows_everything(tmp_path, monkeypatch, capsys, restore_logging):
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(tmp_path / "cli.log"))
    previous = warnings.showwarning
    assert cli_logging.setup_cli_logging(verbose=True) is None
    logging.getLogger("some.library").info("third-party info record")
    err = capsys.readouterr().err
    assert "INFO some.library: third-party info record" in err
    # torch's loggers print through their own handler, unfiltered
    assert not any(logging.getLogger(n).filters for n in cli_logging.NOISY_LOGGERS)
    assert warnings.showwarning is previous  # Python prints warnings as usual
    assert not (tmp_path / "cli.log").exists()


def test_restore_undoes_the_setup(tmp_path, monkeypatch, restore_logging):
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(tmp_path / "cli.log"))
    root = logging.getLogger()
    before = (list(root.handlers), root.level, warnings.showwarning)
    cli_logging.setup_cli_logging(verbose=False)
    assert warnings.showwarning is not before[2]
    assert logging.getLogger("torch.utils._pytree").filters
    cli_logging.restore_cli_logging()
    assert (list(root.handlers), root.level, warnings.showwarning) == before
    assert not any(logging.getLogger(n).filters for n in cli_logging.NOISY_LOGGERS)


def test_native_stderr_goes_to_the_log_while_routing_and_prints_otherwise(
    tmp_path, monkeypatch, capfd, restore_logging
):
    # what a C++ library writes to file descriptor 2 itself (ExecuTorch's cpuinfo lines)
    from hfexport import native_output

    log = tmp_path / "cli.log"
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(log))
    assert not native_output.is_routing()  # library use: nothing is redirected
    with native_output.captured_stderr("somelib"):
        os.write(2, b"[cpuinfo_utils.cpp:87] printed as a library prints it\n")
    assert "printed as a library prints it" in capfd.readouterr().err

    cli_logging.setup_cli_logging(verbose=False)
    assert native_output.is_routing()
    with native_output.captured_stderr("somelib"):
        os.write(
            2, b"[cpuinfo_utils.cpp:87] Failed to open midr file\n\n[cpuinfo_utils.cpp:125] dont match.\n"
        )
    os.write(2, b"after the call\n")  # fd 2 is back
    err = capfd.readouterr().err
    assert "cpuinfo_utils" not in err and "after the call" in err
    logged = log.read_text()
    assert "INFO somelib.native: [cpuinfo_utils.cpp:87] Failed to open midr file" in logged
    assert "INFO somelib.native: [cpuinfo_utils.cpp:125] dont match." in logged

    cli_logging.restore_cli_logging()
    assert not native_output.is_routing()
    assert logging.getLogger("somelib.native").level == logging.NOTSET
    with native_output.captured_stderr("somelib"):
        os.write(2, b"printed again\n")
    assert "printed again" in capfd.readouterr().err


def test_native_routers_follow_the_cli_setup(tmp_path, monkeypatch, restore_logging):
    from hfexport import native_output

    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(native_output, "_routers", {})
    native_output.register_native_router("early", lambda on: calls.append(("early", on)))
    assert calls == []  # registering does not touch the library
    cli_logging.setup_cli_logging(verbose=False)
    assert calls == [("early", True)]
    native_output.register_native_router(
        "late", lambda on: calls.append(("late", on))
    )  # a backend imported now
    assert calls[-1] == ("late", True)

    def broken(on: bool) -> None:
        raise RuntimeError("no such API in this version")

    native_output.register_native_router("broken", broken)  # logged at DEBUG, never raised
    cli_logging.setup_cli_logging(verbose=True)  # -v: the libraries print as usual
    assert calls[-2:] == [("early", False), ("late", False)]
    cli_logging.restore_cli_logging()
    assert len(calls) == 4


def test_transformers_right_padding_warning_goes_to_the_log(tmp_path, monkeypatch, restore_logging):
    # transformers prints through its own handler on the "transformers" logger (propagate=False): a
    # handler added there sees what reaches the terminal, whatever stream transformers bound
    from transformers.utils import logging as hf_logging

    class Recorder(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    log = tmp_path / "cli.log"
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(log))
    message = "A decoder-only architecture is being used, but right-padding was detected!"
    library = hf_logging.get_logger("transformers")
    recorder = Recorder()
    library.addHandler(recorder)
    try:
        cli_logging.setup_cli_logging(verbose=False)
        hf_logging.get_logger("transformers.generation.utils").warning(message)
        assert recorder.messages == []  # not printed by transformers' handler
        assert f"WARNING transformers.generation.utils: {message}" in log.read_text()
        cli_logging.setup_cli_logging(verbose=True)
        hf_logging.get_logger("transformers.generation.utils").warning(message)
        assert recorder.messages == [message]  # -v: printed as transformers prints it
    finally:
        library.removeHandler(recorder)


def _export_subprocess(tmp_path: Path, *args: str, log_name: str) -> tuple[subprocess.CompletedProcess, Path]:
    log = tmp_path / log_name
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TRANSFORMERS_VERBOSITY")}
    env[cli_logging.LOG_FILE_ENV] = str(log)
    proc = subprocess.run(
        [sys.executable, "-m", "hfexport.cli", "export", "dynamo", "--model", "tiny:bert", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    return proc, log


def _noise_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


@pytest.mark.slow
def test_successful_export_stderr_has_no_library_noise(tmp_path):
    proc, _ = _export_subprocess(tmp_path, str(tmp_path / "out"), log_name="ok.log")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.pt2").is_file()
    assert _noise_lines(proc.stderr) == []
    assert "torchvision" not in proc.stderr and "DeprecationWarning" not in proc.stderr


@pytest.mark.slow
def test_failing_export_hides_noise_and_verbose_shows_it(tmp_path):
    import torch
    from safetensors.torch import save_file

    # a failure after torch, transformers and torchao are imported: a folder
    # whose config.json names no model type fails while loading
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(broken / "model.safetensors"))
    args = ["--model", str(broken), str(tmp_path / "out")]
    proc, log = _export_subprocess(tmp_path, *args, log_name="fail.log")
    assert proc.returncode == 1, proc.stderr
    assert _text(proc.stderr).startswith(
        "export failed in stage 'load_model': ValueError: Unrecognized model"
    )
    assert _noise_lines(proc.stderr) == []
    assert "torchvision" not in proc.stderr and "DeprecationWarning" not in proc.stderr
    logged = _noise_lines(log.read_text()) if log.exists() else []
    verbose, _ = _export_subprocess(tmp_path, "-v", *args, log_name="verbose.log")
    assert verbose.returncode == 1, verbose.stderr
    assert "Traceback" in verbose.stderr
    # whatever the quiet run logged, the verbose run shows on the terminal
    for line in logged:
        message = line.split(": ", 1)[1]
        assert message in verbose.stderr, line


def test_usage_of_the_supervised_child_names_the_console_script():
    """The console script runs ``hfexport export`` in a child (``python -m hfexport.cli``); its usage
    and error boxes still say ``hfexport`` (new-user trial: they said ``python -m hfexport.cli``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hfexport.cli", "export", "dynamo", "--model", "tiny:bert"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "HFEXPORT_ISOLATE": "child"},
    )
    assert proc.returncode == 2
    assert "Usage: hfexport export [OPTIONS]" in proc.stdout + proc.stderr
    assert "python -m" not in proc.stdout + proc.stderr


def test_generate_inputs_with_a_tensor_no_component_takes_is_a_usage_error(tmp_path):
    # an unknown key of --inputs was silently ignored (a misspelt pixel_values gave a text-only run)
    import torch
    from safetensors.torch import save_file

    folder = _generation_folder(tmp_path)
    manifest = json.loads((folder / "generation_manifest.json").read_text())
    manifest["plan"] = {
        "architecture": "multimodal",
        "model_class": "Kosmos2ForConditionalGeneration",
        "components": ["image_encoder", "prefill", "decode"],
        "links": {"image_encoder": {"pixel_values": {"from": "prompt", "key": "pixel_values"}}},
        "step_inputs": {
            "prefill": {"image_embeds_position_mask": {"from": "prompt", "key": "image_embeds_position_mask"}}
        },
    }
    (folder / "generation_manifest.json").write_text(json.dumps(manifest))
    image = tmp_path / "image.safetensors"
    save_file(
        {"pixel_value": torch.zeros(1, 3, 4, 4), "image_embeds_position_mask": torch.zeros(1, 2)}, image
    )
    result = _invoke(["generate", str(folder), "--input-ids", "1,2", "--inputs", str(image)])
    assert result.exit_code == 2, result.output
    assert (
        f"Invalid value for --inputs: {image} holds ['pixel_value'], which no exported component of this "
        "Kosmos2ForConditionalGeneration takes; the components take: image_embeds_position_mask, pixel_values."
    ) in _text(result.output)
