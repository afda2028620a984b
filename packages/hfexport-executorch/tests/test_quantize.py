"""ExecuTorch quantization (hfexport_executorch.quantize): methods, refusals, real-weight quality and size.

Quality is only meaningful on real weights: the GPT-2 checkpoint IgLM-S (``pkg:iglm/IgLM-S``,
antibody sequences) and the ALBERT masked LM of rxnmapper (``pkg:rxnmapper``, reaction SMILES),
copied into a temporary folder by :func:`hfexport.testing.folders.package_model_folder` (never
into the repository). Validation runs the core quality gates against the fp32 eager model.
"""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch

from hfexport.config import ExecutorchConfig, QuantizationConfig
from hfexport.testing import tiny_model
from hfexport.testing.folders import package_model_folder
from hfexport_executorch import ExecutorchExporter
from hfexport_executorch.quantize import METHODS, quantize_copy

# Public antibody sequences (trastuzumab heavy and light chains) in IgLM's prompt format.
ANTIBODIES = [
    "[HEAVY] [HUMAN] EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "[LIGHT] [HUMAN] DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
]
REACTIONS = [
    "CC(C)S.CN(C)C=O.Fc1cccnc1F.O=C([O-])[O-].[K+].[K+]>>CC(C)Sc1ncccc1F",
    "CCOC(=O)c1ccc(N)cc1.O=C(Cl)c1ccccc1>>CCOC(=O)c1ccc(NC(=O)c2ccccc2)cc1",
]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_intact(model: torch.nn.Module, before: dict[str, torch.Tensor], kinds: dict[str, str]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert {n: type(m).__name__ for n, m in model.named_modules()} == kinds


@pytest.fixture(scope="module")
def iglm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = package_model_folder("iglm/IgLM-S", tmp_path_factory.mktemp("iglm-s"))
    enc = AutoTokenizer.from_pretrained(folder)(ANTIBODIES, return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # logits only: the KV cache a use_cache forward also returns is an intermediate, and 4-bit weights
    # move the deepest layer's values further (cosine 0.95 on IgLM-S) than its logits
    return model, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "use_cache": False}


@pytest.fixture(scope="module")
def albert(tmp_path_factory):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    folder = package_model_folder("rxnmapper", tmp_path_factory.mktemp("rxnmapper"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(REACTIONS, return_tensors="pt", padding=True)
    ids = enc["input_ids"].clone()
    ids[:, 5::7] = tokenizer.mask_token_id  # a masked LM's job: fill the masked positions
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    return model, {"input_ids": ids, "attention_mask": enc["attention_mask"]}


def _logits_row(report) -> dict:
    (row,) = [r for r in report.validation["sample"] if r["name"] == "logits"]
    return row


# -- refusals before capture --------------------------------------------------------------------------
def test_methods_are_listed_on_the_exporter():
    assert dict(ExecutorchExporter.quantization_methods) == METHODS
    assert list(METHODS) == ["8da4w", "int8-dynamic", "4w", "8w"]
    assert ExecutorchExporter.supported_dtypes == ("float32", "float16", "bfloat16")


def test_unknown_method_is_refused_before_capture_listing_the_allowed_ones():
    model, inputs = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"'int4-weight'.*allowed: 8da4w, int8-dynamic, 4w, 8w$") as info:
        ExecutorchExporter().export(model, inputs, ExecutorchConfig(quantization="int4-weight"))
    assert "executorch" in str(info.value)


@pytest.mark.parametrize("method", ["4w", "8w"])
def test_weight_only_methods_refuse_bfloat16_naming_the_kernel_dtypes(method):
    model, inputs = tiny_model("gpt2")
    config = ExecutorchConfig(quantization=method, dtype="bfloat16")
    with pytest.raises(
        ValueError, match=r"mixed_linear, which has float32 and float16 kernels only; allowed: "
    ):
        ExecutorchExporter().export(model, inputs, config)


@pytest.mark.parametrize(("bits", "group_size", "tolerance"), [(8, None, 0.02), (4, 16, 0.3)])
def test_weight_only_linear_matches_the_dequantized_reference_in_the_runtime(bits, group_size, tolerance):
    """``WeightOnlyLinear`` captured, lowered with the XNNPACK partitioner (which claims nothing of it)
    and run by the ExecuTorch runtime on ``quantized_decomposed::mixed_linear``: equal to the eager
    module (fp32 rounding), close to the float linear (rounding of the weights), weights int8 in the
    program, at two shapes of one program with dynamic batch and sequence axes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.runtime import load_method, load_program
    from hfexport_executorch.weight_only import WeightOnlyLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    module = torch.nn.Sequential(WeightOnlyLinear(linear, bits, group_size)).eval()
    assert module[0].weight.dtype == torch.int8 and int(module[0].weight.abs().max()) == (
        7 if bits == 4 else 127
    )
    assert tuple(module[0].scales.shape) == ((96, 4) if bits == 4 else (96,))
    x = torch.randn(2, 5, 64)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=16)
    exported = torch.export.export(module, (x,), dynamic_shapes=({0: batch, 1: seq},))
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    (plan,) = program.executorch_program.execution_plan
    assert "quantized_decomposed::mixed_linear" in {o.name for o in plan.operators}
    assert len(program.buffer) < 64 * 96 * 4 * 0.5  # int8 weights, not float
    method = load_method(load_program(program.buffer))
    for shape in ((2, 5, 64), (3, 7, 64)):
        x = torch.randn(shape)
        (got,) = method.execute([x])
        with torch.no_grad():
            expected, float_out = module(x), linear(x)
        assert got.shape == (*shape[:-1], 96)
        assert (got - expected).abs().max().item() < 1e-4
        assert (got - float_out).abs().max().item() < tolerance


@pytest.mark.parametrize("method", ["8w", "4w"])
def test_upstream_canary_xnnpack_weight_only_linear_drops_the_weight_scales(method):
    """Why ``4w`` / ``8w`` do not use torchao's weight-only form (executorch 1.4.1): a torchao
    weight-only linear lowered to XNNPACK computes ``x @ qdata.T + bias`` with the raw integer weights.
    When this starts failing, upstream changed: re-measure IgLM-S and consider the delegated form."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    from hfexport_executorch.runtime import load_method, load_program

    torch.manual_seed(0)
    quantized = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    config = (
        IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
        if method == "4w"
        else IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    )
    quantize_(quantized, config)
    x = torch.randn(2, 5, 64)
    program = to_edge_transform_and_lower(
        torch.export.export(quantized, (x,)), partitioner=[XnnpackPartitioner()]
    ).to_executorch()
    (got,) = load_method(load_program(program.buffer)).execute([x])
    weight = quantized[0].weight
    with torch.no_grad():
        expected = quantized(x)
    raw = x @ weight.qdata.float().T + quantized[0].bias
    assert (got - raw).abs().max().item() < 1e-3
    assert (got - expected).abs().max().item() > 10
    assert len(program.buffer) > 64 * 32 * 4  # the integer weights stored as fp32


def test_quantization_on_the_cuda_backend_is_refused_before_capture():
    model, inputs = tiny_model("gpt2")
    config = ExecutorchConfig(backend="cuda", quantization="8da4w")
    with pytest.raises(
        ValueError, match=r"backend='cuda' has none here; allowed: ExecutorchConfig\(backend='xnnpack'\)"
    ):
        ExecutorchExporter().export(model, inputs, config)


_RUNNER_IN_A_FRESH_PROCESS = """
import sys, torch
from executorch.extension.pybindings import _portable_lib
from hfexport_executorch.runtime import ExecutorchRunner, program_operators
path = sys.argv[1]
before = "executorch.kernels.quantized" in sys.modules
spec = torch.load(sys.argv[2], weights_only=False)
out = ExecutorchRunner(path, spec["in"], spec["out"])({"input_ids": spec["ids"]})
print(sorted(program_operators(path)), before, "executorch.kernels.quantized" in sys.modules, tuple(out["logits"].shape))
"""


def test_a_saved_program_with_quantized_embeddings_loads_in_a_fresh_process(tmp_path):
    """The runner registers the quantized kernels (``executorch.kernels.quantized``) before loading a
    program that calls ``quantized_decomposed::embedding_byte``; without that the runtime refuses the
    program ("Missing operator: quantized_decomposed::embedding_byte.out")."""
    import subprocess
    import sys

    model, inputs = tiny_model("gpt2")
    ids = inputs["input_ids"]
    config = ExecutorchConfig(quantization={"method": "8da4w", "embedding_bits": 8}, validate=False)
    program = ExecutorchExporter().export(model, {"input_ids": ids}, config)
    path = tmp_path / "model.pte"
    program.save(path)
    call = program.exported_program().call_spec
    torch.save({"in": call.in_spec, "out": call.out_spec, "ids": ids}, tmp_path / "spec.pt")
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER_IN_A_FRESH_PROCESS, str(path), str(tmp_path / "spec.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    vocab = model.config.vocab_size
    assert done.stdout.strip().splitlines()[-1] == (
        f"['quantized_decomposed::embedding_byte'] False True ({ids.shape[0]}, {ids.shape[1]}, {vocab})"
    )


def _kernel_calls(program, name: str) -> int:
    """How many instructions of the emitted ``forward`` call the operator ``name``."""
    (plan,) = program.executorch_program.execution_plan
    ops = [o.name for o in plan.operators]
    return sum(
        1
        for chain in plan.chains
        for instruction in chain.instructions
        if hasattr(instruction.instr_args, "op_index") and ops[instruction.instr_args.op_index] == name
    )


@pytest.mark.parametrize(
    ("bits", "kernel"),
    [(4, "embedding_4bit"), pytest.param(8, "embedding_byte", marks=pytest.mark.extended)],  # ~20 s each
)
def test_embedding_bits_on_llama_whose_embedding_has_a_padding_idx_runs_in_the_runtime(bits, kernel):
    """Llama's ``embed_tokens`` (like BERT's ``word_embeddings``, unlike GPT-2's ``wte``) has a
    ``padding_idx``: without the node fix ``quantized_embedding_without_padding_idx`` quant fusion left
    its ``torchao::dequantize_affine`` in the program and ``to_executorch`` failed ("Missing out
    variants"). The lookup must be one call of ``quantized_decomposed::{kernel}`` in the ``.pte``,
    computing in the runtime what the eager quantized copy computes. Linears stay float (excluded) so
    only the embedding is under test and the lowering stays fast."""
    model, inputs = tiny_model("llama")
    assert model.model.embed_tokens.padding_idx is not None
    quantization = {"method": "8da4w", "embedding_bits": bits, "exclude": ["model.layers.*", "lm_head"]}
    exporter = ExecutorchExporter()
    # static shapes: faster to lower, and the fix does not depend on them
    config = ExecutorchConfig(dynamic=False, quantization=quantization, validate=False)
    program = exporter.export(model, inputs, config)
    report = exporter.last_report
    fix = "hfexport_executorch.workarounds.fx_fixes.quantized_embedding_without_padding_idx"
    assert fix in report.applied["fx_node_fixes"]
    summary = report.quantization
    assert (summary["embedding"], summary["linear"], summary["ops"]["quantized_embedding"]) == (1, 0, 1)
    (plan,) = program.executorch_program.execution_plan
    assert not [o.name for o in plan.operators if o.name.startswith("torchao::")]
    assert _kernel_calls(program, f"quantized_decomposed::{kernel}") == 1
    assert _kernel_calls(program, "aten::embedding") == 0
    quantized, _ = quantize_copy(model, QuantizationConfig.from_value(quantization))
    with torch.no_grad():
        expected, reference = quantized(**inputs).logits, model(**inputs).logits
    got = exporter.runner(program)(inputs)["logits"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the quantized table is close to the fp32 one: 8-bit rows nearly exact, 4-bit groups of 32 less so
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), reference.flatten(), 0).item()
    assert cosine >= (0.9999 if bits == 8 else 0.99), cosine


def test_upstream_canary_quant_fusion_leaves_a_padded_torchao_embedding_unfused():
    """Why ``quantized_embedding_without_padding_idx`` exists (executorch 1.4.1): ExecuTorch's quant
    fusion fuses a torchao-quantized ``nn.Embedding`` into ``embedding_byte`` only without a
    ``padding_idx``. When this starts failing, upstream matches the padded form: retire the fix."""
    from executorch.exir import ExecutorchBackendConfig, to_edge

    torch.manual_seed(0)
    ids = torch.tensor([[0, 3, 5]])
    for padding_idx, fused in ((None, True), (0, False)):
        table = torch.nn.Sequential(torch.nn.Embedding(16, 32, padding_idx=padding_idx)).eval()
        quantized, summary = quantize_copy(table, QuantizationConfig(method="int8-dynamic", embedding_bits=8))
        assert summary["embedding"] == 1
        edge = to_edge(torch.export.export(quantized, (ids,)))
        config = ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True)
        if fused:
            (plan,) = edge.to_executorch(config).executorch_program.execution_plan
            assert [o.name for o in plan.operators] == ["quantized_decomposed::embedding_byte"]
        else:
            with pytest.raises(
                RuntimeError, match=re.escape("Missing out variants: {'torchao::dequantize_affine'}")
            ):
                edge.to_executorch(config)


# -- the source transform on a copy -------------------------------------------------------------------
def test_quantize_copy_converts_conv1d_counts_modules_and_leaves_the_model_alone():
    model, inputs = tiny_model("gpt2")  # GPT-2 projections are transformers Conv1D
    before, kinds = _state(model), {n: type(m).__name__ for n, m in model.named_modules()}
    config = QuantizationConfig(method="8da4w", embedding_bits=8, exclude=("lm_head",))
    quantized, summary = quantize_copy(model, config)
    n_layers = model.config.n_layer
    assert summary["conv1d_as_linear"] == 4 * n_layers
    assert summary["linear"] == 4 * n_layers - len(summary["skipped"])
    assert summary["excluded"] == ["lm_head"]
    assert summary["embedding"] == 2  # wte and wpe
    assert summary["group_size"] == 32
    assert type(quantized.lm_head.weight) is torch.nn.Parameter  # excluded: still float
    assert type(quantized.transformer.wte.weight).__name__ == "IntxUnpackedToInt8Tensor"
    _assert_intact(model, before, kinds)
    with torch.no_grad():
        ref, out = model(**inputs).logits, quantized(**inputs).logits
    assert torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), 0) > 0.9


