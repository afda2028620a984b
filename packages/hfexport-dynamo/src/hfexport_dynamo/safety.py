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

Before any of that, :func:`check_archive` makes sure every zip reader reads the same archive:
torch's reader (``PyTorchFileReader``, miniz) looks a record up in the central directory with a
case-insensitive binary search, so of two members with the same name (or names differing only in
case) it may take either copy, while Python's :mod:`zipfile` takes the last one. An archive with
such members, with bytes before, between or over its listed members, or with local headers that
disagree with the central directory is refused (:class:`~hfexport_dynamo.errors.UnsafeArtifactError`);
one that is not a zip, truncated, or fails a CRC check is reported as corrupt
(:class:`~hfexport_dynamo.errors.CorruptArtifactError`). The inspection then reads every member
through torch's own reader, i.e. exactly the bytes ``torch.export.load`` will use.

:func:`weights_only_loading` is the second line: while :func:`hfexport_dynamo.load` runs
``torch.export.load`` on an untrusted file, every ``torch.load`` in the calling thread is forced
to ``weights_only=True`` (torch's fallback to full unpickling fails instead of running code),
and the opaque-object unpickler, the TorchScript object unpickler and AOTInductor loading refuse.

The checks follow the archive layout of ``torch.export.save`` in torch 2.12/2.13 (members under
one root folder: ``archive_format``, ``archive_version``, ``byteorder``, ``.data/version``,
``.data/serialization_id``, ``models/<model>.json``, ``data/weights/...``, ``data/constants/...``,
``data/sample_inputs/<model>.pt``, ``extra/...``); a member of any other kind is reported, so a
newer layout is refused rather than trusted.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import logging
import math
import re
import struct
import threading
import unicodedata
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

from hfexport_dynamo.errors import CorruptArtifactError, UnsafeArtifactError

__all__ = ["check_archive", "inspect_pt2", "weights_only_loading"]

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
# archive structure: every zip reader must read the same members
# --------------------------------------------------------------------------------------------

# local file header: signature, version, flags, method, time, date, crc32, sizes, name/extra lengths
_LOCAL_HEADER = struct.Struct("<4sHHHHHLLLHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
# compression methods torch's reader (miniz) can read: stored, deflated
_READABLE_METHODS = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED})


def _record_key(name: str) -> str:
    """The name under which a zip reader could find member ``name``.

    miniz (torch's reader) compares names ASCII case-insensitively; Windows tools treat ``\\\\`` as
    ``/``; Unicode tools may normalize. Folding all three is stricter than torch needs, and
    ``torch.export.save`` only writes ASCII names, so no archive it writes is refused for it.
    """
    return unicodedata.normalize("NFKC", name.replace("\\", "/")).casefold()


def _label(path: str | None) -> str:
    return path if path is not None else "the archive"


def _corrupt(path: str | None, reason: str) -> CorruptArtifactError:
    return CorruptArtifactError(
        f"{_label(path)} is not a valid torch.export archive (.pt2): {reason}. The file is truncated "
        "or corrupt: re-export it (or download it again).",
        path=path,
        reason=reason,
    )


