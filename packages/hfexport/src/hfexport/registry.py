"""One registry of workarounds for upstream bugs, keyed by backend, with open kinds.

Every workaround is a :class:`RegistryEntry` of some *kind*. The core defines three kinds and
applies them itself:

- ``"patch"`` (:func:`register_patch`): a factory receives the original attribute (a function,
  method, ...) and returns its replacement. :func:`apply_patches` installs the replacements for
  the duration of a ``with`` block and restores the originals afterwards, also on error.
- ``"fx_node_fix"`` (:func:`register_fx_node_fix`): ``fix(gm, node) -> bool`` rewrites one node
  of a captured graph; ``True`` means the node was consumed. Applied by
  :func:`apply_fx_node_fixes` over every sub-GraphModule.
- ``"fx_program_fix"`` (:func:`register_fx_program_fix`): ``fix(exported_program) -> None``,
  for fixes that need the whole program (signature, state dict, ...). Applied by
  :func:`apply_fx_program_fixes`.

The list of kinds is open: a package announces a kind of its own with :func:`register_kind`
(``register_kind("onnx_translation", description=...)``), registers entries of it with
:func:`register` and applies them itself, reading :func:`active_entries`. Entries of every kind
carry the same metadata, are listed by ``hfexport patches`` and judged by ``--stale``.

Backend keys may be scoped with dots (``"executorch.xnnpack"``). Asking for a scoped key also
applies the entries of its parent keys, parents first (``"executorch"`` then
``"executorch.xnnpack"``), and never those of sibling scopes (``"executorch.cuda"``).

An entry may record the upstream issue it works around, a one-line description and, per
distribution, the version range in which it is needed (``description``, ``issue``, ``versions``,
all optional, as in the reference API; hfexport's own entries always give them). An entry is
*active* (applied) only when every distribution it names is installed at a version inside its
range (an entry without ``versions`` is always active); :meth:`RegistryEntry.is_stale` tells when
a package's supported range no longer reaches an entry's range, i.e. the entry can be retired.

Patch targets are resolved lazily: registering a patch records its dotted paths and imports
nothing; the paths are resolved (their modules imported) when the patch is first applied, or when
:meth:`RegistryEntry.resolve` is called, e.g. by ``hfexport patches`` to list the paths that do not
resolve. Importing a backend therefore never imports the transformers modules its patches target.

Registration is idempotent: registering the same function (same qualified name) for the same
backend and kind again, e.g. because its module was imported twice or reloaded, replaces the
earlier entry instead of adding a second one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from hfexport.environment import installed_version, public_version
from hfexport.quantization import register_quantization_method

if TYPE_CHECKING:
    import torch
    import torch.fx

__all__ = [
    "NO_ISSUE",
    "EntryKind",
    "Kind",
    "RegistryEntry",
    "active_entries",
    "apply_fx_node_fixes",
    "apply_fx_program_fixes",
    "apply_patches",
    "backend_keys",
    "entries",
    "installed_version",
    "isolated_registry",
    "kinds",
    "register",
    "register_fx_node_fix",
    "register_fx_program_fix",
    "register_kind",
    "register_patch",
    "register_quantization_method",
]

logger = logging.getLogger(__name__)

#: A kind name: ``"patch"``, ``"fx_node_fix"``, ``"fx_program_fix"`` or one registered with
#: :func:`register_kind` (``"onnx_translation"``, ``"input_preparer"``, ...).
EntryKind = str

#: What listings show for an entry registered without an upstream issue.
NO_ISSUE = "no upstream issue recorded"

_BACKEND_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_KIND_RE = re.compile(r"[a-z][a-z0-9_]*")

_F = TypeVar("_F", bound=Callable[..., Any])


# --------------------------------------------------------------------------------------------
# Kinds
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of registry entry.

    Attributes:
        name: the kind's name, lower-case with underscores (``"onnx_translation"``).
        description: one line saying what entries of this kind are and who applies them.
        targets: what an entry's :attr:`RegistryEntry.targets` hold for this kind, for listings
            (``"dotted paths"``, ``"operators"``, ``"input keys"``); empty when entries have none.
    """

    name: str
    description: str
    targets: str = ""


