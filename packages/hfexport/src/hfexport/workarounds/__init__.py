"""The core's workarounds, one module per concept, all entries of :mod:`hfexport.registry`.

- :mod:`hfexport.workarounds.torch_export`: patches installed around every ``torch.export`` capture
  (key ``"capture"``), whichever backend asked for it;
- :mod:`hfexport.workarounds.time_series`: the time-series forecasters' capture patches (autoformer /
  informer masks, ``torch.distributions`` checks, TimesFM's batch of series), key ``"capture"`` too;
- :mod:`hfexport.workarounds.text_to_audio`: the text-to-audio models' capture patches (FastSpeech 2's
  length regulator), key ``"capture.text_to_audio"``;
- :mod:`hfexport.workarounds.detection`: the object detectors' capture patches (OmDet-Turbo's
  token-keyed language cache, anchors and query selection; the RT-DETR family's ``len`` batch;
  ``take_along_dim`` as ``gather``), key ``"capture.detection"``;
- :mod:`hfexport.workarounds.dense_prediction`: the dense-prediction heads' capture patches (DPT's
  patch grid), key ``"capture.dense_prediction"``;
- :mod:`hfexport.workarounds.text_encoders`: the text encoders' capture patches (Funnel's relative
  positions from sizes, CANINE's local attention in blocks), key ``"capture.text_encoders"``;
- :mod:`hfexport.workarounds.text_classification`: the BART/T5-family sequence-classification heads'
  capture patch (the last ``</s>`` pooled by position), key ``"capture.text_classification"``;
- :mod:`hfexport.side_probe` registers the ``"side_probe"`` patches, in place while the image-side
  probe runs the model on fake tensors;
- :mod:`hfexport.workarounds.generation`: patches installed while the generation components are
  recorded (key ``"generation"``);
- :mod:`hfexport.workarounds.input_preparers`: the ``"input_preparer"`` kind (data-dependent inputs
  precomputed before capture, key ``"inputs"``) and :func:`register_export_input_preparer`;
- :mod:`hfexport.workarounds.moe`: the dense mixture-of-experts forward every backend that cannot
  run transformers' data-dependent experts loop registers under its own key;
- :mod:`hfexport.workarounds.assertions`: the program fix erasing runtime assertions and the
  computation only they use, which every backend whose runtime cannot run assertions registers
  under its own key.

Importing this package imports none of them (so it stays cheap); :func:`load` does.
"""

from __future__ import annotations

import importlib

__all__ = ["CORE_KEYS", "CORE_MODULES", "load"]

#: Registry keys the core itself applies; ``hfexport patches --stale`` judges their entries
#: against the version ranges the ``hfexport`` distribution declares.
CORE_KEYS: tuple[str, ...] = (
    "capture",
    "capture.time_series",
    "capture.text_to_audio",
    "capture.detection",
    "capture.dense_prediction",
    "capture.text_encoders",
    "capture.text_classification",
    "side_probe",
    "generation",
    "inputs",
)

#: Modules whose import registers the core's built-in entries.
CORE_MODULES: tuple[str, ...] = (
    "hfexport.workarounds.torch_export",
    "hfexport.workarounds.time_series",
    "hfexport.workarounds.text_to_audio",
    "hfexport.workarounds.detection",
    "hfexport.workarounds.dense_prediction",
    "hfexport.workarounds.text_encoders",
    "hfexport.workarounds.text_classification",
    "hfexport.side_probe",
    "hfexport.workarounds.generation",
    "hfexport.workarounds.input_preparers",
    "hfexport.generation.vision_inputs",
)


def load() -> None:
    """Import every core workaround module, registering the core's built-in entries."""
    for name in CORE_MODULES:
        importlib.import_module(name)
