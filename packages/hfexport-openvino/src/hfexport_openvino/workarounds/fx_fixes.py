"""Workarounds for OpenVINO conversion faults, applied to the captured program (key ``"openvino"``).

- :func:`drop_empty_cat_operands`: ``aten.cat`` operands that are 1-D empty tensors are removed.
  PyTorch keeps the legacy rule that such tensors are skipped whatever ``dim`` says (transformers'
  ``DynamicCache`` starts every layer as ``torch.tensor([])`` and concatenates the first keys onto
  it); OpenVINO's PyTorch frontend builds a ``Concat`` over all operands and fails
  ("Axis -2 out of the tensor rank range [-1, 0]").
- :func:`finite_sdpa_mask`: a boolean ``attn_mask`` of ``aten.scaled_dot_product_attention`` becomes
  a float mask with a finite minimum: OpenVINO returns NaN for a fully masked row (a left-padded
  position; openvino#35959) where PyTorch returns finite values, and the next layer spreads the
  NaN over the whole row.
- :func:`sym_min_max_as_tensor_ops`: ``torch.sym_min``/``sym_max`` on SymInts (the core's
  sliding-window capture workaround, mistral/gemma2) become ``aten.minimum``/``maximum`` over 0-d
  tensors: OpenVINO's FX frontend has no conversion rule for them; :func:`sym_mod_as_floordiv`
  writes Python's ``%`` on SymInts (chunk padding of linear-attention layers, Swin windows) as
  ``a - (a // b) * b``, which stays a SymInt expression through the frontend's retrace.
- :func:`sym_pow_as_products`: Python's ``**`` on a SymInt with a small integer exponent (sizes the
  decomposition of a symbolic ``matmul`` rebuilds from their sympy form, ``(h // 2) ** 2`` in
  MobileViT and Swin) becomes a chain of ``*``, which the frontend converts.
- :func:`complex_rotary_as_real_pairs` (program fix): complex-valued rotary embeddings
  (``torch.polar`` / ``view_as_complex``: deepseek_v2, llama4) become real (real, imaginary) pairs with
  the core's :func:`hfexport.workarounds.complex_pairs.complex_as_real_pairs`: the frontend has no
  conversion rule for ``aten.polar``.
- :func:`squeeze_static_unit_axes`: ``aten.squeeze`` without axes (mBART's and PLBart's
  ``shift_tokens_right``, ``gather(...).squeeze()`` on ``[batch, 1]``) names the axes the traced
  program squeezes, those of static size 1: OpenVINO's ``Squeeze`` also takes a dynamic axis as
  one that may be 1 and fails when it is not ("Can not clone with new dims").
- :func:`repeated_outputs_as_copies` (program fix): a node returned twice (Inkling's vision model's
  ``last_hidden_state`` and ``pooler_output``) is returned once and then multiplied by 1: the
  frontend fails on a repeated output ("Tensor name is not a number").
- :func:`unfold_as_gather`: ``aten.unfold`` (patchtst / patchtsmixer patch extraction) becomes an
  ``index_select`` of the window positions, a view and a permute: the frontend has no rule for unfold.
- the core's dense mixture-of-experts forward (:mod:`hfexport.workarounds.moe`) for every
  implementation: OpenVINO has no conversion for ``torch._grouped_mm``, and the ``"eager"`` loop
  depends on the routing of the sample (``nonzero()``).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch

from hfexport.registry import register_fx_node_fix, register_fx_program_fix
from hfexport.workarounds.fourier import register_real_fourier_mixing
from hfexport.workarounds.fx_nodes import cat_result_size, insert_call
from hfexport.workarounds.moe import register_dense_experts
from hfexport.workarounds.recurrences import register_chunk_loops, register_recurrences
from hfexport.workarounds.text_to_audio import register_bernoulli_as_uniform, register_normal_from_uniform
from hfexport.workarounds.time_series import register_lgamma_elementary, register_real_autocorrelation

__all__ = [
    "BACKEND",
    "antialiased_bilinear_as_matmuls",
    "complex_rotary_as_real_pairs",
    "drop_empty_cat_operands",
    "empty_cat_as_zeros",
    "finite_sdpa_mask",
    "index_add_as_scatter_add",
    "repeated_outputs_as_copies",
    "scalar_sizes_from_int64",
    "squeeze_static_unit_axes",
    "sym_min_max_as_tensor_ops",
    "sym_mod_as_floordiv",
    "sym_pow_as_products",
    "unfold_as_gather",
    "view_sizes_without_inferred_static_axis",
]

#: Registry key of this backend's workarounds.
BACKEND = "openvino"


def _is_legacy_empty(value: Any) -> bool:
    val = getattr(value, "meta", {}).get("val") if isinstance(value, torch.fx.Node) else value
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 1
        and isinstance(val.shape[0], int)
        and val.shape[0] == 0
    )


@register_fx_node_fix(
    BACKEND,
    description=(
        "drop 1-D empty operands of aten.cat (PyTorch's legacy skip rule, hit by DynamicCache's lazy "
        "torch.tensor([]) layers), which OpenVINO's Concat rejects as an axis out of range"
    ),
    issue="https://github.com/pytorch/pytorch/issues/185535",
    versions={"openvino": ">=2026.0"},
)
def drop_empty_cat_operands(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.cat([empty_1d, x, ...], dim)`` as ``aten.cat([x, ...], dim)``.

    Only operands whose traced value is exactly 1-D with 0 elements are dropped, and only when
    another operand has more dimensions (PyTorch skips exactly those). Returns True when the node
    was rewritten.
    """
    if node.target is not torch.ops.aten.cat.default or not node.args:
        return False
    operands = node.args[0]
    if not isinstance(operands, (list, tuple)):
        return False
    kept = [x for x in operands if not _is_legacy_empty(x)]
    if len(kept) == len(operands) or not kept:
        return False
    if not any(getattr(x, "meta", {}).get("val", torch.empty(0)).dim() > 1 for x in kept):
        return False
    node.args = (kept, *node.args[1:])
    return True


