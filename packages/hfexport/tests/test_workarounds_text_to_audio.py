"""The text-to-audio models' capture workarounds (hfexport.workarounds.text_to_audio, issue 28) and
MusicGen's per-codebook decoder ids in the input-role table.

The length-regulator patch is checked for its registry metadata, for being in place only inside
``apply_patches`` of its scope, for giving transformers' values (edge cases included), and for a
captured program whose frame count follows the durations it is given. Tiny models and toy tensors
only (each case a few seconds).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.fastspeech2_conformer import modeling_fastspeech2_conformer as fastspeech2

from hfexport import registry
from hfexport.conventions.roles import input_role
from hfexport.input_checks import check_input_sizes
from hfexport.registry import apply_patches, isolated_registry
from hfexport.testing import tiny_model
from hfexport.workarounds import text_to_audio

REGULATOR = f"{text_to_audio.__name__}.length_regulator_as_gather"


def test_entry_is_registered_under_the_capture_scope_with_its_source_and_range():
    assert text_to_audio.KEY == "capture.text_to_audio"
    found = {e.name: e for e in registry.entries(text_to_audio.KEY, kind="patch")}
    entry = found[REGULATOR]
    assert entry.paths == text_to_audio.LENGTH_REGULATOR_TARGETS
    assert entry.description and entry.issue.startswith("https://github.com/huggingface/transformers/")
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved


def test_patch_is_in_place_only_inside_its_scope_and_restored_after_an_error():
    original = fastspeech2.length_regulator
    with apply_patches("capture"):  # the parent key alone: not this scope's patch
        assert fastspeech2.length_regulator is original
    with pytest.raises(RuntimeError, match="boom"), apply_patches(text_to_audio.KEY):
        assert fastspeech2.length_regulator is not original
        raise RuntimeError("boom")
    assert fastspeech2.length_regulator is original


def test_capture_key_picks_the_scope_for_fastspeech2_only():
    model, _ = tiny_model("fastspeech2_conformer", "text-to-audio")
    assert text_to_audio.capture_key(model) == text_to_audio.KEY
    assert text_to_audio.capture_key(torch.nn.Sequential(model)) == text_to_audio.KEY
    other, _ = tiny_model("vits", "text-to-audio")
    assert text_to_audio.capture_key(other) == "capture"


@pytest.mark.parametrize(
    ("durations", "speed"),
    [
        ([[0, 2, 1, 0, 3], [1, 0, 0, 0, 0]], 1.0),  # zero durations skip phonemes; a short row is padded
        ([[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]], 1.0),  # all zero: every phoneme gets one frame
        ([[0, 0, 0, 0, 0], [2, 1, 0, 0, 1]], 1.0),  # one row zero, the batch not: that row stays empty
        ([[3, 1, 2, 2, 1], [1, 1, 1, 4, 2]], 0.6),  # the speaking speed rounds the scaled durations
    ],
)
def test_regulated_frames_equal_transformers(durations, speed):
    embeddings = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    durations = torch.tensor(durations)
    want = fastspeech2.length_regulator(embeddings, durations.clone(), speed)
    got = text_to_audio.regulate_lengths(embeddings, durations.clone(), speed)
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape
    assert torch.equal(got, want)


def test_captured_regulator_takes_other_durations_and_phoneme_counts():
    class Regulator(torch.nn.Module):
        def forward(self, embeddings: torch.Tensor, durations: torch.Tensor) -> torch.Tensor:
            return fastspeech2.length_regulator(embeddings, durations)

    embeddings = torch.randn(2, 4, 3)
    durations = torch.tensor([[1, 2, 0, 1], [2, 2, 1, 1]])
    with apply_patches(text_to_audio.KEY):
        program = torch.export.export(
            Regulator(),
            (embeddings, durations),
            dynamic_shapes=(
                {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},
                {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},
            ),
        )
    other = torch.randn(3, 6, 3)
    other_durations = torch.tensor([[4, 0, 1, 2, 0, 3], [1, 1, 1, 1, 1, 1], [0, 0, 2, 0, 0, 0]])
    got = program.module()(other, other_durations)
    want = fastspeech2.length_regulator(other, other_durations.clone())
    assert tuple(got.shape) == (3, 10, 3)
    assert torch.equal(got, want)


def test_musicgen_codes_per_codebook_share_the_batch_with_the_text():
    model, inputs = tiny_model("musicgen", "text-to-audio")
    codebooks = model.config.decoder.num_codebooks
    assert tuple(inputs["decoder_input_ids"].shape) == (2, codebooks, 8)
    role = input_role("decoder_input_ids", 3)
    assert (role.batch_axis, role.sequence_axis, role.sequence) == (0, 2, "decoder")
    check_input_sizes(inputs)  # refused ("disagree on the text batch") with [batch * codebooks, seq]
    flat = dict(inputs, decoder_input_ids=inputs["decoder_input_ids"].reshape(2 * codebooks, 8))
    with torch.no_grad():  # the decoder reads both forms alike
        assert torch.equal(model(**inputs).logits, model(**flat).logits)


# --- random draws the executorch / openvino lowerings lack (SpeechT5's prenet, VITS's noise) ----


def test_bernoulli_from_uniform_is_exact_at_0_and_1_and_draws_p_otherwise():
    x = torch.randn(4, 6)
    assert torch.equal(text_to_audio.bernoulli_from_uniform(x, 0.0), torch.zeros_like(x))
    assert torch.equal(text_to_audio.bernoulli_from_uniform(x, 1.0), torch.ones_like(x))
    torch.manual_seed(0)
    draws = text_to_audio.bernoulli_from_uniform(torch.empty(200, 200), 0.3)
    assert set(draws.unique().tolist()) == {0.0, 1.0}
    assert abs(float(draws.mean()) - 0.3) < 0.01  # 40000 draws: standard error 0.0023
    probabilities = torch.tensor([0.0, 1.0]).repeat(50)
    assert torch.equal(text_to_audio.bernoulli_from_uniform(probabilities), probabilities)


def test_normal_from_uniform_is_standard_normal_and_finite():
    torch.manual_seed(0)
    draws = text_to_audio.normal_from_uniform((200, 200))
    assert draws.dtype == torch.float32 and torch.isfinite(draws).all()
    assert abs(float(draws.mean())) < 0.02 and abs(float(draws.std()) - 1.0) < 0.02
    assert text_to_audio.normal_from_uniform((3, 2), torch.float64).dtype == torch.float64


class _Noisy(torch.nn.Module):
    def forward(self, x):
        mask = torch.bernoulli(x[0], p=0.0)  # SpeechT5's prenet: zeros at p 0
        noise = torch.randn(x.size(0), 2, x.size(1)).to(x.dtype)  # VITS's duration noise
        return x * mask + torch.randn_like(x) * 0.0 + noise.sum(1) * 0.0


def test_registered_translations_leave_no_bernoulli_or_randn_in_the_program():
    original = (torch.bernoulli, torch.randn, torch.randn_like)
    x = torch.randn(3, 5)
    with isolated_registry():
        text_to_audio.register_bernoulli_as_uniform(
            "demo", issue="https://github.com/o/r/issues/1", versions={"torch": ">=2"}
        )
        text_to_audio.register_normal_from_uniform(
            "demo", issue="https://github.com/o/r/issues/1", versions={"torch": ">=2"}
        )
        assert {e.paths for e in registry.entries("demo")} == {
            ("torch.bernoulli",),
            ("torch.randn", "torch.randn_like"),
        }
        with apply_patches("demo"):
            assert torch.bernoulli is not original[0]
            assert torch.equal(_Noisy()(x), torch.zeros_like(x))
            program = torch.export.export(
                _Noisy(), (x,), dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
            )
        assert (torch.bernoulli, torch.randn, torch.randn_like) == original
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("bernoulli" in t or "randn" in t for t in targets), targets
    assert torch.equal(program.module()(torch.randn(4, 7)), torch.zeros(4, 7))


def test_backends_register_the_translations_where_their_lowering_lacks_the_ops():
    import importlib

    installed = []
    for backend in ("executorch", "openvino"):
        try:
            importlib.import_module(f"hfexport_{backend}")
        except ImportError:
            continue
        installed.append(backend)
    bernoulli = {e.backend for e in registry.entries(kind="patch") if e.paths == ("torch.bernoulli",)}
    normal = {
        e.backend for e in registry.entries(kind="patch") if e.paths == ("torch.randn", "torch.randn_like")
    }
    assert set(installed) <= bernoulli and set(installed) <= normal
    assert not {"dynamo", "onnx", "capture"} & (bernoulli | normal)
