"""Our rewrite of attention over a concatenated KV cache into ONNX Runtime's ``GroupQueryAttention``.

onnxscript's own rule (``onnxscript.rewriter.ort_fusions.gqa``, 0.7) matches the graphs older
transformers produced: the cos/sin tables from ``MatMul(inv_freq, position_ids)`` (its
``cos_sin_cache`` rule) and a causal mask built from ``Trilu``/``Range`` plus the 2-D mask
(``_CausalMaskPattern``). The decoder graph that transformers 5 exports through ``torch.export``
has neither: the frequencies are ``Mul(Cast(Unsqueeze(position_ids)), inv_freq)``, the mask is a
boolean ``[batch, 1, sequence, total]`` tensor built with ``GatherND`` over ``attention_mask``, so
its GQA rule never fires and the attention fell back to ``MultiHeadAttention`` on K/V expanded to
all query heads (``repeat_kv``), with the rotary embedding unfused.

:func:`fuse_cached_gqa` works on what onnxscript's ``sdpa`` and ``rotary_embedding`` rules leave
(the intermediate ``SDPA`` and ``RotaryEmbedding`` ops of domain ``ai.onnxruntime._fusion``) and
matches, per layer::

    q = Transpose(Reshape(query [B, S, H*Dh]))              -> RotaryEmbedding(q, cos, sin)
    k = Transpose(Reshape(key [B, S, Hkv*Dh]))              -> RotaryEmbedding(k, cos, sin)
    v = Transpose(Reshape(value [B, S, Hkv*Dh]))
    present_key = Concat(past_key, k_rot, axis=-2); present_value = Concat(past_value, v, axis=-2)
    SDPA(q_rot, repeat_kv(present_key), repeat_kv(present_value), mask)  -> Transpose -> Reshape

with ``cos``/``sin`` computed from ``position_ids`` and a constant ``inv_freq`` (``cat(freqs, freqs)``,
optionally times a constant attention scaling), and replaces it by one
``com.microsoft.GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k,
total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias)`` whose ``present_key``
/ ``present_value`` outputs take over the graph outputs.

The fused graph computes what the unfused one does, also for padded batches:

* ``seqlens_k`` is ``past + sequence - 1`` for every row and ``total_sequence_length`` ``past +
  sequence`` (from the shapes), so the op appends the new keys/values after the whole past, as the
  ``Concat`` did (ORT's convention of ``attention_mask.sum() - 1`` would move them for left-padded
  rows); under :func:`attention_mask_lengths` (``lengths="attention_mask"``, the ``genai`` layout)
  they come from the ``attention_mask`` input instead (see there);
* ``query_seqlens`` is ``sequence`` for every row (without it ORT refuses a batch of multi-token
  steps on a non-empty past: "batch_size must be 1 when sequence_length > 1");
* the model's own mask (causal, padding, sliding window) goes in as ``attention_bias``, with
  ``-inf`` clamped to the dtype's lowest value: a fully masked query row (left padding) then gives
  finite values where the unfused graph gives zeros (see ``_finite_bias``), other rows are equal;
* the rotary embedding runs inside the op (``rotary="gqa"``, the default: ``do_rotary=1`` with the
  graph's ``position_ids``; ONNX Runtime 1.32 applies each token's own position, also on a
  left-padded first prompt, which the tests check) or as ``com.microsoft.RotaryEmbedding`` on the
  3-D query and key before the op (``rotary="separate"``);
* with the rotary inside, query, key and value projections ``MatMul(x, W)`` of one ``x`` become one
  ``MatMul`` over the concatenated weights, passed as the op's packed QKV input;
* the cos/sin tables (``[max_position + 1, head_dim / 2]``) are computed in the graph from
  ``position_ids`` and the constant ``inv_freq``, once for all layers: no table of
  ``max_position_embeddings`` rows is stored in the file.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "LENGTH_SOURCES",
    "ROTARY_MODES",
    "attention_mask_lengths",
    "fuse_cached_gqa",
    "shares_past_present_buffer",
]

logger = logging.getLogger(__name__)

_FUSION = "ai.onnxruntime._fusion"  # onnxscript's intermediate ops (SDPA, RotaryEmbedding)
_MS = "com.microsoft"
#: where the rotary embedding runs in the fused graph
ROTARY_MODES = ("separate", "gqa")
#: pass ``query_seqlens`` (see the module docstring)
QUERY_SEQLENS = True
#: where ``seqlens_k`` / ``total_sequence_length`` come from (see :func:`fuse_cached_gqa`)
LENGTH_SOURCES = ("past", "attention_mask")
#: name of the graph input the ``attention_mask`` lengths are read from
ATTENTION_MASK = "attention_mask"
_LENGTHS: contextvars.ContextVar[str] = contextvars.ContextVar("hfexport_gqa_lengths", default="past")
_TABLE_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hfexport_gqa_table_rows", default=None
)


@contextlib.contextmanager
def attention_mask_lengths(max_positions: int | None = None) -> Iterator[None]:
    """Within the block, :func:`fuse_cached_gqa` (run by ``ort_fusions``) reads the lengths from
    ``attention_mask`` (``lengths="attention_mask"``), as a shared past/present buffer needs.

    With ``past_present_share_buffer`` ONNX Runtime GenAI feeds every layer's past as one buffer of
    ``max_length`` positions and binds the present output to the same memory, so the new keys and
    values are written in place instead of the whole cache being copied into a new present tensor
    at every step. The past's shape then says nothing about how much of it is filled: the op needs
    ``seqlens_k = attention_mask.sum(-1) - 1`` and ``total_sequence_length =
    attention_mask.shape[1]``, and no ``attention_bias`` (whose key axis would be the buffer's).
    The op masks causally itself; padding follows ORT's convention (valid tokens first in each
    row), which is what ONNX Runtime GenAI feeds. The ``genai`` layout exports under this block;
    graphs for other runtimes (a left-padded batch, a concatenating loop) keep ``"past"``.

    Args:
        max_positions: the positions the runtime can reach (``context_length``, which caps its
            ``max_length``): the cos/sin tables then have this many rows, computed from constants
            only, so ONNX Runtime folds them once when the session is created instead of every
            step computing ``max(position_ids) + 1`` rows (the file stores at most the
            ``[max_positions, head_dim / 2]`` angles, folded by the onnxscript optimizer when
            within its size limit). ``None``: the per-step tables.

    Raises:
        ValueError: ``max_positions`` is not a positive int.
    """
    if max_positions is not None and (not isinstance(max_positions, int) or max_positions <= 0):
        raise ValueError(f"max_positions={max_positions!r} is invalid; give a positive int or None")
    token = _LENGTHS.set("attention_mask")
    rows = _TABLE_ROWS.set(max_positions)
    try:
        yield
    finally:
        _TABLE_ROWS.reset(rows)
        _LENGTHS.reset(token)


def shares_past_present_buffer(model: Any) -> bool:
    """True when every attention of ``model`` (an ``onnx_ir.Model``) is a ``GroupQueryAttention``
    whose lengths come from the ``attention_mask`` input with no ``attention_bias``: the graph then
    runs with ONNX Runtime GenAI's ``past_present_share_buffer``; False otherwise (no such op, an
    unfused attention left, or lengths from the past's shape)."""
    nodes = [n for n in model.graph.all_nodes() if n.op_type == "GroupQueryAttention" and n.domain == _MS]
    if not nodes or any(
        n.op_type in ("Softmax", "MultiHeadAttention", "Attention") for n in model.graph.all_nodes()
    ):
        return False
    for node in nodes:
        bias = node.inputs[10] if len(node.inputs) > 10 else None
        if bias is not None or not _reads_attention_mask(node.inputs[5]):
            return False
    return True


