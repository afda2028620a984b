"""The task names hfexport knows, in one table (no torch import).

A task is what a checkpoint is loaded for and what its export computes: the pipeline names of
``transformers`` (``text-generation``, ``feature-extraction`` ...), each with the Auto class that
builds a model for it. The CLI's ``--task``, :mod:`hfexport.checkpoints` (which class loads a folder,
which task an ``architectures`` entry implies) and the seeded tiny models of
:mod:`hfexport.tiny` all read this table.
"""

from __future__ import annotations

__all__ = [
    "ARCHITECTURE_SUFFIX_TASKS",
    "CACHELESS_HEAD_SUFFIXES",
    "GENERATION_TASKS",
    "TASK_AUTO_CLASSES",
    "auto_class_name",
]

#: Task name -> name of the ``transformers`` Auto class that loads a model for it. A few model types
#: use another class for the same task (wav2vec2 speech recognition is CTC): the tiny-model zoo
#: resolves those per type (:func:`hfexport.tiny.auto_class_name`).
TASK_AUTO_CLASSES: dict[str, str] = {
    "feature-extraction": "AutoModel",
    "fill-mask": "AutoModelForMaskedLM",
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "text-generation": "AutoModelForCausalLM",
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
    "ctc": "AutoModelForCTC",
    # vision heads, time series and text-to-audio (issue 28); a model type whose class is not in the
    # Auto class's mapping (patchtst's, informer's forecasting heads) is resolved per type by the zoo
    "object-detection": "AutoModelForObjectDetection",
    "zero-shot-object-detection": "AutoModelForZeroShotObjectDetection",
    "image-segmentation": "AutoModelForSemanticSegmentation",
    "depth-estimation": "AutoModelForDepthEstimation",
    "time-series-forecasting": "AutoModelForTimeSeriesPrediction",
    "text-to-audio": "AutoModelForTextToWaveform",
    "zero-shot-image-classification": "AutoModelForZeroShotImageClassification",
    "audio-classification": "AutoModelForAudioClassification",
}

#: Tasks whose explicit ``--task`` exports generation components (prefill/decode, or encoders,
#: language model and decode) instead of the plain forward
#: (:meth:`hfexport.exporter.HfExporter.export_for_generation`).
GENERATION_TASKS: tuple[str, ...] = ("text-generation", "image-text-to-text", "text2text-generation")

#: Class-name suffixes of heads that score their whole input and never generate. Their forward may
#: still take ``use_cache`` (decoder-only and encoder-decoder backbones: ``LlamaForSequenceClassification``,
#: ``BartForSequenceClassification``) and return the KV cache when the config turns it on;
#: :func:`hfexport.inputs.prepare_for_export` exports them with ``use_cache=False`` unless the sample
#: inputs set ``use_cache`` themselves.
CACHELESS_HEAD_SUFFIXES: tuple[str, ...] = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)

#: Architecture class-name suffix -> task, most specific first (``config.architectures`` entries,
#: e.g. ``LlamaForCausalLM`` -> ``text-generation``); :func:`hfexport.checkpoints.infer_task` adds the
#: model-type exceptions (whisper, vision/audio ``ForConditionalGeneration``).
ARCHITECTURE_SUFFIX_TASKS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForImageClassification", "image-classification"),
    ("ForAudioClassification", "audio-classification"),
    ("ForCTC", "ctc"),
    ("ForSpeechSeq2Seq", "automatic-speech-recognition"),
    ("ForImageTextToText", "image-text-to-text"),
    ("ForObjectDetection", "object-detection"),
    ("ForSemanticSegmentation", "image-segmentation"),
    ("ForDepthEstimation", "depth-estimation"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("Model", "feature-extraction"),
)


def auto_class_name(task: str) -> str:
    """The Auto class name of ``task`` (:data:`TASK_AUTO_CLASSES`).

    Raises:
        ValueError: an unknown task; the message lists the known ones.
    """
    if task not in TASK_AUTO_CLASSES:
        raise ValueError(f"unknown task {task!r}; allowed: auto, {', '.join(TASK_AUTO_CLASSES)}")
    return TASK_AUTO_CLASSES[task]
