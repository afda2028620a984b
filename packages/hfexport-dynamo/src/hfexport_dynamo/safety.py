"""Inspect a ``.pt2`` archive for content that would run code, before torch loads it.

``torch.export.load`` (torch 2.13) trusts the file it reads:

- the sample inputs (``data/sample_inputs/<model>.pt``) are read with a weights-only
  ``torch.load`` and, when that fails, silently again with ``weights_only=False``, i.e. full
  unpickling, which runs whatever a ``__reduce__`` in the file asks for;
- pickled weights and constants (``use_pickle`` entries of the payload configs) are read with
  ``weights_only=False`` directly, "opaque" constants with ``pickle.loads`` and TorchScript objects
  with the TorchScript unpickler;
- an ``data/aotinductor/`` folder is loaded as a compiled shared library;
- graph node targets are resolved by walking attributes from ``torch`` (so any callable reachable
  from ``torch`` can become a node), shape expressions are parsed with ``sympy.sympify`` (which
  evaluates Python) and ``guards_code`` strings are compiled into the module ``module()`` returns.

:func:`inspect_pt2` reads the archive without loading anything and lists every member or
value that falls outside what ``torch.export.save`` writes for an ordinary program: pickles must
load with the weights-only unpickler, node targets must be operators (``torch.ops.*``, the
``_operator``/``math`` functions symbolic shapes use, ``torch.sym_*``), shape expressions and
guards must be arithmetic over shape symbols. :func:`hfexport_dynamo.load` refuses a file with
any finding unless the caller passes ``trust_remote_code=True``.

The checks follow the archive layout of ``torch.export.save`` in torch 2.12/2.13 (members under
one root folder: ``archive_format``, ``archive_version``, ``byteorder``, ``.data/version``,
``.data/serialization_id``, ``models/<model>.json``, ``data/weights/...``, ``data/constants/...``,
``data/sample_inputs/<model>.pt``, ``extra/...``); a member of any other kind is reported, so a
newer layout is refused rather than trusted.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import math
import re
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import torch

__all__ = ["inspect_pt2"]

logger = logging.getLogger(__name__)

_METADATA_MEMBERS = frozenset(
    {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
)
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_OPS_TARGET = re.compile(rf"torch\.ops\.({_IDENT})\.({_IDENT})(?:\.({_IDENT}))?")
# aten's bitwise operators keep their Python dunder names (aten::__and__, aten::__ilshift__, ...)
_DUNDER_OPS = re.compile(r"__i?(and|or|xor|lshift|rshift)__")
_SYM_TARGET = re.compile(r"torch\._?sym_[a-z_]+")
# operator functions symbolic-shape nodes call (torch's _SYM_OPS) plus getitem
_OPERATOR_FUNCTIONS = frozenset(
    {
        "eq", "ne", "le", "ge", "lt", "gt", "neg", "pos", "not_", "mul", "add", "sub", "floordiv",
        "mod", "pow", "truediv", "and_", "or_", "xor", "lshift", "rshift", "getitem", "abs", "invert",
    }
)  # fmt: skip
# shape symbols as torch names them: s0, u12, zf3, ps1, ...
_SYMBOL = re.compile(r"[a-z]{1,3}[0-9]+")
_SYMPY_NAMES = frozenset(
    {
        "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Max", "Min", "Abs", "Mod", "Integer",
        "Rational", "Float", "Piecewise", "ITE", "oo", "zoo", "nan", "true", "false", "True", "False",
        "floor", "ceiling", "sqrt", "Mul", "Add", "Pow", "Symbol", "StrictLessThan", "StrictGreaterThan",
        "LessThan", "GreaterThan", "Equality", "Unequality", "BooleanTrue", "BooleanFalse", "Infinity",
        "NegativeInfinity", "One", "Zero", "NegativeOne", "Half",
    }
)  # fmt: skip
_SYMPY_ASSUMPTIONS = frozenset(
    {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero", "nonzero"}
)
_GUARD_NAMES = frozenset({"L", "max", "min", "abs", "int", "float", "bool", "round", "math", "torch"})
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "numel", "dim"})


def _torch_sympy_names() -> frozenset[str]:
    """Names of the sympy functions torch defines for shape expressions (FloorDiv, CeilToInt, ...)."""
    import torch.utils._sympy.functions as functions

    return frozenset(
        name for name, value in vars(functions).items() if isinstance(value, type) and name[:1].isupper()
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = next((line for line in text if "Unsupported global" in line or "GLOBAL" in line), None)
    return f"{type(exc).__name__}: {(detail or (text[0] if text else '')).strip()}"[:300]


def _weights_only_problem(data: bytes, member: str) -> str | None:
    """Load a ``torch.save`` payload with the weights-only unpickler; describe a refusal."""
    if not data:  # torch.export.save writes an empty record for a program without sample inputs
        return None
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        return (
            f"{member}: pickle refused by the weights-only unpickler ({_first_line(exc)}); "
            "torch.export.load would unpickle it in full"
        )
    return None


# --------------------------------------------------------------------------------------------
# graph JSON
# --------------------------------------------------------------------------------------------


def _target_problem(target: str) -> str | None:
    """Why a serialized node target is not an operator, or ``None`` when it is one."""
    match = _OPS_TARGET.fullmatch(target)
    if match:
        namespace = match.group(1)
        registered = vars(torch.ops).get(namespace)
        if (
            namespace.startswith("__")
            or (match.group(2).startswith("__") and not _DUNDER_OPS.fullmatch(match.group(2)))
            or (match.group(3) or "").startswith("__")
            or namespace in dir(type(torch.ops))
            or (registered is not None and "Namespace" not in type(registered).__name__)
        ):
            return f"node target {target!r} is not an operator"
        return None
    if _SYM_TARGET.fullmatch(target):
        return (
            None if callable(getattr(torch, target.split(".", 1)[1], None)) else f"unknown target {target!r}"
        )
    module, _, name = target.partition(".")
    if module == "_operator" and name in _OPERATOR_FUNCTIONS:
        return None
    if module == "math" and re.fullmatch(r"[a-z][a-z0-9_]*", name) and callable(getattr(math, name, None)):
        return None
    return f"node target {target!r} is neither a torch operator nor a symbolic-shape function"


def _expression_problem(text: str, allowed: frozenset[str]) -> str | None:
    """Why a sympy expression string is not plain arithmetic over symbols, or ``None``.

    torch writes expressions in ``srepr`` form (``Mul(Integer(64), Symbol('s70', positive=True,
    integer=True))``) or as plain text (``s70 + 1``): calls of known sympy/torch function names,
    numbers, symbol names, and ``Symbol('<symbol>', <assumption>=True|False)``.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return f"shape expression {text[:80]!r} does not parse"
    symbol_names: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Symbol":
            first = node.args[0] if len(node.args) == 1 else None
            if not (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _SYMBOL.fullmatch(first.value)
            ):
                return f"shape expression {text[:80]!r} declares a symbol with an unexpected name"
            symbol_names.add(id(first))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in allowed and not _SYMBOL.fullmatch(node.id):
                return f"shape expression {text[:80]!r} names {node.id!r}"
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, bool)) and id(node) not in symbol_names:
                return f"shape expression {text[:80]!r} holds a non-numeric constant"
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                return f"shape expression {text[:80]!r} calls something other than a named function"
            for keyword in node.keywords:
                if not (
                    keyword.arg in _SYMPY_ASSUMPTIONS
                    and isinstance(keyword.value, ast.Constant)
                    and isinstance(keyword.value.value, bool)
                ):
                    return f"shape expression {text[:80]!r} passes keyword {keyword.arg!r}"
        elif not isinstance(
            node,
            (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Load, ast.operator,
             ast.unaryop, ast.boolop, ast.cmpop, ast.Tuple, ast.keyword),
        ):  # fmt: skip
            return f"shape expression {text[:80]!r} contains {type(node).__name__}"
    return None


