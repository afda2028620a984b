"""The import graph of the core and every backend package together, read from their sources: no
import cycle inside a package or across packages (the core's own graph, and that it imports no
backend, are checked in ``packages/hfexport/tests/test_architecture.py``)."""

from __future__ import annotations

from pathlib import Path

from hfexport.testing.imports import describe_cycles, find_cycles, import_graph

REPO = Path(__file__).resolve().parent.parent
#: the package folders of every workspace member: packages/<dist>/src/<import name>
ROOTS = sorted(p for p in REPO.glob("packages/*/src/*") if (p / "__init__.py").is_file())


def test_every_package_is_scanned() -> None:
    names = {root.name for root in ROOTS}
    assert {
        "hfexport",
        "hfexport_dynamo",
        "hfexport_onnx",
        "hfexport_executorch",
        "hfexport_openvino",
    } <= names


def test_no_import_cycle_in_any_package() -> None:
    graph = import_graph(ROOTS)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe_cycles(graph, cycles))


def test_the_cycle_check_sees_a_backend_cycle(tmp_path) -> None:
    """The check fails on the cycle it was written for (executorch's generation <-> exporter)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "exporter.py").write_text("from pkg import generation as _generation\n")
    (package / "generation.py").write_text("def f():\n    from pkg.exporter import ATTR\n")
    graph = import_graph([package])
    assert describe_cycles(graph, find_cycles(graph)) == [
        "pkg.exporter (line 1) -> pkg.generation (line 2) -> pkg.exporter"
    ]
