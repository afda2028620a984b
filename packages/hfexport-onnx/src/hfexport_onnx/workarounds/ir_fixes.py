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

from hfexport_onnx.workaround import Workaround, check_metadata, qualified_name

__all__ = ["apply_ir_fixes", "ir_fix_entries", "register_ir_fix"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_FIXES: dict[str, Workaround] = {}


def register_ir_fix(*, description: str, issue: str, versions: Mapping[str, str]) -> Callable[[_F], _F]:
    """Register ``fix(model: onnx_ir.Model) -> bool`` as an ONNX IR fix.

    Args:
        description: one line saying what the fix does.
        issue: URL of the upstream issue being worked around.
        versions: distribution -> specifier set in which the fix is needed.

    Returns:
        A decorator registering the function (idempotent per qualified name) and returning it.

    Raises:
        ValueError: invalid metadata (see :func:`~hfexport_onnx.workaround.check_metadata`).
    """
    checked = check_metadata(description, issue, versions)

    def decorate(func: _F) -> _F:
        name = qualified_name(func)
        _FIXES[name] = Workaround("ir_fix", name, description.strip(), issue, checked, func)
        return func

    return decorate


def ir_fix_entries() -> list[Workaround]:
    """Every registered IR fix, active or not, in registration order."""
    return list(_FIXES.values())


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
    for entry in list(_FIXES.values()):
        reason = entry.inactive_reason()
        if reason is not None:
            logger.debug("IR fix %s not applied: %s", entry.name, reason)
            continue
        try:
            if entry.func(model):
                changed.append(entry.name)
        except Exception as exc:
            exc.add_note(f"hfexport: raised by ONNX IR fix {entry.name}")
            raise
    return changed
