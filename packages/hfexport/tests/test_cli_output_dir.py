"""`hfexport export ... OUTPUT_DIR` checks OUTPUT_DIR before loading any model: a file, an
unwritable parent or a non-empty foreign folder is a usage error (exit 2) at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hfexport.checkpoints
from hfexport.cli import app

runner = CliRunner()


def flat(output: str) -> str:
    """The CLI output as one line, without rich's panel borders and line wraps."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Calls of ``hfexport.checkpoints.load_model`` (each raises, so no model is ever loaded)."""
    calls: list[str] = []

    def load_model(model, task="auto", **kwargs):
        calls.append(model)
        raise RuntimeError("load_model reached")

    monkeypatch.setattr(hfexport.checkpoints, "load_model", load_model)
    return calls


def test_a_file_as_output_dir_fails_before_loading(tmp_path, loads):
    out = tmp_path / "out"
    out.write_text("a file")
    result = runner.invoke(app, ["export", "dynamo", "--model", "tiny:bert", str(out)])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for OUTPUT_DIR: output folder '{out}' is a file, not a folder" in flat(
        result.output
    )
    assert loads == [] and out.read_text() == "a file"


def test_a_foreign_folder_needs_overwrite(tmp_path, loads):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["export", "dynamo", "--model", "tiny:bert", str(out)])
    assert result.exit_code == 2, result.output
    text = flat(result.output)
    assert f"output folder '{out}' is not empty and is not a previous hfexport export" in text
    assert "Pass --overwrite" in text
    assert loads == []
    # --overwrite passes the check (and reaches model loading); the failed run changes nothing
    result = runner.invoke(app, ["export", "dynamo", "--model", "tiny:bert", "--overwrite", str(out)])
    assert result.exit_code == 1, result.output
    assert "stage 'load_model': RuntimeError: load_model reached" in flat(result.output)
    assert loads == ["tiny:bert"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_unwritable_parent_fails_before_loading(tmp_path, loads, monkeypatch):
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if Path(p) == parent else real_access(p, mode, **kw)
    )
    result = runner.invoke(app, ["export", "onnx", "--model", "tiny:bert", str(parent / "out")])
    assert result.exit_code == 2, result.output
    assert f"cannot be written: no write permission on '{parent}'" in flat(result.output)
    assert loads == []


def test_a_path_under_a_file_fails_before_loading(tmp_path, loads):
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    result = runner.invoke(app, ["export", "dynamo", "--model", "tiny:bert", str(a_file / "out")])
    assert result.exit_code == 2, result.output
    assert f"cannot be created: '{a_file}' is a file, not a folder" in flat(result.output)
    assert loads == []


def test_the_model_folder_is_never_the_output_dir(tmp_path, loads):
    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = runner.invoke(app, ["export", "onnx", "--model", str(model), "--overwrite", str(model)])
    assert result.exit_code == 2, result.output
    assert f"output folder '{model}' is or contains '{model}', which an export would delete" in flat(
        result.output
    )
    assert loads == [] and sorted(p.name for p in model.iterdir()) == ["config.json"]