def _reads_attention_mask(value: Any, depth: int = 6) -> bool:
    """Whether ``value`` is computed from the ``attention_mask`` graph input within ``depth`` nodes."""
    if value is None:
        return False
    if value.name == ATTENTION_MASK and value.producer() is None:
        return True
    node = value.producer()
    if node is None or depth == 0:
        return False
    return any(_reads_attention_mask(v, depth - 1) for v in node.inputs)


class _NoMatch(Exception):
    """The subgraph around one SDPA is not the cached GQA form (the message says what differs)."""


def _producer(value: Any, op_type: str, domain: str = "") -> Any:
    node = value.producer() if value is not None else None
    if (
        node is None
        or node.op_type != op_type
        or node.domain not in ((domain,) if domain else ("", "ai.onnx"))
    ):
        raise _NoMatch(
            f"{getattr(value, 'name', value)} is not produced by {op_type}"
            + (f" (but by {node.op_type})" if node is not None else "")
        )
    return node


def _const(value: Any) -> np.ndarray | None:
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            tensor = producer.attributes["value"].as_tensor()
    return None if tensor is None else np.asarray(tensor.numpy())


def _ints(node: Any, index: int) -> list[int] | None:
    array = _const(node.inputs[index]) if len(node.inputs) > index else None
    return None if array is None else [int(x) for x in array.reshape(-1)]


