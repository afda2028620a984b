"""The ``genai`` layout (issue 11): ONNX Runtime GenAI's own ``Model`` + ``Generator`` run our export.

Each model is exported through the CLI (``hfexport export onnx --task text-generation --layout
genai``); the folder is then run in a fresh Python process that imports only
``onnxruntime_genai`` (and numpy), whose greedy tokens must equal ``model.generate``'s exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfexport import cli_logging
from hfexport.testing.folders import package_model_folder, tiny_model_folder
from hfexport.testing.invoke import export_layout, folded, invoke, refusal
from hfexport_onnx.layouts.genai import GENERIC_TYPE, genai_model_type

pytest.importorskip("onnxruntime_genai")

NEW_TOKENS = 24

# Runs in the child process: only onnxruntime_genai and numpy are imported. Text prompts are
# encoded with the runtime's own tokenizer (og.Tokenizer over the folder's tokenizer files);
# lists of ids are fed as they are.
GENAI_SCRIPT = r"""
import json, sys
import numpy as np
import onnxruntime_genai as og

folder, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(folder)
tokenizer = og.Tokenizer(model) if any(isinstance(p, str) for p in prompts) else None
results = []
for prompt in prompts:
    ids = np.asarray(tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=int(ids.shape[-1]) + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(ids[None, :])
    while not generator.is_done():
        generator.generate_next_token()
    results.append({"prompt": ids.tolist(), "sequence": [int(t) for t in generator.get_sequence(0)]})
forbidden = sorted(m for m in sys.modules if m.split(".")[0] in ("hfexport", "hfexport_onnx", "torch", "transformers"))
print(json.dumps({"results": results, "forbidden_modules": forbidden}))
"""


@pytest.fixture(autouse=True)
def _cli_log_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(cli_logging.LOG_FILE_ENV, str(tmp_path / "cli-test.log"))


def _export(folder: Path, out: Path) -> dict:
    result = export_layout("onnx", folder, out, layout="genai", task="text-generation")
    assert result.exit_code == 0, result.output
    return json.loads((out / "export_report.json").read_text())


def _run_genai(out: Path, prompts: list[str]) -> dict:
    """Run the folder with onnxruntime_genai alone, in a child process, from a neutral directory."""
    proc = subprocess.run(
        [sys.executable, "-c", GENAI_SCRIPT, str(out), json.dumps(prompts), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        cwd=out.parent,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _eager_greedy(folder: Path, prompts: list[str]) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            sequence = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS
            )
        out.append((ids[0].tolist(), sequence[0].tolist()))
    return out


def _assert_same_tokens(
    folder: Path, out: Path, prompts: list[str], *, runtime_tokenizer: bool = True
) -> dict:
    expected = _eager_greedy(folder, prompts)
    ran = _run_genai(out, prompts if runtime_tokenizer else [ids for ids, _ in expected])
    assert ran["forbidden_modules"] == []  # the runtime alone: no hfexport, torch or transformers
    assert len({len(p) for p, _ in expected}) == len(prompts)  # prompts of different lengths
    for got, (prompt, sequence) in zip(ran["results"], expected):
        assert got["prompt"] == prompt  # og.Tokenizer reads the copied tokenizer files like transformers
        assert len(sequence) - len(prompt) >= 20  # no early eos: at least 20 new tokens compared
        assert got["sequence"] == sequence
    return ran


@pytest.mark.parametrize(
    ("model_type", "runtime_type"),
    [("llama", "llama"), pytest.param("qwen3", "qwen3", marks=pytest.mark.extended)],
)
def test_genai_generator_matches_generate_on_tiny_models(tmp_path, model_type, runtime_type):
    folder = tiny_model_folder(model_type, tmp_path / "model")
    out = tmp_path / "out"
    report = _export(folder, out)

    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        [
            "model.onnx",
            "genai_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "config.json",
            "export_report.json",
            "checksums.sha256",
        ]
    )
    config = json.loads((folder / "config.json").read_text())
    genai = json.loads((out / "genai_config.json").read_text())
    decoder = genai["model"]["decoder"]
    assert genai["model"]["type"] == runtime_type
    assert genai["model"]["context_length"] == config["max_position_embeddings"]
    assert genai["model"]["vocab_size"] == config["vocab_size"] == 428  # the offline tokenizer's size
    assert (
        genai["model"]["bos_token_id"],
        genai["model"]["eos_token_id"],
        genai["model"]["pad_token_id"],
    ) == (1, 2, 0)
    assert decoder["num_hidden_layers"] == config["num_hidden_layers"]
    assert decoder["num_key_value_heads"] == config["num_key_value_heads"]
    assert decoder["num_attention_heads"] == config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert decoder["head_size"] == head_size
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert genai["search"]["do_sample"] is False
    assert report["layout"] == "genai" and report["runtime"] == "onnxruntime-genai"
    validated = report["report"]["validation"]
    assert {"sample", "prefill_empty_past", "decode_step"} <= set(validated)
    assert next(r["shape"] for r in validated["prefill_empty_past"] if r["name"] == "present.0.key")[2] == 4

    _assert_same_tokens(folder, out, ["Hello world! The quick brown fox", "Numbers 0 1 2"])


def test_genai_generator_matches_generate_on_real_gpt2(tmp_path):
    folder = package_model_folder("iglm/IgLM-S", tmp_path / "model")
    out = tmp_path / "out"
    report = _export(folder, out)
    genai = json.loads((out / "genai_config.json").read_text())
    # GPT-2 runs as the runtime's generic decoder: its "gpt2" class expects other inputs
    assert genai["model"]["type"] == GENERIC_TYPE == "decoder"
    assert report["genai"]["transformers_model_type"] == "gpt2"
    assert genai["model"]["decoder"]["num_hidden_layers"] == 3
    assert "position_ids" in genai["model"]["decoder"]["inputs"]
    # IgLM's tokenizer is WordPiece, which og.Tokenizer cannot read (BPE / Unigram only): the report
    # says so, and the prompts go in as ids encoded by transformers
    assert (
        "og.Tokenizer reads BPE and Unigram (SentencePiece) tokenizers only"
        in report["genai"]["tokenizer_warning"]
    )
    _assert_same_tokens(
        folder, out, ["[HEAVY] [HUMAN] E V Q L V E S G G", "[LIGHT] [HUMAN] D I Q M"], runtime_tokenizer=False
    )


def test_genai_model_type_mapping():
    assert [genai_model_type(t) for t in ("llama", "qwen2", "qwen3", "mistral")] == [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
    ]
    # gpt2: the runtime's GPT-2 class; phi3: its rope rewind; unknown names: refused by the runtime
    assert [genai_model_type(t) for t in ("gpt2", "phi3", "starcoder2", None)] == ["decoder"] * 4


def test_genai_refuses_an_encoder_before_loading_anything_into_output_dir(tmp_path):
    out = tmp_path / "out"
    text = refusal(export_layout("onnx", "tiny:bert", out, layout="genai", task="feature-extraction"))
    assert "layout 'genai' serves tasks text-generation, not 'feature-extraction'" in text
    assert (
        "layouts of onnx that fit:" in text
        or "no onnx layout fits; drop --layout for the default export" in text
    )
    assert not out.exists()


def test_genai_refuses_a_model_without_a_growing_attention_cache(tmp_path):
    out = tmp_path / "out"
    text = refusal(export_layout("onnx", "tiny:mamba", out, layout="genai", task="text-generation"))
    assert "layout 'genai' runs decoder-only causal LMs with a plain attention KV cache" in text
    assert "MambaForCausalLM" in text
    assert not out.exists()


def test_genai_missing_tokenizer_says_which_files_to_add(tmp_path):
    folder = tiny_model_folder("llama", tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    out = tmp_path / "out"
    text = refusal(export_layout("onnx", folder, out, layout="genai", task="text-generation"))
    assert "layout 'genai' needs the tokenizer next to the model" in text
    assert "add tokenizer.json (and tokenizer_config.json) to the model folder" in text
    assert not out.exists()


def test_env_lists_the_genai_layout():
    result = invoke(["env", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    genai = [lay for lay in data["layouts"] if lay["name"] == "genai" and lay["format"] == "onnx"]
    assert genai == [
        {
            "format": "onnx",
            "name": "genai",
            "runtime": "onnxruntime-genai",
            "tasks": ["text-generation"],
            "needs_tokenizer": True,
            "description": genai[0]["description"],
        }
    ]
    onnx_row = next(r for r in data["backends"] if r["format"] == "onnx")
    assert "genai" in onnx_row["layouts"]
    table = invoke(["env"])
    assert table.exit_code == 0
    assert "genai" in folded(table.output) and "onnxruntime-genai" in folded(table.output)


def test_decoder_graph_refuses_encoder_decoders_and_sliding_window_caches():
    from hfexport.errors import UnsupportedModelError
    from hfexport.testing.zoo import tiny_model
    from hfexport_onnx.decoder_graph import decoder_cache_refusal, export_decoder_with_past

    gemma2, _ = tiny_model("gemma2", "text-generation")
    assert decoder_cache_refusal(gemma2) == (
        "Gemma2ForCausalLM's cache has DynamicSlidingWindowLayer layers (sliding-window, linear-attention or "
        "state-space state), not only plain growing attention layers [batch, kv_heads, past, head_dim]"
    )
    t5, inputs = tiny_model("t5")
    with pytest.raises(
        UnsupportedModelError, match=r"T5ForConditionalGeneration is an encoder-decoder model"
    ):
        export_decoder_with_past(t5, inputs, None, None)


def _graph_inputs_under(name: str, producers: dict) -> set[str]:
    """The graph inputs ``name`` is computed from (names with no producer and not initializers)."""
    seen, stack, found = set(), [name], set()
    while stack:
        current = stack.pop()
        if current in seen or not current:
            continue
        seen.add(current)
        node = producers.get(current)
        if node is None:
            found.add(current)
        else:
            stack.extend(node.input)
    return found - {i.name for i in producers["__initializers__"]}


def test_genai_fused_llama_shares_the_past_present_buffer(tmp_path):
    """``--ort-fusions cpu``: GroupQueryAttention with the rotary inside (do_rotary, cos/sin caches,
    position_ids) and its lengths from attention_mask, run by the runtime with one shared
    past/present buffer; greedy tokens still equal ``model.generate``'s."""
    import onnx

    folder = tiny_model_folder("llama", tmp_path / "model")
    out = tmp_path / "out"
    result = export_layout(
        "onnx", folder, out, layout="genai", task="text-generation", extra=["--ort-fusions", "cpu"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "export_report.json").read_text())
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is True
    assert report["genai"]["past_present_share_buffer"] is True
    validated = report["report"]["validation"]
    assert {"sample", "prefill_empty_past", "decode_step"} <= set(validated)  # parity at two shapes
    graph = onnx.load(out / "model.onnx").graph
    producers: dict = {o: n for n in graph.node for o in n.output}
    producers["__initializers__"] = list(graph.initializer)
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    config = json.loads((folder / "config.json").read_text())
    assert len(nodes) == config["num_hidden_layers"]
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0
        inputs = list(node.input) + [""] * 17
        assert inputs[7] and inputs[8] and inputs[9] == "position_ids"  # cos_cache, sin_cache, positions
        assert (
            inputs[10] == "" and inputs[16]
        )  # no attention_bias; query_seqlens (multi-token steps on a past)
        # seqlens_k = attention_mask.sum(-1) - 1 (int32)
        cast = producers[inputs[5]]
        sub = producers[cast.input[0]]
        reduce = producers[sub.input[0]]
        assert (cast.op_type, sub.op_type, reduce.op_type) == ("Cast", "Sub", "ReduceSum")
        assert reduce.input[0] == "attention_mask"
        # the cos/sin tables come from constants only (ONNX Runtime folds them once per session)
        assert not _graph_inputs_under(inputs[7], producers) and not _graph_inputs_under(inputs[8], producers)
    assert not any(n.op_type in ("Softmax", "Concat") and "present" in "".join(n.output) for n in graph.node)
    _assert_same_tokens(folder, out, ["Hello world! The quick brown fox", "Numbers 0 1 2"])
