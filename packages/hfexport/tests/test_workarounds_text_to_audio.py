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
from hfexport.registry import apply_patches
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