def test_layers_whose_width_is_not_a_multiple_of_the_group_are_skipped_and_listed():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 16)
            self.b = torch.nn.Linear(16, 8)

    quantized, summary = quantize_copy(Net(), QuantizationConfig(method="4w", group_size=32))
    assert summary["linear"] == 1
    assert summary["skipped"] == {"b": "input width 16 is not a multiple of group_size 32"}
    assert type(quantized.b.weight) is torch.nn.Parameter


# -- real weights ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "kernel"), [(8, "embedding_byte"), (4, "embedding_4bit")])
def test_embedding_bits_gpt2_real_weights_gates_op_counts_and_size(iglm, bits, kernel):
    """IgLM-S with ``8da4w`` + ``embedding_bits``: both embeddings quantized, the token embedding runs
    on the quantized kernel ``quantized_decomposed::{kernel}`` (the static position lookup is folded
    to a constant), logits pass the 4-bit gates in the ExecuTorch runtime, and the ``.pte`` is smaller
    than ``8da4w`` alone (measured 0.166x the fp32 weights vs 0.217x)."""
    model, inputs = iglm
    before, kinds = _state(model), {n: type(m).__name__ for n, m in model.named_modules()}
    exporter = ExecutorchExporter()
    config = ExecutorchConfig(quantization={"method": "8da4w", "embedding_bits": bits})
    program = exporter.export(model, inputs, config)
    summary = exporter.last_report.quantization
    assert (summary["embedding"], summary["embedding_bits"], summary["linear"]) == (2, bits, 13)
    assert summary["ops"]["quantized_embedding"] == 2
    assert summary["ops"]["delegated_quantized_linear"] == 13
    (plan,) = program.executorch_program.execution_plan
    quantized_ops = sorted(o.name for o in plan.operators if o.name.startswith("quantized_decomposed::"))
    assert quantized_ops == [f"quantized_decomposed::{kernel}"]
    assert summary["size_ratio"] <= 0.19, summary
    row = _logits_row(exporter.last_report)
    assert row["ok"] and row["gates"] == {"cosine": 0.98, "top1_agreement": 0.9}
    assert row["top1_agreement"] >= 0.93 and row["cosine"] >= 0.99, row
    _assert_intact(model, before, kinds)


