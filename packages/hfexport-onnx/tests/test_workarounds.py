"""The registered ONNX workarounds: each one's behaviour on a small input, and its metadata."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import PretrainedConfig

from hfexport import registry
from hfexport.config import OnnxConfig
from hfexport.testing.programs import PlaceholderCheck
from hfexport.testing.programs import placeholder_check_program as _placeholder_program
from hfexport_onnx import OnnxExporter, OnnxRuntimeRunner
from hfexport_onnx.versions import SUPPORTED
from hfexport_onnx.workarounds import fx_fixes, translations

ATOL = 1e-5
SLIDING = "hfexport.workarounds.torch_export.sliding_window_update_keeps_dynamic_length"
POOLING = [
    "hfexport.workarounds.torch_export.avg_pool_over_the_whole_map_as_mean",
    "hfexport.workarounds.torch_export.max_pool_over_the_whole_map_as_amax",
    "hfexport.workarounds.torch_export.max_pool1d_as_max_pool2d",
]
#: the mask, T5Gemma2 and Moonshine capture patches, registered after the pooling ones
LATER = [
    "hfexport.workarounds.torch_export.mask_functions_broadcast_instead_of_vmap",
    "hfexport.workarounds.torch_export.t5gemma2_eoi_embedding_as_where",
    "hfexport.workarounds.torch_export.moonshine_feature_lengths_by_floor_division",
]
SIZE_ONE = "hfexport.workarounds.torch_export.keep_size_one_batch_dynamic"


def test_every_onnx_workaround_names_issue_and_range():
    found = registry.entries("onnx")
    assert {e.kind for e in found} >= {"patch", "onnx_translation"}
    assert [e.name for e in translations.translation_entries()] == [
        e.name for e in found if e.kind == translations.KIND
    ]
    for entry in found:
        assert entry.issue.startswith("https://github.com/"), entry.name
        assert entry.versions and entry.description, entry.name
        assert entry.is_active(), (
            f"{entry.name} is inactive with the tested versions: {entry.inactive_reason()}"
        )
        assert not entry.is_stale(SUPPORTED), f"{entry.name} can be retired"


def test_shared_capture_faults_are_left_to_the_core():
    shared = {"torch.export.export", "transformers.cache_utils.DynamicSlidingWindowLayer.update"}
    assert not {p for e in registry.entries("onnx", kind="patch") for p in e.paths} & shared
    core = {e.name for e in registry.entries("capture", kind="patch")}
    assert {SLIDING, SIZE_ONE} <= core


def test_batch_of_one_sample_exports_a_dynamic_batch(tiny_encoder):
    """The core's size-1 batch workaround reaches the ONNX graph (installed inside the "onnx" patches)."""
    model, inputs = tiny_encoder
    one = {k: v[:1] for k, v in inputs.items()}
    exporter = OnnxExporter()
    program = exporter.export(model, one, OnnxConfig(dynamic=True, external_data=False))
    assert exporter.last_report.applied["capture_patches"] == [SLIDING, SIZE_ONE, *POOLING, *LATER]
    assert SIZE_ONE not in exporter.last_report.applied["patches"]
    assert str(program.model.graph.inputs[0].shape[0]) != "1"
    three = {
        "inputs_embeds": torch.randn(3, 11, 8, generator=torch.Generator().manual_seed(5)),
        "attention_mask": torch.ones(3, 11, dtype=torch.int64),
    }
    got = OnnxRuntimeRunner(program)(three)["last_hidden_state"]
    with torch.no_grad():
        assert (got - model(**three).last_hidden_state).abs().max() <= ATOL


class GroupedMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

        self.config = PretrainedConfig()
        self.weight = torch.nn.Parameter(torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0)))

    def forward(self, inputs_embeds: torch.Tensor, offs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": torch.ops.transformers.grouped_mm_fallback(inputs_embeds, self.weight, offs)}


def test_grouped_mm_fallback_translation_selects_each_rows_expert():
    model = GroupedMatmul().eval()
    rows = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # expert 1 empty, row 6 past the last bound
    exporter = OnnxExporter()
    program = exporter.export(
        model, {"inputs_embeds": rows, "offs": offs}, OnnxConfig(external_data=False, validate=False)
    )
    # the report lists every active translation handed to torch.onnx
    assert (
        f"{translations.__name__}.grouped_mm_fallback" in exporter.last_report.applied["custom_translations"]
    )
    runner = OnnxRuntimeRunner(program)
    for routing in (offs, torch.tensor([0, 3, 3, 7], dtype=torch.int32)):
        got = runner({"inputs_embeds": rows, "offs": routing})["logits"]
        with torch.no_grad():
            expected = model(rows, routing)["logits"]
        assert got.shape == (7, 5)
        assert (got - expected).abs().max() <= ATOL
        if routing[-1] < 7:
            assert torch.equal(got[6:], torch.zeros(1, 5))  # rows past the last bound stay 0


class ComplexRotary(torch.nn.Module):
    """deepseek_v2-style rotary embedding in complex numbers: polar, a real scale, unsqueeze, complex mul."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False
        )

    def forward(self, inputs_embeds: torch.Tensor) -> dict[str, torch.Tensor]:
        batch, heads, seq, _ = inputs_embeds.shape  # [B, H, S, 8]
        positions = torch.arange(seq, dtype=torch.float32).unsqueeze(0).expand(batch, -1)  # [B, S]
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [B, S, 4]
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * 0.5  # complex [B, S, 4]
        x = torch.view_as_complex(inputs_embeds.float().reshape(batch, heads, seq, -1, 2))
        # a positive and a negative unsqueeze axis, each [B, 1, S, 4] against [B, H, S, 4]
        rotated = x * freqs_cis.unsqueeze(1) + x * freqs_cis.unsqueeze(-3) * 0.25
        return {"logits": torch.view_as_real(rotated).flatten(3)}


def test_complex_rotary_translations_match_eager_at_two_lengths():
    # without the complex-input registration torch.onnx fails in translate: "No ONNX function found for
    # aten.unsqueeze.default ... No decompositions registered for the complex-valued input"
    gen = torch.Generator().manual_seed(0)
    model = ComplexRotary().eval()
    sample = torch.randn(2, 3, 5, 8, generator=gen)
    exporter = OnnxExporter()
    program = exporter.export(
        model, {"inputs_embeds": sample}, OnnxConfig(external_data=False, validate=False, dynamic=True)
    )
    applied = exporter.last_report.applied["custom_translations"]
    assert f"{translations.__name__}.unsqueeze_complex" in applied
    assert f"{translations.__name__}.mul_complex" in applied
    runner = OnnxRuntimeRunner(program)
    for x in (sample, torch.randn(3, 3, 9, 8, generator=gen)):
        got = runner({"inputs_embeds": x})["logits"]
        with torch.no_grad():
            expected = model(x)["logits"]
        assert got.shape == expected.shape == (x.shape[0], 3, x.shape[2], 8)
        assert (got - expected).abs().max() <= ATOL


def test_runtime_assertion_condition_has_no_onnx_function_without_the_fix():
    # Documents the installed torch.onnx: remove_assertion_nodes runs after decomposition and without
    # dead-code elimination (pytorch/pytorch#150206). When this stops raising, the fix can retire.
    program, _, _ = _placeholder_program()
    with pytest.raises(Exception, match="_is_all_true"):
        torch.onnx.export(program, dynamo=True, optimize=False)


def test_runtime_assertions_dropped_before_translation_keeps_values_at_two_lengths():
    import onnxruntime as ort

    program, ids, features = _placeholder_program()
    fx_fixes.runtime_assertions_dropped_before_translation(program)
    onnx_program = torch.onnx.export(program, dynamo=True, optimize=False)
    assert not {"_is_all_true", "_assert_scalar"} & {n.op_type for n in onnx_program.model.graph}
    session = ort.InferenceSession(onnx_program.model_proto.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    for prompt in (ids, torch.tensor([[7, 1, 7, 2, 5], [3, 7, 7, 4, 5]])):
        (got,) = session.run(None, dict(zip(names, (prompt.numpy(), features.numpy()))))
        expected = PlaceholderCheck()(prompt, features)
        assert got.shape == tuple(expected.shape)
        assert abs(torch.from_numpy(got) - expected).max() <= ATOL


def test_the_exported_graph_is_freed_after_the_optimizer_ran(monkeypatch):
    """onnxscript's module-level rewrite rules kept the last graph they matched (with every
    initializer, i.e. the weights); with ``rewrite_rules_forget_the_graph`` the ONNX program is
    freed as soon as the caller drops it."""
    import gc
    import weakref

    from onnxscript.rewriter.rules import common

    from hfexport.testing import tiny_model

    # pytest keeps log records, and the constant folder's warnings carry exceptions whose frames
    # hold the graph: silence that logger so only the code under test can keep the graph alive
    monkeypatch.setattr(logging.getLogger("onnxscript.optimizer._constant_folding"), "disabled", True)
    model, inputs = tiny_model("bert")
    program = OnnxExporter().export(model, inputs, OnnxConfig(validate=False))
    graph = weakref.ref(program.model.graph)
    del program
    gc.collect()
    assert graph() is None
    held = [
        rule._matcher
        for rule in vars(common).values()
        if hasattr(rule, "_matcher") and getattr(rule._matcher, "_graph", None) is not None
    ]
    assert held == []  # no module-level rule holds a graph after the export


def test_without_the_patch_a_rewrite_rule_keeps_the_graph():
    """The behaviour the patch works around, so the test above would notice a no-op patch."""
    import gc
    import weakref

    import onnx_ir as ir
    from onnxscript.rewriter import _matcher, pattern

    def target(op, x):
        return op.Identity(x)

    def replacement(op, x):
        return op.Identity(x)

    rule = pattern.RewriteRule(target, replacement)
    graph_in = ir.val("x", ir.DataType.FLOAT, [2])
    node = ir.node("Identity", [graph_in], num_outputs=1)
    graph = ir.Graph([graph_in], node.outputs, nodes=[node], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    matcher = rule._matcher
    assert isinstance(matcher, _matcher.SimplePatternMatcher)
    matcher.match(model, graph, node)
    ref = weakref.ref(graph)
    del model, graph, node, graph_in
    gc.collect()
    assert ref() is not None and matcher._graph is ref()  # the unpatched matcher still holds it
    matcher._graph = None


class _StagesSplitByBatch(torch.nn.Module):
    """ZoeDepth's reassemble stage in small: stages stacked along the batch, split back by the batch size."""

    def forward(self, x):
        stacked = torch.cat([x, 2 * x, 3 * x], dim=0)
        return [chunk.sum(-1) * (i + 1) for i, chunk in enumerate(stacked.split(x.shape[0], dim=0))]


