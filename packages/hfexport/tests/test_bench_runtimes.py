"""The folder-runtime table of ``hfexport bench``: which runtime opens which folder, and errors."""

from __future__ import annotations

import pytest

from hfexport.bench import runtimes
from hfexport.bench.run import BenchRow, folder_size_bytes
from hfexport.bench.runtimes import FolderRuntime, load_opener, register_folder_runtime, runtime_for


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(runtimes, "_RUNTIMES", dict(runtimes._RUNTIMES))


def test_the_highest_priority_runtime_that_claims_the_folder_opens_it(table, tmp_path):
    (tmp_path / "shape.json").write_text("{}")
    register_folder_runtime(
        FolderRuntime("generic", "any folder", lambda p: True, lambda p, t: None, priority=-50)
    )
    register_folder_runtime(
        FolderRuntime(
            "specific", "shape.json", lambda p: (p / "shape.json").is_file(), lambda p, t: None, priority=50
        )
    )
    assert runtime_for(tmp_path).name == "specific"
    assert runtime_for(tmp_path, "generic").name == "generic"
    (tmp_path / "shape.json").unlink()
    assert runtime_for(tmp_path).name == "generic"


def test_a_folder_nobody_claims_names_its_files_and_the_runtimes(table, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(
        ValueError, match=r"no installed runtime opens .*weights\.bin.*hfexport: a generation folder"
    ):
        runtime_for(tmp_path)
    with pytest.raises(ValueError, match="no folder runtime named 'nope'"):
        runtime_for(tmp_path, "nope")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        runtime_for(tmp_path / "weights.bin")
    with pytest.raises(TypeError, match="takes a FolderRuntime"):
        register_folder_runtime({"name": "x"})  # type: ignore[arg-type]


def test_load_opener_refuses_a_reference_without_a_function():
    with pytest.raises(ValueError, match="is not a 'module:function' reference"):
        load_opener("hfexport.bench.eager")
    assert load_opener("hfexport.bench.eager:open_eager").__name__ == "open_eager"


def test_the_folder_size_leaves_out_reports_and_checksums(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "export_report.json").write_text("{" + " " * 5000 + "}")
    (tmp_path / "checksums.sha256").write_text("y" * 300)
    assert folder_size_bytes(tmp_path) == 1000
    assert BenchRow("f", "r", size_bytes=1).to_dict()["size_bytes"] == 1


def test_a_child_reports_its_own_peak_not_the_parents(tmp_path):
    """Linux carries ru_maxrss across exec: a child started by a parent holding 300 MB reports at
    least that there; peak_rss_bytes reads the child's own high-water mark (VmHWM)."""
    import subprocess
    import sys

    held = bytearray(300 * 2**20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    code = (
        "import resource; from hfexport.bench.child import peak_rss_bytes; "
        "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    own, inherited = map(
        int,
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split(),
    )
    assert inherited >= 300 * 2**20  # what ru_maxrss would have reported
    assert own < 200 * 2**20  # the child itself: an interpreter and the core's bench modules
    assert len(held) == 300 * 2**20


def test_per_position_logits_flattens_a_prefill_and_names_a_last_position_only_graph():
    import numpy as np

    from hfexport.bench.runtimes import per_position_logits

    array, note = per_position_logits(np.ones((1, 5, 7), dtype=np.float64), 5)
    assert array.shape == (5, 7) and array.dtype == np.float32 and note == ""
    array, note = per_position_logits(np.ones((1, 1, 7)), 5)
    assert array is None and note == "the artifact returns logits for 1 of 5 positions"
