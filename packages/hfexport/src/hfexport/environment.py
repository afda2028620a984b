"""Installed-version checks: what a backend needs, what it was tested with, and what is here.

Versions are compared on their public part: local suffixes such as ``+cpu`` or ``+cu126`` are
ignored (``2.13.0+cpu`` counts as ``2.13.0``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

__all__ = [
    "EnvironmentProblem",
    "check_environment",
    "installed_version",
    "public_version",
    "torch_older_than",
    "version_older_than",
]

logger = logging.getLogger(__name__)

# (exporter class qualname) -> warned already; drift is reported once per class per process.
_DRIFT_WARNED: set[str] = set()


class VersionDriftWarning(UserWarning):
    """An installed version differs from the one a backend was validated with."""


def installed_version(distribution: str) -> str | None:
    """Return the installed version string of ``distribution`` or ``None`` when absent.

    Goes through ``importlib.metadata.version``; tests monkeypatch this function to fake an
    environment.
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def public_version(version: str) -> Version:
    """Parse ``version`` and drop its local suffix (``"2.13.0+cpu"`` -> ``Version("2.13.0")``).

    Raises:
        packaging.version.InvalidVersion: ``version`` is not PEP 440.
    """
    return Version(Version(version).public)


def version_older_than(distribution: str, version: str) -> bool:
    """True when ``distribution`` is installed at a version below ``version`` (suffixes ignored).

    A distribution that is not installed counts as not older (there is nothing to gate).
    """
    found = installed_version(distribution)
    if found is None:
        return False
    try:
        return public_version(found) < public_version(version)
    except InvalidVersion:
        return False


def torch_older_than(version: str) -> bool:
    """True when the installed torch is older than ``version`` (e.g. ``torch_older_than("2.14")``)."""
    return version_older_than("torch", version)


@dataclass(frozen=True)
class EnvironmentProblem:
    """One unmet requirement: ``kind`` is ``"missing"`` or ``"outdated"``."""

    distribution: str
    kind: str
    installed: str | None
    required: str | None


def check_environment(
    required_packages: Iterable[str],
    min_versions: Mapping[str, str],
    tested_versions: Mapping[str, str],
) -> tuple[list[EnvironmentProblem], list[tuple[str, str, str]]]:
    """Compare the installed distributions with what an exporter needs, in one pass.

    Args:
        required_packages: distribution names that must be importable.
        min_versions: ``{distribution: lowest_supported_version}`` (hard floor).
        tested_versions: ``{distribution: version_validated}`` (drift only warns).

    Returns:
        ``(problems, drift)``: every missing or too-old distribution, and
        ``(distribution, installed, tested)`` for each tested distribution installed at another
        version.
    """
    problems: list[EnvironmentProblem] = []
    drift: list[tuple[str, str, str]] = []
    names = list(dict.fromkeys([*required_packages, *min_versions]))
    for name in names:
        found = installed_version(name)
        if found is None:
            if name in required_packages:
                problems.append(EnvironmentProblem(name, "missing", None, min_versions.get(name)))
            continue
        floor = min_versions.get(name)
        if floor is not None:
            try:
                too_old = public_version(found) < public_version(floor)
            except InvalidVersion:
                too_old = False
            if too_old:
                problems.append(EnvironmentProblem(name, "outdated", found, floor))
    for name, tested in tested_versions.items():
        found = installed_version(name)
        if found is None:
            continue
        try:
            same = public_version(found) == public_version(tested)
        except InvalidVersion:
            same = found == tested
        if not same:
            drift.append((name, found, tested))
    return problems, drift


def format_problems(owner: str, problems: list[EnvironmentProblem], pip_spec: str) -> str:
    """Render ``problems`` as one message ending with the pip command that fixes them all."""
    lines = [f"{owner} cannot run in this environment:"]
    for p in problems:
        if p.kind == "missing":
            floor = f" (>= {p.required})" if p.required else ""
            lines.append(f"  - {p.distribution} is not installed{floor}")
        else:
            lines.append(f"  - {p.distribution} {p.installed} is older than the minimum {p.required}")
    lines.append(f"Install the tested versions with: pip install {pip_spec}")
    return "\n".join(lines)


def warn_drift_once(owner: str, drift: list[tuple[str, str, str]]) -> None:
    """Warn (``VersionDriftWarning``) about ``drift`` once per ``owner`` per process."""
    if not drift or owner in _DRIFT_WARNED:
        return
    _DRIFT_WARNED.add(owner)
    details = ", ".join(f"{name} {found} (tested {tested})" for name, found, tested in drift)
    warnings.warn(
        f"{owner}: installed versions differ from the tested ones: {details}; "
        "behaviour may differ from what was validated",
        VersionDriftWarning,
        stacklevel=3,
    )
