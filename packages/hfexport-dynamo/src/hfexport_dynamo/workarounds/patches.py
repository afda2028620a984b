"""Workarounds installed while ``hfexport-dynamo`` traces a model (``register_patch("dynamo", ...)``).

Each patch is a factory ``original -> replacement`` registered with
:func:`hfexport.registry.register_patch`; :class:`~hfexport_dynamo.exporter.DynamoExporter` installs
the active ones for the ``torch.export`` capture only (the eager model used for validation runs the
original code) and the registry puts the originals back afterwards, also when the export fails.

- the core's shared dense experts patch (:mod:`hfexport.workarounds.moe`), for the ``"eager"``
  implementation only: mixture-of-experts layers whose ``"eager"`` implementation loops over the
  experts the sample routed to (``nonzero()`` on the router output) run a dense computation over
  every expert instead, so every expert stays in the graph whatever the routing.

The ``torch.export`` faults every backend meets (the sliding-window cache slice, size-1 dynamic
batch axes) are worked around by the core capture itself, see :mod:`hfexport.workarounds.capture`.

Under the scoped ``"dynamo.load"`` key (installed by :func:`hfexport_dynamo.load` around
``torch.export.load`` when the caller trusts the file):

- :func:`fallback_warning_with_its_arguments`: torch's weights-only fallback warning is formatted
  with the arguments it has instead of raising inside logging.
"""

from __future__ import annotations

import logging
from typing import Any

from hfexport.registry import register_patch
from hfexport.workarounds.moe import register_dense_experts

__all__ = ["LOAD_KEY", "fallback_warning_with_its_arguments"]

#: Registry key of the patches :func:`hfexport_dynamo.load` installs (a scope of ``"dynamo"``).
LOAD_KEY = "dynamo.load"

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Mixture of experts: the core's shared dense forward, for the "eager" loop only (a .pt2 runs
# transformers' grouped_mm implementation as it is)
# --------------------------------------------------------------------------------------------

register_dense_experts("dynamo", every_implementation=False)


# --------------------------------------------------------------------------------------------
# Loading (installed by hfexport_dynamo.load with trust_remote_code=True only)
# --------------------------------------------------------------------------------------------


class _FallbackWarningLogger:
    """Proxy of torch's serde logger whose weights-only fallback warning formats correctly."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if (
            isinstance(msg, str)
            and msg.startswith("Fallback to weights_only=False")
            and msg.count("%s") > len(args)
        ):
            msg = msg.rsplit(" after initial failure", 1)[0] + " after the weights-only load failed"
        self._logger.warning(msg, *args, **kwargs)


@register_patch(
    LOAD_KEY,
    "torch._export.serde.serialize.log",
    description=(
        "format torch's 'Fallback to weights_only=False' warning, which passes one argument for two %s "
        "(a logging error, raised by handlers such as pytest's)"
    ),
    issue="https://github.com/pytorch/pytorch/pull/189679",
    versions={"torch": ">=2.12,<2.15"},
)
def fallback_warning_with_its_arguments(original: logging.Logger) -> Any:
    """Wrap the module logger of ``torch._export.serde.serialize`` (see :class:`_FallbackWarningLogger`).

    ``deserialize_torch_artifact`` logs ``"... Loaded object of type %s after initial failure: %s"``
    with one argument: formatting the record raises ``TypeError`` inside logging, which prints a
    "Logging error" traceback, or fails the load where a handler re-raises. Only reached when a
    file is loaded with ``trust_remote_code=True`` and its sample inputs need full unpickling.
    """
    return _FallbackWarningLogger(original)
