"""Program and node fixes: unbounded ranges get bounds; SDPA outputs stay viewable after to_edge."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from transformers import PretrainedConfig

from hfexport.capture import capture
from hfexport.config import ExecutorchConfig
from hfexport.registry import apply_fx_node_fixes, apply_patches, entries
from hfexport.testing.programs import PlaceholderCheck
from hfexport.testing.programs import placeholder_check_program as _placeholder_program
from hfexport_executorch import bounds
from hfexport_executorch.workarounds import fx_fixes as fixes


def _input_sizes(program):
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    return node.meta["val"].shape


def test_unbounded_named_dim_gets_role_bound_in_constraints_and_shape_env(toy_double, toy_inputs):
    from executorch.exir.sym_util import eval_upper_bound

    dims = {"input_ids": {0: Dim("b", min=1, max=8), 1: Dim("s", min=1)}}
    program = capture(toy_double, toy_inputs(), ExecutorchConfig(dynamic_shapes=dims))
    seq = _input_sizes(program)[1]
    symbol = seq.node.expr
    assert bounds.is_unbounded(program.range_constraints[symbol].upper)
    fixes.bound_unbounded_dynamic_ranges(program)
    # no exporter hint: the sequence role bound of a model without config
    assert int(program.range_constraints[symbol].upper) == bounds.DEFAULT_MAX_SEQUENCE
    assert eval_upper_bound(seq) == bounds.DEFAULT_MAX_SEQUENCE  # what memory planning will see
    assert eval_upper_bound(_input_sizes(program)[0]) == 8  # bounded dims are left alone
    assert program.graph_module.meta[fixes.BOUNDED_META_KEY] == {str(symbol): bounds.DEFAULT_MAX_SEQUENCE}


def test_unbounded_dim_takes_the_exporter_bound_when_given(toy_double, toy_inputs):
    dims = {"input_ids": {1: Dim("s", min=1)}}
    program = capture(toy_double, toy_inputs(), ExecutorchConfig(dynamic_shapes=dims))
    symbol = _input_sizes(program)[1].node.expr
    program.graph_module.meta[fixes.BOUNDS_META_KEY] = {str(symbol): 300}
    fixes.bound_unbounded_dynamic_ranges(program)
    assert int(program.range_constraints[symbol].upper) == 300


class ToyAttention(torch.nn.Module):
    """GPT-2 shaped attention: fused qkv, SDPA, transpose + contiguous, ``view(-1, C)`` + addmm."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.weight = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(16))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = input_ids.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(input_ids).split(16, dim=2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).contiguous().reshape(b, s, 16)
        return torch.addmm(self.bias, out.view(-1, 16), self.weight).view(b, s, 16)


def _attention_program(toy_inputs):
    torch.manual_seed(0)
    model = ToyAttention().eval()
    dims = {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)}}
    return model, capture(model, toy_inputs(), ExecutorchConfig(dynamic_shapes=dims))


def test_attention_output_view_breaks_to_edge_without_the_fix(toy_inputs):
    # Documents pytorch/pytorch#136543 on the installed torch: when this stops raising, the
    # upstream bug is fixed and contiguous_attention_outputs can be retired.
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    _, program = _attention_program(toy_inputs)
    with pytest.raises(Exception, match="Cannot view a tensor with shape"):
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


