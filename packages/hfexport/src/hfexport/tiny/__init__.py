"""Tiny, seeded, random-weight Hugging Face models: the CLI's ``--model tiny:TYPE`` and the tests' zoo.

Any model type transformers knows (``transformers.CONFIG_MAPPING``) gets a tiny model: its default
configuration is shrunk generically (:mod:`hfexport.tiny.shrink`), with per-type overrides kept
as data (:mod:`hfexport.tiny.presets`). A type whose tiny model cannot be built, or cannot run
eagerly on the derived inputs, raises :class:`TinyModelUnavailable` naming the stage and the reason
(it is not an export failure).

Modules: :mod:`hfexport.tiny.catalog` (model types, tasks, shrunk configurations),
:mod:`hfexport.tiny.models` (:func:`tiny_model`); the sample inputs are
:func:`hfexport.sample_inputs.make_inputs`. ``hfexport.testing`` re-exports all of it for tests and
adds the shared regression cases (``tiny_model("case:C09")``).

The nineteen hand-written presets (:data:`SUPPORTED_MODEL_TYPES`) are described below; every
supported architecture there gets a *shrunk* configuration (hidden size 32-64, two layers, a
vocabulary of 256 tokens, a handful of heads, small images and audio) so that a model builds in a
fraction of a second and has well under two million parameters, while keeping the structural
features that make exporting it interesting: grouped-query attention, sliding windows, partial
rotary embeddings, mixture-of-experts routing, relative position buckets, learned position
offsets, multimodal rotary positions.

Shape limits that matter to callers:

* every text model accepts sequences of at least 256 tokens (``max_position_embeddings`` and
  friends are >= 448 wherever the architecture has such a limit);
* gemma2 keeps its alternating sliding/full attention with ``sliding_window = 32``: sequences up
  to 32 tokens never reach the window, longer ones exercise the sliding mask;
* mistral keeps its default ``sliding_window = 4096``, so the window never applies in tests;
* whisper's encoder takes exactly ``2 * max_source_positions = 64`` mel frames of 16 bins; its
  decoder accepts up to 448 tokens;
* vit takes 32x32 RGB images cut into 8x8 patches (16 patches plus the class token);
* wav2vec2's raw audio length is derived from the requested number of output frames;
* qwen2_vl always gets one image of 4x4 patches (four merged image tokens) in a 12-token prompt;
* classification heads have 3 labels (so their output never looks like a batch of 2); question
  answering heads have the 2 their start and end logits need;
* mixtral keeps transformers' default experts implementation (``grouped_mm`` in 5.24).

Special token ids are kept inside the vocabulary (pad 0, bos 1, eos 2 for most models; the
architecture's own small defaults where they already fit), and random token ids are drawn from
``[3, vocab_size)`` so that the sample inputs never contain special tokens by accident.
"""

from __future__ import annotations

from hfexport.tiny.catalog import (
    SUPPORTED_MODEL_TYPES,
    TASK_TO_AUTO_CLASS,
    TinyModelUnavailable,
    UnknownModelTypeError,
    auto_class_name,
    default_task,
    known_model_types,
    shrunk_config,
    supported_tasks,
)
from hfexport.tiny.models import check_runs_eagerly, tiny_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TASK_TO_AUTO_CLASS",
    "TinyModelUnavailable",
    "UnknownModelTypeError",
    "auto_class_name",
    "check_runs_eagerly",
    "default_task",
    "known_model_types",
    "shrunk_config",
    "supported_tasks",
    "tiny_model",
]