@pytest.mark.extended
def test_8da4w_gpt2_real_weights_quarter_size_top1_and_delegated_quantized_linears(iglm):
    """IgLM-S (GPT-2, 1.4M params): 8da4w .pte <= 0.3x the fp32 weights (measured 0.22x), top-1
    agreement of the logits with fp32 eager >= 0.9 (measured 0.94), all 13 linears delegated."""
    model, inputs = iglm
    before, kinds = _state(model), {n: type(m).__name__ for n, m in model.named_modules()}
    exporter = ExecutorchExporter()
    started = time.perf_counter()
    program = exporter.export(model, inputs, ExecutorchConfig(quantization="8da4w"))
    seconds = time.perf_counter() - started
    report = exporter.last_report
    summary = report.quantization
    assert summary["linear"] == 13 and summary["conv1d_as_linear"] == 12
    assert summary["ops"]["delegated_quantized_linear"] == 13
    assert summary["ops"]["portable_quantized_linear"] == 0
    assert summary["artifact_bytes"] == len(program.buffer)
    assert summary["size_ratio"] <= 0.3, summary
    row = _logits_row(report)
    assert row["ok"] and row["gates"] == {"cosine": 0.98, "top1_agreement": 0.9}
    assert row["top1_agreement"] >= 0.9 and row["cosine"] >= 0.99, row
    _assert_intact(model, before, kinds)
    print(f"8da4w IgLM-S: ratio {summary['size_ratio']}, top-1 {row['top1_agreement']:.4f}, {seconds:.0f} s")


