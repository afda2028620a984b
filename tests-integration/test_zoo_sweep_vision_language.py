"""The zoo sweep's vision-language family (issue 28): its entries, its failure kinds, and the child's
generation cell (``benchmarks/zoo_sweep_child.generation_cell``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sweep = _load("zoo_sweep")
child = _load("zoo_sweep_child")


def test_the_family_and_its_targets():
    assert sweep.FAMILIES["vision-language"] == "image-text-to-text"
    targets = {b: sweep.TARGETS[("vision-language", b)] for b in ("dynamo", "onnx", "executorch", "openvino")}
    assert targets == {"dynamo": 90, "onnx": 90, "executorch": 85, "openvino": 85}
    types = sweep.sweep_types("vision-language", types=["llava", "qwen2_vl", "bert"])
    assert types == ["llava", "qwen2_vl"]


@pytest.mark.parametrize(
    ("stage", "reason", "kind"),
    [
        (
            "decompose",
            "ValueError: cannot tell where input 'image_features' (2, 256, 256) comes from",
            "decompose",
        ),
        (
            "generate",
            "greedy tokens differ from model.generate at the second shape ({...}): first at (row, position) (0, 30)",
            "generation-mismatch",
        ),
        (
            "generate",
            "at the second shape: KeyError: 'the image_encoder needs 'image_sizes''",
            "generation-runner",
        ),
        (
            "validate_second_shape",
            "image_encoder: ExportStageError: ... AssertionError: Guard failed: pixel_values.size()[2] == 448",
            "fixed-axis",
        ),
    ],
)
def test_generation_failures_get_a_kind_and_a_remedy(stage, reason, kind):
    got, action = sweep.failure_action(stage, reason)
    assert got == kind
    assert action.endswith((".", ")")) and len(action) > 40


def test_the_child_runs_the_generation_cell_for_image_text_to_text(monkeypatch, capsys):
    seen = []
    monkeypatch.setitem(
        child.TASK_CELLS, "image-text-to-text", lambda *a: seen.append(a) or {"status": "pass"}
    )
    monkeypatch.setattr(child, "export_cell", lambda *a: {"status": "plain"})
    child.main(["--no-build", "llava", "image-text-to-text", "dynamo"])
    child.main(["--no-build", "llama", "text-generation", "dynamo"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert seen == [("dynamo", "llava", "image-text-to-text")]
    assert [line.split('"status": ')[1].split('"')[1] for line in lines] == ["pass", "plain"]


def test_openvino_generation_cells_use_stateless_components():
    assert child._backend_generation_config("openvino") == {
        "export_format": "openvino",
        "dynamic": True,
        "stateful": False,
    }
    assert child._backend_generation_config("onnx") == {"export_format": "onnx", "dynamic": True}


@pytest.mark.extended  # about a minute on 2 cores
def test_llava_generation_cell_passes_on_dynamo():
    cell = child.generation_cell("dynamo", "llava", "image-text-to-text")
    assert cell["status"] == "pass", cell
    assert cell["components"] == [
        "image_encoder",
        "multi_modal_projector",
        "embed_tokens",
        "language_model",
        "lm_head",
        "decode",
    ]
    assert cell["stages"]["generate_sample"] == cell["stages"]["generate_second"] == "ok"
