"""The backend contract of generation: every hook is a method of the exporter's one
``GenerationSupport`` object (issue 26), the core calls the exporter it was handed (or the one
registered for a manifest's format), and a manifest never decides which modules are imported
(issue 14 item 2). The hooks' old ``HfExporter`` names still work for one release, deprecated.

The backend here is a test-only one, registered under its own format: its artifact is the eager
module itself, kept in memory and named by a token written to the component file, so the tests
exercise the core's generation path without any backend package.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from hfexport import auto
from hfexport.cli import app
from hfexport.config import DynamoConfig
from hfexport.errors import MissingBackendError
from hfexport.exporter import HfExporter
from hfexport.generation import MANIFEST_NAME, generate_from_dir, load_components, save_components
from hfexport.generation.support import GenerationSupport
from hfexport.integrity import write_checksums
from hfexport.testing import tiny_model
from hfexport.testing.eager_backend import EagerModuleExporter

FORMAT = "contracttoy"
NEW_TOKENS = 6
EVIL = "evil_module_that_writes_a_marker"


class RecordingSupport(GenerationSupport):
    """Generation hooks recording their calls on the exporter class."""

    def prepare_component(self, name, module, kwargs, plan):
        type(self.exporter).calls.append(("prepare_component", name))
        return module

    def component_config(self, name, module, kwargs, plan, config):
        type(self.exporter).calls.append(("component_config", name))
        # the returned config is the one exported with: skip validation of the decode graph
        return config.replace(validate=False) if name == "decode" else config

    def component_metadata(self, artifact):
        return {"module_class": type(artifact).__name__}

    def load_component(self, path, metadata):
        type(self.exporter).calls.append(("load_component", metadata["module_class"]))
        return super().load_component(path, metadata)


class EagerExporter(EagerModuleExporter):
    """The eager-module test backend, recording the generation hooks it is called with."""

    export_format = FORMAT
    generation_support_class = RecordingSupport
    calls: list[tuple[str, str]] = []

    def load(self, path, *, trust_remote_code=False):
        type(self).calls.append(("load", f"trust_remote_code={trust_remote_code}"))
        return super().load(path, trust_remote_code=trust_remote_code)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def exported(llama):
    """Components exported once (format registered for the module); the hook calls recorded."""
    model, inputs = llama
    auto._EXPORTERS[FORMAT] = EagerExporter
    try:
        EagerExporter.calls = []
        artifacts = EagerExporter().export_for_generation(model, inputs, DynamoConfig())
        yield artifacts, list(EagerExporter.calls)
    finally:
        auto._EXPORTERS.pop(FORMAT, None)


@pytest.fixture
def toy_format(exported):
    EagerExporter.calls = []
    yield EagerExporter
    EagerExporter.calls = []


@pytest.fixture
def saved(llama, exported, toy_format, tmp_path):
    model, _ = llama
    artifacts, _ = exported
    folder = tmp_path / "out"
    save_components(EagerExporter(), artifacts, folder, model=model)
    return folder, artifacts


def _want(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt) :].tolist()


def test_base_class_defaults_of_the_contract(llama) -> None:
    model, inputs = llama
    exporter = EagerModuleExporter()
    config = DynamoConfig()
    support = exporter.generation_support
    assert type(support) is GenerationSupport and support.exporter is exporter
    assert exporter.generation_support is support  # one object per exporter
    assert support.supports_empty_growing_cache is True
    assert support.prepare_component("decode", model, inputs, None) is model
    assert support.component_config("decode", model, inputs, None, config) is config
    assert support.component_metadata(object()) == {}
    assert support.generation_source(model, config) is None
    assert support.component_filename("decode") == "decode.toy"  # name + the artifact's suffix
    assert type(EagerExporter().generation_support) is RecordingSupport
    with pytest.raises(
        NotImplementedError, match=r"EagerExporter \('contracttoy'\) cannot load saved artifacts"
    ):
        HfExporter.load(EagerExporter(), "x.toy")


def test_export_for_generation_calls_the_hooks_of_the_exporter(exported) -> None:
    artifacts, calls = exported
    assert list(artifacts) == ["prefill", "decode"]
    assert [c for c in calls if c[0] == "prepare_component"] == [
        ("prepare_component", "prefill"),
        ("prepare_component", "decode"),
    ]
    assert [c for c in calls if c[0] == "component_config"] == [
        ("component_config", "prefill"),
        ("component_config", "decode"),
    ]
    # the config the hook returned is the one the component was exported with
    assert "sample" in artifacts.reports["prefill"].validation
    assert "sample" not in artifacts.reports["decode"].validation


def test_supports_empty_growing_cache_false_refuses_a_decode_only_export(llama, toy_format) -> None:
    model, inputs = llama

    class NoEmptyCacheSupport(RecordingSupport):
        supports_empty_growing_cache = False

    class NoEmptyCache(EagerExporter):
        generation_support_class = NoEmptyCacheSupport

    with pytest.raises(
        ValueError, match=r"the contracttoy runtime cannot run a decode graph on an empty growing"
    ):
        NoEmptyCache().export_for_generation(
            model, inputs, DynamoConfig(dynamic=True), multi_token_decode=True, components=["decode"]
        )
    assert not [c for c in toy_format.calls if c[0] == "prepare_component"]


def test_a_folder_loads_with_the_exporter_registered_for_its_format(llama, saved, toy_format) -> None:
    model, inputs = llama
    folder, _ = saved
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["format"] == FORMAT
    assert manifest["files"] == {"prefill": "prefill.toy", "decode": "decode.toy"}
    assert manifest["components"]["decode"]["metadata"] == {"module_class": "LlamaForCausalLM"}
    toy_format.calls.clear()
    prompt = inputs["input_ids"][0].tolist()
    assert generate_from_dir(folder, prompt, max_new_tokens=NEW_TOKENS) == _want(model, prompt)
    # load_component got the saved metadata and went through the backend's own load, safely
    assert toy_format.calls == [
        ("load_component", "LlamaForCausalLM"),
        ("load", "trust_remote_code=False"),
        ("load_component", "LlamaForCausalLM"),
        ("load", "trust_remote_code=False"),
    ]


def test_a_manifest_of_an_unknown_format_lists_the_installed_formats(saved) -> None:
    folder, _ = saved
    path = folder / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["format"] = "nosuchformat"
    path.write_text(json.dumps(manifest))
    write_checksums(folder)  # a consistent folder: the point is what loading imports or refuses
    with pytest.raises(MissingBackendError) as info:
        load_components(folder)
    message = str(info.value)
    assert "export format 'nosuchformat', which no installed backend provides" in message
    assert f"installed formats: {', '.join(auto.available_export_formats())}" in message
    assert FORMAT in message.split("installed formats:")[1]
    manifest["format"] = None
    path.write_text(json.dumps(manifest))
    write_checksums(folder)  # a consistent folder: the point is what loading imports or refuses
    with pytest.raises(ValueError, match=r'names no export format \("format": None\)'):
        load_components(folder)


def test_an_exporter_of_another_format_is_refused(saved) -> None:
    folder, _ = saved

    class Other(EagerExporter):
        export_format = "otherformat"

    with pytest.raises(ValueError, match=r"holds 'contracttoy' components; Other loads 'otherformat' ones"):
        load_components(folder, exporter=Other())


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module on sys.path that writes a marker file when imported."""
    marker = tmp_path / "marker.txt"
    source = tmp_path / "evil_src"
    source.mkdir()
    (source / f"{EVIL}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.syspath_prepend(str(source))
    sys.modules.pop(EVIL, None)
    yield marker
    sys.modules.pop(EVIL, None)


def _poison(folder) -> None:
    """Name the evil module wherever a manifest can name modules."""
    path = folder / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["modules"] = [EVIL]
    for name, io in manifest["plan"]["io"].items():
        io["modules"] = [EVIL, *io["modules"]]
        manifest["components"][name]["metadata"]["modules"] = [EVIL]
    path.write_text(json.dumps(manifest))
    write_checksums(folder)  # a consistent folder: the point is what loading imports or refuses


def test_generate_from_dir_never_imports_modules_named_by_the_manifest(llama, saved, evil_module) -> None:
    model, inputs = llama
    folder, _ = saved
    _poison(folder)
    prompt = inputs["input_ids"][0].tolist()
    assert generate_from_dir(folder, prompt, max_new_tokens=NEW_TOKENS) == _want(model, prompt)
    assert not evil_module.exists()
    assert EVIL not in sys.modules


def test_hfexport_generate_never_imports_modules_named_by_the_manifest(llama, saved, evil_module) -> None:
    model, inputs = llama
    folder, _ = saved
    _poison(folder)
    prompt = inputs["input_ids"][0].tolist()
    result = CliRunner().invoke(
        app, ["generate", str(folder), "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens", "6"]
    )
    assert result.exit_code == 0, result.output
    assert "tokens: " + " ".join(map(str, _want(model, prompt))) in result.output
    assert not evil_module.exists()
    assert EVIL not in sys.modules


def test_a_structure_naming_an_unregistered_type_is_a_clear_error(saved, evil_module) -> None:
    from hfexport.generation.plan import ComponentIO

    folder, _ = saved
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    io = ComponentIO.from_dict(manifest["plan"]["io"]["decode"])
    io.treespec = io.treespec.replace("transformers.cache_utils.DynamicCache", f"{EVIL}.Cache")
    io.modules = [EVIL]
    with pytest.raises(
        ValueError, match=r"names a type that is not registered .*never imports modules named"
    ):
        io.spec()
    assert not evil_module.exists()
    assert EVIL not in sys.modules


def test_component_filename_and_generation_runner_hooks(llama, exported, toy_format, tmp_path) -> None:
    """A backend names its component files and supplies the runner ``hfexport generate`` uses."""
    from hfexport.generation import GenerationRunner, load_runner

    model, inputs = llama
    artifacts, _ = exported
    support = EagerExporter().generation_support
    assert support.component_filename("decode") == "decode.toy"  # the default: name + artifact suffix
    assert isinstance(
        support.generation_runner(artifacts.plan, {"prefill": None, "decode": None}), GenerationRunner
    )

    class OwnLoopSupport(RecordingSupport):
        def component_filename(self, name):
            return f"{name}_graph.toy"

        def generation_runner(self, plan, callers, **runner_kwargs):
            runner = super().generation_runner(plan, callers, **runner_kwargs)
            runner.made_by = "OwnLoop"
            return runner

    class OwnLoop(EagerExporter):
        generation_support_class = OwnLoopSupport

    folder = tmp_path / "own"
    save_components(OwnLoop(), artifacts, folder, model=model)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["files"] == {"prefill": "prefill_graph.toy", "decode": "decode_graph.toy"}
    runner = load_runner(folder, exporter=OwnLoop())
    assert runner.made_by == "OwnLoop"
    prompt = inputs["input_ids"][0].tolist()
    assert generate_from_dir(folder, prompt, max_new_tokens=NEW_TOKENS, exporter=OwnLoop()) == _want(
        model, prompt
    )


def test_generation_source_is_built_once_and_every_component_is_captured_from_it(llama, toy_format) -> None:
    # a backend that transforms the weights before capture (quantization) builds one copy for all
    # components; each component is captured from its counterpart in the copy and validated
    # against the untouched model
    import copy

    from hfexport.generation.parts import mark_transformed_source, transformed_source_of

    model, inputs = llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    built = []

    class ScalingSupport(RecordingSupport):
        def generation_source(self, model, config):
            twin = copy.deepcopy(model)
            with torch.no_grad():
                twin.lm_head.weight.mul_(1.0001)
            mark_transformed_source(twin, model, {"method": "scale"})
            built.append(twin)
            return twin

    class Scaling(EagerExporter):
        generation_support_class = ScalingSupport

    artifacts = Scaling().export_for_generation(model, inputs, DynamoConfig(atol=1e-2, rtol=1e-2))
    assert len(built) == 1
    assert artifacts["prefill"] is artifacts["decode"] is built[0]  # captured from the copy, shared
    assert transformed_source_of(artifacts["decode"]) == ({"method": "scale"}, model)
    assert transformed_source_of(model) is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert "forward" not in model.__dict__ and "forward" not in built[0].__dict__
    assert artifacts.reports["prefill"].validation["sample"]  # validated against the original
    assert "greedy_parity" not in artifacts.reports["decode"].extra  # fp32, no quantization: not gated


def test_the_old_hfexporter_hook_names_still_work_for_one_release(llama, exported, tmp_path) -> None:
    """issue 26: an exporter written against the old contract (hooks as ``HfExporter`` methods) is
    told at class creation, and its overrides, ``super()`` calls included, are still the hooks the
    core calls; calling an old name delegates to the support with a warning."""
    model, inputs = llama
    artifacts, _ = exported
    calls = []

    with pytest.warns(DeprecationWarning, match=r"Legacy overrides component_filename, component_metadata, "):

        class Legacy(EagerModuleExporter):
            export_format = FORMAT
            supports_empty_growing_cache = False

            def component_metadata(self, artifact):
                calls.append("component_metadata")
                return {"legacy": True, **super().component_metadata(artifact)}

            def component_filename(self, name):
                return f"old_{name}.toy"

            def load_component(self, path, metadata):
                calls.append(f"load_component {metadata}")
                return super().load_component(path, metadata)

    exporter = Legacy()
    support = exporter.generation_support
    assert isinstance(support, GenerationSupport) and type(support).__name__ == "LegacyGenerationSupport"
    assert support.supports_empty_growing_cache is False
    assert support.component_filename("decode") == "old_decode.toy"
    folder = tmp_path / "legacy"
    save_components(exporter, artifacts, folder, model=model)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["files"] == {"prefill": "old_prefill.toy", "decode": "old_decode.toy"}
    assert manifest["components"]["decode"]["metadata"] == {"legacy": True}  # super() reached the default
    prompt = inputs["input_ids"][0].tolist()
    assert generate_from_dir(folder, prompt, max_new_tokens=NEW_TOKENS, exporter=Legacy()) == _want(
        model, prompt
    )
    assert calls == ["component_metadata"] * 2 + ["load_component {'legacy': True}"] * 2
    # the old names on a new-style exporter: delegates, deprecated
    new_style = EagerExporter()
    with pytest.warns(DeprecationWarning, match=r"HfExporter.component_filename is deprecated"):
        assert new_style.component_filename("decode") == "decode.toy"
    with pytest.warns(DeprecationWarning, match=r"use exporter.generation_support.component_metadata"):
        assert new_style.component_metadata(torch.nn.Linear(1, 1)) == {"module_class": "Linear"}
    with pytest.warns(DeprecationWarning, match=r"HfExporter.supports_empty_growing_cache is deprecated"):
        assert new_style.supports_empty_growing_cache is True
