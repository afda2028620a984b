"""Language-model metrics on the shipped text (hfexport.quality: perplexity ratio, KL, top-1)."""

from __future__ import annotations

import math

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.errors import ExportValidationError
from hfexport.quality import (
    CHANCE_PERPLEXITY_FRACTION,
    TEXT_GATES_4BIT,
    TEXT_GATES_8BIT,
    plain_text_inputs,
    quality_gates_for,
    quality_text,
    text_chunks,
    text_default_gates,
    text_gates_for,
    text_quality,
    text_reference,
    text_token_ids,
    validate_text,
)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def test_quality_text_is_the_shipped_passage():
    text = quality_text()
    assert text.startswith("It is a truth universally acknowledged")
    assert 900 < len(text.split()) < 1200
    ids, source = text_token_ids(None, vocab_size=300)
    assert source == "utf-8 bytes" and ids.dtype == torch.long and int(ids.max()) < 300
    assert ids.numel() == len(text.encode("utf-8"))


def test_chunks_cover_the_text_within_the_limit():
    ids = torch.arange(1000)
    chunks = text_chunks(ids, max_length=300)
    assert [c.shape for c in chunks] == [torch.Size([1, 250])] * 4
    assert torch.equal(torch.cat([c.reshape(-1) for c in chunks]), ids)
    exact = text_chunks(ids, max_length=64, batch=2, exact=True)
    assert len(exact) == 7 and all(c.shape == (2, 64) for c in exact)
    with pytest.raises(ValueError, match="fewer than one"):
        text_chunks(ids[:10], max_length=64, exact=True)


