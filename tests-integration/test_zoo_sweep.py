"""The zoo sweep's tooling (``benchmarks/zoo_sweep.py``, ``zoo_sweep_child.py``; repository tools, not
in any published package): type lists, subprocess time limit, coverage page, the child's verdicts."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch


def _load_sweep():
    """``benchmarks/zoo_sweep.py`` (what ``nox -s zoo`` runs), loaded by path as ``zoo_sweep``."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo_sweep.py"
    if "zoo_sweep" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zoo_sweep", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["zoo_sweep"] = module
        spec.loader.exec_module(module)
    return sys.modules["zoo_sweep"]


sweep = _load_sweep()


def test_sweep_types_filters_and_limits():
    causal = sweep.sweep_types("causal-lm")
    assert len(causal) > 150 and causal == sorted(causal)
    assert {"llama", "granite", "olmo2", "mamba"} <= set(causal)
    assert sweep.sweep_types("causal-lm", types=["olmo2", "granite", "vit"]) == ["granite", "olmo2"]
    assert (
        sweep.sweep_types("image-classification", limit=3)
        == sorted(sweep.sweep_types("image-classification"))[:3]
    )


def test_child_past_its_time_limit_is_killed_and_reported():
    result = sweep._run_child("import time; time.sleep(30)", [], timeout=1)
    assert {k: result[k] for k in ("status", "stage", "reason")} == {
        "status": "fail",
        "stage": "timeout",
        "reason": "no result within 1 s",
    }
    assert 1.0 <= result["seconds"] < 20
    crashed = sweep._run_child("raise SystemExit('boom at import')", [], timeout=30)
    assert (crashed["status"], crashed["stage"], crashed["reason"]) == ("fail", "crash", "boom at import")


@pytest.mark.parametrize(
    ("stderr", "code", "signum", "reason"),
    [
        ("Traceback ...\nRuntimeError: x\n[cpuinfo_utils.cpp:125] CPU info and manual query on # of cpus dont match.\n",
         1, None, "RuntimeError: x"),
        ("W1203 10:07:18.962000 19849 torch/utils/_pytree.py:630] Enum is deprecated\n", 3, None, "exit 3"),
        ("/x/y.py:12: UserWarning: noise\n[cpuinfo_utils.cpp:125] CPU info\n", -11, 11, "killed by SIGSEGV"),
        ("/x/copyreg.py:105: FutureWarning: deprecated\n  return cls.__new__(cls, *args)\n", -8, 8, "killed by SIGFPE"),
        ("E: aborting in kernel\n", -6, 6, "killed by SIGABRT: E: aborting in kernel"),
    ],
)  # fmt: skip
def test_crash_reason_skips_log_chatter_and_names_the_signal(stderr, code, signum, reason):
    assert sweep.crash_reason(stderr, code, signum) == reason


def test_a_child_killed_by_a_signal_is_reported_with_the_signal_name():
    code = "import os, signal, sys; print('[cpuinfo_utils.cpp:125] chatter', file=sys.stderr); os.kill(os.getpid(), signal.SIGSEGV)"
    crashed = sweep._run_child(code, [], timeout=30)
    assert (crashed["stage"], crashed["reason"]) == ("crash", "killed by SIGSEGV")


def _write(out, family, model_type, build, backends):
    row = {"family": family, "task": sweep.FAMILIES[family], "model_type": model_type, "build": build,
           "backends": backends, "updated": "2026-12-01T23:00:00+00:00"}  # fmt: skip
    (out / f"{family}--{model_type}.json").write_text(json.dumps(row))