@register_fx_node_fix(
    BACKEND,
    description=(
        "an aten.cat whose result has no elements at any size (a static 0 on an axis other than the joined one: "
        "GLM-5-Next's indexed attention caches values of width 0) becomes aten.zeros of its size: OpenVINO's "
        "Concat leaves out the inputs with no elements, so the joined axis came out short (the decode step's "
        "cache.layers.1.values 1x1x12x0 for eager's 1x1x13x0)"
    ),
    # no OpenVINO issue filed yet; reproduces with openvino 2026.4.1 (cat([zeros(1,1,12,0), zeros(1,1,1,0)], 2))
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/core/src/op/concat.cpp",
    versions={"openvino": ">=2026.0"},
)
def empty_cat_as_zeros(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.cat(tensors, dim)`` whose traced result has a static size 0 on an axis other than
    ``dim`` by ``aten.zeros`` of the result's size.

    Such a result holds no elements at any size of its symbols, so only its shape is observable;
    the size along ``dim`` is the sum of the operands' (read with ``aten.sym_size.int`` where
    symbolic), the other sizes the first operand's. Operands of another rank (PyTorch's legacy 1-D
    empty operands) leave the node alone. The values are unchanged (there are none).

    Returns:
        True when the node was replaced.
    """
    if node.target is not torch.ops.aten.cat.default or not node.args:
        return False
    operands = node.args[0]
    out = node.meta.get("val")
    if not isinstance(operands, (list, tuple)) or not operands or not isinstance(out, torch.Tensor):
        return False
    rank = out.dim()
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = dim % rank if rank else 0
    if not any(
        isinstance(out.shape[axis], int) and out.shape[axis] == 0 for axis in range(rank) if axis != dim
    ):
        return False
    vals = [x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in operands]
    if any(not isinstance(v, torch.Tensor) or v.dim() != rank for v in vals):
        return False
    graph = gm.graph
    fake_mode = getattr(out, "fake_mode", None)
    with graph.inserting_before(node):
        shape = cat_result_size(graph, operands, vals, dim, out.shape)
        zeros = graph.call_function(
            torch.ops.aten.zeros.default, (shape,), {"dtype": out.dtype, "device": out.device}
        )
        sizes = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in shape]
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            zeros.meta["val"] = torch.zeros(sizes, dtype=out.dtype, device=out.device)
    node.replace_all_uses_with(zeros)
    graph.erase_node(node)
    return True


_NARROW_INTEGERS = (torch.int32, torch.int16, torch.int8, torch.uint8)


@register_fx_node_fix(
    BACKEND,
    description=(
        "read a symbolic size out of an int64 tensor: aten._local_scalar_dense (tensor.item() / tolist()) "
        "of an int32 tensor (MiniMax-M3-VL's per-image patch counts from grid_thw) becomes an i32 element "
        "of a shape list whose other elements are i64, and OpenVINO's SequenceMark concat refuses to merge "
        "the element types (failed FX node(s): aten.view.default)"
    ),
    # no upstream issue filed yet; reproduces with openvino 2026.4.1's torch.export frontend
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/core/src/op/concat.cpp",
    versions={"openvino": ">=2026.0"},
)
def scalar_sizes_from_int64(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Insert ``aten._to_copy(x, dtype=int64)`` before ``aten._local_scalar_dense(x)`` when ``x``
    is a narrower integer tensor.

    The scalar is a Python int (a ``SymInt``) in the program either way; only OpenVINO's frontend
    keeps the tensor's element type for it, and a ``view`` whose size list mixes it with int64
    constants fails to convert. The cast changes no value (every int32 fits in int64).

    Returns:
        True when the cast was inserted.
    """
    if node.target is not torch.ops.aten._local_scalar_dense.default or not node.args:
        return False
    source = node.args[0]
    val = getattr(source, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _NARROW_INTEGERS:
        return False
    with gm.graph.inserting_before(node):
        cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (source,), {"dtype": torch.int64})
    cast.meta = {k: v for k, v in source.meta.items() if k != "val"}
    cast.meta["val"] = val.to(torch.int64)
    node.args = (cast, *node.args[1:])
    return True


