"""Helpers for generation parity tests over exported components (any backend).

* :func:`generation_config_for` maps a cache kind (``"dynamic"`` / ``"static"``) to the
  ``GenerationConfig`` that ``model.generate`` and ``export_for_generation`` should both use;
* :func:`worst_validation` checks that every component's export validation passed and returns
  the worst max abs diff per component and validation label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CACHE_KINDS", "generation_config_for", "worst_validation"]

CACHE_KINDS = ("dynamic", "static")


def generation_config_for(cache: str, max_cache_len: int = 32) -> Any:
    """The ``GenerationConfig`` for a cache kind, or ``None`` for the model's default growing cache.

    Args:
        cache: ``"dynamic"`` (transformers' ``DynamicCache``, grows by the new tokens each step) or
            ``"static"`` (``StaticCache`` preallocated to ``max_cache_len`` positions).
        max_cache_len: positions of the static cache; prompt length plus new tokens must fit.

    Returns:
        ``None`` for ``"dynamic"``; ``GenerationConfig(cache_implementation="static",
        max_cache_len=max_cache_len)`` for ``"static"``.

    Raises:
        ValueError: ``cache`` is neither kind.
    """
    if cache == "dynamic":
        return None
    if cache == "static":
        from transformers import GenerationConfig

        return GenerationConfig(cache_implementation="static", max_cache_len=max_cache_len)
    raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, not {cache!r}")


def worst_validation(parts: Any) -> dict[str, float]:
    """Worst max abs diff of each component's validation runs, after checking that all passed.

    Args:
        parts: what ``HfExporter.export_for_generation`` returned (its ``reports`` map a component
            name to the ``ExportReport`` whose ``validation`` maps a label, e.g. ``"sample"`` or
            ``"decode_q4"``, to per-output rows with ``ok`` and ``max_abs_diff``).

    Returns:
        ``{"<component>.<label>": worst max abs diff}`` over every validation run.

    Raises:
        AssertionError: a validation run has no rows or a row that is not ``ok`` (the message
            names the component, the label and the rows).
    """
    worst: dict[str, float] = {}
    reports: Mapping[str, Any] = parts.reports
    for name, report in reports.items():
        for label, rows in report.validation.items():
            assert rows and all(r["ok"] for r in rows), (name, label, rows)
            worst[f"{name}.{label}"] = max(float(r["max_abs_diff"]) for r in rows)
    return worst
