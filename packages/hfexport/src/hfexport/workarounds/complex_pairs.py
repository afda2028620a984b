"""Complex-valued computation of a captured program, rewritten as real (real, imaginary) pairs.

Some rotary embeddings are written with complex numbers (transformers 5.24: deepseek_v2, llama4,
llama4_text): ``torch.polar`` builds the rotation, ``torch.view_as_complex`` reads each pair of
query/key features as one complex number, a complex multiplication rotates it and
``torch.view_as_real`` turns it back. Runtimes without complex tensors (ExecuTorch's portable
kernels and XNNPACK) cannot run such a program although its inputs and outputs are real.

:func:`complex_as_real_pairs` gives every complex value of the program the layout
``torch.view_as_real`` gives it (a real tensor with a trailing axis of size 2) and rewrites the
operations on it into real operations on that layout: ``view_as_complex`` and ``view_as_real``
become the identity, ``polar(r, t)`` becomes ``stack([r * cos(t), r * sin(t)], -1)``, a complex
product becomes the four real products, and shape operations (``unsqueeze``, ``slice``) shift
negative axes past the pair axis. The rewrite is all or nothing: a program with a complex
operation outside that set, a complex input, buffer or output, is left as it was. A backend
registers it with :func:`hfexport.registry.register_fx_program_fix` under its own key, naming
its upstream cause.

Values are those of eager PyTorch up to float rounding (the complex product is computed with the
same four products and two sums).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hfexport.workarounds.fx_nodes import insert_call

__all__ = ["SUPPORTED_COMPLEX_TARGETS", "complex_as_real_pairs"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten

#: complex-valued operations :func:`complex_as_real_pairs` rewrites (anything else leaves the program as is)
SUPPORTED_COMPLEX_TARGETS = frozenset(
    {
        _aten.polar.default,
        _aten.view_as_complex.default,
        _aten.view_as_real.default,
        _aten.mul.Tensor,
        _aten.unsqueeze.default,
        _aten.slice.Tensor,
        _aten.clone.default,
        _aten.to.dtype_layout,
        _aten.to.dtype,
        _aten._to_copy.default,
        _aten._assert_tensor_metadata.default,
    }
)

_PAIR_DTYPE = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _is_complex(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _touches_complex(node: torch.fx.Node) -> bool:
    if _is_complex(node.meta.get("val")):
        return True
    return any(_is_complex(a.meta.get("val")) for a in node.all_input_nodes)


def _pair_axis(dim: int) -> int:
    """An axis of a complex tensor, as an axis of its pair layout (negative axes step past the pair axis)."""
    return dim - 1 if dim < 0 else dim


class _Builder:
    """Inserts real ``call_function`` nodes before ``anchor`` (:func:`hfexport.workarounds.fx_nodes.insert_call`)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node) -> None:
        self.graph, self.anchor = graph, anchor

    def __call__(self, target: Callable[..., Any], *args: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            return insert_call(self.graph, target, args, like=self.anchor)


def _complex_product(build: _Builder, a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
    a_re, a_im = build(_aten.select.int, a, -1, 0), build(_aten.select.int, a, -1, 1)
    b_re, b_im = build(_aten.select.int, b, -1, 0), build(_aten.select.int, b, -1, 1)
    real = build(_aten.sub.Tensor, build(_aten.mul.Tensor, a_re, b_re), build(_aten.mul.Tensor, a_im, b_im))
    imag = build(_aten.add.Tensor, build(_aten.mul.Tensor, a_re, b_im), build(_aten.mul.Tensor, a_im, b_re))
    return build(_aten.stack.default, [real, imag], -1)


def _rewrite(
    node: torch.fx.Node, pairs: dict[torch.fx.Node, torch.fx.Node], build: _Builder
) -> torch.fx.Node | None:
    """The pair-layout node standing for complex ``node`` (None for a node that only checks metadata)."""
    target, args = node.target, node.args
    if target is _aten._assert_tensor_metadata.default:
        return None
    if target is _aten.view_as_complex.default:
        return args[0]
    if target is _aten.polar.default:
        magnitude, angle = args[0], args[1]
        real = build(_aten.mul.Tensor, magnitude, build(_aten.cos.default, angle))
        imag = build(_aten.mul.Tensor, magnitude, build(_aten.sin.default, angle))
        return build(_aten.stack.default, [real, imag], -1)
    source = pairs[args[0]] if isinstance(args[0], torch.fx.Node) and args[0] in pairs else None
    if target is _aten.mul.Tensor:
        left, right = args[0], args[1]
        if (
            isinstance(left, torch.fx.Node)
            and left in pairs
            and isinstance(right, torch.fx.Node)
            and right in pairs
        ):
            return _complex_product(build, pairs[left], pairs[right])
        complex_side, other = (
            (left, right) if isinstance(left, torch.fx.Node) and left in pairs else (right, left)
        )
        if isinstance(other, torch.fx.Node):  # a real tensor scales both parts
            other = build(_aten.unsqueeze.default, other, -1)
        return build(_aten.mul.Tensor, pairs[complex_side], other)
    if source is None:
        raise NotImplementedError(f"{target} on a complex value it did not produce from a pair")
    if target is _aten.unsqueeze.default:
        return build(_aten.unsqueeze.default, source, _pair_axis(int(args[1])))
    if target is _aten.slice.Tensor:
        rest = list(args[1:])
        if rest:
            rest[0] = _pair_axis(int(rest[0]))
        return build(_aten.slice.Tensor, source, *rest)
    if target is _aten.clone.default:
        return build(_aten.clone.default, source)
    # to / _to_copy: a complex result keeps the pair (dtype checked by the caller); a real one is not supported
    return source


def _supported(node: torch.fx.Node) -> bool:
    if node.target not in SUPPORTED_COMPLEX_TARGETS:
        return False
    value = node.meta.get("val")
    if node.target in (_aten.to.dtype_layout, _aten.to.dtype, _aten._to_copy.default):
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        # only a complex-to-same-complex conversion (transformers' ``.to(x.device)`` on the rotation)
        return _is_complex(value) and _is_complex(source) and value.dtype == source.dtype
    if node.target is _aten.mul.Tensor:
        return _is_complex(value) and value.dtype in _PAIR_DTYPE
    return True


def complex_as_real_pairs(exported_program: torch.export.ExportedProgram) -> int:
    """Rewrite the complex-valued computation of ``exported_program`` into real pairs, in place.

    Args:
        exported_program: a captured program (ATen level, before a backend's lowering). Its
            inputs, parameters, buffers and outputs must be real.

    Returns:
        The number of complex-valued nodes replaced; 0 when there were none, or when one of them
        is outside :data:`SUPPORTED_COMPLEX_TARGETS` (the program is then left unchanged and the
        operation named in the debug log), or when a placeholder or output is complex.

    Raises:
        Whatever an inserted operation raises on its fake values (a shape the rewrite did not
        expect). Every node is checked against the supported set before any is rewritten, but
        such an error mid-rewrite leaves the program partly rewritten: discard it (the exporter's
        ``fx_program_fixes`` stage fails the export).
    """
    gm = exported_program.graph_module
    graph = gm.graph
    complex_nodes = [n for n in graph.nodes if n.op == "call_function" and _touches_complex(n)]
    if not complex_nodes:
        return 0
    if any(n.op in ("placeholder", "get_attr") and _is_complex(n.meta.get("val")) for n in graph.nodes):
        logger.debug("complex placeholders: the program keeps its complex values")
        return 0
    output = next(n for n in graph.nodes if n.op == "output")
    if any(_is_complex(a.meta.get("val")) for a in output.all_input_nodes):
        logger.debug("complex outputs: the program keeps its complex values")
        return 0
    unsupported = sorted({str(n.target) for n in complex_nodes if not _supported(n)})
    if unsupported:
        logger.debug("complex operations without a pair rewrite: %s", ", ".join(unsupported))
        return 0
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in complex_nodes:
        if node.target is _aten.view_as_real.default:
            node.replace_all_uses_with(pairs[node.args[0]])
            continue
        replacement = _rewrite(node, pairs, _Builder(graph, node))
        if replacement is not None:
            pairs[node] = replacement
    for node in reversed(complex_nodes):
        if node.target is _aten._assert_tensor_metadata.default or not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return len(complex_nodes)