def _ambiguous(path: str | None, problems: list[str]) -> UnsafeArtifactError:
    listed = "\n".join(f"  - {p}" for p in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return UnsafeArtifactError(
        f"refusing to load {_label(path)}: zip readers could read different content from it:\n{listed}{more}\n"
        "torch.export.save never writes such an archive (it was crafted or damaged): re-export the "
        "model from its source, or get the file again from a source you trust.",
        path=_label(path),
        problems=problems,
    )


def _descriptor_length(data: bytes, info: zipfile.ZipInfo) -> int | None:
    """Length of the data descriptor at the start of ``data`` matching ``info``, or ``None``."""
    for signed in (True, False):
        body = data[4:] if signed else data
        if signed and not data.startswith(_DESCRIPTOR_SIGNATURE):
            continue
        for size_format in ("<LLL", "<LQQ"):  # zip32, zip64 sizes
            layout = struct.Struct(size_format)
            if len(body) < layout.size:
                continue
            if layout.unpack_from(body) == (info.CRC, info.compress_size, info.file_size):
                return layout.size + (4 if signed else 0)
    return None


def _layout_problems(file: IO[bytes], zf: zipfile.ZipFile, path: str | None) -> list[str]:
    """Walk the local headers in file order: members must tile the file up to the central directory.

    Returns the findings that make the archive ambiguous; raises :class:`CorruptArtifactError` for
    a damaged local header.
    """
    problems: list[str] = []
    expected = 0
    for info in sorted(zf.infolist(), key=lambda i: i.header_offset):
        if info.header_offset != expected:
            where = "before the first member" if expected == 0 else "between members"
            kind = (
                "overlaps the previous member" if info.header_offset < expected else "follows unlisted bytes"
            )
            problems.append(
                f"member {info.filename!r} {kind} (offset {info.header_offset}, expected {expected}; "
                f"data {where} that only some zip readers see)"
            )
        file.seek(info.header_offset)
        header = file.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or not header.startswith(_LOCAL_SIGNATURE):
            raise _corrupt(path, f"the local header of member {info.filename!r} is missing or damaged")
        _, _, flags, method, _, _, _, _, _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        raw_name = file.read(name_length)
        local_name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        if local_name != info.orig_filename:
            problems.append(
                f"member {info.filename!r}: its local header names it {local_name!r} (readers disagree on its name)"
            )
        if flags & 0x1:
            raise _corrupt(path, f"member {info.filename!r} is encrypted")
        if method != info.compress_type:
            problems.append(
                f"member {info.filename!r}: its local header says compression {method}, the central "
                f"directory {info.compress_type} (readers disagree on its bytes)"
            )
        elif method not in _READABLE_METHODS:
            raise _corrupt(
                path, f"member {info.filename!r} uses compression method {method}, which torch cannot read"
            )
        end = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length + info.compress_size
        if flags & 0x8:
            file.seek(end)
            length = _descriptor_length(file.read(24), info)
            if length is None:
                raise _corrupt(
                    path, f"the data descriptor of member {info.filename!r} does not match its record"
                )
            end += length
        expected = max(expected, end)
    if expected != zf.start_dir:
        problems.append(
            f"{zf.start_dir - expected} bytes between the last member and the central directory "
            "(data that only some zip readers see)"
        )
    return problems


def check_archive(file: IO[bytes], *, path: str | None = None) -> None:
    """Refuse a ``.pt2`` that is not a zip, is damaged, or could be read differently by zip readers.

    Run by :func:`inspect_pt2` and by :func:`hfexport_dynamo.load` (also with
    ``trust_remote_code=True``). Reads the whole file once (the CRC check of every member); executes
    nothing.

    Args:
        file: the archive, opened in binary mode and seekable; its position is undefined afterwards.
        path: the file's path, used in error messages (``None``: "the archive").

    Raises:
        CorruptArtifactError: not a zip archive (e.g. truncated: no end-of-central-directory
            record), a damaged local header or data descriptor, encryption or a compression torch
            cannot read, or a member whose bytes fail their CRC-32 check.
        UnsafeArtifactError: the central directory lists two members under one name, or names
            that torch's reader maps to the same record (differing only in case, ``\\\\`` vs ``/``
            or Unicode normalization), or control characters in a name; or bytes before, between
            or over the listed members, or a local header naming a member differently (ways to
            show one zip reader content another does not see). The message names the members and
            says to re-export; it never suggests ``trust_remote_code``.
    """
    file.seek(0)
    try:
        zf = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error) as exc:
        raise _corrupt(path, f"not a zip archive ({exc})") from exc
    with zf:
        infos = zf.infolist()
        if not infos:
            raise _corrupt(path, "the zip archive holds no members")
        problems: list[str] = []
        counts = Counter(info.filename for info in infos)
        problems += [
            f"duplicate member {name!r} ({count} copies): torch may read one copy and a check another"
            for name, count in sorted(counts.items())
            if count > 1
        ]
        same_record: dict[str, list[str]] = {}
        for name in counts:
            same_record.setdefault(_record_key(name), []).append(name)
        problems += [
            f"members {sorted(names)!r} differ only in case, separators or Unicode normalization: torch's "
            "reader finds them under one name"
            for names in same_record.values()
            if len(names) > 1
        ]
        problems += [
            f"member name {name!r} holds a control character"
            for name in counts
            if any(unicodedata.category(c) == "Cc" for c in name)
        ]
        problems += _layout_problems(file, zf, path)
        if problems:
            raise _ambiguous(path, problems)
        try:
            bad = zf.testzip()
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError, zlib.error) as exc:
            raise _corrupt(path, f"a member cannot be read ({exc})") from exc
        if bad is not None:
            raise _corrupt(path, f"member {bad!r} fails its CRC-32 check")


