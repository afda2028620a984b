"""Saving and loading .pt2 files: atomic writes, weights-only loading, refusal of crafted archives."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.tensors import duplicate_leaf_tensors
from hfexport.testing import tiny_model
from hfexport.testing.pt2 import (
    Pool,
    TouchOnUnpickle,
    archive_root,
    edit_json,
    pickle_payload,
    pool_program,
    rewrite_archive,
)
from hfexport_dynamo import (
    ArtifactLoadError,
    CorruptArtifactError,
    DynamoExporter,
    UnsafeArtifactError,
    inspect_pt2,
    load,
    save,
)
from hfexport_dynamo.safety import _expression_problem, _guard_problem, _target_problem


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    """A dynamic Pool program written by hfexport_dynamo.save."""
    path = tmp_path_factory.mktemp("pool") / "pool.pt2"
    save(pool_program(), path)
    return path


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------


def test_save_then_load_round_trips_a_dynamic_program(pool_file):
    program = load(pool_file)
    x = torch.randn(2, 11, 4)
    assert torch.allclose(program.module()(x=x), Pool().eval()(x), atol=1e-6, rtol=0)


def test_save_refuses_other_objects_and_suffixes(tmp_path):
    with pytest.raises(TypeError, match=r"expects a torch\.export\.ExportedProgram"):
        save(torch.nn.Linear(1, 1), tmp_path / "m.pt2")
    program = torch.export.export(Pool(), (torch.randn(2, 5, 4),))
    with pytest.raises(ValueError, match=r"must end with \.pt2.*e\.g\. model\.pt2"):
        save(program, tmp_path / "model.bin")


def test_failed_save_leaves_no_partial_file_and_keeps_an_existing_one(tmp_path, monkeypatch, pool_file):
    program = load(pool_file)
    target = tmp_path / "model.pt2"

    def broken_save(ep, f, **kwargs):
        f.write(b"PK half an archive")
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save(program, target)
    assert list(tmp_path.iterdir()) == []
    target.write_bytes(b"previous good file")
    with pytest.raises(OSError, match="disk full"):
        save(program, target)
    assert target.read_bytes() == b"previous good file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]


# --------------------------------------------------------------------------------------------
# cache-holding programs
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_program():
    """A llama step traced with a DynamicCache among its inputs (so its sample inputs hold one)."""
    model, inputs = tiny_model("llama", seq_len=4)
    with torch.no_grad():
        cache = model(**inputs).past_key_values
    step = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "past_key_values": cache}  # fmt: skip
    program = capture(model, step, DynamoConfig())
    # eager runs and the program extend the cache in place: hand out a fresh copy every time
    return model, lambda: duplicate_leaf_tensors(step), program


def test_torch_save_of_a_cache_input_program_is_refused_unless_trusted(tmp_path, decode_program):
    model, step, program = decode_program
    path = tmp_path / "torch_saved.pt2"
    torch.export.save(program, path)  # sample inputs pickled with the DynamicCache class
    with pytest.raises(UnsafeArtifactError, match=r"data/sample_inputs/model\.pt: pickle refused") as caught:
        load(path)
    assert "DynamicCache" in str(caught.value) and "trust_remote_code=True" in str(caught.value)
    assert caught.value.path == str(path) and len(caught.value.problems) == 1
    trusted = load(path, trust_remote_code=True)
    got = DynamoExporter().runner(trusted)(step())
    with torch.no_grad():
        assert torch.allclose(got["logits"], model(**step()).logits, atol=1e-5, rtol=0)


def test_our_save_of_a_cache_input_program_loads_weights_only(tmp_path, decode_program, caplog):
    model, step, program = decode_program
    path = save(program, tmp_path / "ours.pt2")
    assert program.example_inputs[1]["past_key_values"] is not None  # the program itself is untouched
    assert inspect_pt2(path.open("rb")) == []
    with caplog.at_level(logging.WARNING, logger="torch._export.serde.serialize"):
        plain = torch.export.load(path)
    assert not [r for r in caplog.records if "Fallback" in r.getMessage()]
    for loaded in (plain, load(path)):
        got = DynamoExporter().runner(loaded)(step())
        with torch.no_grad():
            expected = model(**step())
        assert torch.allclose(got["logits"], expected.logits, atol=1e-5, rtol=0)
        assert torch.equal(got["cache.layers.1.keys"], expected.past_key_values.layers[1].keys)


@pytest.mark.slow
def test_cache_output_program_loads_in_a_fresh_process(tmp_path):
    model, inputs = tiny_model("llama")
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    exporter.save(program, tmp_path / "model.pt2")
    with torch.no_grad():
        expected = exporter.runner(program)(inputs)
    torch.save({"inputs": inputs, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import torch
        data = torch.load({str(tmp_path / "io.pt")!r}, weights_only=True)
        import hfexport_dynamo
        from hfexport.tensors import get_leaf_tensors
        for name, program in (("torch.export.load", torch.export.load({str(tmp_path / "model.pt2")!r})),
                              ("hfexport_dynamo.load", hfexport_dynamo.load({str(tmp_path / "model.pt2")!r}))):
            out = get_leaf_tensors(program.module()(**data["inputs"]))
            out = {{key.replace("__", "."): value for key, value in out.items()}}
            assert list(out) == list(data["expected"]), (name, list(out))
            for key, value in data["expected"].items():
                assert torch.equal(out[key], value), (name, key)
            print(name, "ok", type(program.module()(**data["inputs"])).__name__)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.export.load ok dict" in done.stdout
    assert "hfexport_dynamo.load ok dict" in done.stdout
    assert "Fallback to weights_only=False" not in done.stderr


# --------------------------------------------------------------------------------------------
# crafted archives
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_malicious_sample_inputs_pickle_is_refused_and_never_runs(tmp_path, pool_file):
    marker = tmp_path / "marker"
    evil = rewrite_archive(
        pool_file, tmp_path / "evil.pt2", replace={"data/sample_inputs/model.pt": pickle_payload(marker)}
    )
    with pytest.raises(
        UnsafeArtifactError, match=r"data/sample_inputs/model\.pt: pickle refused by the weights-only"
    ):
        load(evil)
    assert not marker.exists()
    # control: the same file does run its payload through plain torch.export.load (weights_only fallback)
    script = f"import torch\ntry:\n    torch.export.load({str(evil)!r})\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=600)
    assert marker.exists(), "the crafted file no longer reaches full unpickling; this test proves nothing"


def _weights_entry_pickled(marker: Path):
    def edit(document):
        first = next(iter(document["config"].values()))
        first["use_pickle"] = True

    def replace(pool_file: Path) -> dict:
        with zipfile.ZipFile(pool_file) as zf:
            config = json.loads(zf.read(f"{archive_root(pool_file)}/data/weights/model_weights_config.json"))
        path_name = next(iter(config["config"].values()))["path_name"]
        return {
            "data/weights/model_weights_config.json": edit_json(edit),
            f"data/weights/{path_name}": pickle_payload(marker),
        }

    return replace


def _graph_edit(edit):
    return lambda pool_file: {"models/model.json": edit_json(edit)}


def _set_first_target(document):
    document["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.os.system"


def _set_guards(document):
    document["guards_code"] = ["__import__('pathlib').Path('marker').touch() or True"]


def _set_expression(document):
    def visit(value):
        if isinstance(value, dict):
            if "expr_str" in value:
                value["expr_str"] = "__import__('pathlib').Path('marker').touch()"
                return True
            return any(visit(v) for v in value.values())
        if isinstance(value, list):
            return any(visit(v) for v in value)
        return False

    assert visit(document)


def _opaque_constant(marker: Path):
    import pickle

    def edit(document):
        document.setdefault("config", {})["evil"] = {"path_name": "opaque_obj_0", "is_param": False,
                                                     "use_pickle": True, "tensor_meta": None}  # fmt: skip

    return lambda pool_file: {
        "data/constants/model_constants_config.json": edit_json(edit),
        "__add__data/constants/opaque_obj_0": pickle.dumps(TouchOnUnpickle(marker)),
    }


@pytest.mark.parametrize(
    ("craft", "finding"),
    [
        (lambda m: _weights_entry_pickled(m), r"data/weights/\S+ \(proj\.\w+\): pickle refused"),
        (lambda m: _opaque_constant(m), r"opaque_obj_0 \(evil\): a scripted or opaque Python object"),
        (
            lambda m: _graph_edit(_set_first_target),
            r"node target 'torch\.serialization\.os\.system' is neither",
        ),
        (lambda m: _graph_edit(_set_guards), r"guard \"__import__"),
        (lambda m: _graph_edit(_set_expression), r"shape expression \"__import__"),
        (
            lambda m: lambda p: {"__add__data/aotinductor/model/model.so": b"\x7fELF"},
            r"AOTInductor package content",
        ),
        (lambda m: lambda p: {"__add__serialized_state_dict.pt": b"legacy"}, r"unrecognised archive member"),
    ],
    ids=[
        "pickled-weight",
        "opaque-constant",
        "node-target",
        "guard-code",
        "shape-expression",
        "aotinductor",
        "unknown-member",
    ],
)
def test_crafted_archives_are_refused_with_the_reason(tmp_path, pool_file, craft, finding):
    marker = tmp_path / "marker"
    changes = craft(marker)(pool_file)
    add = {k.removeprefix("__add__"): v for k, v in changes.items() if k.startswith("__add__")}
    replace = {k: v for k, v in changes.items() if not k.startswith("__add__")}
    evil = rewrite_archive(pool_file, tmp_path / "evil.pt2", replace=replace, add=add)
    with pytest.raises(UnsafeArtifactError, match=finding) as caught:
        load(evil)
    assert all(p in str(caught.value) for p in caught.value.problems[:20])
    assert not marker.exists()


def test_not_an_archive_and_missing_files_have_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ExportedProgram file"):
        load(tmp_path / "absent.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    for trust in (False, True):
        with pytest.raises(
            CorruptArtifactError, match=r"junk\.pt2 is not a valid torch\.export archive"
        ) as caught:
            load(junk, trust_remote_code=trust)
        assert "trust_remote_code" not in str(caught.value)
        assert isinstance(caught.value, ArtifactLoadError)


# --------------------------------------------------------------------------------------------
# the expression checkers on their own
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "s0 + 1",
        "Mul(Integer(64), Symbol('s70', positive=True, integer=True))",
        "Max(1, FloorDiv(s0, 2))",
        "Eq(Mod(s3, 2), 0)",
        "9223372036854775807",
    ],
)
def test_shape_expressions_torch_writes_pass(text):
    from hfexport_dynamo.safety import _SYMPY_NAMES, _torch_sympy_names

    assert _expression_problem(text, _SYMPY_NAMES | _torch_sympy_names()) is None


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('x')",
        "Symbol('x; rm', positive=True)",
        "Symbol('s0', evaluate=exec)",
        "(lambda: 1)()",
        "s0.__class__",
        "preview(s0)",
    ],
)
def test_shape_expressions_that_could_run_code_are_flagged(text):
    from hfexport_dynamo.safety import _SYMPY_NAMES, _torch_sympy_names

    assert _expression_problem(text, _SYMPY_NAMES | _torch_sympy_names()) is not None


def test_guard_and_target_checks():
    assert _guard_problem("L['input_ids'].size()[1] <= 30") is None
    assert _guard_problem("16 * L['x'].size()[1] == -16 * max(0, -31 + L['x'].size()[1])") is None
    assert _guard_problem("L['x'].__class__") is not None
    assert _guard_problem("open('/etc/passwd')") is not None
    assert _target_problem("torch.ops.aten.add.Tensor") is None
    assert _target_problem("torch.ops.aten.__and__.Tensor") is None
    assert _target_problem("_operator.getitem") is None
    assert _target_problem("torch.sym_max") is None
    assert _target_problem("torch.ops.load_library.x") is not None
    assert _target_problem("torch.ops.aten.__class__.__init__") is not None
    assert _target_problem("builtins.exec") is not None
