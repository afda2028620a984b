"""The main job: the real all-MiniLM-L6-v2 (BERT) exported to ONNX gives the sentence embeddings
PyTorch gives, on a padded batch of 8 real sentences of different lengths and one sentence at a time.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from hfexport.config import OnnxConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SENTENCES = [
    "Hi.",
    "The cat sat on the mat.",
    "ONNX Runtime executes the exported graph on the CPU.",
    "A man is playing a guitar on a small stage in front of a quiet audience.",
    "Sentence embeddings map text of any length to one vector of 384 numbers.",
    "Why not now?",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch, "
    "wondering whether the fence will hold through another long and windy winter.",
    "Export, then validate: a model that runs but computes something else is worse than no model.",
]
MIN_COSINE = 0.99999
MAX_ABS_DIFF = 1e-4


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors where ``attention_mask`` is 1 (sentence-transformers pooling)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


@pytest.fixture(scope="module")
def minilm(minilm_path):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def exported(minilm, tmp_path_factory):
    """Export once with named batch/sequence dims and save it (weights as external data)."""
    from hfexport_onnx import OnnxExporter

    model, tokenizer = minilm
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    lengths = batch["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) == len(SENTENCES)  # all different lengths, so the batch is padded
    b, s = Dim("batch", min=1, max=64), Dim("seq", min=1, max=512)
    shapes = {name: {0: b, 1: s} for name in batch}
    path = tmp_path_factory.mktemp("minilm") / "model.onnx"
    exporter = OnnxExporter()
    exporter.export(model, batch, OnnxConfig(dynamic_shapes=shapes, output_path=str(path)))
    return exporter, path, batch


def _embeddings_both_ways(model, runner, inputs):
    with torch.no_grad():
        expected = mean_pool(model(**inputs).last_hidden_state, inputs["attention_mask"])
    got = mean_pool(runner(inputs)["last_hidden_state"], inputs["attention_mask"])
    return expected, got


def _assert_close(expected: torch.Tensor, got: torch.Tensor) -> None:
    assert got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=-1)
    assert bool((cosine >= MIN_COSINE).all()), cosine
    assert float((got - expected).abs().max()) <= MAX_ABS_DIFF


def test_export_report(exported):
    exporter, path, _batch = exported
    report = exporter.last_report
    assert all(s.status == "ok" for s in report.stages), report.summary_lines()
    assert path.is_file() and path.with_name("model.onnx.data").is_file()
    assert report.extra["onnx_inputs"] == ["input_ids", "token_type_ids", "attention_mask"]
    assert report.extra["onnx_outputs"] == ["last_hidden_state", "pooler_output"]


def test_padded_batch_of_eight_sentences(minilm, exported):
    from hfexport_onnx import OnnxRuntimeRunner

    model, _tokenizer = minilm
    _exporter, path, batch = exported
    expected, got = _embeddings_both_ways(model, OnnxRuntimeRunner(path), batch)
    assert got.shape == (8, 384)
    _assert_close(expected, got)


def test_one_sentence_at_a_time(minilm, exported):
    from hfexport_onnx import OnnxRuntimeRunner

    model, tokenizer = minilm
    _exporter, path, batch = exported
    runner = OnnxRuntimeRunner(path)
    _, batched = _embeddings_both_ways(model, runner, batch)
    for index, sentence in enumerate(SENTENCES):
        single = dict(tokenizer([sentence], return_tensors="pt"))
        expected, got = _embeddings_both_ways(model, runner, single)
        assert got.shape == (1, 384)
        _assert_close(expected, got)
        # padding does not change a sentence's embedding in the exported model either
        _assert_close(batched[index : index + 1], got)