def _open_reader(file: IO[bytes], path: str | None) -> Any:
    """torch's own archive reader over ``file``: the reader ``torch.export.load`` uses."""
    file.seek(0)
    try:
        return torch._C.PyTorchFileReader(file)
    except RuntimeError as exc:
        reason = str(exc).split(". This is an internal miniz error", 1)[0]
        raise _corrupt(path, f"torch's archive reader refuses it ({reason})") from exc


# --------------------------------------------------------------------------------------------
# while torch.export.load runs: no full unpickling in this thread
# --------------------------------------------------------------------------------------------

_GUARD = threading.local()
_GUARD_LOCK = threading.Lock()
_GUARD_USERS = 0
_GUARD_RESTORE: list[Callable[[], None]] = []


def _guarded_path() -> str | None:
    """The file :func:`weights_only_loading` guards in this thread, or ``None`` outside it."""
    stack = getattr(_GUARD, "paths", None)
    return stack[-1] if stack else None


def _refuse(what: str) -> UnsafeArtifactError:
    path = _guarded_path() or "the archive"
    return UnsafeArtifactError(
        f"refusing to load {path}: torch.export.load asked to {what}, which could run code; refused while "
        "loading an untrusted file. Re-export the model with hfexport_dynamo, or pass "
        "trust_remote_code=True only if you trust the file's origin.",
        path=path,
        problems=[what],
    )


def _weights_only_torch_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        if _guarded_path() is None:
            return original(*args, **kwargs)
        asked_full = kwargs.get("weights_only") is False
        kwargs["weights_only"] = True
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if not asked_full:
                raise
            raise _refuse(
                f"unpickle a payload in full (weights-only refused it: {_first_line(exc)})"
            ) from None

    return load


