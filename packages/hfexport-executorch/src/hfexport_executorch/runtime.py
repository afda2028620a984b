"""Run an ExecuTorch program in the ExecuTorch runtime (``executorch.runtime``) on forward kwargs.

:class:`ExecutorchRunner` loads the serialized program (``.pte`` bytes or file) with
``Runtime.get().load_program``, flattens forward kwargs in the order of the exported program's
input spec, executes the method, and maps the flat list of outputs back to the eager output's
leaf paths (``logits``, ``past_key_values.layers.0.keys``) through the program's output spec.

Kernel libraries: the ExecuTorch Python runtime registers the portable (``aten::*``) kernels only.
The quantized kernels (``quantized_decomposed::embedding_byte`` / ``embedding_4bit`` ..., which a
program with quantized embeddings calls) are registered by importing ``executorch.kernels.quantized``
(it loads ``libquantized_ops_aot_lib``, which registers their ExecuTorch out-variants in the same
runtime). :func:`load_program` reads the operator namespaces a program names and imports the library
it needs first; a deploying C++ runtime must link the same kernels (``quantized_ops_lib``, CMake
``EXECUTORCH_BUILD_KERNELS_QUANTIZED=ON``). Likewise the LLM custom ops (``llama::update_cache`` /
``llama::custom_sdpa`` of the ``llm-runner`` layout) are registered by importing
``executorch.extension.llm.custom_ops.custom_ops`` (``libcustom_ops_aot_lib``; CMake
``EXECUTORCH_BUILD_KERNELS_LLM=ON``).
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.pytree import register_cache_pytrees
from hfexport.tensors import get_leaf_tensors

__all__ = [
    "BOUND_REMEDY",
    "KERNEL_LIBRARIES",
    "ExecutorchRunner",
    "LoadedMethod",
    "ensure_kernel_libraries",
    "load_method",
    "load_program",
    "program_operators",
]

logger = logging.getLogger(__name__)

#: how to export a program that takes larger inputs, named in the runner's bound error: the memory
#: budget (which narrows hfexport's default bounds; its command-line form first) or an explicit bound
BOUND_REMEDY = (
    "a larger memory budget when report.dynamic_bounds says the bound was narrowed by the memory budget "
    "(`hfexport export executorch --max-dynamic-bytes 4GiB ...`, or ExecutorchConfig(max_dynamic_bytes=...) "
    "in Python), else a Dim(max=...) in ExecutorchConfig.dynamic_shapes"
)


def _program_bytes(program: Any) -> bytes | str:
    if isinstance(program, (bytes, bytearray)):
        return bytes(program)
    if isinstance(program, (str, os.PathLike)):
        return os.fspath(program)
    buffer = getattr(program, "buffer", None)
    if buffer is None:
        raise TypeError(
            f"ExecutorchRunner takes an ExecutorchProgramManager, .pte bytes or a .pte path, got {type(program).__name__}"
        )
    return buffer


#: Operator namespace -> the module whose import registers its kernels in the ExecuTorch Python
#: runtime (they are not among the portable kernels the runtime starts with).
KERNEL_LIBRARIES: dict[str, str] = {
    "quantized_decomposed": "executorch.kernels.quantized",
    # ExecuTorch's LLM custom ops (llama::update_cache, llama::custom_sdpa; hfexport_executorch.llm_ops)
    "llama": "executorch.extension.llm.custom_ops.custom_ops",
}

# Operator names as the program's flatbuffer stores them (UTF-8 strings; the overload is a separate string).
_OPERATOR_NAME = re.compile(
    rb"(" + b"|".join(re.escape(ns.encode()) for ns in KERNEL_LIBRARIES) + rb")::[A-Za-z0-9_]+"
)


def program_operators(source: bytes | str | os.PathLike[str]) -> set[str]:
    """Operator names (``"quantized_decomposed::embedding_byte"``) of the namespaces in
    :data:`KERNEL_LIBRARIES` that a serialized program (``.pte`` bytes or path) names.

    The program's flatbuffer stores each operator name as a plain string, so the bytes are scanned
    (memory-mapped for a path); a constant that happened to contain such a name would only make
    :func:`ensure_kernel_libraries` import a library the program does not need.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return {m.group(0).decode() for m in _OPERATOR_NAME.finditer(source)}
    with open(os.fspath(source), "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return set()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {m.group(0).decode() for m in _OPERATOR_NAME.finditer(data)}


def ensure_kernel_libraries(source: bytes | str | os.PathLike[str]) -> list[str]:
    """Register the kernel libraries the program needs (:data:`KERNEL_LIBRARIES`) in this process's
    ExecuTorch runtime, before it is loaded.

    Args:
        source: the ``.pte`` bytes or path.

    Returns:
        The modules imported for it (``["executorch.kernels.quantized"]``), ``[]`` when the program
        needs none.

    Raises:
        RuntimeError: after the import, an operator the program names is still not registered (an
            executorch build without the quantized kernels); the message names the operators.
    """
    from executorch.runtime import Runtime

    needed = program_operators(source)
    if not needed:
        return []
    imported = []
    for namespace in sorted({name.split("::")[0] for name in needed}):
        module = KERNEL_LIBRARIES[namespace]
        importlib.import_module(module)
        imported.append(module)
    registered = {name.split(".")[0] for name in Runtime.get().operator_registry.operator_names}
    missing = sorted(needed - registered)
    if missing:
        raise RuntimeError(
            f"the ExecuTorch program calls {', '.join(missing)}, which the runtime in this process does not "
            f"register even after importing {', '.join(imported)}; install an executorch build that ships the "
            "kernels (executorch/kernels/quantized/libquantized_ops_aot_lib for quantized_decomposed, "
            "executorch/extension/llm/custom_ops/libcustom_ops_aot_lib for llama), or export without "
            "quantization.embedding_bits / with --no-custom-ops"
        )
    return imported


class LoadedMethod:
    """A method of a loaded ExecuTorch program that keeps its program alive.

    ExecuTorch 1.4.1's Python ``Method`` holds no reference to the ``Program`` it came from, and
    only the ``Program`` holds the ``.pte`` bytes the method points into: after
    ``Runtime.get().load_program(data).load_method(name)`` the program is freed and ``execute``
    reads freed memory (an intermittent segmentation fault; no upstream issue found). This wrapper
    holds both. It is not an attribute on the method: the program caches its methods, so a
    reference back would make a cycle that only the cyclic garbage collector frees, and a test run
    kept every program's planned memory until then (two workers killed for memory at 18-22 GB).

    ``execute(inputs)`` and ``metadata`` are the method's; other attributes are looked up on it.
    """

    __slots__ = ("_method", "_program")

    def __init__(self, method: Any, program: Any) -> None:
        self._method = method
        self._program = program

    def execute(self, inputs: Sequence[Any]) -> Sequence[Any]:
        """The method's ``execute``: the flat list of inputs in, the flat list of outputs back."""
        return self._method.execute(inputs)

    @property
    def metadata(self) -> Any:
        """The method's ``MethodMeta`` (input and output tensor sizes, dtypes, planned memory)."""
        return self._method.metadata

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)