def test_a_split_into_run_time_chunks_is_optimized_and_runs_at_two_batches():
    """issue 28: torch.onnx gives SplitToSequence(x, batch) for x.split(batch) on a dynamic batch, and
    onnxscript's constant folding failed on it (AttributeError: 'NoneType' object has no attribute 'ndim';
    zoedepth failed stage 'optimize'): with the patch the node is left for ONNX Runtime."""
    import onnxruntime as ort
    from onnx_ir.passes import PassError

    from hfexport.registry import apply_patches

    name = "hfexport_onnx.workarounds.patches.split_of_run_time_chunks_not_folded"
    assert name in {e.name for e in registry.entries("onnx", kind="patch")}
    model = _StagesSplitByBatch()

    def translated():
        return torch.onnx.export(
            model,
            (torch.randn(2, 5),),
            dynamic_shapes=({0: torch.export.Dim.AUTO},),
            dynamo=True,
            optimize=False,
        )

    with pytest.raises(PassError):
        translated().optimize()
    program = translated()
    with apply_patches("onnx"):
        program.optimize()
    assert "SplitToSequence" in [node.op_type for node in program.model.graph]
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    for batch in (2, 5):
        x = torch.randn(batch, 5)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        for mine, theirs in zip(got, model(x), strict=True):
            assert mine.shape == (batch,)
            torch.testing.assert_close(torch.from_numpy(mine), theirs, atol=ATOL, rtol=ATOL)


