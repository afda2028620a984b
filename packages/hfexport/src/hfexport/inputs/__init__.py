"""Turn sample forward kwargs into inputs that ``torch.export`` can trace, reversibly.

An export takes forward kwargs (``model(**inputs)``). Before tracing them:

- the loss/training path is refused (``labels``, ``future_values``, ``return_loss=True``, ...);
- output flags (``use_cache``, ``output_attentions``, ``output_hidden_states``,
  ``return_dict``) are lifted out of the kwargs, to be applied to the config for the duration
  of the export with :func:`apply_output_flags` (python bools are not graph inputs);
- floating point tensors are cast to the model's dtype, every tensor goes to its device;
- data-dependent inputs that tracing cannot compute are precomputed by the preparers
  registered with :func:`register_export_input_preparer`.

The context managers :func:`apply_output_flags`, :func:`attention_for_export` and
:func:`restore_model_state` change the model only inside their ``with`` body and put back the
exact previous state on exit, also when the body raises.

The package has one module per concept; this module re-exports their public names:
:mod:`~hfexport.inputs.prepare` (:func:`prepare_for_export`, :func:`precompute_export_inputs`),
:mod:`~hfexport.inputs.flags` (:func:`apply_output_flags`), :mod:`~hfexport.inputs.attention`
(:func:`attention_for_export`), :mod:`~hfexport.inputs.state` (:func:`restore_model_state`) and
:mod:`~hfexport.inputs.config_undo` (the config bookkeeping they share). The preparer registry
lives in :mod:`hfexport.workarounds.input_preparers`; its functions are re-exported here too.
"""

from __future__ import annotations

from hfexport.inputs.attention import attention_for_export
from hfexport.inputs.flags import OUTPUT_FLAG_KEYS, apply_output_flags
from hfexport.inputs.prepare import LOSS_INPUT_KEYS, precompute_export_inputs, prepare_for_export
from hfexport.inputs.state import restore_model_state
from hfexport.workarounds.input_preparers import (
    ExportInputPreparer,
    register_export_input_preparer,
    registered_export_input_preparers,
    unregister_export_input_preparer,
)

__all__ = [
    "LOSS_INPUT_KEYS",
    "OUTPUT_FLAG_KEYS",
    "ExportInputPreparer",
    "apply_output_flags",
    "attention_for_export",
    "precompute_export_inputs",
    "prepare_for_export",
    "register_export_input_preparer",
    "registered_export_input_preparers",
    "restore_model_state",
    "unregister_export_input_preparer",
]
