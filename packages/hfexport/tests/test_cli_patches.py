"""``hfexport patches``: every kind listed, ``--stale`` judging scoped and core keys, usage errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfexport import cli, registry
from hfexport.cli import app

runner = CliRunner()
ISSUE = "https://github.com/pytorch/pytorch/issues/1"


def _json_rows(*args: str) -> list[dict]:
    result = runner.invoke(app, ["patches", "--json", *args], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("[") :])


@pytest.fixture
def extra_entries():
    """Entries of kinds that have no built-in entry, registered for one test and removed after."""
    from hfexport_onnx.workarounds import ir_fixes

    def fx_test_fix(gm, node):
        return False

    def ir_test_fix(model):
        return False

    def documented_form_fix(ep):
        return None

    registry.register_fx_node_fix(
        "onnx", description="test node fix", issue=ISSUE, versions={"torch": ">=2"}
    )(fx_test_fix)
    ir_fixes.register_ir_fix(description="test ir fix", issue=ISSUE, versions={"torch": ">=2"})(ir_test_fix)
    registry.register_fx_program_fix("dynamo")(documented_form_fix)  # the reference API's form, no metadata
    yield {f.__qualname__ for f in (fx_test_fix, ir_test_fix, documented_form_fix)}
    for kind, func in (
        ("fx_node_fix", fx_test_fix),
        (ir_fixes.KIND, ir_test_fix),
        ("fx_program_fix", documented_form_fix),
    ):
        registry.unregister(kind, registry._qualified_name(func))


def test_every_kind_is_listed_with_issue_and_range(extra_entries):
    rows = _json_rows()
    kinds = {r["kind"] for r in rows}
    assert {
        "patch",
        "fx_node_fix",
        "fx_program_fix",
        "onnx_translation",
        "onnx_ir_fix",
        "input_preparer",
    } <= kinds
    by_name = {r["name"].rsplit(".", 1)[-1]: r for r in rows}
    translation = by_name["grouped_mm_fallback"]
    assert translation["backend"] == "onnx" and translation["issue"].startswith("https://github.com/")
    assert translation["targets"] == ["transformers::grouped_mm_fallback.default"]
    assert translation["versions"]["onnxscript"] == ">=0.5" and translation["stale"] is False
    preparer = by_name["prepare_vision_grid_inputs"]
    assert preparer["backend"] == "inputs" and preparer["targets"] == ["grid_thw"]
    assert by_name["dense_experts_for_eager"]["backend"] == "dynamo"
    # the core's dense-experts patch is registered once per backend that needs it
    dense_every = {
        r["backend"] for r in rows if r["name"].rsplit(".", 1)[-1] == "dense_experts_for_every_implementation"
    }
    assert {"executorch.xnnpack", "openvino"} <= dense_every
    assert by_name["fallback_warning_with_its_arguments"]["backend"] == "dynamo.load"
    plain = by_name["documented_form_fix"]
    assert (plain["issue"], plain["versions"], plain["stale"]) == (None, {}, False)
    for row in rows:  # every stale verdict is given: no key is left unjudged
        assert row["stale"] is not None, row["name"]


def test_entry_without_metadata_reads_no_upstream_issue_recorded(extra_entries):
    result = runner.invoke(app, ["patches", "--backend", "dynamo"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "documented_form_fix" in line)
    assert "no upstream issue recorded" in line and "any version" in line


@pytest.mark.parametrize("key", ["bad key!", "nonsense", "dynamo-load"])
def test_unknown_backend_key_is_a_usage_error_listing_known_keys(key):
    result = runner.invoke(app, ["patches", "--backend", key], env={"COLUMNS": "400"})
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert f"unknown backend key {key!r}" in message
    # judged before any backend is imported: the roots (core keys and installed formats) are listed
    for known in ("capture", "dynamo", "executorch", "generation", "inputs", "onnx"):
        assert known in message
    assert "a scope of one of them, e.g. executorch.xnnpack, also works" in message
    assert "Traceback" not in result.output


def test_scoped_key_of_a_known_backend_is_accepted():
    rows = _json_rows("--backend", "executorch.cuda")
    assert rows and {r["backend"] for r in rows} == {"executorch"}  # the parent's entries only


def test_stale_judges_scoped_and_core_keys_against_their_roots(monkeypatch):
    ranges = {
        "executorch": {"executorch": ">=9"},
        "dynamo": {"torch": ">=2.12"},
        "capture": {"transformers": ">=7"},
        "generation": {"transformers": ">=7"},
        "inputs": {"transformers": ">=7"},
    }
    monkeypatch.setattr(cli, "_supported_ranges", lambda: ranges)
    meta = {"description": "test", "issue": ISSUE}
    with registry.isolated_registry():
        registry.register_fx_node_fix("executorch.xnnpack", versions={"executorch": "<2"}, **meta)(
            lambda gm, n: False
        )

        def retired(original):
            return original

        def needed(original):
            return original

        registry.register_patch("dynamo.load", "json.dumps", versions={"torch": "<2.12"}, **meta)(retired)
        registry.register_patch("dynamo.load", "json.loads", versions={"torch": "<3"}, **meta)(needed)
        registry.register_patch("generation", "json.load", versions={"transformers": "<6"}, **meta)(
            lambda o: o
        )
        registry.register_fx_program_fix("thirdparty", versions={"torch": "<2"}, **meta)(lambda ep: None)
        rows = _json_rows()
        stale_rows = _json_rows("--stale")
    verdicts = [(r["backend"], r["targets"], r["stale"]) for r in rows]
    assert verdicts == [
        ("executorch.xnnpack", [], True),  # executorch <2 vs supported >=9
        ("dynamo.load", ["json.dumps"], True),  # torch <2.12 vs supported >=2.12
        ("dynamo.load", ["json.loads"], False),
        ("generation", ["json.load"], True),  # core key: judged against the core's ranges
        ("thirdparty", [], None),  # no installed backend owns it: not judged
    ]
    assert [(r["backend"], r["targets"]) for r in stale_rows] == [
        ("executorch.xnnpack", []),
        ("dynamo.load", ["json.dumps"]),
        ("generation", ["json.load"]),
    ]


def test_listing_reports_unresolved_paths():
    with registry.isolated_registry():
        registry.register_patch("onnx", "_hfexport_no_such_module.fn", description="x", issue=ISSUE)(
            lambda o: o
        )
        rows = _json_rows("--backend", "onnx")
    (row,) = [r for r in rows if r["targets"] == ["_hfexport_no_such_module.fn"]]
    assert row["unresolved"][0][0] == "_hfexport_no_such_module.fn"
    assert "No module named '_hfexport_no_such_module'" in row["unresolved"][0][1]