def load_method(program: Any, name: str = "forward") -> LoadedMethod | None:
    """``program.load_method(name)``, with what the runtime prints to stderr meanwhile routed to
    the ``executorch.native`` logger while the CLI routes native output
    (:func:`hfexport.native_output.captured_stderr`): loading the first XNNPACK method creates the
    thread pool, and ExecuTorch 1.4.1 then prints five ``[cpuinfo_utils.cpp:...]`` Info lines
    (``Failed to open midr file ...``, ``CPU info and manual query on # of cpus dont match.``) that
    no runtime setting silences (the level is fixed at build time; no upstream issue found).

    Returns:
        The method as a :class:`LoadedMethod`, which keeps ``program`` alive as long as it is
        used; ``None`` when the program has no such method.
    """
    from hfexport.native_output import captured_stderr

    with captured_stderr("executorch"):
        method = program.load_method(name)
    return None if method is None else LoadedMethod(method, program)


def load_program(source: bytes | str | os.PathLike[str]) -> Any:
    """``executorch.runtime.Runtime.get().load_program(source)`` after
    :func:`ensure_kernel_libraries` (``.pte`` bytes or path); returns the runtime ``Program``."""
    from executorch.runtime import Runtime

    ensure_kernel_libraries(source)
    return Runtime.get().load_program(source)


