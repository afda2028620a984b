"""Which tiny models exist: model types, their tasks and auto classes, and the shrunk configs.

Any model type transformers knows (``transformers.CONFIG_MAPPING``) gets a tiny configuration: its
default configuration shrunk generically (:mod:`hfexport.tiny.shrink`), with per-type overrides kept
as data (:mod:`hfexport.tiny.presets`). The tasks offered are those of
:data:`hfexport.tasks.TASK_AUTO_CLASSES` a tiny model is built for (:data:`TASK_TO_AUTO_CLASS`).
Building the model itself is :mod:`hfexport.tiny.models`; its sample inputs are
:mod:`hfexport.sample_inputs`.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

import transformers
from transformers import AutoConfig, PretrainedConfig

from hfexport.errors import HfExportError
from hfexport.tasks import TASK_AUTO_CLASSES
from hfexport.tiny.presets import PRESETS, Preset
from hfexport.tiny.shrink import shrink_overrides

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TASK_TO_AUTO_CLASS",
    "TinyModelUnavailable",
    "UnknownModelTypeError",
    "auto_class_name",
    "check_task",
    "default_task",
    "known_model_types",
    "shrunk_config",
    "supported_tasks",
]

#: Task name -> name of the ``transformers`` auto class that builds a model for it. A few model
#: types use another class for the same task (wav2vec2 speech recognition is CTC, not
#: sequence-to-sequence); :func:`auto_class_name` resolves those.
#: The tasks the zoo builds tiny models for, a subset of :data:`hfexport.tasks.TASK_AUTO_CLASSES`.
TASK_TO_AUTO_CLASS: dict[str, str] = {
    task: TASK_AUTO_CLASSES[task]
    for task in (
        "text-generation",
        "feature-extraction",
        "fill-mask",
        "text-classification",
        "text2text-generation",
        "image-classification",
        "automatic-speech-recognition",
        "image-text-to-text",
        # issue 28: detection, segmentation, depth, time series, text-to-audio
        "object-detection",
        "zero-shot-object-detection",
        "image-segmentation",
        "depth-estimation",
        "time-series-forecasting",
        "text-to-audio",
        "token-classification",
        "question-answering",
        "zero-shot-image-classification",
        "audio-classification",
    )
}

# task -> (name of the transformers mapping model_type -> class name, auto class), in lookup order
_TASK_MAPPINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "text-generation": (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),),
    "feature-extraction": (("MODEL_MAPPING_NAMES", "AutoModel"),),
    "fill-mask": (("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),),
    "text-classification": (
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
    ),
    "text2text-generation": (("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),),
    "image-classification": (
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    ),
    "automatic-speech-recognition": (
        ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
        ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    ),
    "image-text-to-text": (("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),),
    "token-classification": (
        ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification"),
    ),
    "question-answering": (("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering"),),
    "zero-shot-image-classification": (
        (
            "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            "AutoModelForZeroShotImageClassification",
        ),
    ),
    "audio-classification": (
        ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
    ),
    # issue 28: vision heads, time series, text-to-audio
    "object-detection": (("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", "AutoModelForObjectDetection"),),
    "zero-shot-object-detection": (
        ("MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES", "AutoModelForZeroShotObjectDetection"),
    ),
    "image-segmentation": (
        ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "AutoModelForSemanticSegmentation"),
        ("MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES", "AutoModelForUniversalSegmentation"),
        ("MODEL_FOR_INSTANCE_SEGMENTATION_MAPPING_NAMES", "AutoModelForInstanceSegmentation"),
    ),
    "depth-estimation": (("MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES", "AutoModelForDepthEstimation"),),
    "time-series-forecasting": (
        ("MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES", "AutoModelForTimeSeriesPrediction"),
    ),
    "text-to-audio": (
        ("MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES", "AutoModelForTextToWaveform"),
        ("MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES", "AutoModelForTextToSpectrogram"),
    ),
}

#: task -> {model type: model class name} for heads no Auto class maps in transformers 5.24 (the
#: forecasting heads of patchtst, patchtsmixer, informer, autoformer and time_series_transformer);
#: the zoo builds them with the class itself (issue 28)
_EXTRA_TASK_CLASSES: dict[str, dict[str, str]] = {
    "time-series-forecasting": {
        "patchtst": "PatchTSTForPrediction",
        "patchtsmixer": "PatchTSMixerForPrediction",
        "informer": "InformerForPrediction",
        "autoformer": "AutoformerForPrediction",
        "time_series_transformer": "TimeSeriesTransformerForPrediction",
    },
}

#: tasks added after the hand-written presets fixed theirs (issue 28): a preset is offered these too
#: wherever transformers has a class for them (bert's token classification, whisper's audio
#: classification), after its own tasks
_HEAD_TASKS = (
    "token-classification",
    "question-answering",
    "zero-shot-image-classification",
    "audio-classification",
)

#: tasks a hand-written preset is offered after its own, where transformers has a class for them:
#: the head tasks, and text-classification for the presets that do not list it (t5's and bart's
#: sequence-classification heads; issue 28)
_PRESET_LATER_TASKS = ("text-classification", *_HEAD_TASKS)

# default task of a type without a preset: the first of these it has a class for (the head tasks
# come last, so adding them changed no type's default)
_DEFAULT_TASK_ORDER = (
    "text2text-generation",
    "image-text-to-text",
    "automatic-speech-recognition",
    "image-classification",
    "fill-mask",
    "text-generation",
    "feature-extraction",
    "text-classification",
    # issue 28: after the existing tasks, so no type's default task changes
    "object-detection",
    "zero-shot-object-detection",
    "image-segmentation",
    "depth-estimation",
    "time-series-forecasting",
    "text-to-audio",
    *_HEAD_TASKS,
)

_AUTO_CLASS_OVERRIDES: dict[tuple[str, str], str] = {
    ("wav2vec2", "automatic-speech-recognition"): "AutoModelForCTC",
}

_NUM_LABELS = 3

#: Model types with a hand-written preset (see the module docstring), in a stable order.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(mt for mt, p in PRESETS.items() if p.mode == "replace")


class UnknownModelTypeError(ValueError):
    """``transformers`` knows no such model type; the message lists close matches."""


class TinyModelUnavailable(HfExportError, RuntimeError):
    """The tiny model of a known model type cannot be built or cannot run eagerly.

    Not an export failure: the zoo sweep (``nox -s zoo``) reports such a type as "unbuildable" or
    "eager fails".

    Attributes:
        model_type: the model type asked for.
        task: the task asked for.
        stage: ``"config"`` (the shrunk configuration is refused), ``"build"`` (the model class
            cannot be instantiated from it) or ``"eager"`` (the forward pass on the derived
            inputs fails).
        reason: one line: the exception type and the first line of its message.
    """

    def __init__(self, model_type: str, task: str | None, stage: str, reason: str) -> None:
        self.model_type, self.task, self.stage, self.reason = model_type, task, stage, reason
        super().__init__(f"tiny {model_type} model ({task}) unavailable at {stage}: {reason}")


def one_line(exc: BaseException) -> str:
    """``"ExceptionType: first line of the message"``, at most 300 characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def _modeling_auto() -> Any:
    from transformers.models.auto import modeling_auto

    return modeling_auto


