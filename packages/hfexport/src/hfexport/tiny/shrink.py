"""Generic shrink of a transformers default configuration into a tiny one.

:func:`shrink_overrides` reads the default configuration of a model type
(``AutoConfig.for_model(model_type)``) and returns the attributes to change so that the model
has two layers, a hidden size of 64 (4 heads of 16, 2 kv heads where the default has grouped
queries), feed-forward sizes of 128, a vocabulary of 256 tokens, at most 512 positions, 4 experts
routed top-2, a 32-token sliding window, 32x32 images in 8x8 patches, and recursively the same for
every nested sub-configuration (``text_config``, ``vision_config``, ``audio_config``, ``encoder``,
``decoder`` ...). Special token ids are kept valid: ids 0, 1 and 2 stay; every other special id
(``*_token_id``, ``*_token_index``, lists of them) is moved to the top of the 256-token vocabulary
(255, 254, ...), equal ids staying equal, so random ids drawn from ``[3, lowest special id)`` never
hit a special token.

The rules are by attribute *name*, which transformers keeps consistent across model types; types
the rules get wrong have an overlay in :mod:`hfexport.tiny.presets`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

__all__ = ["HEADS", "HEAD_DIM", "HIDDEN", "VOCAB", "shrink_overrides", "special_token_ids"]

VOCAB = 256
HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
FFN = 128
LAYERS = 2
MAX_POSITIONS = 512
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
SLIDING_WINDOW = 32
IMAGE_SIZE = 32
PATCH_SIZE = 8

_HIDDEN_KEYS = frozenset(
    {
        "hidden_size",
        "d_model",
        "n_embd",
        "n_embed",
        "embed_dim",
        "model_dim",
        "word_embed_proj_dim",
        "embedding_size",
        "d_embed",
        "dim",
        "emb_dim",
        "projection_dim",
        "text_embed_dim",
        "vision_embed_dim",
        # a patch-grid vision tower's merger output, the language model's width (Qwen-VL, GLM-4V)
        "out_hidden_size",
        "projection_hidden_size",  # Kimi-K2.5's projector input, its vision tower's width
        "text_hidden_size",  # a vision tower's output width, the language model's (inkling2)
        "adapter_in_dim",  # dots3_note's audio adapter input, its hidden size
        "adapter_input_size",
        "adapter_out_dim",  # dots3_note's adapters' output, the text hidden size
    }
)
_FFN_KEYS = frozenset(
    {
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "d_ff",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "d_inner",
        "ffn_hidden_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "expert_intermediate_size",
        "intermediate_size_mlp",
        "dense_intermediate_size",
        "expert_ffn_hidden_size",
    }
)
_LAYER_KEYS = frozenset(
    {
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "num_decoder_layers",
        "num_encoder_layers",
        "encoder_layers",
        "decoder_layers",
        "depth",
    }
)
_HEAD_KEYS = frozenset(
    {
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "num_decoder_attention_heads",
    }
)
_KV_HEAD_KEYS = frozenset({"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"})
_HEAD_DIM_KEYS = frozenset(
    {"head_dim", "d_kv", "kv_channels", "attention_head_dim", "attention_head_size", "qk_head_dim"}
)
_POSITION_KEYS = frozenset(
    {
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "max_target_positions",
        "original_max_position_embeddings",
    }
)
_EXPERT_KEYS = frozenset(
    {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num"}
)
_EXPERT_TOPK_KEYS = frozenset({"num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"})
_ONE_KEYS = frozenset({"n_group", "topk_group", "n_shared_experts", "num_shared_experts", "n_groups"})
# multi-head latent attention (deepseek v2/v3 and friends)
_MLA = {
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
}
_TOKEN_SUFFIXES = ("_token_id", "_token_index", "_token_ids")


def special_token_ids(config: PretrainedConfig) -> set[int]:
    """Every special token id (``*_token_id``, ``*_token_index``, lists of them) in ``config`` and its
    sub-configurations, as a set of ints (``None`` values are left out)."""
    found: set[int] = set()

    def visit(cfg: Any) -> None:
        items = cfg.to_dict().items() if isinstance(cfg, PretrainedConfig) else cfg.items()
        for key, value in items:
            if not isinstance(key, str):
                continue
            if isinstance(value, PretrainedConfig | Mapping):
                visit(value)
            elif key.endswith(_TOKEN_SUFFIXES):
                values = value if isinstance(value, list | tuple) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))

    visit(config)
    return found


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kv_heads(original_kv: int, original_heads: Any) -> int:
    if original_kv == 1:
        return 1  # multi-query attention stays multi-query
    if _is_int(original_heads) and original_kv >= original_heads:
        return HEADS  # plain multi-head attention
    return 2


def _trim_layer_types(types: list[Any], layers: int) -> list[Any]:
    """``layers`` entries of a per-layer list, covering as many distinct values as fit, in order of
    first appearance (a 5:1 sliding/full pattern keeps one of each in two layers)."""
    distinct = list(dict.fromkeys(types))
    if len(distinct) <= 1 or layers >= len(types):
        return list(types[:layers])
    picked = distinct[:layers]
    while len(picked) < layers:
        picked.append(types[len(picked)])
    return picked


def _shrink_rope(rope: Mapping[str, Any], head_dim: int, max_positions: int) -> dict[str, Any]:
    out = dict(rope)
    for key, value in rope.items():
        if isinstance(value, Mapping):  # per-layer-type rope parameters (gemma3 and friends)
            out[key] = _shrink_rope(value, head_dim, max_positions)
        elif key == "mrope_section" and isinstance(value, list) and value:
            half = head_dim // 2
            total = sum(value)
            scaled = [max(1, v * half // total) for v in value]
            scaled[-1] += half - sum(scaled)
            out[key] = scaled
        elif key in ("short_factor", "long_factor") and isinstance(value, list):
            factor = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
            out[key] = value[: max(1, int(head_dim * factor) // 2)]
        elif key == "original_max_position_embeddings" and _is_int(value):
            out[key] = min(value, max_positions)
    return out


def shrink_overrides(config: PretrainedConfig, remap: dict[int, int] | None = None) -> dict[str, Any]:
    """Attributes to pass to ``AutoConfig.for_model`` to make ``config`` tiny.

    Args:
        config: a default (full-size) configuration of any model type.
        remap: special-token id map shared across sub-configurations; built from ``config`` when
            ``None`` (the top-level call).

    Returns:
        A dict of changed attributes; a sub-configuration appears as the *whole* dict of its shrunk
        attributes (its ``model_type`` included), so the parent rebuilds the same sub-model type.
    """
    if remap is None:
        remap = _token_remap(config)
    values = config.to_dict()
    out: dict[str, Any] = {}
    heads = values.get("num_attention_heads", values.get("n_head", values.get("num_heads")))
    has_stages = isinstance(values.get("depths"), list)  # swin-like: the width doubles per stage

    for key, value in values.items():
        # sub-configurations are dicts in to_dict(); reading any other attribute back through the
        # config can raise (transformers >= 5.20 per-layer attributes of heterogeneous configs,
        # AmbiguousGlobalPerLayerAttributeError, which getattr's default does not catch)
        sub = getattr(config, key, None) if isinstance(value, Mapping) else None
        if isinstance(sub, PretrainedConfig):
            shrunk = shrink_overrides(sub, remap)
            out[key] = {**sub.to_dict(), **shrunk}
            if "num_labels" in shrunk:
                # the sub-configuration's own label maps (two labels by default) would contradict the
                # new count: transformers then warns "You passed `num_labels=3` which is incompatible
                # to the `id2label` map of length `2`" on every build; it draws the maps from the count
                out[key].pop("id2label", None)
                out[key].pop("label2id", None)
            if key == "backbone_config":
                out[key] = _tiny_backbone(sub, out[key])
            continue
        if key.endswith(_TOKEN_SUFFIXES):
            if _is_int(value) and value in remap:
                out[key] = remap[value]
            elif isinstance(value, list):
                out[key] = [remap.get(v, v) if _is_int(v) else v for v in value]
            continue
        if key.endswith("_tokens") and isinstance(value, list):  # suppress lists and the like
            out[key] = [v for v in value if _is_int(v) and v < VOCAB][:4]
            continue
        new = _shrink_value(key, value, heads)
        if new is not _KEEP:
            out[key] = new

    layer_key = next(
        (k for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if k in values), None
    )
    layers = out.get(layer_key) if layer_key else None
    old_layers = values.get(layer_key) if layer_key else None
    if _is_int(layers) and _is_int(old_layers) and old_layers > layers:
        for key, value in values.items():  # per-layer lists follow the layer count
            if isinstance(value, list) and len(value) == old_layers:
                out[key] = list(out.get(key, value))[:layers]
    if _is_int(values.get("qk_rope_head_dim")):  # MLA: head_dim is the rotary part
        # a default without rotary part stays without (glm5_next's DSA layers are NoPE by design:
        # its config refuses a rotary dim)
        rope_dim = 0 if values["qk_rope_head_dim"] == 0 else _MLA["qk_rope_head_dim"]
        out["qk_rope_head_dim"] = rope_dim
        if "head_dim" in values:
            out["head_dim"] = rope_dim or _MLA["qk_nope_head_dim"]
        if "qk_head_dim" in values:
            out["qk_head_dim"] = rope_dim + _MLA["qk_nope_head_dim"]
    if _is_int(layers) and layer_key is not None:
        _fit_backbone_outputs(values, out, layer_key, layers)
    taps = values.get("deepstack_visual_indexes")
    depth = layers if _is_int(layers) else out.get("depth")  # Qwen3-VL's vision tower counts "depth"
    if isinstance(taps, list) and taps and _is_int(depth):
        # Qwen3-VL's DeepStack taps vision layers [8, 16, 24]: none exists in the tiny two-layer
        # tower, and the language model then gets no deepstack inputs at all (issue 28)
        out["deepstack_visual_indexes"] = list(range(min(len(taps), depth)))
    for key in ("layer_types", "block_types", "layers_block_type", "hybrid_override_pattern"):
        types = values.get(key)
        if isinstance(types, list) and _is_int(layers):
            out[key] = _trim_layer_types(types, layers)
        elif isinstance(types, str) and _is_int(layers) and len(types) > layers:
            out[key] = "".join(_trim_layer_types(list(types), layers))
    merge = values.get("spatial_merge_size")
    if _is_int(values.get("window_size")) and _is_int(merge) and _is_int(values.get("patch_size")):
        # Qwen2.5-VL-like vision towers count their attention windows in pixels: 2x2 merged patches
        # (the swin rule's 4 gave 4 // merge // patch = 0 merged patches per window, ZeroDivisionError)
        out["window_size"] = 2 * merge * int(out.get("patch_size", values["patch_size"]))
    if _is_int(layers):  # hybrids: the last layer keeps attention (and experts) after the shrink
        for key, value in values.items():
            if key.endswith("_layer_period") and _is_int(value) and _is_int(values.get(key[:-6] + "offset")):
                out[key], out[key[:-6] + "offset"] = (
                    layers,
                    layers - 1,
                )  # layer i has it when i % period == offset
        if "attn_layer_indices" in values and not values["attn_layer_indices"]:
            out["attn_layer_indices"] = [layers - 1]  # bamba-style: no attention at all by default
    # a head_dim left None is derived as hidden / heads by most models, but some read it as is
    # (hunyuan_v1_dense/moe: head_dim ** -0.5); the tiny value is that same quotient
    if (
        "head_dim" in values
        and values["head_dim"] is None
        and "head_dim" not in out
        and out.get("hidden_size") == HIDDEN
        and out.get("num_attention_heads") == HEADS
    ):
        out["head_dim"] = HEAD_DIM
    # kv heads left None mean "as many as the query heads" (nemotron reads them as is)
    if values.get("num_key_value_heads", 0) is None and _is_int(out.get("num_attention_heads")):
        out["num_key_value_heads"] = out["num_attention_heads"]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, Mapping) and per_layer:
        out["per_layer_config"] = _shrink_per_layer(per_layer, out, heads, layers, values.get("layer_types"))
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if isinstance(rope, Mapping):
            head_dim = out.get("head_dim") or HEAD_DIM
            out[key] = _shrink_rope(rope, int(head_dim), MAX_POSITIONS)
    if has_stages:  # swin-like: embed_dim doubles per stage up to hidden_size
        stages = len(values["depths"])
        if _is_int(values.get("embed_dim")):
            out["embed_dim"] = 16
            if _is_int(values.get("hidden_size")):
                out["hidden_size"] = 16 * 2 ** (stages - 1)
    backbone = out.get("backbone_config")
    if isinstance(backbone, Mapping):
        _fit_neck_channels(values, out, backbone)
    _scale_grid_pinpoints(values, out)
    _fit_merger_window(values, out)
    _fit_feature_layers(values, out)
    # a codec's depthwise upsampling (Mimi: groups == hidden_size, 512 by default) stays depthwise;
    # kept at 512 it no longer divides the 64 tiny channels (csm, kyutai_speech_to_text; issue 28)
    groups, width = values.get("upsample_groups"), out.get("hidden_size")
    if _is_int(groups) and _is_int(width) and groups > width:
        out["upsample_groups"] = width if groups == values.get("hidden_size") else math.gcd(groups, width)
    for key in ("use_timm_backbone", "use_pretrained_backbone"):
        if values.get(key):
            out[key] = False
    if values.get("num_labels", 0) != 3 and "id2label" in values:
        out["num_labels"] = 3
    return out


_KEEP = object()


#: stands in for a ``timm`` backbone (detr and friends default to timm's resnet50): a transformers
#: resnet of four one-block stages, so the zoo needs no ``timm`` and downloads no weights
_RESNET_BACKBONE: dict[str, Any] = {
    "model_type": "resnet",
    "embedding_size": 16,
    "hidden_sizes": [16, 32, 64, 128],
    "depths": [1, 1, 1, 1],
    "layer_type": "basic",
}
_QUERY_KEYS = frozenset({"num_queries", "num_top_queries", "num_denoising", "two_stage_num_proposals"})


def _tiny_backbone(sub: PretrainedConfig, shrunk: dict[str, Any]) -> dict[str, Any]:
    """The tiny ``backbone_config`` of a detection/segmentation head (issue 28).

    * a ``timm_backbone`` becomes a transformers resnet (:data:`_RESNET_BACKBONE`) tapping the same
      stages (``out_indices``), so the model builds without ``timm`` and without pretrained weights;
    * a stage backbone (``depths`` per stage: swin, resnet) keeps every stage: the generic layer
      shrink would cut ``num_layers`` (its stage count) and its per-stage lists to two, while the
      head taps stages three and four;
    * hgnet_v2 gets narrow stages whose ``hidden_sizes`` equal its ``stage_out_channels`` (the heads
      read one, the backbone builds from the other); a backbone whose blocks are spelled out in
      ``block_configs`` (pp_lcnet_v4: kernel, in and out channels per block) builds its channels
      from those and keeps its ``stage_out_channels`` (narrowing them alone breaks the first block).
    """
    values = sub.to_dict()
    if values.get("model_type") == "timm_backbone":
        indices = [int(i) for i in (values.get("out_indices") or [1, 2, 3, 4]) if int(i) >= 1]
        return {
            **_RESNET_BACKBONE,
            "num_channels": values.get("num_channels", 3),
            "out_features": [f"stage{i}" for i in indices],
        }
    depths = values.get("depths")
    if (
        isinstance(depths, list)
        and _is_int(values.get("num_layers"))
        and shrunk.get("num_layers") != len(depths)
    ):
        stages = len(depths)
        shrunk["num_layers"] = stages
        for key, value in values.items():
            if (
                isinstance(value, list)
                and len(value) == stages
                and isinstance(shrunk.get(key), list)
                and len(shrunk[key]) < stages
            ):
                new = _shrink_value(key, value, None)
                shrunk[key] = list(value) if new is _KEEP else new
    outs = values.get("stage_out_channels")
    if (
        isinstance(outs, list)
        and outs
        and all(_is_int(v) for v in outs)
        and not isinstance(values.get("block_configs"), list)
    ):
        n = len(outs)
        tiny = [16 * 2**i for i in range(n)]
        shrunk.update(
            {
                "stem_channels": [values.get("num_channels", 3), 16, 16],
                "stage_in_channels": [16, *tiny[:-1]],
                "stage_mid_channels": [max(8, c // 2) for c in tiny],
                "stage_out_channels": tiny,
                "hidden_sizes": tiny,
                "stage_num_blocks": [1] * n,
                "stage_numb_of_layers": [2] * n,
            }
        )
    return shrunk


def _fit_neck_channels(values: Mapping[str, Any], out: dict[str, Any], backbone: Mapping[str, Any]) -> None:
    """A detection head's ``encoder_in_channels`` follow its tiny backbone's tapped stages (rt_detr:
    ``[512, 1024, 2048]`` for resnet50's stages 2-4; with one tap more than encoder inputs and an
    ``x4_feat_dim``, pp_doclayout_v3, the first tap is the mask branch's), a hybrid encoder's
    ``encoder_hidden_dim`` (and the decoder inputs reading it) narrows to the tiny hidden size, and
    its query counts shrink (``num_queries`` 300 top-k picks over the 21 anchors of a 32x32 image
    fail). Changes ``out`` in place."""
    channels = backbone.get("hidden_sizes")
    indices = backbone.get("out_indices")
    if indices is None and isinstance(backbone.get("out_features"), list):
        indices = [int(str(f).removeprefix("stage")) for f in backbone["out_features"] if str(f) != "stem"]
    if (
        isinstance(values.get("encoder_in_channels"), list)
        and isinstance(channels, list)
        and indices
        and all(1 <= int(i) <= len(channels) for i in indices)
    ):
        picked = [channels[int(i) - 1] for i in indices]
        if len(picked) == len(values["encoder_in_channels"]):
            out["encoder_in_channels"] = picked
        elif len(picked) == len(values["encoder_in_channels"]) + 1 and _is_int(values.get("x4_feat_dim")):
            # pp_doclayout_v3: the first (stride-4) tap feeds the mask branch, the others the encoder
            out["x4_feat_dim"] = picked[0]
            out["encoder_in_channels"] = picked[1:]
    for key in _QUERY_KEYS:
        if _is_int(values.get(key)) and values[key] > 10:
            out[key] = 10
    width = values.get("encoder_hidden_dim")
    if _is_int(width) and width > HIDDEN:
        # rt_detr-like hybrid encoders: 256 wide by default (10M parameters at the tiny size);
        # the decoder's input projections read the encoder's width
        out["encoder_hidden_dim"] = HIDDEN
        decoder_in = values.get("decoder_in_channels")
        if isinstance(decoder_in, list) and all(c == width for c in decoder_in):
            out["decoder_in_channels"] = [HIDDEN] * len(decoder_in)


def _fit_feature_layers(values: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Keep the vision tower's tapped layers (``vision_feature_layer``) inside its tiny stack (issue 28).

    VipLLaVA taps five hidden states of its 24-layer CLIP tower, ``(-2, -5, -8, -11, 6)``; with two
    layers there are three hidden states (indices -3 .. 2), and ``hidden_states[-5]`` raises
    IndexError. Each index is clamped into that range, the count (the projector's input width) kept.
    Changes ``out`` in place.
    """
    taps = values.get("vision_feature_layer")
    layers = (out.get("vision_config") or {}).get("num_hidden_layers")
    if not (isinstance(taps, list | tuple) and taps and all(_is_int(t) for t in taps) and _is_int(layers)):
        return
    states = layers + 1  # the embeddings' output, then every layer's
    out["vision_feature_layer"] = [max(-states, min(states - 1, t)) for t in taps]


def _fit_merger_window(values: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Keep a Qwen2.5-VL-style windowed vision tower's ``window_size`` a whole number of merged
    patches (issue 28).

    There ``window_size`` counts *pixels* (112 = 14-pixel patches x merge 2 x 4 merged tokens);
    the swin rule (:func:`_shrink_value`: at most 4, a window of patches) leaves 4 pixels, less than
    one merged patch, and the window index divides by ``window_size // merge // patch`` = 0
    (ZeroDivisionError in ``get_vision_window_index``). The tiny window is 2 x 2 merged patches of
    the tiny patch size. Changes ``out`` in place.
    """
    window, merge, patch = (values.get(k) for k in ("window_size", "spatial_merge_size", "patch_size"))
    if not (_is_int(window) and _is_int(merge) and _is_int(patch)) or window < merge * patch:
        return
    tiny_patch = out.get("patch_size", patch)
    if _is_int(tiny_patch):
        out["window_size"] = 2 * merge * tiny_patch


def _scale_grid_pinpoints(values: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Scale an "anyres" model's ``image_grid_pinpoints`` with its vision tower's image size (issue 28).

    LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision cut an image into tiles of the vision tower's
    ``image_size`` laid out on the best-fitting resolution among ``image_grid_pinpoints`` (multiples
    of 336 or 384 pixels by default). Next to the 32-pixel tiny vision tower those resolutions mean
    hundreds of tiles per image; scaled by ``tiny / default`` image size they keep the same tile
    grids (1x2, 2x1, 2x2 ... tiles). Changes ``out`` in place.
    """
    pinpoints = values.get("image_grid_pinpoints")
    vision = values.get("vision_config")
    if not (isinstance(pinpoints, list) and pinpoints and isinstance(vision, Mapping)):
        return
    old = vision.get("image_size")
    new = (out.get("vision_config") or {}).get("image_size", old)
    if not (_is_int(old) and _is_int(new)) or old == new:
        return
    scaled: list[list[int]] = []
    for point in pinpoints:
        if isinstance(point, list | tuple) and len(point) == 2 and all(_is_int(v) for v in point):
            tile = [max(new, v * new // old) for v in point]
            if tile not in scaled:
                scaled.append(tile)
    if scaled:
        out["image_grid_pinpoints"] = scaled


def _fit_backbone_outputs(
    values: Mapping[str, Any], out: dict[str, Any], layer_key: str, layers: int
) -> None:
    """Keep a transformer backbone's feature taps inside the tiny layer stack (issue 28).

    A backbone of a dense-prediction head (dinov2 under depth_anything, vit under zoedepth) taps
    ``out_features`` ``["stage9", ..., "stage12"]`` of 12 layers; the shrunk 2-layer stack has only
    ``stage1``/``stage2``, and transformers refuses the config. The neck expects as many taps as the
    default has, so the stack gets that many layers (at least the tiny count) and taps its last
    ones. A convolutional backbone (``depths`` per stage) keeps its stages and is left alone.
    """
    outs = values.get("out_features")
    if not isinstance(outs, list) or not outs or isinstance(values.get("depths"), list):
        return
    stages = {"stem", *(f"stage{i}" for i in range(1, layers + 1))}
    if set(outs) <= stages:
        return
    wanted = len(outs)
    n = max(layers, wanted)
    out[layer_key] = n
    out["out_features"] = [f"stage{i}" for i in range(n - wanted + 1, n + 1)]
    out["out_indices"] = list(range(n - wanted + 1, n + 1))


def _shrink_per_layer(
    per_layer: Mapping[Any, Any], shrunk: Mapping[str, Any], heads: Any, layers: Any, types: Any
) -> dict[str, Any]:
    """Shrink a heterogeneous config's ``per_layer_config`` (transformers >= 5.20: ``{layer index:
    {attribute: value}}`` overriding the global attributes for one layer, e.g. dots3_note's and
    gemma4's wider sliding/full-attention layers).

    Tiny layer ``i`` takes the overrides of the first original layer of its type (the layer types
    are trimmed to cover each kind, see :func:`_trim_layer_types`), or of original layer ``i`` when
    the config has no ``layer_types``. An attribute the top-level shrink changed takes the top-level
    tiny value (a 256-wide head next to 16-wide global heads would break the tiny model's shape
    rules); any other is shrunk by the same rules. Types whose layers need different tiny values
    (dots3_note's sliding layers) have an overlay in :mod:`hfexport.tiny.presets`.
    """
    by_index: dict[int, Mapping[str, Any]] = {}
    for key, attrs in per_layer.items():
        try:
            by_index[int(key)] = attrs
        except (TypeError, ValueError):
            continue
    if not _is_int(layers):
        return {str(i): dict(a) for i, a in by_index.items()}
    tiny_types = _trim_layer_types(list(types), layers) if isinstance(types, list) else None
    out: dict[str, Any] = {}
    for i in range(layers):
        source = list(types).index(tiny_types[i]) if tiny_types and i < len(tiny_types) else i
        attrs = by_index.get(source)
        if not isinstance(attrs, Mapping):
            continue
        layer: dict[str, Any] = {}
        for key, value in attrs.items():
            if key in shrunk:
                layer[key] = shrunk[key]
            else:
                new = _shrink_value(key, value, heads)
                layer[key] = value if new is _KEEP else new
        out[str(i)] = layer
    return out


def _shrink_value(key: str, value: Any, heads: Any) -> Any:
    """The tiny value of one attribute, or ``_KEEP``."""
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        if key in ("depths", "encoder_layers", "decoder_layers", "num_hidden_layers"):
            return [1] * len(value)
        if key in _HEAD_KEYS or key == "num_attention_heads":
            return [min(v, 2) for v in value]
        if key == "neck_hidden_sizes":  # dpt-like necks (issue 28)
            return [min(v, 16 * 2**i) for i, v in enumerate(value)]
        if key in ("hidden_sizes", "embed_dims", "embed_dim", "hidden_size", "dims"):
            return [min(v, 16 * 2**i) for i, v in enumerate(value)]
        if key == "conv_dim":
            return [32] * len(value)
        if key in _FFN_KEYS:
            return [FFN] * len(value)
        return _KEEP
    if not _is_int(value):
        return _KEEP
    if key in _HIDDEN_KEYS:
        return min(value, HIDDEN)
    if key in _FFN_KEYS:
        return min(value, FFN)
    if key in _LAYER_KEYS:
        return min(value, LAYERS)
    if key in _HEAD_KEYS:
        return min(value, HEADS)
    if key in _KV_HEAD_KEYS:
        return min(_kv_heads(value, heads), HEADS)
    if key in _HEAD_DIM_KEYS:
        return HEAD_DIM
    if key in _MLA:
        return _MLA[key]
    if key == "rotary_dim":
        return min(value, HEAD_DIM)
    if key == "window_size":  # swin-like windows over the 8x8 patch grid of a 32x32 image
        return min(value, 4)
    if key == "mm_tokens_per_image":
        return min(value, 4)
    if key in ("vocab_size", "vocab_size_per_layer_input"):
        return min(value, VOCAB)
    if key in _POSITION_KEYS:
        return value if value <= 2 * MAX_POSITIONS else MAX_POSITIONS
    if key in _EXPERT_KEYS:
        return min(value, EXPERTS)
    if key in _EXPERT_TOPK_KEYS:
        return min(value, EXPERTS_PER_TOKEN)
    if key in _ONE_KEYS:
        return min(value, 1)
    if key == "first_k_dense_replace":
        return min(value, 1)
    if key == "sliding_window":
        return min(value, SLIDING_WINDOW)
    if key == "image_size":
        return min(value, IMAGE_SIZE)
    if key == "patch_size":
        return value if value <= 4 else PATCH_SIZE
    if key in ("encoder_stride",):
        return min(value, PATCH_SIZE)
    if key in ("num_conv_pos_embeddings",):
        return min(value, 16)
    if key in ("num_conv_pos_embedding_groups",):
        return min(value, 4)
    if key in ("reassemble_hidden_size", "fusion_hidden_size"):  # dense-prediction necks (issue 28)
        return min(value, HIDDEN)
    if key in ("classifier_proj_size", "conv_channels", "proj_codevector_dim", "codevector_dim"):
        return min(value, 32)
    return _KEEP


def _vocab_sizes(config: Any) -> list[int]:
    items = config.to_dict().items() if isinstance(config, PretrainedConfig) else config.items()
    sizes = []
    for key, value in items:
        if not isinstance(key, str):
            continue
        if isinstance(value, PretrainedConfig | Mapping):
            sizes += _vocab_sizes(value)
        elif key == "vocab_size" and _is_int(value):
            sizes.append(value)
    return sizes


def _token_remap(config: PretrainedConfig) -> dict[int, int]:
    """Special ids >= 3 -> v-1, v-2, ... with v the smallest shrunk vocabulary of the tree (255, 254,
    ... for a 256-token vocabulary); equal ids stay equal. Empty when the tree has no vocabulary."""
    sizes = _vocab_sizes(config)
    if not sizes:
        return {}
    top = min(min(sizes), VOCAB)
    ids = sorted(i for i in special_token_ids(config) if i >= 3)
    return {old: top - 1 - k for k, old in enumerate(ids) if top - 1 - k >= 3}
