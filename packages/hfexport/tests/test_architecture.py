"""Structure of the core package, checked on its sources (nothing is imported):

- the import graph of ``hfexport`` is a DAG: every ``import`` / ``from ... import`` of an
  ``hfexport`` module counts as an edge, also inside functions, relative imports resolved;
- the core imports no backend package;
- no backend name (``"dynamo"``, ``"onnx"``, ``"executorch"``, ``"hfexport-onnx"``,
  ``"hfexport_dynamo.x"`` ...) appears as a string literal outside the built-in format table:
  the core talks to a backend only through ``HfExporter`` methods.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import hfexport

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
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _imported(
    module: str, is_package: bool, tree: ast.AST, modules: set[str] | None = None
) -> list[tuple[str, int]]:
    """Absolute names of what ``module`` imports, with line numbers (function bodies too).

    ``from pkg import name`` gives ``pkg.name`` when that is one of ``modules`` (a submodule),
    else ``pkg``; without ``modules`` both are listed.
    """
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if modules is None:
                    out.extend([(source, node.lineno), (full, node.lineno)])
                else:
                    out.append((full if full in modules else source, node.lineno))
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported hfexport module: first line importing it}}``.

    The implicit import of parent packages is not an edge (every module would depend on
    ``hfexport/__init__.py``, which only names things lazily).
    """
    modules = _modules()
    names = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imported(name, is_package, ast.parse(path.read_text(encoding="utf-8")), names):
            if target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            nxt = min(t for t in graph[path[-1]] if t in members)
            if nxt in seen:
                cycles.append([*path[path.index(nxt) :], nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def test_the_graph_sees_function_level_and_relative_imports(tmp_path) -> None:
    graph = import_graph()
    # function-level: HfExporter.export_for_generation imports the generation export
    assert "hfexport.generation.export" in graph["hfexport.exporter"]
    # package-level `from hfexport.generation import preparers` is an edge to the submodule
    assert "hfexport.generation.preparers" in graph["hfexport.generation"]
    tree = ast.parse(
        "from . import plan\nfrom ..tensors import x\ndef f():\n    from .runner import Caller\n"
    )
    names = {n for n, _ in _imported("hfexport.generation.persist", False, tree, set(_modules()))}
    assert names == {"hfexport.generation.plan", "hfexport.tensors", "hfexport.generation.runner"}
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]


def test_the_core_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    shown = [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"
        for cycle in cycles
    ]
    assert not cycles, "import cycles in hfexport:\n" + "\n".join(shown)


def test_the_core_imports_no_backend() -> None:
    found = [
        f"{name}:{line} imports {target}"
        for name, (path, is_package) in _modules().items()
        for target, line in _imported(name, is_package, ast.parse(path.read_text(encoding="utf-8")))
        if target.split(".")[0] in {f"hfexport_{b}" for b in BACKENDS}
    ]
    assert not found, "\n".join(found)


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
