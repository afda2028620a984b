"""Faults injected into real exports (issue 29): what a user is left with when an export dies.

Faults come from our own hook, :mod:`hfexport.faults` (``HFEXPORT_FAULT=<point>:<kind>``), never
from timing: SIGKILL at each stage boundary (the points a clean run's trace lists: every stage of
the report, the CLI's own steps ``load_model``, ``output_dir``, ``write_output``, ``swap``) and
before each rename of the output folder's swap; ``ENOSPC`` and ``EIO`` on every write into the
staging folder; ``MemoryError`` raised by a stage; ``KeyboardInterrupt`` in capture, lowering and
validation. For each:

- the previous output folder (and everything beside it) is byte-identical (:func:`disk_snapshot`);
- no staging folder, breadcrumb or temporary file survives (for SIGKILL: after the supervising
  CLI process cleaned up, or after the next run);
- the CLI exits non-zero with exactly one line naming the stage; a SIGKILLed export run without
  the supervisor (``HFEXPORT_ISOLATE=0``) is reported by the next run, naming the stage it died in;
- through the API, the model object is unchanged (:func:`model_fingerprint`).

The default run has a slice on dynamo with ``tiny:bert`` (in-process, one forked child for the
SIGKILL, under a minute); ``-m extended`` runs the whole matrix on every installed backend
(SIGKILLs as ``python -m hfexport.cli`` subprocesses, the other faults in-process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfexport import faults
from hfexport.cli import app
from hfexport.testing.snapshots import disk_snapshot, leftovers, model_fingerprint

pytestmark = [pytest.mark.integration]

runner = CliRunner()
BACKENDS = {
    "dynamo": "hfexport_dynamo",
    "onnx": "hfexport_onnx",
    "executorch": "hfexport_executorch",
    "openvino": "hfexport_openvino",
}
ENV = {"COLUMNS": "2000", "NO_COLOR": "1"}
LEFT = re.compile(r"hfexport-staging")


# --------------------------------------------------------------------------------------------------
# the working folder: a previous export and a user's file beside it
# --------------------------------------------------------------------------------------------------


def _workdir(tmp: Path) -> Path:
    from hfexport.integrity import write_checksums

    work = tmp / "work"
    good = work / "out"
    good.mkdir(parents=True)
    (good / "model.bin").write_bytes(b"a previous good artifact")
    (good / "config.json").write_text('{"model_type": "bert"}\n')
    (good / "export_report.json").write_text('{"export_format": "dynamo"}\n')
    write_checksums(good)
    (work / "notes.txt").write_text("the user's file\n")
    return work


def _args(fmt: str, work: Path) -> list[str]:
    return ["export", fmt, str(work / "out"), "--model", "tiny:bert"]


def _stage_lines(text: str, stage: str) -> list[str]:
    return [line for line in text.splitlines() if f"stage '{stage}'" in line]


def _assert_untouched(work: Path, before: dict) -> None:
    assert leftovers(work) == [], leftovers(work)
    assert disk_snapshot(work) == before


@pytest.fixture
def log_env(tmp_path, monkeypatch):
    log = tmp_path / "cli.log"
    monkeypatch.setenv("HFEXPORT_LOG_FILE", str(log))
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    monkeypatch.delenv(faults.TRACE_ENV, raising=False)
    return {**ENV, "HFEXPORT_LOG_FILE": str(log)}


def _invoke(args: list[str], fault: str | None, env: dict[str, str]):
    """The CLI in-process with ``HFEXPORT_FAULT=fault``; ``(exit code, stderr)``."""
    result = runner.invoke(app, args, env={**env, faults.FAULT_ENV: fault})
    return result.exit_code, result.stderr


def _check_raised(fmt: str, work: Path, fault: str, stage: str, env: dict[str, str]) -> list[str]:
    """One in-process CLI run with ``fault``; the problems found (empty when it behaved)."""
    before = disk_snapshot(work)
    code, err = _invoke(_args(fmt, work), fault, env)
    problems = []
    if code == 0:
        problems.append(f"{fault}: exit code 0")
    if len(_stage_lines(err, stage)) != 1:
        problems.append(f"{fault}: expected one line naming stage {stage!r}, got:\n{err}")
    if "Traceback" in err:
        problems.append(f"{fault}: a traceback reached the terminal:\n{err}")
    if leftovers(work) or disk_snapshot(work) != before:
        problems.append(f"{fault}: the folder changed; leftovers {leftovers(work)}")
    return problems


# --------------------------------------------------------------------------------------------------
# the hook itself
# --------------------------------------------------------------------------------------------------


def test_the_hook_is_inert_when_unset_and_refuses_a_malformed_fault(monkeypatch) -> None:
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    monkeypatch.delenv(faults.TRACE_ENV, raising=False)
    faults.reached("stage:capture")  # nothing happens
    faults.reached("move")
    monkeypatch.setenv(faults.FAULT_ENV, "stage:capture:explode")
    with pytest.raises(faults.FaultSpecError, match=r"HFEXPORT_FAULT='stage:capture:explode' is invalid"):
        faults.reached("stage:capture")
    monkeypatch.setenv(faults.FAULT_ENV, "stage:capture:memory")
    faults.reached("stage:lower")  # another point: nothing
    with pytest.raises(MemoryError, match="injected fault at stage:capture"):
        faults.reached("stage:capture")


def test_the_supervisor_reports_a_killed_child_and_cleans_what_it_left(tmp_path, monkeypatch, capsys) -> None:
    """``hfexport export`` as a console script runs in a child; a child killed by SIGKILL (the OOM
    killer) gets one line naming its last stage, and its staging folder is removed at once."""
    from hfexport import cli
    from hfexport.atomic import _HOST

    work = _workdir(tmp_path)
    before = disk_snapshot(work)
    child = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "notes = os.environ['HFEXPORT_SUPERVISOR_FILE']\n"
        "out = sys.argv[-1]\n"
        "Path(notes).write_text(f'output_dir\\t{out}\\nstage\\tload_model\\nstage\\tcapture\\n')\n"
        f"staging = Path(out).parent / f'.out.hfexport-staging.{{os.getpid()}}.{_HOST}.0123abcd'\n"
        "staging.mkdir(); (staging / 'model.pt2').write_bytes(b'half')\n"
        "Path(str(staging) + '.stage').write_text('capture\\n')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    real = subprocess.Popen

    def popen(argv, **kwargs):
        assert argv[1:3] == ["-m", "hfexport.cli"] and kwargs["env"]["HFEXPORT_ISOLATE"] == "child"
        return real([sys.executable, "-c", child, str(work / "out")], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(cli.err_console, "soft_wrap", True)
    code = cli._supervise(["export", "dynamo", str(work / "out"), "--model", "tiny:bert"])
    err = capsys.readouterr().err
    assert code == 137
    assert len(_stage_lines(err, "capture")) == 1 and "export killed by SIGKILL in stage 'capture'" in err
    assert "out-of-memory killer" in err
    _assert_untouched(work, before)


# --------------------------------------------------------------------------------------------------
# the default-run slice: dynamo, tiny:bert
# --------------------------------------------------------------------------------------------------

SLICE = [
    ("stage:capture:memory", "capture"),
    ("stage:capture:interrupt", "capture"),
    ("write:1:enospc", "save"),  # the first file the save writes
]


@pytest.mark.parametrize(("fault", "stage"), SLICE, ids=[f for f, _ in SLICE])
def test_slice_a_raised_fault_leaves_everything_as_it_was(tmp_path, log_env, fault, stage) -> None:
    pytest.importorskip("hfexport_dynamo")
    work = _workdir(tmp_path)
    assert _check_raised("dynamo", work, fault, stage, log_env) == []


def test_slice_memory_error_names_the_stage_and_what_to_do(tmp_path, log_env) -> None:
    pytest.importorskip("hfexport_dynamo")
    work = _workdir(tmp_path)
    code, err = _invoke(_args("dynamo", work), "stage:capture:memory", log_env)
    assert code == 1
    line = _stage_lines(err, "capture")[0]
    assert line.startswith("export failed in stage 'capture': ExportMemoryError: ")
    for option in ("--dtype bfloat16", "--no-validate", "smaller model", "--ignore-memory-estimate"):
        assert option in line, line


def test_slice_sigkill_then_the_next_run_reports_it_and_cleans_up(tmp_path, log_env) -> None:
    """A SIGKILLed export (forked from this process, so nothing is imported again) leaves its
    staging folder and the breadcrumb naming its stage; the next export removes both and says
    which stage the killed run died in. The previous folder stays byte-identical throughout."""
    pytest.importorskip("hfexport_dynamo")
    import torch

    work = _workdir(tmp_path)
    before = disk_snapshot(work)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            torch.set_num_threads(1)  # no OpenMP team of the parent after fork
            runner.invoke(app, _args("dynamo", work), env={**log_env, faults.FAULT_ENV: "stage:capture:kill"})
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, status
    left = leftovers(work)
    assert any(name.endswith(".stage") for name in left) and any("hfexport-staging" in n for n in left)
    assert {k: v for k, v in disk_snapshot(work).items() if not LEFT.search(k)} == before
    # the next run: removes what the killed one left, names its stage
    code, err = _invoke(_args("dynamo", work), "stage:prepare_inputs:memory", log_env)
    assert code == 1
    assert re.search(
        rf"previous export into .*out \(process {pid}\) was killed during stage 'capture'", err
    ), err
    _assert_untouched(work, before)


def test_slice_api_interrupt_in_validation_leaves_the_model_unchanged(tmp_path) -> None:
    """Through the API: a KeyboardInterrupt in ``validate`` propagates, and the model, its patches
    and the output folder are as they were."""
    pytest.importorskip("hfexport_dynamo")
    from hfexport.atomic import atomic_output_dir
    from hfexport.auto import get_hf_exporter
    from hfexport.testing import tiny_model

    model, inputs = tiny_model("bert")
    fingerprint = model_fingerprint(model)
    work = _workdir(tmp_path)
    before = disk_snapshot(work)
    exporter = get_hf_exporter("dynamo")()
    os.environ[faults.FAULT_ENV] = "stage:validate:interrupt"
    try:
        with (
            pytest.raises(KeyboardInterrupt) as info,
            atomic_output_dir(work / "out") as staging,
        ):
            exporter.export_to_path(model, inputs, exporter.artifact_path(staging))
    finally:
        del os.environ[faults.FAULT_ENV]
    assert any("failed in stage 'validate'" in note for note in info.value.__notes__)
    assert model_fingerprint(model) == fingerprint
    _assert_untouched(work, before)


# --------------------------------------------------------------------------------------------------
# the full matrix (extended): every backend, every point
# --------------------------------------------------------------------------------------------------


def _trace(fmt: str, tmp: Path, env: dict[str, str]) -> list[str]:
    """The points a clean export of ``fmt`` reaches (``stage:<name>``, ``write:<n> <file>``, ``move:<n>``)."""
    trace = tmp / "trace.txt"
    work = _workdir(tmp / "clean")
    result = runner.invoke(app, _args(fmt, work), env={**env, faults.TRACE_ENV: str(trace)})
    assert result.exit_code == 0, result.output
    return trace.read_text().splitlines()


def _stage_of(points: list[str], index: int) -> str:
    """The stage the CLI names for a fault at ``points[index]``: the last stage started before it
    (``swap`` for the moves)."""
    if points[index].startswith("move:"):
        return "swap"
    for point in reversed(points[:index]):
        if point.startswith("stage:"):
            return point.split(":", 1)[1]
    raise AssertionError(points[index])


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    pytest.importorskip(BACKENDS[request.param])
    return request.param


@pytest.mark.extended
def test_matrix_raised_faults(backend, tmp_path, log_env) -> None:
    """MemoryError at every stage, KeyboardInterrupt in capture, lower and validate, ENOSPC and EIO
    on every write into the staging folder: in-process CLI runs."""
    points = _trace(backend, tmp_path, log_env)
    stages = [p.split(":", 1)[1] for p in points if p.startswith("stage:")]
    for required in ("capture", "validate", "save", "write_output"):
        assert required in stages, stages
    problems = []
    runs = [(f"stage:{s}:memory", s) for s in dict.fromkeys(stages) if s not in ("swap",)]
    # dynamo records `lower` as skipped (the ExportedProgram is the artifact): no lowering to interrupt
    runs += [(f"stage:{s}:interrupt", s) for s in ("capture", "lower", "validate") if s in stages]
    for i, point in enumerate(points):
        if point.startswith("write:"):
            for kind in ("enospc", "eio"):
                runs.append((f"{point.split()[0]}:{kind}", _stage_of(points, i)))
    for n, (fault, stage) in enumerate(runs):
        problems += _check_raised(backend, _workdir(tmp_path / f"run{n}"), fault, stage, log_env)
    assert problems == [], "\n".join(problems)


def _subprocess(fmt: str, work: Path, fault: str, env: dict[str, str], isolate: bool = True):
    run_env = {k: v for k, v in os.environ.items() if k not in (faults.FAULT_ENV, faults.TRACE_ENV)}
    run_env.update(env)
    run_env[faults.FAULT_ENV] = fault
    if not isolate:
        run_env["HFEXPORT_ISOLATE"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "hfexport.cli", *_args(fmt, work)],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=1800,
    )


@pytest.mark.extended
def test_matrix_sigkill_at_every_stage_boundary_and_move(backend, tmp_path, log_env) -> None:
    """SIGKILL at every stage start and before every rename of the swap, as ``python -m
    hfexport.cli`` (the supervising process reports the stage and cleans up); once more without
    the supervisor, where the next run reports the killed one."""
    points = _trace(backend, tmp_path, log_env)
    problems = []
    kills = [
        (p, _stage_of(points, i) if p.startswith("move:") else p.split(":", 1)[1])
        for i, p in enumerate(points)
    ]
    kills = [(p, s) for p, s in dict.fromkeys(kills) if not p.startswith("write:")]
    for n, (point, stage) in enumerate(kills):
        work = _workdir(tmp_path / f"kill{n}")
        before = disk_snapshot(work)
        proc = _subprocess(backend, work, f"{point}:kill", log_env)
        if proc.returncode != 137:
            problems.append(f"{point}: exit code {proc.returncode}: {proc.stderr}")
        lines = _stage_lines(proc.stderr, stage)
        if len(lines) != 1 or not lines[0].startswith("export killed by SIGKILL"):
            problems.append(f"{point}: expected one line naming stage {stage!r}:\n{proc.stderr}")
        if leftovers(work) or disk_snapshot(work) != before:
            problems.append(f"{point}: the folder changed; leftovers {leftovers(work)}")
    assert problems == [], "\n".join(problems)
    # unsupervised: the process dies outright; the next run cleans up and names the stage
    work = _workdir(tmp_path / "unsupervised")
    before = disk_snapshot(work)
    # capture: a stage every backend starts (dynamo records lower as skipped, never started)
    proc = _subprocess(backend, work, "stage:capture:kill", log_env, isolate=False)
    assert proc.returncode == -9, proc.stderr
    code, err = _invoke(_args(backend, work), "stage:prepare_inputs:memory", log_env)
    assert code == 1 and "was killed during stage 'capture'" in err, err
    _assert_untouched(work, before)
