"""A matrix of bad inputs to the API (issue 14, "Done when"): each row is one bad call.

Every row asserts the error type and the first line of its message, and that nothing changed:

- in the models: weights, training modes, config (JSON), attention implementation, the sample
  inputs, and no attribute of a model class or of a function the workaround registry patches left
  replaced (:func:`_model_fingerprint`, :func:`_patch_fingerprint`);
- on disk: the test's working folder (every path, size and SHA-256), in which a previous "good"
  export and a user's file sit, is identical afterwards, with no staging or temporary leftovers.

Rows run before any capture, so the matrix is fast; rows needing a backend name its package in
``needs`` and are skipped (``pytest.importorskip``) when it is not installed. The CLI rows are in
``tests-integration/test_bad_inputs_cli.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import shutil
import unittest.mock
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

from hfexport.atomic import atomic_output_dir, atomic_path, check_output_dir
from hfexport.auto import AutoExportConfig, AutoHfExporter
from hfexport.capture import capture
from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig, QuantizationMethod
from hfexport.errors import IntegrityError, OutputDirectoryError, UnsupportedInputError
from hfexport.exporter import HfExporter
from hfexport.generation.support import GenerationSupport
from hfexport.tensors import get_leaf_tensors
from hfexport.testing import tiny_model
from hfexport.testing.eager_backend import EagerModuleExporter
from hfexport.testing.pt2 import archive_members, member_data_offset, pool_program, write_archive
from hfexport.testing.snapshots import LEFTOVER
from hfexport.testing.snapshots import disk_snapshot as _disk_snapshot
from hfexport.testing.snapshots import inputs_fingerprint as _inputs_fingerprint
from hfexport.testing.snapshots import model_fingerprint as _model_fingerprint

# --------------------------------------------------------------------------------------------------
# test-only backends (core only)
# --------------------------------------------------------------------------------------------------


class CoreExporter(HfExporter):
    """torch.export capture through the core only; its artifact file is the graph signature."""

    export_format = "matrix-core"
    config_class = DynamoConfig
    artifact_filename = "model.txt"

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return lambda kwargs: get_leaf_tensors(artifact.module()(**kwargs))

    def save(self, artifact, path):
        with atomic_path(path) as tmp:
            tmp.write_text(str(artifact.graph_signature))


class QuantizingCoreExporter(CoreExporter):
    """A core-only backend declaring two quantization methods and the options each reads."""

    export_format = "matrix-quant"
    quantization_methods = {
        "toy-dynamic": QuantizationMethod("dynamic int8", options=frozenset({"per_channel", "exclude"})),
        "toy-static": QuantizationMethod(
            "calibrated int8", options=frozenset({"per_channel", "calibration", "num_calibration_samples"})
        ),
    }


TOY = "matrixtoy"
TOY_ARTIFACTS: dict[str, Any] = {}  # what export_for_generation returned, set by the fixture


class UnvalidatedComponents(GenerationSupport):
    """Generation hooks exporting every component with ``validate=False``."""

    def component_config(self, name, module, kwargs, plan, config):
        return config.replace(validate=False)


class EagerExporter(EagerModuleExporter):
    """The eager-module test backend (:mod:`hfexport.testing.eager_backend`), components unvalidated."""

    export_format = TOY
    generation_support_class = UnvalidatedComponents


class Plain(torch.nn.Module):
    """A plain module with a keyword forward (no transformers config)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x, scale: float = 1.0):
        return {"y": self.proj(x) * scale}


class Positional(torch.nn.Module):
    def forward(self, x, /):
        return x


class ArgsOnly(torch.nn.Module):
    def forward(self, *args):
        return args[0]


# --------------------------------------------------------------------------------------------------
# fixtures built once per module
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[torch.nn.Module, dict[str, Any]]]:
    return {
        "bert": tiny_model("bert"),
        "llama": tiny_model("llama"),
        "plain": (Plain().eval(), {"x": torch.randn(2, 4)}),
    }


@pytest.fixture(scope="module")
def toy_generation_folder(models, tmp_path_factory) -> Path:
    """A generation export of tiny llama by the eager test backend, saved once."""
    from hfexport import auto
    from hfexport.generation import save_components

    model, inputs = models["llama"]
    auto._EXPORTERS[TOY] = EagerExporter
    folder = tmp_path_factory.mktemp("toygen") / "gen"
    try:
        artifacts = EagerExporter().export_for_generation(model, inputs, DynamoConfig(validate=False))
        save_components(EagerExporter(), artifacts, folder, model=model)
        TOY_ARTIFACTS["llama"] = artifacts
        yield folder
    finally:
        auto._EXPORTERS.pop(TOY, None)


@pytest.fixture(scope="module")
def pt2_file(tmp_path_factory) -> Path | None:
    """A good ``.pt2`` saved by hfexport_dynamo (None without the backend)."""
    try:
        from hfexport_dynamo import save
    except ImportError:
        return None
    path = tmp_path_factory.mktemp("pt2") / "pool.pt2"
    save(pool_program(), path)
    return path


@dataclasses.dataclass
class Env:
    """What a row's setup and call get: the working folder and the module's models."""

    tmp: Path
    models: dict[str, tuple[torch.nn.Module, dict[str, Any]]]
    gen_folder: Path
    pt2: Path | None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def model(self, name: str) -> torch.nn.Module:
        return self.models[name][0]

    def inputs(self, name: str) -> dict[str, Any]:
        return self.models[name][1]


# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = inspect.getattr_static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
        return obj
    raise ImportError(dotted)


# functions our workarounds patch while exporting (also read from the registry, below)
PATCHED = (
    "torch.export.export",
    "torch.nn.functional.scaled_dot_product_attention",
    "transformers.cache_utils.DynamicSlidingWindowLayer.update",
    "transformers.cache_utils.get_layer_types_and_kwargs",
    "transformers.integrations.moe.ExpertsInterface.get_interface",
    "transformers.masking_utils.sdpa_mask",
    "transformers.masking_utils.create_causal_mask",
)


def _patch_fingerprint() -> dict[str, int]:
    from hfexport import registry

    paths = set(PATCHED)
    for entry in registry.entries():
        for target in (*getattr(entry, "paths", ()), *getattr(entry, "targets", ())):
            if isinstance(target, str):
                paths.add(target)
    found = {}
    for path in sorted(paths):
        try:
            found[path] = id(_resolve(path))
        except (ImportError, AttributeError):
            continue
    return found


