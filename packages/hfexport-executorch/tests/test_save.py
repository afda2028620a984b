"""Saving: atomic .pte writes through the exporter, the CLI hook and the returned manager's save()."""

from __future__ import annotations

import os

import pytest
import torch

from hfexport.config import ExecutorchConfig
from hfexport_executorch import ExecutorchExporter
from hfexport_executorch.serialize import attach_atomic_save, save_program


@pytest.fixture(scope="module")
def exported(toy_inputs, toy_projection_factory):
    model = toy_projection_factory()
    exporter = ExecutorchExporter()
    return model, exporter, exporter.export(model, toy_inputs(), ExecutorchConfig(validate=False))


def test_save_writes_a_loadable_program(exported, tmp_path, toy_inputs):
    from hfexport_executorch.runtime import load_method, load_program

    model, exporter, program = exported
    path = exporter.artifact_path(tmp_path)
    assert path.name == "model.pte"
    exporter.save(program, path)
    assert path.read_bytes() == program.buffer
    method = load_method(load_program(str(path)))
    inputs = toy_inputs(seed=7)
    (out,) = method.execute([inputs["input_ids"]])
    with torch.no_grad():
        expected = model(**inputs)["hidden"]
    assert (out - expected).abs().max().item() < 1e-5
    assert sorted(os.listdir(tmp_path)) == ["model.pte"]


def test_returned_manager_save_is_atomic(exported, tmp_path):
    _, _, program = exported
    target = tmp_path / "sub" / "model.pte"
    program.save(str(target))
    assert target.read_bytes() == program.buffer


class _FailingManager:
    def write_to_file(self, fh):
        fh.write(b"half a program")
        raise OSError("disk full")


def test_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model.pte"
    target.write_bytes(b"good program")
    manager = attach_atomic_save(_FailingManager())
    with pytest.raises(OSError, match="disk full"):
        manager.save(target)
    with pytest.raises(OSError, match="disk full"):
        save_program(_FailingManager(), target)
    assert target.read_bytes() == b"good program"
    assert sorted(os.listdir(tmp_path)) == ["model.pte"]


def test_export_with_output_path_saves(tmp_path, toy_inputs, toy_projection_factory):
    exporter = ExecutorchExporter()
    path = tmp_path / "out.pte"
    program = exporter.export(toy_projection_factory(), toy_inputs(), ExecutorchConfig(output_path=str(path)))
    assert path.read_bytes() == program.buffer
    assert [s.status for s in exporter.last_report.stages if s.name == "save"] == ["ok"]