@pytest.mark.slow
def test_contiguous_attention_outputs_lets_to_edge_run_and_keeps_values(toy_inputs):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model, program = _attention_program(toy_inputs)
    applied = apply_fx_node_fixes("executorch", program.graph_module)
    assert applied == ["hfexport_executorch.workarounds.fx_fixes.contiguous_attention_outputs"]
    clones = [n for n in program.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 1 and clones[0].args[0].target is torch.ops.aten.transpose.int
    with apply_patches("executorch"):  # the qkv split needs keep_dynamic_dims_in_list_returning_ops
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    inputs = toy_inputs(batch=3, seq=40, seed=4)
    with torch.no_grad():
        expected = model(**inputs)
    actual = edge.exported_program().module()(**inputs)
    assert actual.shape == (3, 40, 16)
    assert (actual - expected).abs().max().item() < 1e-5


def test_every_fix_names_an_upstream_issue_and_a_version_range():
    found = entries("executorch.xnnpack")
    assert {e.name.rsplit(".", 1)[1] for e in found} >= {
        "bound_unbounded_dynamic_ranges",
        "contiguous_attention_outputs",
        "conv1d_with_one_dynamic_dim_only",
        "edge_verifier_accepts_symbolic_min_max",
        "keep_dynamic_dims_in_list_returning_ops",
        "runtime_assertions_dropped_before_edge",
        "layer_norm_in_float32",
        "quantized_embedding_without_padding_idx",
        "sort_as_topk",
        "scatter_add_with_long_index",
        "empty_cat_as_full",
    }
    for entry in found:
        # pytorch/ issues, and the shared dense experts' transformers issue
        assert entry.issue.startswith(("https://github.com/pytorch/", "https://github.com/huggingface/")), (
            entry.name
        )
        assert entry.versions and entry.is_active(), entry.name
        assert not entry.is_stale({"torch": ">=2.12", "executorch": ">=1.3"}), entry.name


def test_runtime_assertion_condition_breaks_to_edge_without_the_fix():
    # Documents the installed executorch: RemoveGraphAssertsPass runs in to_executorch, after to_edge
    # verified the condition (pytorch/executorch#1319). When this stops raising, the fix can retire.
    from executorch.exir import to_edge

    program, _, _ = _placeholder_program()
    with pytest.raises(Exception, match="_is_all_true"):
        to_edge(program)


def test_runtime_assertions_dropped_before_edge_lets_to_edge_run_and_keeps_values():
    from executorch.exir import to_edge

    program, ids, features = _placeholder_program()
    fixes.runtime_assertions_dropped_before_edge(program)
    edge = to_edge(program).exported_program()
    targets = {str(n.target) for n in edge.graph.nodes if n.op == "call_function"}
    assert not any("_is_all_true" in t or "_assert_scalar" in t for t in targets), targets
    longer = torch.tensor([[7, 1, 7, 2, 5], [3, 7, 7, 4, 5]])
    for prompt in (ids, longer):
        torch.testing.assert_close(edge.module()(prompt, features), PlaceholderCheck()(prompt, features))


class SortedRouter(torch.nn.Module):
    """jetmoe's router in small: sort the expert assignment, gather by the permutation, scatter back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(torch.nn.functional.one_hot(input_ids % 8, 8).float())
        expert = input_ids.flatten() % 3  # int64, many ties
        _, order = expert.sort(0)
        grouped = hidden.flatten(0, 1)[order] * (1.0 + expert[order, None])
        out = torch.zeros_like(hidden.flatten(0, 1)).index_add(0, order, grouped)
        values, _ = hidden.sort(-1, descending=True)
        return out.view_as(hidden) + values


def test_sort_as_topk_lets_the_pte_load_and_matches_eager_at_two_shapes():
    # jetmoe failed to load in the runtime ("Missing operator: aten::sort.values", error 0x14)
    from hfexport_executorch import ExecutorchExporter

    model = SortedRouter().eval()
    inputs = {"input_ids": torch.tensor([[5, 1, 7, 2, 3, 9], [4, 4, 0, 6, 2, 8]])}
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert "hfexport_executorch.workarounds.fx_fixes.sort_as_topk" in report.applied["fx_node_fixes"]
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok"
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


class ChunkReshape(torch.nn.Module):
    """Pads the sequence to whole 64-token chunks and splits it into them, as the gated delta rule does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (64 - x.shape[1] % 64) % 64
        padded = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return padded.reshape(padded.shape[0], -1, 64, padded.shape[-1])


def test_constant_size_reads_the_chunk_size_that_sympy_leaves_symbolic():
    program = torch.export.export(
        ChunkReshape(), (torch.randn(2, 8, 4),), dynamic_shapes={"x": {1: Dim.AUTO}}
    )
    output = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    chunks, chunk = output.meta["val"].shape[1:3]
    assert isinstance(chunk, torch.SymInt)  # padded // (padded // 64): constant, not simplified
    assert fixes._constant_size(chunk) == 64
    assert fixes._constant_size(chunks) is None  # the chunk count varies with the length
    assert fixes._constant_size(7) == 7


class GatedDeltaRule(torch.nn.Module):
    """transformers 5.24's olmo_hybrid ``torch_chunk_gated_delta_rule`` on projected inputs: the
    solve of the unit lower-triangular UT system, with the real chunked scan."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 8)
        self.qkv = torch.nn.Linear(8, 3 * 8)
        self.gates = torch.nn.Linear(8, 2 * 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from transformers.models.olmo_hybrid import modeling_olmo_hybrid

        hidden = self.embed(input_ids)
        batch, length, _ = hidden.shape
        query, key, value = self.qkv(hidden).view(batch, length, 3, 2, 4).unbind(2)
        decay, beta = self.gates(hidden).view(batch, length, 2, 2).unbind(2)
        out, _ = modeling_olmo_hybrid.torch_chunk_gated_delta_rule(
            query,
            key,
            value,
            -torch.nn.functional.softplus(decay),
            beta.sigmoid(),
            use_qk_l2norm_in_kernel=True,
        )
        return out.flatten(2)


def _solves(program: torch.export.ExportedProgram) -> int:
    return sum(n.target is torch.ops.aten.linalg_solve_triangular.default for n in program.graph.nodes)


def test_gated_delta_rule_keeps_its_solve_under_the_patch_and_the_fix_turns_it_into_matmuls():
    # The patch keeps torch.linalg.solve_triangular under export (not transformers' 63 unrolled row
    # updates, huggingface/transformers#47808); the node fix turns it into matmuls the runtime runs.
    model = GatedDeltaRule().eval()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))}
    with apply_patches("executorch"):
        program = capture(model, inputs, ExecutorchConfig(dynamic=True))
    assert _solves(program) == 2  # the new values and the decayed keys
    assert len(program.graph.nodes) < 200  # 130; unrolled (captured without the patch, ~40 s): 953
    applied = apply_fx_node_fixes("executorch", program.graph_module)
    assert "hfexport_executorch.workarounds.fx_fixes.unit_lower_triangular_solve_as_matmuls" in applied
    assert _solves(program) == 0
    for batch, length in ((2, 8), (3, 61)):  # one 64-token chunk: the program's range (model-bounded)
        ids = torch.randint(0, 32, (batch, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            diff = (program.module()(input_ids=ids) - model(input_ids=ids)).abs().max().item()
        assert diff < 1e-5, (batch, length, diff)


@pytest.mark.extended
def test_gated_delta_rule_pte_matches_eager_at_two_shapes():
    # end to end (about 80 s): lowering, the runtime, and the second shape inside the model-bounded range
    from hfexport_executorch import ExecutorchExporter

    model = GatedDeltaRule().eval()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))}
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.unit_lower_triangular_solve_as_matmuls"
        in (report.applied["fx_node_fixes"])
    )
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok"
    # one chunk per program: the scan over chunks is unrolled at the sample's count (model-bounded)
    sequence = [a for a in report.dynamic_axes if a["meaning"] == "sequence"]
    assert {(a["max"], a["note"]) for a in sequence} == {(63, "model-bounded")}
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


def test_every_gated_delta_rule_module_with_the_export_branch_is_patched():
    # a new transformers model with the unrolled solve (huggingface/transformers#47808) needs adding
    import pathlib

    import transformers

    from hfexport_executorch.workarounds.patches import GATED_DELTA_RULE_MODELS

    models = pathlib.Path(transformers.__file__).parent / "models"
    found = sorted(
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if "solve_triangular" in (text := path.read_text()) and "is_torchdynamo_exporting()" in text
    )
    assert found == sorted(GATED_DELTA_RULE_MODELS)


def test_complex_rotary_lowers_and_the_pte_matches_eager_at_two_shapes():
    # deepseek_v2 / llama4 failed in to_edge (SpecViolationError: complex operations; the portable
    # kernels have no complex dtype, pytorch/executorch#11404)
    from hfexport.testing.programs import ComplexRotary
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    exporter.export(ComplexRotary().eval(), {"input_ids": ids}, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.complex_rotary_as_real_pairs"
        in (report.applied["fx_program_fixes"])
    )
    assert [a["input"] for a in report.dynamic_bounds["axes"]] == ["input_ids", "input_ids"]
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok"
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


class FramesBatchNorm(torch.nn.Module):
    """SpeechT5's postnet shape: a BatchNorm1d over [batch, channels, frames], batch and frames dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1.0, 1.0)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(inputs_embeds.transpose(1, 2))).transpose(1, 2)


def test_batch_norm_over_two_dynamic_dims_stays_portable_and_matches_at_two_shapes():
    # speecht5 (text-to-audio, issue 28) failed at XNNPACK preprocess: "XNNPACK reshape only
    # supports 1 dynamic dimension" (the batch norm became a 1-D convolution between reshapes)
    from hfexport_executorch import ExecutorchExporter

    model = FramesBatchNorm().eval()
    inputs = {"inputs_embeds": torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))}
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok"
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


