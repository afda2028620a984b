"""Structure of the core package, checked on its sources (nothing is imported):

- the import graph of ``hfexport`` is a DAG: every ``import`` / ``from ... import`` of an
  ``hfexport`` module counts as an edge, also inside functions, relative imports resolved;
- the core imports no backend package;
- the modules sit in declared layers (:data:`LAYERS`, lowest first) and no import runs from a
  lower layer back up to a higher one (also inside functions);
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


#: The core's layers, lowest first (issue 26): a module may import its own layer and the ones
#: below, never one above. A module belongs to the layer of its longest matching prefix; ``=name``
#: matches that module alone (a package's ``__init__`` facade that re-exports higher modules).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "records (no torch: errors, names, file formats)",
        (
            "hfexport.__about__", "hfexport.errors", "hfexport.tasks", "hfexport.folder.contents",
            "hfexport.config_flags", "hfexport.utils", "hfexport.environment", "hfexport.memory",
            "hfexport.faults", "hfexport.integrity",
        ),
    ),
    (
        "files, tensors and conventions",
        (
            "hfexport.atomic", "hfexport.cli_logging", "hfexport.tensors", "hfexport.pytree",
            "hfexport.conventions", "hfexport.report", "hfexport.linear_forms", "hfexport.native_output",
            "hfexport.batching",
        ),
    ),
    (
        "configs and registries",
        ("hfexport.config", "hfexport.precision", "hfexport.quantization", "hfexport.registry", "hfexport.layouts"),
    ),
    (
        "services (capture, inputs, verification, generation parts, models)",
        (
            "hfexport.workarounds", "hfexport.capture", "hfexport.inputs", "hfexport.input_checks",
            "hfexport.program_axes", "hfexport.side_probe", "hfexport.sample_inputs", "hfexport.tiny",
            "hfexport.gguf_source", "hfexport.checkpoints", "hfexport.calibration", "hfexport.verify",
            "hfexport.validation", "hfexport.quality", "hfexport.generation",
        ),
    ),
    (
        "the exporter and what drives it",
        (
            "hfexport.exporter", "hfexport.auto", "=hfexport.generation", "hfexport.generation.export",
            "hfexport.generation.persist", "hfexport.generation.support", "hfexport.folder",
            "hfexport.folder.writer", "hfexport.loader",
        ),
    ),
    ("surface (CLI, bench, test helpers, the package facade)", ("=hfexport", "hfexport.cli", "hfexport.bench", "hfexport.testing")),
)  # fmt: skip


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of ``module`` (longest matching prefix; ``=name`` exact), or ``None``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.startswith("="):
                if module == prefix[1:]:
                    return index
                continue
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """``"module:line (layer) -> imported (higher layer)"`` for every import of ``graph`` that runs
    from a lower layer up to a higher one."""
    found = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module)
        for target, line in sorted(targets.items()):
            other = layer_of(target)
            if own is not None and other is not None and other > own:
                found.append(f"{module}:{line} ({LAYERS[own][0]}) -> {target} ({LAYERS[other][0]})")
    return found


def test_every_core_module_has_a_layer_and_no_import_runs_up() -> None:
    graph = import_graph()
    unassigned = sorted(m for m in graph if layer_of(m) is None)
    assert not unassigned, f"modules without a layer in LAYERS: {unassigned}"
    assert layer_of("hfexport.generation") == 4 and layer_of("hfexport.generation.runner") == 3
    violations = upward_imports(graph)
    assert not violations, "imports from a lower layer up:\n" + "\n".join(violations)


def test_the_layer_check_sees_an_upward_import() -> None:
    planted = {"hfexport.config": {"hfexport.exporter": 7}, "hfexport.exporter": {"hfexport.config": 3}}
    assert upward_imports(planted) == [
        "hfexport.config:7 (configs and registries) -> hfexport.exporter (the exporter and what drives it)"
    ]