class _PyramidPooling(torch.nn.Module):
    """The pyramid pooling of BEiT / UperNet segmentation heads: adaptive means to 1, 2, 3 and 6 bins."""

    def forward(self, x):
        return [torch.nn.functional.adaptive_avg_pool2d(x, bins) for bins in (1, 2, 3, 6)]


def _onnx_session(model, sample, patched: bool):
    import onnxruntime as ort

    from hfexport.registry import apply_patches

    auto = torch.export.Dim.AUTO
    dynamic = ({0: auto, 2: auto, 3: auto},)
    with apply_patches("onnx") if patched else contextlib.nullcontext():
        program = torch.onnx.export(model, (sample,), dynamic_shapes=dynamic, dynamo=True)
    return ort.InferenceSession(program.model_proto.SerializeToString())


def test_adaptive_average_pooling_keeps_its_windows_at_other_image_sizes():
    """issue 28: torch.onnx fixed adaptive_avg_pool2d's AveragePool window at the traced sides (pytorch/pytorch#147720):
    BEiT's segmentation logits missed eager by 9e-4 at a doubled image. The patch's averaging matrices follow the
    sides (non-divisible sides and more bins than positions included)."""
    name = "hfexport_onnx.workarounds.patches.adaptive_avg_pool_over_dynamic_sides"
    assert name in {e.name for e in registry.entries("onnx", kind="patch")}
    model = _PyramidPooling()
    unpatched = _onnx_session(model, torch.randn(2, 3, 4, 4), patched=False)
    wide = torch.randn(2, 3, 8, 8)
    got = unpatched.run(None, {unpatched.get_inputs()[0].name: wide.numpy()})
    assert got[1].shape != (2, 3, 2, 2)  # the 2-bin pooling kept the sample's window
    session = _onnx_session(model, torch.randn(2, 3, 4, 4), patched=True)
    for height, width in ((4, 4), (8, 8), (7, 5), (2, 2)):
        x = torch.randn(3, 3, height, width)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        for mine, theirs in zip(got, model(x), strict=True):
            assert mine.shape == tuple(theirs.shape)
            torch.testing.assert_close(torch.from_numpy(mine), theirs, atol=ATOL, rtol=ATOL)


class _ScalarMinusMask(torch.nn.Module):
    """XLNet's input mask: ``1.0 - attention_mask`` on an int64 mask, scaling float states."""

    def forward(self, x, mask):
        return (1.0 - mask)[:, :, None] * x


