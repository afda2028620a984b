"""DynamoExporter's side of the backend contract: ``load`` is the safe loader, and saved
generation components load through it (``generation_support.load_component`` = ``runner(load(path))``)."""

from __future__ import annotations

import io
import pathlib
import zipfile
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from hfexport_dynamo import DynamoExporter, UnsafeArtifactError, save


class Pool(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x).relu().sum(dim=1)


class _TouchOnUnpickle:
    """Unpickling this object creates ``marker``: stands for any code a pickle can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    program = torch.export.export(
        Pool().eval(), (), {"x": torch.randn(2, 5, 4)}, dynamic_shapes={"x": {1: Dim("n")}}
    )
    path = tmp_path_factory.mktemp("pool") / "decode.pt2"
    save(program, path)
    return path


def _with_pickle_payload(src: Path, dst: Path, marker: Path) -> Path:
    """Copy ``src`` with its sample-inputs member replaced by a pickle that touches ``marker``."""
    buffer = io.BytesIO()
    torch.save(_TouchOnUnpickle(marker), buffer)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data/sample_inputs/model.pt"):
                data = buffer.getvalue()
            zout.writestr(info.filename, data)
    return dst


def test_load_component_runs_the_saved_program(pool_file) -> None:
    caller = DynamoExporter().generation_support.load_component(pool_file, {})
    x = torch.randn(2, 7, 4)  # the sequence axis is dynamic, the batch static
    with torch.no_grad():
        want = Pool().eval()(x)
    got = caller({"x": x})
    assert len(got) == 1
    assert torch.allclose(next(iter(got.values())), want, atol=1e-6, rtol=0)
    # a keyword-input program saved flat records its leaf names (stock torch.export.load runs it)
    assert DynamoExporter().generation_support.component_metadata(torch.export.load(pool_file)) == {
        "flat_io": {"inputs": {"x": "x"}}
    }


def test_load_and_load_component_use_the_safe_loader(pool_file, tmp_path) -> None:
    marker = tmp_path / "marker"
    evil = _with_pickle_payload(pool_file, tmp_path / "decode.pt2", marker)
    with pytest.raises(UnsafeArtifactError, match=r"pickle refused"):
        DynamoExporter().load(evil)
    with pytest.raises(UnsafeArtifactError, match=r"pickle refused"):
        DynamoExporter().generation_support.load_component(evil, {})
    assert not marker.exists()
