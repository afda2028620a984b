"""AOTInductor packages: the exported program compiled ahead of time to native code.

``DynamoConfig(aoti=True)`` (``hfexport export dynamo --aoti OUTPUT_DIR``) makes
:class:`~hfexport_dynamo.DynamoExporter` compile the program with
``torch._inductor.aoti_compile_and_package`` (on CUDA when the model's weights are on a CUDA device,
else CPU) into a package written next to ``model.pt2`` as ``model.aoti.pt2``
(:func:`package_path`), and validate that package, loaded with
``torch._inductor.aoti_load_package``, against eager PyTorch at the sample shape and the second
shape (report stages ``aoti_compile`` and ``validate_aoti``).

A package holds a compiled shared library: loading it runs native code, so load packages from
sources you trust only (the safe ``.pt2`` loader, :func:`hfexport_dynamo.load`, refuses them).
The program's inputs and outputs are flat (:mod:`hfexport_dynamo.flat_io`), so the package runs as
``aoti_load_package("model.aoti.pt2")(**leaves)`` and returns ``{flat_name: tensor}``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport_dynamo.flat_io import flat_inputs, leaf_path

__all__ = [
    "AOTI_SUFFIX",
    "AotiRunner",
    "attached_package",
    "check_aoti_available",
    "compile_package",
    "package_path",
    "save_package",
]

#: Suffix of the package written next to ``model.pt2``: ``model.aoti.pt2``.
AOTI_SUFFIX = ".aoti.pt2"
# program -> its compiled package: a side table of ours, nothing is set on torch's ExportedProgram
_PACKAGES: weakref.WeakKeyDictionary[Any, Path] = weakref.WeakKeyDictionary()


def package_path(pt2_path: str | os.PathLike[str]) -> Path:
    """``out/model.pt2`` -> ``out/model.aoti.pt2``."""
    path = Path(pt2_path)
    return path.with_name(path.name.removesuffix(".pt2") + AOTI_SUFFIX)


def _compiler_candidates() -> list[str]:
    import torch._inductor.config as inductor_config

    configured = inductor_config.cpp.cxx
    names = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    return [str(n) for n in [os.environ.get("CXX"), *names] if n]


def check_aoti_available() -> None:
    """Refuse AOTInductor compilation on a machine without a C++ compiler (checked before capture).

    Raises:
        RuntimeError: no C++ compiler inductor would use (``$CXX``, or ``torch._inductor.config.cpp.cxx``,
            ``g++`` by default) is on ``PATH``; the message says what to install.
    """
    candidates = _compiler_candidates()
    if not any(shutil.which(name) for name in candidates):
        raise RuntimeError(
            "--aoti (DynamoConfig.aoti=True) compiles the program to native code with AOTInductor, which needs a "
            f"C++ compiler; none of {candidates} is on PATH. Install one (e.g. `apt-get install g++`) or set CXX "
            "to its path, or export without --aoti."
        )


def compile_package(program: torch.export.ExportedProgram) -> Path:
    """Compile ``program`` with ``torch._inductor.aoti_compile_and_package`` into a temporary package.

    The package path is remembered on ``program`` (:func:`attached_package`) and the temporary
    folder removed when ``program`` is garbage collected; :func:`save_package` copies it next to a
    saved ``.pt2``.

    Returns:
        The temporary package path (``.../model.aoti.pt2``).

    Raises:
        RuntimeError: no C++ compiler (:func:`check_aoti_available`); inductor's own errors.
    """
    check_aoti_available()
    folder = tempfile.mkdtemp(prefix="hfexport-aoti-")
    target = Path(folder) / f"model{AOTI_SUFFIX}"
    weakref.finalize(program, shutil.rmtree, folder, True)
    with torch.no_grad():
        written = torch._inductor.aoti_compile_and_package(program, package_path=str(target))
    _PACKAGES[program] = Path(written)
    return Path(written)


def attached_package(program: Any) -> Path | None:
    """The package :func:`compile_package` made for ``program``, or ``None``."""
    try:
        path = _PACKAGES.get(program)
    except TypeError:  # an unhashable object is no program of ours
        path = None
    return path if path is not None and Path(path).is_file() else None


def save_package(program: Any, pt2_path: str | os.PathLike[str]) -> Path | None:
    """Copy ``program``'s compiled package next to ``pt2_path`` (:func:`package_path`), atomically.

    Returns:
        The written path, or ``None`` when ``program`` was not compiled.
    """
    from hfexport.atomic import atomic_path

    source = attached_package(program)
    if source is None:
        return None
    target = package_path(pt2_path)
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
    return target


class AotiRunner:
    """Callable running an AOTInductor package: forward kwargs -> ``{output_leaf_path: tensor}``.

    Args:
        package: the ``.aoti.pt2`` file (loaded with ``torch._inductor.aoti_load_package``: native
            code runs; trusted files only).
    """

    def __init__(self, package: str | os.PathLike[str]) -> None:
        self.package = Path(package)
        self.model = torch._inductor.aoti_load_package(str(self.package))

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run on forward kwargs ``inputs`` (caches are given as their flat leaves)."""
        with torch.no_grad():
            outputs = self.model(**flat_inputs(inputs))
        if isinstance(outputs, Mapping):
            return {leaf_path(str(name)): value for name, value in outputs.items()}
        from hfexport.tensors import get_leaf_tensors

        return get_leaf_tensors(outputs)
