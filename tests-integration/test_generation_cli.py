"""`hfexport export dynamo --task text-generation` then `hfexport generate`: one file per component,
a manifest naming them, and the printed tokens equal ``model.generate(do_sample=False)``."""

from __future__ import annotations

import json

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
