"""DynamoExporter's side of the backend contract: ``load`` is the safe loader, and saved
generation components load through it (``generation_support.load_component`` = ``runner(load(path))``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfexport.testing.pt2 import SAMPLE_INPUTS, Pool, pickle_payload, pool_program, rewrite_archive
from hfexport_dynamo import DynamoExporter, UnsafeArtifactError, save


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "decode.pt2"
    save(pool_program(), path)
    return path


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
    evil = rewrite_archive(
        pool_file, tmp_path / "decode.pt2", replace={SAMPLE_INPUTS: pickle_payload(marker)}
    )
    with pytest.raises(UnsafeArtifactError, match=r"pickle refused"):
        DynamoExporter().load(evil)
    with pytest.raises(UnsafeArtifactError, match=r"pickle refused"):
        DynamoExporter().generation_support.load_component(evil, {})
    assert not marker.exists()