def test_render_counts_rows_cells_and_partial_banner(tmp_path):
    out = tmp_path / "zoo"
    out.mkdir()
    (out / "_run.json").write_text(
        json.dumps(
            {
                "date": "2026-12-01T22:00:00+00:00",
                "versions": {"torch": "2.13.0", "transformers": "5.24.0"},
                "families": ["causal-lm"],
                "backends": ["dynamo", "onnx"],
                "types": ["a", "b", "c"],
                "limit": None,
                "partial": True,
            }
        )
    )
    ok = {"status": "ok", "params": 120000}
    _write(out, "causal-lm", "b", ok, {"dynamo": {"status": "pass"}, "onnx": {"status": "pass"}})
    _write(out, "causal-lm", "a", ok, {"dynamo": {"status": "pass"},
           "onnx": {"status": "fail", "stage": "translate", "reason": "ConversionError: no | rule"}})  # fmt: skip
    _write(out, "causal-lm", "c", {"status": "eager fails", "stage": "eager", "reason": "ValueError: x"}, {})
    text = sweep.render(
        out, tmp_path / "coverage.md", known={"causal-lm": ["a", "b", "c", "d"], "speech": ["s"]}
    )
    assert (tmp_path / "coverage.md").read_text() == text
    assert "- Date: 2026-12-01" in text and "torch 2.13.0, transformers 5.24.0" in text
    assert "**Partial sweep** (causal-lm 3 of 4 types, speech 0 of 1 types; partial on dynamo, onnx)" in text
    # 3 of the family's 4 types swept: the target is not judged on a part of the family
    assert (
        "| causal-lm | 3 | 2 | 2 pass / 0 fail / 0 skip (100%; 3 of 4 types swept, target 95% not judged yet) "
        "| 1 pass / 1 fail / 0 skip (50%; 3 of 4 types swept, target 95% not judged yet) |"
    ) in text
    whole = sweep.render(out, tmp_path / "whole.md", known={"causal-lm": ["a", "b", "c"], "speech": ["s"]})
    assert (
        "| causal-lm | 3 | 2 | 2 pass / 0 fail / 0 skip (100%, target 95%: met) "
        "| 1 pass / 1 fail / 0 skip (50%, target 95%: **missed**) |"
    ) in whole
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| a ") or line.startswith("| b ") or line.startswith("| c ")
    ]
    assert rows == [
        "| a | ok (0.12M params) | pass | **fail** (translate) [lowering]: ConversionError: no \\| rule |",
        "| b | ok (0.12M params) | pass | pass |",
        "| c | eager fails (eager): ValueError: x | n/a | n/a |",
    ]


