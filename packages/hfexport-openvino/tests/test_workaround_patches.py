"""The OpenVINO backend's capture patches (:mod:`hfexport_openvino.workarounds.patches`, issue 28):
cheap captures of the patched methods alone, no conversion."""

from __future__ import annotations

import importlib

import pytest
import torch

from hfexport.registry import apply_patches
from hfexport_openvino.workarounds.patches import REFERENCE_GRID_TARGETS, reference_points


def _owner(path: str) -> type:
    module, cls, _ = path.rsplit(".", 2)
    return getattr(importlib.import_module(module), cls)


class _Grid(torch.nn.Module):
    """The encoder's call: the reference grid of two feature levels whose sides are derived from the
    input's (as a backbone's strided outputs are: the sizes are symbolic expressions, not bare symbols)."""

    def __init__(self, owner: type) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, features: torch.Tensor, valid_ratios: torch.Tensor) -> torch.Tensor:
        h, w = torch.nn.functional.avg_pool2d(features, 2, ceil_mode=True).shape[-2:]
        return self.owner.get_reference_points(
            [(h, w), (h // 2, w // 2)], valid_ratios, device=features.device
        )


def _sym_float_nodes(owner: type) -> list[str]:
    features, ratios = torch.zeros(1, 1, 8, 6), torch.full((2, 2, 2), 0.75)
    dims = {2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO}
    program = torch.export.export(_Grid(owner), (features, ratios), dynamic_shapes=(dims, None), strict=False)
    program = program.run_decompositions()  # linspace decomposes into float arithmetic on the symbol
    return [n.name for n in program.graph.nodes if n.op == "call_function" and "sym_float" in str(n.target)]


@pytest.mark.parametrize("path", REFERENCE_GRID_TARGETS, ids=lambda p: p.split(".")[2])
def test_reference_grid_equals_upstream_values(path):
    ratios = torch.tensor([[[1.0, 0.75], [0.5, 1.0], [0.8, 0.9]], [[0.6, 1.0], [1.0, 1.0], [0.7, 0.5]]])
    shapes = [(7, 5), (4, 3), (1, 2)]
    expected = _owner(path).get_reference_points(shapes, ratios, "cpu")
    assert expected.shape == (2, 7 * 5 + 4 * 3 + 1 * 2, 3, 2)
    assert torch.equal(reference_points(shapes, ratios, "cpu"), expected)  # bit for bit in float32


def test_reference_grid_leaves_no_sym_float_for_the_frontend():
    """Without the patch the captured grid holds sym_float nodes (linspace's end, size - 0.5), which
    OpenVINO's FX frontend refused: deformable_detr 'failed FX node(s): sym_float' in the zoo sweep."""
    owner = _owner(REFERENCE_GRID_TARGETS[0])
    assert _sym_float_nodes(owner)
    with apply_patches("openvino"):
        assert _sym_float_nodes(owner) == []
    assert _sym_float_nodes(owner)  # the original is back


class _GroupedQueryAttention(torch.nn.Module):
    """transformers' SDPA integration over 4 query heads and 2 key/value heads, no mask (LFM3-VL's
    vision encoder)."""

    is_causal = False
    num_key_value_groups = 2

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(32, 32)
        self.kv = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        length = x.shape[1]
        q = self.q(x).view(1, length, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(1, length, 2, 16).transpose(1, 2).split(8, dim=-1)
        out, _ = sdpa_attention_forward(self, q, k.contiguous(), v.contiguous(), None, scaling=8**-0.5)
        return out.reshape(1, length, 32)


def _sdpa_kwargs(program: torch.export.ExportedProgram) -> list[dict]:
    return [dict(n.kwargs) for n in program.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


def test_grouped_query_attention_is_captured_with_repeated_heads():
    # enable_gqa=True SDPA: the OpenVINO CPU plugin's snippet failed LFM3-VL's vision encoder at run
    # time ("Incompatible MatMul batch dimension. Can't merge dim 4 with dim 2")
    torch.manual_seed(0)
    model, x = _GroupedQueryAttention().eval(), torch.randn(1, 16, 32)
    plain = torch.export.export(model, (x,), strict=False)
    assert [k.get("enable_gqa") for k in _sdpa_kwargs(plain)] == [True]
    with apply_patches("openvino"):
        patched = torch.export.export(model, (x,), strict=False)
    assert [k.get("enable_gqa", False) for k in _sdpa_kwargs(patched)] == [False]
    x2 = torch.randn(1, 16, 32)
    torch.testing.assert_close(patched.module()(x2), model(x2), rtol=1e-5, atol=1e-6)


class _ItemSizedView(torch.nn.Module):
    """A size read out of an int32 tensor (MiniMax-M3-VL's per-image patch counts from its grid)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n = counts[0].item()
        torch._check(n * 4 == x.shape[1])
        return x.view(2, n, 4) * 2.0


def test_scalar_sizes_are_read_from_int64_tensors():
    # OpenVINO kept the int32 element type of such a size, and MiniMax-M3-VL's image encoder failed
    # to convert ("failed FX node(s): view_13 (aten.view.default)": an i32 size among i64 constants)
    from hfexport.registry import apply_fx_node_fixes

    x, counts = torch.randn(2, 12), torch.tensor([3], dtype=torch.int32)
    program = torch.export.export(_ItemSizedView(), (x, counts), strict=False).run_decompositions()
    applied = apply_fx_node_fixes("openvino", program.graph_module)
    assert "hfexport_openvino.workarounds.fx_fixes.scalar_sizes_from_int64" in applied
    (item,) = [n for n in program.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    assert item.args[0].target is torch.ops.aten._to_copy.default
    assert item.args[0].meta["val"].dtype == torch.int64
    torch.testing.assert_close(program.module()(x, counts), x.view(2, 3, 4) * 2.0)


def test_speech_to_text_frame_lengths_equal_upstream_values():
    from types import SimpleNamespace

    from transformers.models.speech_to_text.modeling_speech_to_text import Speech2TextPreTrainedModel

    from hfexport import registry
    from hfexport_openvino.workarounds import patches

    lengths = torch.arange(0, 6000)
    for layers in (1, 2, 3):
        owner = SimpleNamespace(config=SimpleNamespace(num_conv_layers=layers))  # what the method reads
        expected = Speech2TextPreTrainedModel._get_feat_extract_output_lengths(owner, lengths)
        got = patches.speech_to_text_frame_lengths(lengths, layers)
        assert got.dtype == torch.int64 and torch.equal(got, expected), layers
        with apply_patches(patches.BACKEND):
            assert torch.equal(
                Speech2TextPreTrainedModel._get_feat_extract_output_lengths(owner, lengths), expected
            )
            assert Speech2TextPreTrainedModel._get_feat_extract_output_lengths(owner, 32) == 32 // 2**layers
    entry = next(
        e
        for e in registry.entries(patches.BACKEND, kind="patch")
        if e.name.endswith("speech_to_text_lengths_by_float_floor")
    )
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved


class _FrameCounts(torch.nn.Module):
    """Speech2Text's encoder call: frame counts of a [batch, features] mask (two convolutions)."""

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        from types import SimpleNamespace

        from transformers.models.speech_to_text.modeling_speech_to_text import Speech2TextPreTrainedModel

        owner = SimpleNamespace(config=SimpleNamespace(num_conv_layers=2))
        return Speech2TextPreTrainedModel._get_feat_extract_output_lengths(owner, attention_mask.sum(-1))


def test_speech_to_text_frame_counts_converted_equal_eager():
    """issue 28: without the patch the converted program gives [9, 6, 1, 1] (Speech2Text's OpenVINO
    export failed validation on the sample: the encoder output 4.6 off eager)."""
    import openvino as ov

    from hfexport_openvino.workarounds import patches

    mask = torch.zeros(4, 32, dtype=torch.long)
    for row, count in enumerate((32, 20, 1, 0)):
        mask[row, :count] = 1
    dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    with apply_patches(patches.BACKEND):
        program = torch.export.export(_FrameCounts(), (mask[:2],), dynamic_shapes=dims, strict=False)
    compiled = ov.compile_model(ov.convert_model(program), "CPU")
    assert compiled(mask.numpy())[0].tolist() == _FrameCounts()(mask).tolist() == [8, 5, 1, 0]


@pytest.mark.extended  # a capture, a conversion and three runs: about 40 s on a loaded machine
def test_chunked_gated_delta_rule_converts_as_a_loop_and_serves_any_chunk_count():
    """Qwen3.5's loop over chunks, unrolled by capture, bounded the program to the sample's chunk count
    (and GLM-5-Next's, the same loop, failed its second shape); the frontend converts no scan op, so
    OpenVINO takes the while-loop form: an OpenVINO Loop over a symbolic chunk count."""
    import openvino as ov
    from torch.export import Dim
    from transformers.models.qwen3_5 import modeling_qwen3_5

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            # the module's function at call time (the patch replaces it); chunks of 4, the models use 64
            fn = modeling_qwen3_5.torch_chunk_gated_delta_rule
            return fn(
                q, k, v, g=g, beta=beta, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True
            )

    def sample(length):
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, length, 2, 4, generator=gen) for _ in range(3))
        return q, k, v, -torch.rand(1, length, 2, generator=gen), torch.rand(1, length, 2, generator=gen)

    length = Dim("length", min=2, max=512)
    with apply_patches("openvino"):
        assert modeling_qwen3_5.torch_chunk_gated_delta_rule is not original
        program = torch.export.export(Attention(), sample(3), dynamic_shapes=({1: length},) * 5)
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is original  # restored after the capture
    targets = {getattr(n.target, "__name__", "") for n in program.graph.nodes if n.op == "call_function"}
    assert "while_loop" in targets and "scan" not in targets
    compiled = ov.compile_model(ov.convert_model(program), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    for n in (3, 5, 23):  # one chunk, two, six
        want, want_state = (
            t.numpy()
            for t in original(
                *sample(n)[:3],
                g=sample(n)[3],
                beta=sample(n)[4],
                chunk_size=4,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        )
        got = compiled([t.numpy() for t in sample(n)])
        assert got[0].shape == (1, n, 2, 4)
        assert abs(got[0] - want).max() <= 1e-5 and abs(got[1] - want_state).max() <= 1e-5, n
