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
_SUMMARY = re.compile(r"Conversion is failed for:\s*(?P<ops>[^\n]+)")


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

    Attributes:
        nodes: ``[(fx_node_name, op)]`` OpenVINO names as failed (``[("cat_3", "aten.cat.default")]``),
            empty when its message names none.
        ops: the op names OpenVINO's summary lists (``["aten.cat.default"]``).
    """

    def __init__(self, message: str, *, stage: str, component: str | None = None, detail: str = "") -> None:
        self.nodes = failed_nodes(detail)
        summary = _SUMMARY.search(detail)
        self.ops = [op.strip() for op in summary.group("ops").split(",")] if summary else []
        if self.nodes:
            message += "; failed FX node(s): " + ", ".join(f"{node} ({op})" for node, op in self.nodes)
        elif self.ops:
            message += "; failed op(s): " + ", ".join(self.ops)
        super().__init__(message, stage=stage, component=component)
