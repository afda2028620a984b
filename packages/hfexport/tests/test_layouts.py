"""The runtime-layout table (hfexport.layouts): registration, lookup and the pre-capture checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfexport import layouts as lay


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(lay, "_LAYOUTS", {})
    lay.register_layout(
        lay.Layout(
            name="gen",
            export_format="fmt",
            tasks=("text-generation",),
            runtime="some-runtime",
            description="d",
            writer=lambda request: {"wrote": request.task},
            needs_tokenizer=True,
            check=lambda model, task: "the cache is not causal" if model == "seq2seq" else None,
        )
    )
    lay.register_layout(
        lay.Layout(
            name="embed",
            export_format="fmt",
            tasks=("feature-extraction",),
            runtime="r2",
            description="d",
            writer="json:dumps",
        )
    )


def test_unknown_layout_names_the_format_layouts_and_other_formats(table):
    with pytest.raises(
        ValueError, match=r"unknown layout 'gen' for other; other layouts: none; 'gen' is a layout of fmt"
    ):
        lay.get_layout("other", "gen")
    with pytest.raises(ValueError, match=r"fmt layouts: embed, gen"):
        lay.get_layout("fmt", "nope")


def test_task_and_model_refusals_name_the_layouts_that_fit(table):
    with pytest.raises(
        ValueError,
        match=r"serves tasks text-generation, not 'feature-extraction'; layouts of fmt that fit: embed",
    ):
        lay.check_layout("fmt", "gen", model="m", task="feature-extraction")
    with pytest.raises(ValueError, match=r"the cache is not causal; no fmt layout fits"):
        lay.check_layout("fmt", "gen", model="seq2seq", task="text-generation")


def test_missing_tokenizer_says_which_files_to_add(table, tmp_path: Path):
    with pytest.raises(ValueError, match=r"add tokenizer.json \(and tokenizer_config.json\)"):
        lay.check_layout("fmt", "gen", model="m", task="text-generation", files=[tmp_path / "config.json"])
    found = lay.check_layout(
        "fmt", "gen", model="m", task="text-generation", files=[tmp_path / "tokenizer.json"]
    )
    assert found.resolve_writer()(type("R", (), {"task": "t"})()) == {"wrote": "t"}


def test_lazy_writer_and_conflicting_registration(table):
    import json

    assert lay.get_layout("fmt", "embed").resolve_writer() is json.dumps
    with pytest.raises(ValueError, match="already registered for 'fmt'"):
        lay.register_layout(
            lay.Layout(
                name="embed", export_format="fmt", tasks=(), runtime="x", description="", writer="os:getcwd"
            )
        )
    assert [x.name for x in lay.layouts("fmt")] == ["embed", "gen"]
