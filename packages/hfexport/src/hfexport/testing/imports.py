"""The import graph of installed packages, read from their sources (nothing is imported), for the
architecture tests: ``packages/hfexport/tests/test_architecture.py`` (the core) and
``tests-integration/test_architecture.py`` (the core and every backend together).

Every ``import`` / ``from ... import`` of a module of the scanned packages is an edge, also inside
functions, relative imports resolved; the implicit import of parent packages is not.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "describe_cycles",
    "find_cycles",
    "import_graph",
    "imported",
    "imports_of_test_helpers",
    "package_modules",
]


def package_modules(roots: Iterable[Path]) -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (path, is_package)}`` of every module below the package folders ``roots``.

    Args:
        roots: package folders (``.../src/hfexport``); a module's name starts with its root's name.
    """
    found: dict[str, tuple[Path, bool]] = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            parts = list(path.relative_to(Path(root).parent).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


def imported(
    module: str, is_package: bool, tree: ast.AST, modules: set[str] | None = None
) -> list[tuple[str, int]]:
    """Absolute names of what ``module`` imports, with line numbers (function bodies too).

    Args:
        module: the dotted name of the module ``tree`` was parsed from.
        is_package: whether it is a package's ``__init__``.
        tree: its parsed source.
        modules: known module names; ``from pkg import name`` gives ``pkg.name`` when that is one
            of them (a submodule), else ``pkg``. Without ``modules`` both are listed.

    Returns:
        ``[(imported name, line)]`` in source order.
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


def import_graph(roots: Iterable[Path]) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line importing it}}`` over the packages ``roots``.

    Args:
        roots: package folders, as for :func:`package_modules`.
    """
    modules = package_modules(roots)
    names = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        edges: dict[str, int] = {}
        for target, line in imported(name, is_package, ast.parse(path.read_text(encoding="utf-8")), names):
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


def describe_cycles(graph: dict[str, dict[str, int]], cycles: list[list[str]]) -> list[str]:
    """One line per cycle: ``a (line 3) -> b (line 9) -> a``."""
    return [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"
        for cycle in cycles
    ]


def _in_testing(module: str) -> bool:
    return module == "hfexport.testing" or module.startswith("hfexport.testing.")


def imports_of_test_helpers(graph: dict[str, dict[str, int]]) -> list[str]:
    """``"module:line imports hfexport.testing..."`` for every production module of ``graph`` (any
    module outside ``hfexport.testing``) that imports a module of ``hfexport.testing``."""
    return [
        f"{name}:{line} imports {target}"
        for name, targets in graph.items()
        if not _in_testing(name)
        for target, line in targets.items()
        if _in_testing(target)
    ]