_KIND_TABLE: dict[str, Kind] = {}
_KIND_LOCK = threading.Lock()


def register_kind(name: str, *, description: str, targets: str = "") -> Kind:
    """Announce a kind of registry entry (idempotent: the same name again replaces its description).

    The registry does not apply entries of a new kind: the package that registers the kind
    reads :func:`active_entries` at its own stage and calls the entries' functions.

    Args:
        name: lower-case name with underscores, e.g. ``"onnx_translation"``.
        description: one line saying what entries of this kind do and where they are applied.
        targets: what entries' ``targets`` hold (``"operators"``), empty when they hold nothing.

    Returns:
        The :class:`Kind`.

    Raises:
        ValueError: when ``name`` is not lower-case letters, digits and underscores, or
            ``description`` is empty or spans lines.
    """
    if not isinstance(name, str) or not _KIND_RE.fullmatch(name):
        raise ValueError(
            f"kind name must be lower-case letters, digits and underscores, e.g. 'onnx_ir_fix', got {name!r}"
        )
    _check_description(description)
    kind = Kind(name=name, description=description.strip(), targets=targets)
    with _KIND_LOCK:
        _KIND_TABLE[name] = kind
    return kind


def kinds() -> tuple[Kind, ...]:
    """Every registered kind, in registration order (the core's three first)."""
    with _KIND_LOCK:
        return tuple(_KIND_TABLE.values())


def _check_kind(kind: str) -> None:
    with _KIND_LOCK:
        known = tuple(_KIND_TABLE)
    if kind not in known:
        raise ValueError(
            f"kind must be one of {known} (announce a new kind with hfexport.registry.register_kind), got {kind!r}"
        )


# --------------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Target:
    """A resolved patch target: ``setattr(owner, attr, ...)`` installs the replacement."""

    path: str
    owner: Any
    attr: str


