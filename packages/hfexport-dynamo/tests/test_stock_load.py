"""Every ``.pt2`` hfexport writes runs with stock ``torch.export.load`` in a process importing only torch.

A plain export of a tiny llama (outputs ``CausalLMOutputWithPast`` with a ``DynamicCache``) and its
generation components (``prefill`` returns a cache, ``decode`` takes and returns one) are loaded
in a subprocess that imports torch alone and run as ``torch.export.load(path).module()(**leaves)``
with the flat leaf names (:mod:`hfexport_dynamo.flat_io`), the components also with the output
flags they were exported with (``use_cache``, ``return_dict``: constant inputs, issue 26); outputs
must equal eager PyTorch's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hfexport.config import DynamoConfig
from hfexport.generation import save_components
from hfexport.tensors import duplicate_leaf_tensors, get_leaf_tensors
from hfexport.testing.zoo import tiny_model
from hfexport_dynamo import DynamoExporter
from hfexport_dynamo.flat_io import flat_inputs, flat_name

_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    cases = torch.load(sys.argv[1], weights_only=True)
    for file, case in cases.items():
        out = torch.export.load(file).module()(**case["inputs"])
        assert sorted(out) == sorted(case["expected"]), (file, sorted(out))
        diff = max((out[k] - v).abs().max().item() for k, v in case["expected"].items())
        print(f"{file.rsplit('/', 1)[-1]} max_abs_diff={diff:.3g}")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "hfexport", "hfexport_dynamo"))
    print("imported:", loaded)
    """
)


def _run_torch_only(cases: dict, tmp_path) -> dict[str, float]:
    torch.save(cases, tmp_path / "cases.pt")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "imported: []" in done.stdout, done.stdout  # neither transformers nor hfexport was imported
    diffs = {}
    for line in done.stdout.splitlines():
        if "max_abs_diff=" in line:
            name, value = line.split(" max_abs_diff=")
            diffs[name] = float(value)
    return diffs


def _expected(outputs) -> dict[str, torch.Tensor]:
    return {flat_name(k): v for k, v in get_leaf_tensors(outputs).items()}


@pytest.mark.slow
def test_plain_and_generation_pt2_run_with_stock_torch_export_load(tmp_path):
    model, inputs = tiny_model("llama", "text-generation")
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    exporter.save(program, tmp_path / "model.pt2")
    with torch.no_grad():
        plain = _expected(model(**inputs))
    assert "cache__layers__1__values" in plain

    artifacts = exporter.export_for_generation(model, inputs, DynamoConfig(dynamic=True))
    folder = tmp_path / "gen"
    save_components(exporter, artifacts, folder, model=model)
    manifest = json.loads((folder / "generation_manifest.json").read_text())
    names = manifest["components"]["decode"]["metadata"]["flat_io"]
    assert names["inputs"]["cache__layers__0__keys"] == "cache.layers.0.keys"
    assert names["inputs"]["use_cache"] == "use_cache" and names["inputs"]["return_dict"] == "return_dict"
    flags = {"use_cache": True, "return_dict": True}  # as the components were exported
    assert names["outputs"]["logits"] == "logits"

    # eager prefill, then one eager decode step on a copy of the prefill's cache
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill_in = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    with torch.no_grad():
        prefilled = model(**prefill_in, use_cache=True)
        cache = duplicate_leaf_tensors(prefilled.cache)
        token = prefilled.logits[:, -1:].argmax(-1)
        decode_in = {
            "input_ids": token,
            "attention_mask": torch.cat([mask, torch.ones_like(token)], dim=1),
            "position_ids": positions[:, -1:] + 1,
            "cache": cache,
        }
        flat_decode_in = {k: v.clone() for k, v in flat_inputs(decode_in).items()} | flags
        decoded = model(
            input_ids=token,
            attention_mask=decode_in["attention_mask"],
            position_ids=decode_in["position_ids"],
            past_key_values=cache,
        )
    assert set(flat_decode_in) == set(names["inputs"])
    cases = {
        str(tmp_path / "model.pt2"): {"inputs": dict(inputs), "expected": plain},
        str(folder / "prefill.pt2"): {"inputs": prefill_in | flags, "expected": _expected(prefilled)},
        str(folder / "decode.pt2"): {"inputs": flat_decode_in, "expected": _expected(decoded)},
    }
    diffs = _run_torch_only(cases, tmp_path)
    assert set(diffs) == {"model.pt2", "prefill.pt2", "decode.pt2"}
    print("max abs diff vs eager:", diffs)
    assert all(diff <= 1e-5 for diff in diffs.values()), diffs