def test_no_known_skip_is_left_for_the_recurrent_types_or_llava():
    KNOWN_SKIPS = sweep.KNOWN_SKIPS

    for backend in sweep.BACKENDS:
        # llava exports and validates on every backend: the runtime assertions of its placeholder check
        # are dropped before ONNX translation / ExecuTorch lowering, and the second shape of a dynamic=True
        # export keeps the image batch the capture fixes (packages/*/tests/test_image_text.py)
        assert (backend, "llava") not in KNOWN_SKIPS
        # the selective scan runs as torch's scan op (dynamo, onnx) or the chunked form (executorch,
        # openvino): hfexport.workarounds.recurrences, tests-integration/test_recurrences.py
        for model_type in ("mamba", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma", "mamba2"):
            assert (backend, model_type) not in KNOWN_SKIPS


@pytest.mark.parametrize(
    ("model_type", "experts"), [("dbrx", "DbrxExperts"), ("longcat_flash", "LongcatFlashExperts")]
)
def test_hand_written_experts_loop_skips_name_the_construct_still_installed(model_type, experts):
    import importlib
    import inspect

    from transformers.integrations import moe

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    reason = sweep.KNOWN_SKIPS[("dynamo", model_type)]
    assert {sweep.KNOWN_SKIPS[(b, model_type)] for b in sweep.BACKENDS} == {reason}
    assert f"{experts}.forward" in reason and "@use_experts_implementation" in reason
    cls = getattr(module, experts)
    source = inspect.getsource(cls.forward)
    assert ".nonzero(" in source and "torch.where(expert_mask[" in source
    # not served by the experts interface (retire the skip when transformers declares it)
    assert "use_experts_implementation" not in inspect.getsource(cls)
    assert moe.use_experts_implementation is not None


def test_mamba_capture_still_specialises_the_sequence_length():
    # Documents the construct hfexport.workarounds.recurrences replaces on the installed transformers: the plain
    # forward's selective scan is a Python loop over the sequence, unrolled by a capture without the backends'
    # patches. Retire the mamba patch when this fails.
    import inspect

    import pytest
    import torch
    from transformers.models.mamba import modeling_mamba

    from hfexport.capture import capture
    from hfexport.config import DynamoConfig
    from hfexport.testing import make_inputs, tiny_model

    source = inspect.getsource(modeling_mamba.mamba_selective_scan)
    assert "for index in range(seq_len):" in source
    assert "is_torchdynamo_compiling() and not is_torchdynamo_exporting()" in source

    model, inputs = tiny_model("mamba", "text-generation")  # batch 2, 8 tokens
    assert inputs["input_ids"].shape == (2, 8)
    program = capture(model, inputs, DynamoConfig(dynamic=True))
    module = program.module()
    with torch.no_grad():
        out = module(**make_inputs(model, batch_size=3, seq_len=8, seed=1))  # the batch stays dynamic
    assert out["logits"].shape[:2] == (3, 8)
    with pytest.raises(AssertionError, match=r"Guard failed: .*size\(\)\[1\] == 8"):
        module(**make_inputs(model, batch_size=2, seq_len=9, seed=2))


def test_results_file_accumulates_runs_and_keeps_cells_a_new_run_did_not_cover(tmp_path):
    ok = {"status": "ok", "params": 1000}
    first, second = tmp_path / "run1", tmp_path / "run2"
    first.mkdir()
    second.mkdir()
    results = tmp_path / "coverage.json"
    _write(first, "causal-lm", "a", ok, {"dynamo": {"status": "fail", "stage": "capture", "reason": "x"},
           "onnx": {"status": "pass"}})  # fmt: skip
    _write(first, "causal-lm", "b", ok, {"dynamo": {"status": "pass"}})
    sweep.merge_results(first, results)
    # a later run (fresh checkout: run1 is gone) re-exports only "a" on dynamo
    row = {"family": "causal-lm", "task": "text-generation", "model_type": "a", "build": ok,
           "backends": {"dynamo": {"status": "pass"}}, "updated": "2026-12-02T10:00:00+00:00"}  # fmt: skip
    (second / "causal-lm--a.json").write_text(json.dumps(row))
    text = sweep.render(second, tmp_path / "coverage.md", results=results, known={"causal-lm": ["a", "b"]})
    doc = json.loads(results.read_text())
    assert [(r["model_type"], r["backends"]) for r in doc["rows"]] == [
        ("a", {"dynamo": {"status": "pass"}, "onnx": {"status": "pass"}}),
        ("b", {"dynamo": {"status": "pass"}}),
    ]
    assert (
        "| causal-lm | 2 | 2 | 2 pass / 0 fail / 0 skip (100%, target 95%: met) | 1 pass / 0 fail / 0 skip (100%"
        in text
    )
    assert "(causal-lm 2 of 2 types; complete on dynamo; partial on onnx (1 of 2 cells not run, `-`))" in text
    # an older row never replaces a newer stored one
    stale = {**row, "backends": {"dynamo": {"status": "fail", "stage": "x", "reason": "old"}},
             "updated": "2026-11-01T00:00:00+00:00"}  # fmt: skip
    (second / "causal-lm--a.json").write_text(json.dumps(stale))
    sweep.merge_results(second, results)
    assert json.loads(results.read_text())["rows"][0]["backends"]["dynamo"] == {"status": "pass"}


def test_one_child_per_type_keeps_finished_cells_and_reruns_what_a_hung_backend_blocked(
    tmp_path, monkeypatch
):
    # a fake child: builds, passes on b1, hangs on b2; run alone (--no-build) it passes its backend
    child = (
        "import json, sys, time\n"
        "args = sys.argv[1:]\n"
        "if args[0] == '--no-build':\n"
        "    print(json.dumps({'kind': 'cell', 'backend': args[3], 'status': 'pass', 'alone': True}))\n"
        "    sys.exit(0)\n"
        "print(json.dumps({'kind': 'build', 'status': 'ok', 'params': 10}), flush=True)\n"
        "print(json.dumps({'kind': 'cell', 'backend': 'b1', 'status': 'pass'}), flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(sweep, "_TYPE_CHILD", child)
    row = sweep._sweep_one("causal-lm", "fake", ["b1", "b2", "b3"], ["b1", "b2", "b3"], 1.0, tmp_path)
    assert row["build"] == {"status": "ok", "params": 10}
    assert row["backends"]["b1"] == {"status": "pass"}
    assert row["backends"]["b2"]["status"] == "fail" and row["backends"]["b2"]["stage"] == "timeout"
    assert row["backends"]["b2"]["reason"] == "no result within 4 s"  # 1 s per step: build + 3 exports
    assert row["backends"]["b3"] == {"status": "pass", "alone": True}
    assert json.loads((tmp_path / "causal-lm--fake.json").read_text())["backends"] == row["backends"]


def test_only_missing_skips_types_whose_rows_cover_every_selected_backend(tmp_path, monkeypatch):
    swept = []
    monkeypatch.setattr(sweep, "_sweep_one", lambda family, model_type, *a: swept.append(model_type) or {})
    done = [
        {"family": "causal-lm", "model_type": "gpt2", "build": {"status": "ok"}, "backends": {"dynamo": {}}},
        {"family": "causal-lm", "model_type": "llama", "build": {"status": "ok"}, "backends": {"onnx": {}}},
        {"family": "causal-lm", "model_type": "jamba", "build": {"status": "eager fails"}, "backends": {}},
    ]
    sweep.run_sweep(["causal-lm"], ["dynamo"], ["gpt2", "llama", "jamba"], out_dir=tmp_path, done=done)
    assert swept == ["llama"]


def test_skip_reasons_become_numbered_notes_under_the_family_table(tmp_path):
    ok = {"status": "ok", "params": 1000}
    long_reason = "model-side: a per-token loop | unrolled at capture"
    _write(
        tmp_path,
        "causal-lm",
        "m",
        ok,
        {b: {"status": "skip", "reason": long_reason} for b in ("dynamo", "onnx")},
    )
    _write(
        tmp_path,
        "causal-lm",
        "n",
        ok,
        {"dynamo": {"status": "skip", "reason": "other"}, "onnx": {"status": "pass"}},
    )
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"causal-lm": ["m", "n"]})
    assert "| m | ok (0.00M params) | skip [1] | skip [1] |" in text
    assert "| n | ok (0.00M params) | skip [2] | pass |" in text
    assert "1. model-side: a per-token loop \\| unrolled at capture\n2. other\n" in text