@pytest.mark.parametrize(("method", "min_top1"), [("8w", 0.98), ("4w", 0.9)])
def test_weight_only_gpt2_real_weights_gates_size_and_kernel(iglm, method, min_top1):
    """IgLM-S with ``8w`` / ``4w``: all 13 linears run on ``quantized_decomposed::mixed_linear`` (none
    delegated: XNNPACK has no weight-only GEMM), int8 weights put the ``.pte`` at about a third of
    the fp32 weights (embeddings stay float, 4-bit values are stored one per byte; measured 8w 0.327x,
    4w 0.350x with its 8-bit head), and the logits pass the method's gates in the ExecuTorch runtime
    (measured top-1 / cosine 8w 0.996 / 0.99998, 4w 0.957 / 0.9983; 4w with ``amax / 7`` scales and a
    4-bit head, before: 0.961 / 0.9963)."""
    model, inputs = iglm
    before, kinds = _state(model), {n: type(m).__name__ for n, m in model.named_modules()}
    exporter = ExecutorchExporter()
    program = exporter.export(model, inputs, ExecutorchConfig(quantization=method))
    summary = exporter.last_report.quantization
    assert summary["linear"] == 13 and summary["conv1d_as_linear"] == 12
    assert summary["ops"]["portable_quantized_linear"] == 13
    assert summary["ops"]["delegated_quantized_linear"] == 0
    (plan,) = program.executorch_program.execution_plan
    assert "quantized_decomposed::mixed_linear" in {o.name for o in plan.operators}
    assert summary["size_ratio"] <= 0.4, summary
    row = _logits_row(exporter.last_report)
    expected_gates = (
        {"cosine": 0.98, "top1_agreement": 0.9} if method == "4w" else {"cosine": 0.99, "top1_agreement": 0.9}
    )
    assert row["ok"] and row["gates"] == expected_gates
    assert row["top1_agreement"] >= min_top1, row
    # IgLM's amino-acid tokenizer maps English prose to <unk>: no text gates, top-1 stays gated on the sample
    assert "unknown token" in exporter.last_report.extra["text_quality"]["skipped"]
    assert "text" not in exporter.last_report.validation
    _assert_intact(model, before, kinds)
    print(
        f"{method} IgLM-S: ratio {summary['size_ratio']}, top-1 {row['top1_agreement']:.4f}, {row['cosine']:.5f}"
    )


