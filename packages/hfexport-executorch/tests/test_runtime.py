"""The ExecuTorch runner and the dynamic bounds of exported programs, on toy models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.export import Dim

from hfexport.config import ExecutorchConfig
from hfexport_executorch import ExecutorchExporter, bounds


@pytest.fixture(scope="module")
def bounded_program(toy_inputs, toy_projection_factory):
    model = toy_projection_factory()
    dims = {"input_ids": {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=32)}}
    exporter = ExecutorchExporter()
    program = exporter.export(model, toy_inputs(), ExecutorchConfig(dynamic_shapes=dims))
    return model, exporter, program


def test_explicit_dims_win_and_are_reported(bounded_program):
    _, exporter, _ = bounded_program
    axes = {(a["input"], a["axis"]): a for a in exporter.last_report.dynamic_bounds["axes"]}
    assert (axes[("input_ids", 0)]["max"], axes[("input_ids", 0)]["source"]) == (4, "user")
    assert (axes[("input_ids", 1)]["max"], axes[("input_ids", 1)]["source"]) == (32, "user")
    assert exporter.last_report.extra["dynamic_shapes_mode"] == "as given"


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (4, 32), (3, 17)])
def test_runs_anywhere_inside_the_bounds(bounded_program, batch, seq, toy_inputs):
    model, exporter, program = bounded_program
    inputs = toy_inputs(batch=batch, seq=seq, seed=batch * 100 + seq)
    out = exporter.runner(program)(inputs)
    with torch.no_grad():
        expected = model(**inputs)["hidden"]
    assert list(out) == ["hidden"]
    assert out["hidden"].shape == (batch, seq, 8)
    assert (out["hidden"] - expected).abs().max().item() < 1e-5


def test_outputs_are_not_overwritten_by_the_next_call(bounded_program, toy_inputs):
    _, exporter, program = bounded_program
    run = exporter.runner(program)
    first = run(toy_inputs(seed=1))["hidden"]
    kept = first.clone()
    run(toy_inputs(seed=2))
    assert torch.equal(first, kept)


def test_input_above_the_planned_bound_is_refused_with_a_clear_error(bounded_program, toy_inputs):
    _, exporter, program = bounded_program
    with pytest.raises(ValueError, match=r"input_ids dimension 0 is 5, above the upper bound 4 this program"):
        exporter.runner(program)(toy_inputs(batch=5, seq=8))
    with pytest.raises(ValueError, match=r"input_ids dimension 1 is 33, above the upper bound 32"):
        exporter.runner(program)(toy_inputs(batch=1, seq=33))


def test_second_shape_is_validated_inside_the_bounds(bounded_program):
    _, exporter, _ = bounded_program
    rows = exporter.last_report.validation["second_shape"]
    # derived second shape: batch 3 and sequence 65, cut to the sequence bound 32
    assert [(r["name"], tuple(r["shape"])) for r in rows] == [("hidden", (3, 32, 8))]
    assert all(r["ok"] for r in rows)


def test_wrong_input_names_raise_value_error(bounded_program):
    _, exporter, program = bounded_program
    with pytest.raises(
        ValueError,
        match=r"do not match the structure the program was exported with \(inputs \['input_ids'\]\)",
    ):
        exporter.runner(program)({"pixel_values": torch.randn(2, 6, 16)})


def test_unbounded_user_dim_is_bounded_and_runs_beyond_the_sample(toy_projection, toy_inputs):
    exporter = ExecutorchExporter()
    config = ExecutorchConfig(dynamic_shapes={"input_ids": {1: Dim("seq", min=1)}})
    program = exporter.export(toy_projection, toy_inputs(batch=2, seq=6), config)
    (axis,) = exporter.last_report.dynamic_bounds["axes"]
    assert (axis["input"], axis["axis"], axis["max"]) == ("input_ids", 1, bounds.DEFAULT_MAX_SEQUENCE)
    assert "bounded by bound_unbounded_dynamic_ranges" in axis["source"]
    assert exporter.last_report.applied["fx_program_fixes"] == [
        "hfexport_executorch.workarounds.fx_fixes.runtime_assertions_dropped_before_edge",
        "hfexport_executorch.workarounds.fx_fixes.bound_unbounded_dynamic_ranges",
        "hfexport_executorch.workarounds.fx_fixes.sequence_bounds_from_input_guards",  # no chunk guard here
        "hfexport_executorch.workarounds.fx_fixes.complex_rotary_as_real_pairs",  # finds nothing complex here
    ]
    inputs = toy_inputs(batch=2, seq=1000, seed=3)
    out = exporter.runner(program)(inputs)["hidden"]
    with torch.no_grad():
        expected = toy_projection(**inputs)["hidden"]
    assert out.shape == (2, 1000, 8) and (out - expected).abs().max().item() < 1e-5


def test_batch_one_sample_is_traced_at_batch_two_and_runs_at_any_batch(toy_projection, toy_inputs):
    exporter = ExecutorchExporter()
    program = exporter.export(toy_projection, toy_inputs(batch=1, seq=6), ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert report.extra["trace_inputs"].startswith("batch 1 repeated to 2 for tracing (input_ids)")
    assert report.validation["sample"][0]["shape"][0] == 1  # validated on the user's batch-1 inputs
    assert report.validation["second_shape"][0]["shape"][0] == 2
    run = exporter.runner(program)
    for batch in (1, 3):
        inputs = toy_inputs(batch=batch, seq=9, seed=batch)
        with torch.no_grad():
            expected = toy_projection(**inputs)["hidden"]
        assert (run(inputs)["hidden"] - expected).abs().max().item() < 1e-5


_LOAD_ONCE = """
import sys
from hfexport import cli_logging
from hfexport_executorch.runtime import load_method, load_program