def _perm(node: Any) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else list(attr.as_ints())


def _dim(value: Any, axis: int) -> Any:
    shape = value.shape
    if shape is None or len(shape) <= axis:
        return None
    return shape[axis]


def _heads_input(value: Any, what: str) -> tuple[Any, Any]:
    """``Transpose(Reshape(x [B, S, H*Dh]) -> [B, S, H, Dh], perm=[0, 2, 1, 3])`` -> ``(x, reshaped)``."""
    transpose = _producer(value, "Transpose")
    if _perm(transpose) != [0, 2, 1, 3]:
        raise _NoMatch(f"the {what} heads transpose has perm {_perm(transpose)}")
    reshape = _producer(transpose.inputs[0], "Reshape")
    flat, split = reshape.inputs[0], reshape.outputs[0]
    if flat.shape is None or len(flat.shape) != 3 or split.shape is None or len(split.shape) != 4:
        raise _NoMatch(f"the {what} projection is not reshaped from rank 3 to rank 4")
    if not isinstance(_dim(split, 2), int) or not isinstance(_dim(split, 3), int):
        raise _NoMatch(f"the {what} head count / head size is not static ({split.shape})")
    return flat, split


@dataclasses.dataclass
class _Rope:
    """Where the cos/sin of a rotate-half rotary embedding come from."""

    position_ids: Any  # int64 [B, S] or [S]
    inv_freq: np.ndarray  # float32 [Dh / 2]
    scaling: float  # attention scaling multiplied into cos and sin


