"""Input preparers: the ``"input_preparer"`` kind of :mod:`hfexport.registry` (key ``"inputs"``).

Some forward kwargs imply values that ``torch.export`` cannot compute from shapes alone (the
vision position ids a model derives from the *values* of ``image_grid_thw`` with ``.tolist()``
loops). A preparer computes them eagerly, before capture, and returns the inputs with those
tensors added, so the exported graph receives them as inputs. Preparers are registry entries like
every other workaround (same metadata, listed by ``hfexport patches``); their targets are the
input keys (*markers*) that must all be present for them to run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hfexport import registry

__all__ = [
    "KEY",
    "KIND",
    "ExportInputPreparer",
    "apply_export_input_preparers",
    "register_export_input_preparer",
    "registered_export_input_preparers",
    "unregister_export_input_preparer",
]

logger = logging.getLogger(__name__)

#: Registry kind of input preparers.
KIND = "input_preparer"
#: Registry key input preparers are registered under (a core key, see ``hfexport.workarounds``).
KEY = "inputs"

PreparerFn = Callable[[Any, dict[str, Any]], Mapping[str, Any]]
_F = TypeVar("_F", bound=PreparerFn)

registry.register_kind(
    KIND,
    description="fn(model, inputs) -> inputs precomputing data-dependent inputs before capture",
    targets="input keys",
)


@dataclasses.dataclass(frozen=True)
class ExportInputPreparer:
    """A registered function precomputing data-dependent inputs (a view of its registry entry).

    Attributes:
        name: qualified name of ``fn`` (``module.qualname``), the registry key.
        markers: input keys that must all be present (and not None) for ``fn`` to run.
        fn: ``fn(model, inputs) -> new_inputs``.
    """

    name: str
    markers: tuple[str, ...]
    fn: PreparerFn


def register_export_input_preparer(
    *markers: str,
    description: str | None = None,
    issue: str | None = None,
    versions: Mapping[str, str] | None = None,
) -> Callable[[_F], _F]:
    """Decorator registering a preparer of data-dependent inputs.

    Preparers run in registration order. Registering a function with the same qualified name
    again (a module imported twice, a reload) replaces the entry in place, keeping its position.

    Args:
        *markers: input keys that must all be present, with a non-None value, for the preparer
            to run (e.g. ``"image_grid_thw"``).
        description: one line saying what the preparer computes (optional).
        issue: URL of the upstream issue that makes it necessary (optional).
        versions: distribution -> specifier set in which it is needed (optional; without it the
            preparer always runs).

    Returns:
        A decorator that registers ``fn(model, inputs: dict) -> dict`` and returns it
        unchanged. ``fn`` receives a copy of the inputs it may modify and returns the new
        inputs.

    Raises:
        ValueError: no marker given, a marker is not a non-empty string, or invalid metadata
            (see :func:`hfexport.registry.register_patch`).
    """
    if not markers or not all(isinstance(marker, str) and marker for marker in markers):
        raise ValueError(f"register_export_input_preparer needs one or more input key names, got {markers!r}")
    return registry.register(KIND, KEY, *markers, description=description, issue=issue, versions=versions)


def unregister_export_input_preparer(fn_or_name: Callable[..., Any] | str) -> bool:
    """Remove a registered preparer.

    Args:
        fn_or_name: the registered function or its qualified name.

    Returns:
        True if a preparer was removed, False if none was registered under that name.
    """
    name = fn_or_name if isinstance(fn_or_name, str) else registry._qualified_name(fn_or_name)
    return bool(registry.unregister(KIND, name))


def registered_export_input_preparers() -> tuple[ExportInputPreparer, ...]:
    """Return the registered preparers (active or not), in the order they run."""
    return tuple(
        ExportInputPreparer(name=e.name, markers=tuple(e.targets), fn=e.func)
        for e in registry.entries(KEY, kind=KIND)
    )


def apply_export_input_preparers(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply every active preparer whose markers are all present in ``inputs``.

    Args:
        model: the model being exported, passed to each preparer.
        inputs: forward kwargs; not modified.

    Returns:
        A new dict of forward kwargs: the output of the last matching preparer, or a copy of
        ``inputs`` if none matched. A preparer sees the output of the previous ones, so its
        markers are checked against the inputs as they are when its turn comes.

    Raises:
        TypeError: a preparer returned something other than a mapping.
    """
    prepared = dict(inputs)
    for entry in registry.active_entries(KIND, KEY):
        if not all(prepared.get(marker) is not None for marker in entry.targets):
            continue
        result = entry.func(model, dict(prepared))
        if not isinstance(result, Mapping):
            raise TypeError(
                f"export input preparer {entry.name} returned {type(result).__name__}, expected a dict of inputs"
            )
        logger.debug("export input preparer %s applied (markers %s)", entry.name, entry.targets)
        prepared = dict(result)
    return prepared
