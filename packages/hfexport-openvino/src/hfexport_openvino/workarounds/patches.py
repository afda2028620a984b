"""Patches installed while the OpenVINO backend captures a model (``register_patch("openvino", ...)``).

- :func:`reference_grid_from_arange`: the deformable-attention encoders' reference-point grid
  (Deformable DETR, Grounding DINO, MM Grounding DINO, Mask2Former, OneFormer) computed as
  ``arange(size) + 0.5`` instead of ``linspace(0.5, size - 0.5, size)``, whose end point, a
  symbolic size minus a float, puts ``sym_float`` nodes in the program; OpenVINO's FX frontend has
  no conversion rule for them (``failed FX node(s): sym_float``).
- :func:`grouped_query_attention_with_repeated_heads`: grouped-query attention captured with
  repeated key/value heads instead of ``enable_gqa=True``, whose SDPA the CPU plugin fails to run
  (LFM3-VL's vision encoder).
- :func:`speech_to_text_lengths_by_float_floor`: Speech2Text's encoder computes its frame counts
  from the summed feature mask with integer floor division (``(length - 1) // 2 + 1`` per
  convolution), which the converted program computes wrong with dynamic axes (32 features gave 9
  frames instead of 8, 20 gave 6 instead of 5, 0 gave 1 instead of 0); the frame counts are
  computed with ``floor`` of a float32 quotient instead (exact for counts below 2**24).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hfexport.registry import register_patch

__all__ = [
    "BACKEND",
    "REFERENCE_GRID_TARGETS",
    "grouped_query_attention_with_repeated_heads",
    "reference_grid_from_arange",
    "reference_points",
    "speech_to_text_frame_lengths",
    "speech_to_text_lengths_by_float_floor",
]

#: Registry key of these patches (the backend's own: installed for its capture only).
BACKEND = "openvino"

#: the static ``get_reference_points`` methods building the encoder's reference grid with linspace
REFERENCE_GRID_TARGETS: tuple[str, ...] = tuple(
    f"transformers.models.{module}.modeling_{module}.{cls}.get_reference_points"
    for module, cls in (
        ("deformable_detr", "DeformableDetrEncoder"),
        ("grounding_dino", "GroundingDinoEncoder"),
        ("mm_grounding_dino", "MMGroundingDinoEncoder"),
        ("mask2former", "Mask2FormerPixelDecoderEncoderOnly"),
        ("oneformer", "OneFormerPixelDecoderEncoderOnly"),
    )
)


def _cell_centres(size: Any, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``[0.5, 1.5, ..., size - 0.5]`` (``size`` values) in ``dtype``: ``linspace(0.5, size - 0.5,
    size)``'s values (its step is exactly 1; equal in float32 and float16 for every size, checked
    up to 300; bfloat16 rounds some centres past 128 the other way), computed from an integer
    ``arange`` so that a symbolic ``size`` stays an integer expression."""
    return (torch.arange(size, device=device, dtype=torch.float32) + 0.5).to(dtype)


def reference_points(
    spatial_shapes_list: Sequence[tuple[Any, Any]], valid_ratios: torch.Tensor, device: Any
) -> torch.Tensor:
    """The deformable-attention encoder's reference points, as transformers' ``get_reference_points``.

    For each feature level ``(height, width)`` the centres of its cells, normalised by the level's
    valid size (``valid_ratios * size``), flattened row-major; all levels concatenated and scaled
    by every level's valid ratio.

    Args:
        spatial_shapes_list: ``(height, width)`` per feature level (ints, or symbolic ints while
            ``torch.export`` traces).
        valid_ratios: ``[batch, levels, 2]`` float, the (x, y) share of each level not padded.
        device: where the grid is built.

    Returns:
        ``[batch, sum(height * width), levels, 2]`` in ``valid_ratios.dtype``: (x, y) per position
        and level.
    """
    per_level = []
    for level, (height, width) in enumerate(spatial_shapes_list):
        ref_y, ref_x = torch.meshgrid(
            _cell_centres(height, valid_ratios.dtype, device),
            _cell_centres(width, valid_ratios.dtype, device),
            indexing="ij",
        )
        ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, level, 1] * height)
        ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, level, 0] * width)
        per_level.append(torch.stack((ref_x, ref_y), -1))
    points = torch.cat(per_level, 1)
    return points[:, :, None] * valid_ratios[:, None]


