"""Crafting ``.pt2`` archives for the tests of archive safety, serialization and bad inputs.

A small torch-only program to save (:class:`Pool`, :func:`pool_program`), a pickle whose only effect
is to create a marker file (:func:`pickle_payload`), and reading, writing and rewriting the members of
a ``torch.export`` archive (a zip whose members all sit under one root folder). Saving the program is
the backend's (``hfexport_dynamo.save``); nothing here imports a backend.
"""

from __future__ import annotations

import io
import json
import pathlib
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

__all__ = [
    "SAMPLE_INPUTS",
    "Pool",
    "TouchOnUnpickle",
    "archive_members",
    "archive_root",
    "edit_json",
    "member_data_offset",
    "pickle_payload",
    "pool_program",
    "rewrite_archive",
    "write_archive",
]

#: the sample-inputs member of an archive, relative to its root folder (a pickle ``torch.load`` reads)
SAMPLE_INPUTS = "data/sample_inputs/model.pt"


class Pool(torch.nn.Module):
    """``forward(x [batch, n, 4] float32) -> [batch, 3] float32``: a seeded linear layer, ReLU, sum
    over ``n``. Torch only (no transformers class), so a subprocess loading it needs only torch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu().sum(dim=1)


def pool_program() -> torch.export.ExportedProgram:
    """:class:`Pool` captured on ``x`` of shape ``[2, 5, 4]`` with axis 1 dynamic (``Dim("n")``), the
    batch static."""
    return torch.export.export(
        Pool().eval(), (), {"x": torch.randn(2, 5, 4)}, dynamic_shapes={"x": {1: Dim("n")}}
    )


class TouchOnUnpickle:
    """Unpickling this object creates ``marker``: stands for any code a pickle can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def pickle_payload(marker: Path) -> bytes:
    """``torch.save`` bytes of a :class:`TouchOnUnpickle`: loading them with ``weights_only=False``
    creates ``marker``; a weights-only load refuses them."""
    buffer = io.BytesIO()
    torch.save(TouchOnUnpickle(marker), buffer)
    return buffer.getvalue()


def archive_members(path: Path) -> list[tuple[str, bytes]]:
    """``[(member name, bytes)]`` of the zip archive at ``path``, in the order stored (names are full
    paths, root folder included; a duplicated name appears twice)."""
    with zipfile.ZipFile(path) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def archive_root(path: Path) -> str:
    """The root folder of the archive at ``path`` (the first component of its first member)."""
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()[0].split("/", 1)[0]


def member_data_offset(path: Path, name: str) -> int:
    """Offset in the file at ``path`` of the first stored byte of member ``name`` (full name): a byte
    flipped at or after it (within the member) keeps the zip readable but fails the member's CRC-32.

    Raises:
        KeyError: the archive has no member ``name``.
    """
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    header = path.read_bytes()[info.header_offset : info.header_offset + 30]  # the local file header
    name_length = int.from_bytes(header[26:28], "little")
    extra_length = int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_length + extra_length


def write_archive(path: Path, members: Sequence[tuple[str, bytes]]) -> Path:
    """Write ``members`` (full names, in this order, duplicates kept) as an uncompressed zip at
    ``path``; returns ``path``. ``zipfile`` warns (``UserWarning: Duplicate name``) on a duplicate."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for name, data in members:
            zout.writestr(name, data)
    return path


def rewrite_archive(
    src: Path,
    dst: Path,
    replace: Mapping[str, bytes | Callable[[bytes], bytes]] | None = None,
    add: Mapping[str, bytes] | None = None,
) -> Path:
    """Copy the archive ``src`` to ``dst`` with members replaced or added; returns ``dst``.

    Args:
        src: a ``.pt2`` (any zip whose members sit under one root folder).
        dst: where the copy is written (uncompressed).
        replace: member path relative to the root (``"data/sample_inputs/model.pt"``) -> new bytes,
            or a function of the old bytes returning the new ones.
        add: member path relative to the root -> bytes, appended after the copied members.
    """
    replace, add = replace or {}, add or {}
    root = archive_root(src)
    members = []
    for name, data in archive_members(src):
        change = replace.get(name[len(root) + 1 :])
        if change is not None:
            data = change(data) if callable(change) else change
        members.append((name, data))
    members += [(f"{root}/{relative}", data) for relative, data in add.items()]
    return write_archive(dst, members)


def edit_json(edit: Callable[[Any], None]) -> Callable[[bytes], bytes]:
    """A ``replace`` function for :func:`rewrite_archive`: parse the member as JSON, let ``edit``
    change the document in place, serialise it again."""

    def apply(data: bytes) -> bytes:
        document = json.loads(data)
        edit(document)
        return json.dumps(document).encode()

    return apply