@pytest.mark.extended
def test_8da4w_gpt2_real_weights_dynamic_passes_its_gates_at_both_shapes(iglm):
    """issue 12: a dynamic 8da4w export of IgLM-S validates its second shape on the sample's own
    tokens (batch + 1, a quarter shorter) and passes the default 4-bit gates there too. On 3 x 244
    random ids it missed (cosine 0.976, top-1 0.83); measured now 3 x 92: 0.9974 / 0.953."""
    from hfexport.validation import derive_second_inputs

    model, inputs = iglm
    config = ExecutorchConfig(quantization="8da4w", dynamic=True)
    second, _ = derive_second_inputs(model, inputs, config=config)
    real = {int(t) for t in inputs["input_ids"][inputs["attention_mask"].bool()]}
    assert tuple(second["input_ids"].shape) == (3, 92) and bool((second["attention_mask"] == 1).all())
    assert set(second["input_ids"].unique().tolist()) <= real
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, config)
    report = exporter.last_report
    sample = _logits_row(report)
    (row,) = [r for r in report.validation["second_shape"] if r["name"] == "logits"]
    assert tuple(row["shape"]) == (3, 92, 33)
    for found in (sample, row):
        assert found["ok"] and found["gates"] == {"cosine": 0.98, "top1_agreement": 0.9}
        assert found["top1_agreement"] >= 0.93 and found["cosine"] >= 0.99, found