def _guard_problem(code: str) -> str | None:
    """Why a ``guards_code`` string is not a comparison of input sizes, or ``None``."""
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError:
        return f"guard {code[:80]!r} does not parse"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _GUARD_NAMES:
                return f"guard {code[:80]!r} names {node.id!r}"
        elif isinstance(node, ast.Attribute):
            base = node.value
            ok = (
                node.attr in _GUARD_METHODS
                or (
                    isinstance(base, ast.Name)
                    and base.id == "math"
                    and callable(getattr(math, node.attr, None))
                )
                or (
                    isinstance(base, ast.Name)
                    and base.id == "torch"
                    and _SYM_TARGET.fullmatch(f"torch.{node.attr}")
                )
            )
            if not ok or node.attr.startswith("__"):
                return f"guard {code[:80]!r} reads attribute {node.attr!r}"
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, bool, str)) or (
                isinstance(node.value, str) and "__" in node.value
            ):
                return f"guard {code[:80]!r} holds constant {node.value!r}"
        elif isinstance(node, ast.Call):
            if node.keywords:
                return f"guard {code[:80]!r} passes keyword arguments"
        elif not isinstance(
            node,
            (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Subscript, ast.Load,
             ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Tuple, ast.IfExp),
        ):  # fmt: skip
            return f"guard {code[:80]!r} contains {type(node).__name__}"
    return None


