"""Workarounds installed while ``hfexport-dynamo`` traces a model (``register_patch("dynamo", ...)``).

Each patch is a factory ``original -> replacement`` registered with
:func:`hfexport.registry.register_patch`; :class:`~hfexport_dynamo.exporter.DynamoExporter` installs
the active ones for the ``torch.export`` capture only (the eager model used for validation runs the
original code) and the registry puts the originals back afterwards, also when the export fails.

- the core's shared dense experts patch (:mod:`hfexport.workarounds.moe`), for the ``"eager"``
  implementation only: mixture-of-experts layers whose ``"eager"`` implementation loops over the
  experts the sample routed to (``nonzero()`` on the router output) run a dense computation over
  every expert instead, so every expert stays in the graph whatever the routing.
- the core's recurrences (:mod:`hfexport.workarounds.recurrences`, ``form="scan"``): Mamba's
  selective scan, RWKV's time mixing and RecurrentGemma's RG-LRU as torch's scan higher-order op
  instead of per-token loops the capture unrolls; Mamba2's chunk scan on whole chunks.

The ``torch.export`` faults every backend meets (the sliding-window cache slice, size-1 dynamic
batch axes) are worked around by the core capture itself, see :mod:`hfexport.workarounds.torch_export`.

Under the scoped ``"dynamo.load"`` key (installed by :func:`hfexport_dynamo.load` around
``torch.export.load`` when the caller trusts the file):

- :func:`fallback_warning_with_its_arguments`: torch's weights-only fallback warning is formatted
  with the arguments it has instead of raising inside logging.

Under the scoped ``"dynamo.save"`` key (installed by :func:`hfexport_dynamo.save` around
``torch.export.save``):

- :func:`weights_written_from_their_storage`: each weight is written into the ``.pt2`` from its own
  storage instead of through two whole-tensor copies.
"""

from __future__ import annotations

import logging
from typing import Any

from hfexport.registry import register_patch
from hfexport.workarounds.moe import register_dense_experts
from hfexport.workarounds.recurrences import register_recurrences

__all__ = [
    "LOAD_KEY",
    "SAVE_KEY",
    "fallback_warning_with_its_arguments",
    "weights_written_from_their_storage",
]

#: Registry key of the patches :func:`hfexport_dynamo.load` installs (a scope of ``"dynamo"``).
LOAD_KEY = "dynamo.load"
#: Registry key of the patches :func:`hfexport_dynamo.save` installs (a scope of ``"dynamo"``).
SAVE_KEY = "dynamo.save"

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Mixture of experts: the core's shared dense forward, for the "eager" loop only (a .pt2 runs
# transformers' grouped_mm implementation as it is)
# --------------------------------------------------------------------------------------------

register_dense_experts("dynamo", every_implementation=False)

# Recurrences (mamba selective scan, RWKV time mixing, RG-LRU): torch's scan higher-order op, which a
# .pt2 runs as it is, instead of a per-token loop that capture unrolls (issue 28)
register_recurrences("dynamo", form="scan")


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


# --------------------------------------------------------------------------------------------
# Saving (installed by hfexport_dynamo.save around torch.export.save)
# --------------------------------------------------------------------------------------------


class _StorageRecord:
    """A weight's CPU storage standing in for its ``bytes`` between torch's two archive helpers."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage


@register_patch(
    SAVE_KEY,
    "torch.export.pt2_archive._package._get_raw_tensor_bytes",
    "torch.export.pt2_archive._package.PT2ArchiveWriter.write_bytes",
    description=(
        "write each weight of a .pt2 from its own storage: torch.export.save copies every weight into a "
        "bytes object, which the archive writer's binding copies again"
    ),
    # no upstream issue found for torch.export.save; the same two copies were removed from AOTInductor's
    # weight writing in pytorch/pytorch#180684
    issue="https://github.com/pytorch/pytorch/pull/180684",
    versions={"torch": ">=2.10"},
)
def weights_written_from_their_storage(original: Any) -> Any:
    """Replace ``_get_raw_tensor_bytes`` and ``PT2ArchiveWriter.write_bytes`` while saving.

    ``torch.export.save`` turns each weight into ``bytes`` (one copy of the tensor) and hands them
    to ``PyTorchFileWriter.write_record``, whose binding takes a ``std::string`` (a second copy):
    the peak of a save is the model plus twice its largest weight (Qwen3-0.6B: +1.23 GB over the
    model, its 0.62 GB tied embedding twice). ``write_record`` also takes a storage and writes it
    from its own memory: ``_get_raw_tensor_bytes`` returns the CPU tensor's storage instead of
    bytes, and ``write_bytes`` passes such a storage on (anything else as before). Same archive,
    byte for byte; measured: +0.0 GB over the model instead of +1.23 GB.
    """
    name = getattr(original, "__name__", "")
    if name == "write_bytes":

        def write_bytes(self: Any, archive_name: str, data: Any) -> None:
            if isinstance(data, _StorageRecord):
                self.archive_file.write_record(archive_name, data.storage, data.storage.nbytes())
                return
            original(self, archive_name, data)

        write_bytes.__wrapped__ = original  # type: ignore[attr-defined]
        return write_bytes

    def raw_tensor_bytes(value: Any) -> Any:
        import torch

        plain = type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)  # not fake
        if plain and value.device.type == "cpu" and value.untyped_storage().nbytes():
            return _StorageRecord(value.untyped_storage())
        return original(value)

    raw_tensor_bytes.__wrapped__ = original  # type: ignore[attr-defined]
    return raw_tensor_bytes