if sys.argv[2] == "routed":
    cli_logging.setup_cli_logging(verbose=False)
assert load_method(load_program(sys.argv[1]), "forward") is not None
cli_logging.restore_cli_logging()
"""


@pytest.mark.slow  # two fresh processes import executorch
def test_cpuinfo_lines_of_the_first_xnnpack_load_go_to_the_cli_log(bounded_program, tmp_path):
    """ExecuTorch 1.4.1 prints ``[cpuinfo_utils.cpp:...]`` lines from C++ once per process, when the
    first XNNPACK method is loaded; with the CLI's routing (no -v) they go to its log file instead
    (:func:`hfexport_executorch.runtime.load_method`). Fresh processes, so the lines are printed."""
    _, exporter, program = bounded_program
    pte = tmp_path / "model.pte"
    exporter.save(program, pte)
    log = tmp_path / "cli.log"
    env = {**os.environ, "HFEXPORT_LOG_FILE": str(log)}

    def run(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_ONCE, str(pte), mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    printed = [line for line in run("plain").splitlines() if "cpuinfo_utils.cpp" in line]
    if sys.platform == "linux":  # a canary: once ExecuTorch stops printing them, the capture can go
        assert printed, "ExecuTorch no longer prints cpuinfo lines: retire runtime.load_method's capture"
    routed = run("routed")
    assert "cpuinfo_utils" not in routed, routed
    logged = log.read_text() if log.exists() else ""
    for line in printed:  # what the runtime printed itself is in the log, attributed to it
        assert f"INFO executorch.native: {line.strip()}" in logged, logged


def test_a_bound_the_memory_budget_narrowed_is_the_one_the_report_prints_and_the_runner_names(
    toy_double, toy_inputs
):
    # fresh-user trial (issue 28): tiny T5's sequence bound was narrowed 4096 -> 1024 by the memory budget,
    # report.dynamic_bounds said 1024 but dynamic_axes_summary (what the CLI prints) still said 4096, and
    # the runner's error named the remedy in Python only. The toy's peak is 128 * batch * seq bytes: a
    # 300 kB budget narrows the default sequence bound 4096 to 256 at batch 8.
    exporter = ExecutorchExporter()
    program = exporter.export(
        toy_double, toy_inputs(), ExecutorchConfig(dynamic=True, max_dynamic_bytes=300_000)
    )
    report = exporter.last_report
    bounds_by_axis = {(a["input"], a["axis"]): a for a in report.dynamic_bounds["axes"]}
    assert bounds_by_axis[("input_ids", 1)]["max"] == 256
    assert bounds_by_axis[("input_ids", 1)]["source"].endswith("narrowed by the memory budget")
    axes = {(a["input"], a["axis"]): a for a in report.dynamic_axes}
    assert (axes[("input_ids", 1)]["max"], axes[("input_ids", 1)]["note"]) == (256, "memory budget")
    assert (axes[("input_ids", 0)]["max"], axes[("input_ids", 0)]["note"]) == (8, "")
    assert "input_ids sequence: dynamic [1, 256] (memory budget)" in report.dynamic_axes_summary
    with pytest.raises(ValueError, match=r"input_ids dimension 1 is 257, above the upper bound 256") as err:
        exporter.runner(program)(toy_inputs(batch=1, seq=257))
    assert "`hfexport export executorch --max-dynamic-bytes 4GiB ...`" in str(err.value)
    assert "ExecutorchConfig(max_dynamic_bytes=...)" in str(
        err.value
    ) and "ExecutorchConfig.dynamic_shapes" in str(err.value)


def test_a_loaded_method_keeps_its_program_alive_and_frees_it_without_a_cycle():
    # ExecuTorch 1.4.1's Method holds no reference to its Program (which alone holds the .pte bytes):
    # ``load_method(load_program(data))`` freed the program while the method pointed into it, and
    # execute() then segfaulted now and then (a crashed xdist worker in CI). The method keeps it, and
    # releases it by reference counting alone once dropped: a reference cycle (the program caches its
    # methods) kept every program's planned memory until a full garbage collection, and the default
    # test run's workers were killed for memory at 18-22 GB.
    import gc
    import weakref

    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    buffer = to_edge_transform_and_lower(torch.export.export(model, (x,))).to_executorch().buffer
    gc.collect()
    gc.disable()  # only reference counting frees what follows
    try:
        program = load_program(bytes(buffer))
        alive = weakref.ref(program)
        method = load_method(program)
        del program, buffer
        assert alive() is not None
        (got,) = method.execute([x])
        with torch.no_grad():
            assert (got - model(x)).abs().max().item() < 1e-6
        assert method.metadata.num_inputs() == 1
        del method
        assert alive() is None
    finally:
        gc.enable()
