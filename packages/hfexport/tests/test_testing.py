"""Tests of hfexport.testing: the tiny-model zoo (:mod:`hfexport.tiny`, re-exported) and the shared-case
loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfexport.testing import (
    CASES_DIR_ENV,
    SUPPORTED_MODEL_TYPES,
    TASK_TO_AUTO_CLASS,
    auto_class_name,
    default_task,
    find_cases_dir,
    list_cases,
    load_case,
    make_inputs,
    shrunk_config,
    supported_tasks,
    tiny_model,
    tiny_model_from_case,
)

CAUSAL_LMS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "gpt_neox", "opt", "mixtral")
ENCODERS = ("bert", "roberta", "distilbert")
REQUIRED = (*CAUSAL_LMS, *ENCODERS, "t5", "bart", "vit", "whisper", "wav2vec2", "qwen2_vl")

# model_type -> (output attribute, shape for batch b and sequence s) of the default task
EXPECTED_OUTPUT = {
    **{mt: ("logits", lambda b, s: (b, s, 256)) for mt in CAUSAL_LMS},
    **{mt: ("last_hidden_state", lambda b, s: (b, s, 64)) for mt in ENCODERS},
    "t5": ("logits", lambda b, s: (b, s, 256)),
    "bart": ("logits", lambda b, s: (b, s, 256)),
    "vit": ("logits", lambda b, s: (b, 3)),
    "whisper": ("logits", lambda b, s: (b, s, 256)),
    "wav2vec2": ("logits", lambda b, s: (b, s, 32)),
    "qwen2_vl": ("logits", lambda b, s: (1, 12, 256)),
}

EXPECTED_INPUTS = {
    **{mt: {"input_ids": (2, 8), "attention_mask": (2, 8)} for mt in (*CAUSAL_LMS, *ENCODERS)},
    "t5": {"input_ids": (2, 8), "attention_mask": (2, 8), "decoder_input_ids": (2, 8)},
    "bart": {"input_ids": (2, 8), "attention_mask": (2, 8), "decoder_input_ids": (2, 8)},
    "vit": {"pixel_values": (2, 3, 32, 32)},
    "whisper": {"input_features": (2, 16, 64), "decoder_input_ids": (2, 8)},
    # 8 frames after conv kernels (10, 3) and strides (5, 2): (8 - 1) * 2 + 3 = 17, (17 - 1) * 5 + 10 = 90
    "wav2vec2": {"input_values": (2, 90), "attention_mask": (2, 90)},
    "qwen2_vl": {
        "input_ids": (1, 12),
        "attention_mask": (1, 12),
        "pixel_values": (16, 1176),
        "image_grid_thw": (1, 3),
        "mm_token_type_ids": (1, 12),
    },
}


def _run(model: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    with torch.no_grad():
        return model(**inputs)


def _assert_same_inputs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def _assert_ids_avoid_special_tokens(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """Random token ids lie in [3, vocab); special ids fit the vocabulary; masks are int64 ones."""
    text = model.config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(text, attr, None)
        for token in value if isinstance(value, list) else [value]:
            assert token is None or 0 <= token < vocab, (attr, token)
    if "input_ids" in inputs:
        ids = inputs["input_ids"]
        if model.config.model_type == "qwen2_vl":
            ids = ids[inputs["mm_token_type_ids"] == 0]
            ids = ids[(ids < 250) | (ids > 253)]  # vision start/end are placed on purpose
        assert ids.dtype == torch.int64
        assert int(ids.min()) >= 3 and int(ids.max()) < vocab
    if "decoder_input_ids" in inputs:
        decoder_ids = inputs["decoder_input_ids"]
        assert decoder_ids[:, 0].tolist() == [model.config.decoder_start_token_id] * decoder_ids.shape[0]
        assert int(decoder_ids[:, 1:].min()) >= 3 and int(decoder_ids.max()) < vocab
    if "attention_mask" in inputs:
        assert inputs["attention_mask"].dtype == torch.int64
        assert bool((inputs["attention_mask"] == 1).all())


def test_required_architectures_are_supported():
    assert set(REQUIRED) <= set(SUPPORTED_MODEL_TYPES)
    assert set(EXPECTED_OUTPUT) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_tiny_model_builds_runs_and_is_deterministic(model_type):
    model, inputs = tiny_model(model_type)
    again, inputs_again = tiny_model(model_type)

    assert not model.training
    assert {k: tuple(v.shape) for k, v in inputs.items()} == EXPECTED_INPUTS[model_type]
    _assert_same_inputs(inputs, inputs_again)
    state, state_again = model.state_dict(), again.state_dict()
    assert list(state) == list(state_again)
    for name in state:
        assert torch.equal(state[name], state_again[name]), name
    assert sum(p.numel() for p in model.parameters()) < 2_000_000

    attr, shape = EXPECTED_OUTPUT[model_type]
    out = getattr(_run(model, inputs), attr)
    assert tuple(out.shape) == shape(2, 8)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(getattr(_run(again, inputs_again), attr), out, rtol=0, atol=0)

    _assert_ids_avoid_special_tokens(model, inputs)

    # a second input shape, as validation uses it: batch 1, 256 tokens (the longest other tests use)
    second = make_inputs(model, batch_size=1, seq_len=256, seed=1)
    out2 = getattr(_run(model, second), attr)
    assert tuple(out2.shape) == shape(1, 256)
    assert torch.isfinite(out2).all()


def test_seed_changes_weights_and_inputs():
    model0, inputs0 = tiny_model("llama", seed=0)
    model1, inputs1 = tiny_model("llama", seed=1)
    w0 = model0.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    w1 = model1.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert w0.shape == w1.shape == (64, 64)
    assert not torch.equal(w0, w1)
    assert not torch.equal(inputs0["input_ids"], inputs1["input_ids"])


def test_make_inputs_does_not_touch_global_rng():
    model, _ = tiny_model("bart")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_inputs(model, batch_size=3, seq_len=5, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_seq2seq_and_whisper_decoder_starts_with_start_token():
    for model_type, start in (("t5", 0), ("bart", 2), ("whisper", 1)):
        model, inputs = tiny_model(model_type, batch_size=3, seq_len=5)
        assert model.config.decoder_start_token_id == start
        assert inputs["decoder_input_ids"][:, 0].tolist() == [start] * 3


def test_qwen2_vl_image_layout():
    _, inputs = tiny_model("qwen2_vl", batch_size=4, seq_len=99)  # layout is fixed
    ids = inputs["input_ids"][0]
    assert ids[3].item() == 252 and ids[8].item() == 253
    assert ids[4:8].tolist() == [250] * 4
    others = torch.cat([ids[:3], ids[9:]])
    assert bool(((others >= 3) & (others < 250)).all())
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["pixel_values"].dtype == torch.float32


@pytest.mark.parametrize(
    ("model_type", "task", "class_name", "attr", "shape"),
    [
        ("bert", "fill-mask", "BertForMaskedLM", "logits", (2, 8, 256)),
        ("roberta", "text-classification", "RobertaForSequenceClassification", "logits", (2, 3)),
        ("distilbert", "fill-mask", "DistilBertForMaskedLM", "logits", (2, 8, 256)),
        ("qwen2", "text-classification", "Qwen2ForSequenceClassification", "logits", (2, 3)),
        ("llama", "feature-extraction", "LlamaModel", "last_hidden_state", (2, 8, 64)),
        ("vit", "feature-extraction", "ViTModel", "last_hidden_state", (2, 17, 64)),
    ],
)
def test_other_tasks(model_type, task, class_name, attr, shape):
    model, inputs = tiny_model(model_type, task)
    assert type(model).__name__ == class_name
    assert tuple(getattr(_run(model, inputs), attr).shape) == shape


def test_task_tables():
    assert default_task("llama") == "text-generation"
    assert default_task("bert") == "feature-extraction"
    assert default_task("t5") == "text2text-generation"
    assert default_task("vit") == "image-classification"
    assert default_task("whisper") == "automatic-speech-recognition"
    assert default_task("qwen2_vl") == "image-text-to-text"
    assert auto_class_name("whisper") == "AutoModelForSpeechSeq2Seq"
    assert auto_class_name("wav2vec2") == "AutoModelForCTC"
    assert auto_class_name("bert", "fill-mask") == "AutoModelForMaskedLM"
    assert TASK_TO_AUTO_CLASS["text-generation"] == "AutoModelForCausalLM"
    # a hand-written preset's own tasks first, then the head tasks transformers has classes for
    assert supported_tasks("roberta") == (
        "feature-extraction",
        "fill-mask",
        "text-classification",
        "token-classification",
        "question-answering",
    )
    assert supported_tasks("whisper")[-1] == "audio-classification"
    assert auto_class_name("wav2vec2", "audio-classification") == "AutoModelForAudioClassification"
    assert (
        auto_class_name("clip", "zero-shot-image-classification") == "AutoModelForZeroShotImageClassification"
    )


def test_attention_implementation_defaults():
    gemma, _ = tiny_model("gemma2")
    llama, _ = tiny_model("llama")
    eager, _ = tiny_model("llama", attn_implementation="eager")
    assert gemma.config._attn_implementation == "eager"  # no SDPA path in transformers 5.24
    assert llama.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"


def test_shrunk_config_values_and_overrides():
    mixtral = shrunk_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert shrunk_config("phi3").pad_token_id == 0
    assert shrunk_config("gemma2").sliding_window == 32
    whisper = shrunk_config("whisper")
    assert (whisper.max_source_positions, whisper.max_target_positions, whisper.num_mel_bins) == (32, 448, 16)
    for model_type in ("llama", "qwen2", "bert", "bart", "opt", "phi3"):
        assert shrunk_config(model_type).max_position_embeddings >= 512, model_type
    assert shrunk_config("gpt2").n_positions >= 512
    assert shrunk_config("llama", num_hidden_layers=3).num_hidden_layers == 3
    vl = shrunk_config("qwen2_vl", text_config={"num_hidden_layers": 1})
    assert vl.text_config.num_hidden_layers == 1
    assert vl.text_config.hidden_size == 64  # the rest of the sub-config is kept
    model, inputs = tiny_model("llama", vocab_size=512)
    assert model.config.vocab_size == 512
    assert tuple(_run(model, inputs).logits.shape) == (2, 8, 512)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match="unknown model_type 'nope'") as info:
        tiny_model("nope")
    for model_type in REQUIRED:
        assert model_type in str(info.value)
    with pytest.raises(ValueError, match="llama, qwen2"):
        shrunk_config("nope")


def test_unknown_or_unsupported_task():
    with pytest.raises(ValueError, match="unknown task 'translation'") as info:
        tiny_model("llama", "translation")
    assert "text-generation" in str(info.value) and "image-text-to-text" in str(info.value)
    with pytest.raises(ValueError, match="its tasks: image-classification, feature-extraction"):
        tiny_model("vit", "text-generation")


def test_make_inputs_rejects_bad_sizes():
    model, _ = tiny_model("gpt2")
    with pytest.raises(ValueError, match="must be >= 1"):
        make_inputs(model, batch_size=0, seq_len=4)


# ---------------------------------------------------------------------------------------- cases

CASE_NAMES = [case.name for case in list_cases()]

# case name -> logits shape of (sample, second) inputs
EXPECTED_CASE_LOGITS = {
    "C01-mixtral-moe": ((2, 6, 128), (3, 11, 128)),
    "C04-qwen2vl-vision-grid": ((1, 12, 256), None),
    "C06-gqa-sdpa-no-mask": ((1, 7, 256), (2, 12, 256)),
    # conv (kernel 10, stride 5) then (3, 2): 1600 -> 319 -> 159; 2400 -> 479 -> 239
    "C08-wav2vec2-ctc": ((1, 159, 32), (2, 239, 32)),
    "C09-left-padding": ((2, 8, 256), (3, 10, 256)),
    "C12-t5-padded": ((2, 3, 128), (1, 4, 128)),
}


def test_find_cases_dir_defaults_to_shared_next_to_repo(monkeypatch):
    monkeypatch.delenv(CASES_DIR_ENV, raising=False)
    found = find_cases_dir()
    assert found.name == "cases" and found.parent.name == "shared"
    assert (found / "C09-left-padding.toml").is_file()
    assert set(CASE_NAMES) >= set(EXPECTED_CASE_LOGITS)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_loads_builds_and_runs(name):
    case = load_case(name)
    assert case.name == name
    assert case.backends and set(case.backends) <= {"dynamo", "onnx", "executorch"}
    assert "atol" in case.expect
    model = case.build_model()
    assert not model.training
    assert type(model).__name__ != "" and model.config.model_type == case.model_type
    sample, second = case.sample_inputs(model), case.second_inputs(model)
    _assert_same_inputs(sample, case.sample_inputs())
    if second is not None:
        _assert_same_inputs(second, case.second_inputs())

    weights = next(iter(model.state_dict().values()))
    assert torch.equal(weights, next(iter(case.build_model().state_dict().values())))

    expected = EXPECTED_CASE_LOGITS.get(name)
    for inputs, shape in zip((sample, second), expected or (None, None)):
        if inputs is None:
            assert shape is None
            continue
        logits = _run(model, inputs).logits
        assert torch.isfinite(logits).all()
        if shape is not None:
            assert tuple(logits.shape) == shape


def test_case_fields_and_spec_values():
    c09 = load_case("C09")
    assert c09.name == "C09-left-padding"
    assert (c09.model_type, c09.auto_class, c09.dynamic) == ("qwen2", "AutoModelForCausalLM", True)
    assert c09.config["num_key_value_heads"] == 2
    sample = c09.sample_inputs()
    assert sample["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8]
    assert sample["input_ids"].dtype == torch.int64
    assert int(sample["input_ids"].min()) >= 0 and int(sample["input_ids"].max()) < 256
    assert c09.second_inputs()["attention_mask"].tolist()[1] == [0] + [1] * 9

    c06 = load_case("C06-gqa-sdpa-no-mask")
    assert c06.attn_implementation == "sdpa"
    assert list(c06.sample_inputs()) == ["input_ids"]  # the note is not an input
    assert c06.build_model().config._attn_implementation == "sdpa"

    c01 = load_case("C01")
    assert c01.sample_inputs()["attention_mask"].tolist() == [[1] * 6] * 2
    c08 = load_case("C08")
    assert c08.sample_inputs()["input_values"].dtype == torch.float32


def test_c12_padding_rows():
    case = load_case("C12-t5-padded")
    sample = case.sample_inputs()
    ids, mask = sample["input_ids"], sample["attention_mask"]
    assert tuple(ids.shape) == (2, 16)
    assert ids[0, 5:].tolist() == [0] * 11
    assert bool((ids[0, :5] >= 1).all()) and bool((ids[1] >= 1).all())
    assert int(ids.max()) < 128
    assert mask.tolist() == [[1] * 5 + [0] * 11, [1] * 16]
    assert tuple(sample["decoder_input_ids"].shape) == (2, 3)
    second = case.second_inputs()
    assert tuple(second["input_ids"].shape) == (1, 9)
    assert bool((second["input_ids"] >= 1).all())
    assert second["attention_mask"].tolist() == [[1] * 9]
    assert tuple(second["decoder_input_ids"].shape) == (1, 4)


def test_c04_image_layout():
    case = load_case("C04")
    sample = case.sample_inputs()
    assert case.second_inputs() is None
    assert tuple(sample["pixel_values"].shape) == (16, 1176)
    assert sample["pixel_values"].dtype == torch.float32
    assert sample["image_grid_thw"].tolist() == [[1, 4, 4]]
    ids = sample["input_ids"][0].tolist()
    assert ids[3:9] == [252, 250, 250, 250, 250, 253]
    assert all(3 <= t < 240 for t in ids[:3] + ids[9:])
    assert sample["mm_token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert sample["mm_token_type_ids"].dtype == torch.int64


def test_tiny_model_accepts_a_case():
    model, inputs = tiny_model("case:C09-left-padding")
    ref_model, ref_inputs = tiny_model_from_case(load_case("C09-left-padding"))
    _assert_same_inputs(inputs, ref_inputs)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[name], ref_model.state_dict()[name])
    with pytest.raises(ValueError, match="takes no task"):
        tiny_model("case:C09", "text-generation")


def test_the_tiny_models_and_sample_inputs_are_the_cores_and_only_tests_build_a_case():
    from hfexport import sample_inputs, tiny
    from hfexport.testing import zoo

    assert (make_inputs, default_task, zoo.shrunk_config) == (
        sample_inputs.make_inputs,
        tiny.default_task,
        tiny.shrunk_config,
    )
    model, inputs = tiny.tiny_model("llama")  # what --model tiny:llama builds
    ref_model, ref_inputs = tiny_model("llama")
    _assert_same_inputs(inputs, ref_inputs)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[name], ref_model.state_dict()[name])
    # the shared cases are test data: the core's factory does not know them
    with pytest.raises(tiny.UnknownModelTypeError, match=r"unknown model_type 'case:C09'"):
        tiny.tiny_model("case:C09")


def test_list_cases_by_backend():
    all_cases = list_cases()
    assert [c.name for c in all_cases] == sorted(c.name for c in all_cases)
    assert {c.name for c in list_cases("dynamo")} == {c.name for c in all_cases if "dynamo" in c.backends}
    assert list_cases("no-such-backend") == []


def test_load_case_errors_and_env_dir(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="available: C01-mixtral-moe"):
        load_case("C99")
    _write_case(tmp_path, "C0-a")
    _write_case(tmp_path, "C0-b")
    with pytest.raises(ValueError, match="several cases"):
        load_case("C0", cases_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        load_case(tmp_path / "missing.toml")

    monkeypatch.setenv(CASES_DIR_ENV, str(tmp_path))
    assert find_cases_dir() == tmp_path
    assert [c.name for c in list_cases()] == ["C0-a", "C0-b"]
    case = load_case("C0-a")
    inputs = case.sample_inputs()
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert tuple(inputs["input_ids"].shape) == (1, 4)
    with pytest.raises(NotImplementedError, match="free text"):
        case.second_inputs()

    monkeypatch.setenv(CASES_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=CASES_DIR_ENV):
        find_cases_dir()


def _write_case(directory: Path, name: str) -> None:
    (directory / f"{name}.toml").write_text(
        'pattern = "p"\nmodel_type = "llama"\nauto_class = "AutoModelForCausalLM"\nbackends = ["dynamo"]\n'
        "[config]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 1\n"
        "num_attention_heads = 2\npad_token_id = 0\n"
        "[inputs]\ninput_ids = { rows = [[5, 6, 7, 0]] }\nattention_mask = { rows_from_padding = true }\n"
        '[second_inputs]\ninput_ids = { note = "something only a person can build" }\n'
        "[expect]\natol = 1e-4\n"
    )


def test_generation_config_for_each_cache_kind():
    from hfexport.testing.generation import generation_config_for

    assert generation_config_for("dynamic") is None
    static = generation_config_for("static", max_cache_len=40)
    assert (static.cache_implementation, static.max_cache_len) == ("static", 40)
    with pytest.raises(ValueError, match="cache must be one of dynamic, static, not 'sliding'"):
        generation_config_for("sliding")


def test_worst_validation_returns_the_worst_diff_and_refuses_a_failed_run():
    from types import SimpleNamespace

    from hfexport.testing.generation import worst_validation

    ok = SimpleNamespace(
        validation={"sample": [{"ok": True, "max_abs_diff": 1e-6}, {"ok": True, "max_abs_diff": 3e-6}]}
    )
    assert worst_validation(SimpleNamespace(reports={"decode": ok})) == {"decode.sample": 3e-6}
    bad = SimpleNamespace(validation={"decode_q4": [{"ok": False, "max_abs_diff": 0.5}]})
    with pytest.raises(AssertionError, match="decode_q4"):
        worst_validation(SimpleNamespace(reports={"decode": ok, "prefill": bad}))