def _rope_source(cos4: Any, sin4: Any) -> _Rope:
    """``Unsqueeze(Cos(Concat(f, f)) [* s], 1)`` and the same with ``Sin``, ``f`` = positions x inv_freq."""

    def table(value: Any, op: str) -> tuple[Any, float]:
        unsqueeze = _producer(value, "Unsqueeze")
        if _ints(unsqueeze, 1) != [1]:
            raise _NoMatch("the rotary cos/sin are not unsqueezed on axis 1")
        current, scaling = unsqueeze.inputs[0], 1.0
        node = current.producer()
        if (
            node is not None and node.op_type == "Cast"
        ):  # cos/sin computed in float32, cast to the model dtype
            current = node.inputs[0]
            node = current.producer()
        if node is not None and node.op_type == "Mul":  # cos * attention_scaling
            for a, b in (node.inputs, reversed(node.inputs)):
                factor = _const(b)
                if factor is not None and factor.size == 1:
                    current, scaling = a, float(factor.reshape(()))
                    break
            else:
                raise _NoMatch("the rotary cos/sin are scaled by a non-constant")
        trig = _producer(current, op)
        return trig.inputs[0], scaling

    emb_cos, scale_cos = table(cos4, "Cos")
    emb_sin, scale_sin = table(sin4, "Sin")
    if emb_cos is not emb_sin or scale_cos != scale_sin:
        raise _NoMatch("cos and sin are not computed from the same angles")
    concat = _producer(emb_cos, "Concat")
    axis = concat.attributes.get("axis")
    if (
        len(concat.inputs) != 2
        or concat.inputs[0] is not concat.inputs[1]
        or axis is None
        or axis.as_int() != -1
    ):
        raise _NoMatch("the rotary angles are not cat(freqs, freqs, dim=-1) (rotate-half layout)")
    freqs = concat.inputs[0]
    node = freqs.producer()
    if node is not None and node.op_type == "Mul":  # transformers 5: positions[..., None].float() * inv_freq
        for pos, inv in (node.inputs, reversed(node.inputs)):  # noqa: B007 (pos is used after the loop)
            inv_freq = _const(inv)
            if inv_freq is not None:
                break
        else:
            raise _NoMatch("the rotary frequencies are not a constant inv_freq")
        cast = _producer(pos, "Cast")
        unsqueeze = _producer(cast.inputs[0], "Unsqueeze")
        position_ids = unsqueeze.inputs[0]
        rank = len(position_ids.shape) if position_ids.shape is not None else None
        if rank is None or _ints(unsqueeze, 1) not in ([-1], [rank]):
            raise _NoMatch("the rotary positions are not position_ids[..., None]")
    elif (
        node is not None and node.op_type == "Transpose"
    ):  # (inv_freq[None, :, None] @ positions[:, None, :]).T
        if _perm(node) != [0, 2, 1]:
            raise _NoMatch("the rotary frequencies are not transposed [0, 2, 1]")
        matmul = _producer(node.inputs[0], "MatMul")
        inv = matmul.inputs[0]
        expand = inv.producer()
        if expand is not None and expand.op_type == "Expand":
            inv = expand.inputs[0]
        inv_freq = _const(inv)
        if inv_freq is None:
            raise _NoMatch("the rotary frequencies are not a constant inv_freq")
        cast = _producer(matmul.inputs[1], "Cast")
        unsqueeze = _producer(cast.inputs[0], "Unsqueeze")
        position_ids = unsqueeze.inputs[0]
        if _ints(unsqueeze, 1) != [1] or position_ids.shape is None or len(position_ids.shape) != 2:
            raise _NoMatch("the rotary positions are not position_ids[:, None, :]")
    else:
        raise _NoMatch("the rotary frequencies are neither positions * inv_freq nor inv_freq @ positions")
    if position_ids.dtype is not None and position_ids.dtype.name != "INT64":
        raise _NoMatch(f"the rotary positions are {position_ids.dtype}, not int64")
    inv_freq = inv_freq.astype(np.float32).reshape(-1)
    return _Rope(position_ids, inv_freq, scale_cos)


@dataclasses.dataclass
class _Layer:
    query: Any  # [B, S, H*Dh]
    key: Any  # [B, S, Hkv*Dh]
    value: Any
    past_key: Any  # [B, Hkv, P, Dh]
    past_value: Any
    present_key: Any  # Concat outputs (graph outputs) replaced by GQA's
    present_value: Any
    output: Any  # [B, S, H*Dh] attention output replaced by GQA's
    mask: Any  # [B|1, 1, S, T] float additive mask or None
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float | None
    rope: _Rope
    cos4: Any


def _repeated(value: Any, what: str) -> Any:
    """The cache tensor under ``repeat_kv`` (``Reshape(Expand(Unsqueeze(x, 2)))``), or ``value`` itself."""
    node = value.producer()
    if node is None or node.op_type != "Reshape":
        return value
    expand = _producer(node.inputs[0], "Expand")
    unsqueeze = _producer(expand.inputs[0], "Unsqueeze")
    if _ints(unsqueeze, 1) != [2]:
        raise _NoMatch(f"the {what} heads are not repeated through Unsqueeze(axis 2) + Expand")
    return unsqueeze.inputs[0]


def _cache_concat(value: Any, what: str) -> tuple[Any, Any]:
    concat = _producer(value, "Concat")
    axis = concat.attributes.get("axis")
    if len(concat.inputs) != 2 or axis is None or axis.as_int() not in (-2, 2):
        raise _NoMatch(f"present {what} is not Concat(past, new, axis=-2)")
    past, new = concat.inputs
    if past.shape is None or len(past.shape) != 4:
        raise _NoMatch(f"past {what} is not rank 4")
    return past, new