@pytest.mark.extended
def test_int8_dynamic_albert_real_weights_cosine_and_delegation(albert):
    """rxnmapper's ALBERT (12 shared layers): PT2E int8-dynamic, cosine per token >= 0.99."""
    model, inputs = albert
    before, kinds = _state(model), {n: type(m).__name__ for n, m in model.named_modules()}
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(quantization="int8-dynamic"))
    summary = exporter.last_report.quantization
    assert summary["ops"]["delegated_quantized_linear"] >= 6 * 12
    row = _logits_row(exporter.last_report)
    assert row["cosine"] >= 0.99 and row["top1_agreement"] >= 0.9, row
    _assert_intact(model, before, kinds)


@pytest.mark.extended
def test_8da4w_albert_real_weights(albert):
    model, inputs = albert
    exporter = ExecutorchExporter()
    exporter.export(model, copy.deepcopy(inputs), ExecutorchConfig(quantization="8da4w"))
    row = _logits_row(exporter.last_report)
    assert row["top1_agreement"] >= 0.9, row


@pytest.mark.extended
def test_fp16_gpt2_real_weights_delegates_to_xnnpack(iglm):
    model, inputs = iglm
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dtype="float16"))
    report = exporter.last_report
    assert report.extra["delegation"]["delegated_share"] > 0.5
    row = _logits_row(report)
    assert row["top1_agreement"] >= 0.98 and row["cosine"] >= 0.99, row