def _walk(value: Any) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Yield ``(key, value, owner)`` for every key of every dict in a JSON document."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                yield key, child, item
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _graph_problems(member: str, text: str) -> list[str]:
    try:
        document = json.loads(text)
    except ValueError as exc:
        return [f"{member}: not JSON ({exc})"]
    problems: list[str] = []
    sympy_names = _SYMPY_NAMES | _torch_sympy_names()
    for key, value, owner in _walk(document):
        problem = None
        is_node_target = key == "target" and "inputs" in owner
        if isinstance(value, str) and (is_node_target or key == "as_operator"):
            problem = _target_problem(value)
        elif key == "expr_str" and isinstance(value, str):
            problem = _expression_problem(value, sympy_names)
        elif key == "guards_code" and isinstance(value, list):
            for code in value:
                problem = problem or (
                    _guard_problem(code) if isinstance(code, str) else "a guard is not text"
                )
        if problem:
            problems.append(f"{member}: {problem}")
    return problems


# --------------------------------------------------------------------------------------------
# payloads
# --------------------------------------------------------------------------------------------


def _payload_problems(zf: zipfile.ZipFile, root: str, folder: str, member: str) -> tuple[list[str], set[str]]:
    """Check one ``*_config.json`` of weights or constants; return problems and the files it names."""
    problems: list[str] = []
    named: set[str] = set()
    try:
        config = json.loads(zf.read(f"{root}/{member}")).get("config", {})
    except (ValueError, AttributeError, KeyError) as exc:
        return [f"{member}: unreadable payload config ({exc})"], named
    for fqn, entry in config.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
            problems.append(f"{member}: entry {fqn!r} has no path_name")
            continue
        path_name = entry["path_name"]
        named.add(path_name)
        full = f"{root}/{folder}{path_name}"
        if path_name.startswith(("custom_obj", "opaque_obj")):
            problems.append(
                f"{folder}{path_name} ({fqn}): a scripted or opaque Python object, loaded with an unpickler "
                "that is not weights-only"
            )
        elif entry.get("use_pickle"):
            try:
                data = zf.read(full)
            except KeyError:
                problems.append(f"{member}: {fqn!r} points to missing {folder}{path_name}")
                continue
            problem = _weights_only_problem(data, f"{folder}{path_name} ({fqn})")
            if problem:
                problems.append(problem)
    return problems, named


def inspect_pt2(file: IO[bytes]) -> list[str]:
    """List what in a ``.pt2`` archive could run code when ``torch.export.load`` reads or runs it.

    Nothing in the archive is executed: pickles are tried with the weights-only unpickler (which
    refuses any global outside torch's allow-list and calls nothing else), JSON documents are
    parsed, expressions are parsed with :mod:`ast` and never evaluated.

    Args:
        file: the archive, opened in binary mode and seekable (a file object or ``io.BytesIO``).
            It is read from the start; its position is undefined afterwards.

    Returns:
        One line per finding, naming the archive member and the reason (an empty list means the
        archive holds only what ``torch.export.save`` writes for an ordinary program): pickles the
        weights-only unpickler refuses (the sample inputs of a program traced with a cache object,
        a crafted ``__reduce__``), TorchScript or opaque objects, AOTInductor libraries, members of
        an unknown kind, node targets that are not operators, shape expressions or guards that are
        not arithmetic over input sizes.
    """
    file.seek(0)
    try:
        zf = zipfile.ZipFile(file)
    except zipfile.BadZipFile as exc:
        return [f"not a .pt2 (zip) archive: {exc}"]
    names = [n for n in zf.namelist() if not n.endswith("/")]
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or any("/" not in n for n in names):
        return [f"archive members are not under one root folder (found {sorted(roots)[:5]})"]
    root = roots.pop()
    members = sorted(n[len(root) + 1 :] for n in names)
    problems: list[str] = []
    payload_files: dict[str, set[str]] = {"data/weights/": set(), "data/constants/": set()}
    for member in members:
        for folder, files in payload_files.items():
            if member.startswith(folder) and member.endswith("_config.json"):
                found, named = _payload_problems(zf, root, folder, member)
                problems += found
                files |= named
    for member in members:
        if member in _METADATA_MEMBERS or member.startswith("extra/"):
            continue
        if member.startswith("models/") and member.endswith(".json"):
            problems += _graph_problems(member, zf.read(f"{root}/{member}").decode("utf-8", "replace"))
        elif member.startswith("data/sample_inputs/") and member.endswith(".pt"):
            problem = _weights_only_problem(zf.read(f"{root}/{member}"), member)
            if problem:
                problems.append(problem)
        elif any(
            member.startswith(folder) and (member.endswith("_config.json") or member[len(folder) :] in files)
            for folder, files in payload_files.items()
        ):
            continue
        elif member.startswith("data/aotinductor/"):
            problems.append(f"{member}: AOTInductor package content (a compiled library torch would load)")
        else:
            problems.append(f"{member}: unrecognised archive member (legacy or newer .pt2 layout)")
    return problems
