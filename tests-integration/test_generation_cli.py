"""`hfexport export dynamo --task text-generation` then `hfexport generate`: one file per component,
a manifest naming them, and the printed tokens equal ``model.generate(do_sample=False)``."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from hfexport.cli import app
from hfexport.testing import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

runner = CliRunner()
PROMPT = [5, 17, 42, 99, 3, 64]
NEW_TOKENS = 12


def test_export_for_text_generation_then_generate_prints_the_generate_tokens(tmp_path):
    out = tmp_path / "llama-gen"
    result = runner.invoke(
        app, ["export", "dynamo", "--model", "tiny:llama", "--task", "text-generation", str(out)]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "generation_manifest.json").read_text())
    assert manifest["format"] == "dynamo"
    assert manifest["files"] == {"prefill": "prefill.pt2", "decode": "decode.pt2"}
    assert all((out / f).is_file() for f in manifest["files"].values())

    ids = ",".join(map(str, PROMPT))
    result = runner.invoke(
        app, ["generate", str(out), "--input-ids", ids, "--max-new-tokens", str(NEW_TOKENS)]
    )
    assert result.exit_code == 0, result.output
    printed = [int(t) for t in result.output.split("tokens:", 1)[1].split()]

    model, _ = tiny_model("llama")  # the same seeded weights the CLI exported
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert printed == want[0, len(PROMPT) :].tolist()

    # --prompt without tokenizer files: a usage error that says what to do, not a traceback
    result = runner.invoke(app, ["generate", str(out), "--prompt", "hello"])
    assert result.exit_code == 2
    assert "--input-ids" in " ".join(result.output.split())

    # checksums: the report records them, sha256sum verifies the folder, a flipped byte is refused
    report = json.loads((out / "export_report.json").read_text())
    # each component's second shape is recorded: the decode step's at another past length
    decode = report["second_shapes"]["decode"]
    past, second = decode["past_length"]
    assert second == 2 * past + 1 and decode["summary"].startswith(f"past length {past} -> {second}")
    assert report["second_shapes"]["prefill"]["past_length"] == [0, 0]
    assert sorted(report["sha256"]) == sorted(
        p.name for p in out.iterdir() if p.name not in ("export_report.json", "checksums.sha256")
    )
    assert report["sha256"]["decode.pt2"] == hashlib.sha256((out / "decode.pt2").read_bytes()).hexdigest()
    check = subprocess.run(["sha256sum", "-c", "checksums.sha256"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0 and "export_report.json: OK" in check.stdout, check.stdout + check.stderr
    data = bytearray((out / "prefill.pt2").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "prefill.pt2").write_bytes(bytes(data))
    result = runner.invoke(app, ["generate", str(out), "--input-ids", ids, "--max-new-tokens", "2"])
    assert result.exit_code != 0
    shown = "".join(result.output.split())  # rich folds long lines anywhere, even inside a file name
    assert result.exit_code == 1 and "IntegrityError" in shown
    assert "prefill.pt2doesnotmatchitschecksum" in shown and "re-exportit" in shown
    assert "tokens:" not in result.output