class LastStepsState(torch.nn.Module):
    """RecurrentGemma's convolution state in small: the last ``width`` steps of the sequence, zeros
    before a short one, as ``pad(x, (width - seq_len, 0))`` (a crop when the sequence is longer)."""

    width = 3

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids).transpose(1, 2)  # [batch, channels, seq]
        return torch.nn.functional.pad(x, (self.width - x.shape[-1], 0)) * 2.0, x.sum(1)


def test_a_left_crop_by_negative_pad_runs_in_the_runtime_at_long_and_short_prompts():
    # the runtime's constant_pad_nd refuses negative pads (error 0x12): RecurrentGemma's prefill failed
    from hfexport_executorch import ExecutorchExporter

    model = LastStepsState().eval()
    inputs = {"input_ids": torch.tensor([[5, 1, 7, 2, 3, 9], [4, 4, 0, 6, 2, 8]])}
    exporter = ExecutorchExporter()
    program = exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    fix = "hfexport_executorch.workarounds.fx_fixes.left_crop_of_constant_pad_as_pad_and_slice"
    assert fix in report.applied["fx_node_fixes"]
    assert report.dynamic_bounds["specialized"] == []  # the sequence axis stays dynamic
    for rows in report.validation.values():  # a crop at the sample and at the second shape
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows
    run = exporter.runner(program)
    for ids in (
        torch.tensor([[3, 1], [2, 5]]),
        torch.tensor([[3, 1, 4]]),
        torch.tensor([[1, 2, 3, 4, 5, 6, 7]]),
    ):
        with torch.no_grad():
            expected = model(ids)
        state, sums = run({"input_ids": ids}).values()
        assert state.shape == (ids.shape[0], 4, 3) and sums.shape == ids.shape
        # zeros before a 2-token prompt, the last 3 steps of a 7-token one
        assert torch.equal(state, expected[0]) and torch.equal(sums, expected[1]), ids.shape


