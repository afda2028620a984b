"""FX program and node fixes applied to the captured program before ExecuTorch lowering.

Each fix is registered with :mod:`hfexport.registry` under the ``"executorch"`` key (every
ExecuTorch backend) or a scoped key (``"executorch.xnnpack"``), names the upstream issue it works
around and the versions in which it is needed. The exporter applies them in its
``fx_program_fixes`` and ``fx_node_fixes`` stages.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any

import torch

from hfexport.registry import register_fx_node_fix, register_fx_program_fix
from hfexport.workarounds.assertions import drop_runtime_assertions
from hfexport.workarounds.fx_nodes import cat_result_size, insert_call
from hfexport_executorch import bounds

__all__ = [
    "BOUNDED_META_KEY",
    "BOUNDS_META_KEY",
    "GUARD_BOUNDED_META_KEY",
    "GUARD_BOUNDS_META_KEY",
    "bound_unbounded_dynamic_ranges",
    "bucketize_as_comparison_count",
    "complex_rotary_as_real_pairs",
    "contiguous_attention_outputs",
    "dynamic_empty_as_full",
    "embedding_bag_of_fixed_bags_as_gather_sum",
    "empty_cat_as_full",
    "layer_norm_in_float32",
    "left_crop_of_constant_pad_as_pad_and_slice",
    "quantized_embedding_without_padding_idx",
    "repeat_interleave_as_cumulative_count",
    "runtime_assertions_dropped_before_edge",
    "scatter_add_with_long_index",
    "sequence_bounds_from_input_guards",
    "sort_as_topk",
    "unit_lower_triangular_solve_as_matmuls",
]

logger = logging.getLogger(__name__)

#: ``ep.graph_module.meta`` key where the exporter leaves ``{symbol name: upper bound}`` for the
#: symbols that were captured without one (derived from the axis roles and the model config).
BOUNDS_META_KEY = "hfexport_executorch_bounds"
#: ``ep.graph_module.meta`` key where :func:`bound_unbounded_dynamic_ranges` records what it set.
BOUNDED_META_KEY = "hfexport_executorch_bounded"
#: ``ep.graph_module.meta`` key where the exporter leaves ``{symbol name: largest size}`` for the
#: symbols whose input guards refuse sizes their range still admits (a sequence axis of a forward
#: that loops over the sample's chunk count; ``hfexport.program_axes`` finds them at capture).
GUARD_BOUNDS_META_KEY = "hfexport_executorch_guard_bounds"
#: ``ep.graph_module.meta`` key where :func:`sequence_bounds_from_input_guards` records what it set.
GUARD_BOUNDED_META_KEY = "hfexport_executorch_guard_bounded"


@register_fx_program_fix(
    "executorch",
    description=(
        "erase runtime assertions (torch._check / transformers' torch_compilable_check) and the computation only "
        "they use before to_edge: ExecuTorch erases the assertions only in to_executorch, after the edge verifier "
        "has refused their condition (aten._is_all_true is not core ATen)"
    ),
    issue="https://github.com/pytorch/executorch/pull/1319",
    versions={"executorch": ">=1.3"},  # still needed on executorch 1.4.1 (exir/program/_program.py)
)
def runtime_assertions_dropped_before_edge(exported_program: torch.export.ExportedProgram) -> None:
    """Erase the program's runtime assertions and their dead condition chain before ``to_edge``.

    The ExecuTorch runtime does not run assertions: ``RemoveGraphAssertsPass`` erases
    ``aten._assert_async.msg`` / ``aten._assert_scalar`` among the ``to_executorch`` passes
    (pytorch/executorch#1319 proposed moving it to the ATen-to-edge passes; not merged, still so in
    executorch 1.4.1). ``to_edge`` verifies the program first, condition included, and
    transformers 5.24's ``torch_compilable_check`` on a tensor condition (llava's "Image features
    and image tokens do not match" check, the same in many image-text models) is captured as
    ``aten._is_all_true -> item -> _assert_scalar``: ``SpecViolationError: aten._is_all_true is not
    in Core ATen opset``. This fix erases the assertions before lowering and removes the
    computation only they used (:func:`hfexport.workarounds.assertions.drop_runtime_assertions`),
    and the range constraints of the unbacked symbols it defined, so the bounds fix after it does
    not see them. The ``.pte`` checks nothing either way; values are unchanged.
    """
    dropped = drop_runtime_assertions(exported_program)
    if dropped.assertions:
        logger.info(
            "ExecuTorch cannot run runtime assertions: dropped %d (and %d node(s) computing their conditions)",
            dropped.assertions,
            dropped.dead_nodes,
        )


@register_fx_program_fix(
    "executorch",
    description=(
        "give every unbounded dynamic dimension a finite upper bound (axis role rule, see hfexport_executorch.bounds); "
        "ExecuTorch plans memory at upper bounds and otherwise silently plans the traced size (still open upstream)"
    ),
    issue="https://github.com/pytorch/executorch/issues/8766",
    versions={"executorch": ">=1.3"},
)
def bound_unbounded_dynamic_ranges(exported_program: torch.export.ExportedProgram) -> None:
    """Bound every symbol of ``exported_program`` whose range has no finite upper end.

    ExecuTorch memory planning needs a concrete upper bound for each dynamic size
    (https://github.com/pytorch/executorch/issues/8766: unbounded dynamic memory is not
    supported). Since https://github.com/pytorch/executorch/pull/20834 an unbounded size is
    planned at its trace-time value instead of failing, so the program breaks at run time on any
    larger input. This fix sets the upper bound to the value the exporter left in
    ``graph_module.meta[BOUNDS_META_KEY]`` (from the axis role and the model config), or else to
    the role bound of the first user input axis the symbol sizes (model-independent defaults),
    or :data:`hfexport_executorch.bounds.DEFAULT_MAX_SEQUENCE` for a symbol sizing no input.

    Records ``{symbol: upper}`` in ``graph_module.meta[BOUNDED_META_KEY]``.
    """
    planned: dict[str, int] = exported_program.graph_module.meta.get(BOUNDS_META_KEY, {})
    infos = {info.symbol: info for info in bounds.collect_symbols(exported_program)}
    done: dict[str, int] = {}
    for symbol, value_range in list(exported_program.range_constraints.items()):
        if not bounds.is_unbounded(value_range.upper):
            continue
        upper = planned.get(str(symbol))
        if upper is None:
            info = infos.get(symbol)
            if info is not None:
                upper, _ = bounds.role_bound(info.role, info.hint, None)
            else:
                upper = bounds.DEFAULT_MAX_SEQUENCE
        lower = int(value_range.lower) if value_range.lower.is_finite else 0
        upper = max(int(upper), lower)
        bounds.set_symbol_upper_bound(exported_program, symbol, upper)
        done[str(symbol)] = upper
    if done:
        logger.debug("bounded dynamic ranges: %s", done)
    exported_program.graph_module.meta[BOUNDED_META_KEY] = done


@register_fx_program_fix(
    "executorch",
    description=(
        "narrow the range of a sequence symbol to the largest size the program's input guards accept (a forward "
        "looping over the sample's chunk count guards the chunk count, not the symbol's range): ExecuTorch plans "
        "memory at the range's end, so the inputs were planned longer than the chunk-sized intermediates"
    ),
    # torch.export keeps a shape guard it cannot turn into a symbol range (ceil(L / 64) == 1) in the
    # program's guard code (shape guards of exported programs, pytorch/pytorch#161178), and
    # range_constraints keep the asked range; checked on torch 2.13 (earlier versions not checked)
    issue="https://github.com/pytorch/pytorch/pull/161178",
    versions={"torch": ">=2.13"},
)
def sequence_bounds_from_input_guards(exported_program: torch.export.ExportedProgram) -> None:
    """Narrow each symbol named in ``graph_module.meta[GUARD_BOUNDS_META_KEY]`` to its bound there.

    Transformers' chunked gated delta rule (``torch_chunk_gated_delta_rule`` of qwen3_5,
    qwen3_5_moe, qwen3_next, olmo_hybrid: transformers 5.24) pads the sequence to whole chunks of 64
    and loops over the chunks in Python; capture unrolls the loop for the sample's one chunk and
    records ``(L + pad) // 64 == 1`` as a guard of the program, while ``range_constraints`` keeps
    the range the export asked for (``[4, 512]`` for a vision-language model's language model
    exported with ``dynamic=True``). ExecuTorch plans the inputs at the range's end and the chunked
    intermediates at one chunk, so any prompt of more than 64 tokens failed inside the program
    (``aten::cumsum.out``: "Attempted to resize a bounded tensor with a maximum capacity of 2048
    elements to 4096 elements", error 0x12) instead of at the runtime's input-size check. The
    exporter finds the largest size the guards accept
    (:func:`hfexport.program_axes.program_input_axes`, note ``"model-bounded"``) and leaves it in the
    graph's meta; this fix sets it as the symbol's upper bound, so the inputs are planned, and
    refused above it, at the size the program serves. Narrowing a range after capture is sound:
    every guard that held on the wider range still holds. Values are unchanged.

    Records ``{symbol: upper}`` in ``graph_module.meta[GUARD_BOUNDED_META_KEY]``.
    """
    wanted: dict[str, int] = exported_program.graph_module.meta.get(GUARD_BOUNDS_META_KEY, {})
    done: dict[str, int] = {}
    for symbol, value_range in list(exported_program.range_constraints.items()):
        upper = wanted.get(str(symbol))
        if upper is None:
            continue
        lower = int(value_range.lower) if value_range.lower.is_finite else 0
        if upper < lower or (not bounds.is_unbounded(value_range.upper) and int(value_range.upper) <= upper):
            continue
        bounds.set_symbol_upper_bound(exported_program, symbol, int(upper))
        done[str(symbol)] = int(upper)
    if done:
        logger.info("sequence bounds narrowed to what the program's input guards accept: %s", done)
    exported_program.graph_module.meta[GUARD_BOUNDED_META_KEY] = done


_ATTENTION_OPS = (
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
# Ops through which the layout of an attention output flows unchanged or transposed.
_LAYOUT_OPS = (
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    operator.getitem,
)
_TRANSPOSE_OPS = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def _comes_from_attention(node: torch.fx.Node, depth: int = 8) -> bool:
    current = node
    for _ in range(depth):
        if not current.args or not isinstance(current.args[0], torch.fx.Node):
            return False
        current = current.args[0]
        if current.op != "call_function":
            return False
        if current.target in _ATTENTION_OPS:
            return True
        if current.target not in _LAYOUT_OPS:
            return False
    return False


@register_fx_node_fix(
    "executorch",
    description=(
        "copy the transposed scaled_dot_product_attention output to contiguous memory (the model's .contiguous() "
        "is elided at capture), so views stay valid once to_edge decomposes SDPA (still reproduces on torch 2.13)"
    ),
    issue="https://github.com/pytorch/pytorch/issues/136543",
    versions={"torch": ">=2.12"},
)
def contiguous_attention_outputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Insert ``aten.clone(memory_format=contiguous_format)`` after a transpose of an attention output.

    At capture time the CPU SDPA output has the strides of the fused kernel, for which
    ``out.transpose(1, 2)`` is already contiguous, so the model's ``.contiguous()`` is a no-op
    and is not recorded, and the following ``reshape`` is captured as a view. ExecuTorch's
    ``to_edge`` later decomposes SDPA into matmuls whose output is contiguous *before* the
    transpose, and the view that merges the transposed axes then fails with "Cannot view a
    tensor with shape ... and strides ..." (https://github.com/pytorch/pytorch/issues/136543;
    the SDPA stride fix proposed in https://github.com/pytorch/pytorch/pull/169732 was closed
    unmerged). GPT-2's ``Conv1D`` (``x.view(-1, x.size(-1))``) hits it with dynamic shapes.
    The inserted clone restores what ``.contiguous()`` meant; the values are unchanged.

    Applies to ``aten.transpose``/``aten.permute`` nodes whose input comes from a
    ``scaled_dot_product_attention`` output through layout ops only, and that do not already
    feed a clone.

    Returns:
        True when a clone was inserted.
    """
    if node.target not in _TRANSPOSE_OPS or not _comes_from_attention(node):
        return False
    if any(user.target is torch.ops.aten.clone.default for user in node.users):
        return False
    val = node.meta.get("val")
    with gm.graph.inserting_after(node):
        clone = gm.graph.call_function(
            torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
        )
    node.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
    clone.meta = {k: v for k, v in node.meta.items() if k != "val"}
    if isinstance(val, torch.Tensor):
        clone.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    return True


_EMPTY_OPS = (torch.ops.aten.new_empty.default, torch.ops.aten.empty.memory_format)


def _has_symbolic_size(size: Any) -> bool:
    return isinstance(size, (list, tuple)) and any(isinstance(s, torch.fx.Node) for s in size)


@register_fx_node_fix(
    "executorch",
    description=(
        "an uninitialised tensor of a dynamic size (aten.new_empty / aten.empty.memory_format, Mistral-4's "
        "key_states = kv.new_empty(...) filled by two slice copies) is created with aten.full(size, 0) instead: "
        "to_edge turns empty into dim_order_ops._empty_dim_order, whose schema takes int[] size, not SymInt[], so "
        "the conversion evaluates every symbolic size and pins batch and sequence to the sample's (executorch 1.4.1)"
    ),
    # no upstream issue filed yet; the schema is visible in the registry module
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/passes/dim_order_ops_registry.py",
    versions={"executorch": ">=1.3"},
)
def dynamic_empty_as_full(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.new_empty(x, size)`` / ``aten.empty.memory_format(size)`` with a symbolic
    element in ``size`` to ``aten.full(size, 0)`` of the same dtype and device.

    ExecuTorch's ``MemoryFormatOpsPass`` (run by ``to_edge``) replaces ``aten.empty.memory_format``
    by ``dim_order_ops._empty_dim_order``, declared ``_empty_dim_order(int[] size, ...)`` in
    ``exir/passes/dim_order_ops_registry.py`` (executorch 1.4.1): calling it on symbolic sizes
    guards each to its hint (``Eq(s43, 2)``), so the whole program becomes static at the sample's
    batch and length and the runtime refuses a larger input ("input_ids dimension 0 is 3, above the
    upper bound 2", issue 28: Mistral-4's ``expand_kv``). ``aten.full`` takes ``SymInt[]`` and has no
    memory format. An empty tensor's contents are undefined, so zeros are one valid content: the
    values the model computes are unchanged.

    Returns:
        True when the node was replaced.
    """
    if node.target not in _EMPTY_OPS:
        return False
    size = node.args[1] if node.target is torch.ops.aten.new_empty.default else node.args[0]
    if not _has_symbolic_size(size):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    with gm.graph.inserting_before(node):
        full = gm.graph.call_function(
            torch.ops.aten.full.default, (list(size), 0), {"dtype": val.dtype, "device": val.device}
        )
    full.meta = dict(node.meta)  # same fake value: shape, dtype, device, contiguous strides
    node.replace_all_uses_with(full)
    gm.graph.erase_node(node)
    return True


def _is_torchao_dequantize(node: object) -> bool:
    target = getattr(node, "target", None)
    return isinstance(target, torch._ops.OpOverload) and target.name() == "torchao::dequantize_affine"


@register_fx_node_fix(
    "executorch",
    description=(
        "drop padding_idx from aten.embedding over a torchao dequantize_affine weight (padding_idx only masks "
        "the gradient), so ExecuTorch's quant fusion, whose torchao patterns take (weight, indices) only, turns "
        "it into quantized_decomposed.embedding_4bit/embedding_byte instead of leaving a dequantize_affine the "
        "runtime has no kernel for (executorch 1.4.1 and main)"
    ),
    issue="https://github.com/pytorch/executorch/issues/10663",
    versions={"executorch": ">=1.3"},
)
def quantized_embedding_without_padding_idx(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.embedding(dequantize_affine(...), indices, padding_idx)`` to
    ``aten.embedding(dequantize_affine(...), indices)``.

    ``ExecutorchConfig.quantization.embedding_bits`` quantizes ``nn.Embedding`` weights with torchao
    (:func:`hfexport_executorch.quantize.quantize_copy`), which captures as a ``torchao.dequantize_affine``
    of the integer table feeding ``aten.embedding``. ``to_executorch(do_quant_fusion_and_const_prop=True)``
    fuses that pair into ``quantized_decomposed.embedding_byte`` / ``embedding_4bit``, the lookups the
    runtime's quantized kernels run, but its torchao patterns
    (``_get_embedding_ops_patterns_and_replacements_torchao`` in
    ``executorch/exir/passes/_quant_patterns_and_replacements.py``, executorch 1.4.1 and upstream main)
    only match ``aten.embedding(weight, indices)``; its older ``quantized_decomposed`` patterns do
    accept a ``padding_idx`` ("padding_idx only matters for training"). A Hugging Face embedding built
    with a ``padding_idx`` (llama ``embed_tokens``, BERT ``word_embeddings``; GPT-2's ``wte`` has none)
    then keeps its ``dequantize_affine``, which has no out variant: ``to_executorch`` fails with
    "Missing out variants: {'torchao::dequantize_affine'}" (the symptom of
    https://github.com/pytorch/executorch/issues/10663 on Hugging Face models). ``padding_idx`` changes
    only the gradient of the padding row, so the forward values are unchanged.

    Returns:
        True when the node's ``padding_idx`` was dropped (the node is kept, with two arguments).
    """
    if node.target is not torch.ops.aten.embedding.default or len(node.args) <= 2 or node.kwargs:
        return False
    if not _is_torchao_dequantize(node.args[0]):
        return False
    padding_idx = node.args[2]
    if len(node.args) > 3 and any(node.args[3:]):  # scale_grad_by_freq / sparse: leave such a node alone
        return False
    node.args = node.args[:2]
    logger.debug("%s: dropped padding_idx=%s of a quantized embedding", node.name, padding_idx)
    return True


@register_fx_node_fix(
    "executorch",
    description=(
        "count the boundaries below each value (unsqueeze, gt/ge, sum) instead of aten.bucketize: bucketize is not "
        "core ATen (to_edge: SpecViolationError) and the runtime has no kernel for it; the Idefics2/Idefics3 vision "
        "embeddings (aria, idefics2, idefics3, smolvlm) bucket the patch coordinates of each image"
    ),
    issue="https://github.com/pytorch/executorch/issues/20270",
    # executorch 1.4.1: not in the core ATen opset, no bucketize in kernels/portable (pytorch/executorch#20287
    # adds a portable kernel after 1.4.1; to_edge still refuses the op without a compile_config exception)
    versions={"executorch": ">=1.3"},
)
def bucketize_as_comparison_count(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.bucketize.Tensor(x, boundaries, out_int32=False, right=False)`` by
    ``(x.unsqueeze(-1) > boundaries).to(dtype).sum(-1)`` (``>=`` when ``right=True``).

    For sorted 1-D ``boundaries`` of length ``m``, ``bucketize`` returns for each element of ``x``
    the index ``i`` in ``[0, m]`` with ``boundaries[i-1] < x <= boundaries[i]`` (``right=False``) or
    ``boundaries[i-1] <= x < boundaries[i]`` (``right=True``): the number of boundaries strictly
    below ``x``, or at or below it. The count is what this fix computes, in ``x``'s shape and
    int64 (int32 with ``out_int32=True``), as ``bucketize`` returns it. ``aten.bucketize`` is not in
    the core ATen opset, so ``to_edge`` refuses it (``SpecViolationError``), and the ExecuTorch 1.4.1
    runtime has no kernel for it (https://github.com/pytorch/executorch/issues/20270). The
    comparison materialises an ``x.numel() x m`` boolean tensor, small for position buckets (the
    Idefics3 vision embeddings compare each patch row/column coordinate with ``num_patches_per_side
    - 1`` boundaries). One difference: a NaN in ``x`` counts 0 here where ``bucketize`` gives ``m``.

    Returns:
        True when the node was rewritten (``boundaries`` a 1-D tensor node).
    """
    if node.target is not torch.ops.aten.bucketize.Tensor:
        return False
    source, boundaries = node.args[0], node.args[1]
    options = dict(zip(("out_int32", "right"), node.args[2:], strict=False)) | dict(node.kwargs)
    b_val = boundaries.meta.get("val") if isinstance(boundaries, torch.fx.Node) else None
    if not isinstance(source, torch.fx.Node) or not isinstance(b_val, torch.Tensor) or b_val.dim() != 1:
        return False
    dtype = torch.int32 if options.get("out_int32", False) else torch.int64
    compare = torch.ops.aten.ge.Tensor if options.get("right", False) else torch.ops.aten.gt.Tensor
    aten = torch.ops.aten
    with gm.graph.inserting_before(node):
        column = insert_call(gm.graph, aten.unsqueeze.default, (source, -1), like=node)
        below = insert_call(gm.graph, compare, (column, boundaries), like=node)
        counted = insert_call(gm.graph, aten._to_copy.default, (below,), {"dtype": dtype}, like=node)
        total = insert_call(gm.graph, aten.sum.dim_IntList, (counted, [-1]), {"dtype": dtype}, like=node)
    node.replace_all_uses_with(total)
    gm.graph.erase_node(node)
    return True


_SCATTER_ADD_OPS = (torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_add_.default)


@register_fx_node_fix(
    "executorch",
    description=(
        "cast an int32 index of aten.scatter_add to int64: the edge dialect's dtype table takes only Long indices "
        "for scatter_add (unlike gather and scatter), so to_edge refused the program with 'These operators are "
        "taking Tensor inputs with mismatched dtypes' (GLM-5-Next's sparse-attention mask scatters its int32 "
        "top-k indices)"
    ),
    # no upstream issue found; executorch 1.4.1's exir/dialects/edge/edge.yaml constrains scatter_add's
    # index to T7 (Long) for every self dtype
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/dialects/edge/edge.yaml",
    versions={"executorch": ">=1.3"},
)
def scatter_add_with_long_index(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Give ``aten.scatter_add(self, dim, index, src)`` an int64 copy of an int32 ``index``.

    ``torch.scatter_add`` takes int32 and int64 indices alike, and GLM-5-Next's sparse attention
    (``build_attention_mask_from_topk``) scatters the indexer's int32 top-k indices into an int32
    count of selected keys. ExecuTorch's edge dialect lists the dtypes each operator accepts
    (``exir/dialects/edge/edge.yaml``), and for ``scatter_add`` the index is Long only, so
    ``to_edge``'s verifier raised ``SpecViolationError: These operators are taking Tensor inputs
    with mismatched dtypes`` (issue 28). Index values are unchanged by the cast (an int32 index
    fits int64), so the result is the same.

    Returns:
        True when a cast was inserted (the node's index was an int32 tensor).
    """
    if node.target not in _SCATTER_ADD_OPS or len(node.args) < 3:
        return False
    index = node.args[2]
    value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
        return False
    with gm.graph.inserting_before(node):
        wide = insert_call(
            gm.graph, torch.ops.aten._to_copy.default, (index,), {"dtype": torch.int64}, like=node
        )
    node.args = (*node.args[:2], wide, *node.args[3:])
    return True


def _cat_dim(node: torch.fx.Node, rank: int) -> int:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return int(dim) % rank if rank else 0


def _has_zero_axis(value: torch.Tensor) -> bool:
    """True when ``value`` has an axis of literal size 0 (it is empty at every input size)."""
    return any(isinstance(size, int) and size == 0 for size in value.shape)


@register_fx_node_fix(
    "executorch",
    description=(
        "an aten.cat of tensors that are all empty (an axis of size 0) becomes aten.full of its size, computed "
        "by sym_size nodes: ExecuTorch's PruneEmptyTensorsPass replaces such a cat by aten.full with the raw "
        "symbolic sizes in its size list, and the emitter refused the program ('Unsupported type encountered in "
        "int list'; GLM-5-Next's cache update concatenates [batch, 1, positions, 0] keys)"
    ),
    # no upstream issue found; executorch 1.4.1's exir/passes/prune_empty_tensors_pass.py builds
    # full(tuple(cat_tensor.shape), 0) from the fake value's shape, SymInts included
    issue="https://github.com/pytorch/executorch/blob/v1.4.1/exir/passes/prune_empty_tensors_pass.py",
    versions={"executorch": ">=1.3"},
)
def empty_cat_as_full(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.cat(tensors, dim)`` of tensors that each have an axis of size 0 by
    ``aten.full(size, 0)`` of the cat's size.

    Such a cat returns an empty tensor. ExecuTorch's ``PruneEmptyTensorsPass`` (run by
    ``to_executorch``) replaces a cat whose inputs are all empty by ``aten.full(shape, 0)``, taking
    ``shape`` from the fake value: a dynamic axis enters the size list as a raw ``SymInt``, not as a
    node computing it, and the emitter fails with ``InternalError: Unsupported type encountered in
    int list`` (issue 28: GLM-5-Next's cache update concatenates keys ``[batch, 1, positions, 0]``
    along the positions of a growing cache). Here each symbolic size is read off the inputs with
    ``aten.sym_size.int`` (the concatenated axis as the sum of the inputs' sizes), as ``aten.full``
    takes ``SymInt[]``; the result holds no values, so nothing the model computes changes. 1-D empty
    operands of another rank, which ``cat`` skips (a ``DynamicCache`` layer starts as
    ``torch.tensor([])``), are skipped here too.

    Returns:
        True when the cat was replaced.
    """
    if node.target is not torch.ops.aten.cat.default or not node.args:
        return False
    tensors = node.args[0]
    out = node.meta.get("val")
    if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(out, torch.Tensor):
        return False
    if not _has_zero_axis(out) or out.dim() == 0:
        return False
    values = [item.meta.get("val") if isinstance(item, torch.fx.Node) else None for item in tensors]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    # cat skips 1-D empty operands of another rank (its legacy rule; transformers' DynamicCache starts
    # each layer as torch.tensor([])): the size comes from the others
    kept = [(t, v) for t, v in zip(tensors, values, strict=True) if v.dim() == out.dim()]
    skipped = [v for v in values if v.dim() != out.dim()]
    if not kept or any(v.dim() != 1 or v.shape[0] != 0 for v in skipped):
        return False
    if not all(_has_zero_axis(v) for _, v in kept):
        return False
    tensors, values = [t for t, _ in kept], [v for _, v in kept]
    dim = _cat_dim(node, out.dim())
    with gm.graph.inserting_before(node):
        size = cat_result_size(gm.graph, tensors, values, dim, out.shape)
        full = gm.graph.call_function(
            torch.ops.aten.full.default, (size, 0), {"dtype": out.dtype, "device": out.device}
        )
    full.meta = dict(node.meta)  # same fake value: shape, dtype, device
    node.replace_all_uses_with(full)
    gm.graph.erase_node(node)
    return True


def _input_size_node(gm: torch.fx.GraphModule, size: torch.SymInt) -> torch.fx.Node | None:
    """An ``aten.sym_size.int`` node (inserted at the graph's insertion point) reading ``size`` off the
    first placeholder with an axis of exactly that symbolic size, or ``None`` when no input has one."""
    expr = size.node.expr
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        val = placeholder.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, extent in enumerate(val.shape):
            if isinstance(extent, torch.SymInt) and extent.node.expr == expr:
                return _size_argument(gm, placeholder, dim, extent)
    return None


@register_fx_node_fix(
    "executorch",
    description=(
        "repeat_interleave with tensor repeats as an index_select of cumulative counts (arange, cumsum, ge, sum): "
        "to_edge decomposes it into aten.repeat_interleave.Tensor, which is not core ATen (SpecViolationError); "
        "the Qwen3-VL vision position-embedding interpolation repeats each image's grid per patch"
    ),
    # the runtime has a repeat_interleave.Tensor_out kernel (that PR), but the op is not core ATen in torch 2.13,
    # so the edge verifier of executorch 1.4.1 refuses it before any kernel is looked up
    issue="https://github.com/pytorch/executorch/pull/7264",
    versions={"executorch": ">=1.3"},
)
def repeat_interleave_as_cumulative_count(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.repeat_interleave.self_Tensor(x, repeats, dim)`` (1-D ``repeats``) by
    ``x.index_select(dim, index)`` and ``aten.repeat_interleave.Tensor(repeats)`` by ``index``, with
    ``index = (arange(n)[:, None] >= repeats.cumsum(0)[None, :]).sum(-1)``.

    Output row ``i`` of a repeat-interleave comes from the source row whose cumulative repeat count
    first exceeds ``i``, i.e. from the number of cumulative counts at or below ``i``; ``n`` is the
    output length (the sum of ``repeats``). ``torch.export`` records ``n`` as a size of the output
    (transformers' ``get_vision_interpolation_indices_and_weights`` repeats per-image grid sides
    once per patch, and the trace identifies their sum with the patch axis of the encoder's input);
    ``to_edge`` then decomposes the op into ``aten.repeat_interleave.Tensor`` + ``index_select``, and
    ``aten.repeat_interleave.Tensor`` is not in the core ATen opset (``SpecViolationError``, issue 28:
    the Qwen3-VL image encoder). The rewrite uses core operators only, and the values are the
    same. ``index`` is int64 ``[n]``; the comparison is ``[n, len(repeats)]`` booleans (patches x
    images). Applies only when ``n`` is an int or a size of one of the program's inputs (read with
    ``aten.sym_size.int``); ``x`` must be 1-D when ``dim`` is None.

    Returns:
        True when the node was rewritten.
    """
    aten = torch.ops.aten
    if node.target is aten.repeat_interleave.self_Tensor:
        source, repeats = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    elif node.target is aten.repeat_interleave.Tensor:
        source, repeats, dim = None, node.args[0], 0
    else:
        return False
    r_val = repeats.meta.get("val") if isinstance(repeats, torch.fx.Node) else None
    out_val = node.meta.get("val")
    if not isinstance(r_val, torch.Tensor) or r_val.dim() != 1 or not isinstance(out_val, torch.Tensor):
        return False
    if source is not None:
        s_val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(s_val, torch.Tensor) or (dim is None and s_val.dim() != 1):
            return False
        dim = 0 if dim is None else int(dim) % s_val.dim()
    length = out_val.shape[dim]
    with gm.graph.inserting_before(node):
        if isinstance(length, torch.SymInt):
            size = _input_size_node(gm, length)
            if size is None:
                return False
        else:
            size = int(length)
        positions = gm.graph.call_function(
            aten.arange.start_step, (0, size, 1), {"dtype": torch.int64, "device": out_val.device}
        )
        positions.meta["val"] = out_val.new_empty((length,), dtype=torch.int64)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in node.meta:
                positions.meta[key] = node.meta[key]
        ends = insert_call(gm.graph, aten.cumsum.default, (repeats, 0), {"dtype": torch.int64}, like=node)
        column = insert_call(gm.graph, aten.unsqueeze.default, (positions, 1), like=node)
        row = insert_call(gm.graph, aten.unsqueeze.default, (ends, 0), like=node)
        passed = insert_call(gm.graph, aten.ge.Tensor, (column, row), like=node)
        counted = insert_call(gm.graph, aten._to_copy.default, (passed,), {"dtype": torch.int64}, like=node)
        index = insert_call(gm.graph, aten.sum.dim_IntList, (counted, [1]), {"dtype": torch.int64}, like=node)
        result = (
            index
            if source is None
            else insert_call(gm.graph, aten.index_select.default, (source, dim, index), like=node)
        )
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return True


_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def _cast(gm: torch.fx.GraphModule, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """An ``aten._to_copy(value, dtype=dtype)`` node (inserted at the graph's current insertion point)."""
    return insert_call(gm.graph, torch.ops.aten._to_copy.default, (value,), {"dtype": dtype}, like=value)


@register_fx_node_fix(
    "executorch.xnnpack",
    description=(
        "compute a float16/bfloat16 aten.layer_norm in float32 (cast in, cast out): the CPU runtime's optimized "
        "native_layer_norm reads half rows of >= 256 elements as float32 (RowwiseMoments via Vectorized<float>::loadu) "
        "and returns garbage, inf/NaN on MiniLM (executorch 1.4.1 and main)"
    ),
    issue="https://github.com/pytorch/executorch/pull/16727",
    versions={"executorch": ">=1.3"},
)
def layer_norm_in_float32(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Run a reduced-precision ``aten.layer_norm`` in float32: cast its input, weight and bias to float32
    and its output back.

    ExecuTorch's optimized CPU ``native_layer_norm`` (``kernels/optimized/cpu/op_native_layer_norm.cpp``,
    the kernel the XNNPACK program's non-delegated layer norms run on; XNNPACK itself takes none) has
    a scalar path for rows shorter than 256 elements (``kSmallNThreshold``, from
    https://github.com/pytorch/executorch/pull/18636) and a SIMD path above, whose
    ``RowwiseMoments`` (``kernels/optimized/cpu/moments_utils.h``, float accumulation since
    https://github.com/pytorch/executorch/pull/16727) loads the half/bfloat16 row with
    ``Vectorized<float>::loadu``, i.e. reads its bytes as float32, and has no reduced-precision
    specialization. Measured with executorch 1.4.1: a float16 or bfloat16 ``LayerNorm(256)`` or wider
    is off by 1 to 8 (absolute) on ``randn`` rows, ``LayerNorm(255)`` is right, float32 is right;
    all-MiniLM-L6-v2 (hidden 384) in float16 gives an inf ``last_hidden_state`` (cosine 0 against
    fp32), while GPT-2 IgLM-S (hidden < 256) is unaffected. No upstream issue names it yet; the
    stored upstream ``moments_utils.h`` still has it. ATen computes the moments of a reduced-precision
    layer norm in float32 too, so the values are what eager PyTorch computes; the cost is two casts
    per layer norm.

    Returns:
        True when the node was rewritten (its input was float16 or bfloat16).
    """
    if node.target is not torch.ops.aten.layer_norm.default:
        return False
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in _REDUCED_FLOATS:
        return False
    dtype = val.dtype
    args = list(node.args)
    with gm.graph.inserting_before(node):
        for index in (0, 2, 3):  # input, weight, bias (weight/bias may be None or absent)
            if index < len(args) and isinstance(args[index], torch.fx.Node):
                args[index] = _cast(gm, args[index], torch.float32)
    node.args = tuple(args)
    out_val = node.meta.get("val")
    if isinstance(out_val, torch.Tensor):
        node.meta["val"] = out_val.to(torch.float32)
    with gm.graph.inserting_after(node):
        back = _cast(gm, node, dtype)
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return True


def _size_argument(
    gm: torch.fx.GraphModule, source: torch.fx.Node, dim: int, size: int | torch.SymInt
) -> torch.fx.Node | int:
    """``source.size(dim)`` as an operator argument, at the graph's insertion point: an
    ``aten.sym_size.int`` node (its ``meta["val"]`` the symbolic size) when the size is symbolic,
    else the int."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    node = gm.graph.call_function(torch.ops.aten.sym_size.int, (source, dim))
    node.meta["val"] = size
    return node


@register_fx_node_fix(
    "executorch",
    description=(
        "rewrite aten.sort and aten.argsort (not stable) as aten.topk over the whole axis: the ExecuTorch runtime has "
        "no sort kernel (portable or optimized), so a .pte with sort fails to load (Missing operator: "
        "aten::sort.values, error 0x14; to_edge decomposes argsort into sort); jetmoe's router sorts its expert "
        "assignment, the Qwen2.5-VL / EXAONE 4.5 / HyperCLOVAX-Vision-V2 window attention argsorts its window index"
    ),
    issue="https://github.com/pytorch/executorch/issues/11320",
    # executorch 1.4.1 kernels/portable/functions.yaml: topk.values, no sort
    versions={"executorch": ">=1.3"},
)
def sort_as_topk(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.sort.default(x, dim=-1, descending=False)`` by ``aten.topk(x, k=x.size(dim), dim,
    largest=descending, sorted=True)``, and ``aten.argsort.default(x, dim=-1, descending=False)`` by
    the indices of that ``topk``.

    Both return ``(values, indices)`` with the same shapes and dtypes (values of ``x``'s dtype,
    indices int64), the values ordered the same way along ``dim``. The ExecuTorch runtime ships
    ``topk.values`` among its portable kernels and no ``sort`` (executorch 1.4.1; the portable
    library's core-ATen coverage is tracked in pytorch/executorch#11320), so the loader fails on
    ``aten::sort.values`` (error 0x14). ``aten.sort.default`` is not stable either, so the order of
    equal elements (and with it their indices) is unspecified in both; ``aten.sort.stable`` with
    ``stable=True`` is left alone. With a dynamic ``dim`` the ``k`` is the symbolic size
    (``aten.sym_size.int``). ``aten.argsort`` is not core ATen and ``to_edge`` decomposes it into
    ``aten.sort`` after this fix ran, so it is rewritten here too (``argsort.stable`` only with
    ``stable=False``): the Qwen2.5-VL vision tower (and EXAONE 4.5's, HyperCLOVAX-Vision-V2's)
    restores the patch order with ``torch.argsort(window_index)``, whose values are distinct, so
    the order of ties does not arise (issue 28: its image encoder failed to load, error 0x14).

    Returns:
        True when the node was rewritten.
    """
    aten = torch.ops.aten
    if node.target is aten.argsort.stable:
        if node.kwargs.get("stable", False):
            return False
    elif node.target not in (aten.sort.default, aten.argsort.default):
        return False
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    positional = node.args[1:] if node.target is not aten.argsort.stable else ()
    dim = positional[0] if len(positional) > 0 else node.kwargs.get("dim", -1)
    descending = positional[1] if len(positional) > 1 else node.kwargs.get("descending", False)
    dim = int(dim) % max(val.dim(), 1)
    size = val.shape[dim] if val.dim() else 1
    with gm.graph.inserting_before(node):
        k = _size_argument(gm, source, dim, size)
        topk = gm.graph.call_function(torch.ops.aten.topk.default, (source, k, dim, bool(descending), True))
    if node.target is aten.sort.default:
        topk.meta.update({key: value for key, value in node.meta.items()})
        node.replace_all_uses_with(topk)
    else:  # argsort: the indices of the topk
        indices = node.meta.get("val")
        topk.meta.update({key: value for key, value in node.meta.items() if key != "val"})
        if isinstance(indices, torch.Tensor):
            topk.meta["val"] = (val.new_empty(indices.shape), indices)
        with gm.graph.inserting_after(topk):
            index = gm.graph.call_function(operator.getitem, (topk, 1))
        index.meta = dict(node.meta)
        node.replace_all_uses_with(index)
    gm.graph.erase_node(node)
    return True


def _can_be_negative(value: object) -> bool:
    """Whether a symbolic integer's range, as the shape environment bounds it, reaches below 0."""
    node = getattr(value, "node", None)
    shape_env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
    if shape_env is None or expr is None:
        return False
    return bool(shape_env.bound_sympy(expr).lower < 0)


def _never_negative(value: object) -> bool:
    """Whether a symbolic integer (or int) is >= 0 over the whole range the shape environment gives it."""
    if isinstance(value, int):
        return value >= 0
    node = getattr(value, "node", None)
    shape_env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
    if shape_env is None or expr is None:
        return False
    return bool(shape_env.bound_sympy(expr).lower >= 0)


@register_fx_node_fix(
    "executorch",
    description=(
        "pad by (p + n) then slice n off, for an aten.constant_pad_nd whose symbolic left pad p may be negative "
        "(a crop) while p + n, n the padded axis's size, never is: the runtime's constant_pad_nd refuses negative "
        "pads (error 0x12) where eager crops; RecurrentGemma keeps its convolution state as pad(x, (w - 1 - L, 0))"
    ),
    issue="https://github.com/pytorch/executorch/pull/18018",
    # executorch 1.4.1 kernels/portable/cpu/util/kernel_ops_util.cpp check_constant_pad_args: pad[i] >= 0
    versions={"executorch": ">=1.3"},
)
def left_crop_of_constant_pad_as_pad_and_slice(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Rewrite ``aten.constant_pad_nd(x, [..., p, r, ...], value)`` (or ``aten.pad`` in ``"constant"``
    mode, as ``torch.export`` records ``torch.nn.functional.pad``) with a symbolic left pad ``p`` that
    may be negative as ``aten.slice(aten.constant_pad_nd(x, [..., p + n, r, ...], value), dim, n)``,
    ``n = x.size(dim)``.

    ``torch.nn.functional.pad`` with a negative amount crops, and models use it to keep the last
    ``k`` steps of a sequence whatever its length: RecurrentGemma's recurrent block stores its
    convolution state as ``pad(x, (conv1d_width - 1 - seq_len, 0))`` (zeros before a short prompt,
    the last ``conv1d_width - 1`` steps of a long one). The ExecuTorch runtime's ``constant_pad_nd``
    kernel checks ``pad[i] >= 0`` (added by https://github.com/pytorch/executorch/pull/18018 against
    the out-of-bounds writes negative pads caused) and fails the method with error 0x12
    (InvalidArgument) at a prompt longer than the state; XNNPACK does not take negative pads either
    (https://github.com/pytorch/executorch/issues/12456). Padding by ``p + n`` puts ``n`` more zeros
    before the axis, and dropping the first ``n`` positions gives what the crop or the pad gave:
    for ``p >= 0`` the ``n`` extra zeros, for ``p < 0`` the ``p + n`` zeros and the first ``-p`` steps.
    Values are unchanged. Applies only when the shape environment bounds ``p`` below 0 and ``p + n``
    at 0 or above; right pads and constant pads are left alone.

    Returns:
        True when the node was rewritten.
    """
    if node.target is torch.ops.aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        if mode != "constant":
            return False
    elif node.target is not torch.ops.aten.constant_pad_nd.default:
        return False
    source, pad = node.args[0], list(node.args[1])
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    for index in range(0, len(pad), 2):  # left pads: pad[2k] applies before axis ndim - 1 - k
        amount = pad[index]
        amount_val = amount.meta.get("val") if isinstance(amount, torch.fx.Node) else amount
        if not isinstance(amount_val, torch.SymInt) or not _can_be_negative(amount_val):
            continue
        dim = val.dim() - 1 - index // 2
        size = val.shape[dim]
        if not _never_negative(amount_val + size):
            continue
        with gm.graph.inserting_before(node):
            size_node = _size_argument(gm, source, dim, size)
            widened = gm.graph.call_function(operator.add, (amount, size_node))
            widened.meta["val"] = amount_val + size
            pad[index] = widened
            # meta values built, not computed: fake-running a slice at a symbolic start guards on it
            # and would specialise the axis
            padded = gm.graph.call_function(node.target, (source, pad, *node.args[2:]), dict(node.kwargs))
            cropped = gm.graph.call_function(torch.ops.aten.slice.Tensor, (padded, dim, size_node))
        out_val = node.meta.get("val")
        padded.meta = {k: v for k, v in node.meta.items() if k != "val"}
        cropped.meta = dict(node.meta)
        if isinstance(out_val, torch.Tensor):
            shape = list(out_val.shape)
            shape[dim] = shape[dim] + size
            padded.meta["val"] = out_val.new_empty(shape)
        node.replace_all_uses_with(cropped)
        gm.graph.erase_node(node)
        return True
    return False


def _constant_size(size: int | torch.SymInt) -> int | None:
    """The value of a size that is the same for every value of its one symbol, else None.

    Symbolic sizes such as ``padded // (padded // 64)`` (``padded`` the length rounded up to a multiple
    of 64) are constant without sympy being able to simplify them; the expression is evaluated at
    every length from 1 to 1024 and at powers of two (and their neighbours) up to 2**20, and must give
    the sample's value at each (about 0.1 s per distinct expression; results are cached).
    """
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    expr, hint = getattr(node, "expr", None), getattr(node, "hint", None)
    if expr is None or hint is None or len(expr.free_symbols) != 1:
        return None
    return _constant_over_probes(expr, int(hint))


_PROBES = sorted({*range(1, 1025), *(2**k + d for k in range(10, 21) for d in (-1, 0, 1))})


@functools.lru_cache(maxsize=64)
def _constant_over_probes(expr: Any, hint: int) -> int | None:
    import sympy

    (symbol,) = expr.free_symbols
    try:
        if all(int(expr.xreplace({symbol: sympy.Integer(value)})) == hint for value in _PROBES):
            return hint
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return None


@register_fx_node_fix(
    "executorch",
    description=(
        "solve a unit lower-triangular system (aten.linalg_solve_triangular, upper=False, unitriangular=True) by "
        "ceil(log2 n) products of (I + N^(2^k)), N the negated strictly lower part: the runtime has no triangular-solve "
        "kernel; the gated delta rule of qwen3_next / qwen3_5 / olmo_hybrid / lara_mini solves one per chunk"
    ),
    issue="https://github.com/huggingface/transformers/pull/47808",
    # executorch 1.4.1 kernels/portable/functions.yaml: no linalg_solve_triangular / triangular_solve
    versions={"executorch": ">=1.3"},
)
def unit_lower_triangular_solve_as_matmuls(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.linalg_solve_triangular(A, B, upper=False, left=True, unitriangular=True)`` by
    matrix products.

    With ``A = I + L`` (``L`` strictly lower triangular, ``n x n``), ``N = -L`` is nilpotent
    (``N^n = 0``), so ``A^-1 = I + N + ... + N^(n-1) = (I + N)(I + N^2)(I + N^4)...(I + N^(2^(K-1)))``
    with ``K = ceil(log2 n)``: ``X = A^-1 B`` takes ``K`` products with ``B`` and ``K - 1`` squarings
    (``n = 64``: 11 batched matmuls). The diagonal of ``A`` is not read, as ``unitriangular=True``
    specifies. ``n`` must be constant; it may be written symbolically (the gated delta rule computes
    its chunk size as padded length over chunk count, always 64): see :func:`_constant_size`. A
    system whose size varies is left alone.

    Transformers' gated-delta-rule models (``torch_chunk_gated_delta_rule``) call
    ``torch.linalg.solve_triangular`` in eager mode and, under ``torch.export``, unroll the same solve
    into ``n - 1`` sliced in-place row updates (transformers PR 47808, made for export targets
    without the solver); that unrolled form makes the ExecuTorch lowering of a tiny olmo_hybrid take
    more than ten minutes. The patch
    :func:`hfexport_executorch.workarounds.patches.gated_delta_rule_keeps_the_triangular_solve` keeps
    the solver call in the captured graph, and this fix turns it into products the portable and
    XNNPACK kernels run. The products are equal to the solve in exact arithmetic; in float32 they
    differ by rounding (max abs diff 1e-6 on the tiny models, tested).

    Returns:
        True when the node was rewritten.
    """
    if node.target is not torch.ops.aten.linalg_solve_triangular.default:
        return False
    a, b = node.args[0], node.args[1]
    options = dict(zip(("upper", "left", "unitriangular"), node.args[2:], strict=False)) | dict(node.kwargs)
    if options.get("upper", True) or not options.get("left", True) or not options.get("unitriangular", False):
        return False
    a_val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
    if not isinstance(a_val, torch.Tensor) or not isinstance(b, torch.fx.Node):
        return False
    n = _constant_size(a_val.shape[-1])
    if n is None or n < 1:
        return False
    aten = torch.ops.aten

    def call(target: object, *args: object) -> torch.fx.Node:
        return insert_call(gm.graph, target, args, like=node)

    with gm.graph.inserting_before(node):
        power = call(aten.neg.default, call(aten.tril.default, a, -1))
        solution = call(aten.add.Tensor, b, call(aten.matmul.default, power, b))
        span = 2
        while span < n:  # factors (I + N^2), (I + N^4), ... until every power below n is covered
            power = call(aten.matmul.default, power, power)
            solution = call(aten.add.Tensor, solution, call(aten.matmul.default, power, solution))
            span *= 2
    node.replace_all_uses_with(solution)
    gm.graph.erase_node(node)
    return True


@register_fx_program_fix(
    "executorch",
    description=(
        "rewrite complex-valued computation (torch.polar / view_as_complex rotary embeddings of deepseek_v2, "
        "llama4) into real (real, imaginary) pairs: the portable kernels and XNNPACK have no complex dtype, and "
        "to_edge refuses the complex operations"
    ),
    issue="https://github.com/pytorch/executorch/issues/11404",
    # executorch 1.4.1: no complex kernels for mul / polar / view_as_complex in kernels/portable
    versions={"executorch": ">=1.3"},
)
def complex_rotary_as_real_pairs(exported_program: torch.export.ExportedProgram) -> None:
    """Run :func:`hfexport.workarounds.complex_pairs.complex_as_real_pairs` on the program.

    The rewrite is all or nothing; a program with complex operations it does not know keeps them
    (and fails in ``to_edge`` as it did before).
    """
    from hfexport.workarounds.complex_pairs import complex_as_real_pairs

    rewritten = complex_as_real_pairs(exported_program)
    if rewritten:
        logger.debug("%d complex-valued nodes rewritten as real pairs", rewritten)


@register_fx_node_fix(
    "executorch",
    description=(
        "F.embedding_bag over bags of one size (2-D indices: offsets an arange of that step) as a gather, a "
        "multiply by the per-sample weights and a sum (or mean) over each bag: the ExecuTorch runtime has no "
        "embedding_bag kernel, so the .pte fails to load (error 0x14); Kimi-K2.5's vision tower resamples its "
        "position grid bicubically as an embedding_bag of 16 weighted rows per patch"
    ),
    issue="https://github.com/pytorch/executorch/issues/11320",
    # executorch 1.4.1 kernels/portable/functions.yaml: embedding.out, no _embedding_bag
    versions={"executorch": ">=1.3"},
)
def embedding_bag_of_fixed_bags_as_gather_sum(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace ``aten.embedding_bag`` (``.default`` / ``.padding_idx``, and ``aten._embedding_bag``)
    whose bags all hold ``k`` indices by ``embedding(weight, indices) * per_sample_weights``
    reshaped to ``[bags, k, dim]`` and summed (``mode="sum"``) or averaged (``mode="mean"``) over
    the bag axis.

    ``F.embedding_bag`` with 2-D ``indices`` ``[bags, k]`` flattens them and passes ``offsets =
    arange(0, bags * k, k)``: that is the form recognised here (``offsets`` an ``aten.arange``
    from 0 with a constant step ``k``, ``bags * k`` indices, ``include_last_offset=False``).
    The output ``[bags, dim]`` in ``weight``'s dtype is what ``embedding_bag``'s first result holds;
    an index equal to ``padding_idx`` contributes nothing (and, for ``mode="mean"``, is not
    counted), as in ``embedding_bag``. The other three results (offsets bookkeeping for the
    backward pass) must have no users. ``mode="max"``, ragged bags and ``scale_grad_by_freq`` /
    ``sparse`` nodes are left alone. The ExecuTorch 1.4.1 runtime registers ``embedding.out`` but no
    ``_embedding_bag`` kernel (pytorch/executorch#11320 tracks the portable library's core-ATen
    coverage), so such a program failed to load (``Failed to load method forward, error: 0x14``):
    Kimi-K2.5's vision tower (issue 28).

    Returns:
        True when the node was rewritten.
    """
    aten = torch.ops.aten
    if node.target not in (
        aten.embedding_bag.default,
        aten.embedding_bag.padding_idx,
        aten._embedding_bag.default,
    ):
        return False
    names = (
        "weight",
        "indices",
        "offsets",
        "scale_grad_by_freq",
        "mode",
        "sparse",
        "per_sample_weights",
        "include_last_offset",
        "padding_idx",
    )
    options: dict[str, Any] = {"scale_grad_by_freq": False, "mode": 0, "sparse": False}
    options |= {"per_sample_weights": None, "include_last_offset": False, "padding_idx": None}
    options |= dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    weight, indices, offsets = options["weight"], options["indices"], options["offsets"]
    if options["scale_grad_by_freq"] or options["sparse"] or options["include_last_offset"]:
        return False
    mode = int(options["mode"])
    if mode not in (0, 1) or not all(isinstance(n, torch.fx.Node) for n in (weight, indices, offsets)):
        return False
    # the first result only: the others are bookkeeping for the backward pass
    for user in node.users:
        if user.target is not operator.getitem or (user.args[1] != 0 and user.users):
            return False
    step = _fixed_bag_size(offsets)
    w_val, i_val, o_val = (n.meta.get("val") for n in (weight, indices, offsets))
    if step is None or not all(isinstance(v, torch.Tensor) for v in (w_val, i_val, o_val)):
        return False
    if i_val.dim() != 1 or o_val.dim() != 1 or w_val.dim() != 2:
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    size = step.meta["val"] if isinstance(step, torch.fx.Node) else step
    end = offsets.args[1] if len(offsets.args) > 1 else offsets.kwargs.get("end")
    end = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
    count = i_val.shape[0]
    if not isinstance(end, int | torch.SymInt) or not statically_known_true(end == count):
        return False  # offsets that do not cover the indices
    if not statically_known_true(count % size == 0):
        return False  # the last bag is shorter
    padding_idx = options["padding_idx"]
    if padding_idx is not None and int(padding_idx) < 0:  # _embedding_bag's "no padding index"
        padding_idx = None
    psw = options["per_sample_weights"]
    dim = w_val.shape[1]
    with gm.graph.inserting_before(node):
        rows = insert_call(gm.graph, aten.embedding.default, (weight, indices), like=node)
        if isinstance(psw, torch.fx.Node):
            column = insert_call(gm.graph, aten.unsqueeze.default, (psw, -1), like=node)
            rows = insert_call(gm.graph, aten.mul.Tensor, (rows, column), like=node)
        kept = None
        if padding_idx is not None:
            keep = insert_call(gm.graph, aten.ne.Scalar, (indices, int(padding_idx)), like=node)
            kept = insert_call(gm.graph, aten._to_copy.default, (keep,), {"dtype": w_val.dtype}, like=node)
            column = insert_call(gm.graph, aten.unsqueeze.default, (kept, -1), like=node)
            rows = insert_call(gm.graph, aten.mul.Tensor, (rows, column), like=node)
        bags = insert_call(gm.graph, aten.view.default, (rows, [-1, step, dim]), like=node)
        out = insert_call(gm.graph, aten.sum.dim_IntList, (bags, [1]), like=node)
        if mode == 1:
            if kept is None:
                out = insert_call(gm.graph, aten.div.Scalar, (out, step), like=node)
            else:
                counted = insert_call(gm.graph, aten.view.default, (kept, [-1, step]), like=node)
                count = insert_call(gm.graph, aten.sum.dim_IntList, (counted, [1], True), like=node)
                # an all-padding bag gives 0, as embedding_bag's mean of an empty bag
                count = insert_call(gm.graph, aten.clamp_min.default, (count, 1), like=node)
                out = insert_call(gm.graph, aten.div.Tensor, (out, count), like=node)
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return True


def _fixed_bag_size(offsets: torch.fx.Node) -> int | torch.fx.Node | None:
    """The step ``k`` when ``offsets`` is ``aten.arange(0, end, k)`` (``.start_step``) with a
    constant int ``k > 0`` or a symbolic size node (``aten.sym_size.int`` of a dynamic bag axis),
    as ``F.embedding_bag`` builds it for 2-D indices; ``None`` otherwise."""
    if offsets.target is not torch.ops.aten.arange.start_step:
        return None
    args = list(offsets.args)
    start = args[0] if args else offsets.kwargs.get("start", 0)
    step = args[2] if len(args) > 2 else offsets.kwargs.get("step", 1)
    if isinstance(step, torch.fx.Node) and isinstance(step.meta.get("val"), torch.SymInt):
        return step if start == 0 else None  # a symbolic bag size (an input axis), >= 1 as arange's step
    if start != 0 or not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        return None
    return step
