"""Writing ExecuTorch programs to disk atomically.

``ExecutorchProgramManager.save`` in ExecuTorch 1.4 writes the ``.pte`` in place and only logs
when writing fails, so a failed save can leave a truncated file and no error. :func:`save_program`
writes to a temporary file next to the target and renames it only once the write succeeded,
raising on failure; :func:`attach_atomic_save` binds it as ``save`` on a program manager
instance (adding the method where the installed ExecuTorch has none).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

from hfexport.atomic import atomic_path

__all__ = ["attach_atomic_save", "save_program"]


def save_program(manager: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``manager`` (an ``ExecutorchProgramManager``) to ``path`` atomically.

    Args:
        manager: the program to write.
        path: the ``.pte`` file to create or replace; its folder is created if needed.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: the file cannot be written; ``path`` is then left as it was and no temporary
            file remains.

    Tensor data a backend stores outside the program (``.ptd`` files, e.g. for ``cuda``) is
    written next to ``path`` the same way, before the program itself.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensor_data = getattr(manager, "_tensor_data", None)
    if tensor_data:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.data.", dir=target.parent))
        try:
            manager.write_tensor_data_to_file(str(staging))
            for item in sorted(staging.iterdir()):
                os.replace(item, target.parent / item.name)
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(staging)
    with atomic_path(target) as tmp, open(tmp, "wb") as fh:
        manager.write_to_file(fh)
    return target


def attach_atomic_save(manager: Any) -> Any:
    """Bind :func:`save_program` as ``manager.save(path)`` on this instance and return ``manager``."""
    manager.save = types.MethodType(save_program, manager)
    return manager