# -- 8da4w scales: least squared error per group (issue 27) ----------------------------------------------
def _heavy_tailed_weight(out_features: int, in_features: int) -> torch.Tensor:
    """Trained-LM-like weights: Student-t (3 degrees of freedom) values, a few input channels ~8x
    larger (the outlier columns of real projections), so a group's max sits far above its bulk."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    weight = torch.distributions.StudentT(torch.tensor(3.0)).sample((out_features, in_features)) * 0.02
    columns = torch.randperm(in_features, generator=generator)[: in_features // 32]
    weight[:, columns] *= 8
    return weight


def test_8da4w_mse_scales_are_positive_beat_hqq_and_amax_and_lower_to_xnnpack():
    """``8da4w``'s default body scales (``mse_group_scales``): every scale positive (XNNPACK refuses
    negative block scales), the weight reconstructed with less squared error than torchao's
    ``hqq_scale_only`` and than plain ``amax / 7`` rounding; a two-linear model quantized by
    ``quantize_copy`` and lowered to XNNPACK (``dequantize_affine`` consumed by the delegate) runs in
    the ExecuTorch runtime equal to the eager quantized copy (cosine >= 0.999)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport_executorch.quantize import mse_group_scales
    from hfexport_executorch.runtime import load_method, load_program

    torch.manual_seed(0)
    weight = _heavy_tailed_weight(256, 128)
    scales = mse_group_scales(weight, 32)
    assert scales.shape == (256, 4) and bool((scales > 0).all())

    def error(scale: torch.Tensor) -> float:
        per_element = scale.repeat_interleave(32, dim=1)
        return float(
            ((torch.clamp(torch.round(weight / per_element), -8, 7) * per_element - weight) ** 2).sum()
        )

    amax = weight.reshape(256, 4, 32).abs().amax(-1) / 7
    mse = error(scales)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64)).eval()
    with torch.no_grad():
        model[0].weight.copy_(weight)
    hqq_copy, _ = quantize_copy(
        model, QuantizationConfig(method="8da4w", group_size=32), scales="hqq_scale_only"
    )
    hqq = float(((hqq_copy[0].weight.dequantize() - weight) ** 2).sum())
    assert mse < 0.9 * error(amax), (mse, error(amax))
    assert mse < hqq, (mse, hqq)  # measured 2.457 vs hqq 2.475 vs amax / 7 2.807

    quantized, summary = quantize_copy(model, QuantizationConfig(method="8da4w", group_size=32))
    assert summary["scales"] == "mse" and summary["linear"] == 2
    first = quantized[0].weight
    assert first.target_dtype == torch.int4 and bool((first.zero_point == 0).all())
    assert torch.equal(first.scale, scales)
    x = torch.randn(2, 7, 128)
    program = to_edge_transform_and_lower(
        torch.export.export(quantized, (x,)), partitioner=[XnnpackPartitioner()]
    ).to_executorch()
    (plan,) = program.executorch_program.execution_plan
    assert not [o.name for o in plan.operators if "quantize" in o.name]  # all inside the delegate
    (got,) = load_method(load_program(program.buffer)).execute([x])
    with torch.no_grad():
        expected = quantized(x)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(0, 1), expected.flatten(0, 1), dim=-1)
    assert cosine.min().item() >= 0.999, cosine.min().item()


def test_8da4w_scale_choice_and_group_checks_refuse_bad_input():
    from hfexport_executorch.quantize import mse_group_scales

    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    with pytest.raises(ValueError, match=r"scales='rtn'.*allowed: \('mse', 'hqq_scale_only'\)"):
        quantize_copy(model, QuantizationConfig(method="8da4w"), scales="rtn")
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of group_size 32"):
        mse_group_scales(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="2-D float weight"):
        mse_group_scales(torch.ones(4, 32, dtype=torch.int8), 32)
    # an all-zero group quantizes to zero with a positive scale
    assert bool((mse_group_scales(torch.zeros(2, 32), 32) > 0).all())


@pytest.mark.parametrize("method", ["8da4w", "4w"])
def test_a_group_size_that_divides_no_linear_is_refused_naming_the_sizes_that_fit(method):
    # widths 576 and 1536 (SmolLM2's): 5 divides neither, so every linear would stay float
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576))
    with pytest.raises(
        ValueError,
        match=r"group_size=5 divides none of the model's linear input widths \(576, 1536\).*allowed here: 16, 32, 64",
    ):
        quantize_copy(model, QuantizationConfig(method=method, group_size=5))
    # one linear that takes the groups is enough: the other is recorded as skipped, not refused
    mixed = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    _, summary = quantize_copy(mixed, QuantizationConfig(method=method, group_size=32))
    assert list(summary["skipped"]) == ["1"]
    assert "input width 48 is not a multiple of group_size 32" in summary["skipped"]["1"]


