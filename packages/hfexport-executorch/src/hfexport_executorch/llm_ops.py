"""ExecuTorch's LLM custom ops in our programs: a KV cache written by ``llama::update_cache`` and
attention computed by ``llama::custom_sdpa`` (issue 27).

ExecuTorch 1.4.1 ships these operators in ``executorch/extension/llm/custom_ops``: importing
``executorch.extension.llm.custom_ops.custom_ops`` loads ``libcustom_ops_aot_lib``, which registers
the ATen ops ``torch.ops.llama.*`` (with the meta kernels torch.export needs) **and** their
ExecuTorch out-variants (``llama::custom_sdpa.out``, ``llama::update_cache.out``, ...) in the
ExecuTorch runtime of the same process (``_portable_lib``, which ``TextLLMRunner``'s extension links
too). The wheel's runtime does not register them by itself: a process that runs such a program
loads the library first (:func:`load_runtime_kernels`; ExecuTorch's own C++ ``llama_main`` links
``custom_ops``).

The operator contracts, read in ``extension/llm/custom_ops/custom_ops.py`` (meta kernels) and
``op_sdpa.cpp`` / ``op_update_cache.cpp`` of executorch 1.4.1:

- ``update_cache(value [B, S, H, D], cache [B, T, H, D], start_pos: SymInt) -> Tensor``: writes
  ``value`` into ``cache[:, start_pos:start_pos + S]`` in place (the returned tensor is a dummy);
  requires ``start_pos + S <= T``;
- ``custom_sdpa(query [B, S, Hq, D], k_cache [B, T, Hkv, D], v_cache, start_pos, attn_mask=None,
  dropout_p=0, is_causal=False, scale=None) -> [B, S, Hq, D]``: attention of the ``S`` queries
  at positions ``start_pos ..`` over cache positions ``0 .. start_pos + S - 1`` only (causal when
  ``is_causal``), grouped-query when ``Hq`` is a multiple of ``Hkv``; fp32 / bf16 / fp16.

Note the layout: sequence before heads (``[B, S, H, D]``), where transformers' attention works on
``[B, H, S, D]``. The transform here (:func:`custom_op_attention`) keeps the model's code and
swaps two of its seams for the duration of an export:

- the cache layers of :class:`hfexport_executorch.layouts.llm_runner.RunnerProgram` become
  :class:`UpdateCacheLayer` (buffers ``[1, T, Hkv, D]``, written by ``update_cache``);
- the model's attention implementation becomes :data:`ATTENTION_NAME`, registered in transformers'
  ``AttentionInterface`` as :func:`custom_sdpa_attention` (``custom_sdpa`` over the whole cache,
  causal from ``start_pos``); no mask is built for that name (the op masks itself).

What ExecuTorch's own ``export_llm`` does instead (``examples/models/llama/source_transformation/
sdpa.py``: ``replace_sdpa_with_custom_op``, ``custom_kv_cache.py``: ``replace_kv_cache_with_custom_kv_cache``)
is a module swap on its own Llama definition; ours works on transformers' models.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from hfexport import registry

__all__ = [
    "ATTENTION_NAME",
    "INT8_CACHE_KERNELS",
    "KIND",
    "KV_CACHE_LAYERS",
    "RUNTIME_KERNELS",
    "CustomOpsUnavailableError",
    "Int8UpdateCacheLayer",
    "UpdateCacheLayer",
    "custom_op_attention",
    "custom_op_refusal",
    "custom_sdpa_attention",
    "custom_sdpa_transform",
    "load_export_ops",
    "load_runtime_kernels",
    "missing_runtime_kernels",
    "source_transform_entries",
    "update_cache_transform",
]

#: transformers ``AttentionInterface`` name of :func:`custom_sdpa_attention` (no mask function: none is built).
ATTENTION_NAME = "hfexport_executorch_custom_sdpa"

#: Registry kind of our ExecuTorch source transforms (listed by ``hfexport patches``).
KIND = "executorch_source_transform"

#: ExecuTorch runtime kernels a program written with the custom ops calls.
RUNTIME_KERNELS = ("llama::update_cache.out", "llama::custom_sdpa.out")

_CUSTOM_OPS_MODULE = "executorch.extension.llm.custom_ops.custom_ops"
_VERSIONS = {"executorch": ">=1.4"}
# where the op contracts and ExecuTorch's own swaps live (no bug: a reference, not a workaround)
_REFERENCE = "https://github.com/pytorch/executorch/tree/v1.4.1/extension/llm/custom_ops"

registry.register_kind(
    KIND,
    description="transform(model) swapping a transformers model's computation for ExecuTorch LLM custom ops",
    targets="ExecuTorch operators produced",
)


class CustomOpsUnavailableError(RuntimeError):
    """The ExecuTorch install cannot provide the LLM custom ops (export side or runtime kernels)."""


@registry.register(
    KIND,
    "executorch",
    "llama::update_cache",
    description=(
        "RunnerProgram's KV cache as [1, positions, kv heads, head dim] buffers written by llama::update_cache "
        "(what executorch/examples/models/llama/source_transformation/custom_kv_cache.py does to its own Llama)"
    ),
    issue=_REFERENCE,
    versions=_VERSIONS,
)
def update_cache_transform(program: Any, kv_cache_dtype: str | None = None) -> int:
    """Swap every cache layer of a ``RunnerProgram`` for an :class:`UpdateCacheLayer` (in place), or an
    :class:`Int8UpdateCacheLayer` for ``kv_cache_dtype="int8"``.

    Args:
        program: a :class:`hfexport_executorch.layouts.llm_runner.RunnerProgram` built with
            ``custom_ops=True`` (it calls this itself).
        kv_cache_dtype: ``None`` (the model's dtype) or ``"int8"`` (:data:`KV_CACHE_LAYERS`).

    Returns:
        The number of layers swapped.

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype not in KV_CACHE_LAYERS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid; allowed: None, 'int8'")
    kind = KV_CACHE_LAYERS[kv_cache_dtype]
    swapped = 0
    for i, layer in enumerate(program.cache.layers):
        batch, heads, positions, head_dim = layer.keys.shape
        new = kind(positions, batch, heads, head_dim, layer.keys.dtype, layer.keys.device)
        program.cache.layers[i] = new
        swapped += 1
    return swapped


@registry.register(
    KIND,
    "executorch",
    "llama::custom_sdpa",
    description=(
        "transformers attention over the cache as llama::custom_sdpa (causal from start_pos, grouped-query), "
        "no mask built (what executorch/examples/models/llama/source_transformation/sdpa.py does to its own Llama)"
    ),
    issue=_REFERENCE,
    versions=_VERSIONS,
)
def custom_sdpa_transform(model: Any) -> str:
    """Register :func:`custom_sdpa_attention` in transformers and return its name
    (:data:`ATTENTION_NAME`); :func:`custom_op_attention` sets it on the model."""
    from transformers import AttentionInterface

    # no AttentionMaskInterface entry: transformers then builds no mask for this name
    # (masking_utils._preprocess_mask_arguments exits early), and the op masks causally itself
    AttentionInterface.register(ATTENTION_NAME, custom_sdpa_attention)
    return ATTENTION_NAME


def source_transform_entries() -> list[registry.RegistryEntry]:
    """The registered ExecuTorch source transforms (this module's two)."""
    return registry.entries(kind=KIND)


# -- availability -------------------------------------------------------------------------------
def load_export_ops() -> None:
    """Import ExecuTorch's custom-op module so ``torch.ops.llama.update_cache`` / ``custom_sdpa`` exist
    (with meta kernels for torch.export) and their runtime kernels are registered in this process.

    Raises:
        CustomOpsUnavailableError: the module or its library is missing from the executorch install;
            export with ``ExecutorchConfig(custom_ops=False)`` (``--no-custom-ops``) instead.
    """
    try:
        importlib.import_module(_CUSTOM_OPS_MODULE)
        torch.ops.llama.update_cache.default  # noqa: B018 (raises when not registered)
        torch.ops.llama.custom_sdpa.default  # noqa: B018
    except (ImportError, AttributeError, AssertionError, OSError, RuntimeError) as exc:
        raise CustomOpsUnavailableError(
            f"ExecuTorch's LLM custom ops cannot be loaded ({type(exc).__name__}: {exc}): this executorch install has "
            f"no {_CUSTOM_OPS_MODULE} / libcustom_ops_aot_lib; export with --no-custom-ops "
            "(ExecutorchConfig(custom_ops=False))"
        ) from exc


def missing_runtime_kernels(names: tuple[str, ...] = RUNTIME_KERNELS) -> list[str]:
    """The ExecuTorch runtime kernels of ``names`` not registered in this process (after
    :func:`load_runtime_kernels`), ``[]`` when all are."""
    from executorch.extension.pybindings import portable_lib

    registered = set(portable_lib._get_operator_names())
    return [name for name in names if name not in registered]


def load_runtime_kernels() -> list[str]:
    """Register the custom ops' ExecuTorch kernels in this process's runtime without importing the
    export stack: ``torch.ops.load_library`` of the ``libcustom_ops_aot_lib`` shipped next to
    ``executorch.extension.llm.custom_ops`` (it links the same ``_portable_lib`` as
    ``TextLLMRunner``).

    Returns:
        The kernels of :data:`RUNTIME_KERNELS` still missing afterwards (``[]`` on success).

    Raises:
        CustomOpsUnavailableError: the library is not in the executorch install.
    """
    import importlib.util
    from pathlib import Path

    if not missing_runtime_kernels():
        return []
    spec = importlib.util.find_spec("executorch")
    base = Path(next(iter(spec.submodule_search_locations or ()), "")) if spec else None
    libs = sorted((base / "extension" / "llm" / "custom_ops").glob("*custom_ops_aot_lib.*")) if base else []
    if not libs:
        raise CustomOpsUnavailableError(
            "this executorch install has no extension/llm/custom_ops/libcustom_ops_aot_lib: the program calls "
            f"{', '.join(RUNTIME_KERNELS)}; re-export it with --no-custom-ops"
        )
    torch.ops.load_library(str(libs[0]))
    return missing_runtime_kernels()


def custom_op_refusal(model: Any) -> str | None:
    """Why the custom ops cannot replace ``model``'s attention, or ``None`` when they can.

    Refused: attention modules that do not dispatch through transformers' ``AttentionInterface``
    (``config._attn_implementation``), sliding-window layers (``custom_sdpa`` attends to every
    cached position), attention logit soft-capping or sink logits (the op has neither), key and
    value head sizes that differ.
    """
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_attn_softcapping", None):
        return f"{name} soft-caps its attention logits, which llama::custom_sdpa does not"
    types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in types):
        return f"{name} has sliding-window layers; llama::custom_sdpa attends to every cached position"
    if not types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{name} has a sliding window; llama::custom_sdpa attends to every cached position"
    dispatching = 0
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx"):
            if hasattr(module, "sinks"):
                return f"{name}'s attention has sink logits, which llama::custom_sdpa does not take"
            try:
                source = inspect.getsource(type(module).forward)
            except (OSError, TypeError):
                source = ""
            if "ALL_ATTENTION_FUNCTIONS" not in source:
                return (
                    f"{type(module).__name__} does not dispatch its attention through transformers' "
                    "AttentionInterface, so llama::custom_sdpa cannot replace it"
                )
            dispatching += 1
    if not dispatching:
        return f"{name} has no attention module with a layer_idx that dispatches through AttentionInterface"
    head_dim = getattr(config, "head_dim", None)
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and head_dim is not None and v_head_dim != head_dim:
        return f"{name}'s value heads ({v_head_dim}) differ from its key heads ({head_dim})"
    return None