def _match(sdpa: Any) -> _Layer:
    """The cached-GQA subgraph ending in ``sdpa`` (an intermediate SDPA op), or :class:`_NoMatch`."""
    key_format = sdpa.attributes.get("key_format")
    if key_format is not None and key_format.as_string() != "BHSd":
        raise _NoMatch(f"SDPA key format {key_format.as_string()}")
    q_rot, k_rep, v_rep = sdpa.inputs[:3]
    mask = sdpa.inputs[3] if len(sdpa.inputs) > 3 else None
    scale_attr = sdpa.attributes.get("scale")
    scale = None if scale_attr is None else float(scale_attr.as_float())

    q_rope = _producer(q_rot, "RotaryEmbedding", _FUSION)
    present_key, present_value = _repeated(k_rep, "key"), _repeated(v_rep, "value")
    past_key, k_rot = _cache_concat(present_key, "key")
    past_value, v_heads = _cache_concat(present_value, "value")
    k_rope = _producer(k_rot, "RotaryEmbedding", _FUSION)
    for rope in (q_rope, k_rope):
        interleaved = rope.attributes.get("interleaved")
        if interleaved is not None and interleaved.as_int() != 0:
            raise _NoMatch("interleaved rotary embedding")
    if q_rope.inputs[1] is not k_rope.inputs[1] or q_rope.inputs[2] is not k_rope.inputs[2]:
        raise _NoMatch("query and key use different cos/sin")
    query, q_split = _heads_input(q_rope.inputs[0], "query")
    key, k_split = _heads_input(k_rope.inputs[0], "key")
    value, v_split = _heads_input(v_heads, "value")
    num_heads, head_size = _dim(q_split, 2), _dim(q_split, 3)
    kv_num_heads = _dim(k_split, 2)
    if _dim(v_split, 2) != kv_num_heads or _dim(k_split, 3) != head_size or _dim(v_split, 3) != head_size:
        raise _NoMatch("key/value heads differ from each other or from the query head size")
    if num_heads % kv_num_heads:
        raise _NoMatch(f"{num_heads} query heads are not a multiple of {kv_num_heads} key/value heads")
    for past in (past_key, past_value):
        if _dim(past, 1) not in (kv_num_heads, None) or _dim(past, 3) not in (
            head_size,
            None,
        ):
            raise _NoMatch(f"past cache shape {past.shape} is not [B, {kv_num_heads}, P, {head_size}]")
    for rep in (k_rep, v_rep):
        if _dim(rep, 1) not in (num_heads, None):
            raise _NoMatch(f"repeated cache shape {rep.shape} does not have {num_heads} heads")
    if mask is not None and (mask.shape is None or len(mask.shape) != 4 or _dim(mask, 1) != 1):
        raise _NoMatch(f"the attention mask is not [B|1, 1, S, T] (shape {mask.shape})")

    # the output: SDPA [B, H, S, Dh] -> Transpose -> Reshape [B, S, H*Dh]
    users = [use.node for use in sdpa.outputs[0].uses()]
    if len(users) != 1 or users[0].op_type != "Transpose" or _perm(users[0]) != [0, 2, 1, 3]:
        raise _NoMatch("the attention output is not transposed back to [B, S, H, Dh]")
    merge = [use.node for use in users[0].outputs[0].uses()]
    if len(merge) != 1 or merge[0].op_type != "Reshape":
        raise _NoMatch("the attention output is not reshaped to [B, S, H*Dh]")
    output = merge[0].outputs[0]
    if output.shape is None or len(output.shape) != 3 or _dim(output, 2) not in (num_heads * head_size, None):
        raise _NoMatch(f"the merged attention output has shape {output.shape}")

    rope = _rope_source(q_rope.inputs[1], q_rope.inputs[2])
    if rope.inv_freq.size * 2 != head_size:
        raise _NoMatch(f"{rope.inv_freq.size} rotary frequencies for head size {head_size} (partial rotary)")
    return _Layer(
        query, key, value, past_key, past_value, present_key, present_value, output, mask,
        int(num_heads), int(kv_num_heads), int(head_size), scale, rope, q_rope.inputs[1],
    )  # fmt: skip


