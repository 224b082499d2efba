"""The alignment term's op (ops/alignment_cosine.py) against ``1 - F.cosine_similarity`` of the objective.

fp32 and fp16 features run the Triton kernels (through the interpreter on CPU), fp64 the torch expression. r = 1500
spans two 1024-wide tiles with a ragged end; one feature row is zero (its norm clamped to eps).
"""

import pytest
import torch

from liger_dspine.models.dspine.objective import alignment_terms
from liger_dspine.ops.alignment_cosine import liger_alignment_cosine


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("rank", [24, 1500])
def test_matches_the_eager_term(device, dtype, rank):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 2, 5, rank, generator=generator)
    features[1, 0, 2] = 0.0
    features = features.to(device, dtype)
    codes = torch.randn(3, 5, rank, generator=generator).to(device)
    upstream = torch.randn(3, 2, 5, generator=generator).to(device)
    results = []
    for fused in (False, True):
        leaf = features.clone().requires_grad_(True)
        align = alignment_terms(leaf, codes, fused=fused)
        (align * upstream).sum().backward()
        results.append((align.detach(), leaf.grad))
    (want, want_grad), (got, grad) = results
    assert got.dtype == torch.float32 and got.shape == (3, 2, 5) and grad.dtype == dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    tolerance = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, **tolerance)


def test_codes_with_a_gradient_take_the_torch_expression():
    features = torch.randn(2, 3, 4, 8, requires_grad=True)
    codes = torch.randn(2, 4, 8, requires_grad=True)
    liger_alignment_cosine(features, codes).sum().backward()
    assert codes.grad is not None and features.grad is not None


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="liger-dspine: the alignment term expects"):
        liger_alignment_cosine(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8))
