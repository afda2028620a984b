"""Structure of the core package, checked on its sources (nothing is imported):

- the import graph of ``hfexport`` is a DAG: every ``import`` / ``from ... import`` of an
  ``hfexport`` module counts as an edge, also inside functions, relative imports resolved;
- the core imports no backend package;
- production code (every module outside ``hfexport.testing``) imports no ``hfexport.testing``
  module: the test helpers are not part of what an export runs;
- no backend name (``"dynamo"``, ``"onnx"``, ``"executorch"``, ``"hfexport-onnx"``,
  ``"hfexport_dynamo.x"`` ...) appears as a string literal outside the built-in format table:
  the core talks to a backend only through ``HfExporter`` methods.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hfexport
from hfexport.testing.imports import (
    describe_cycles,
    find_cycles,
    imported,
    imports_of_test_helpers,
    package_modules,
)
from hfexport.testing.imports import import_graph as _import_graph

ROOT = Path(hfexport.__file__).parent
BACKENDS = ("dynamo", "onnx", "executorch", "openvino")
#: Modules that may name the built-in backends: the built-in format table (``ExportFormat`` in
#: config.py, the install hints of auto.py), the lazy ``from hfexport import DynamoExporter ...``
#: names of __init__.py, and cli.py, whose closed ``BACKENDS`` tuple is being replaced by the
#: open-formats work (issue 10, "Open formats"); remove it from here once that lands.
ALLOWED_BACKEND_NAMES = {"hfexport.config", "hfexport.auto", "hfexport", "hfexport.cli"}
_BACKEND_LITERAL = re.compile(rf"^(?:hfexport[-_])?(?:{'|'.join(BACKENDS)})(?:\.[\w.]+)?$", re.IGNORECASE)
_BACKEND_PACKAGE = re.compile(rf"\bhfexport[-_](?:{'|'.join(BACKENDS)})\b", re.IGNORECASE)


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (path, is_package)}`` of every module of the core."""
    return package_modules([ROOT])


def _imported(
    module: str, is_package: bool, tree: ast.AST, modules: set[str] | None = None
) -> list[tuple[str, int]]:
    return imported(module, is_package, tree, modules)


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported hfexport module: first line importing it}}`` of the core."""
    return _import_graph([ROOT])


def test_the_graph_sees_function_level_and_relative_imports(tmp_path) -> None:
    graph = import_graph()
    # function-level: HfExporter.export_for_generation imports the generation export
    assert "hfexport.generation.export" in graph["hfexport.exporter"]
    # package-level `from hfexport.generation import preparers` is an edge to the submodule
    assert "hfexport.generation.vision_inputs" in graph["hfexport.generation"]
    tree = ast.parse(
        "from . import plan\nfrom ..tensors import x\ndef f():\n    from .runner import Caller\n"
    )
    names = {n for n, _ in _imported("hfexport.generation.persist", False, tree, set(_modules()))}
    assert names == {"hfexport.generation.plan", "hfexport.tensors", "hfexport.generation.runner"}
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]


def test_the_core_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in hfexport:\n" + "\n".join(describe_cycles(graph, cycles))


def test_the_core_imports_no_backend() -> None:
    found = [
        f"{name}:{line} imports {target}"
        for name, (path, is_package) in _modules().items()
        for target, line in _imported(name, is_package, ast.parse(path.read_text(encoding="utf-8")))
        if target.split(".")[0] in {f"hfexport_{b}" for b in BACKENDS}
    ]
    assert not found, "\n".join(found)


def test_production_code_imports_no_test_helper() -> None:
    found = imports_of_test_helpers(import_graph())
    assert not found, "production code imports the test helpers:\n" + "\n".join(found)
    assert imports_of_test_helpers(
        {"hfexport.x": {"hfexport.testing.zoo": 3}, "hfexport.testing": {"hfexport.x": 1}}
    ) == ["hfexport.x:3 imports hfexport.testing.zoo"]
    # the check sees the kind of import it forbids (the one hfexport.checkpoints used to have)
    tree = ast.parse("def f():\n    from hfexport.testing import make_inputs\n")
    assert _imported("hfexport.checkpoints", False, tree, set(_modules())) == [("hfexport.testing", 2)]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def backend_name_literals(source: str) -> list[tuple[int, str]]:
    """``(line, literal)`` of every non-docstring string constant naming a backend."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and (_BACKEND_LITERAL.match(node.value.strip()) or _BACKEND_PACKAGE.search(node.value))
    ]


def test_the_literal_scan_finds_backend_names() -> None:
    source = (
        '"""Docs may say dynamo."""\n'
        'def f(fmt):\n    """Or onnx."""\n'
        '    if fmt != "dynamo":\n        return f"hfexport_{fmt}.generation"\n'
        '    return ("hfexport_executorch.generation", "pip install hfexport-onnx", "ONNX Runtime")\n'
    )
    assert backend_name_literals(source) == [
        (4, "dynamo"),
        (6, "hfexport_executorch.generation"),
        (6, "pip install hfexport-onnx"),
    ]


def test_no_backend_name_literal_in_core_code_outside_the_format_table() -> None:
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {value!r}"
        for name, (path, _) in _modules().items()
        if name not in ALLOWED_BACKEND_NAMES
        for line, value in backend_name_literals(path.read_text(encoding="utf-8"))
    ]
    assert not found, "backend names in core code (use HfExporter methods instead):\n" + "\n".join(found)


def test_verify_imports_nothing_that_imports_it() -> None:
    """issue 26: ``hfexport.verify`` sits below its users. No module it reaches through imports
    (also inside functions) imports a ``verify`` module from outside the package: not the exporter,
    not the compatibility modules ``hfexport.validation`` / ``hfexport.quality`` /
    ``hfexport.generation.second_shape``, not the generation package."""
    graph = import_graph()
    verify = {m for m in graph if m == "hfexport.verify" or m.startswith("hfexport.verify.")}
    assert {"hfexport.verify.compare", "hfexport.verify.gates", "hfexport.verify.sizes"} <= verify
    users = {m for m, targets in graph.items() if m not in verify and verify & set(targets)}
    assert {
        "hfexport.validation",
        "hfexport.quality",
        "hfexport.generation.second_shape",
        "hfexport.exporter",
    } <= users
    reached: dict[str, str] = {}
    stack = sorted(verify)
    while stack:
        module = stack.pop()
        for target in graph.get(module, {}):
            if target not in reached and target not in verify:
                reached[target] = module
                stack.append(target)
    back = sorted(f"{reached[m]} -> {m}" for m in users if m in reached)
    assert not back, "hfexport.verify imports back up into its users:\n" + "\n".join(back)