def test_identical_logits_score_ratio_one_kl_zero_top1_one():
    torch.manual_seed(0)
    chunks = [torch.randint(0, 50, (1, 40)), torch.randint(0, 50, (1, 30))]
    logits = [torch.randn(1, 40, 50), torch.randn(1, 30, 50)]
    result = text_quality(chunks, logits, [t.clone() for t in logits], gates=TEXT_GATES_4BIT)
    assert result.perplexity_ratio == pytest.approx(1.0, abs=1e-12)
    assert result.kl_divergence == pytest.approx(0.0, abs=1e-12)
    assert result.top1_agreement_text == 1.0 and result.tokens == 70 and result.ok
    # perplexity by hand: exp(mean NLL of the next token over the 39 + 29 predicted positions)
    nll = []
    for ids, out in zip(chunks, logits, strict=True):
        logp = torch.log_softmax(out[0].double(), -1)
        nll += [-float(logp[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]
    assert result.perplexity_eager == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-9)


def test_kl_and_top1_against_a_known_perturbation():
    # two positions, vocab 2: eager p = (0.5, 0.5) twice; artifact q = (0.9, 0.1), then (0.5, 0.5)
    chunks = [torch.tensor([[0, 1]])]
    eager = torch.zeros(1, 2, 2)
    artifact = torch.tensor([[[math.log(0.9), math.log(0.1)], [0.0, 0.0]]])
    result = text_quality(chunks, [eager], [artifact])
    kl0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert result.kl_divergence == pytest.approx(kl0 / 2) and result.kl_divergence_max == pytest.approx(kl0)
    # only position 0 predicts (token 1): eager p = 0.5, artifact 0.1
    assert result.perplexity_ratio == pytest.approx(0.5 / 0.1)
    assert result.top1_agreement_text == 1.0  # argmax ties at position 1 resolve alike; position 0: 0 vs 0


def test_memory_blocks_give_the_same_scores(monkeypatch):
    import hfexport.verify.text as q

    torch.manual_seed(1)
    chunks = [torch.randint(0, 97, (1, 33))]
    eager = [torch.randn(1, 33, 97)]
    artifact = [eager[0] + 0.5 * torch.randn(1, 33, 97)]
    whole = text_quality(chunks, eager, artifact)
    monkeypatch.setattr(q, "_CHUNK", 97 * 4)  # 4 rows per block
    blocked = text_quality(chunks, eager, artifact)
    for name in ("perplexity_ratio", "kl_divergence", "kl_divergence_max", "top1_agreement_text"):
        assert getattr(blocked, name) == pytest.approx(getattr(whole, name), rel=1e-12)


def test_text_gates_defaults_and_overrides():
    assert text_gates_for(DynamoConfig()) is None
    assert text_gates_for(DynamoConfig(dtype="float16")) is None
    assert text_gates_for(DynamoConfig(quantization="int8-weight")) == TEXT_GATES_8BIT
    gates = text_gates_for(DynamoConfig(quantization="int8-weight", quality_gates={"kl_divergence": 0.2}))
    assert gates == {**TEXT_GATES_8BIT, "kl_divergence": 0.2}
    # naming a text gate on an unquantized gated export turns it on there
    assert text_gates_for(DynamoConfig(dtype="float16", quality_gates={"perplexity_ratio": 1.01})) == {
        "perplexity_ratio": 1.01
    }
    # the per-output gates do not change
    assert quality_gates_for(DynamoConfig(quantization="int8-weight")) == {
        "cosine": 0.99,
        "top1_agreement": 0.9,
    }
    with pytest.raises(ValueError, match=r"perplexity_ratio'\]=0.9 is invalid; allowed: a float >= 1.0"):
        text_gates_for(DynamoConfig(quantization="int8-weight", quality_gates={"perplexity_ratio": 0.9}))
    with pytest.raises(ValueError, match=r"kl_divergence'\]=-1 is invalid; allowed: a float >= 0"):
        text_gates_for(DynamoConfig(quantization="int8-weight", quality_gates={"kl_divergence": -1}))


def test_default_text_gates_apply_only_when_the_eager_model_beats_chance():
    # a random-weight model's next-token distributions are near-uniform (perplexity about the
    # vocabulary size): its default text gates are recorded as not applied, named gates still are
    gen = torch.Generator().manual_seed(0)
    vocab, length = 64, 200
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    flat = [0.01 * torch.randn(1, length, vocab, generator=gen)]
    noisy = [flat[0] + 0.05 * torch.randn(1, length, vocab, generator=gen)]
    at_chance = text_quality([ids], flat, noisy, gates=TEXT_GATES_4BIT, default_gates=TEXT_GATES_4BIT)
    assert at_chance.perplexity_eager > CHANCE_PERPLEXITY_FRACTION * vocab
    assert at_chance.top1_agreement_text < TEXT_GATES_4BIT["top1_agreement_text"]  # noise
    assert at_chance.ok and at_chance.gates == {} and at_chance.vocab_size == vocab
    assert "at chance on the text" in at_chance.note and "--gate" in at_chance.note
    # a gate named by the user (not a default) is enforced at chance too
    named = text_quality(
        [ids], flat, noisy, gates=TEXT_GATES_4BIT, default_gates=("kl_divergence", "perplexity_ratio")
    )
    assert not named.ok and named.gates == {"top1_agreement_text": TEXT_GATES_4BIT["top1_agreement_text"]}
    assert [f.split(" = ")[0] for f in named.failures] == ["top1_agreement_text"]
    # an eager model that predicts the text (the next token gets +8 logits) is gated by default
    sharp = flat[0].clone()
    sharp[0, torch.arange(length - 1), ids[0, 1:]] += 8.0
    learned = text_quality([ids], [sharp], noisy, gates=TEXT_GATES_4BIT, default_gates=TEXT_GATES_4BIT)
    assert learned.perplexity_eager < CHANCE_PERPLEXITY_FRACTION * vocab
    assert learned.gates == TEXT_GATES_4BIT and not learned.ok and learned.note == ""
    # what validate_text will apply, known at reference time (the per-output top-1 defers to it)
    from hfexport.quality import TextReference, text_gates_in_force

    def reference(eager):
        return TextReference([ids], [{}], eager, dict(TEXT_GATES_4BIT), default_gates=tuple(TEXT_GATES_4BIT))

    assert text_gates_in_force(reference(flat)) == {}
    assert text_gates_in_force(reference([sharp])) == TEXT_GATES_4BIT
    # which gates are defaults: those the config does not name
    config = DynamoConfig(quantization="8da4w", quality_gates={"top1_agreement": 0.7, "kl_divergence": 0.3})
    assert text_default_gates(config, text_gates_for(config)) == ("perplexity_ratio", "top1_agreement_text")


def test_identical_artifact_passes_and_perturbed_one_fails_naming_metric_and_margin():
    model = _tiny_llama()
    sample = {
        "input_ids": torch.randint(0, 300, (1, 8)),
        "attention_mask": torch.ones(1, 8, dtype=torch.long),
    }
    axes = [
        {"input": "input_ids", "axis": 1, "status": "dynamic", "min": 2, "max": None},
        {"input": "input_ids", "axis": 0, "status": "dynamic", "min": 1, "max": None},
    ]
    plan = plain_text_inputs(model, sample, axes)
    assert not isinstance(plan, str)
    make_inputs, chunking = plan
    assert chunking == {"max_length": 512, "exact": False, "batch": 1}
    ids, source = text_token_ids(None, 300)
    chunks = text_chunks(ids, **chunking)
    assert len(chunks) == math.ceil(ids.numel() / 512)
    reference = text_reference(model, make_inputs, chunks, gates=TEXT_GATES_8BIT, tokenizer=source)

    def same(kwargs):
        with torch.no_grad():
            return {"logits": model(**kwargs).logits}

    result = validate_text(reference, same)
    assert result.perplexity_ratio == pytest.approx(1.0, abs=1e-9)
    assert result.kl_divergence == pytest.approx(0.0, abs=1e-9) and result.top1_agreement_text == 1.0
    assert result.tokens == ids.numel()

    def noisy(kwargs):
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            logits = model(**kwargs).logits
        return {"logits": logits + 3.0 * logits.std() * torch.randn(logits.shape, generator=gen)}

    with pytest.raises(ExportValidationError) as info:
        validate_text(reference, noisy)
    message = str(info.value)
    assert "misses its text quality gates" in message
    assert "kl_divergence = " in message and "(gate <= 0.05, missed by " in message
    assert "top1_agreement_text = " in message and "(gate >= 0.9, missed by " in message
    assert "--gate kl_divergence=" in message
    failed = info.value.table[0]
    kl_missed = failed.kl_divergence - 0.05
    assert f"missed by {kl_missed:.4f}" in message


def test_plain_text_inputs_refuses_caches_and_keeps_static_shapes():
    model = _tiny_llama()
    sample = {
        "input_ids": torch.zeros(2, 16, dtype=torch.long),
        "position_ids": torch.zeros(2, 16, dtype=torch.long),
    }
    make_inputs, chunking = plain_text_inputs(model, sample, [])
    assert chunking == {"max_length": 16, "exact": True, "batch": 2}
    built = make_inputs(torch.ones(2, 16, dtype=torch.long))
    assert torch.equal(built["position_ids"][1], torch.arange(16))
    reason = plain_text_inputs(model, {**sample, "past_key_values": torch.zeros(1)}, [])
    assert isinstance(reason, str) and "past_key_values" in reason
    assert "not a causal LM" in plain_text_inputs(torch.nn.Linear(2, 2), sample, [])


def test_accuracy_level_and_symmetric_options_are_checked():
    from hfexport.config import QuantizationConfig

    with pytest.raises(ValueError, match=r"accuracy_level=7 is invalid; allowed: 0, 1, 2, 3, 4 or None"):
        QuantizationConfig("int4-weight", accuracy_level=7)
    with pytest.raises((TypeError, ValueError), match=r"quantization\.symmetric"):
        QuantizationConfig("int4-weight", symmetric="yes")
    config = QuantizationConfig("int4-weight", symmetric=False, accuracy_level=0)
    assert config.given_options() == ["symmetric", "accuracy_level"]


class _VocabTokenizer:
    """A word-level tokenizer knowing ``known`` words; everything else is its unknown token 0."""

    unk_token_id = 0

    def __init__(self, known: set[str]) -> None:
        self.ids = {word: i + 1 for i, word in enumerate(sorted(known))}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.ids.get(word, 0) for word in text.split()]}