class TransposedState(torch.nn.Module):
    """A decode step over a state the previous step returned transposed (RecurrentGemma keeps its
    convolution state as ``[batch, channels, width]`` views of ``[batch, width, channels]`` tensors)."""

    def forward(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((state.clone(), x), -1)[..., 1:] * torch.arange(1, 4, dtype=x.dtype)


def test_a_transposed_sample_input_is_captured_in_row_major_memory():
    # the program took the sample's dim order [0, 2, 1] for `state` while the runner passes row-major
    # buffers: the decode of RecurrentGemma returned scrambled states (max abs diff 4.2)
    from hfexport_executorch import ExecutorchExporter

    model = TransposedState().eval()
    state = (
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).transpose(1, 2)
    )  # [2, 4, 3], strides (12, 1, 4)
    inputs = {"state": state, "x": torch.full((2, 4, 1), -1.0)}
    assert not state.is_contiguous()
    exporter = ExecutorchExporter()
    program = exporter.export(model, inputs, ExecutorchConfig(dynamic=False))
    rows = exporter.last_report.validation["sample"]
    assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows
    (out,) = exporter.runner(program)(inputs).values()
    assert torch.equal(out, model(**inputs))


class _ConcatByEmpty(torch.nn.Module):
    """Mistral-4's ``expand_kv``: one tensor made by ``new_empty`` and filled by two slice copies."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
        out[..., : a.shape[-1]].copy_(a)
        out[..., a.shape[-1] :].copy_(b)
        return out * 2.0


def test_dynamic_empty_as_full_keeps_batch_and_length_dynamic_through_to_edge():
    """Without the fix to_edge pins batch and length to the sample's (2, 8): ``_empty_dim_order``
    takes ``int[] size`` (issue 28, Mistral-4's prefill refused batch 3)."""
    from executorch.exir import to_edge_transform_and_lower

    a, b = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 8)
    batch, length = Dim("batch", min=1, max=8), Dim("length", min=1, max=64)
    shapes = ({0: batch, 2: length}, {0: batch, 2: length})
    program = torch.export.export(_ConcatByEmpty(), (a, b), dynamic_shapes=shapes, strict=False)
    applied = apply_fx_node_fixes("executorch", program.graph_module)
    assert "hfexport_executorch.workarounds.fx_fixes.dynamic_empty_as_full" in applied
    assert not [n for n in program.graph.nodes if n.target is torch.ops.aten.new_empty.default]
    edge = to_edge_transform_and_lower(program)
    uppers = sorted(int(r.upper) for r in edge.exported_program().range_constraints.values())
    assert uppers == [8, 64]
    a3, b3 = torch.randn(3, 4, 11, 16), torch.randn(3, 4, 11, 8)
    actual = edge.exported_program().module()(a3, b3)
    torch.testing.assert_close(actual, torch.cat([a3, b3], dim=-1) * 2.0)


