"""Calibration inputs for static quantization (``QuantizationConfig.calibration``).

A calibrated method (ONNX ``int8-static``, ExecuTorch PT2E) runs the model on representative
inputs to pick activation ranges. :func:`calibration_inputs` builds them, in this order of
preference:

1. ``data``: an iterable of forward-kwarg dicts given through the Python API;
2. ``quantization.calibration``: a UTF-8 text file of prompts, one per line, tokenized with the
   model's tokenizer into batches shaped like the sample inputs (padded/truncated to the sample's
   sequence length, so static graphs take them too);
3. neither: the sample inputs plus seeded random variants (token ids drawn from the sample's id
   range), with a warning, since random tokens calibrate poorly.

Every batch must carry exactly the sample inputs' tensor keys (the graph inputs); anything else is
refused before capture with a ``ValueError`` naming the keys.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["calibration_inputs", "check_calibration_keys"]

logger = logging.getLogger(__name__)


def check_calibration_keys(batches: list[Mapping[str, Any]], sample_inputs: Mapping[str, Any]) -> None:
    """Refuse calibration batches whose tensor keys differ from the sample inputs' tensor keys.

    Raises:
        ValueError: a batch is not a mapping, or its keys are not the model's inputs; the message
            names the batch index, its keys and the expected keys.
    """
    expected = sorted(k for k, v in sample_inputs.items() if isinstance(v, torch.Tensor))
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"calibration sample {index} is a {type(batch).__name__}; allowed: a dict of forward kwargs "
                f"with the keys {expected}"
            )
        keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        if keys != expected:
            raise ValueError(
                f"calibration sample {index} has the keys {keys}, but the model's inputs are {expected}; "
                "give every calibration dict exactly these keys"
            )


def _tokenizer_for(model: Any, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return tokenizer
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source and os.path.isdir(source):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as exc:
            raise ValueError(
                f"calibration prompts need the model's tokenizer, but loading it from {source} failed: {exc}"
            ) from exc
    raise ValueError(
        "calibration prompts need the model's tokenizer: load the model from a folder with one, pass "
        "tokenizer=..., or give calibration data as a list of forward-kwarg dicts"
    )


def _prompt_batches(
    path: str, tokenizer: Any, sample_inputs: Mapping[str, Any], limit: int
) -> list[dict[str, Any]]:
    text = Path(path)
    if not text.is_file():
        raise ValueError(
            f"calibration file {path} does not exist; allowed: a UTF-8 text file, one prompt per line"
        )
    try:
        lines = text.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"calibration file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); give a UTF-8 "
            "text file, one prompt per line"
        ) from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"calibration file {path} holds no prompts; give one prompt per line")
    ids = sample_inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(
            "calibration prompts apply to models taking input_ids [batch, seq]; give calibration data as "
            "forward-kwarg dicts instead"
        )
    from transformers.cache_utils import Cache

    filled = [k for k, v in sample_inputs.items() if isinstance(v, Cache) and v.get_seq_length() > 0]
    if filled:
        # a generation export's decode component: prompts give fresh token ids, not the cache of
        # their own past, so the sample's cache would be paired with unrelated tokens
        raise ValueError(
            f"calibration prompts cannot feed a component that takes a filled KV cache ({filled[0]!r}, the decode "
            "step of a generation export); calibrate it on its sample inputs (no --calibration), or give "
            "calibration data as forward-kwarg dicts per component"
        )
    batch, length = int(ids.shape[0]), int(ids.shape[1])
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = getattr(tokenizer, "eos_token", None) or getattr(tokenizer, "unk_token", None)
    out: list[dict[str, Any]] = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        chunk += [chunk[-1]] * (batch - len(chunk))
        enc = tokenizer(chunk, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        item: dict[str, Any] = {}
        for key, value in sample_inputs.items():
            if not isinstance(value, torch.Tensor):
                item[key] = value
            elif key in enc:
                item[key] = enc[key].to(value.dtype)
            elif key == "token_type_ids":
                item[key] = torch.zeros_like(value)
            elif key == "position_ids":
                item[key] = torch.arange(length).expand(batch, length).to(value.dtype).contiguous()
            else:
                raise ValueError(
                    f"the tokenizer gives no {key!r} for the calibration prompts; give calibration data as "
                    "forward-kwarg dicts instead"
                )
        out.append(item)
        if len(out) >= limit:
            break
    return out


def _random_variants(sample_inputs: Mapping[str, Any], count: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out: list[dict[str, Any]] = [dict(sample_inputs)]
    for _ in range(max(count - 1, 0)):
        item: dict[str, Any] = {}
        for key, value in sample_inputs.items():
            if (
                not isinstance(value, torch.Tensor)
                or "mask" in key
                or "position" in key
                or key == "token_type_ids"
            ):
                item[key] = value
            elif value.is_floating_point():
                item[key] = value + torch.randn(value.shape, generator=gen).to(
                    value.dtype
                ) * value.std().clamp_min(1e-3)
            else:
                low, high = int(value.min()), int(value.max()) + 1
                item[key] = torch.randint(
                    low, max(high, low + 1), tuple(value.shape), generator=gen, dtype=value.dtype
                )
        out.append(item)
    return out


def calibration_inputs(
    quantization: Any,
    model: Any,
    sample_inputs: Mapping[str, Any],
    *,
    data: Iterable[Mapping[str, Any]] | None = None,
    tokenizer: Any = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The calibration batches for a static quantization method.

    Args:
        quantization: the :class:`hfexport.config.QuantizationConfig` (its ``calibration`` file
            and ``num_calibration_samples`` cap).
        model: the eager model (its ``config._name_or_path`` folder gives the tokenizer for prompts).
        sample_inputs: the export's forward kwargs; every batch gets exactly their tensor keys.
        data: forward-kwarg dicts from the Python API (wins over the file).
        tokenizer: the tokenizer for prompts (default: loaded from the model's folder).
        seed: seed of the random variants.

    Returns:
        At most ``quantization.num_calibration_samples`` forward-kwarg dicts.

    Raises:
        ValueError: keys that are not the model's inputs, a missing/empty prompt file, no tokenizer
            for prompts (all before capture).
    """
    limit = int(getattr(quantization, "num_calibration_samples", 32) or 32)
    if data is not None:
        batches = [dict(b) if isinstance(b, Mapping) else b for b in data][:limit]
        if not batches:
            raise ValueError("calibration data is empty; give at least one forward-kwarg dict")
    elif getattr(quantization, "calibration", None):
        batches = _prompt_batches(
            quantization.calibration, _tokenizer_for(model, tokenizer), sample_inputs, limit
        )
    else:
        count = min(limit, 8)
        message = (
            f"no calibration data for {quantization.method!r}: calibrating on the sample inputs plus "
            f"{count - 1} seeded random variants; pass a prompt file (--calibration prompts.txt) for ranges "
            "that match real inputs"
        )
        warnings.warn(message, UserWarning, stacklevel=3)  # the CLI shows it once, via py.warnings
        batches = _random_variants(sample_inputs, count, seed)
    check_calibration_keys(batches, sample_inputs)
    return batches