def test_scalar_minus_integer_mask_translates_with_the_fix_and_runs_at_two_shapes():
    """issue 28: XLNet question answering failed stage 'translate' (torch 2.13 type promotion of
    1.0 - int_tensor: Cannot find a compatible OpOverload for aten.sub, pytorch/pytorch#194381)."""
    import onnxruntime as ort

    name = f"{fx_fixes.__name__}.scalar_minus_integer_tensor_in_float"
    assert name in {e.name for e in registry.entries("onnx", kind="fx_node_fix")}
    model = _ScalarMinusMask()
    x, mask = torch.randn(2, 5, 4), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    auto = torch.export.Dim.AUTO
    dynamic = ({0: auto, 1: auto}, {0: auto, 1: auto})

    def captured():
        return torch.export.export(model, (x, mask), dynamic_shapes=dynamic)

    with pytest.raises(Exception, match=r"aten\.sub"):
        torch.onnx.export(captured(), dynamo=True, optimize=False)
    program = captured()
    rsub = [n for n in program.graph.nodes if n.target is torch.ops.aten.rsub.Scalar]
    assert len(rsub) == 1 and fx_fixes.scalar_minus_integer_tensor_in_float(program.graph_module, rsub[0])
    assert not fx_fixes.scalar_minus_integer_tensor_in_float(
        program.graph_module, rsub[0]
    )  # operand now float
    session = ort.InferenceSession(torch.onnx.export(program, dynamo=True).model_proto.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    for shape in ((2, 5), (3, 9)):
        xs, masks = torch.randn(*shape, 4), torch.randint(0, 2, shape)
        (got,) = session.run(None, dict(zip(names, (xs.numpy(), masks.numpy()))))
        assert got.dtype.name == "float32" and got.shape == (*shape, 4)
        torch.testing.assert_close(torch.from_numpy(got), model(xs, masks), atol=ATOL, rtol=ATOL)


class _EpsilonShift(torch.nn.Module):
    """CHMv2's bin weights in small: ``relu(x) + 1e-8`` normalised over the bins, uniform where
    every logit is <= 0."""

    def forward(self, x):
        shifted = torch.relu(x) + 1e-8
        return shifted / shifted.sum(dim=1, keepdim=True)


def test_an_epsilon_added_is_not_dropped_as_a_no_op_add():
    """issue 28 (chmv2): onnxscript's Add(x, 0) -> x rule matched the constant 1e-8 (its pattern
    constants match within abs_tol 1e-8); with ``identity_constants_match_exactly`` the Add stays and
    the weights are eager's 1/4, not 0/0."""
    from onnxscript.rewriter import rewrite

    name = "hfexport_onnx.workarounds.patches.identity_constants_match_exactly"
    entry = next(e for e in registry.entries("onnx", kind="patch") if e.name == name)
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved
    x = -torch.rand(2, 4, 3, generator=torch.Generator().manual_seed(0)) - 0.1  # every logit < 0
    program = OnnxExporter().export(_EpsilonShift(), {"x": x}, OnnxConfig(dynamic=False))
    got = OnnxRuntimeRunner(program)({"x": x})
    (out,) = got.values()
    torch.testing.assert_close(torch.as_tensor(out), torch.full((2, 4, 3), 0.25), atol=1e-6, rtol=0)
    # the upstream behaviour the patch works around: the same rules outside it drop the Add
    import onnx_ir as ir

    exported = torch.onnx.export(_EpsilonShift(), (x,), dynamo=True, optimize=False)
    model = ir.from_proto(ir.to_proto(exported.model))
    adds = sum(node.op_type == "Add" for node in model.graph)
    rewrite(model)
    assert sum(node.op_type == "Add" for node in model.graph) == adds - 1


class _SqueezeRows(torch.nn.Module):
    """``squeeze(0)`` of a ``[tokens, hidden]`` tensor: a no-op in PyTorch (Mistral3's image features)."""

    def forward(self, x):
        return (x * 2).squeeze(0).squeeze(1)


def test_squeeze_of_a_non_unit_axis_runs_in_onnxruntime_with_the_fix():
    """issue 28: Mistral3 / Mistral-Large-4's image encoder failed ONNX validation (ShapeInferenceError:
    Dimension of input 0 must be 1 instead of 4): onnxscript emits Squeeze for squeeze(0) of a
    4-row tensor, which ONNX refuses (onnx/onnx#3764)."""
    import onnxruntime as ort

    name = f"{fx_fixes.__name__}.squeeze_of_a_non_unit_axis_dropped"
    assert name in {e.name for e in registry.entries("onnx", kind="fx_node_fix")}
    model, x = _SqueezeRows(), torch.randn(4, 1, 8)

    def session(program):
        proto = torch.onnx.export(program, dynamo=True, optimize=False).model_proto.SerializeToString()
        return ort.InferenceSession(proto)

    with pytest.raises(Exception, match="must be 1"):
        session(torch.export.export(model, (x,))).run(None, {"x": x.numpy()})
    program = torch.export.export(model, (x,))
    squeezes = [n for n in program.graph.nodes if n.target is torch.ops.aten.squeeze.dim]
    assert [fx_fixes.squeeze_of_a_non_unit_axis_dropped(program.graph_module, n) for n in squeezes] == [
        True,
        False,
    ]
    (got,) = session(program).run(None, {"x": x.numpy()})
    assert got.shape == (4, 8)  # the size-1 axis is still squeezed
    torch.testing.assert_close(torch.from_numpy(got), model(x), atol=0, rtol=0)


class _RepeatByCounts(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.tensor([2, 1, 3])
        # .self_Tensor, which the translation's decompositions turn into .Tensor(counts, output_size=6)
        return x.repeat_interleave(counts, dim=0, output_size=6) * 2


def test_repeat_interleave_with_output_size_translates_with_the_fix():
    """issue 28: Kimi-K2.5's image encoder (exported for one patch grid) computes its position
    interpolation indices with repeat_interleave(counts, output_size=n); onnxscript's translation
    has no output_size parameter (TypeError, microsoft/onnxscript#2687)."""
    import onnxruntime as ort

    name = f"{fx_fixes.__name__}.repeat_interleave_without_output_size"
    assert name in {e.name for e in registry.entries("onnx", kind="fx_node_fix")}
    model, x = _RepeatByCounts(), torch.randn(3, 4)
    with pytest.raises(Exception, match="output_size"):
        torch.onnx.export(torch.export.export(model, (x,)), dynamo=True, optimize=False)
    program = torch.export.export(model, (x,))
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    assert sum(fx_fixes.repeat_interleave_without_output_size(program.graph_module, n) for n in nodes) == 1
    proto = torch.onnx.export(program, dynamo=True, optimize=False).model_proto.SerializeToString()
    (got,) = ort.InferenceSession(proto).run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), model(x), atol=0, rtol=0)


