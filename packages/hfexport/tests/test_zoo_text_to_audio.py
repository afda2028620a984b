"""The text-to-audio family's tiny builders (issue 28): the types whose generic shrink was
unbuildable, failed eagerly because of our sample inputs, or kept tens of millions of parameters.
Each test builds a tiny model (under a second or two) and runs it eagerly."""

from __future__ import annotations

import torch

from hfexport.testing import shrunk_config, tiny_model


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mimi_codec_upsampling_stays_depthwise_at_the_tiny_width():
    # Mimi's ConvTranspose1d takes groups=upsample_groups (512 = its hidden size by default) over
    # hidden_size channels: kept at 512 it does not divide 64 and the model does not build
    codec = shrunk_config("csm").codec_config
    assert codec.hidden_size == 64 and codec.upsample_groups == 64
    assert shrunk_config("kyutai_speech_to_text").codec_config.upsample_groups == 64


def test_csm_builds_small_and_runs():
    model, inputs = tiny_model("csm", "text-to-audio", check_eager=True)
    assert _params(model) < 2_000_000  # 48.8M at the generic shrink
    with torch.no_grad():
        logits = model(**inputs).logits
    assert tuple(logits.shape) == (2, 8, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_flow_head_condition_dim_follows_the_backbone_width():
    for model_type in ("pocket_tts", "gradium_phonon_tts"):
        config = shrunk_config(model_type)  # refused (condition_dim 1024/768 vs hidden 64) without the preset
        assert config.flow_head_config.condition_dim == config.hidden_size == 64
        model, inputs = tiny_model(model_type, "text-to-audio", check_eager=True)
        with torch.no_grad():
            hidden = model(**inputs).last_hidden_state
        assert tuple(hidden.shape) == (2, 8, 64)


def test_fastspeech2_with_hifigan_ids_index_the_text_model_vocabulary():
    model, inputs = tiny_model("fastspeech2_conformer_with_hifigan", "text-to-audio", check_eager=True)
    vocab = model.config.model_config.vocab_size  # 78 phonemes; the wrapper config has no vocab_size
    assert int(inputs["input_ids"].max()) < vocab and int(inputs["input_ids"].min()) >= 3
    # the derived per-stack dicts shrink with the flat fields (4 + 6 layers of 1536 units otherwise)
    assert model.config.model_config.encoder_config["linear_units"] == 128
    assert len(model.model.encoder.conformer_layers) == 2
    assert _params(model) < 1_000_000  # 26.8M at the generic shrink
    with torch.no_grad():
        waveform = model(**inputs).waveform
    assert waveform.shape[0] == 2 and torch.isfinite(waveform).all()


def test_musicgen_codec_is_small():
    model, inputs = tiny_model("musicgen", "text-to-audio")
    assert model.config.audio_encoder.num_filters == 2
    assert _params(model) < 1_000_000  # 14.7M at the generic shrink, 14M of it the unused EnCodec
    codebooks = model.config.decoder.num_codebooks
    with torch.no_grad():
        logits = model(**inputs).logits
    # one row per (batch item, codebook), as decoder_input_ids [batch * codebooks, seq]
    assert tuple(logits.shape) == (2 * codebooks, 8, model.config.decoder.vocab_size)