# -- the transform ------------------------------------------------------------------------------
def custom_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of transformers' ``AttentionInterface`` signature computed by ``llama::custom_sdpa``.

    Args:
        module: the attention module (unused).
        query: ``[B, Hq, S, D]`` (transformers' layout).
        key / value: the whole cache as :class:`UpdateCacheLayer` returns it, ``[B, T, Hkv, D]``.
        attention_mask: ignored (``None``: the op is causal from ``start_pos`` and transformers builds
            no mask for an attention name without a mask function).
        scaling: the softmax scale (``None``: ``1/sqrt(D)``).
        kwargs: must hold ``hfexport_start_pos``, the position of the first query (an int or SymInt),
            and, for an :class:`Int8UpdateCacheLayer` cache, ``hfexport_cache`` (the ``Cache``; the
            layer is ``module.layer_idx``'s, whose ``attend`` runs ``llama::custom_quantized_sdpa``).

    Returns:
        ``(output [B, S, Hq, D], None)``, the layout transformers' attention functions return.

    Raises:
        KeyError: ``hfexport_start_pos`` (or ``hfexport_cache``) was not passed (the model was not called by a
            ``RunnerProgram`` built with the custom ops).
    """
    start = kwargs["hfexport_start_pos"]
    q = query.transpose(1, 2)
    dtype = q.dtype
    if key.dtype == torch.int8:
        layer = kwargs["hfexport_cache"].layers[module.layer_idx]
        return layer.attend(q, start, scaling).to(dtype), None
    if key.dtype != dtype:
        q = q.to(key.dtype)
    out = torch.ops.llama.custom_sdpa(q, key, value, start, None, 0.0, True, scaling)
    return out.to(dtype), None


class UpdateCacheLayer(CacheLayerMixin):
    """A static KV-cache layer in ExecuTorch's custom-op layout, written by ``llama::update_cache``.

    Args:
        positions: cache positions ``T``.
        batch / heads / head_dim: ``B``, ``Hkv``, ``D`` of the model's key/value states.
        dtype / device: of the cache tensors.

    Attributes:
        keys / values: ``[B, T, Hkv, D]`` tensors (the ``RunnerProgram`` registers them as buffers and
            assigns its own before each call).
        start_pos: the write position of the next ``update`` (set by the ``RunnerProgram`` per call).

    ``update(key_states [B, Hkv, S, D], value_states, *args) -> (keys, values)`` writes the states at
    ``start_pos`` and returns the whole cache, the form :func:`custom_sdpa_attention` reads.
    """

    is_compileable = True
    is_sliding = False
    #: tensors the RunnerProgram registers as buffers per layer (attribute -> buffer name prefix)
    BUFFERS = {"keys": "k_cache", "values": "v_cache"}

    def __init__(
        self, positions: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: Any
    ) -> None:
        super().__init__()
        self.max_cache_len = int(positions)
        self.keys = torch.zeros(batch, positions, heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, positions, heads, head_dim, dtype=dtype, device=device)
        self.start_pos: Any = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.llama.update_cache(key_states.transpose(1, 2), self.keys, self.start_pos)
        torch.ops.llama.update_cache(value_states.transpose(1, 2), self.values, self.start_pos)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the tensors are allocated in ``__init__``."""


def _quantize_per_token(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``value [B, S, H, D]`` float -> ``(int8 values, fp32 scales [B, S, H, 1], int8 zero points)``,
    asymmetric over ``D`` per (token, head): ExecuTorch's ``quantized_decomposed`` per-token ops."""
    ops = torch.ops.quantized_decomposed
    scales, zeros = ops.choose_qparams_per_token_asymmetric.default(value, torch.int8)
    quantized = ops.quantize_per_token(value, scales, zeros, -128, 127, torch.int8)
    return quantized, scales.to(torch.float32), zeros.to(torch.int8)


class Int8UpdateCacheLayer(UpdateCacheLayer):
    """:class:`UpdateCacheLayer` holding int8 keys/values (``--kv-cache-dtype int8``).

    Keys and values are quantized per (token, head) over the head dim, asymmetric (ExecuTorch's
    ``quantized_decomposed.choose_qparams_per_token_asymmetric`` / ``quantize_per_token``); the int8
    tensors, their fp32 scales and int8 zero points (``[B, T, Hkv, 1]``) are written by
    ``llama::update_cache``, and :meth:`attend` quantizes the queries the same way and runs
    ``llama::custom_quantized_sdpa`` (integer dot products, float softmax). The layout of ExecuTorch's
    ``QuantizedKVCache`` + ``QuantizedSDPA`` (``examples/models/llama/source_transformation/
    custom_kv_cache.py`` / ``sdpa.py``, executorch 1.4.1): a quarter of the fp32 cache memory.

    Attributes:
        keys / values: int8 ``[B, T, Hkv, D]``; ``k_scales`` / ``v_scales`` fp32 and ``k_zeros`` /
            ``v_zeros`` int8, ``[B, T, Hkv, 1]``.
    """

    BUFFERS = {
        "keys": "k_cache",
        "values": "v_cache",
        "k_scales": "k_cache_scales",
        "v_scales": "v_cache_scales",
        "k_zeros": "k_cache_zeros",
        "v_zeros": "v_cache_zeros",
    }

    def __init__(
        self, positions: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: Any
    ) -> None:
        super().__init__(positions, batch, heads, head_dim, torch.int8, device)
        side = (batch, positions, heads, 1)
        self.k_scales = torch.ones(side, dtype=torch.float32, device=device)
        self.v_scales = torch.ones(side, dtype=torch.float32, device=device)
        self.k_zeros = torch.zeros(side, dtype=torch.int8, device=device)
        self.v_zeros = torch.zeros(side, dtype=torch.int8, device=device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for states, cache, scales, zeros in (
            (key_states, self.keys, self.k_scales, self.k_zeros),
            (value_states, self.values, self.v_scales, self.v_zeros),
        ):
            quantized, new_scales, new_zeros = _quantize_per_token(states.transpose(1, 2).float())
            torch.ops.llama.update_cache(quantized, cache, self.start_pos)
            torch.ops.llama.update_cache(new_scales, scales, self.start_pos)
            torch.ops.llama.update_cache(new_zeros, zeros, self.start_pos)
        return self.keys, self.values

    def attend(self, query: torch.Tensor, start_pos: Any, scaling: float | None) -> torch.Tensor:
        """``llama::custom_quantized_sdpa`` of ``query [B, S, Hq, D]`` (float) over this cache, causal
        from ``start_pos``; returns float32 ``[B, S, Hq, D]``."""
        q, q_scales, q_zeros = _quantize_per_token(query.float())
        return torch.ops.llama.custom_quantized_sdpa(
            q,
            self.keys,
            self.values,
            start_pos,
            None,
            0.0,
            True,
            scaling,
            q_zeros,
            q_scales,
            self.k_zeros,
            self.k_scales,
            self.v_zeros,
            self.v_scales,
        )


#: ``ExecutorchConfig.kv_cache_dtype`` values -> cache layer class (``None``: the model's dtype).
KV_CACHE_LAYERS: dict[str | None, type[UpdateCacheLayer]] = {
    None: UpdateCacheLayer,
    "int8": Int8UpdateCacheLayer,
}

#: Runtime kernels an int8-cache program calls besides :data:`RUNTIME_KERNELS`.
INT8_CACHE_KERNELS = (
    "llama::custom_quantized_sdpa.out",
    "quantized_decomposed::choose_qparams_per_token_asymmetric.out",
    "quantized_decomposed::quantize_per_token.out",
)


@contextlib.contextmanager
def custom_op_attention(model: Any) -> Iterator[str]:
    """Within the block, ``model`` computes its attention with :func:`custom_sdpa_attention`.

    Sets ``config._attn_implementation`` (of the model's config and every sub-config that has one)
    to :data:`ATTENTION_NAME` and restores the previous values on exit, also on error.

    Yields:
        The attention name.

    Raises:
        CustomOpsUnavailableError: the custom ops cannot be loaded (:func:`load_export_ops`).
        ValueError: :func:`custom_op_refusal` refuses the model.
    """
    reason = custom_op_refusal(model)
    if reason is not None:
        raise ValueError(reason)
    load_export_ops()
    name = custom_sdpa_transform(model)
    configs = [
        m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    ]
    seen: dict[int, Any] = {}
    for config in configs:
        seen.setdefault(id(config), (config, config._attn_implementation))
    try:
        for config, _ in seen.values():
            config._attn_implementation = name
        yield name
    finally:
        for config, previous in seen.values():
            config._attn_implementation = previous