def _make_workdir(tmp: Path) -> None:
    """A previous good export and a user's file next to where the rows write."""
    good = tmp / "good_export"
    good.mkdir()
    (good / "model.txt").write_text("a graph signature\n")
    (good / "config.json").write_text('{"model_type": "bert"}\n')
    (good / "export_report.json").write_text('{"export_format": "matrix-core"}\n')
    from hfexport.integrity import write_checksums

    write_checksums(good)
    (tmp / "notes.txt").write_text("the user's file\n")


# --------------------------------------------------------------------------------------------------
# the rows
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Env], Any]
    error: type[BaseException] | str  # a class, or "module.Class" of a backend
    first_line: str  # regex, matched at the start of the first line of str(error)
    setup: Callable[[Env], None] | None = None
    needs: str | None = None  # backend distribution import name, importorskip'ed


def _export(name: str, inputs: Any = None, config: Any = None, exporter: type = CoreExporter):
    def call(env: Env) -> Any:
        model = env.model(name) if name in env.models else None
        sample = env.inputs(name) if inputs is None else inputs(env)
        return exporter().export(model, sample, config)

    return call


def _with(name: str, **changes: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda env: {**env.inputs(name), **{k: v(env) if callable(v) else v for k, v in changes.items()}}


def _ids(*shape: int) -> Callable[[Env], torch.Tensor]:
    return lambda env: torch.ones(shape, dtype=torch.long)


def _ds(spec: dict[str, Any]) -> DynamoConfig:
    return DynamoConfig(dynamic_shapes=spec)


KW = r"export needs a torch\.nn\.Module whose forward takes keyword arguments"
TOL = r"is invalid; allowed: a finite, non-negative float or None$"
OPSET = r"is invalid; allowed: an int from 18 to \d+ \(the opsets the installed onnxscript .*\) or None"


def _not_a_module(env: Env) -> Any:
    return CoreExporter().export(lambda **kw: kw, env.inputs("bert"))


def _flip_one_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    where = len(data) // 2 if offset is None else offset
    data[where] ^= 0x01
    path.write_bytes(bytes(data))


# ---- .pt2 files (hfexport_dynamo) ----------------------------------------------------------------


def _copy_pt2(env: Env) -> Path:
    assert env.pt2 is not None
    dst = env.tmp / "art" / "pool.pt2"
    dst.parent.mkdir()
    shutil.copy(env.pt2, dst)
    return dst


def _setup_text_pt2(env: Env) -> None:
    path = env.tmp / "art" / "model.pt2"
    path.parent.mkdir()
    path.write_text("this is not an archive\n")


def _setup_truncated_pt2(env: Env) -> None:
    path = _copy_pt2(env)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _weights_offset(path: Path) -> int:
    """Offset of a byte inside the stored weights of the archive (a flip there keeps the zip valid
    but for its CRC, and changes what would load)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/weights/" in i.filename and i.file_size > 8)
    return member_data_offset(path, info.filename) + 4


def _setup_flipped_pt2(env: Env) -> None:
    from hfexport.integrity import write_checksums

    path = _copy_pt2(env)
    write_checksums(path.parent)
    _flip_one_byte(path, _weights_offset(path))


def _setup_duplicate_pt2(env: Env) -> None:
    path = _copy_pt2(env)
    members = archive_members(path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name we write on purpose
        write_archive(path, [members[-1], *members])


def _dynamo_load(relative: str) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        from hfexport_dynamo import load

        return load(env.tmp / relative)

    return call


# ---- generation folders --------------------------------------------------------------------------


def _copy_gen(env: Env) -> Path:
    dst = env.tmp / "gen"
    shutil.copytree(env.gen_folder, dst)
    return dst


def _setup_plain_folder(env: Env) -> None:
    shutil.copytree(env.tmp / "good_export", env.tmp / "gen")


def _setup_manifest(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        from hfexport.generation import MANIFEST_NAME
        from hfexport.integrity import write_checksums

        folder = _copy_gen(env)
        path = folder / MANIFEST_NAME
        new = edit(json.loads(path.read_text()))
        path.write_text(new if isinstance(new, str) else json.dumps(new))
        write_checksums(folder)  # a consistent folder: the point is the manifest itself

    return setup


def _unknown_format(manifest: dict[str, Any]) -> dict[str, Any]:
    return {**manifest, "format": "nosuchformat"}


def _setup_flipped_component(env: Env) -> None:
    folder = _copy_gen(env)
    component = sorted(folder.glob("*.toy"))[0]
    _flip_one_byte(component, 0)


def _generate(relative: str = "gen") -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        from hfexport import auto
        from hfexport.generation import generate_from_dir

        auto._EXPORTERS[TOY] = EagerExporter
        try:
            return generate_from_dir(env.tmp / relative, [1, 2, 3], max_new_tokens=2)
        finally:
            auto._EXPORTERS.pop(TOY, None)

    return call


# ---- export_config.json -------------------------------------------------------------------------


def _setup_recipe(text: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        folder = env.tmp / "recipe"
        folder.mkdir()
        (folder / "export_config.json").write_text(text, encoding="utf-8")

    return setup


# ---- output folders ------------------------------------------------------------------------------


def _setup_foreign(env: Env) -> None:
    foreign = env.tmp / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("months of work\n")


def _atomic(relative: str) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        with atomic_output_dir(env.tmp / relative) as staging:
            (staging / "model.txt").write_text("new")

    return call


def _check(relative: str) -> Callable[[Env], Any]:
    return lambda env: check_output_dir(env.tmp / relative)


def _save_components_into(relative: str) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        from hfexport.generation import save_components

        return save_components(EagerExporter(), TOY_ARTIFACTS["llama"], env.tmp / relative)

    return call


def _locked_folder(env: Env) -> Path:
    """A folder nobody may write into (mode 0555); for root, who writes anyway, the write probe of
    :mod:`hfexport.atomic` is made to fail there as it would for anyone else."""
    folder = env.tmp / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


@contextlib.contextmanager
def _unwritable(env: Env) -> Any:
    from hfexport import atomic

    locked = env.tmp / "locked"
    real = atomic._probe_write

    def probe(folder: Path) -> OSError | None:
        if os.geteuid() == 0 and Path(folder) == locked:
            return PermissionError(13, "Permission denied")
        return real(folder)

    with unittest.mock.patch.object(atomic, "_probe_write", probe):
        yield


def _with_unwritable(env: Env, call: Callable[[], Any]) -> Any:
    with _unwritable(env):
        return call()


def _onnx_export_to(relative: str, *, locked: bool = False) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        exporter = importlib.import_module("hfexport_onnx").OnnxExporter()
        config = OnnxConfig(output_path=str(env.tmp / relative))
        with _unwritable(env) if locked else contextlib.nullcontext():
            return exporter.export(env.model("bert"), env.inputs("bert"), config)

    return call


def _set(config: Any, name: str, value: Any) -> Any:
    setattr(config, name, value)
    return config


def _dangling_link(env: Env) -> Path:
    """A symlink beside the working folder (a dangling link cannot be snapshotted) naming a folder
    below it that does not exist: following it would create ``gone/out`` in the working folder."""
    link = env.tmp.parent / f"{env.tmp.name}-dangling"
    link.symlink_to(env.tmp / "gone" / "out", target_is_directory=True)
    return link


def _save_dynamo_into(relative: str) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        from hfexport_dynamo import load, save

        return save(load(env.pt2), env.tmp / relative)

    return call


def _encoded_dim(name: str, lo: int, hi: int) -> dict[str, Any]:
    return {"input_ids": {"__int_keys__": [[0, {"__dim__": {"name": name, "min": lo, "max": hi}}]]}}


CASES: list[Case] = [
    # -- the model -------------------------------------------------------------------------------
    Case(
        "model_none",
        _export("none", inputs=lambda env: env.inputs("bert")),
        TypeError,
        KW + r" \(a transformers PreTrainedModel or your own module\), got NoneType$",
    ),
    Case("model_not_a_module", _not_a_module, TypeError, KW + r" \(.*\), got function$"),
    Case(
        "forward_positional_only",
        lambda env: CoreExporter().export(Positional(), {"x": torch.zeros(2, 4)}),
        TypeError,
        KW + r": Positional\.forward takes positional-only parameter\(s\) \['x'\]",
    ),
    Case(
        "forward_star_args",
        lambda env: CoreExporter().export(ArgsOnly(), {"x": torch.zeros(2, 4)}),
        TypeError,
        KW + r": ArgsOnly\.forward takes positional arguments only",
    ),
    # -- the sample inputs -------------------------------------------------------------------------
    Case(
        "inputs_a_list",
        _export("bert", inputs=lambda env: [env.inputs("bert")["input_ids"]]),
        TypeError,
        r"prepare_for_export expects forward kwargs as a dict with string keys, got list$",
    ),
    Case(
        "inputs_a_tensor",
        _export("bert", inputs=lambda env: env.inputs("bert")["input_ids"]),
        TypeError,
        r"prepare_for_export expects forward kwargs as a dict with string keys, got Tensor$",
    ),
    Case(
        "inputs_labels",
        _export("bert", inputs=_with("bert", labels=lambda env: env.inputs("bert")["input_ids"])),
        UnsupportedInputError,
        r"the sample inputs contain 'labels', which only feeds the loss",
    ),
    Case(
        "inputs_unknown_kwarg",
        _export("bert", inputs=_with("bert", foo=_ids(2))),
        UnsupportedInputError,
        r"the sample inputs give \['foo'\], which BertModel\.forward does not take",
    ),
    Case(
        "inputs_unknown_kwarg_plain",
        _export("plain", inputs=lambda env: {"x": torch.randn(2, 4), "colour": 1}),
        UnsupportedInputError,
        r"the sample inputs give \['colour'\], which Plain\.forward does not take",
    ),
    Case(
        "inputs_missing_required",
        _export("plain", inputs=lambda env: {"scale": 2.0}),
        UnsupportedInputError,
        r"Plain\.forward requires \['x'\], which the sample inputs do not give",
    ),
    Case(
        "inputs_batch_mismatch",
        _export("llama", inputs=_with("llama", attention_mask=_ids(3, 8))),
        UnsupportedInputError,
        r"the sample inputs disagree on the text batch: input_ids \[2, 8\] has 2 on axis 0, "
        r"attention_mask \[3, 8\] has 3 on axis 0",
    ),
    Case(
        "inputs_sequence_mismatch",
        _export("bert", inputs=_with("bert", attention_mask=_ids(2, 5))),
        UnsupportedInputError,
        r"the sample inputs disagree on the text sequence length: input_ids \[2, 8\] has 8 on axis 1, "
        r"attention_mask \[2, 5\] has 5 on axis 1",
    ),
    Case(
        "inputs_sequence_length_0",
        _export("llama", inputs=lambda env: {"input_ids": torch.ones(2, 0, dtype=torch.long)}),
        UnsupportedInputError,
        r"input_ids \[2, 0\] has size 0 on axis 1 \(its sequence axis\)",
    ),
    Case(
        "inputs_batch_0",
        _export("bert", inputs=lambda env: {"input_ids": torch.ones(0, 8, dtype=torch.long)}),
        UnsupportedInputError,
        r"input_ids \[0, 8\] has size 0 on axis 0 \(its batch axis\)",
    ),
    # -- token ids (issue 29): refused before capture, not by the embedding lookup ---------------
    Case(
        "inputs_float_input_ids",
        _export("bert", inputs=_with("bert", input_ids=lambda env: env.inputs("bert")["input_ids"].float())),
        UnsupportedInputError,
        r"input_ids is a float32 tensor \[2, 8\], which is invalid; allowed: an integer \(torch\.long\) "
        r"tensor \[batch, sequence\] of token ids",
    ),
    Case(
        "inputs_ids_above_the_vocabulary",
        _export("bert", inputs=_with("bert", input_ids=lambda env: env.inputs("bert")["input_ids"] + 10**5)),
        UnsupportedInputError,
        r"input_ids holds token ids \[1\d{5}, .*\] outside the vocabulary of BertModel, which is invalid; "
        r"allowed: ids from 0 to \d+ \(its input embedding has \d+ rows\)",
    ),
    Case(
        "inputs_negative_ids",
        _export(
            "llama", inputs=_with("llama", input_ids=lambda env: env.inputs("llama")["input_ids"] - 10**5)
        ),
        UnsupportedInputError,
        r"input_ids holds token ids \[-\d+, .*\] outside the vocabulary of LlamaForCausalLM, which is invalid",
    ),
    Case(
        "inputs_input_ids_a_str",
        _export("bert", inputs=_with("bert", input_ids="hello world")),
        UnsupportedInputError,
        r"input_ids='hello world' is a str, which is invalid; allowed: an integer \(torch\.long\) tensor "
        r".*Tokenize the text first",
    ),
    Case(
        "inputs_input_ids_a_list",
        _export("bert", inputs=_with("bert", input_ids=lambda env: env.inputs("bert")["input_ids"].tolist())),
        UnsupportedInputError,
        r"input_ids=\[\[\d+, .* is a list, which is invalid; allowed: an integer \(torch\.long\) tensor",
    ),
    # -- dynamic_shapes ----------------------------------------------------------------------------
    Case(
        "dynamic_shapes_str_leaf",
        lambda env: DynamoConfig(dynamic_shapes={"input_ids": {0: "batch"}}),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\]='batch' is invalid; allowed: torch\.export\.Dim\(name, min=\.\.\., "
        r"max=\.\.\.\), Dim\.AUTO, Dim\.STATIC, Dim\.DYNAMIC, an int or None; .*write Dim\('batch'\)",
    ),
    Case(
        "dynamic_shapes_str_leaf_set_after_construction",
        lambda env: _set(DynamoConfig(), "dynamic_shapes", {"input_ids": ("batch", None)}),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\]='batch' is invalid; allowed: torch\.export\.Dim",
    ),
    Case(
        "dynamic_shapes_dim_bound_not_a_number_from_dict",
        lambda env: DynamoConfig.from_dict(
            {
                "dynamic_shapes": {
                    "input_ids": {"__int_keys__": [[0, {"__dim__": {"name": "b", "min": "one"}}]]}
                }
            }
        ),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\]: Dim 'b' has min='one', which is invalid; allowed: a non-negative "
        r"integer or null",
    ),
    Case(
        "export_config_json_dim_bound_not_a_number",
        lambda env: AutoHfExporter.from_pretrained(env.tmp / "recipe"),
        ValueError,
        r".*recipe/export_config\.json: dynamic_shapes\['input_ids'\]\[1\]: Dim 'seq' has max='lots', which is invalid; allowed: a non-negative "
        r"integer or null",
        setup=_setup_recipe(
            json.dumps(
                {
                    "export_format": "dynamo",
                    "dynamic_shapes": {
                        "input_ids": {
                            "__int_keys__": [[1, {"__dim__": {"name": "seq", "min": 1, "max": "lots"}}]]
                        }
                    },
                }
            )
        ),
    ),
    Case(
        "dynamic_shapes_batch_dynamic_on_one_input_static_on_another",
        _export("bert", config=_ds({"input_ids": {0: Dim("b")}, "attention_mask": {0: None}})),
        ValueError,
        r"dynamic_shapes marks the text batch axis dynamic on input_ids \(dynamic_shapes\['input_ids'\]\[0\] = "
        r"Dim\('b'\)\) and static on attention_mask \(dynamic_shapes\['attention_mask'\]\[0\] = None\), which is "
        r"invalid",
    ),
    Case(
        "dynamic_shapes_sequence_dynamic_on_one_input_static_on_another",
        _export("llama", config=_ds({"input_ids": {1: Dim("s")}, "attention_mask": (None, 8)})),
        ValueError,
        r"dynamic_shapes marks the text sequence axis dynamic on input_ids .* and static on attention_mask "
        r"\(dynamic_shapes\['attention_mask'\]\[1\] = 8\)",
    ),
    Case(
        "dynamic_shapes_3_dims_for_2d",
        _export("bert", config=_ds({"input_ids": (None, None, None)})),
        ValueError,
        r"dynamic_shapes\['input_ids'\] gives 3 axes, but input_ids \[2, 8\] has 2",
    ),
    Case(
        "dynamic_shapes_bad_axis",
        _export("bert", config=_ds({"input_ids": {2: Dim("s")}})),
        ValueError,
        r"dynamic_shapes\['input_ids'\] names axes \[2\], but input_ids \[2, 8\] has 2 axes",
    ),
    Case(
        "dynamic_shapes_max_below_batch",
        _export("bert", config=_ds({"input_ids": {0: Dim("batch", max=1)}})),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\] = Dim\('batch'\) with range \[0, 1\] does not admit the sample size 2",
    ),
    Case(
        "dynamic_shapes_min_above_batch",
        _export("bert", config=_ds({"input_ids": {0: Dim("b", min=4, max=8)}})),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\] = Dim\('b'\) with range \[4, 8\] does not admit the sample size 2",
    ),
    Case(
        "dynamic_shapes_min_gt_max_from_dict",
        lambda env: DynamoConfig.from_dict({"dynamic_shapes": _encoded_dim("b", 5, 3)}),
        ValueError,
        r".*input_ids.*\b5\b.*\b3\b",  # should name the input, the axis and the bad range
    ),
    Case(
        "dynamic_shapes_fixed_size_wrong",
        _export("bert", config=_ds({"input_ids": {0: 3}})),
        ValueError,
        r"dynamic_shapes\['input_ids'\]\[0\] = 3, but input_ids \[2, 8\] has size 2 on axis 0",
    ),
    Case(
        "dynamic_shapes_key_not_an_input",
        _export("bert", config=_ds({"pixel_values": {0: Dim("b")}})),
        ValueError,
        r"dynamic_shapes names \['pixel_values'\], which are not among the sample inputs",
    ),
    # -- tolerances (config, from_dict, and a dict given to export) --------------------------------
    Case("config_atol_nan", lambda env: DynamoConfig(atol=math.nan), ValueError, r"atol=nan " + TOL),
    Case("config_atol_negative", lambda env: DynamoConfig(atol=-1), ValueError, r"atol=-1 " + TOL),
    Case("config_rtol_inf", lambda env: OnnxConfig(rtol=math.inf), ValueError, r"rtol=inf " + TOL),
    Case("config_rtol_negative", lambda env: DynamoConfig(rtol=-0.5), ValueError, r"rtol=-0\.5 " + TOL),
    Case(
        "config_atol_set_after_construction",
        lambda env: _set(DynamoConfig(), "atol", -5),
        ValueError,
        r"atol=-5 " + TOL,
    ),
    Case(
        "config_opset_set_after_construction",
        lambda env: _set(OnnxConfig(), "opset_version", 6),
        ValueError,
        r"opset_version=6 " + OPSET,
    ),
    Case(
        "config_export_format_set_after_construction",
        lambda env: _set(DynamoConfig(), "export_format", "onnx"),
        ValueError,
        r"DynamoConfig has export_format='dynamo', got 'onnx'",
    ),
    Case(
        "from_dict_atol_nan",
        lambda env: AutoExportConfig.from_dict({"export_format": "dynamo", "atol": math.nan}),
        ValueError,
        r"atol=nan " + TOL,
    ),
    Case(
        "from_dict_atol_negative",
        lambda env: AutoExportConfig.from_dict({"export_format": "onnx", "atol": -1}),
        ValueError,
        r"atol=-1 " + TOL,
    ),
    Case(
        "from_dict_rtol_inf",
        lambda env: AutoExportConfig.from_dict({"export_format": "executorch", "rtol": math.inf}),
        ValueError,
        r"rtol=inf " + TOL,
    ),
    Case(
        "from_dict_rtol_negative",
        lambda env: AutoExportConfig.from_dict({"export_format": "dynamo", "rtol": -0.5}),
        ValueError,
        r"rtol=-0\.5 " + TOL,
    ),
    Case(
        "export_config_dict_atol_nan",
        _export("bert", config={"atol": math.nan}),
        ValueError,
        r"atol=nan " + TOL,
    ),
    # -- opset -------------------------------------------------------------------------------------
    Case("opset_99", lambda env: OnnxConfig(opset_version=99), ValueError, r"opset_version=99 " + OPSET),
    Case(
        "opset_10_to_the_6",
        lambda env: OnnxConfig(opset_version=10**6),
        ValueError,
        r"opset_version=1000000 " + OPSET,
    ),
    Case("opset_6", lambda env: OnnxConfig(opset_version=6), ValueError, r"opset_version=6 " + OPSET),
    # -- quantization options the method would ignore, gates where none apply (new-user trial) -----
    Case(
        "quantization_option_the_method_does_not_read",
        _export(
            "bert",
            config=DynamoConfig(quantization={"method": "toy-dynamic", "calibration": "prompts.txt"}),
            exporter=QuantizingCoreExporter,
        ),
        ValueError,
        r"quantization\.calibration='prompts\.txt' is not read by the matrix-quant quantization method "
        r"'toy-dynamic' and would be ignored; allowed with 'toy-dynamic': per_channel, exclude \(calibration "
        r"is read by: toy-static\); drop it or choose a method that reads it$",
    ),
    Case(
        "quantization_option_no_method_reads",
        _export(
            "bert",
            config=DynamoConfig(quantization={"method": "toy-static", "group_size": 32}),
            exporter=QuantizingCoreExporter,
        ),
        ValueError,
        r"quantization\.group_size=32 is not read by the matrix-quant quantization method 'toy-static' .*"
        r"\(no other matrix-quant method reads group_size\)",
    ),
    Case(
        "quality_gates_on_a_plain_float32_config",
        lambda env: DynamoConfig(dtype="float32", quality_gates={"cosine": 0.9}),
        ValueError,
        r"quality_gates=\{'cosine': 0\.9\} cannot apply: quality gates score reduced-precision and quantized "
        r"exports, and this one \(dtype float32, no quantization\) is validated with allclose",
    ),
    Case(
        "quality_gates_on_a_fused_float32_onnx_config",
        lambda env: OnnxConfig(ort_fusions="cpu", dtype="float32", quality_gates={"top1_agreement": 0.9}),
        ValueError,
        r"quality_gates=\{'top1_agreement': 0\.9\} cannot apply",
    ),
    Case(
        # dtype auto: the export decides float32 for the float32 model, which is compared by
        # tolerances, so the gates cannot apply; refused before capture
        "quality_gates_on_an_auto_dtype_export_that_resolves_to_float32",
        _export("bert", config=DynamoConfig(quality_gates={"cosine": 0.9})),
        ValueError,
        r"quality_gates=\{'cosine': 0\.9\} cannot apply: this export computes in float32 like its eager "
        r"reference \(float32\)",
    ),
    Case(
        "onnx_int8_dynamic_with_a_calibration_file",
        _export(
            "bert",
            config=OnnxConfig(quantization={"method": "int8-dynamic", "calibration": "prompts.txt"}),
            exporter=lambda: importlib.import_module("hfexport_onnx").OnnxExporter(),
        ),
        ValueError,
        r"quantization\.calibration='prompts\.txt' is not read by the onnx quantization method 'int8-dynamic' "
        r"and would be ignored; allowed with 'int8-dynamic': per_channel, exclude \(calibration is read by: "
        r"int8-static\)",
        needs="hfexport_onnx",
    ),
    Case(
        "onnx_int8_dynamic_with_calibration_data",
        _export(
            "bert",
            config=OnnxConfig(quantization="int8-dynamic"),
            exporter=lambda: importlib.import_module("hfexport_onnx").OnnxExporter(calibration_data=[{}]),
        ),
        ValueError,
        r"calibration_data is given but quantization method 'int8-dynamic' calibrates nothing and would "
        r"ignore it; allowed: calibration_data=None, or a method that calibrates: int8-static$",
        needs="hfexport_onnx",
    ),
    Case(
        "onnx_int4_weight_per_tensor",
        _export(
            "bert",
            config=OnnxConfig(quantization={"method": "int4-weight", "per_channel": False}),
            exporter=lambda: importlib.import_module("hfexport_onnx").OnnxExporter(),
        ),
        ValueError,
        r"quantization\.per_channel=False is not read by the onnx quantization method 'int4-weight' .*"
        r"allowed with 'int4-weight': group_size, embedding_bits, exclude, symmetric, accuracy_level "
        r"\(per_channel is read by: int8-dynamic, int8-static\)",
        needs="hfexport_onnx",
    ),
    Case(
        "onnx_int8_static_group_size",
        _export(
            "bert",
            config=OnnxConfig(quantization={"method": "int8-static", "group_size": 32}),
            exporter=lambda: importlib.import_module("hfexport_onnx").OnnxExporter(),
        ),
        ValueError,
        r"quantization\.group_size=32 is not read by the onnx quantization method 'int8-static' .*"
        r"\(group_size is read by: int4-weight, int8-weight\)",
        needs="hfexport_onnx",
    ),
    Case(
        "executorch_8da4w_per_tensor",
        _export(
            "bert",
            config=ExecutorchConfig(quantization={"method": "8da4w", "per_channel": False}),
            exporter=lambda: importlib.import_module("hfexport_executorch").ExecutorchExporter(),
        ),
        ValueError,
        r"quantization\.per_channel=False is not read by the executorch quantization method '8da4w' .*"
        r"allowed with '8da4w': group_size, embedding_bits, exclude \(per_channel is read by: int8-dynamic\)",
        needs="hfexport_executorch",
    ),
    Case(
        "executorch_int8_dynamic_group_size_without_4bit_embeddings",
        _export(
            "bert",
            config=ExecutorchConfig(
                quantization={"method": "int8-dynamic", "embedding_bits": 8, "group_size": 64}
            ),
            exporter=lambda: importlib.import_module("hfexport_executorch").ExecutorchExporter(),
        ),
        ValueError,
        r"quantization\.group_size=64 is not read by the executorch quantization method 'int8-dynamic' .*"
        r"allowed with 'int8-dynamic': embedding_bits, per_channel, group_size \(with embedding_bits=4\), "
        r"exclude \(with embedding_bits set\)",
        needs="hfexport_executorch",
    ),
    Case(
        "executorch_int8_dynamic_exclude_without_embeddings",
        _export(
            "bert",
            config=ExecutorchConfig(quantization={"method": "int8-dynamic", "exclude": ["pooler.dense"]}),
            exporter=lambda: importlib.import_module("hfexport_executorch").ExecutorchExporter(),
        ),
        ValueError,
        r"quantization\.exclude=\('pooler\.dense',\) is not read by the executorch quantization method "
        r"'int8-dynamic'",
        needs="hfexport_executorch",
    ),
    # -- configs of another format, unknown formats and fields -------------------------------------
    Case(
        "dynamo_exporter_onnx_config",
        lambda env: importlib.import_module("hfexport_dynamo").DynamoExporter(OnnxConfig()),
        TypeError,
        r"DynamoExporter takes a DynamoConfig, got OnnxConfig; use AutoHfExporter\.from_config",
        needs="hfexport_dynamo",
    ),
    Case(
        "dynamo_exporter_executorch_config",
        lambda env: importlib.import_module("hfexport_dynamo").DynamoExporter(
            ExecutorchConfig(backend="cuda", output_path=str(env.tmp / "model.pte"))
        ),
        TypeError,
        r"DynamoExporter takes a DynamoConfig, got ExecutorchConfig; use AutoHfExporter\.from_config",
        needs="hfexport_dynamo",
    ),
    Case(
        "dynamo_export_with_onnx_config",
        lambda env: (
            importlib.import_module("hfexport_dynamo")
            .DynamoExporter()
            .export(env.model("bert"), env.inputs("bert"), OnnxConfig())
        ),
        TypeError,
        r"DynamoExporter takes a DynamoConfig, got OnnxConfig",
        needs="hfexport_dynamo",
    ),
    Case(
        "onnx_exporter_dynamo_config",
        lambda env: importlib.import_module("hfexport_onnx").OnnxExporter(DynamoConfig()),
        TypeError,
        r"OnnxExporter takes a OnnxConfig, got DynamoConfig; use AutoHfExporter\.from_config",
        needs="hfexport_onnx",
    ),
    Case(
        "auto_exporter_unknown_format",
        lambda env: AutoHfExporter.from_config({"export_format": "nosuch"}),
        ValueError,
        r"export_format='nosuch' is not known; available: .*\bdynamo\b",
    ),
    Case(
        "auto_config_missing_format",
        lambda env: AutoExportConfig.from_dict({"atol": 1e-4}),
        ValueError,
        r"export_format is missing from the config dict; available: ",
    ),
    Case(
        "auto_config_unknown_field",
        lambda env: AutoExportConfig.from_dict({"export_format": "dynamo", "colour": 1}),
        ValueError,
        r"unknown DynamoConfig field\(s\) \['colour'\]; known fields: \[",
    ),
    Case(
        "export_config_json_bad_json",
        lambda env: AutoHfExporter.from_pretrained(env.tmp / "recipe"),
        ValueError,
        r".*recipe/export_config\.json.* is not valid JSON",
        setup=_setup_recipe("{bad json"),
    ),
    Case(
        "export_config_json_not_an_object",
        lambda env: AutoExportConfig.from_json_file(env.tmp / "recipe" / "export_config.json"),
        ValueError,
        r".*recipe/export_config\.json.* holds a JSON list, not an object",
        setup=_setup_recipe("[1, 2]"),
    ),
    Case(
        "export_config_json_missing",
        lambda env: AutoHfExporter.from_pretrained(env.tmp / "nowhere"),
        FileNotFoundError,
        r".*nowhere",
    ),
    Case(
        "executorch_backend_bogus",
        lambda env: ExecutorchConfig(backend="bogus"),
        ValueError,
        r"backend='bogus' is invalid; allowed: 'xnnpack', 'cuda'$",
    ),
    Case(
        "executorch_backend_cuda_without_cuda",
        lambda env: (
            importlib.import_module("hfexport_executorch")
            .ExecutorchExporter()
            .export(env.model("bert"), env.inputs("bert"), ExecutorchConfig(backend="cuda"))
        ),
        RuntimeError,
        r"executorch export of component 'model' \(BertModel\) failed in stage 'prepare_backend': "
        r"RuntimeError: backend='cuda' cannot be used",
        needs="hfexport_executorch",
    ),
    # -- hfexport_dynamo.load ----------------------------------------------------------------------
    Case(
        "pt2_missing",
        _dynamo_load("art/missing.pt2"),
        FileNotFoundError,
        r"no ExportedProgram file at .*art/missing\.pt2$",
        needs="hfexport_dynamo",
    ),
    Case(
        "pt2_text_file",
        _dynamo_load("art/model.pt2"),
        "hfexport_dynamo.CorruptArtifactError",
        r".*art/model\.pt2 is not a valid torch\.export archive \(\.pt2\): not a zip archive",
        setup=_setup_text_pt2,
        needs="hfexport_dynamo",
    ),
    Case(
        "pt2_truncated",
        _dynamo_load("art/pool.pt2"),
        "hfexport_dynamo.CorruptArtifactError",
        r".*art/pool\.pt2 is not a valid torch\.export archive \(\.pt2\): ",
        setup=_setup_truncated_pt2,
        needs="hfexport_dynamo",
    ),
    Case(
        "pt2_flipped_byte_with_checksums",
        _dynamo_load("art/pool.pt2"),
        IntegrityError,
        r".*art/pool\.pt2 does not match its checksum in .*art/checksums\.sha256: expected SHA-256 ",
        setup=_setup_flipped_pt2,
        needs="hfexport_dynamo",
    ),
    Case(
        "pt2_duplicate_member",
        _dynamo_load("art/pool.pt2"),
        "hfexport_dynamo.UnsafeArtifactError",
        r"refusing to load .*art/pool\.pt2: zip readers could read different content from it",
        setup=_setup_duplicate_pt2,
        needs="hfexport_dynamo",
    ),
    # -- generation folders ------------------------------------------------------------------------
    Case(
        "generate_missing_folder",
        _generate("nowhere"),
        FileNotFoundError,
        r"no generation_manifest\.json in ",
    ),
    Case(
        "generate_plain_export_folder",
        _generate(),
        FileNotFoundError,
        r"no generation_manifest\.json in .*gen; export with `hfexport export <format> --task text-generation`",
        setup=_setup_plain_folder,
    ),
    Case(
        "generate_manifest_unknown_format",
        _generate(),
        ImportError,
        r".*generation_manifest\.json was written with export format 'nosuchformat', which no installed "
        r"backend provides \(installed formats: ",
        setup=_setup_manifest(_unknown_format),
    ),
    Case(
        "generate_manifest_not_json",
        _generate(),
        ValueError,
        r".*generation_manifest\.json.*JSON",  # should name the file
        setup=_setup_manifest(lambda manifest: "{not json"),
    ),
    Case(
        "generate_manifest_not_an_object",
        _generate(),
        ValueError,
        r".*generation_manifest\.json.*(object|JSON)",  # should name the file
        setup=_setup_manifest(lambda manifest: "[1, 2]"),
    ),
    Case(
        "generate_flipped_component_byte",
        _generate(),
        IntegrityError,
        r".*gen/\w+\.toy does not match its checksum in .*gen/checksums\.sha256: expected SHA-256 ",
        setup=_setup_flipped_component,
    ),
    Case(
        "generate_empty_prompt",
        lambda env: importlib.import_module("hfexport.generation").generate_from_dir(env.gen_folder, []),
        ValueError,
        r"generate_from_dir takes one non-empty prompt",
    ),
    # -- the tiny-model zoo ------------------------------------------------------------------------
    Case(
        "tiny_model_unknown_type",
        lambda env: tiny_model("bret"),
        ValueError,
        r"unknown model_type 'bret' for the tiny-model zoo: .*\(close matches: bert\b",
    ),
    Case(
        "tiny_model_wrong_task",
        lambda env: tiny_model("bert", "text-generation"),
        ValueError,
        r"the tiny bert model is not available for task 'text-generation'; its tasks: feature-extraction",
    ),
    Case(
        "tiny_model_unknown_task",
        lambda env: tiny_model("bert", "nonsense-task"),
        ValueError,
        r"unknown task 'nonsense-task'; known tasks: text-generation",
    ),
    # -- export_for_generation ---------------------------------------------------------------------
    Case(
        "generation_per_component_config_missing_entry",
        lambda env: CoreExporter().export_for_generation(
            env.model("llama"), env.inputs("llama"), {"decode": DynamoConfig()}
        ),
        ValueError,
        r"the per-component config misses \['prefill'\]; expected one entry for each of \['prefill', 'decode'\]",
    ),
    Case(
        "generation_static_cache_without_length",
        lambda env: CoreExporter().export_for_generation(
            env.model("llama"),
            env.inputs("llama"),
            DynamoConfig(),
            generation_config=importlib.import_module("transformers").GenerationConfig(
                cache_implementation="static"
            ),
        ),
        ValueError,
        r"a static cache needs its length: pass GenerationConfig\(cache_implementation='static', max_cache_len=N\)",
    ),
    # -- output folders ----------------------------------------------------------------------------
    Case(
        "check_output_dir_a_file",
        _check("notes.txt"),
        OutputDirectoryError,
        r"output folder '.*notes\.txt' is a file, not a folder",
    ),
    Case(
        "check_output_dir_foreign_folder",
        _check("foreign"),
        OutputDirectoryError,
        r"output folder '.*foreign' is not empty and is not a previous hfexport export \(it holds thesis\.tex",
        setup=_setup_foreign,
    ),
    Case(
        "check_output_dir_under_a_file",
        _check("notes.txt/out"),
        OutputDirectoryError,
        r"output folder '.*notes\.txt/out' cannot be created: '.*notes\.txt' is a file, not a folder",
    ),
    Case(
        "atomic_output_dir_a_file",
        _atomic("notes.txt"),
        OutputDirectoryError,
        r"output folder '.*notes\.txt' is a file, not a folder",
    ),
    Case(
        "atomic_output_dir_foreign_folder",
        _atomic("foreign"),
        OutputDirectoryError,
        r"output folder '.*foreign' is not empty and is not a previous hfexport export",
        setup=_setup_foreign,
    ),
    Case(
        "atomic_output_dir_under_a_file",
        _atomic("notes.txt/out"),
        OutputDirectoryError,
        r"output folder '.*notes\.txt/out' cannot be created",
    ),
    Case(
        "check_output_dir_dangling_symlink",
        lambda env: check_output_dir(_dangling_link(env)),
        OutputDirectoryError,
        r"output folder '.*-dangling' is a symbolic link to '.*gone/out', which does not exist; refusing to "
        r"follow a dangling link",
    ),
    Case(
        "atomic_output_dir_dangling_symlink",
        lambda env: _atomic(str(_dangling_link(env)))(env),
        OutputDirectoryError,
        r"output folder '.*-dangling' is a symbolic link to '.*gone/out', which does not exist",
    ),
    Case(
        "check_output_dir_unwritable_parent",
        lambda env: _with_unwritable(env, lambda: check_output_dir(env.tmp / "locked" / "out")),
        OutputDirectoryError,
        r"output folder '.*locked/out' cannot be written: (Permission denied|no write permission) on "
        r"'.*locked'",
        setup=_locked_folder,
    ),
    Case(
        "export_to_path_under_a_file",
        lambda env: CoreExporter().export_to_path(
            env.model("bert"), env.inputs("bert"), env.tmp / "notes.txt" / "m.txt"
        ),
        OutputDirectoryError,
        r"path='.*notes\.txt/m\.txt' is invalid: '.*notes\.txt' is a file, not a folder",
    ),
    Case(
        "export_to_path_a_folder",
        lambda env: CoreExporter().export_to_path(
            env.model("bert"), env.inputs("bert"), env.tmp / "good_export"
        ),
        OutputDirectoryError,
        r"path='.*good_export' is invalid: it is an existing folder; allowed: a file path",
    ),
    Case(
        "export_to_path_unwritable_parent",
        lambda env: _with_unwritable(
            env,
            lambda: CoreExporter().export_to_path(
                env.model("bert"), env.inputs("bert"), env.tmp / "locked" / "m.txt"
            ),
        ),
        OutputDirectoryError,
        r"path '.*locked/m\.txt' cannot be written: (Permission denied|no write permission) on '.*locked'",
        setup=_locked_folder,
    ),
    Case(
        "onnx_output_path_under_a_file",
        _onnx_export_to("notes.txt/model.onnx"),
        OutputDirectoryError,
        r"output_path='.*notes\.txt/model\.onnx' is invalid: '.*notes\.txt' is a file, not a folder",
        needs="hfexport_onnx",
    ),
    Case(
        "onnx_output_path_unwritable_parent",
        _onnx_export_to("locked/sub/model.onnx", locked=True),
        OutputDirectoryError,
        r"output_path '.*locked/sub/model\.onnx' cannot be written: (Permission denied|no write permission) on "
        r"'.*locked'",
        setup=_locked_folder,
        needs="hfexport_onnx",
    ),
    Case(
        "save_under_a_file",
        lambda env: CoreExporter().save(None, env.tmp / "notes.txt" / "model.txt"),
        OutputDirectoryError,
        r"cannot write the file '.*notes\.txt/model\.txt': '.*notes\.txt' is a file, not a folder",
    ),
    Case(
        "dynamo_save_under_a_file",
        _save_dynamo_into("notes.txt/model.pt2"),
        OutputDirectoryError,
        r"cannot write the file '.*notes\.txt/model\.pt2': '.*notes\.txt' is a file, not a folder",
        needs="hfexport_dynamo",
    ),
    Case(
        "dynamo_save_into_a_folder",
        _save_dynamo_into("good_export.pt2"),
        OutputDirectoryError,
        r"cannot write the file '.*good_export\.pt2': it is an existing folder",
        setup=lambda env: (env.tmp / "good_export.pt2").mkdir(),
        needs="hfexport_dynamo",
    ),
    Case(
        "save_components_into_a_file",
        _save_components_into("notes.txt"),
        OutputDirectoryError,
        r"output folder '.*notes\.txt' is a file, not a folder",
    ),
]

assert len({c.id for c in CASES}) == len(CASES), "duplicate row ids"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, models, toy_generation_folder, pt2_file, tmp_path) -> None:
    if case.needs:
        pytest.importorskip(case.needs, reason=f"row {case.id} needs the {case.needs} backend")
    if case.id == "executorch_backend_cuda_without_cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available: backend='cuda' is not a bad input on this machine")
    env = Env(tmp=tmp_path, models=models, gen_folder=toy_generation_folder, pt2=pt2_file)
    _make_workdir(tmp_path)
    if case.setup is not None:
        case.setup(env)
    cwd = os.getcwd()
    before_disk = _disk_snapshot(tmp_path)
    before_gen = _disk_snapshot(toy_generation_folder)
    before_models = {name: _model_fingerprint(m) for name, (m, _) in models.items()}
    before_inputs = {name: _inputs_fingerprint(i) for name, (_, i) in models.items()}
    before_patches = _patch_fingerprint()

    error = case.error
    if isinstance(error, str):
        module, _, name = error.rpartition(".")
        error = getattr(importlib.import_module(module), name)
    with pytest.raises(error) as info:
        case.call(env)

    first = (str(info.value).splitlines() or [""])[0]
    assert re.match(case.first_line, first), f"first line {first!r} does not match {case.first_line!r}"
    assert os.getcwd() == cwd
    after_disk = _disk_snapshot(tmp_path)
    assert after_disk == before_disk, _diff(before_disk, after_disk)
    assert not [p for p in after_disk if LEFTOVER.search(p)]
    assert _disk_snapshot(toy_generation_folder) == before_gen
    for name, (model, inputs) in models.items():
        assert _model_fingerprint(model) == before_models[name], f"model {name} changed"
        assert _inputs_fingerprint(inputs) == before_inputs[name], f"sample inputs of {name} changed"
    assert _patch_fingerprint() == before_patches, "a patched function was left in place"


def _diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"disk changed: added {added}, removed {removed}, changed {changed}"


def test_the_matrix_has_enough_rows() -> None:
    assert len(CASES) >= 55


# --------------------------------------------------------------------------------------------------
# the harness itself sees what it must see
# --------------------------------------------------------------------------------------------------


def test_the_model_fingerprint_sees_every_kind_of_change(monkeypatch) -> None:
    model, _ = tiny_model("bert")
    base = _model_fingerprint(model)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[0, 0] += 1e-6
    assert _model_fingerprint(model)["state"] != base["state"]
    model, _ = tiny_model("bert")
    model.train()
    assert _model_fingerprint(model)["training"] != base["training"]
    model.eval()
    model.config.use_cache = not model.config.use_cache
    assert _model_fingerprint(model)["config"] != base["config"]
    model, _ = tiny_model("bert")
    model.config._attn_implementation = "eager"
    assert _model_fingerprint(model)["attn"] != base["attn"]
    model, _ = tiny_model("bert")
    model.forward = lambda **kwargs: None  # an instance attribute left behind
    assert _model_fingerprint(model)["instance_attrs"] != base["instance_attrs"]
    model, _ = tiny_model("bert")
    monkeypatch.setattr(type(model), "forward", lambda self, **kwargs: None)
    assert _model_fingerprint(model)["class_attrs"] != base["class_attrs"]


def test_the_patch_fingerprint_sees_a_patched_function(monkeypatch) -> None:
    base = _patch_fingerprint()
    assert "torch.export.export" in base and len(base) >= 3
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: None)
    assert _patch_fingerprint() != base


def test_the_disk_snapshot_sees_changes(tmp_path) -> None:
    _make_workdir(tmp_path)
    base = _disk_snapshot(tmp_path)
    (tmp_path / "good_export" / "model.txt").write_text("a graph signaturf\n")
    assert _disk_snapshot(tmp_path) != base
    (tmp_path / "good_export" / "model.txt").write_text("a graph signature\n")
    assert _disk_snapshot(tmp_path) == base
    (tmp_path / ".out.hfexport-staging.1.host.x").mkdir()
    after = _disk_snapshot(tmp_path)
    assert after != base and [p for p in after if LEFTOVER.search(p)]