class _Shared:
    """Inputs every GroupQueryAttention of the graph shares, built once on first use."""

    def __init__(self, tape: Any, layer: _Layer, mask: Any = None, table_rows: int | None = None) -> None:
        import onnx_ir as ir

        self.tape = tape
        op = tape.op

        def ints(values: list[int]) -> Any:
            return op("Constant", [], {"value": ir.tensor(np.asarray(values, dtype=np.int64))})

        # [B, S, ...] from the projections' input when there is one, so that the query projection
        # is not kept alive for its shape once packed into one QKV MatMul
        source = layer.query
        producer = source.producer()
        hidden = producer.inputs[0] if producer is not None and producer.op_type == "MatMul" else None
        if hidden is not None and hidden.shape is not None and len(hidden.shape) == 3:
            source = hidden
        batch = op("Shape", [source], {"start": 0, "end": 1})
        sequence = op("Shape", [source], {"start": 1, "end": 2})
        self.from_mask = mask is not None
        self.table_rows = table_rows
        if mask is None:
            past = op("Shape", [layer.past_key], {"start": 2, "end": 3})
            total = op("Add", [past, sequence])  # int64 [1]
            last = op("Cast", [op("Sub", [total, ints([1])])], {"to": ir.DataType.INT32})
            self.seqlens_k = op("Expand", [last, batch])  # int32 [B]: past + sequence - 1 for every row
        else:  # a shared past/present buffer: the filled length of each row is the mask's sum
            total = op("Shape", [mask], {"start": 1, "end": 2})  # int64 [1]
            filled = op("ReduceSum", [mask, ints([1])], {"keepdims": 0})  # int64 [B]
            self.seqlens_k = op("Cast", [op("Sub", [filled, ints([1])])], {"to": ir.DataType.INT32})
        self.total_sequence_length = op("Cast", [op("Squeeze", [total])], {"to": ir.DataType.INT32})
        # every row's new tokens are all valid: without this input ORT refuses a batch of
        # multi-token steps on a non-empty past ("batch_size must be 1 when sequence_length > 1")
        self.query_seqlens = op("Expand", [op("Cast", [sequence], {"to": ir.DataType.INT32}), batch])
        self.batch_sequence = op("Concat", [batch, sequence], {"axis": 0})
        self._ints = ints
        self._tables: dict[int, tuple[Any, Any, Any]] = {}

    def rotary(self, layer: _Layer) -> tuple[Any, Any, Any]:
        """``(position_ids [B, S] int64, cos_cache, sin_cache [rows, Dh / 2])`` for ``layer``'s rotary
        (``rows``: ``max(position_ids) + 1`` and at least the total length, or ``table_rows``)."""
        import onnx_ir as ir

        key = id(layer.cos4)
        if key in self._tables:
            return self._tables[key]
        op, rope = self.tape.op, layer.rope
        positions = rope.position_ids
        if positions.shape is not None and len(positions.shape) == 1:  # [S] shared by every row
            positions = op(
                "Expand",
                [op("Unsqueeze", [positions, self._ints([0])]), self.batch_sequence],
            )
        # rows 0 .. max(position_ids), at least total_sequence_length of them; or a constant count
        # (the runtime's whole context): the tables are then constant, folded once by ONNX Runtime
        rows = (
            op("Constant", [], {"value_int": self.table_rows})
            if self.table_rows
            else op(
                "Max",
                [
                    op(
                        "Add",
                        [
                            op("ReduceMax", [positions], {"keepdims": 0}),
                            op("Constant", [], {"value_int": 1}),
                        ],
                    ),
                    op("Cast", [self.total_sequence_length], {"to": ir.DataType.INT64}),
                ],
            )
        )
        start = op("Constant", [], {"value_int": 0})
        step = op("Constant", [], {"value_int": 1})
        grid = op("Cast", [op("Range", [start, rows, step])], {"to": ir.DataType.FLOAT})
        grid = op("Unsqueeze", [grid, self._ints([1])])  # [M, 1]
        inv_freq = op("Constant", [], {"value": ir.tensor(rope.inv_freq.reshape(1, -1))})
        angles = op("Mul", [grid, inv_freq])  # [M, Dh / 2], the product eager computes
        cos, sin = op("Cos", [angles]), op("Sin", [angles])
        if rope.scaling != 1.0:
            factor = op("Constant", [], {"value": ir.tensor(np.float32(rope.scaling))})
            cos, sin = op("Mul", [cos, factor]), op("Mul", [sin, factor])
        dtype = layer.query.dtype
        if dtype is not None and dtype != ir.DataType.FLOAT:
            cos, sin = (
                op("Cast", [cos], {"to": dtype}),
                op("Cast", [sin], {"to": dtype}),
            )
        self._tables[key] = (positions, cos, sin)
        return self._tables[key]