# -- 4w: searched scales and an 8-bit head (issue 27) ---------------------------------------------------
def test_4w_searches_its_scales_and_keeps_the_lm_head_at_8_bits():
    """``4w`` on a causal LM: the head (``get_output_embeddings()``) becomes an 8-bit per-row
    ``WeightOnlyLinear``, every other linear 4-bit groups whose scales are ``mse_group_scales`` (in the
    linear's dtype, fp32 here), reconstructing the weight with less squared error than ``amax / 7``.
    Before, every linear took ``amax / 7`` 4-bit groups and SmolLM2-135M missed the 4-bit text gates
    (eager copy perplexity ratio 1.404, KL 0.441, top-1 0.585 vs gates 1.25 / 0.35 / 0.65)."""
    from hfexport_executorch.quantize import mse_group_scales
    from hfexport_executorch.weight_only import WeightOnlyLinear

    model, _ = tiny_model("llama")
    model.eval()
    quantized, summary = quantize_copy(model, QuantizationConfig(method="4w", group_size=32))
    assert summary["head"] == ["lm_head"] and summary["head_bits"] == 8 and summary["scales"] == "mse"
    head = quantized.lm_head
    assert (
        isinstance(head, WeightOnlyLinear)
        and head.bits == 8
        and tuple(head.scales.shape) == (head.out_features,)
    )
    body_float = model.model.layers[0].mlp.down_proj.weight.detach()
    body = quantized.model.layers[0].mlp.down_proj
    assert isinstance(body, WeightOnlyLinear) and body.bits == 4 and body.group_size == 32
    expected = mse_group_scales(body_float, 32, scale_dtype=torch.float32)
    assert torch.equal(body.scales, expected)
    per_element = body.scales.repeat_interleave(32, dim=1)
    mse_error = float(((body.weight.float() * per_element - body_float) ** 2).sum())
    amax = WeightOnlyLinear(model.model.layers[0].mlp.down_proj, 4, 32)
    amax_error = float(((amax.weight.float() * amax.scales.repeat_interleave(32, 1) - body_float) ** 2).sum())
    assert mse_error < amax_error, (mse_error, amax_error)
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(model.lm_head(x), head(x), dim=-1).min().item()
    assert cosine > 0.9999, cosine  # 8-bit rows (a 4-bit head: ~0.99)
    # an exclude still keeps the head float; 8w has no head rule (every linear is 8-bit already)
    _, summary = quantize_copy(model, QuantizationConfig(method="4w", group_size=32, exclude=("lm_head",)))
    assert summary["head"] == [] and summary["head_bits"] is None and summary["excluded"] == ["lm_head"]
    assert "head" not in quantize_copy(model, QuantizationConfig(method="8w"))[1]


def test_weight_only_linear_refuses_scales_of_the_wrong_shape_or_sign():
    from hfexport_executorch.weight_only import WeightOnlyLinear

    linear = torch.nn.Linear(64, 8)
    with pytest.raises(ValueError, match=r"scales must be positive with shape \(8, 2\) for 4-bit"):
        WeightOnlyLinear(linear, 4, 32, scales=torch.ones(8, 4))
    with pytest.raises(ValueError, match=r"scales must be positive with shape \(8,\) for 8-bit"):
        WeightOnlyLinear(linear, 8, scales=-torch.ones(8))
    given = torch.full((8, 2), 0.01)
    module = WeightOnlyLinear(linear, 4, 32, scales=given)
    assert torch.equal(module.scales, given)
    expected = torch.clamp(torch.round(linear.weight.detach() / 0.01), -8, 7).to(torch.int8)
    assert torch.equal(module.weight, expected)  # values beyond the levels are clipped
