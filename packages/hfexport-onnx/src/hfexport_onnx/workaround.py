"""Workaround records for the ONNX-only stages that ``hfexport.registry`` has no kind for.

Custom aten translations (:mod:`hfexport_onnx.translations`) and ONNX IR fixes
(:mod:`hfexport_onnx.ir_fixes`) are workarounds too: each names the upstream issue it exists for
and the version range in which it is needed, exactly like the core's patches and FX fixes, and
is applied only while every distribution it names is inside its range.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from hfexport import registry as _core_registry

__all__ = ["Workaround", "check_metadata"]


def check_metadata(description: str, issue: str, versions: Mapping[str, str]) -> dict[str, str]:
    """Validate the metadata every workaround carries.

    Args:
        description: one line saying what the workaround does.
        issue: http(s) URL of the upstream issue it works around.
        versions: distribution -> PEP 440 specifier set in which it is needed (at least one).

    Returns:
        ``versions`` as a plain dict.

    Raises:
        ValueError: an empty or multi-line description, an issue that is not an http(s) URL,
            no versions, or an invalid specifier set.
    """
    if not isinstance(description, str) or not description.strip() or "\n" in description.strip():
        raise ValueError(f"description must be one non-empty line, got {description!r}")
    parsed = urllib.parse.urlparse(issue) if isinstance(issue, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"issue must be the URL of the upstream issue (https://...), got {issue!r}")
    if not isinstance(versions, Mapping) or not versions:
        raise ValueError(
            "versions must map at least one distribution to a specifier set, e.g. {'torch': '<2.14'}"
        )
    out: dict[str, str] = {}
    for dist, spec in versions.items():
        try:
            SpecifierSet(spec)
        except (InvalidSpecifier, TypeError) as exc:
            raise ValueError(f"versions[{dist!r}] is not a PEP 440 specifier set: {spec!r}") from exc
        out[str(dist)] = str(spec)
    return out


@dataclass(frozen=True)
class Workaround:
    """One registered ONNX-stage workaround.

    Attributes:
        kind: ``"translation"`` or ``"ir_fix"``.
        name: qualified name of the function (``module.qualname``).
        description: what it does, one line.
        issue: upstream issue URL.
        versions: distribution -> specifier set in which it is needed.
        func: the translation or fix function.
        targets: for translations, the aten overloads it translates.
    """

    kind: str
    name: str
    description: str
    issue: str
    versions: dict[str, str]
    func: Callable[..., Any] = field(compare=False, repr=False)
    targets: tuple[Any, ...] = ()

    def inactive_reason(self) -> str | None:
        """``None`` when active, else why not (a distribution missing or outside its range).

        Versions come from ``hfexport.registry.installed_version`` (local suffixes ignored), so
        tests can fake an environment the same way for every kind of workaround.
        """
        for dist, spec in self.versions.items():
            found = _core_registry.installed_version(dist)
            if found is None:
                return f"{dist} is not installed"
            try:
                version = Version(Version(found).public)
            except InvalidVersion:
                return f"{dist} has a version that is not PEP 440 ({found!r})"
            if not SpecifierSet(spec).contains(version, prereleases=True):
                return f"{dist} {found} is outside {spec!r}"
        return None

    def is_active(self) -> bool:
        """True when every distribution in :attr:`versions` is installed inside its range."""
        return self.inactive_reason() is None


def qualified_name(func: Callable[..., Any]) -> str:
    """``module.qualname`` of ``func`` (the identity under which it is registered)."""
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
