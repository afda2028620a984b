"""What a failed export must leave as it was: a model object, a folder on disk.

Shared by the bad-input and fault-injection suites (``tests-integration/test_faults.py``):

* :func:`model_fingerprint`: every tensor's bytes, training flags, the config, the attention
  implementation, the instance attributes of every submodule and the methods of their classes (a
  patch left in place changes the identity of a method);
* :func:`disk_snapshot`: every path below a folder with its size and SHA-256;
* :func:`leftovers`: the temporary files and folders an export may create (staging folders,
  ``.tmp`` files, breadcrumbs) found below a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "LEFTOVER",
    "disk_snapshot",
    "inputs_fingerprint",
    "leftovers",
    "model_fingerprint",
    "tensor_digest",
]

#: names of temporary files and folders of an export (ours, and the backends' own)
LEFTOVER = re.compile(r"hfexport-(staging|old|trash)|\.staging\.|\.tmp$|\.partial|~$")


def tensor_digest(tensor: Any) -> str:
    """The SHA-256 hex digest of ``tensor``'s bytes (any dtype and layout; copied to a contiguous CPU
    buffer first)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    import torch

    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def inputs_fingerprint(inputs: dict[str, Any]) -> dict[str, Any]:
    """``{name: (dtype, shape, digest)}`` per tensor of ``inputs``, ``repr`` of anything else: two
    fingerprints compare equal when no input was changed in place."""
    import torch

    return {
        k: (str(v.dtype), tuple(v.shape), tensor_digest(v)) if isinstance(v, torch.Tensor) else repr(v)
        for k, v in inputs.items()
    }


def model_fingerprint(model: Any) -> dict[str, Any]:
    """A comparable summary of everything an export could change on ``model``.

    Args:
        model: a ``torch.nn.Module`` (a transformers model or any module).

    Returns:
        A dict of plain values: ``state`` (dtype, shape, SHA-256 per state-dict entry),
        ``training``, ``config`` (JSON), ``attn``, ``instance_attrs``, ``class_attrs``; two
        fingerprints compare equal when nothing changed.
    """
    state = {k: (str(v.dtype), tuple(v.shape), tensor_digest(v)) for k, v in model.state_dict().items()}
    config = getattr(model, "config", None)
    classes = {type(m) for m in model.modules()}
    return {
        "state": state,
        "training": {name: m.training for name, m in model.named_modules()},
        "config": json.dumps(config.to_dict(), sort_keys=True, default=str) if config is not None else None,
        "attn": getattr(config, "_attn_implementation", None),
        "instance_attrs": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "class_attrs": {
            f"{c.__module__}.{c.__qualname__}": {k: id(v) for k, v in vars(c).items() if callable(v)}
            for c in classes
        },
    }


def disk_snapshot(root: str | os.PathLike[str]) -> dict[str, tuple[int, str | None]]:
    """Every folder (``"name/"``: ``(-1, None)``) and file (``(size, sha256)``) below ``root``,
    by path relative to ``root``; symlinks are followed. An empty dict for a missing ``root``."""
    snap: dict[str, tuple[int, str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = (-1, None)
        for name in filenames:
            path = os.path.join(dirpath, name)
            data = Path(path).read_bytes()
            snap[os.path.relpath(path, root)] = (len(data), hashlib.sha256(data).hexdigest())
    return snap


def leftovers(root: str | os.PathLike[str]) -> list[str]:
    """Paths below ``root`` (relative) whose names are temporary files of an export (:data:`LEFTOVER`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            if LEFTOVER.search(name):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)
