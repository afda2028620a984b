"""Errors of ``hfexport-openvino`` (all :class:`hfexport.errors.HfExportError` subclasses)."""

from __future__ import annotations

import re

from hfexport.errors import ExportStageError, UnsupportedModelError

__all__ = ["DeviceUnavailableError", "OpenvinoConversionError", "StatefulExportError", "failed_nodes"]


class DeviceUnavailableError(ValueError):
    """The configured OpenVINO device is not present, or does not support the precision hint.

    Raised before capture; the message lists ``openvino.Core().available_devices`` and the device's
    supported precisions.
    """


class StatefulExportError(UnsupportedModelError):
    """A stateful export was asked of a model that has no KV cache (or is not decoder-only)."""


# "Exception happened during conversion of operation cat_3/aten.cat.default with schema ..."
_OP_FAILURE = re.compile(r"conversion of operation (?P<node>[^\s/]+)/(?P<op>[\w.:]+)")
# "-- aten.cat.default with a message:" / "-- No conversion rule found for operations: aten.foo.default"
_SUMMARY = re.compile(
    r"(?:Conversion is failed for|No conversion rule found for operations):\s*(?P<ops>[^\n]+)"
)


def failed_nodes(message: str) -> list[tuple[str, str]]:
    """``[(fx_node_name, op)]`` named by an OpenVINO ``OpConversionFailure`` message, in order.

    >>> failed_nodes("... during conversion of operation cat_3/aten.cat.default with schema NONE")
    [('cat_3', 'aten.cat.default')]
    """
    seen: list[tuple[str, str]] = []
    for match in _OP_FAILURE.finditer(message):
        pair = (match.group("node"), match.group("op"))
        if pair not in seen:
            seen.append(pair)
    return seen


class OpenvinoConversionError(ExportStageError):
    """``openvino.convert_model`` rejected the captured program.

    Args:
        detail: OpenVINO's ``OpConversionFailure`` message.
        graph_nodes: ``{op: [fx node names]}`` of the converted program, to name the nodes of ops
            OpenVINO reports without a node ("No conversion rule found for operations: ...").

    Attributes:
        nodes: ``[(fx_node_name, op)]`` OpenVINO names as failed (``[("cat_3", "aten.cat.default")]``),
            empty when its message names none.
        ops: the op names OpenVINO's summary lists (``["aten.cat.default"]``).
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        component: str | None = None,
        detail: str = "",
        graph_nodes: dict[str, list[str]] | None = None,
    ) -> None:
        self.nodes = failed_nodes(detail)
        self.ops = []
        for summary in _SUMMARY.finditer(detail):
            self.ops += [op.strip() for op in summary.group("ops").split(",") if op.strip() not in self.ops]
        if not self.nodes and graph_nodes:  # "no conversion rule" names ops only: find their FX nodes
            self.nodes = [(node, op) for op in self.ops for node in graph_nodes.get(op, [])]
        if self.nodes:
            message += "; failed FX node(s): " + ", ".join(f"{node} ({op})" for node, op in self.nodes)
        elif self.ops:
            message += "; failed op(s): " + ", ".join(self.ops)
        super().__init__(message, stage=stage, component=component)
