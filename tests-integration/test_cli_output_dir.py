"""`hfexport export` replaces OUTPUT_DIR as a whole: a plain export into a folder that held a
generation export leaves no old manifest or component behind, and no temporary folder beside it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfexport.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

runner = CliRunner()


def test_a_plain_export_over_a_generation_export_leaves_no_old_manifest(tmp_path):
    out = tmp_path / "bert"
    out.mkdir()
    (out / "generation_manifest.json").write_text(
        json.dumps({"format": "dynamo", "files": {"decode": "decode.pt2"}})
    )
    (out / "decode.pt2").write_bytes(b"old component")
    (out / "prefill.pt2").write_bytes(b"old component")
    (out / "export_report.json").write_text('{"export_format": "dynamo"}')
    result = runner.invoke(app, ["export", "dynamo", "--model", "tiny:bert", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.sha256",
        "config.json",
        "export_report.json",
        "model.pt2",
    ]
    report = json.loads((out / "export_report.json").read_text())
    assert report["model"] == "tiny:bert" and sorted(report["artifact_sizes_bytes"]) == [
        "config.json",
        "model.pt2",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]  # no staging or backup folder left
    result = runner.invoke(app, ["generate", str(out), "--input-ids", "1,2"])
    assert result.exit_code == 2, result.output  # a usage error, found before anything is loaded
    assert "generation_manifest.json" in " ".join(result.output.split())
