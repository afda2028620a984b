"""The object detectors' capture workarounds (hfexport.workarounds.detection, issue 28).

The OmDet-Turbo patch is checked for its registry metadata, for the key the capture picks (only
for an OmDet-Turbo model), for giving the eager numbers, and for what it exists for: without it
``torch.export`` cannot capture the tiny model, with it the program runs another batch size and
matches eager. Tiny models only (the capture takes a few seconds).
"""

from __future__ import annotations

import pytest
import torch

from hfexport import registry
from hfexport.registry import apply_patches
from hfexport.testing import tiny_model
from hfexport.workarounds import detection

TASK = "zero-shot-object-detection"
OMDET = f"{detection.__name__}.omdet_language_embedding_batched"
OUTPUTS = ("decoder_class_logits", "decoder_coord_logits")


def test_entry_is_registered_under_the_capture_scope_with_issue_link_and_range():
    assert detection.KEY == "capture.detection"
    found = {e.name: e for e in registry.entries(detection.KEY, kind="patch")}
    entry = found[OMDET]
    assert entry.paths == detection.OMDET_LANGUAGE_TARGETS
    assert entry.issue == "https://github.com/pytorch/pytorch/issues/126685"
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved
    assert OMDET not in {e.name for e in registry.entries("capture", kind="patch")}


def test_capture_key_is_the_detection_scope_only_for_omdet():
    model, _ = tiny_model("omdet-turbo", TASK)
    assert detection.capture_key(model) == "capture.detection"
    owl, _ = tiny_model("owlvit", TASK)
    assert detection.capture_key(owl) is None


def _second(model, inputs) -> dict[str, torch.Tensor]:
    from hfexport.verify.second_shape import derive_second_inputs

    second, reason = derive_second_inputs(model, inputs)
    assert second is not None, reason
    return second


def test_omdet_queries_have_input_roles_for_a_second_shape():
    model, inputs = tiny_model("omdet-turbo", TASK)
    second = _second(model, inputs)
    shapes = {k: tuple(v.shape) for k, v in second.items()}
    assert shapes["pixel_values"] == (3, 3, 64, 64)  # one image more, sides doubled
    assert shapes["classes_input_ids"] == shapes["tasks_input_ids"] == (3, 4)  # queries keep their length
    assert shapes["tasks_attention_mask"] == shapes["classes_attention_mask"] == (3, 4)
    assert second["classes_structure"].tolist() == [1, 1, 1]  # repeated, never generated


def test_patched_embedding_gives_the_eager_outputs():
    model, inputs = tiny_model("omdet-turbo", TASK)
    with torch.no_grad():
        eager = model(**inputs)
        with apply_patches(detection.KEY):
            patched = model(**inputs)
    for name in OUTPUTS:
        torch.testing.assert_close(patched[name], eager[name], rtol=0, atol=1e-6)


def test_omdet_exports_only_with_the_patch_and_runs_another_batch():
    from hfexport.capture import auto_dynamic_shapes

    model, inputs = tiny_model("omdet-turbo", TASK)
    shapes = auto_dynamic_shapes(inputs)
    with pytest.raises(Exception, match=r"data-dependent"):  # the token-keyed cache: .tolist()
        torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    with apply_patches(detection.KEY):
        program = torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    other = _second(model, inputs)
    # the hybrid encoder's positional grid holds the image sides static (the exporter keeps the
    # sides a program took static at its second shape): another batch only
    other["pixel_values"] = other["pixel_values"][:, :, :32, :32].contiguous()
    with torch.no_grad():
        got = program.module()(**other)
        want = model(**other)
    for name in OUTPUTS:
        assert got[name].shape[0] == 3
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_symbolic_len_is_the_builtin_except_on_tensors():
    assert detection.symbolic_len([1, 2, 3]) == 3
    assert detection.symbolic_len(torch.zeros(5, 2)) == 5
    with pytest.raises(TypeError):
        detection.symbolic_len(torch.tensor(1.0))
    with pytest.raises(TypeError):
        detection.symbolic_len(7)


def test_rt_detr_exports_a_dynamic_batch_only_with_the_patch():
    import transformers.models.rt_detr.modeling_rt_detr as rt_detr
    from torch.export import Dim

    model, inputs = tiny_model("rt_detr", "object-detection")
    assert detection.capture_key(model) == "capture.detection"
    shapes = {"pixel_values": {0: Dim("batch", min=1, max=16)}}
    with pytest.raises(Exception, match=r"specialized it to be a constant \(2\)"):  # len(source_flatten)
        torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    with apply_patches(detection.KEY):
        program = torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    assert "len" not in vars(rt_detr)  # the module-level len is gone after the forward
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = program.module()(pixel_values=pixels), model(pixel_values=pixels)
    for name in ("logits", "pred_boxes"):
        assert got[name].shape[0] == 3
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_take_along_dim_as_gather_gives_the_same_values_and_falls_back_to_broadcast():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    idx = torch.argsort(x[..., 0], dim=1)
    with apply_patches(detection.KEY):
        patched = torch.take_along_dim
        same = patched(x, idx[..., None].expand(-1, -1, 4), dim=1)
        broadcast = patched(x, idx[..., None], dim=1)  # indices [3, 5, 1]: needs the broadcast
        flat = patched(x, torch.tensor([0, 7]))  # no dim: the flattened input
    assert torch.take_along_dim is not patched  # restored
    torch.testing.assert_close(same, torch.take_along_dim(x, idx[..., None].expand(-1, -1, 4), dim=1))
    torch.testing.assert_close(broadcast, torch.take_along_dim(x, idx[..., None], dim=1))
    torch.testing.assert_close(flat, x.flatten()[[0, 7]])