def test_forked_child_streams_records_and_is_killed_or_reported_like_a_fresh_interpreter(monkeypatch):
    import time

    sweep_child = sweep._child_module()

    def hangs_after_one_cell(args):
        print(json.dumps({"kind": "build", "status": "ok", "args": args}), flush=True)
        print(json.dumps({"kind": "cell", "backend": "b1", "status": "pass"}), flush=True)
        time.sleep(60)

    monkeypatch.setattr(sweep_child, "main", hangs_after_one_cell)
    records, error = sweep._fork_lines(["tiny", "text-generation", "b1,b2"], timeout=2.0)
    assert [r["kind"] for r in records] == ["build", "cell"]
    assert records[0]["args"] == ["tiny", "text-generation", "b1,b2"]
    assert (error["stage"], error["reason"]) == ("timeout", "no result within 2 s")

    def crashes(args):
        raise RuntimeError("lowering blew up")

    monkeypatch.setattr(sweep_child, "main", crashes)
    records, error = sweep._fork_lines(["tiny", "text-generation", "b1"], timeout=30.0)
    assert records == []
    assert (error["stage"], error["reason"]) == ("crash", "RuntimeError: lowering blew up")

    def segfaults(args):
        print("[cpuinfo_utils.cpp:125] CPU info and manual query on # of cpus dont match.", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGSEGV)

    monkeypatch.setattr(sweep_child, "main", segfaults)
    records, error = sweep._fork_lines(["tiny", "text-generation", "b1"], timeout=30.0)
    assert (error["stage"], error["reason"]) == ("crash", "killed by SIGSEGV")