class _NoRotaryKeys(torch.nn.Module):
    """``k_rot.view(batch, 1, seq, 0)`` of an attention layer without a rotary part (GLM-5-Next's DSA)."""

    def forward(self, x: torch.Tensor, rot: torch.Tensor):
        batch, seq = x.shape[:2]
        rot = rot.view(batch, 1, seq, 0)
        return x * 2, torch.cat([rot, rot], dim=2)


def test_reshape_to_a_zero_size_tensor_runs_in_onnxruntime_with_the_fix():
    """issue 28: GLM-5-Next's ONNX decode was refused by onnxruntime (Reshape: Invalid Target shape
    product of 0. Product cannot be 0 in combination with -1): the optimizer's MaterializeReshapeShape
    wrote -1 for the batch next to the zero rotary width (onnxruntime#9940)."""
    import onnxruntime as ort

    from hfexport_onnx.workarounds import patches

    name = f"{patches.__name__}.reshape_to_zero_size_keeps_its_computed_shape"
    assert name in {e.name for e in registry.entries("onnx", kind="patch")}
    x, rot = torch.randn(2, 1, 4), torch.randn(2, 1, 0)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(_NoRotaryKeys(), (x, rot), dynamic_shapes=({0: batch}, {0: batch}))

    def session():
        proto = torch.onnx.export(program, dynamo=True, optimize=True).model_proto.SerializeToString()
        return ort.InferenceSession(proto)

    with pytest.raises(Exception, match="Product cannot be 0 in combination with -1"):
        session()
    with registry.apply_patches("onnx"):
        runner = session()
    for rows in (2, 3):
        feeds = {"x": torch.randn(rows, 1, 4).numpy(), "rot": torch.randn(rows, 1, 0).numpy()}
        doubled, keys = runner.run(None, feeds)
        assert keys.shape == (rows, 1, 2, 0)
        torch.testing.assert_close(torch.from_numpy(doubled), torch.from_numpy(feeds["x"]) * 2)
