"""FNet's Fourier token mixing in real arithmetic (hfexport.workarounds.fourier, issue 28): the values
against ``torch.fft.fftn``, the patch's registry metadata and scope, and a dynamic capture of a tiny
FNet whose program holds no complex tensor and matches eager at two sequence lengths."""

from __future__ import annotations

import pytest
import torch

from hfexport import registry
from hfexport.registry import apply_patches, isolated_registry
from hfexport.testing import tiny_model
from hfexport.workarounds import fourier

_ISSUE = "https://github.com/o/r/issues/1"


@pytest.mark.parametrize("shape", [(2, 8, 64), (1, 65, 48), (3, 1, 5)])
def test_real_fourier_mixing_is_the_real_part_of_the_2d_fft(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    expected = torch.fft.fftn(x, dim=(1, 2)).real
    got = fourier.real_fourier_mixing(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) <= 1e-5 * scale


def test_real_fourier_mixing_refuses_what_it_does_not_compute():
    with pytest.raises(TypeError, match="real floating point"):
        fourier.real_fourier_mixing(torch.ones(2, 3, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"\[batch, seq, hidden\]"):
        fourier.real_fourier_mixing(torch.ones(3, 4))


def test_patch_is_registered_under_its_key_and_in_place_only_inside_apply_patches():
    from transformers.models.fnet.modeling_fnet import FNetBasicFourierTransform

    forward = FNetBasicFourierTransform.forward
    with isolated_registry():
        fourier.register_real_fourier_mixing("demo", issue=_ISSUE, versions={"torch": ">=2.0"})
        (entry,) = registry.entries("demo", kind="patch")
        assert entry.paths == fourier.FNET_FOURIER_TARGETS and entry.issue == _ISSUE and entry.is_active()
        with pytest.raises(RuntimeError, match="boom"), apply_patches("demo"):
            assert FNetBasicFourierTransform.forward is not forward
            raise RuntimeError("boom")
    assert FNetBasicFourierTransform.forward is forward


def _complex_or_fft_nodes(program: torch.export.ExportedProgram) -> list[str]:
    found = []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        is_complex = isinstance(value, torch.Tensor) and value.is_complex()
        if is_complex or "fft" in str(node.target) or "view_as_real" in str(node.target):
            found.append(str(node.target))
    return found


def test_fnet_captures_without_complex_tensors_and_matches_eager_at_two_lengths():
    model, inputs = tiny_model("fnet", "token-classification")
    longer = {k: v.repeat(1, 4)[:, :29] for k, v in inputs.items()}  # another sequence length
    with torch.no_grad():
        expected = [model(**inputs).logits, model(**longer).logits]
    # without the patch the program holds aten._fft_c2c on a complex64 copy: the patched one must not
    seq = torch.export.Dim("seq", min=2, max=512)
    dynamic = {k: {1: seq} for k in inputs}
    with isolated_registry(), torch.no_grad():
        fourier.register_real_fourier_mixing("demo", issue=_ISSUE, versions={"torch": ">=2.0"})
        with apply_patches("demo"):
            program = torch.export.export(model, (), dict(inputs), dynamic_shapes=dynamic, strict=False)
        got = [program.module()(**inputs).logits, program.module()(**longer).logits]
    assert _complex_or_fft_nodes(program) == []
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    assert got[1].shape == (2, 29, 3)