def _refusing(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def refuse_while_guarded(*args: Any, **kwargs: Any) -> Any:
        if _guarded_path() is not None:
            raise _refuse(what)
        return original(*args, **kwargs)

    return refuse_while_guarded


class _GuardedPickle:
    """Stands for the :mod:`pickle` module inside torch's pt2 loader: ``loads`` refuses while guarded."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.loads = _refusing(module.loads, "unpickle an opaque Python object (pickle.loads)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _install_guard() -> None:
    from torch.export.pt2_archive import _package

    def swap(owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        _GUARD_RESTORE.append(lambda: setattr(owner, name, original))

    swap(torch, "load", _weights_only_torch_load(torch.load))
    swap(torch._C, "_pickle_load_obj", _refusing(torch._C._pickle_load_obj, "unpickle a TorchScript object"))
    swap(_package, "pickle", _GuardedPickle(_package.pickle))
    swap(_package, "_load_aoti", _refusing(_package._load_aoti, "load an AOTInductor shared library"))


@contextlib.contextmanager
def weights_only_loading(path: str) -> Iterator[None]:
    """While the block runs in this thread, nothing torch loads may unpickle in full.

    torch 2.12-2.14 ``torch.export.load`` reads sample inputs with ``torch.load(weights_only=True)``
    and, when that fails, again with ``weights_only=False``; pickled weights/constants with
    ``weights_only=False`` directly; opaque constants with ``pickle.loads``; TorchScript objects
    with ``torch._C._pickle_load_obj``; and loads AOTInductor libraries
    (https://github.com/pytorch/pytorch/issues/153410: ``torch.export.load`` has no
    ``weights_only``). Inside the block, in the calling thread only, ``torch.load`` always runs
    weights-only (a load that asked for full unpickling and needs it raises
    :class:`UnsafeArtifactError`), and the other three raise it. Other threads are unaffected;
    the originals are put back when the last concurrent block exits.

    Args:
        path: the file being loaded, named in the errors.

    Raises:
        UnsafeArtifactError: (from inside the block) torch asked for one of the refused loads.
    """
    global _GUARD_USERS
    with _GUARD_LOCK:
        if _GUARD_USERS == 0:
            try:
                _install_guard()
            except BaseException:
                while _GUARD_RESTORE:
                    _GUARD_RESTORE.pop()()
                raise
        _GUARD_USERS += 1
    stack = getattr(_GUARD, "paths", None)
    if stack is None:
        stack = _GUARD.paths = []
    stack.append(path)
    try:
        yield
    finally:
        stack.pop()
        with _GUARD_LOCK:
            _GUARD_USERS -= 1
            if _GUARD_USERS == 0:
                while _GUARD_RESTORE:
                    _GUARD_RESTORE.pop()()


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
    # flat input names (hfexport_dynamo.flat_io: ``L['cache__layers__0__keys']``) may hold "__": allowed
    # only as a plain identifier subscripting the guard's input mapping L, never as an attribute
    input_keys = {
        id(node.slice)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "L"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
        and node.slice.value.isidentifier()
        and not node.slice.value.startswith("_")
    }
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
                isinstance(node.value, str) and "__" in node.value and id(node) not in input_keys
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


def _read(reader: Any, member: str) -> bytes | None:
    """Member ``member`` (relative to the archive root) as torch reads it, or ``None`` if absent."""
    try:
        return bytes(reader.get_record(member))
    except RuntimeError:
        return None


def _payload_problems(reader: Any, folder: str, member: str) -> tuple[list[str], set[str]]:
    """Check one ``*_config.json`` of weights or constants; return problems and the files it names."""
    problems: list[str] = []
    named: set[str] = set()
    try:
        config = json.loads(_read(reader, member) or b"").get("config", {})
    except (ValueError, AttributeError) as exc:
        return [f"{member}: unreadable payload config ({exc})"], named
    for fqn, entry in config.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
            problems.append(f"{member}: entry {fqn!r} has no path_name")
            continue
        path_name = entry["path_name"]
        named.add(path_name)
        if path_name.startswith(("custom_obj", "opaque_obj")):
            problems.append(
                f"{folder}{path_name} ({fqn}): a scripted or opaque Python object, loaded with an unpickler "
                "that is not weights-only"
            )
        elif entry.get("use_pickle"):
            data = _read(reader, f"{folder}{path_name}")
            if data is None:
                problems.append(f"{member}: {fqn!r} points to missing {folder}{path_name}")
                continue
            problem = _weights_only_problem(data, f"{folder}{path_name} ({fqn})")
            if problem:
                problems.append(problem)
    return problems, named


def inspect_pt2(file: IO[bytes], *, path: str | None = None) -> list[str]:
    """List what in a ``.pt2`` archive could run code when ``torch.export.load`` reads or runs it.

    Nothing in the archive is executed: pickles are tried with the weights-only unpickler (which
    refuses any global outside torch's allow-list and calls nothing else), JSON documents are
    parsed, expressions are parsed with :mod:`ast` and never evaluated.

    The archive is first checked with :func:`check_archive` (which raises for a corrupt or
    ambiguous archive); every member is then read through torch's own reader
    (``torch._C.PyTorchFileReader``), so the bytes inspected are the bytes ``torch.export.load``
    uses.

    Args:
        file: the archive, opened in binary mode and seekable (a file object or ``io.BytesIO``).
            It is read from the start; its position is undefined afterwards.
        path: the file's path, for error messages (``None``: "the archive").

    Returns:
        One line per finding, naming the archive member and the reason (an empty list means the
        archive holds only what ``torch.export.save`` writes for an ordinary program): pickles the
        weights-only unpickler refuses (the sample inputs of a program traced with a cache object,
        a crafted ``__reduce__``), TorchScript or opaque objects, AOTInductor libraries, members of
        an unknown kind, node targets that are not operators, shape expressions or guards that are
        not arithmetic over input sizes.

    Raises:
        CorruptArtifactError: not a zip archive, truncated, or damaged (see :func:`check_archive`).
        UnsafeArtifactError: duplicate or same-record member names, or hidden bytes (see
            :func:`check_archive`).
    """
    check_archive(file, path=path)
    file.seek(0)
    with zipfile.ZipFile(file) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or any("/" not in n for n in names):
        return [f"archive members are not under one root folder (found {sorted(roots)[:5]})"]
    # from here on every member is read by torch's reader: the bytes torch.export.load will use
    reader = _open_reader(file, path)
    members = sorted(reader.get_all_records())
    problems: list[str] = []
    payload_files: dict[str, set[str]] = {"data/weights/": set(), "data/constants/": set()}
    for member in members:
        for folder, files in payload_files.items():
            if member.startswith(folder) and member.endswith("_config.json"):
                found, named = _payload_problems(reader, folder, member)
                problems += found
                files |= named
    for member in members:
        if member in _METADATA_MEMBERS or member.startswith("extra/"):
            continue
        if member.startswith("models/") and member.endswith(".json"):
            problems += _graph_problems(member, (_read(reader, member) or b"").decode("utf-8", "replace"))
        elif member.startswith("data/sample_inputs/") and member.endswith(".pt"):
            problem = _weights_only_problem(_read(reader, member) or b"", member)
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