def _known_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def known_model_types(task: str | None = None) -> list[str]:
    """Model types ``transformers`` knows, sorted; with ``task``, those it has a class for.

    Args:
        task: a key of :data:`TASK_TO_AUTO_CLASS`, or ``None`` for every model type.

    Returns:
        Sorted model-type names (``transformers.CONFIG_MAPPING`` keys).

    Raises:
        ValueError: unknown ``task`` (the message lists the known tasks).
    """
    if task is None:
        return sorted(_known_types())
    check_task(task)
    auto = _modeling_auto()
    types: set[str] = set()
    for mapping_name, _ in _TASK_MAPPINGS[task]:
        types |= set(getattr(auto, mapping_name, {}))
    types |= {t for t, cls in _EXTRA_TASK_CLASSES.get(task, {}).items() if hasattr(transformers, cls)}
    return sorted(t for t in types if t in set(_known_types()))


def check_task(task: str) -> None:
    """Refuse a task the tiny models are not built for.

    Raises:
        ValueError: ``task`` is not a key of :data:`TASK_TO_AUTO_CLASS` (the message lists them).
    """
    if task not in TASK_TO_AUTO_CLASS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASK_TO_AUTO_CLASS)}")


def _check_model_type(model_type: str) -> None:
    if model_type in PRESETS:
        return
    known = _known_types()
    if model_type in known:
        return
    close = difflib.get_close_matches(model_type, known, n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "no close match"
    raise UnknownModelTypeError(
        f"unknown model_type {model_type!r} for the tiny-model zoo: transformers "
        f"{transformers.__version__} knows no such model type ({hint}); any model type of "
        f"transformers.CONFIG_MAPPING works, hand-written presets: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _generic_tasks(model_type: str) -> dict[str, str]:
    """task -> auto class name, for the tasks transformers has a class for (default order)."""
    auto = _modeling_auto()
    found: dict[str, str] = {}
    for task in _DEFAULT_TASK_ORDER:
        for mapping_name, auto_cls in _TASK_MAPPINGS[task]:
            if model_type in getattr(auto, mapping_name, {}):
                found[task] = auto_cls
                break
        extra = _EXTRA_TASK_CLASSES.get(task, {}).get(model_type)
        if task not in found and extra is not None and hasattr(transformers, extra):
            found[task] = extra
    return found


def supported_tasks(model_type: str) -> tuple[str, ...]:
    """Return the tasks a tiny model of ``model_type`` can be built for, default first.

    A hand-written preset fixes its tasks (followed by those of text-classification,
    token-classification, question-answering, zero-shot-image-classification and
    audio-classification transformers has a class for); any other type has the tasks transformers has an auto class for (among
    :data:`TASK_TO_AUTO_CLASS`), in the order text2text-generation, image-text-to-text,
    automatic-speech-recognition, image-classification, fill-mask, text-generation,
    feature-extraction, text-classification, token-classification, question-answering,
    zero-shot-image-classification, audio-classification.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no ``model_type``; the message
            lists close matches.
    """
    _check_model_type(model_type)
    preset = PRESETS.get(model_type)
    if preset is not None and preset.tasks is not None:
        generic = _generic_tasks(model_type)
        later = tuple(t for t in _PRESET_LATER_TASKS if t in generic and t not in preset.tasks)
        return preset.tasks + later
    return tuple(_generic_tasks(model_type))


def default_task(model_type: str) -> str:
    """Return the task a tiny model of ``model_type`` is built for when none is given.

    Args:
        model_type: a ``transformers`` model type, e.g. ``"llama"``.

    Returns:
        The task name, a key of :data:`TASK_TO_AUTO_CLASS` (``"text-generation"`` for decoder
        language models, ``"feature-extraction"`` for the BERT-like presets, ...).

    Raises:
        UnknownModelTypeError: unknown ``model_type`` (the message lists close matches).
        TinyModelUnavailable: transformers has no class of any zoo task for ``model_type``.
    """
    tasks = supported_tasks(model_type)
    if not tasks:
        raise TinyModelUnavailable(
            model_type,
            None,
            "build",
            f"transformers has no class of the tasks {', '.join(TASK_TO_AUTO_CLASS)}",
        )
    return tasks[0]


def auto_class_name(model_type: str, task: str | None = None) -> str:
    """Return the name of the ``transformers`` auto class building ``model_type`` for ``task``.

    Args:
        model_type: any model type transformers knows.
        task: a key of :data:`TASK_TO_AUTO_CLASS`; ``None`` means :func:`default_task`.

    Returns:
        An attribute name of the ``transformers`` module, e.g. ``"AutoModelForCausalLM"``; for a
        head no Auto class maps, the model class itself (``"PatchTSTForPrediction"``).

    Raises:
        ValueError: unknown ``model_type`` (:class:`UnknownModelTypeError`, with close matches);
            unknown ``task`` (the message lists the known tasks); a task the model type has no
            class for (the message names the tasks it has).
    """
    _check_model_type(model_type)
    if task is None:
        task = default_task(model_type)
    check_task(task)
    tasks = supported_tasks(model_type)
    if task not in tasks:
        raise ValueError(
            f"the tiny {model_type} model is not available for task {task!r}; "
            f"its tasks: {', '.join(tasks) or '(none of the zoo tasks)'}"
        )
    if (model_type, task) in _AUTO_CLASS_OVERRIDES:
        return _AUTO_CLASS_OVERRIDES[(model_type, task)]
    generic = _generic_tasks(model_type)
    return generic.get(task, TASK_TO_AUTO_CLASS[task])


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-copy ``base`` and apply ``overrides``; nested dicts (sub-configs) merge key by key."""
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def shrunk_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """Build the zoo's small configuration for ``model_type``.

    Args:
        model_type: any model type transformers knows; a hand-written preset
            (:data:`SUPPORTED_MODEL_TYPES`) is used as is, any other type's default configuration
            is shrunk generically (:func:`hfexport.tiny.shrink.shrink_overrides`) and its overlay
            in :data:`hfexport.tiny.presets.PRESETS` (if any) applied.
        **overrides: configuration attributes replacing the zoo's values; a dict given for a
            sub-configuration (``text_config``, ``vision_config``) is merged into the zoo's.

    Returns:
        A fresh ``PretrainedConfig`` from ``AutoConfig.for_model(model_type, ...)``.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no ``model_type``.
        TinyModelUnavailable: (stage ``"config"``) transformers refuses the shrunk configuration.
    """
    _check_model_type(model_type)
    preset: Preset | None = PRESETS.get(model_type)
    if preset is not None and preset.mode == "replace":
        base = {"num_labels": _NUM_LABELS, **preset.config}
        return AutoConfig.for_model(model_type, **_merge(base, overrides))
    try:
        default = AutoConfig.for_model(model_type)
        base = {"num_labels": _NUM_LABELS, **shrink_overrides(default)}
        if preset is not None:
            base = _merge(base, preset.config)
        return AutoConfig.for_model(model_type, **_merge(base, overrides))
    except Exception as exc:  # transformers raises many types here; all mean "no tiny config"
        raise TinyModelUnavailable(model_type, None, "config", one_line(exc)) from exc