class _Resolution:
    """The lazily computed resolution of a patch entry's dotted paths (computed once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.targets: tuple[_Target, ...] = ()
        self.unresolved: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One registered workaround.

    Attributes:
        kind: ``"patch"``, ``"fx_node_fix"``, ``"fx_program_fix"`` or a kind registered with
            :func:`register_kind`.
        backend: the backend key it was registered for, e.g. ``"onnx"`` or ``"executorch.xnnpack"``.
        name: qualified name of the decorated function, ``module.qualname``.
        description: one line saying what the workaround does (``None`` when not given).
        issue: URL of the upstream issue the workaround exists for (``None`` when not given).
        versions: distribution name -> PEP 440 specifier set in which the workaround is needed
            (empty when not given: the entry is then always active and never stale).
        func: the decorated factory or fix function.
        targets: what the entry applies to, per kind: dotted paths for patches, operators for
            ONNX translations, input keys for input preparers; empty for FX fixes.
    """

    kind: EntryKind
    backend: str
    name: str
    description: str | None
    issue: str | None
    versions: dict[str, str] = dataclasses.field(hash=False)
    func: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    targets: tuple[Any, ...] = ()
    _resolution: _Resolution = dataclasses.field(
        default_factory=_Resolution, compare=False, repr=False, hash=False
    )

    @property
    def key(self) -> tuple[str, str, str]:
        """``(kind, backend, name)``: the identity under which the entry is registered."""
        return (self.kind, self.backend, self.name)

    @property
    def paths(self) -> tuple[str, ...]:
        """Dotted paths a patch replaces (empty for every other kind)."""
        return tuple(self.targets) if self.kind == "patch" else ()

    @property
    def has_metadata(self) -> bool:
        """True when the entry names its description, upstream issue and version range."""
        return bool(self.description and self.issue and self.versions)

    @property
    def issue_text(self) -> str:
        """The upstream issue URL, or :data:`NO_ISSUE` when none was recorded."""
        return self.issue or NO_ISSUE

    @property
    def unresolved(self) -> tuple[tuple[str, str], ...]:
        """``(path, reason)`` for every dotted path of a patch that does not resolve.

        Reading it resolves the paths (imports their modules) if that has not happened yet;
        unresolved paths are never patched. Always empty for kinds other than ``"patch"``.
        """
        self.resolve()
        return self._resolution.unresolved

    def resolve(self) -> tuple[_Target, ...]:
        """Resolve a patch's dotted paths now (once; later calls return the cached result).

        Imports the longest importable module prefix of every path and looks the rest up with
        ``getattr``. A path that fails (module missing, attribute renamed, import error) is
        recorded in :attr:`unresolved` with the reason instead of raising.

        Returns:
            The resolved targets (empty for kinds other than ``"patch"``).
        """
        res = self._resolution
        if res.done:
            return res.targets
        with res.lock:
            if not res.done:
                targets: list[_Target] = []
                unresolved: list[tuple[str, str]] = []
                for path in self.paths:
                    resolved = _resolve(path)
                    if isinstance(resolved, str):
                        logger.debug("patch %s: cannot resolve %s: %s", self.name, path, resolved)
                        unresolved.append((path, resolved))
                    else:
                        targets.append(resolved)
                res.targets, res.unresolved = tuple(targets), tuple(unresolved)
                res.done = True
        return res.targets

    def inactive_reason(self) -> str | None:
        """Say why the entry is not active with the installed packages.

        Returns:
            ``None`` when the entry is active; otherwise a sentence naming the first
            distribution that is missing or installed outside the entry's range.
        """
        for dist, spec in self.versions.items():
            found = installed_version(dist)
            if found is None:
                return f"{dist} is not installed"
            try:
                version = public_version(found)
            except InvalidVersion:
                return f"{dist} has a version that is not PEP 440 ({found!r})"
            if not SpecifierSet(spec).contains(version, prereleases=True):
                return f"{dist} {found} is outside {spec!r}"
        return None

    def is_active(self) -> bool:
        """Return whether the workaround applies to the installed packages.

        True when every distribution in :attr:`versions` is installed and its version, with
        any local suffix (``+cpu``, ``+cu126``) ignored, is inside the entry's specifier set
        (always True for an entry without versions). Computed at call time from
        :func:`installed_version`.
        """
        return self.inactive_reason() is None

    def is_stale(
        self,
        supported: Mapping[str, str],
        candidates: Mapping[str, list[str]] | None = None,
    ) -> bool:
        """Return whether the entry can be retired given the versions a package supports.

        The entry is stale when, for at least one distribution in :attr:`versions` that also
        appears in ``supported``, no version admitted by ``supported[dist]`` falls inside the
        entry's range: the upstream fix has shipped in every version the package still supports.

        Specifier sets are not intersected symbolically. Instead a list of candidate versions is
        tested against both sets: ``0``, every version literal appearing in either set
        (wildcards ``2.13.*`` read as ``2.13``), and, for each literal, the next patch, minor and
        major release and the literal with one more ``.1`` component (``2.13`` -> ``2.13.0.1``).
        Every bound of either set is such a literal, so a non-empty overlap of realistic ranges
        contains one of these candidates; exotic ranges can add candidates explicitly.

        Args:
            supported: distribution name -> specifier set the package supports, e.g.
                ``{"torch": ">=2.12,<2.16"}``. Distributions missing here are not judged.
            candidates: extra candidate versions per distribution, tested in addition to the
                generated ones.

        Returns:
            True when the entry's range and the supported range share no candidate for some
            distribution.

        Raises:
            packaging.specifiers.InvalidSpecifier: when a ``supported`` specifier is malformed.
        """
        supported_by_name = {canonicalize_name(d): s for d, s in supported.items()}
        extra_by_name = {canonicalize_name(d): list(v) for d, v in (candidates or {}).items()}
        for dist, spec in self.versions.items():
            name = canonicalize_name(dist)
            if name not in supported_by_name:
                continue
            entry_set = SpecifierSet(spec)
            supported_set = SpecifierSet(supported_by_name[name])
            pool = _candidate_versions(entry_set, supported_set, extra_by_name.get(name, []))
            if not any(
                entry_set.contains(v, prereleases=True) and supported_set.contains(v, prereleases=True)
                for v in pool
            ):
                return True
        return False