class PatchBuckets(torch.nn.Module):
    """Buckets fractional patch coordinates into position ids, as the Idefics3 vision embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(16, 3)

    def forward(
        self, input_ids: torch.Tensor
    ) -> torch.Tensor:  # float coordinates in [0, 1), as the toys' input_ids
        coords = input_ids
        boundaries = torch.arange(0.25, 1.0, 0.25)
        rows = torch.bucketize(coords, boundaries, right=True)
        cols = torch.bucketize(coords.flip(-1), boundaries)  # right=False
        narrow = torch.bucketize(coords, boundaries, out_int32=True, right=True).to(torch.int64)
        return self.table(rows * 4 + cols) + narrow[..., None]


def test_bucketize_as_comparison_count_lowers_and_the_pte_matches_eager_at_two_shapes():
    # aria / idefics2 / idefics3 / smolvlm image encoders failed in to_edge:
    # "SpecViolationError: Operator torch._ops.aten.bucketize.Tensor is not in Core ATen opset"
    from hfexport_executorch import ExecutorchExporter

    model = PatchBuckets().eval()
    # values on the boundaries too, where right=True and right=False differ
    coords = torch.tensor([[0.0, 0.25, 0.3, 0.5, 0.75, 0.99], [0.1, 0.2, 0.25, 0.6, 0.7, 0.8]])
    exporter = ExecutorchExporter()
    exporter.export(model, {"input_ids": coords}, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.bucketize_as_comparison_count"
        in report.applied["fx_node_fixes"]
    )
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows


def test_bucketize_as_comparison_count_gives_bucketize_indices_and_dtypes():
    boundaries = torch.tensor([0.25, 0.5, 0.75])
    x = torch.tensor([[-1.0, 0.25, 0.4, 0.5, 0.9, 2.0]])
    for right in (False, True):
        for out_int32 in (False, True):

            class Bucket(torch.nn.Module):
                def forward(self, values: torch.Tensor, right=right, out_int32=out_int32) -> torch.Tensor:
                    return torch.bucketize(values, boundaries, out_int32=out_int32, right=right)

            ep = torch.export.export(Bucket(), (x,))
            applied = apply_fx_node_fixes("executorch", ep.graph_module)
            assert any(name.endswith("bucketize_as_comparison_count") for name in applied), applied
            assert not any(n.target is torch.ops.aten.bucketize.Tensor for n in ep.graph.nodes)
            ep.graph_module.recompile()
            got, expected = ep.module()(x), torch.bucketize(x, boundaries, out_int32=out_int32, right=right)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (
                right,
                out_int32,
                got,
                expected,
            )


class WindowRestore(torch.nn.Module):
    """Permutes rows by a window index and restores their order with argsort, as Qwen2.5-VL's vision tower does."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        window_index = torch.arange(input_ids.shape[1]).flip(0)  # distinct values, like the window index
        windowed = input_ids[:, window_index] * 2.0
        restored = windowed[:, torch.argsort(window_index)]
        descending = torch.argsort(input_ids, dim=-1, descending=True)
        return restored + descending.to(restored.dtype)


