"""export_for_generation on the core capture (ExportedProgram components), the greedy runner,
multi-token decode, static caches, save/load.

The exporter used here is the smallest possible backend: the core ``capture`` and
``ExportedProgram.module()``; the backend packages have their own generation tests.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch
from transformers import GenerationConfig

from hfexport.capture import capture
from hfexport.config import DynamoConfig
from hfexport.errors import HfExportError, IntegrityError, OutputDirectoryError
from hfexport.exporter import HfExporter
from hfexport.generation import (
    MANIFEST_NAME,
    ComponentExportError,
    GenerationRunner,
    decode_inputs_for_query_length,
    decompose_prefill_decode,
    exported_program_caller,
    generate_from_dir,
    load_runner,
    save_components,
)
from hfexport.generation.export import resolve_component_configs
from hfexport.integrity import write_checksums
from hfexport.testing import tiny_model
from hfexport.testing.pt2 import SAMPLE_INPUTS, pickle_payload, rewrite_archive

NEW_TOKENS = 20
ATOL = 1e-4


class ProgramExporter(HfExporter):
    """Core-only exporter: the artifact is the ``ExportedProgram`` from ``hfexport.capture``."""

    export_format = "dynamo"
    config_class = DynamoConfig
    artifact_filename = "model.pt2"
    fail_component: str | None = None

    def _export(self, model, inputs, config, report):
        with report.stage("capture"):
            if report.component == self.fail_component:
                raise RuntimeError("capture exploded")
            return capture(model, inputs, config, report)

    def runner(self, artifact):
        return exported_program_caller(artifact)

    def load(self, path, *, trust_remote_code=False):
        from hfexport.pytree import register_known_pytrees

        register_known_pytrees()
        return torch.export.load(path)

    def save(self, artifact, path):
        from hfexport.atomic import atomic_path

        # the example inputs hold cache objects, which torch.export.load (weights_only) refuses
        examples, artifact.example_inputs = artifact.example_inputs, None
        try:
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                torch.export.save(artifact, fh)
        finally:
            artifact.example_inputs = examples


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def dynamic_parts(llama):
    model, inputs = llama
    exporter = ProgramExporter()
    artifacts = exporter.export_for_generation(
        model, inputs, DynamoConfig(dynamic=True), multi_token_decode=True
    )
    return exporter, artifacts


@pytest.fixture(scope="module")
def static_parts(llama):
    model, inputs = llama
    exporter = ProgramExporter()
    config = GenerationConfig(cache_implementation="static", max_cache_len=40)
    artifacts = exporter.export_for_generation(
        model, inputs, DynamoConfig(dynamic=True), generation_config=config, multi_token_decode=True
    )
    return exporter, artifacts


def _reference(model, inputs, **generation):
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        **generation,
    )
    with torch.no_grad():
        return model.generate(**inputs, generation_config=config)


def _check_parity(runner, model, inputs, **generation):
    out = runner.generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=NEW_TOKENS)
    ref = _reference(model, inputs, **generation)
    assert out.shape == (2, 8 + NEW_TOKENS)
    assert torch.equal(out, ref.sequences)
    assert len(runner.last_logits) == NEW_TOKENS
    for ours, theirs in zip(runner.last_logits, ref.logits):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_dynamic_cache_parity_with_generate(llama, dynamic_parts) -> None:
    model, inputs = llama
    _, artifacts = dynamic_parts
    assert list(artifacts) == ["prefill", "decode"]
    assert isinstance(artifacts["decode"], torch.export.ExportedProgram)
    decode_report = artifacts.reports["decode"]
    assert {"sample", "decode_q1", "decode_q4"} <= set(decode_report.validation)
    runner = GenerationRunner(artifacts.plan, {n: exported_program_caller(a) for n, a in artifacts.items()})
    _check_parity(runner, model, inputs)


@pytest.fixture(scope="module")
def decode_kwargs(llama):
    model, inputs = llama
    return decompose_prefill_decode(model, inputs, multi_token_decode=True)["decode"][1]


@pytest.mark.slow
@pytest.mark.parametrize("q", [1, 2, 4])
def test_multi_token_decode_graph_takes_any_query_length(llama, dynamic_parts, decode_kwargs, q) -> None:
    model, _ = llama
    _, artifacts = dynamic_parts
    decode = artifacts["decode"].module()
    inputs = decode_inputs_for_query_length(decode_kwargs, q, seed=q)
    assert inputs["use_cache"] is True  # the kwargs the graph was exported with, flags included (issue 26)
    with torch.no_grad():
        want = model(**copy.deepcopy(inputs))
        got = decode(**copy.deepcopy(inputs))
    assert got.logits.shape == (2, q, model.config.vocab_size)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    assert got.cache.layers[0].keys.shape[2] == 8 + q


@pytest.mark.slow
def test_static_cache_parity_and_in_place_update(llama, static_parts) -> None:
    model, inputs = llama
    _, artifacts = static_parts
    assert artifacts.plan.cache_kind == "static" and artifacts.plan.max_cache_len == 40
    assert "decode_prefill_empty_cache" in artifacts.reports["decode"].validation
    callers = {n: exported_program_caller(a) for n, a in artifacts.items()}
    _check_parity(
        GenerationRunner(artifacts.plan, callers),
        model,
        inputs,
        cache_implementation="static",
        max_cache_len=40,
    )
    # prefill through the decode graph on an empty static cache gives the same tokens
    _check_parity(
        GenerationRunner(artifacts.plan, callers, prefill_with_decode=True),
        model,
        inputs,
        cache_implementation="static",
        max_cache_len=40,
    )
    with pytest.raises(ValueError, match=r"static cache holds 40 positions but this run needs 48"):
        GenerationRunner(artifacts.plan, callers).generate(inputs["input_ids"], max_new_tokens=40)


@pytest.mark.slow
def test_static_cache_passed_to_the_decode_graph_grows_in_place(llama, static_parts) -> None:
    model, inputs = llama
    _, artifacts = static_parts
    config = GenerationConfig(cache_implementation="static", max_cache_len=40)
    kwargs = decompose_prefill_decode(model, inputs, generation_config=config, multi_token_decode=True)[
        "decode"
    ][1]
    decode = artifacts["decode"].module()
    for q, empty in ((1, False), (2, False), (4, False), (4, True)):
        sample = decode_inputs_for_query_length(kwargs, q, empty_cache=empty, seed=q)  # flags included
        cache = sample["cache"]
        keys = cache.layers[0].keys
        before = int(cache.layers[0].cumulative_length)
        with torch.no_grad():
            want = model(**copy.deepcopy(sample))
            got = decode(**sample)
        assert int(cache.layers[0].cumulative_length) == before + q, "the cache length grows by q"
        assert cache.layers[0].keys is keys, "the same preallocated tensor is updated"
        torch.testing.assert_close(keys, want.cache.layers[0].keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)


def test_per_component_configs() -> None:
    one = DynamoConfig(dynamic=True)
    assert resolve_component_configs(one, ["prefill", "decode"]) == {"prefill": one, "decode": one}
    assert resolve_component_configs({"dynamic": True}, ["prefill"]) == {"prefill": {"dynamic": True}}
    both = resolve_component_configs({"prefill": one, "decode": {"dynamic": False}}, ["prefill", "decode"])
    assert both["decode"] == {"dynamic": False}
    with pytest.raises(
        ValueError, match=r"misses \['decode'\].*expected one entry for each of \['prefill', 'decode'\]"
    ):
        resolve_component_configs({"prefill": one}, ["prefill", "decode"])


@pytest.mark.slow
def test_a_failing_component_is_named_and_the_model_left_as_it_was(llama) -> None:
    model, inputs = llama
    exporter = ProgramExporter()
    exporter.fail_component = "decode"
    config_before = model.config.to_dict()
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ComponentExportError) as info:
        exporter.export_for_generation(model, inputs, {"prefill": DynamoConfig(), "decode": DynamoConfig()})
    error = info.value
    assert isinstance(error, RuntimeError)
    assert "'decode' (LlamaForCausalLM)" in str(error) and "capture exploded" in str(error)
    assert error.component == "decode" and error.model_class == "LlamaForCausalLM"
    assert "cache" in error.input_keys and "input_ids" in error.input_keys
    assert model.config.to_dict() == config_before
    assert not model.training and "forward" not in vars(model)
    assert all(torch.equal(v, state_before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="misses"):
        exporter.export_for_generation(model, inputs, {"prefill": DynamoConfig()})


@pytest.mark.slow
def test_save_and_generate_from_dir(llama, dynamic_parts, tmp_path, monkeypatch) -> None:
    model, inputs = llama
    exporter, artifacts = dynamic_parts
    written = save_components(exporter, artifacts, tmp_path, model=model)
    assert sorted(p.name for p in written) == sorted(
        [MANIFEST_NAME, "checksums.sha256", "decode.pt2", "prefill.pt2"]
    )
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["format"] == "dynamo"
    assert manifest["files"] == {"prefill": "prefill.pt2", "decode": "decode.pt2"}
    assert manifest["cache"] == {"kind": "dynamic", "max_cache_len": None}
    assert manifest["token_ids"]["eos_token_id"] == [2] and manifest["token_ids"]["pad_token_id"] == 0
    prompt = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)
    got = generate_from_dir(tmp_path, prompt, max_new_tokens=NEW_TOKENS, exporter=exporter)
    assert got == want[0, len(prompt) :].tolist()
    batch = load_runner(tmp_path, exporter=exporter).generate(
        inputs["input_ids"], inputs["attention_mask"], max_new_tokens=5
    )
    assert batch.shape == (2, 13)
    with pytest.raises(ValueError, match="one non-empty prompt"):
        generate_from_dir(tmp_path, inputs["input_ids"], exporter=exporter)
    with pytest.raises(FileNotFoundError, match=r"no generation_manifest\.json"):
        generate_from_dir(tmp_path / "nowhere", prompt, exporter=exporter)
    # integrity: the folder verifies with coreutils, and one flipped byte is refused before loading
    listed = (tmp_path / "checksums.sha256").read_text().splitlines()
    assert [line.split("  ", 1)[1] for line in listed] == ["decode.pt2", MANIFEST_NAME, "prefill.pt2"]
    check = subprocess.run(
        ["sha256sum", "-c", "checksums.sha256"], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 0 and check.stdout.count(": OK") == 3, check.stdout + check.stderr
    data = bytearray((tmp_path / "decode.pt2").read_bytes())
    data[len(data) // 3] ^= 0x01
    (tmp_path / "decode.pt2").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"decode\.pt2 does not match its checksum in .*checksums\.sha256: "
                       r"expected SHA-256 [0-9a-f]{64}, got [0-9a-f]{64}\. .*re-export it"):  # fmt: skip
        generate_from_dir(tmp_path, prompt, max_new_tokens=NEW_TOKENS, exporter=exporter)
    # a component from someone else (checksums rewritten to match): a pickle that would run code is
    # refused by the loader of the manifest's format (the installed dynamo backend's safe loader,
    # found from the manifest, never a plain torch.export.load)
    pytest.importorskip("hfexport_dynamo", reason="the refusal is the dynamo backend's safe loader")
    marker = tmp_path / "marker"
    rewrite_archive(
        tmp_path / "prefill.pt2", tmp_path / "decode.pt2", replace={SAMPLE_INPUTS: pickle_payload(marker)}
    )
    write_checksums(tmp_path)
    with pytest.raises(HfExportError, match=r"refusing to load .*decode\.pt2"):
        generate_from_dir(tmp_path, prompt, max_new_tokens=2)
    assert not marker.exists()


@pytest.mark.slow
def test_a_failed_save_leaves_nothing_behind(dynamic_parts, tmp_path) -> None:
    exporter, artifacts = dynamic_parts

    class Failing(ProgramExporter):
        def save(self, artifact, path):
            if str(path).endswith("decode.pt2"):
                raise OSError("disk full")
            super().save(artifact, path)

    (tmp_path / "keep.txt").write_text("existing")
    with pytest.raises(OutputDirectoryError, match="not a previous hfexport export"):
        save_components(exporter, artifacts, tmp_path)  # would delete keep.txt: refused
    with pytest.raises(OSError, match="disk full"):
        save_components(Failing(), artifacts, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    with pytest.raises(ValueError, match="needs the generation plan"):
        save_components(exporter, dict(artifacts), tmp_path)


def test_a_data_dependent_size_error_of_a_later_stage_retries_the_image_encoder_per_grid():
    # HunYuan-VL's image encoder passed capture on ExecuTorch and failed in memory planning ("Could not guard on
    # data-dependent expression u271 < 1", later "bad number 68719476736 for type int32"): the per-grid retry
    # did not run
    from hfexport.errors import DataDependentSizeError, ExportStageError
    from hfexport.generation.export import _grid_read_as_values
    from hfexport.generation.plan import GenerationPlan

    plan = GenerationPlan(architecture="multimodal", model_class="M", cache_kind="dynamic")
    inputs = {"input_ids": torch.ones(1, 4, dtype=torch.long), "image_grid_thw": torch.tensor([[1, 4, 4]])}

    def stage_error(cause: BaseException) -> ExportStageError:
        try:
            raise ExportStageError(
                "executorch export failed in stage 'memory_planning'", stage="x"
            ) from cause
        except ExportStageError as exc:
            return exc

    planned = stage_error(DataDependentSizeError("cannot plan u271", symbols=["u271"]))
    assert _grid_read_as_values("image_encoder", planned, plan, inputs, False)
    assert not _grid_read_as_values("image_encoder", planned, plan, inputs, True)  # retried once only
    assert not _grid_read_as_values("decode", planned, plan, inputs, False)
    assert not _grid_read_as_values("image_encoder", planned, plan, {"input_ids": inputs["input_ids"]}, False)
    other = stage_error(TypeError("bad number 68719476736 for type int32"))
    assert not _grid_read_as_values("image_encoder", other, plan, inputs, False)