def _candidate_versions(
    entry_set: SpecifierSet, supported_set: SpecifierSet, extra: list[str]
) -> list[Version]:
    """Versions worth testing for an overlap of two specifier sets (see ``is_stale``)."""
    literals: list[str] = ["0", *extra]
    for spec in (*entry_set, *supported_set):
        literals.append(spec.version.removesuffix(".*"))
    out: list[Version] = []
    for text in literals:
        try:
            version = Version(text)
        except InvalidVersion:
            continue  # "===" arbitrary strings are not versions
        release = version.release + (0,) * max(0, 3 - len(version.release))
        out.append(version)
        for i in range(len(release)):
            bumped = (*release[:i], release[i] + 1, *(0,) * (len(release) - i - 1))
            out.append(Version(".".join(map(str, bumped))))
        out.append(Version(".".join(map(str, (*release, 1)))))
    return out


# --------------------------------------------------------------------------------------------
# Registry storage
# --------------------------------------------------------------------------------------------


class _Registry:
    """Entries in registration order; a re-registered key keeps its slot."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], RegistryEntry] = {}
        self._lock = threading.Lock()

    def add(self, entry: RegistryEntry) -> None:
        with self._lock:
            if entry.key in self._entries:
                logger.debug("replacing registry entry %s for %r", entry.name, entry.backend)
            self._entries[entry.key] = entry

    def remove(self, predicate: Callable[[RegistryEntry], bool]) -> list[RegistryEntry]:
        with self._lock:
            gone = [e for e in self._entries.values() if predicate(e)]
            for entry in gone:
                del self._entries[entry.key]
            return gone

    def snapshot(self) -> list[RegistryEntry]:
        with self._lock:
            return list(self._entries.values())


_REGISTRY = _Registry()

# Process-wide lock held for the whole body of apply_patches.
_PATCH_LOCK = threading.RLock()
# Keys of patch entries installed by an enclosing apply_patches (guarded by _PATCH_LOCK).
_INSTALLED: set[tuple[str, str, str]] = set()
# Entries already warned about (unresolved paths), so the warning is given once.
_WARNED: set[tuple[str, str, str]] = set()


@contextlib.contextmanager
def isolated_registry() -> Iterator[None]:
    """Swap in an empty registry for the duration of a ``with`` block (for tests).

    Entries registered inside the block are dropped on exit and the previous registry is put
    back, also when the block raises. Kinds registered inside the block stay registered.
    """
    global _REGISTRY
    saved = _REGISTRY
    _REGISTRY = _Registry()
    try:
        yield
    finally:
        _REGISTRY = saved


def unregister(kind: EntryKind, name: str, backend: str | None = None) -> list[RegistryEntry]:
    """Remove entries of ``kind`` whose qualified name is ``name`` (for one backend key or all).

    Returns:
        The removed entries (empty when none matched).
    """
    return _REGISTRY.remove(
        lambda e: e.kind == kind and e.name == name and (backend is None or e.backend == backend)
    )


# --------------------------------------------------------------------------------------------
# Validation and path resolution
# --------------------------------------------------------------------------------------------


def _validate_backend(backend: str) -> None:
    if not isinstance(backend, str) or not _BACKEND_RE.fullmatch(backend):
        raise ValueError(
            f"backend key must be a non-empty dotted name such as 'onnx' or 'executorch.xnnpack', got {backend!r}"
        )


def _check_description(description: Any) -> None:
    if not isinstance(description, str) or not description.strip() or "\n" in description.strip():
        raise ValueError(f"description must be one non-empty line, got {description!r}")


def _validate_metadata(
    description: str | None, issue: str | None, versions: Mapping[str, str] | None
) -> tuple[str | None, str | None, dict[str, str]]:
    """Check the optional metadata; return ``(description, issue, versions)`` normalised."""
    if description is not None:
        _check_description(description)
        description = description.strip()
    if issue is not None:
        parsed = urllib.parse.urlparse(issue) if isinstance(issue, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"issue must be the URL of the upstream issue being worked around (https://...), got {issue!r}"
            )
    if versions is None:
        return description, issue, {}
    if not isinstance(versions, Mapping) or not versions:
        raise ValueError(
            "versions must map at least one distribution to the specifier set in which the "
            "workaround is needed, e.g. {'torch': '<2.14'} (or be left out); use '>=0' only when no "
            "upstream fix is planned"
        )
    checked: dict[str, str] = {}
    for dist, spec in versions.items():
        if not isinstance(dist, str) or not dist.strip():
            raise ValueError(f"versions has an empty distribution name: {versions!r}")
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(
                f"versions[{dist!r}] must be a non-empty specifier set such as '<2.14', got {spec!r}"
            )
        try:
            SpecifierSet(spec)
        except InvalidSpecifier as exc:
            raise ValueError(f"versions[{dist!r}] is not a PEP 440 specifier set: {spec!r}") from exc
        checked[dist] = spec
    return description, issue, checked


def _resolve(path: str) -> _Target | str:
    """Resolve a dotted path to ``(owner, attr)``; return a reason string when it cannot."""
    parts = path.split(".")
    module = None
    first_attr = 0
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (modname == missing or modname.startswith(missing + ".")):
                continue  # this prefix is not a module: try a shorter one
            return f"importing {modname} failed: {type(exc).__name__}: {exc}"
        except Exception as exc:
            return f"importing {modname} failed: {type(exc).__name__}: {exc}"
        first_attr = i
        break
    if module is None:
        return f"no importable module prefix (No module named {parts[0]!r})"
    owner: Any = module
    for depth, name in enumerate(parts[first_attr:-1], start=first_attr):
        try:
            owner = getattr(owner, name)
        except Exception as exc:
            return f"{'.'.join(parts[:depth])} has no attribute {name!r} ({type(exc).__name__}: {exc})"
    attr = parts[-1]
    try:
        getattr(owner, attr)
    except Exception as exc:
        return f"{'.'.join(parts[:-1])} has no attribute {attr!r} ({type(exc).__name__}: {exc})"
    return _Target(path=path, owner=owner, attr=attr)


def _qualified_name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "<unknown>"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return f"{module}.{qualname}"


# --------------------------------------------------------------------------------------------
# Decorators
# --------------------------------------------------------------------------------------------


def register(
    kind: EntryKind,
    backend: str,
    *targets: Any,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Register the decorated function as an entry of ``kind`` for ``backend``.

    The generic form behind :func:`register_patch`, :func:`register_fx_node_fix` and
    :func:`register_fx_program_fix`, and the one to use for a kind announced with
    :func:`register_kind`. Nothing is imported or resolved here.

    Args:
        kind: a registered kind name (see :func:`kinds`).
        backend: backend key, optionally scoped (``"executorch.xnnpack"``).
        *targets: what the entry applies to (kind-specific: dotted paths, operators, input keys).
        description: one line saying what the workaround does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> PEP 440 specifier set in which the workaround is needed,
            e.g. ``{"torch": "<2.14"}``; without it the entry is always active.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: when ``kind`` is not registered, ``backend`` is not a dotted name,
            ``description`` is empty or spans lines, ``issue`` is not an http(s) URL, or
            ``versions`` is empty or holds an invalid specifier set.
    """
    _check_kind(kind)
    _validate_backend(backend)
    description, issue, checked = _validate_metadata(description, issue, versions)

    def decorator(func: _F) -> _F:
        _REGISTRY.add(
            RegistryEntry(
                kind=kind,
                backend=backend,
                name=_qualified_name(func),
                description=description,
                issue=issue,
                versions=checked,
                func=func,
                targets=tuple(targets),
            )
        )
        return func

    return decorator


