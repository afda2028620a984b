"""``pkg:`` model sources: model folders shipped inside installed PyPI packages (real weights)."""

from __future__ import annotations

import json

import pytest

from hfexport.loading import resolve_package_model


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
