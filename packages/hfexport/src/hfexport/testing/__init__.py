"""Test helpers shared by the hfexport packages: tiny seeded models and the shared regression cases.

* :func:`tiny_model` builds a small random-weight model of any architecture transformers knows plus
  forward kwargs for it, or the model of a shared case (``"case:C09"``); the tiny models and
  :func:`make_inputs` are core features (:mod:`hfexport.tiny`, :mod:`hfexport.sample_inputs`),
  re-exported here by :mod:`hfexport.testing.zoo`;
* :func:`load_case` / :func:`list_cases` read the shared ``*.toml`` cases and build their models
  and inputs (:mod:`hfexport.testing.cases`).

Nothing here downloads anything: every model is built from a configuration.
"""

from __future__ import annotations

from hfexport.testing.cases import (
    CASES_DIR_ENV,
    Case,
    find_cases_dir,
    list_cases,
    load_case,
    tiny_model_from_case,
)
from hfexport.testing.zoo import (
    SUPPORTED_MODEL_TYPES,
    TASK_TO_AUTO_CLASS,
    TinyModelUnavailable,
    UnknownModelTypeError,
    auto_class_name,
    check_runs_eagerly,
    default_task,
    known_model_types,
    make_inputs,
    modality,
    shrunk_config,
    supported_tasks,
    tiny_model,
)

__all__ = [
    "CASES_DIR_ENV",
    "SUPPORTED_MODEL_TYPES",
    "TASK_TO_AUTO_CLASS",
    "Case",
    "TinyModelUnavailable",
    "UnknownModelTypeError",
    "auto_class_name",
    "check_runs_eagerly",
    "default_task",
    "find_cases_dir",
    "known_model_types",
    "list_cases",
    "load_case",
    "make_inputs",
    "modality",
    "shrunk_config",
    "supported_tasks",
    "tiny_model",
    "tiny_model_from_case",
]