def test_text_outside_the_tokenizers_domain_is_not_gated_by_default(monkeypatch):
    """A protein LM's tokenizer maps English prose to <unk> (IgLM-S: 98%): the text is one token
    repeated, any artifact predicts it, so the default text gates must not replace the sample's
    top-1 gate; gates the user names still apply."""
    import hfexport.verify.text
    from hfexport.exporter import HfExporter
    from hfexport.quality import UNKNOWN_TOKEN_FRACTION, text_coverage_problem
    from hfexport.report import ExportReport

    class _OnlyExport(HfExporter):
        export_format = "dynamo"

        def export(self, model, sample_inputs, config=None, **kwargs):
            raise NotImplementedError

    words = quality_text().split()
    covered = _VocabTokenizer(set(words))
    ids, _ = text_token_ids(covered, len(covered.ids) + 1)
    assert text_coverage_problem(covered, ids) is None
    assert text_coverage_problem(None, ids) is None
    foreign = _VocabTokenizer({"the", "of"})  # a few percent of the words
    ids, _ = text_token_ids(foreign, 3)
    problem = text_coverage_problem(foreign, ids)
    share = float((ids == 0).double().mean())
    assert (
        share > UNKNOWN_TOKEN_FRACTION
        and f"maps {share:.0%} of the quality text to its unknown token" in problem
    )

    model = _tiny_llama()
    monkeypatch.setattr(hfexport.verify.text, "model_tokenizer", lambda model: foreign)
    sample = {"input_ids": torch.randint(0, 3, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    exporter = _OnlyExport()
    report = ExportReport(export_format="dynamo")
    default = DynamoConfig(quantization="int8-weight")
    assert exporter.text_reference(model, sample, default, report) is None
    assert report.extra["text_quality"] == {"skipped": problem}
    assert report.top1_gated_on_text is False
    named = DynamoConfig(quantization="int8-weight", quality_gates={"kl_divergence": 0.2})
    reference = exporter.text_reference(model, sample, named, ExportReport(export_format="dynamo"))
    assert reference is not None and reference.gates == {"kl_divergence": 0.2}


def test_text_is_scored_one_chunk_at_a_time_against_spilled_eager_logits():
    """validate_text drops each chunk's artifact logits before the next chunk runs, and a reference
    built with spill=True holds its eager logits in a temporary file (read back block by block,
    deleted with the reference): the same numbers as a reference that holds them in memory."""
    import gc
    import os
    import weakref

    import hfexport.verify.text as q
    from hfexport.quality import SpilledLogits

    model = _tiny_llama()
    ids, source = text_token_ids(None, 300)
    ids = ids[:300]  # three chunks of 100 (the tiny model is not fast at 512 positions)
    chunks = text_chunks(ids, max_length=100)
    assert len(chunks) == 3
    make_inputs = lambda chunk: {"input_ids": chunk}  # noqa: E731
    stored = text_reference(model, make_inputs, chunks, gates=TEXT_GATES_8BIT, tokenizer=source)
    spilled = text_reference(model, make_inputs, chunks, gates=TEXT_GATES_8BIT, tokenizer=source, spill=True)
    assert all(isinstance(e, torch.Tensor) for e in stored.expected) and stored.spill_folder is None
    assert all(isinstance(e, SpilledLogits) for e in spilled.expected)
    files = [e.path for e in spilled.expected]
    assert all(os.path.getsize(f) == 100 * 300 * 4 for f in files)
    for index, held in enumerate(stored.expected):
        assert torch.equal(spilled.expected_logits(index), held)
    assert torch.equal(spilled.expected[1].flat().rows(98, 105), stored.expected[1][0, 98:])
    # the eager perplexity is measured at reference time either way (text_gates_in_force reads it)
    assert spilled.perplexity_eager == stored.perplexity_eager and spilled.vocab_size == 300
    assert 100 < spilled.perplexity_eager < 1000  # random weights: about the vocabulary size

    alive: list[weakref.ref] = []
    seen: list[int] = []

    def artifact(kwargs):  # reference counting frees a dropped tensor at once (no gc needed)
        assert all(r() is None for r in alive), "a previous chunk's logits are still held"
        seen.append(int(kwargs["input_ids"].shape[1]))
        with torch.no_grad():
            logits = model(**kwargs).logits * 1.01  # not eager: KL > 0
        alive.append(weakref.ref(logits))
        return {"logits": logits}

    blocks: list[int] = []
    rows = SpilledLogits.rows

    def counted(self, start, stop):
        block = rows(self, start, stop)
        blocks.append(block.shape[0])
        return block

    q._CHUNK, chunk = 300 * 16, q._CHUNK  # 16 rows per block
    try:
        SpilledLogits.rows = counted
        streamed = validate_text(spilled, artifact, raise_on_failure=False)
    finally:
        SpilledLogits.rows = rows
        q._CHUNK = chunk
    assert seen == [100, 100, 100]
    assert blocks == ([16] * 6 + [4]) * 3  # the eager side read in row blocks, never a whole chunk
    alive.clear()
    whole = validate_text(stored, artifact, raise_on_failure=False)
    for name in ("perplexity_ratio", "kl_divergence", "kl_divergence_max", "top1_agreement_text"):
        assert getattr(streamed, name) == pytest.approx(getattr(whole, name), rel=1e-12)
    assert streamed.kl_divergence > 0 and streamed.chunks == 3 and streamed.tokens == 300
    folder = spilled.spill_folder.name
    del spilled
    gc.collect()
    assert not os.path.exists(folder)


def test_exports_and_bench_cut_the_text_alike():
    """The exports' text metrics use hfexport bench's chunk length, so both report the same numbers."""
    import inspect

    from hfexport.bench.run import bench_folders
    from hfexport.quality import TEXT_CHUNK_TOKENS

    assert TEXT_CHUNK_TOKENS == 512
    assert inspect.signature(bench_folders).parameters["max_chunk"].default == TEXT_CHUNK_TOKENS
    model = _tiny_llama()
    model.config.max_position_embeddings = 8192
    sample = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    axes = [{"input": "input_ids", "axis": 1, "status": "dynamic", "min": 2, "max": None}]
    _, chunking = plain_text_inputs(model, sample, axes)
    assert chunking["max_length"] == TEXT_CHUNK_TOKENS