def _packed_projection(tape: Any, layer: _Layer) -> Any:
    """``MatMul(x, [Wq | Wk | Wv])`` when query, key and value are ``MatMul(x, W)`` of one ``x`` with
    constant 2-D weights used nowhere else, else ``None``: GroupQueryAttention takes the packed
    ``[B, S, (H + 2 Hkv) Dh]`` projection as its query (key and value omitted)."""

    nodes = [v.producer() for v in (layer.query, layer.key, layer.value)]
    if any(n is None or n.op_type != "MatMul" for n in nodes):
        return None
    x = nodes[0].inputs[0]
    weights = [_const(n.inputs[1]) for n in nodes]
    if any(n.inputs[0] is not x for n in nodes) or any(w is None or w.ndim != 2 for w in weights):
        return None
    if any(len(n.inputs[1].uses()) != 1 for n in nodes) or len({w.shape[0] for w in weights}) != 1:
        return None
    if len({w.dtype for w in weights}) != 1:
        return None
    from hfexport_onnx.matmul_packing import concatenated_weight

    # computed when read: no stored copy of the q/k/v weights next to the model's own
    weight = concatenated_weight([n.inputs[1] for n in nodes], f"{nodes[0].inputs[1].name}_qkv")
    tape.graph_like.register_initializer(weight)
    return tape.op("MatMul", [x, weight])


def _finite_bias(tape: Any, mask: Any) -> Any:
    """``max(mask, lowest)``: the mask's ``-inf`` as the dtype's lowest finite value.

    ``GroupQueryAttention`` adds the bias to the scores and takes the softmax; a row masked
    everywhere (a left-padding query position) would give NaN there, and NaN keys/values of those
    positions would then poison the next layers. With a finite bias such a row gets a finite
    average instead (the unfused graph's ``IsNaN``/``Where`` gives zeros: only padding rows differ).
    """
    import onnx_ir as ir

    dtype = mask.dtype.numpy() if mask.dtype is not None else np.float32
    lowest = np.asarray(np.finfo(dtype).min, dtype=dtype)
    return tape.op("Max", [mask, tape.op("Constant", [], {"value": ir.tensor(lowest)})])


