"""Two threads exporting the same model object: each export gets the model to itself.

``torch.export`` swaps a module's parameters for fake tensors while it traces, so two captures of
one model object at once corrupted each other (seen as ``AssertionError: Unexpected key
_export_root...`` and ``fake_mode.in_kernel_invocation must be False``). The base exporter now
serializes exports per model object; exports of different models still run side by side.
"""

from __future__ import annotations

import threading

import torch

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.exporter import HfExporter
from hfexport.generation.runner import exported_program_caller
from hfexport.testing import tiny_model


class _Exporter(HfExporter):
    export_format = "concurrency-test"
    config_class = DynamoConfig

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def save(self, artifact, path):
        raise NotImplementedError


def test_two_threads_exporting_one_model_both_match_eager_and_leave_it_unchanged():
    model, inputs = tiny_model("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors: list[BaseException] = []
    reports = []

    def run() -> None:
        exporter = _Exporter()
        try:
            exporter.export(model, inputs, DynamoConfig(dynamic=True))
            reports.append(exporter.last_report)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == []
    assert len(reports) == 2
    for report in reports:
        for label in ("sample", "second_shape"):
            rows = report.validation[label]
            assert rows and all(r["ok"] for r in rows), rows
            assert max(r["max_abs_diff"] for r in rows) < 1e-4
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training
