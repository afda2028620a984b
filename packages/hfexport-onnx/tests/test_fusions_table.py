"""The ORT fusions are one table (issue 26): each row is one registry entry, in run order, and
its conditions (dtypes, the op it needs) and rewrites are applied by one function."""

from __future__ import annotations

from types import SimpleNamespace

from hfexport import registry
from hfexport_onnx import fusions

CPU_ORDER = [
    "erf_gelu",
    "rms_normalization",
    "skip_rms_normalization",
    "rotary_embedding",
    "cos_sin_cache",
    "partial_rotary_embedding",
    "sdpa",
    "cached_gqa",
    "gqa",
    "packed_qkv_for_gqa",
    "mha",
    "mha_scale",
    "mha_bias",
    "gelu",
    "bias_gelu",
    "sdpa_via_mha",
    "matmul_rules",
    "attention_cpu",
    "sibling_matmuls_cpu",
]


def _model(*ops: str) -> SimpleNamespace:
    nodes = [SimpleNamespace(op_type=op) for op in ops]
    return SimpleNamespace(graph=SimpleNamespace(all_nodes=lambda: nodes))


def test_each_row_is_one_registry_entry_in_table_and_run_order():
    for provider in fusions.PROVIDERS:
        entries = registry.entries(f"onnx.{provider}", kind=fusions.KIND)
        rows = [row for row in fusions.ORT_FUSIONS if row.provider in (None, provider)]
        assert [e.name for e in entries] == [f"hfexport_onnx.fusions.fuse_{row.name}" for row in rows]
        assert [tuple(e.targets) for e in entries] == [row.ops for row in rows]
        assert [e.issue for e in entries] == [row.issue for row in rows]
        assert all(
            e.func is getattr(fusions, f"fuse_{row.name}") for e, row in zip(entries, rows, strict=True)
        )
    # the report's names, in the order apply_ort_fusions runs them for the CPU
    cpu = registry.entries("onnx.cpu", kind=fusions.KIND)
    assert [e.name.rsplit(".", 1)[-1].removeprefix("fuse_") for e in cpu] == CPU_ORDER
    assert len(fusions.ORT_FUSIONS) == len({row.name for row in fusions.ORT_FUSIONS}) == 22


def test_a_row_skips_other_dtypes_and_graphs_without_the_op_it_rewrites():
    assert fusions.fuse_attention_cpu(_model("MultiHeadAttention"), "float16") == 0  # ORT CPU: float only
    assert fusions.fuse_attention_cpu(_model("MatMul"), "float32") == 0  # nothing to fold into Attention
    assert fusions.fuse_mha_bias(_model("Add"), "float32") == 0


def test_a_rows_rewrites_are_summed_in_order_then_its_pass_runs():
    calls: list[str] = []

    def first(model, **kwargs):
        calls.append(f"first {kwargs}")
        return 2

    def second(model, **kwargs):
        calls.append("second")
        return 3

    row = fusions.OrtFusion(
        "toy",
        ("com.microsoft.Toy",),
        "a toy row",
        (first, second),
        kwargs={"k": 1},
        dtypes=("float32",),
        requires_op="MatMul",
        then=lambda model: calls.append("then"),
    )
    fuse = fusions._entry_function(row)
    assert fuse.__name__ == "fuse_toy" and fuse.__doc__ == "a toy row"
    assert fuse(_model("MatMul"), "float32") == 5
    assert calls == ["first {'k': 1}", "second", "then"]
    calls.clear()
    assert fuse(_model("MatMul"), "bfloat16") == 0 and calls == []
