"""Build a tiny, seeded, random-weight model: :func:`tiny_model` (the CLI's ``--model tiny:TYPE``).

The configuration comes from :func:`hfexport.tiny.catalog.shrunk_config`, the sample inputs from
:func:`hfexport.sample_inputs.make_inputs`. A type whose tiny model cannot be built, or cannot run
eagerly on the derived inputs, raises :class:`~hfexport.tiny.catalog.TinyModelUnavailable` naming the
stage and the reason (it is not an export failure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from hfexport.tiny.catalog import (
    SUPPORTED_MODEL_TYPES,
    TinyModelUnavailable,
    auto_class_name,
    one_line,
    shrunk_config,
)
from hfexport.tiny.presets import PRESETS
from hfexport.tiny.shrink import _vocab_sizes, special_token_ids

__all__ = [
    "CLASSIFICATION_PAD_TOKEN_ID",
    "DEGENERATE_MAX_ABS",
    "check_runs_eagerly",
    "set_missing_image_token",
    "tiny_model",
    "variance_preserving_init",
]


#: tasks whose heads need a fixed number of labels (the zoo's other heads have 3): a
#: question-answering head splits its 2 outputs into start and end logits
_TASK_NUM_LABELS = {"question-answering": 2}

#: the padding id a text-classification tiny model gets when its configuration has none: the
#: sequence-classification heads of decoder-only language models pool the last token that is not
#: ``pad_token_id`` and refuse a batch of more than one row without it ("Cannot handle batch sizes >
#: 1 if no padding token is defined"); 0 is one of the ids the sample inputs never draw (issue 28)
CLASSIFICATION_PAD_TOKEN_ID = 0


def _set_missing_pad_token(config: Any) -> None:
    """Give ``config`` (and its text configuration) ``pad_token_id`` 0 where it is ``None``."""
    for cfg in (config, config.get_text_config()):
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = CLASSIFICATION_PAD_TOKEN_ID


#: the placeholder-id attributes of vision-language configurations (issue 28)
IMAGE_TOKEN_ATTRIBUTES = ("image_token_id", "image_token_index")


def set_missing_image_token(config: Any) -> int | None:
    """Give a vision-language ``config`` whose image placeholder id is ``None`` one (issue 28).

    Some configurations declare ``image_token_id`` with a ``None`` default that only released
    checkpoints fill in (MiniCPM-V 4.6 / 4.7, MiniCPM-o OCR, Nemotron-H Omni); their forward then
    skips the image features altogether (``image_token_id is not None`` guards the merge), so a
    tiny model of the default configuration never reads its image. The id given is the largest one
    below the smallest vocabulary of the configuration tree that is no special id yet, so it sits
    with the other special ids at the top of the tiny vocabulary, above the ids the sample prompts
    draw (:mod:`hfexport.sample_inputs` draws below the lowest special id >= 3).

    Args:
        config: a (shrunk) ``PretrainedConfig``; changed in place.

    Returns:
        The id set, or ``None`` when the configuration has no ``None`` placeholder attribute (or
        no vocabulary, or no free id >= 3 in it): nothing is changed then.
    """
    name = next(
        (a for a in IMAGE_TOKEN_ATTRIBUTES if a in config.to_dict() and getattr(config, a, 0) is None),
        None,
    )
    sizes = _vocab_sizes(config)
    if name is None or not sizes:
        return None
    taken = special_token_ids(config)
    free = [i for i in range(min(sizes) - 1, 2, -1) if i not in taken]
    if not free:
        return None
    setattr(config, name, free[0])
    return free[0]


def _build(
    model_type: str,
    task: str | None,
    seed: int,
    attn_implementation: str | None,
    overrides: Mapping[str, Any],
) -> PreTrainedModel:
    auto_cls = getattr(transformers, auto_class_name(model_type, task))
    if not hasattr(auto_cls, "from_config"):  # a model class no Auto class maps (patchtst's head)
        auto_cls = _ClassBuilder(auto_cls)
    if task in _TASK_NUM_LABELS and "num_labels" not in overrides:
        overrides = {**overrides, "num_labels": _TASK_NUM_LABELS[task]}
    config = shrunk_config(model_type, **overrides)
    if task == "text-classification" and "pad_token_id" not in overrides:
        _set_missing_pad_token(config)
    if task == "image-text-to-text" and model_type not in SUPPORTED_MODEL_TYPES:
        set_missing_image_token(config)
    preset = PRESETS.get(model_type)
    if model_type in SUPPORTED_MODEL_TYPES:  # hand-written: built exactly as always
        if attn_implementation is None:
            attn_implementation = preset.attn_implementation or "sdpa"
        torch.manual_seed(seed)
        return auto_cls.from_config(config, attn_implementation=attn_implementation).eval()
    chosen = attn_implementation or (preset.attn_implementation if preset else None) or "sdpa"
    _name_default_architecture(auto_cls, config)
    try:
        torch.manual_seed(seed)
        try:
            model = auto_cls.from_config(config, attn_implementation=chosen)
        except ValueError as exc:
            message = str(exc).lower()
            if (
                attn_implementation is not None
                or chosen != "sdpa"
                or "attention implementation" not in message
            ):
                raise
            torch.manual_seed(seed)  # no SDPA path in this architecture: eager attention
            model = auto_cls.from_config(config, attn_implementation="eager")
    except Exception as exc:  # any failure to instantiate means "no tiny model", with the reason
        raise TinyModelUnavailable(model_type, task, "build", one_line(exc)) from exc
    _redraw_zero_matrices(model, seed)
    if preset is not None and preset.init == "variance_preserving":
        variance_preserving_init(model, seed)
    return model.eval()


def _name_default_architecture(auto_cls: Any, config: Any) -> str | None:
    """Set ``config.architectures`` to the first class the Auto class maps ``config`` to, when it maps
    it to several and the config names none.

    transformers 5.24 ``_get_model_class`` (``models/auto/auto_factory.py``) means to fall back to the
    first class of a tuple entry (``AutoModel``: funnel -> ``FunnelModel`` or ``FunnelBaseModel``;
    ``AutoModelForImageClassification``: deit, levit, perceiver) when no architecture matches, but it
    iterates ``getattr(config, "architectures", [])``, which is ``None`` on a fresh config, so
    ``from_config`` raises ``TypeError: 'NoneType' object is not iterable`` (no upstream issue
    found). Naming the documented default beforehand builds the class transformers intends.

    Args:
        auto_cls: a transformers Auto class (anything without ``_model_mapping`` is left alone).
        config: the model's configuration; changed in place.

    Returns:
        The architecture set, or ``None`` when nothing was changed.
    """
    mapping = getattr(auto_cls, "_model_mapping", None)
    if mapping is None or getattr(config, "architectures", None):
        return None
    try:
        classes = mapping[type(config)]
    except KeyError:
        return None
    if not isinstance(classes, (list, tuple)) or not classes:
        return None
    config.architectures = [classes[0].__name__]
    return config.architectures[0]


class _ClassBuilder:
    """``from_config`` of a concrete model class (its ``_from_config``), for the heads the zoo builds
    without an Auto class (:data:`hfexport.tiny.catalog._EXTRA_TASK_CLASSES`)."""

    def __init__(self, cls: type[PreTrainedModel]) -> None:
        self.cls = cls

    def from_config(self, config: Any, **kwargs: Any) -> PreTrainedModel:
        """The model of ``config`` (``kwargs`` as for ``PreTrainedModel._from_config``)."""
        return self.cls._from_config(config, **kwargs)


def _redraw_zero_matrices(model: torch.nn.Module, seed: int) -> list[str]:
    """Draw every all-zero weight matrix of ``model`` (2-D or more, floating) from N(0, std), std =
    the config's ``initializer_range`` (0.02 without one), with a generator seeded by ``seed``.

    Some architectures zero-initialise a weight matrix, notably MoE routers (afmoe's
    ``router.gate``): every token then scores every expert equally, and which experts top-k picks
    among exact ties is left to the kernel (torch's CPU topk and ONNX Runtime's TopK pick
    different ones), so an exported model "differs" from eager for no fault of the export, and
    routing covers only one expert set. A trained checkpoint never has such a matrix. Vectors
    (norm weights, biases, zero-initialised gates) are left alone.

    Returns:
        The names of the redrawn parameters, in module order.
    """
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    gen = torch.Generator().manual_seed(seed + 1)
    redrawn = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and param.is_floating_point() and param.numel() and not param.any():
                param.copy_(
                    torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype) * std
                )
                redrawn.append(name)
    return redrawn


def variance_preserving_init(model: torch.nn.Module, seed: int) -> int:
    """Redraw ``model``'s weights so that activations keep their scale through deep stacks.

    * the weight of every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (transposed ones included) from
      N(0, 1 / fan_in), fan_in = the weight's elements per output channel (LeCun's initialisation),
      with a generator seeded by ``seed``; biases are left as drawn;
    * the scale (``weight``) of every batch norm (``nn.BatchNorm*d`` and any module with a
      ``running_var`` buffer and a ``weight``, e.g. transformers' frozen batch norms) set to 1, the
      PyTorch default; shifts and running statistics unchanged.

    For the tiny models of architectures whose upstream initializer draws convolution weights *and*
    batch-norm scales from N(0, initializer_range): each conv + batch-norm pair then multiplies the
    activations by ~``initializer_range ** 2 * sqrt(fan_in)``, and a few such layers make them
    vanish (the RT-DETR family's encoder: 1e-6..1e-18; its class scores then all equal the prior
    bias and its top-k query selection picks among exact ties). A preset opts in with
    ``init="variance_preserving"`` (:class:`hfexport.tiny.presets.Preset`).

    Args:
        model: the freshly built model (modified in place, float weights only).
        seed: seed of the weight draws (the builder's seed; equal seeds give equal weights).

    Returns:
        The number of weight tensors redrawn or reset.
    """
    gen = torch.Generator().manual_seed(seed + 2)
    layers = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or not weight.numel():
                continue
            if isinstance(module, layers):
                std = 1.0 / math.sqrt(weight[0].numel())  # [out, in, *kernel]: in * kernel per output
                if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
                    std = 1.0 / math.sqrt(weight.shape[0] * weight[0, 0].numel())  # [in, out, *kernel]
                weight.copy_(
                    torch.randn(weight.shape, generator=gen, dtype=torch.float32).to(weight.dtype) * std
                )
            elif isinstance(getattr(module, "running_var", None), torch.Tensor):
                weight.fill_(1.0)
            else:
                continue
            changed += 1
    return changed


def check_runs_eagerly(
    model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], task: str | None = None
) -> Any:
    """Run ``model(**inputs)`` without gradients and return its output.

    Raises:
        TinyModelUnavailable: (stage ``"eager"``) the forward pass raised (the reason is the
            exception's type and first line), or every floating-point output value is below
            :data:`DEGENERATE_MAX_ABS` in magnitude: activations vanished through the random layers,
            and a parity check against such a model compares zeros, so it proves nothing (the fix is
            a per-type overlay in :mod:`hfexport.tiny.presets`, e.g. a larger ``initializer_range``);
            or a floating-point output holds a NaN (a parity check against NaN proves nothing
            either). Infinities are allowed: masked scores are ``-inf`` by design.
    """
    try:
        with torch.no_grad():
            output = model(**inputs)
    except Exception as exc:  # any eager failure makes the type unavailable, not an export failure
        raise TinyModelUnavailable(model.config.model_type, task, "eager", one_line(exc)) from exc
    floats = [t for t in _output_tensors(output) if t.is_floating_point() and t.numel()]
    with_nan = [i for i, t in enumerate(floats) if bool(torch.isnan(t).any())]
    if with_nan:
        shapes = ", ".join(f"#{i} {list(floats[i].shape)}" for i in with_nan)
        raise TinyModelUnavailable(
            model.config.model_type,
            task,
            "eager",
            f"NaN in the eager outputs ({shapes}): the random weights or the config overflow, so parity "
            "with eager would compare NaN (add an overlay in hfexport.tiny.presets, e.g. a smaller "
            "initializer_range or fewer layers)",
        )
    if floats and max(float(t.abs().max()) for t in floats) < DEGENERATE_MAX_ABS:
        peak = max(float(t.abs().max()) for t in floats)
        raise TinyModelUnavailable(
            model.config.model_type,
            task,
            "eager",
            f"degenerate outputs: every value is below {DEGENERATE_MAX_ABS:g} in magnitude (max {peak:.1e}); the "
            "activations vanish through the random layers, so parity with eager would compare zeros "
            "(add an overlay with a larger initializer_range in hfexport.tiny.presets)",
        )
    return output


#: a tiny model whose every floating-point output is below this (absolute) is degenerate
DEGENERATE_MAX_ABS = 1e-6


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (ModelOutput, tuple, dict, cache objects skipped)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _output_tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for value in output for t in _output_tensors(value)]
    return []


def tiny_model(
    model_type: str,
    task: str | None = None,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 8,
    attn_implementation: str | None = None,
    check_eager: bool = False,
    **overrides: Any,
) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """Build a tiny seeded random-weight model in eval mode and matching forward kwargs.

    ``torch.manual_seed(seed)`` runs right before the model is built, so equal arguments give
    equal weights; the inputs come from :func:`hfexport.sample_inputs.make_inputs` with the same seed.
    For task ``"text-classification"`` a configuration without ``pad_token_id`` (nor an override of
    it) gets :data:`CLASSIFICATION_PAD_TOKEN_ID`: the decoder-only heads pool the last non-pad token.

    Args:
        model_type: any model type transformers knows (:func:`known_model_types`; the nineteen of
            :data:`SUPPORTED_MODEL_TYPES` have hand-written presets),.
        task: a task of the model type (see :func:`supported_tasks`); ``None`` = default task.
        seed: seed for the weights and the inputs.
        batch_size: batch size of the sample inputs.
        seq_len: sequence length of the sample inputs (meaning per architecture in
            :func:`hfexport.sample_inputs.make_inputs`).
        attn_implementation: ``"sdpa"``, ``"eager"``, ...; ``None`` picks ``"sdpa"`` where
            the architecture supports it in transformers 5.24 and ``"eager"`` otherwise (gemma2,
            and any generic type whose model class refuses SDPA).
        check_eager: run the model once on the sample inputs (:func:`check_runs_eagerly`).
        **overrides: configuration overrides, see :func:`shrunk_config`.

    Returns:
        ``(model, sample_inputs)``: a ``PreTrainedModel`` in eval mode on CPU in float32, and a
        dict of tensors such that ``model(**sample_inputs)`` runs.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) transformers knows no such model type; the
            message lists close matches.
        ValueError: unknown task (the message lists the tasks), a task the type has no class for
            (the message names the tasks it has).
        TinyModelUnavailable: the tiny configuration or model cannot be built (stage
            ``"config"``/``"build"``), or, with ``check_eager=True``, the forward pass on the
            sample inputs fails (stage ``"eager"``).
    """
    # imported here, not at the top: hfexport.sample_inputs imports hfexport.tiny.catalog, which
    # runs hfexport/tiny/__init__.py, which imports this module
    from hfexport.sample_inputs import make_inputs

    model = _build(model_type, task, seed, attn_implementation, overrides)
    try:
        inputs = make_inputs(model, task, batch_size=batch_size, seq_len=seq_len, seed=seed)
    except ValueError:
        raise
    except Exception as exc:  # deriving inputs ran into the model (e.g. its vision tower)
        raise TinyModelUnavailable(model_type, task, "eager", one_line(exc)) from exc
    if check_eager:
        check_runs_eagerly(model, inputs, task)
    return model, inputs
