"""Helpers for generation parity tests over exported components (any backend).

* :func:`generation_config_for` maps a cache kind (``"dynamic"`` / ``"static"``) to the
  ``GenerationConfig`` that ``model.generate`` and ``export_for_generation`` should both use;
* :func:`worst_validation` checks that every component's export validation passed and returns
  the worst max abs diff per component and validation label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CACHE_KINDS", "check_reduced_precision_generation", "generation_config_for", "worst_validation"]

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


def check_reduced_precision_generation(exporter: Any, config: Any, folder: Any) -> dict[str, Any]:
    """Export tiny llama for generation in ``config.dtype`` with ``exporter``, assert what every
    backend must give, save it to ``folder`` and generate from there; returns the greedy parity.

    Asserts: the user's model stays float32; prefill and decode record the dtype and the default
    reduced-precision gates (cosine 0.99, top-1 0.98), their logits pass with cosine >= 0.999 and
    top-1 1.0 (tiny llama); the greedy run over the exported parts covers 16 tokens with at least one
    equal to fp32 ``model.generate`` (reported, not gated); the manifest records the caches in the
    dtype and ``input_ids`` as int64; 4 tokens generated from the folder equal the parity run's.

    Raises:
        AssertionError: when any of those does not hold.
    """
    import json
    from pathlib import Path

    import torch

    from hfexport.generation import MANIFEST_NAME, load_runner, save_components
    from hfexport.testing import tiny_model

    dtype = config.dtype
    model, inputs = tiny_model("llama")
    parts = exporter.export_for_generation(model, inputs, config)
    assert model.dtype == torch.float32
    for name in ("prefill", "decode"):
        report = parts.reports[name]
        assert report.extra["dtype"] == dtype
        assert report.extra["quality_gates"] == {"cosine": 0.99, "top1_agreement": 0.98}
        logits = next(r for r in report.validation["sample"] if r["name"] == "logits")
        assert logits["dtype"] == f"torch.{dtype}" and logits["ok"], (name, logits)
        assert logits["cosine"] >= 0.999 and logits["top1_agreement"] == 1.0, (name, logits)
    parity = parts.reports["decode"].extra["greedy_parity"]
    assert "error" not in parity and len(parity["sequence"]) == len(parity["reference"]) == 16
    assert parity["matching_prefix"] >= 1, parity  # measured on tiny llama: 16 (no divergence)

    folder = Path(folder)
    save_components(exporter, parts, folder, model=model)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    leaves = {leaf["path"]: leaf.get("dtype") for leaf in manifest["plan"]["io"]["decode"]["leaves"]}
    assert leaves["cache.layers.0.keys"] == dtype and leaves["input_ids"] == "int64"
    out = load_runner(folder, exporter=exporter).generate(
        inputs["input_ids"], inputs["attention_mask"], max_new_tokens=4
    )
    assert out.shape == (2, inputs["input_ids"].shape[1] + 4)
    assert out[0, -4:].tolist() == parity["sequence"][:4]
    return parity