def test_argsort_as_topk_indices_lets_the_pte_load_and_matches_eager_at_two_shapes():
    # qwen2_5_vl / exaone4_5 / hyperclovax_vision_v2 image encoders failed to load: to_edge decomposes
    # aten.argsort into aten.sort, which the runtime has no kernel for ("Missing operator: aten::sort.values")
    from hfexport_executorch import ExecutorchExporter

    model = WindowRestore().eval()
    inputs = {"input_ids": torch.randn(2, 5, generator=torch.Generator().manual_seed(0))}
    exporter = ExecutorchExporter()
    exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert "hfexport_executorch.workarounds.fx_fixes.sort_as_topk" in report.applied["fx_node_fixes"]
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows


def test_stable_argsort_is_left_to_the_runtime():
    class Stable(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.argsort(x, stable=True)

    ep = torch.export.export(Stable(), (torch.tensor([[3, 1, 1, 2]]),))
    assert apply_fx_node_fixes("executorch", ep.graph_module) == []
    assert any(n.target is torch.ops.aten.argsort.stable for n in ep.graph.nodes)


class GridRepeat(torch.nn.Module):
    """Repeats each image's grid width once per patch and adds it to the patches, as the Qwen3-VL
    position-embedding interpolation does (the repeats sum to the patch count)."""

    def forward(self, input_ids: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        counts = grid[:, 0] * grid[:, 1]
        widths = torch.repeat_interleave(grid[:, 1], counts)
        starts = torch.repeat_interleave(torch.nn.functional.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
        within = torch.arange(counts.sum()) - starts
        return input_ids + (within % widths)[:, None].to(input_ids.dtype)


def test_repeat_interleave_as_cumulative_count_lowers_and_matches_eager():
    # the qwen3_vl image encoder failed in to_edge: "SpecViolationError: Operator
    # torch._ops.aten.repeat_interleave.Tensor is not in Core ATen opset"
    from torch.export import Dim

    from hfexport_executorch import ExecutorchExporter

    model = GridRepeat().eval()
    grid = torch.tensor([[2, 3], [1, 4]])
    inputs = {"input_ids": torch.randn(10, 4, generator=torch.Generator().manual_seed(0)), "grid": grid}
    patches = Dim("patches", min=2, max=256)
    exporter = ExecutorchExporter()
    config = ExecutorchConfig(dynamic=True, dynamic_shapes={"input_ids": {0: patches}, "grid": None})
    exporter.export(model, inputs, config)
    report = exporter.last_report
    fixes = report.applied["fx_node_fixes"]
    assert "hfexport_executorch.workarounds.fx_fixes.repeat_interleave_as_cumulative_count" in fixes
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows


class ChunkLoop(torch.nn.Module):
    """A sequence padded to whole chunks of 8 and a Python loop over the chunks carrying a state, as
    transformers' ``torch_chunk_gated_delta_rule`` (qwen3_5, qwen3_next) loops over 64-token chunks:
    capture unrolls the loop for the sample's chunk count and guards it (``ceil(L / 8) == 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length, width = input_ids.shape
        pad = (8 - length % 8) % 8
        chunks = torch.nn.functional.pad(input_ids, (0, 0, 0, pad)).reshape(batch, -1, 8, width)
        summed = chunks.cumsum(2)
        state = torch.zeros(batch, 1, width)
        out = torch.zeros_like(summed)
        for i in range(chunks.shape[1]):
            out[:, i] = summed[:, i] + state
            state = state + summed[:, i, -1:]
        return out.reshape(batch, -1, width)[:, :length]


def test_a_chunk_loop_is_planned_and_refused_at_the_length_its_guards_accept(toy_inputs):
    # the guard on the unrolled chunk count is no range constraint (pytorch/pytorch#161178): the input
    # was planned at the role bound (4096) and the chunk at 8 rows, so a 12-token input failed inside
    # the program (aten::cumsum.out: error 0x12) instead of being refused; Qwen3.5's language model
    from hfexport_executorch import ExecutorchExporter

    model = ChunkLoop().eval()
    inputs = toy_inputs(batch=2, seq=6)
    exporter = ExecutorchExporter()
    program = exporter.export(model, inputs, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.sequence_bounds_from_input_guards"
        in (report.applied["fx_program_fixes"])
    )
    guarded = {(a["input"], a["axis"]): a["max"] for a in report.dynamic_axes if a["note"] == "model-bounded"}
    assert guarded == {("input_ids", 1): 7}  # a whole chunk takes an unpadded path the guards exclude
    planned = {(a["input"], a["axis"]): a["max"] for a in report.dynamic_bounds["axes"]}
    assert planned[("input_ids", 1)] == 7
    run = exporter.runner(program)
    for batch, length in ((1, 3), (3, 7)):
        x = toy_inputs(batch=batch, seq=length, seed=length)["input_ids"]
        (out,) = run({"input_ids": x}).values()
        assert torch.allclose(out, model(x), atol=1e-5), (batch, length)
    with pytest.raises(ValueError, match="dimension 1 is 12, above the upper bound 7"):
        run({"input_ids": toy_inputs(batch=1, seq=12)["input_ids"]})


class WeightedBags(torch.nn.Module):
    """Sums 4 weighted rows of a table per patch with ``F.embedding_bag``, as Kimi-K2.5's vision tower
    resamples its position grid (16 rows there)."""

    def __init__(self, mode: str = "sum", padding_idx: int | None = None) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(12, 6))
        self.mode, self.padding_idx = mode, padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # float [patches, 4]
        index = (input_ids.abs() * 7).to(torch.int64) % 12
        weights = input_ids.softmax(-1) if self.mode == "sum" else None
        return torch.nn.functional.embedding_bag(
            index, self.table, per_sample_weights=weights, mode=self.mode, padding_idx=self.padding_idx
        )


def test_embedding_bag_of_fixed_bags_lets_the_pte_load_and_matches_eager_at_two_shapes():
    # Kimi-K2.5's image encoder failed to load: "Failed to load method forward, error: 0x14" (no
    # embedding_bag kernel in the runtime)
    from hfexport_executorch import ExecutorchExporter

    model = WeightedBags().eval()
    exporter = ExecutorchExporter()
    exporter.export(model, {"input_ids": torch.rand(9, 4)}, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.embedding_bag_of_fixed_bags_as_gather_sum"
        in report.applied["fx_node_fixes"]
    )
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] < 1e-5 for row in rows), rows


@pytest.mark.parametrize(("mode", "padding_idx"), [("sum", None), ("sum", 3), ("mean", None), ("mean", 3)])
def test_embedding_bag_of_fixed_bags_gives_embedding_bag_values(mode, padding_idx):
    model = WeightedBags(mode, padding_idx).eval()
    x = torch.rand(5, 4)
    x[0] = 3 / 7 + 0.01  # an all-padding bag: index 3 everywhere
    program = torch.export.export(model, (x,))
    applied = apply_fx_node_fixes("executorch", program.graph_module)
    assert any(name.endswith("embedding_bag_of_fixed_bags_as_gather_sum") for name in applied), applied
    targets = {n.target for n in program.graph.nodes}
    assert not targets & {torch.ops.aten.embedding_bag.padding_idx, torch.ops.aten._embedding_bag.default}
    program.graph_module.recompile()
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-6, atol=1e-6)


def test_embedding_bag_of_ragged_bags_is_left_alone():
    class Ragged(torch.nn.Module):
        def forward(self, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding_bag(index, table, torch.tensor([0, 2, 3]), mode="sum")

    program = torch.export.export(Ragged(), (torch.tensor([1, 2, 0, 4, 3]), torch.randn(6, 2)))
    applied = apply_fx_node_fixes("executorch", program.graph_module)
    assert not any(name.endswith("embedding_bag_of_fixed_bags_as_gather_sum") for name in applied), applied


class TopkKeyMask(torch.nn.Module):
    """Marks the keys each query selected, from int32 indices, as GLM-5-Next's sparse attention does."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        picked = torch.stack([input_ids % 8, (input_ids * 3) % 8], dim=-1).to(torch.int32)
        counts = torch.zeros(batch, length, 8, dtype=torch.int32)
        counts.scatter_add_(-1, picked, torch.ones_like(picked))
        return counts.ne(0).to(torch.float32) * 2.0


def test_scatter_add_with_an_int32_index_lowers_and_the_pte_matches_eager_at_two_shapes():
    # glm5_next's language model failed in to_edge: "SpecViolationError: These operators are taking
    # Tensor inputs with mismatched dtypes: aten.scatter_add.default ... 'index': torch.int32"
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 0, 6, 11, 13]])
    exporter.export(TopkKeyMask().eval(), {"input_ids": ids}, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert (
        "hfexport_executorch.workarounds.fx_fixes.scatter_add_with_long_index"
        in report.applied["fx_node_fixes"]
    )
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows


class EmptyJoin(torch.nn.Module):
    """Joins empty tensors, as GLM-5-Next's cache update ([batch, 1, positions, 0] keys along the
    positions) and its tiny indexer ([batch, seq, 0] top-k and tail indices) do."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        picked = input_ids[..., None][..., :0]  # [batch, seq, 0]
        tail = (input_ids[..., None] + 1)[..., :0]
        joined = torch.cat([picked, tail], dim=-1)  # empty along the joined axis
        grown = torch.cat([picked, tail[:, :2]], dim=1)  # empty on another axis: [batch, seq + 2, 0]
        # a 1-D empty operand, skipped by cat (a DynamicCache layer's first keys)
        grown = torch.cat([input_ids.new_zeros(0), grown], dim=1)
        return input_ids * 2 + joined.sum(-1) + grown.sum(-1)[:, : input_ids.shape[1]]


def test_empty_cat_as_full_lets_the_program_emit_and_matches_eager_at_two_shapes():
    # glm5_next's language model failed in to_executorch: PruneEmptyTensorsPass put the raw SymInt
    # sequence length into aten.full's size list, "InternalError: Unsupported type encountered in int list"
    from hfexport_executorch import ExecutorchExporter

    exporter = ExecutorchExporter()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 0, 6, 11, 13]])
    exporter.export(EmptyJoin().eval(), {"input_ids": ids}, ExecutorchConfig(dynamic=True))
    report = exporter.last_report
    assert "hfexport_executorch.workarounds.fx_fixes.empty_cat_as_full" in report.applied["fx_node_fixes"]
    stages = {s.name: s.status for s in report.stages}
    assert stages["validate"] == "ok" and stages["validate_second_shape"] == "ok", stages
    for rows in report.validation.values():
        assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in rows), rows