def test_a_backend_that_has_not_run_every_type_is_not_judged_against_its_target(tmp_path):
    ok = {"status": "ok", "params": 1000}
    _write(tmp_path, "causal-lm", "a", ok, {"dynamo": {"status": "pass"}, "executorch": {"status": "pass"}})
    _write(tmp_path, "causal-lm", "b", ok, {"dynamo": {"status": "pass"}})
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"causal-lm": ["a", "b"]})
    assert (
        "| causal-lm | 2 | 2 | 2 pass / 0 fail / 0 skip (100%, target 95%: met) "
        "| 1 pass / 0 fail / 0 skip (100%; 1 of 2 types run, target 90% not judged yet) |"
    ) in text


@pytest.mark.parametrize(
    ("stage", "reason", "kind"),
    [
        ("timeout", "no result within 600 s", "timeout"),
        (
            "validate_second_shape",
            "the program came out static: every axis asked dynamic was specialised",
            "static",
        ),
        (
            "validate",
            "ExportValidationError: exported artifact does not match eager PyTorch on the sample",
            "numbers",
        ),
        ("capture", "ExportStageError: ... GuardOnDataDependentSymNode: Could not guard", "data-dependent"),
        (
            "validate_second_shape",
            "ExportStageError: ... AssertionError: Guard failed: input_ids.size()[1] == 8",
            "fixed-axis",
        ),
        (
            "validate_second_shape",
            "Fail: [ONNXRuntimeError] : 1 : FAIL : Non-zero status code",
            "second-shape",
        ),
        ("validate", "RuntimeError: method->execute() failed with error 0x12", "runtime"),
        ("validate", "MemoryError: std::bad_alloc", "runtime"),
        ("lower", "SpecViolationError: ", "lowering"),
        ("capture", "AssertionError: Cannot create Dim with inconsistent min=2, max=2", "capture"),
        ("crash", "killed by SIGSEGV", "crash"),
        (
            "convert",
            "OpenvinoConversionError: rejected; failed FX node(s): polar (aten.polar.default)",
            "lowering",
        ),
        (
            "convert",
            "ExportStageError: failed in stage 'convert': GuardOnDataDependentSymNode: u5",
            "lowering",
        ),
        (
            "capture.torch_export",
            "ExportStageError: GuardOnDataDependentSymNode: Eq(u0, 0)",
            "data-dependent",
        ),
        ("export", "Segmentation fault", "unclassified"),
    ],
)
def test_every_failure_gets_a_kind_and_a_remedy(stage, reason, kind):
    got, action = sweep.failure_action(stage, reason)
    assert got == kind
    assert action.endswith((".", ")")) and len(action) > 40


def test_failure_remedies_are_listed_under_the_family_table(tmp_path):
    ok = {"status": "ok", "params": 1000}
    guard = {
        "status": "fail",
        "stage": "validate_second_shape",
        "reason": "AssertionError: Guard failed: x == 8",
    }
    _write(tmp_path, "causal-lm", "m", ok, {"dynamo": guard, "onnx": {"status": "pass"}})
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"causal-lm": ["m"]})
    assert (
        "| m | ok (0.00M params) | **fail** (validate_second_shape) [fixed-axis]: AssertionError: Guard failed: x == 8 | pass |"
        in text
    )
    assert (
        "Failures, by kind (what you can do):\n\n- `fixed-axis`: Capture fixed an axis at the sample's size"
        in text
    )


def test_a_backend_that_ran_no_type_of_a_family_reads_not_run_yet(tmp_path):
    ok = {"status": "ok", "params": 1000}
    _write(tmp_path, "speech", "s", ok, {"dynamo": {"status": "pass"}})
    _write(tmp_path, "causal-lm", "m", ok, {"dynamo": {"status": "pass"}, "onnx": {"status": "pass"}})
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"causal-lm": ["m"], "speech": ["s"]})
    assert "| speech | 1 | 1 | 1 pass / 0 fail / 0 skip (100%) | not run yet |" in text


