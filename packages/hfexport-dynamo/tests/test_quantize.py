"""dynamo quantization (``int8-weight``) and reduced precision, on real weights where quality matters.

IgLM-S (the real GPT-2 checkpoint of the ``iglm`` package, copied into a temporary folder by
:func:`hfexport.testing.folders.package_model_folder`) is scored by the core quality gates against
the fp32 eager model.
"""

from __future__ import annotations

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.testing import tiny_model
from hfexport.testing.folders import package_model_folder
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo.quantize import METHODS

ANTIBODIES = [
    "[HEAVY] [HUMAN] EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "[LIGHT] [HUMAN] DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
]


@pytest.fixture(scope="module")
def iglm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = package_model_folder("iglm/IgLM-S", tmp_path_factory.mktemp("iglm-s"))
    enc = AutoTokenizer.from_pretrained(folder)(ANTIBODIES, return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _logits_row(report) -> dict:
    (row,) = [r for r in report.validation["sample"] if r["name"] == "logits"]
    return row


def test_methods_and_dtypes_are_listed_on_the_exporter():
    assert dict(DynamoExporter.quantization_methods) == METHODS == {"int8-weight": METHODS["int8-weight"]}
    assert DynamoExporter.supported_dtypes == ("float32", "float16", "bfloat16")


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ("8da4w", r"'8da4w' is not one of the dynamo backend's; allowed: int8-weight"),
        (
            {"method": "int8-weight", "embedding_bits": 8},
            r"embedding_bits=8 is not supported by the dynamo backend .*allowed: embedding_bits=None, or "
            r"export_format='executorch'",
        ),
        (
            {"method": "int8-weight", "per_channel": False},
            r"^quantization\.per_channel=False is not read by the dynamo quantization method 'int8-weight' and "
            r"would be ignored; allowed with 'int8-weight': exclude \(no other dynamo method reads per_channel\)",
        ),
        (
            {"method": "int8-weight", "group_size": 32},
            r"^quantization\.group_size=32 is not read by the dynamo quantization method 'int8-weight' .*"
            r"allowed with 'int8-weight': exclude \(no other dynamo method reads group_size\)",
        ),
        (
            {"method": "int8-weight", "calibration": "prompts.txt", "num_calibration_samples": 4},
            r"^quantization\.calibration='prompts\.txt' is not read by the dynamo quantization method",
        ),
    ],
)
def test_options_the_backend_does_not_have_are_refused_before_capture(quantization, message):
    model, inputs = tiny_model("gpt2")
    exporter = DynamoExporter()
    with pytest.raises(ValueError, match=message):
        exporter.export(model, inputs, DynamoConfig(quantization=quantization))


def test_int8_weight_gpt2_real_weights_agrees_runs_under_plain_aten_and_loads_safely(iglm, tmp_path):
    """IgLM-S: 13 linears int8 (12 Conv1D rewritten), top-1 >= 0.99 vs fp32 eager (measured 0.996),
    weights 0.31x; no torchao op in the graph; the .pt2 loads with the weights-only loader."""
    model, inputs = iglm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True, quantization="int8-weight"))
    report = exporter.last_report
    summary = report.quantization
    assert (summary["linear"], summary["conv1d_as_linear"], summary["quantized_mm_nodes"]) == (13, 12, 13)
    assert summary["size_ratio"] <= 0.35, summary
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if t.startswith("torchao.")], targets
    assert sum(v.dtype == torch.int8 for v in program.state_dict.values()) >= 13
    row = _logits_row(report)
    assert row["ok"] and row["top1_agreement"] >= 0.99 and row["cosine"] >= 0.999, row
    assert report.validation["second_shape"]  # the dynamic program validated at a second shape too
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"

    path = tmp_path / "model.pt2"
    exporter.save(program, path)
    loaded = exporter.load(path)  # trust_remote_code=False: weights-only unpickling, archive checks
    with torch.no_grad():
        out = exporter.runner(loaded)(dict(inputs))["logits"]
        ref = model(**inputs).logits
    keep = inputs["attention_mask"].bool()
    agreement = (out.argmax(-1) == ref.argmax(-1))[keep].float().mean().item()
    assert agreement >= 0.99


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gpt2_real_weights(iglm, dtype):
    model, inputs = iglm
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dtype=dtype))
    assert {v.dtype for v in program.state_dict.values() if v.is_floating_point()} == {getattr(torch, dtype)}
    row = _logits_row(exporter.last_report)
    assert row["gates"] == {"cosine": 0.99, "top1_agreement": 0.98}
    assert row["ok"] and row["top1_agreement"] >= 0.99, row
    assert next(model.parameters()).dtype == torch.float32