@register_patch(
    BACKEND,
    *REFERENCE_GRID_TARGETS,
    description=(
        "deformable-attention encoders (deformable_detr, grounding-dino, mm-grounding-dino, mask2former, "
        "oneformer): the reference grid's cell centres as arange(size) + 0.5 instead of linspace(0.5, "
        "size - 0.5, size), whose symbolic float end point leaves sym_float nodes that OpenVINO's FX "
        "frontend cannot convert"
    ),
    # no upstream issue filed yet; sym_float is missing from the frontend's op table
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/bindings/python/src/openvino/frontend/pytorch/torchdynamo/op_support.py",
    versions={"openvino": ">=2026.0", "transformers": ">=5.0,<6"},
)
def reference_grid_from_arange(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace the static ``get_reference_points`` of :data:`REFERENCE_GRID_TARGETS` while capturing.

    Upstream builds each level's cell centres with ``torch.linspace(0.5, height - 0.5, height)``;
    with a dynamic image side ``height`` is a ``SymInt`` and ``height - 0.5`` a ``SymFloat``, which
    the program records as ``sym_float`` plus float arithmetic on symbols, none of which OpenVINO's
    FX frontend converts (``OpenvinoConversionError: ... failed FX node(s): sym_float``). The
    replacement (:func:`reference_points`) takes the centres from ``arange(height) + 0.5``: the same
    float32 values (linspace's step here is exactly 1), integer arithmetic on the symbol only.
    """
    return functools.wraps(original)(reference_points)


@register_patch(
    BACKEND,
    "transformers.integrations.sdpa_attention.use_gqa_in_sdpa",
    description=(
        "grouped-query attention without a mask is captured with its key/value heads repeated (repeat_kv) "
        "instead of scaled_dot_product_attention(enable_gqa=True), which the OpenVINO CPU plugin's SDPA "
        'snippet fails at run time ("Incompatible MatMul batch dimension. Can\'t merge dim 4 with dim 2"; '
        "LFM3-VL's vision encoder)"
    ),
    # no upstream issue filed yet; reproduces with openvino 2026.4.1 on CPU
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/common/snippets/src/shape_inference/shape_infer_instances.cpp",
    versions={"openvino": ">=2026.0", "transformers": ">=5.0,<6"},
)
def grouped_query_attention_with_repeated_heads(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace transformers' ``use_gqa_in_sdpa`` while capturing: it answers False.

    transformers' SDPA integration passes ``enable_gqa=True`` (fewer key/value heads than query
    heads) when the call has no mask, and repeats the key/value heads itself (``repeat_kv``)
    otherwise. OpenVINO 2026.4 converts the GQA form, but the CPU plugin's fused SDPA snippet then
    fails shape inference at the first inference (an LFM3-VL vision encoder with 4 query and 2
    key/value heads: "Incompatible MatMul batch dimension. Can't merge dim 4 with dim 2", issue 28).
    The repeated heads are the same keys and values, so the outputs are those of the GQA call.
    """

    @functools.wraps(original)
    def use_gqa_in_sdpa(attention_mask: Any, key: torch.Tensor, value: torch.Tensor) -> bool:
        return False

    return use_gqa_in_sdpa


def speech_to_text_frame_lengths(input_lengths: torch.Tensor, num_conv_layers: int) -> torch.Tensor:
    """Speech2Text's frame counts: ``(length - 1) // 2 + 1`` per convolution, by float ``floor``.

    Args:
        input_lengths: int64 tensor of feature counts (any shape; values below 2**24).
        num_conv_layers: the config's ``num_conv_layers`` (each halves the count, rounding up).

    Returns:
        int64 tensor of the same shape: the values of transformers 5.24's
        ``Speech2TextPreTrainedModel._get_feat_extract_output_lengths``.
    """
    lengths = input_lengths
    for _ in range(num_conv_layers):
        lengths = torch.floor((lengths - 1).float() / 2).long() + 1
    return lengths


@register_patch(
    BACKEND,
    "transformers.models.speech_to_text.modeling_speech_to_text.Speech2TextPreTrainedModel._get_feat_extract_output_lengths",
    description=(
        "Speech2Text: the encoder's frame counts from the summed feature mask by float floor instead of integer "
        "floor division, which the converted program computed wrong with dynamic axes (32 features: 9 frames, "
        "eager 8; the encoder's output 4.6 off eager on the sample)"
    ),
    # no upstream issue filed yet; reproduces with openvino 2026.4.1 on CPU: (x - 1) // 2 + 1 twice over a
    # dynamic [batch, features] mask's sum gives [9, 6, 1, 1] for [32, 20, 1, 0] (eager [8, 5, 1, 0])
    issue="https://github.com/openvinotoolkit/openvino/blob/2026.4.1/src/frontends/pytorch/src/op/floor_divide.cpp",
    versions={"openvino": ">=2026.0", "transformers": ">=5.0,<6"},
)
def speech_to_text_lengths_by_float_floor(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``Speech2TextPreTrainedModel._get_feat_extract_output_lengths`` while capturing: a
    tensor of lengths goes to :func:`speech_to_text_frame_lengths` (the same values); an int or
    ``SymInt`` to the original."""

    @functools.wraps(original)
    def lengths(self: Any, input_lengths: Any) -> Any:
        if isinstance(input_lengths, torch.Tensor):
            return speech_to_text_frame_lengths(input_lengths, self.config.num_conv_layers)
        return original(self, input_lengths)

    return lengths