def test_cells_drop_object_addresses(tmp_path):
    ok = {"status": "ok", "params": 1000}
    reason = "OpenvinoConversionError: failed op(s): <function sym_max at 0x7fc7f8b0e200>"
    _write(
        tmp_path, "causal-lm", "a", ok, {"dynamo": {"status": "fail", "stage": "convert", "reason": reason}}
    )
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"causal-lm": ["a"]})
    assert "failed op(s): <function sym_max>" in text and "0x7fc7" not in text


# --- the child's verdict on an ExecuTorch export whose program came out static ---


class _StaticBatch(torch.nn.Module):
    """Specialises every axis asked dynamic: a (2, 8, 4) table is added to the embeddings."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)
        self.table = torch.nn.Parameter(torch.randn(2, 8, 4))

    def forward(self, input_ids, attention_mask):
        return self.emb(input_ids) * attention_mask[..., None] + self.table


def test_a_pass_whose_program_came_out_static_is_a_failure_of_the_second_shape(monkeypatch):
    # ExecuTorch fits the second shape into the program's bounds: a static program validates at the
    # sample's shape twice, which the sweep must not count as a dynamic pass
    pytest.importorskip(
        "hfexport_executorch", reason="the cell exports with hfexport-executorch, not installed"
    )
    import hfexport.testing as testing

    sweep_child = sweep._child_module()

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(
        testing,
        "tiny_model",
        lambda *a, **k: (_StaticBatch().eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
    )
    cell = sweep_child.export_cell("executorch", "static-toy", "feature-extraction")
    assert cell["status"] == "fail" and cell["stage"] == "validate_second_shape"
    assert (
        cell["reason"]
        == "the program came out static: every axis asked dynamic was specialised, nothing varied"
    )


# --- issue 28 families (object detection, segmentation, depth, time series, text-to-audio) ---


def test_issue_28_families_have_tasks_targets_and_notes(tmp_path):
    from hfexport.tasks import TASK_AUTO_CLASSES

    new = (
        "object-detection",
        "zero-shot-object-detection",
        "image-segmentation",
        "depth-estimation",
        "time-series",
        "text-to-audio",
    )
    for family in new:
        assert sweep.FAMILIES[family] in TASK_AUTO_CLASSES
        assert sweep.TARGETS[(family, "dynamo")] == sweep.TARGETS[(family, "onnx")] == 90
        assert sweep.TARGETS[(family, "executorch")] == sweep.TARGETS[(family, "openvino")] == 85
    assert "patchtst" in sweep.sweep_types("time-series")
    ok = {"status": "ok", "params": 1000}
    _write(
        tmp_path, "time-series", "patchtst", ok, {"dynamo": {"status": "pass"}, "onnx": {"status": "pass"}}
    )
    text = sweep.render(tmp_path, tmp_path / "c.md", known={"time-series": ["patchtst"]})
    assert "| time-series | 1 | 1 | 1 pass / 0 fail / 0 skip (100%, target 90%: met) |" in text
    assert "## time-series (`time-series-forecasting`)\n\n" + sweep.FAMILY_NOTES["time-series"] in text


def test_forking_parent_preloads_the_modules_a_first_executorch_export_imports_lazily(monkeypatch):
    import importlib

    import hfexport.auto

    exporters: list[str] = []
    imported: list[str] = []

    def get_hf_exporter(backend):
        if backend == "missing":
            raise ImportError("hfexport-missing is not installed")
        exporters.append(backend)

    monkeypatch.setattr(hfexport.auto, "get_hf_exporter", get_hf_exporter)
    monkeypatch.setattr(importlib, "import_module", imported.append)
    sweep._preload(["onnx", "missing", "executorch"])
    assert exporters == ["onnx", "executorch"]
    # executorch.exir comes with the lowering module: the import every ExecuTorch cell paid again
    assert imported == list(sweep.PRELOAD_MODULES["executorch"])
    assert imported[0] == "hfexport_executorch.lowering"
