"""The import graph of the core and every backend package together, read from their sources: no
import cycle inside a package or across packages (the core's own graph, and that it imports no
backend, are checked in ``packages/hfexport/tests/test_architecture.py``); no production module of
any package imports the test helpers (``hfexport.testing``)."""

from __future__ import annotations

from pathlib import Path

from hfexport.testing.imports import describe_cycles, find_cycles, import_graph, imports_of_test_helpers

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


def test_no_package_imports_the_test_helpers_from_production_code() -> None:
    graph = import_graph(ROOTS)
    assert any(name.startswith("hfexport_onnx.") for name in graph)  # the backends are in the graph
    found = imports_of_test_helpers(graph)
    assert not found, "production code imports the test helpers:\n" + "\n".join(found)


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


def _extra_reads(source: str) -> list[int]:
    """Line numbers where ``source`` reads a value back from some object's ``.extra`` (a subscript
    in load context or ``.extra.get(...)``), other than ``self.extra`` / ``record.extra`` (the
    folder record's top-level keys). ``.extra.setdefault(...)`` appends a note and is allowed."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target = node.func.value
        if not (isinstance(target, ast.Attribute) and target.attr == "extra"):
            continue
        if isinstance(target.value, ast.Name) and target.value.id in ("self", "record"):
            continue
        lines.append(node.lineno)
    return lines


def test_no_report_extra_value_is_read_back_by_code() -> None:
    """issue 26: what a later stage needs is a typed field of ``ExportReport``
    (``hfexport.report.TYPED_FACTS``); ``report.extra`` holds notes nobody reads back."""
    found = {
        str(path.relative_to(REPO)): lines
        for root in ROOTS
        for path in sorted(root.rglob("*.py"))
        if (lines := _extra_reads(path.read_text(encoding="utf-8")))
    }
    assert found == {}
    assert _extra_reads(
        'x = report.extra["dynamic_axes"]\ny = report.extra.get("q")\nreport.extra["a"] = 1\n'
    ) == [1, 2]
