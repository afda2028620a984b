"""float16 generation graphs for ONNX Runtime (CPU runs fp16 graphs): the decoder graph with
past/present tensors (the ``genai`` layout's graph) validates its prefill on an empty past and its
decode step with the quality gates, fed float16 past keys/values; bfloat16 is refused first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hfexport.config import OnnxConfig
from hfexport.testing import tiny_model
from hfexport_onnx.decoder_graph import export_decoder_with_past


def test_float16_decoder_with_past_validates_prefill_and_decode_step():
    model, inputs = tiny_model("llama")
    graph = export_decoder_with_past(model, inputs, OnnxConfig(dtype="float16"))
    assert model.dtype == torch.float32  # the user's model is back in float32
    assert graph.dtype == "float16"
    dtypes = {v.name: v.dtype.name for v in graph.artifact.model.graph.inputs}
    assert dtypes["past_key_values.0.key"] == dtypes["past_key_values.1.value"] == "FLOAT16"
    assert dtypes["input_ids"] == dtypes["attention_mask"] == "INT64"
    assert {v.name: v.dtype.name for v in graph.artifact.model.graph.outputs}["present.0.key"] == "FLOAT16"
    report = graph.report
    assert report.quality_gates == {"cosine": 0.99, "top1_agreement": 0.98}
    for label, past in (("sample", 4), ("prefill_empty_past", 0), ("decode_step", 6)):
        rows = {r["name"]: r for r in report.validation[label]}
        logits, key = rows["logits"], rows["present.0.key"]
        # scored against the fp32 eager wrapper: fp16 outputs, gates met
        assert logits["dtype"] == "torch.float16" and logits["ok"], (label, logits)
        assert logits["cosine"] >= 0.999 and logits["top1_agreement"] == 1.0, (label, logits)
        assert key["ok"] and key["cosine"] >= 0.999 and 0 < key["max_abs_diff"] < 1e-2, (label, key)
        if label != "sample":
            sequence = 4 if past == 0 else 1
            assert key["shape"][2] == past + sequence, (label, key["shape"])


def test_bfloat16_decoder_graph_is_refused_before_the_eager_run(monkeypatch):
    import hfexport_onnx.decoder_graph as decoder_graph

    model, inputs = tiny_model("llama")

    def no_eager_run(*args, **kwargs):
        raise AssertionError("the model ran before the dtype was checked")

    monkeypatch.setattr(decoder_graph, "_eager_past", no_eager_run)
    with pytest.raises(
        ValueError, match=r"dtype='bfloat16' cannot run in ONNX Runtime .* allowed for onnx: float32, float16"
    ):
        export_decoder_with_past(model, inputs, OnnxConfig(dtype="bfloat16"))


@pytest.mark.extended
def test_float16_genai_folder_runs_in_onnxruntime_genai(tmp_path):
    """CLI ``--dtype float16 --layout genai``; ONNX Runtime GenAI generates from the folder.

    Random weights: the greedy tokens are compared with fp32 ``model.generate`` and the first
    divergence is printed, not asserted (measured on tiny llama: none in 12 tokens)."""
    pytest.importorskip("onnxruntime_genai")
    from typer.testing import CliRunner

    from hfexport.cli import app
    from hfexport.testing.folders import tiny_model_folder

    folder = tiny_model_folder("llama", tmp_path / "model")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            *("export", "onnx", "--model", str(folder), "--task", "text-generation"),
            *("--dtype", "float16", "--layout", "genai", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "export_report.json").read_text())
    assert {"sample", "prefill_empty_past", "decode_step"} <= set(report["report"]["validation"])
    script = (
        "import json, sys, numpy as np, onnxruntime_genai as og\n"
        "model = og.Model(sys.argv[1]); params = og.GeneratorParams(model)\n"
        "ids = np.asarray([[1, 5, 7, 9, 11, 13]], dtype=np.int32)\n"
        "params.set_search_options(do_sample=False, max_length=18)\n"
        "gen = og.Generator(model, params); gen.append_tokens(ids)\n"
        "while not gen.is_done(): gen.generate_next_token()\n"
        "print(json.dumps([int(t) for t in gen.get_sequence(0)]))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(out)], capture_output=True, text=True, check=True
    )
    sequence = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(sequence) == 18 and sequence[:6] == [1, 5, 7, 9, 11, 13]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    new, ref = sequence[6:], reference[0, 6:].tolist()
    diverged = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), None)
    print(f"float16 genai vs fp32 generate: first divergence at new token {diverged}")