def fuse_cached_gqa(model: Any, *, rotary: str = "gqa", lengths: str | None = None) -> int:
    """Rewrite attention over a concatenated KV cache into ``com.microsoft.GroupQueryAttention``, in place.

    Args:
        model: an ``onnx_ir.Model`` on which onnxscript's ``fuse_rotary_embedding`` and
            ``fuse_sdpa`` ran (their intermediate ``RotaryEmbedding``/``SDPA`` ops are the anchors).
        rotary: ``"gqa"`` (``do_rotary=1`` inside the op, with ``position_ids``; the query, key
            and value projections packed into one MatMul when they can be) or ``"separate"``
            (``com.microsoft.RotaryEmbedding`` on query and key, then the op on unpacked inputs).
        lengths: where ``seqlens_k`` and ``total_sequence_length`` come from: ``"past"`` (the past
            cache's shape; the model's mask as ``attention_bias``) or ``"attention_mask"`` (the
            ``attention_mask`` input, no ``attention_bias``: see :func:`attention_mask_lengths`);
            ``None``: ``"attention_mask"`` inside :func:`attention_mask_lengths`, else ``"past"``.
            ``"attention_mask"`` falls back to ``"past"`` (logged) when the graph has no
            ``attention_mask`` input.

    Returns:
        The number of attention layers rewritten (0 when none has the form in the module docstring;
        why each SDPA did not match is logged at debug level).

    Raises:
        ValueError: an unknown ``rotary`` or ``lengths`` mode.

    The replaced nodes are left for dead-code elimination (the ``present`` graph outputs now come
    from the GroupQueryAttention nodes, under their old names).
    """
    import onnx_ir as ir

    if rotary not in ROTARY_MODES:
        raise ValueError(f"rotary={rotary!r} is invalid; allowed: {', '.join(ROTARY_MODES)}")
    lengths = _LENGTHS.get() if lengths is None else lengths
    if lengths not in LENGTH_SOURCES:
        raise ValueError(f"lengths={lengths!r} is invalid; allowed: {', '.join(LENGTH_SOURCES)}")
    graph = model.graph
    layers: list[_Layer] = []
    for node in graph:
        if node.op_type == "SDPA" and node.domain == _FUSION:
            try:
                layers.append(_match(node))
            except _NoMatch as exc:
                logger.debug("no GroupQueryAttention for %s: %s", node.name, exc)
    if not layers:
        return 0
    mask = None
    if lengths == "attention_mask":
        mask = next((v for v in graph.inputs if v.name == ATTENTION_MASK), None)
        if mask is None:
            logger.info(
                "no %s input: GroupQueryAttention lengths from the past's shape",
                ATTENTION_MASK,
            )
    tape = ir.tape.Tape(graph)
    shared = _Shared(tape, layers[0], mask, _TABLE_ROWS.get() if mask is not None else None)
    outputs = {id(v): i for i, v in enumerate(graph.outputs)}
    for layer in layers:
        positions, cos, sin = shared.rotary(layer)
        query, key = layer.query, layer.key
        attrs: dict[str, Any] = {
            "num_heads": layer.num_heads,
            "kv_num_heads": layer.kv_num_heads,
        }
        if layer.scale is not None:
            attrs["scale"] = layer.scale
        value = layer.value
        if rotary == "separate":
            query = tape.op(
                "RotaryEmbedding",
                [query, positions, cos, sin],
                {"num_heads": layer.num_heads},
                domain=_MS,
            )
            key = tape.op(
                "RotaryEmbedding",
                [key, positions, cos, sin],
                {"num_heads": layer.kv_num_heads},
                domain=_MS,
            )
            rotary_inputs = [None, None, None]
        else:
            attrs.update(do_rotary=1, rotary_interleaved=0)
            rotary_inputs = [cos, sin, positions]
            packed = _packed_projection(tape, layer)
            if packed is not None:  # one MatMul for query, key and value
                query, key, value = packed, None, None
        bias = None
        if layer.mask is not None and not shared.from_mask:
            bias = _finite_bias(tape, layer.mask)
        inputs = [query, key, value, layer.past_key, layer.past_value, shared.seqlens_k]
        inputs += [shared.total_sequence_length, *rotary_inputs, bias]
        if QUERY_SEQLENS:
            inputs += [None] * 5 + [shared.query_seqlens]  # head_sink, k/v scales, q/k norms: unused
        while inputs[-1] is None:
            inputs.pop()
        out, present_key, present_value = tape.op_multi_out(
            "GroupQueryAttention", inputs, attrs, num_outputs=3, domain=_MS
        )
        for old, new in (
            (layer.output, out),
            (layer.present_key, present_key),
            (layer.present_value, present_value),
        ):
            new.shape, new.type = old.shape, old.type
            index = outputs.get(id(old))
            if index is not None:  # a graph output keeps its name
                name = old.name
                old.name = f"{name}_unfused"
                graph.outputs[index] = new
                new.name = name
            old.replace_all_uses_with(new)
    model.opset_imports.setdefault(_MS, 1)
    graph.sort()
    return len(layers)