def test_pp_doclayout_exports_a_dynamic_batch_with_the_patches():
    from torch.export import Dim

    model, inputs = tiny_model("pp_doclayout_v2", "object-detection")
    shapes = {"pixel_values": {0: Dim("batch", min=1, max=16)}}
    with apply_patches(detection.KEY):
        program = torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = program.module()(pixel_values=pixels), model(pixel_values=pixels)
    for name in ("logits", "pred_boxes", "order_logits"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)


class _KeptFirst(torch.nn.Module):
    """PP-DocLayout-V2's sort: the queries passing their threshold first (a 0/1 key, all ties)."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.argsort((scores > 0).int(), dim=1, descending=True)


def test_argsort_of_integer_keys_breaks_ties_by_position():
    """issue 28: pp_doclayout_v2's OpenVINO export returned its logits / pred_boxes permuted among tied
    queries. Under the patch the captured sort has unique keys: the stable order, whatever the runtime's
    sort; eager's own unstable sort already differs from it at 33 queries."""
    scores = torch.randn(2, 33, generator=torch.Generator().manual_seed(0))
    stable = torch.argsort((scores > 0).int(), dim=1, descending=True, stable=True)
    assert not torch.equal(_KeptFirst()(scores), stable)  # the unpatched order among ties is the sort's own
    with apply_patches(detection.KEY):
        program = torch.export.export(_KeptFirst(), (scores,), strict=False)
        assert torch.equal(_KeptFirst()(scores), stable)
    assert torch.equal(program.module()(scores), stable)
    assert torch.equal(torch.argsort(scores, dim=1), torch.argsort(scores, dim=1))  # original back
    with pytest.raises(ValueError, match="integer or boolean keys"):
        detection.stable_integer_argsort(scores)


GROUNDING = f"{detection.__name__}.grounding_phrase_masks_without_cumulative_extrema"


def test_grounding_phrase_masks_equal_transformers_on_random_token_mixes():
    """issue 28: Grounding DINO's phrase masks (cummax/cummin/isin, which ONNX and OpenVINO do not
    convert) computed with a masked max/min over token pairs give exactly transformers' results."""
    from transformers.models.grounding_dino import modeling_grounding_dino as upstream

    special = torch.tensor([101, 102, 1012, 1029])
    pool = torch.tensor([5, 6, 7, 101, 102, 1012, 1029])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch, length = (
            int(torch.randint(1, 4, (1,), generator=gen)),
            int(torch.randint(1, 12, (1,), generator=gen)),
        )
        ids = pool[torch.randint(0, len(pool), (batch, length), generator=gen)]
        want_mask, want_positions = upstream.generate_masks_with_special_tokens_and_transfer_map(ids, special)
        mask, positions = detection.grounding_phrase_masks(ids, special)
        assert torch.equal(mask, want_mask), ids
        assert torch.equal(positions, want_positions) and positions.dtype == torch.long, ids
    # "a cat . a dog ." with [CLS]/[SEP]: two phrases of 3 tokens, positions counted within each
    ids = torch.tensor([[101, 5, 6, 1012, 5, 7, 1012, 102]])
    mask, positions = detection.grounding_phrase_masks(ids, special)
    assert positions.tolist() == [[0, 0, 1, 2, 0, 1, 2, 0]]
    assert mask[0, 1].tolist() == [False, True, True, True, False, False, False, False]


def test_grounding_mask_patch_is_registered_and_installed_for_both_grounding_types():
    found = {e.name: e for e in registry.entries(detection.KEY, kind="patch")}
    entry = found[GROUNDING]
    assert entry.paths == detection.GROUNDING_MASK_TARGETS
    assert entry.issue == "https://github.com/pytorch/pytorch/pull/84496"
    assert entry.is_active(), entry.inactive_reason()
    assert not entry.unresolved, entry.unresolved
    model, _ = tiny_model("grounding-dino", TASK)
    assert detection.capture_key(model) == "capture.detection"
    from transformers.models.mm_grounding_dino import modeling_mm_grounding_dino as mm

    original = mm.generate_masks_with_special_tokens_and_transfer_map
    with apply_patches(detection.KEY):
        assert mm.generate_masks_with_special_tokens_and_transfer_map is not original
    assert mm.generate_masks_with_special_tokens_and_transfer_map is original