@register_fx_node_fix(
    BACKEND,
    description=(
        "aten.index_add (Kimi-K2.5's temporal merge of the vision tower's patches) as aten.scatter_add with "
        "the index expanded over the source's other axes: the torch.export frontend has no rule for index_add "
        "(failed FX node(s): index_add)"
    ),
    issue="https://github.com/openvinotoolkit/openvino/issues/35628",
    versions={"openvino": ">=2026.0"},
)
def index_add_as_scatter_add(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.index_add(x, dim, index, source, alpha=1)`` by
    ``aten.scatter_add(x, dim, index', source)``, ``index'`` the 1-D ``index`` placed on axis
    ``dim`` and expanded to ``source``'s shape (the same sums: each ``source`` slice ``i`` along
    ``dim`` is added at ``x``'s slice ``index[i]``).

    Only for a static ``source`` shape and ``alpha`` 1 (the one-grid image encoders of issue 28
    have both); other nodes are left to the frontend.

    Returns:
        True when the node was replaced.
    """
    if node.target is not torch.ops.aten.index_add.default or len(node.args) < 4:
        return False
    if node.kwargs.get("alpha", 1) != 1 or (len(node.args) > 4 and node.args[4] != 1):
        return False
    base, dim, index, source = node.args[:4]
    source_val = getattr(source, "meta", {}).get("val")
    index_val = getattr(index, "meta", {}).get("val")
    if not isinstance(source_val, torch.Tensor) or not isinstance(index_val, torch.Tensor):
        return False
    shape = list(source_val.shape)
    if not all(isinstance(n, int) for n in shape) or index_val.dim() != 1:
        return False
    axis = int(dim) % len(shape)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    graph = gm.graph
    with graph.inserting_before(node):
        placed = graph.call_function(torch.ops.aten.view.default, (index, view))
        placed.meta["val"] = index_val.view(view)
        expanded = graph.call_function(torch.ops.aten.expand.default, (placed, shape))
        expanded.meta["val"] = placed.meta["val"].expand(shape)
        scatter = graph.call_function(torch.ops.aten.scatter_add.default, (base, axis, expanded, source))
    scatter.meta = dict(node.meta)
    node.replace_all_uses_with(scatter)
    graph.erase_node(node)
    return True


def _call(graph: torch.fx.Graph, fake_mode: Any, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new ``call_function`` node with its ``meta["val"]`` computed under ``fake_mode``."""
    node = graph.call_function(target, args, kwargs)

    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    with fake_mode:
        node.meta["val"] = target(*[val(a) for a in args], **{k: val(v) for k, v in kwargs.items()})
    return node


def _resize_weights(graph: torch.fx.Graph, fake_mode: Any, size_in: int, size_out: int) -> torch.fx.Node:
    """``[size_out, size_in]`` float32: the rows of an antialiased bilinear resize (half-pixel
    centres), each a triangle filter widened by the downscale factor, normalised to sum 1."""
    scale = size_in / size_out
    widen = 1 / scale if scale >= 1 else 1.0
    source = _call(graph, fake_mode, torch.ops.aten.arange.default, size_in, dtype=torch.float32)
    target = _call(graph, fake_mode, torch.ops.aten.arange.default, size_out, dtype=torch.float32)
    centre = _call(
        graph,
        fake_mode,
        torch.ops.aten.mul.Tensor,
        _call(graph, fake_mode, torch.ops.aten.add.Tensor, target, 0.5),
        scale,
    )
    offset = _call(
        graph,
        fake_mode,
        torch.ops.aten.sub.Tensor,
        _call(
            graph,
            fake_mode,
            torch.ops.aten.unsqueeze.default,
            _call(graph, fake_mode, torch.ops.aten.add.Tensor, source, 0.5),
            0,
        ),
        _call(graph, fake_mode, torch.ops.aten.unsqueeze.default, centre, 1),
    )
    distance = _call(
        graph,
        fake_mode,
        torch.ops.aten.mul.Tensor,
        _call(graph, fake_mode, torch.ops.aten.abs.default, offset),
        widen,
    )
    triangle = _call(
        graph,
        fake_mode,
        torch.ops.aten.clamp_min.default,
        _call(graph, fake_mode, torch.ops.aten.rsub.Scalar, distance, 1.0),
        0.0,
    )
    total = _call(graph, fake_mode, torch.ops.aten.sum.dim_IntList, triangle, [1], True)
    return _call(graph, fake_mode, torch.ops.aten.div.Tensor, triangle, total)


@register_fx_node_fix(
    BACKEND,
    description=(
        "aten._upsample_bilinear2d_aa of a static size (Cosmos3-Edge's learned position grid resized to its one "
        "patch grid) as two matrix products with the antialiased bilinear weights: the torch.export frontend has no "
        "rule for it (failed FX node(s): _upsample_bilinear2d_aa)"
    ),
    # the TorchScript frontend has the rule (openvino#18617); the torch.export frontend's table lacks it
    issue="https://github.com/openvinotoolkit/openvino/pull/18617",
    versions={"openvino": ">=2026.0"},
)
def antialiased_bilinear_as_matmuls(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten._upsample_bilinear2d_aa(x, [h_out, w_out], align_corners=False)`` of a
    static ``[n, c, h, w]`` input by ``W_h @ x @ W_w^T``.

    The antialiased resize is separable: each output row (column) is a normalised triangle-filter
    average of the input rows (columns) around its half-pixel centre, the filter widened by the
    scale when shrinking (:func:`_resize_weights`, equal to PyTorch's to float32 rounding). Only
    for ``align_corners=False`` without explicit scales and static sizes; other nodes are left to
    the frontend.

    Returns:
        True when the node was replaced.
    """
    if node.target is not torch.ops.aten._upsample_bilinear2d_aa.default or len(node.args) < 3:
        return False
    x, size, align = node.args[:3]
    scales = [a for a in node.args[3:] if a is not None] + [v for v in node.kwargs.values() if v is not None]
    value = getattr(x, "meta", {}).get("val")
    if align or scales or not isinstance(value, torch.Tensor) or value.dim() != 4:
        return False
    sizes = [*value.shape[2:], *size]
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is None or not all(isinstance(n, int) for n in sizes) or value.dtype != torch.float32:
        return False
    n, c, h, w = value.shape
    h_out, w_out = sizes[2], sizes[3]
    aten = torch.ops.aten
    graph = gm.graph
    with graph.inserting_before(node):
        rows = _resize_weights(graph, fake_mode, h, h_out)
        columns = _resize_weights(graph, fake_mode, w, w_out)

        def flat(t: torch.fx.Node, order: list[int], shape: list[int]) -> torch.fx.Node:
            moved = _call(graph, fake_mode, aten.permute.default, t, order)
            dense = _call(graph, fake_mode, aten.clone.default, moved, memory_format=torch.contiguous_format)
            return _call(graph, fake_mode, aten.view.default, dense, shape)

        # 2-D products (aten.mm): the frontend refused aten.matmul of these operands
        tall = _call(graph, fake_mode, aten.mm.default, rows, flat(x, [2, 0, 1, 3], [h, n * c * w]))
        back = flat(tall, [1, 0], [n * c * w, h_out])  # rows of (n, c, w), columns h_out
        back = flat(
            _call(graph, fake_mode, aten.view.default, back, [n, c, w, h_out]),
            [0, 1, 3, 2],
            [n * c * h_out, w],
        )
        wide = _call(
            graph,
            fake_mode,
            aten.mm.default,
            back,
            _call(graph, fake_mode, aten.permute.default, columns, [1, 0]),
        )
        out = _call(graph, fake_mode, aten.view.default, wide, [n, c, h_out, w_out])
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


# OpenVINO converts no torch._grouped_mm; the "eager" loop specialises on the sample routing
register_dense_experts(BACKEND, every_implementation=True)

# Recurrences (mamba selective scan, RWKV time mixing, RG-LRU): the loop-free chunked form instead of a
# per-token loop that capture unrolls (issue 28)
register_recurrences(BACKEND, form="chunked")
# GLM-5-Next's and Qwen3.5's loops over 64-token chunks: torch's while-loop op, which the frontend converts into a
# Loop (it has no rule for the scan op the other backends take), instead of a loop that capture unrolls
register_chunk_loops(
    BACKEND,
    form="loop",
    issue_override="https://github.com/openvinotoolkit/openvino/pull/33173",
    runtime_versions={"openvino": ">=2026.0"},
)

# torch.lgamma (StudentT log_prob of the forecasters' loss, issue 28) from elementary operations:
# the frontend has no conversion rule for aten.lgamma
register_lgamma_elementary(BACKEND)
# autoformer's FFT auto-correlation (issue 28) as real DFT matrix products: the torch.export frontend has
# no rule for aten._fft_r2c / aten._conj / aten._fft_c2r (the TorchScript frontend's fft rules, the issue,
# were not carried over)
register_real_autocorrelation(
    BACKEND,
    issue="https://github.com/openvinotoolkit/openvino/issues/21665",
    versions={"openvino": ">=2026.0"},
)
# SpeechT5's eval-mode prenet dropout and VITS's noise (issue 28): the torch.export frontend has no rule for
# aten.bernoulli.p, aten.randn or aten.randn_like ("failed FX node(s): bernoulli (aten.bernoulli.p)"), one
# for aten.rand; no upstream issue filed yet
register_bernoulli_as_uniform(
    BACKEND,
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
register_normal_from_uniform(
    BACKEND,
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)

# fnet's token mixing fftn(x, dim=(1, 2)).real (issue 28) as cosine/sine matrix products: same missing
# aten._fft_c2c / aten.view_as_real rules as above
register_real_fourier_mixing(
    BACKEND,
    issue="https://github.com/openvinotoolkit/openvino/issues/21665",
    versions={"openvino": ">=2026.0"},
)

_SDPA = (torch.ops.aten.scaled_dot_product_attention.default,)


@register_fx_node_fix(
    BACKEND,
    description=(
        "give scaled_dot_product_attention a float mask with a finite minimum instead of a boolean one: "
        "OpenVINO's SDPA turns a fully masked row (a left-padded position) into NaN, which the next "
        "layer spreads to every position of the row (0 * NaN); PyTorch returns finite values there"
    ),
    issue="https://github.com/openvinotoolkit/openvino/issues/35959",
    versions={"openvino": ">=2026.0"},
)
def finite_sdpa_mask(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite a boolean ``attn_mask`` of ``aten.scaled_dot_product_attention`` as ``(1 - mask) * finfo.min``.

    Allowed positions get 0, masked ones the most negative finite value of the query's dtype, so a
    row with every position masked gets uniform weights (finite) instead of NaN. Returns True when
    the node was rewritten.
    """
    if node.target not in _SDPA:
        return False
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if len(args) > 3:
        mask, where = args[3], "arg"
    else:
        mask, where = kwargs.get("attn_mask"), "kwarg"
    mask_val = getattr(mask, "meta", {}).get("val") if isinstance(mask, torch.fx.Node) else None
    query_val = getattr(args[0], "meta", {}).get("val") if isinstance(args[0], torch.fx.Node) else None
    if mask_val is None or query_val is None or mask_val.dtype != torch.bool:
        return False
    dtype = query_val.dtype
    lowest = torch.finfo(dtype).min
    graph = node.graph
    with graph.inserting_before(node):
        as_float = graph.call_function(torch.ops.aten._to_copy.default, (mask,), {"dtype": dtype})
        inverted = graph.call_function(torch.ops.aten.rsub.Scalar, (as_float, 1.0))
        float_mask = graph.call_function(torch.ops.aten.mul.Scalar, (inverted, lowest))
    fake_mode = getattr(mask_val, "fake_mode", None)
    if fake_mode is not None:
        with fake_mode:
            as_float.meta["val"] = mask_val.to(dtype)
            inverted.meta["val"] = 1.0 - as_float.meta["val"]
            float_mask.meta["val"] = inverted.meta["val"] * lowest
    if where == "arg":
        args[3] = float_mask
    else:
        kwargs["attn_mask"] = float_mask
    node.args, node.kwargs = tuple(args), kwargs
    return True


_SYM_MIN_MAX = {torch.sym_min: torch.ops.aten.minimum.default, torch.sym_max: torch.ops.aten.maximum.default}


@register_fx_node_fix(
    BACKEND,
    description=(
        "compute torch.sym_min/sym_max on SymInts (the core's sliding-window capture workaround, shapes "
        "with Min/Max) as aten.minimum/maximum over 0-d tensors: OpenVINO's FX frontend converts add, "
        "sub, mul and floordiv on SymInts but has no rule for sym_min/sym_max"
    ),
    # no upstream issue filed yet; the missing rules are visible in the frontend's op table
    # (openvino/frontend/pytorch/torchdynamo/op_support.py, 2026.3-2026.4)
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
def sym_min_max_as_tensor_ops(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``torch.sym_min(a, b)`` (or ``sym_max``) on SymInts as
    ``aten._local_scalar_dense(aten.minimum(aten.scalar_tensor(a), aten.scalar_tensor(b)))``.

    Same integer value; OpenVINO converts every one of those ops. Returns True when the node was
    rewritten (its users read the new scalar).
    """
    tensor_op = _SYM_MIN_MAX.get(node.target)
    if tensor_op is None or node.op != "call_function" or len(node.args) != 2:
        return False
    _as_tensor_op(node, tensor_op)
    return True


def _as_tensor_op(node: torch.fx.Node, tensor_op: Any) -> None:
    """Replace the SymInt call ``node(a, b)`` by ``_local_scalar_dense(tensor_op(scalar_tensor(a),
    scalar_tensor(b)))`` over 0-d int64 tensors (same integer value)."""
    graph = node.graph
    with graph.inserting_before(node):
        operands = [
            graph.call_function(torch.ops.aten.scalar_tensor.default, (arg,), {"dtype": torch.int64})
            for arg in node.args
        ]
        combined = graph.call_function(tensor_op, tuple(operands))
        scalar = graph.call_function(torch.ops.aten._local_scalar_dense.default, (combined,))
    value = node.meta.get("val")
    for new in (*operands, combined):
        new.meta["val"] = torch.empty((), dtype=torch.int64)  # a 0-d int64 tensor; value known at run time
    if value is not None:
        scalar.meta["val"] = value
    node.replace_all_uses_with(scalar)
    graph.erase_node(node)


@register_fx_node_fix(
    BACKEND,
    description=(
        "compute Python's % on SymInts (chunked linear-attention layers and Swin windows pad a length to a "
        "multiple: (chunk - length % chunk) % chunk) as a - (a // b) * b: OpenVINO's FX frontend has no rule "
        "for operator.mod but converts floordiv, mul and sub"
    ),
    # no upstream issue filed yet; the missing rule is visible in the frontend's op table
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
def sym_mod_as_floordiv(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``a % b`` on SymInts as ``a - (a // b) * b``.

    Python's ``//`` floors, so this is Python's ``%`` for every sign of ``a`` and ``b`` (the
    remainder takes the divisor's sign). The result stays a SymInt expression: unlike a detour
    through a tensor and ``.item()``, the frontend's retrace (``run_decompositions``) keeps it
    backed, so no data-dependent guard appears. Returns True when the node was rewritten.
    """
    if node.op != "call_function" or node.target is not operator.mod or len(node.args) != 2:
        return False
    if not any(isinstance(getattr(a, "meta", {}).get("val"), torch.SymInt) for a in node.args):
        return False
    a, b = node.args
    graph = node.graph
    value = node.meta.get("val")
    with graph.inserting_before(node):
        quotient = graph.call_function(operator.floordiv, (a, b))
        product = graph.call_function(operator.mul, (quotient, b))
        remainder = graph.call_function(operator.sub, (a, product))
    a_val = a.meta["val"] if isinstance(a, torch.fx.Node) else a
    b_val = b.meta["val"] if isinstance(b, torch.fx.Node) else b
    quotient.meta["val"] = a_val // b_val
    product.meta["val"] = quotient.meta["val"] * b_val
    remainder.meta["val"] = value
    node.replace_all_uses_with(remainder)
    graph.erase_node(node)
    return True


#: the largest integer exponent written out as products (larger ones go through aten.pow)
_MAX_PRODUCT_EXPONENT = 16


@register_fx_node_fix(
    BACKEND,
    description=(
        "compute Python's ** on a SymInt with a small integer exponent as a chain of *: the decomposition "
        "of a matmul over symbolic axes rebuilds sizes such as (h // 2) ** 2 from their sympy form "
        "(MobileViT, Swin windows), and OpenVINO's FX frontend has no rule for operator.pow"
    ),
    # no upstream issue filed yet; the missing rule is visible in the frontend's op table
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
def sym_pow_as_products(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``a ** k`` (``a`` a SymInt node, ``k`` an int in 1..16) as ``a * a * ... * a``, and a
    larger or symbolic integer exponent as ``aten.pow`` over 0-d int64 tensors. Same integer value.
    Returns True when the node was rewritten; a float base or a negative exponent is left alone."""
    if node.op != "call_function" or node.target is not operator.pow or len(node.args) != 2:
        return False
    base, exponent = node.args
    if not isinstance(getattr(base, "meta", {}).get("val"), torch.SymInt):
        return False
    if isinstance(exponent, int) and 1 <= exponent <= _MAX_PRODUCT_EXPONENT:
        graph = node.graph
        product = base
        with graph.inserting_before(node):
            for _ in range(exponent - 1):
                product = graph.call_function(operator.mul, (product, base))
                product.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        return True
    exponent_val = (
        getattr(exponent, "meta", {}).get("val") if isinstance(exponent, torch.fx.Node) else exponent
    )
    if isinstance(exponent_val, (int, torch.SymInt)) and not (
        isinstance(exponent_val, int) and exponent_val < 0
    ):
        _as_tensor_op(node, torch.ops.aten.pow.Tensor_Tensor)
        return True
    return False


@register_fx_program_fix(
    BACKEND,
    description=(
        "rewrite complex-valued computation (torch.polar / view_as_complex rotary embeddings of deepseek_v2, "
        "llama4) into real (real, imaginary) pairs: OpenVINO's FX frontend has no conversion rule for "
        'aten.polar ("failed FX node(s): polar (aten.polar.default)")'
    ),
    # no upstream issue filed yet; aten.polar is missing from the frontend's op table
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
def complex_rotary_as_real_pairs(exported_program: torch.export.ExportedProgram) -> None:
    """Apply :func:`hfexport.workarounds.complex_pairs.complex_as_real_pairs` to the captured program,
    in place. All or nothing: a program with a complex operation the rewrite does not know keeps its
    complex values and fails in ``convert`` with the op named, as without this fix."""
    from hfexport.workarounds.complex_pairs import complex_as_real_pairs

    complex_as_real_pairs(exported_program)


@register_fx_node_fix(
    BACKEND,
    description=(
        "name the axes of an aten.squeeze without axes (the static size-1 axes the traced program drops): "
        "OpenVINO's Squeeze also drops a dynamic axis it takes as possibly 1, and fails at inference when it "
        "is not (mBART's shift_tokens_right on [batch, 1])"
    ),
    # Squeeze v0 takes a dynamic dimension as squeezable, unlike torch (the v15 spec adds allow_axis_skip)
    issue="https://github.com/openvinotoolkit/openvino/pull/26989",
    versions={"openvino": ">=2026.0"},
)
def squeeze_static_unit_axes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.squeeze.default(x)`` / ``aten.squeeze.dims(x, axes)`` as
    ``aten.squeeze.dims(x, unit_axes)``.

    ``unit_axes`` are the axes (of ``axes``, or all) of ``x``'s traced value whose size is the
    static int 1: the ones ``torch.export`` dropped (the node's traced output keeps every symbolic
    axis, which the program takes as never 1). The output shape is unchanged; a squeeze that drops
    no axis is removed (its uses take ``x``). Returns True when the node was rewritten; a node without traced values, whose input has no symbolic axis among the
    named ones (nothing to misread), or whose traced output rank disagrees is left alone.
    """
    if node.op != "call_function" or node.target not in (
        torch.ops.aten.squeeze.default,
        torch.ops.aten.squeeze.dims,
        torch.ops.aten.squeeze.dim,
    ):
        return False
    source = node.args[0] if node.args else None
    value = getattr(source, "meta", {}).get("val") if isinstance(source, torch.fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor) or value.dim() == 0:
        return False
    rank = value.dim()
    if node.target is torch.ops.aten.squeeze.default:
        named = list(range(rank))
    else:
        given = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        if not all(isinstance(a, int) for a in given):
            return False
        named = sorted({a % rank for a in given})
    if all(isinstance(value.shape[a], int) for a in named):
        return False
    axes = [a for a in named if isinstance(value.shape[a], int) and value.shape[a] == 1]
    if out.dim() != rank - len(axes):
        return False
    if not axes:  # nothing squeezed: an empty axes list would read as "every axis of size 1" again
        node.replace_all_uses_with(source)
        node.graph.erase_node(node)
        return True
    node.target = torch.ops.aten.squeeze.dims
    node.args = (source, axes)
    node.kwargs = {}
    return True


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


@register_fx_node_fix(
    BACKEND,
    description=(
        "write the static size of the -1 axis of a view / reshape whose other sizes are symbolic: OpenVINO's "
        "shape inference of GLM-5-Next's language model gave hyper-connection streams.view(batch, seq, -1) a "
        "last axis of 1, and convert failed a MatMul check (Incompatible MatMul matrix dimension ... 1 ... 256)"
    ),
    # no upstream issue filed yet; reproduces with openvino 2026.4.1 on GLM-5-Next's whole language model
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/core/shape_inference/include/reshape_shape_inference.hpp",
    versions={"openvino": ">=2026.0"},
)
def view_sizes_without_inferred_static_axis(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace the ``-1`` of ``aten.view(x, [..., -1, ...])`` (also ``reshape`` / ``_unsafe_view``) by
    the size torch.export traced for that axis, when it is a static int.

    The traced output already fixes that size, so the program is the same; OpenVINO then reshapes
    to explicit sizes instead of inferring one from a product of symbolic ones, which its MOC
    transformations got wrong on GLM-5-Next's language model (``hidden_streams.view(batch, seq, -1)``
    of its hyper-connections, ``[batch, seq, 4, 64] -> [batch, seq, 256]``, inferred ``[?, ?, 1]``).

    Returns:
        True when the node was rewritten; False for any other node, one without ``-1``, or one
        whose ``-1`` axis is symbolic in the traced output.
    """
    if node.op != "call_function" or node.target not in _VIEWS or len(node.args) < 2:
        return False
    sizes = node.args[1]
    out = node.meta.get("val")
    if not isinstance(sizes, (list, tuple)) or not isinstance(out, torch.Tensor) or len(sizes) != out.dim():
        return False
    where = [i for i, size in enumerate(sizes) if isinstance(size, int) and size == -1]
    if len(where) != 1 or not isinstance(out.shape[where[0]], int):
        return False
    fixed = list(sizes)
    fixed[where[0]] = int(out.shape[where[0]])
    node.args = (node.args[0], fixed, *node.args[2:])
    return True


_UNFOLD = (torch.ops.aten.unfold.default,)


@register_fx_node_fix(
    BACKEND,
    description=(
        "compute aten.unfold (patchtst / patchtsmixer patch extraction, sliding windows) as an index_select of "
        "the window positions, a view and a permute: OpenVINO's FX frontend has no conversion rule for unfold"
    ),
    # no upstream issue filed yet; aten.unfold is missing from the frontend's op table
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0"},
)
def unfold_as_gather(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.unfold(x, dim, size, step)`` as a gather of the windows.

    ``unfold`` returns every window of ``size`` steps taken every ``step`` along ``dim`` as a new
    last axis: ``[..., n, ..., size]`` with ``n = (length - size) // step + 1``. The rewrite picks
    the ``n * size`` positions ``window * step + offset`` with ``aten.index_select`` along ``dim``
    (no ``as_strided``), views them as ``[..., n, size, ...]`` and moves the ``size`` axis last
    with ``aten.permute``: the same values, which OpenVINO converts. Needs a static length
    along ``dim`` (a patch axis fixed by the model's context length); other axes may be
    symbolic (their sizes are read with ``aten.sym_size.int``). Returns True when the node was
    rewritten.
    """
    if node.op != "call_function" or node.target not in _UNFOLD or len(node.args) != 4:
        return False
    source, dim, size, step = node.args
    source_val = getattr(source, "meta", {}).get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(source_val, torch.Tensor) or not all(isinstance(v, int) for v in (dim, size, step)):
        return False
    rank = source_val.dim()
    dim = dim % rank if rank else 0
    length = source_val.shape[dim] if rank else 1
    if not isinstance(length, int) or size < 1 or step < 1 or size > length:
        return False
    windows = (length - size) // step + 1
    count = windows * size
    graph = node.graph
    with graph.inserting_before(node):
        index = graph.call_function(torch.ops.aten.arange.start_step, (0, count), {"dtype": torch.int64})
        # positions as an arithmetic of arange: window * step + offset for a flat i = window * size + offset
        window = graph.call_function(torch.ops.aten.floor_divide.default, (index, size))
        offset = graph.call_function(torch.ops.aten.remainder.Scalar, (index, size))
        start = graph.call_function(torch.ops.aten.mul.Scalar, (window, step))
        flat = graph.call_function(torch.ops.aten.add.Tensor, (start, offset))
        picked = graph.call_function(torch.ops.aten.index_select.default, (source, dim, flat))
        shape: list[Any] = []
        for axis in range(rank):
            if axis == dim:
                shape.extend([windows, size])
                continue
            extent = source_val.shape[axis]
            if isinstance(extent, int):
                shape.append(extent)
            else:
                sym = graph.call_function(torch.ops.aten.sym_size.int, (source, axis))
                sym.meta["val"] = extent
                shape.append(sym)
        viewed = graph.call_function(torch.ops.aten.view.default, (picked, shape))
        order = [axis for axis in range(rank + 1) if axis != dim + 1] + [dim + 1]
        moved = graph.call_function(torch.ops.aten.permute.default, (viewed, order))
    fake_mode = getattr(source_val, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        index.meta["val"] = torch.arange(0, count, dtype=torch.int64, device=source_val.device)
        window.meta["val"] = torch.floor_divide(index.meta["val"], size)
        offset.meta["val"] = torch.remainder(index.meta["val"], size)
        start.meta["val"] = window.meta["val"] * step
        flat.meta["val"] = start.meta["val"] + offset.meta["val"]
        picked.meta["val"] = torch.index_select(source_val, dim, flat.meta["val"])
        viewed.meta["val"] = picked.meta["val"].view(
            [s.meta["val"] if isinstance(s, torch.fx.Node) else s for s in shape]
        )
        moved.meta["val"] = viewed.meta["val"].permute(order)
    node.replace_all_uses_with(moved)
    graph.erase_node(node)
    return True


@register_fx_program_fix(
    BACKEND,
    description=(
        "return a repeated graph output the second time as its product by 1 (x & x for bool): OpenVINO's FX "
        "frontend fails on a node returned twice ('Check is_number(name) failed ... Tensor name is not a number: "
        "view:0'; a clone is dropped by the frontend and fails the same); Inkling's vision model returns one "
        "tensor as last_hidden_state and pooler_output"
    ),
    # no upstream issue found; openvino 2026.4.1 src/frontends/pytorch/src/translate_session.cpp:434
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/frontends/pytorch/src/translate_session.cpp",
    versions={"openvino": ">=2026.0"},
)
def repeated_outputs_as_copies(exported_program: torch.export.ExportedProgram) -> None:
    """Replace the second and later occurrences of a node among the program's outputs by a copy of
    its values (``x * 1``; ``x & x`` for a bool tensor), and point their output specs at them.

    A model output structure holding one tensor twice (``BaseModelOutputWithPooling(
    last_hidden_state=h, pooler_output=h)``: Inkling's vision model, issue 28) is captured as an
    output node listing the same FX node twice; OpenVINO 2026.4.1's FX frontend then fails in
    ``convert_model`` with ``Check 'is_number(name)' failed at translate_session.cpp:434 ... Tensor
    name is not a number: view:0``. ``aten.clone`` does not help: the frontend converts it to
    nothing, so both outputs are one tensor again. With the product each output is its own tensor,
    of the same values, shape and dtype; the flat output order and names are unchanged.
    """
    graph = exported_program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    specs = exported_program.graph_signature.output_specs
    seen: set[torch.fx.Node] = set()
    copies = 0
    for i, value in enumerate(values):
        if not isinstance(value, torch.fx.Node):
            continue
        if value in seen and isinstance(value.meta.get("val"), torch.Tensor):
            with graph.inserting_before(output):
                if value.meta["val"].dtype == torch.bool:
                    copy = insert_call(graph, torch.ops.aten.bitwise_and.Tensor, (value, value), like=value)
                else:
                    copy = insert_call(graph, torch.ops.aten.mul.Tensor, (value, 1), like=value)
            values[i] = copy
            if i < len(specs) and getattr(specs[i].arg, "name", None) == value.name:
                specs[i].arg.name = copy.name
            copies += 1
        seen.add(value)
    if copies:
        output.args = (tuple(values),)
        exported_program.graph_module.recompile()
