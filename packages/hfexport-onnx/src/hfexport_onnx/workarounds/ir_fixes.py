"""Fixes applied to the translated ONNX model (``onnx_ir.Model``) before optimization.

Each fix is a function ``fix(model) -> bool`` (True when it changed the model) working around an
upstream translation or runtime bug; it is registered with :func:`register_ir_fix`, naming the
upstream issue and the version range it is needed for, and :func:`apply_ir_fixes` runs the
active ones in registration order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hfexport import registry

__all__ = ["KIND", "apply_ir_fixes", "ir_fix_entries", "register_ir_fix"]

logger = logging.getLogger(__name__)

#: Registry kind of fixes of the translated ONNX model (applied by the ONNX exporter).
KIND = "onnx_ir_fix"
#: Registry key they are registered under.
KEY = "onnx"

_F = TypeVar("_F", bound=Callable[..., Any])

registry.register_kind(
    KIND,
    description="fix(model: onnx_ir.Model) -> bool rewriting the translated ONNX model before optimization",
)


def register_ir_fix(
    *,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Register ``fix(model: onnx_ir.Model) -> bool`` as an ONNX IR fix.

    An entry of kind :data:`KIND` under the ``"onnx"`` key of :mod:`hfexport.registry`.

    Args:
        description: one line saying what the fix does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> specifier set in which the fix is needed.

    Returns:
        A decorator registering the function (idempotent per qualified name) and returning it.

    Raises:
        ValueError: invalid metadata (see :func:`hfexport.registry.register_patch`).
    """
    return registry.register(KIND, KEY, description=description, issue=issue, versions=versions)


def ir_fix_entries() -> list[registry.RegistryEntry]:
    """Every registered IR fix, active or not, in registration order."""
    return registry.entries(KEY, kind=KIND)


def apply_ir_fixes(model: Any) -> list[str]:
    """Run the active IR fixes on ``model`` in place.

    Args:
        model: an ``onnx_ir.Model`` (``ONNXProgram.model``).

    Returns:
        Qualified names of the fixes that changed the model.

    Raises:
        Exception: whatever a fix raises, with a note naming the fix.
    """
    changed: list[str] = []
    for entry in registry.active_entries(KIND, KEY):
        try:
            if entry.func(model):
                changed.append(entry.name)
        except Exception as exc:
            exc.add_note(f"hfexport: raised by ONNX IR fix {entry.name}")
            raise
    return changed