def _planned_input_sizes(method: Any) -> list[tuple[int, ...] | None]:
    """Upper-bound sizes of each tensor input of a loaded method (``None`` for non-tensor inputs)."""
    meta = method.metadata
    sizes: list[tuple[int, ...] | None] = []
    for index in range(meta.num_inputs()):
        try:
            sizes.append(tuple(int(s) for s in meta.input_tensor_meta(index).sizes()))
        except Exception:  # not a tensor input
            sizes.append(None)
    return sizes


def _leaf_paths(kwargs: Mapping[str, Any]) -> list[str]:
    """Dotted paths (``input_ids``, ``past_key_values.0``) of the flattened ``((), kwargs)`` leaves."""
    leaves, _ = pytree.tree_flatten_with_path(((), dict(kwargs)))
    paths = []
    for key_path, _leaf in leaves:
        parts = []
        for entry in key_path[1:]:
            for attr in ("key", "idx", "name"):
                if hasattr(entry, attr):
                    parts.append(str(getattr(entry, attr)))
                    break
        paths.append(".".join(parts) or "input")
    return paths


class ExecutorchRunner:
    """Callable running an ExecuTorch program: forward kwargs -> ``{output leaf path: tensor}``.

    Args:
        program: an ``ExecutorchProgramManager``, the ``.pte`` bytes, or a path to a ``.pte`` file.
        in_spec: the pytree spec of the exported program's inputs, ``((), {kwarg: ...})``
            (``ExportedProgram.call_spec.in_spec``).
        out_spec: the pytree spec of its outputs (``ExportedProgram.call_spec.out_spec``).
        method: the method to run.
        required_backend: a delegate backend the program needs in the runtime
            (``"XnnpackBackend"``); checked on first call.
        output_flags: ``{flag: value}`` the program was exported with (``use_cache`` ...: constant
            inputs of the program, which the runtime requires and checks); a call may leave them
            out (they are filled in) or pass them (each is checked first, with an error naming
            it). ``None``: the program's own (:func:`hfexport.inputs.flags.program_output_flags`)
            when ``program`` is a program manager, else none.

    The program is loaded on first call and kept. Outputs are cloned: the runtime returns
    tensors backed by its planned memory, which the next call overwrites.
    """

    def __init__(
        self,
        program: Any,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        *,
        method: str = "forward",
        required_backend: str | None = None,
        output_flags: Mapping[str, Any] | None = None,
    ) -> None:
        if output_flags is None and hasattr(program, "exported_program"):
            from hfexport.inputs.flags import program_output_flags

            output_flags = program_output_flags(program.exported_program(method))
        self.output_flags = dict(output_flags or {})
        self._source = _program_bytes(program)
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.method_name = method
        self.required_backend = required_backend
        self._method: Any = None
        self._planned_sizes: list[tuple[int, ...] | None] = []

    @classmethod
    def from_manager(
        cls, manager: Any, *, method: str = "forward", required_backend: str | None = None
    ) -> ExecutorchRunner:
        """Runner for an ``ExecutorchProgramManager``, with the specs of its exported program."""
        spec = manager.exported_program(method).call_spec
        return cls(manager, spec.in_spec, spec.out_spec, method=method, required_backend=required_backend)

    @property
    def input_names(self) -> list[str]:
        """The forward kwargs the program takes, in order."""
        if self.in_spec.num_children != 2:
            return []
        child = getattr(self.in_spec, "child", None)
        kwargs_spec = child(1) if callable(child) else self.in_spec.children_specs[1]
        context = kwargs_spec.context
        return list(context) if isinstance(context, list) else []

    def _load(self) -> Any:
        if self._method is None:
            from executorch.runtime import Runtime

            runtime = Runtime.get()
            if self.required_backend and not runtime.backend_registry.is_available(self.required_backend):
                raise RuntimeError(
                    f"the ExecuTorch runtime in this process has no {self.required_backend} registered (available: "
                    f"{runtime.backend_registry.registered_backend_names}); install an executorch build that includes "
                    "it, or export with validate=False and run the program where that backend exists"
                )
            program = load_program(self._source)
            method = load_method(program, self.method_name)
            if method is None:
                raise RuntimeError(f"the ExecuTorch program has no method {self.method_name!r}")
            from hfexport.native_output import captured_stderr

            # the runtime logs "input: N is not Tensor" for each non-tensor input (output flags)
            with captured_stderr("executorch"):
                self._planned_sizes = _planned_input_sizes(method)
            self._method = method
        return self._method

    def _check_sizes(self, kwargs: Mapping[str, Any], flat: list[Any]) -> None:
        paths = _leaf_paths(kwargs)
        for index, value in enumerate(flat):
            planned = self._planned_sizes[index] if index < len(self._planned_sizes) else None
            if planned is None or not isinstance(value, torch.Tensor):
                continue
            name = paths[index] if index < len(paths) else f"input {index}"
            if value.dim() != len(planned):
                raise ValueError(
                    f"{name} has {value.dim()} dimensions, the program takes {len(planned)} (planned shape {list(planned)})"
                )
            for axis, (size, limit) in enumerate(zip(value.shape, planned)):
                if size > limit:
                    raise ValueError(
                        f"{name} dimension {axis} is {size}, above the upper bound {limit} this program was "
                        f"memory-planned for (planned shape {list(planned)}); export again with a larger bound: "
                        f"{BOUND_REMEDY}"
                    )

    def program_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``kwargs`` as the program takes them: the output flags it was exported with filled in
        when left out (:func:`hfexport.inputs.flags.fill_output_flags`), and flags it does not
        take (a program exported without them) dropped.

        Raises:
            hfexport.errors.UnsupportedInputError: a flag differs from its exported value.
        """
        from hfexport.inputs.flags import OUTPUT_FLAG_KEYS, fill_output_flags

        filled = fill_output_flags(kwargs, self.output_flags)
        names = set(self.input_names)
        return {k: v for k, v in filled.items() if k not in OUTPUT_FLAG_KEYS or k in names or not names}

    def flatten_inputs(self, kwargs: Mapping[str, Any]) -> list[Any]:
        """Flatten forward kwargs into the program's positional input list.

        Raises:
            ValueError: the kwargs do not have the structure the program was exported with (other
                names, a missing input, a cache of another layout); the message lists both.
            hfexport.errors.UnsupportedInputError: an output flag differs from its exported value.
        """
        kwargs = self.program_kwargs(kwargs)
        names = self.input_names
        if names and set(names) == set(kwargs):
            kwargs = {k: kwargs[k] for k in names}
        flat, spec = pytree.tree_flatten(((), dict(kwargs)))
        if spec != self.in_spec:
            raise ValueError(
                f"inputs {sorted(kwargs)} do not match the structure the program was exported with "
                f"(inputs {names or self.in_spec}); pass the same forward kwargs, with the same cache layout, "
                "as the sample inputs"
            )
        return [v.contiguous() if isinstance(v, torch.Tensor) else v for v in flat]

    def __call__(self, kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run the program on forward kwargs.

        Returns:
            ``{leaf path: tensor}`` named like :func:`hfexport.tensors.get_leaf_tensors` names the
            eager output.

        Raises:
            ValueError: see :meth:`flatten_inputs`; or an input is larger than the upper bound the
                program was memory-planned for (the message names the input, axis and bound).
            hfexport.errors.UnsupportedInputError: an output flag differs from its exported value.
            RuntimeError: the runtime lacks the required backend, or execution failed.
        """
        register_cache_pytrees()
        kwargs = self.program_kwargs(kwargs)
        flat = self.flatten_inputs(kwargs)
        method = self._load()
        self._check_sizes(kwargs, flat)
        from hfexport.native_output import captured_stderr

        # kernels log argument checks to stderr as they run (executorch 1.4.1: mixed_linear's
        # "Expected tensor.dim() to be 1, but got 2" for a valid per-group scale, every call)
        with captured_stderr("executorch"):
            outputs = method.execute(flat)
        cloned = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
        structured = pytree.tree_unflatten(cloned, self.out_spec)
        return get_leaf_tensors(structured)