def register_patch(
    backend: str,
    *dotted_paths: str,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Register a patch factory for ``backend``, replacing the attributes at ``dotted_paths``.

    The decorated function is a factory ``factory(original) -> replacement``. For every path,
    :func:`apply_patches` calls it with the current attribute and installs what it returns.
    For an attribute stored in a class as ``staticmethod``/``classmethod`` the factory receives
    the underlying function and its result is wrapped in the same descriptor again (unless the
    factory already returned a descriptor).

    Paths such as ``"torch.nn.functional.scaled_dot_product_attention"`` or
    ``"pkg.mod.Class.method"`` are not imported here: they are resolved when the patch is first
    applied (or listed): the longest importable module prefix is imported and the rest looked up
    with ``getattr``. A path that cannot be resolved (module missing, attribute renamed) is
    recorded in :attr:`RegistryEntry.unresolved` with the reason, warned about once, and never
    patched.

    Args:
        backend: backend key, optionally scoped (``"executorch.xnnpack"``).
        *dotted_paths: one or more ``module.attribute`` paths to replace.
        description: one line saying what the patch does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> PEP 440 specifier set in which the patch is needed,
            e.g. ``{"torch": "<2.14"}``; without it the patch is always applied.

    Returns:
        A decorator that registers the factory and returns it unchanged.

    Raises:
        ValueError: when ``backend`` is not a dotted name, no path is given or a path has no
            attribute part, ``description`` is empty or spans lines, ``issue`` is not an
            http(s) URL, or ``versions`` is empty or holds an invalid specifier set.
    """
    _validate_backend(backend)
    _validate_metadata(description, issue, versions)
    if not dotted_paths:
        raise ValueError("register_patch needs at least one dotted path to patch")
    for path in dotted_paths:
        if not isinstance(path, str) or len(path.split(".")) < 2 or not all(path.split(".")):
            raise ValueError(f"patch path must look like 'package.module.attribute', got {path!r}")
    return register("patch", backend, *dotted_paths, description=description, issue=issue, versions=versions)


def register_fx_node_fix(
    backend: str,
    *,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Register an FX node fix ``fix(gm, node) -> bool`` for ``backend``.

    :func:`apply_fx_node_fixes` calls the fix for every ``call_function`` node of every
    GraphModule in the captured graph. The fix returns True when it rewrote (consumed) the
    node; later fixes then skip that node. A fix returning False must leave the graph unchanged.

    Args:
        backend: backend key, optionally scoped (``"executorch.xnnpack"``).
        description: one line saying what the fix does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> PEP 440 specifier set in which the fix is needed.

    Returns:
        A decorator that registers the fix and returns it unchanged.

    Raises:
        ValueError: when ``backend``, ``description``, ``issue`` or ``versions`` is invalid
            (see :func:`register_patch`).
    """
    return register("fx_node_fix", backend, description=description, issue=issue, versions=versions)


def register_fx_program_fix(
    backend: str,
    *,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Register a program-level fix ``fix(exported_program) -> None`` for ``backend``.

    The fix mutates the :class:`torch.export.ExportedProgram` in place; it is called once per
    program by :func:`apply_fx_program_fixes`.

    Args:
        backend: backend key, optionally scoped (``"executorch.xnnpack"``).
        description: one line saying what the fix does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> PEP 440 specifier set in which the fix is needed.

    Returns:
        A decorator that registers the fix and returns it unchanged.

    Raises:
        ValueError: when ``backend``, ``description``, ``issue`` or ``versions`` is invalid
            (see :func:`register_patch`).
    """
    return register("fx_program_fix", backend, description=description, issue=issue, versions=versions)


# --------------------------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------------------------


def _scope_chain(backend: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``."""
    parts = backend.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def entries(backend: str | None = None, *, kind: EntryKind | None = None) -> list[RegistryEntry]:
    """List registered entries.

    Args:
        backend: ``None`` for every entry; otherwise the entries that apply to this key, i.e.
            those registered for the key itself or one of its parent scopes, in the order they
            are applied (parent scopes first, then registration order).
        kind: restrict to one kind (``"patch"``, ``"fx_node_fix"``, ``"fx_program_fix"`` or a
            registered one).

    Returns:
        The matching entries, active or not (see :meth:`RegistryEntry.is_active`).

    Raises:
        ValueError: when ``backend`` is not a dotted name or ``kind`` is unknown.
    """
    if kind is not None:
        _check_kind(kind)
    found = [e for e in _REGISTRY.snapshot() if kind is None or e.kind == kind]
    if backend is None:
        return found
    _validate_backend(backend)
    chain = _scope_chain(backend)
    rank = {key: i for i, key in enumerate(chain)}
    selected = [e for e in found if e.backend in rank]
    return sorted(selected, key=lambda e: rank[e.backend])  # stable: keeps registration order


def backend_keys() -> list[str]:
    """Every backend key with at least one entry, and each of its parent scopes, sorted."""
    keys: set[str] = set()
    for entry in _REGISTRY.snapshot():
        keys.update(_scope_chain(entry.backend))
    return sorted(keys)


def active_entries(kind: EntryKind, backend: str) -> list[RegistryEntry]:
    """The active entries of ``kind`` that apply to ``backend``, in application order.

    What a package calls to apply the entries of a kind it registered (see :func:`register_kind`).

    Raises:
        ValueError: when ``backend`` is not a dotted name or ``kind`` is unknown.
    """
    out = []
    for entry in entries(backend, kind=kind):
        reason = entry.inactive_reason()
        if reason is None:
            out.append(entry)
        else:
            logger.debug("skipping %s %s: %s", kind, entry.name, reason)
    return out


_active = active_entries


register_kind(
    "patch",
    description="factory(original) -> replacement, installed by apply_patches for the export and undone after",
    targets="dotted paths",
)
register_kind(
    "fx_node_fix",
    description="fix(gm, node) -> bool rewriting one node of the captured graph (apply_fx_node_fixes)",
)
register_kind(
    "fx_program_fix",
    description="fix(exported_program) -> None rewriting the captured program (apply_fx_program_fixes)",
)


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Installed:
    """What is needed to undo one installed replacement."""

    entry: RegistryEntry
    target: _Target
    owned: bool  # attribute lived in owner.__dict__ before install
    raw: Any  # the raw __dict__ value (owned) or the looked-up value (inherited)
    replacement: Any


def _raw_lookup(owner: Any, attr: str) -> tuple[bool, Any]:
    """Return (owned, raw value): the raw ``__dict__`` entry when possible."""
    own_dict = getattr(owner, "__dict__", None)
    if own_dict is not None and attr in own_dict:
        return True, own_dict[attr]
    if inspect.isclass(owner):
        for klass in inspect.getmro(owner):
            if attr in klass.__dict__:
                return False, klass.__dict__[attr]
    value = getattr(owner, attr)  # e.g. a lazy module's __getattr__, which may cache it
    if own_dict is not None and attr in own_dict:
        return True, own_dict[attr]
    return False, value


def _install(entry: RegistryEntry, target: _Target) -> _Installed:
    owned, raw = _raw_lookup(target.owner, target.attr)
    wrapper: type | None = None
    original = raw
    if inspect.isclass(target.owner) and isinstance(raw, (staticmethod, classmethod)):
        wrapper = type(raw)
        original = raw.__func__
    try:
        replacement = entry.func(original)
    except Exception as exc:
        exc.add_note(f"hfexport: raised by patch factory {entry.name} for {target.path}")
        raise
    if wrapper is not None and not isinstance(replacement, (staticmethod, classmethod)):
        replacement = wrapper(replacement)
    setattr(target.owner, target.attr, replacement)
    logger.debug("patched %s with %s", target.path, entry.name)
    return _Installed(entry=entry, target=target, owned=owned, raw=raw, replacement=replacement)


def _uninstall(record: _Installed) -> None:
    owner, attr = record.target.owner, record.target.attr
    current = getattr(owner, "__dict__", {}).get(attr, None)
    if current is not record.replacement:
        logger.warning(
            "%s was replaced by someone else while patched by %s; restoring the original anyway",
            record.target.path,
            record.entry.name,
        )
    if record.owned:
        setattr(owner, attr, record.raw)
    else:
        with contextlib.suppress(AttributeError):
            delattr(owner, attr)
    logger.debug("restored %s", record.target.path)


@contextlib.contextmanager
def apply_patches(backend: str) -> Iterator[list[RegistryEntry]]:
    """Install the active patches of ``backend`` (and of its parent scopes) for a ``with`` block.

    For every active patch entry and every resolved path, the factory is called with the
    current attribute and the result installed with ``setattr``. On exit every original is
    put back, also when the block raises: an attribute that lived in the owner's ``__dict__``
    gets its identical raw object back (a ``staticmethod`` stays the same ``staticmethod``); an
    inherited attribute is deleted from the owner again.

    A process-wide re-entrant lock is held for the whole block, so two threads exporting at
    once never see each other's patches half installed: the second waits until the first
    block exits. Nesting in one thread is safe: an entry already installed by an enclosing
    block (same key, or a parent scope) is not installed twice. Do not wait inside the block
    for another thread that itself enters ``apply_patches``: it would wait for this block.

    Args:
        backend: backend key, optionally scoped (``"executorch.xnnpack"`` also installs the
            ``"executorch"`` patches first).

    Yields:
        The patch entries in effect for ``backend`` inside the block, in application order,
        whether installed by this block or by an enclosing one.

    Raises:
        ValueError: when ``backend`` is not a dotted name.
        Exception: whatever a patch factory raises (with a note naming the entry and path);
            patches installed before it are restored first.
    """
    _validate_backend(backend)
    with _PATCH_LOCK:
        records: list[_Installed] = []
        installed_keys: list[tuple[str, str, str]] = []
        in_effect: list[RegistryEntry] = []
        try:
            for entry in _active("patch", backend):
                if entry.key in _INSTALLED:
                    in_effect.append(entry)
                    continue
                if entry.unresolved and entry.key not in _WARNED:
                    _WARNED.add(entry.key)
                    for path, reason in entry.unresolved:
                        logger.warning("patch %s cannot replace %s: %s", entry.name, path, reason)
                for target in entry.resolve():
                    records.append(_install(entry, target))
                _INSTALLED.add(entry.key)
                installed_keys.append(entry.key)
                in_effect.append(entry)
            yield in_effect
        finally:
            for record in reversed(records):
                _uninstall(record)
            for key in installed_keys:
                _INSTALLED.discard(key)


# --------------------------------------------------------------------------------------------
# FX fixes
# --------------------------------------------------------------------------------------------


def _is_erased(node: torch.fx.Node, graph: torch.fx.Graph, live: list[set[torch.fx.Node] | None]) -> bool:
    flag = getattr(node, "_erased", None)
    if isinstance(flag, bool):
        return flag
    if live[0] is None:  # torch without Node._erased: fall back to a membership snapshot
        live[0] = set(graph.nodes)
    return node not in live[0]


def apply_fx_node_fixes(backend: str, gm: torch.fx.GraphModule) -> list[str]:
    """Apply the active FX node fixes of ``backend`` (and its parent scopes) to ``gm`` in place.

    Every ``call_function`` node of every GraphModule in ``gm.modules()`` (the root included)
    is offered to the fixes in order: parent scopes first, then registration order. Once a fix
    returns True for a node, later fixes skip it. Nodes present before the pass are visited;
    nodes erased by a fix are skipped and nodes created by a fix are not visited. Every
    GraphModule in which a node was consumed then gets dead code elimination, a lint and a
    recompile.

    Args:
        backend: backend key, optionally scoped.
        gm: the graph module to fix, e.g. ``exported_program.graph_module``.

    Returns:
        Qualified names of the fixes that consumed at least one node, in fix order.

    Raises:
        ValueError: when ``backend`` is not a dotted name.
        Exception: whatever a fix raises (with a note naming the fix and the node), or the
            graph lint error when a fix left the graph inconsistent.
    """
    import torch.fx

    fixes = _active("fx_node_fix", backend)
    if not fixes:
        return []
    used: set[str] = set()
    for module in list(gm.modules()):
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        touched = False
        live: list[set[torch.fx.Node] | None] = [None]
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            for entry in fixes:
                if _is_erased(node, graph, live):
                    break
                try:
                    consumed = entry.func(module, node)
                except Exception as exc:
                    exc.add_note(f"hfexport: raised by FX node fix {entry.name} on node {node.format_node()}")
                    raise
                if consumed:
                    touched = True
                    used.add(entry.name)
                    live[0] = None
                    break
        if touched:
            graph.eliminate_dead_code()
            graph.lint()
            module.recompile()
    return [e.name for e in fixes if e.name in used]


def apply_fx_program_fixes(backend: str, exported_program: torch.export.ExportedProgram) -> list[str]:
    """Apply the active program fixes of ``backend`` (and its parent scopes) in place.

    Args:
        backend: backend key, optionally scoped.
        exported_program: the program to fix; each fix is called once with it.

    Returns:
        Qualified names of the fixes applied, in order.

    Raises:
        ValueError: when ``backend`` is not a dotted name.
        Exception: whatever a fix raises, with a note naming the fix.
    """
    applied: list[str] = []
    for entry in _active("fx_program_fix", backend):
        try:
            entry.func(exported_program)
        except Exception as exc:
            exc.add_note(f"hfexport: raised by FX program fix {entry.name}")
            raise
        applied.append(entry.name)
    return applied
