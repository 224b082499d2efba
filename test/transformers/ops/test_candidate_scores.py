"""Candidate scores (ops/candidate_scores.py) against the eager ``W[ids].float() @ h`` of the refinement loss.

fp32 and fp16 run the Triton kernels (through the interpreter on CPU), fp64 the torch path. H = 300 spans two
256-wide tiles with a ragged end, K = 3 pads to 4.
"""

import pytest
import torch

from liger_dspine.ops.candidate_scores import liger_candidate_scores


def eager_scores(hidden, weight, ids):
    return torch.matmul(weight[ids].float(), hidden.float()[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_matches_eager_forward_and_backward(device, dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 300, generator=generator).to(device, dtype)
    weight = torch.randn(50, 300, generator=generator).to(device, dtype)
    ids = torch.randint(0, 50, (2, 5, 3), generator=generator).to(device)
    upstream = torch.randn(2, 5, 3, generator=generator).to(device)

    leaf = hidden.clone().requires_grad_(True)
    scores = liger_candidate_scores(leaf, weight, ids)
    (scores * upstream).sum().backward()
    ref_leaf = hidden.clone().requires_grad_(True)
    ref = eager_scores(ref_leaf, weight, ids)
    (ref * upstream).sum().backward()

    assert scores.dtype == torch.float32 and scores.shape == (2, 5, 3)
    # fp32 sums of 300 products of O(1) in another order: ~1e-5; fp16 gradients are rounded to fp16
    torch.testing.assert_close(scores, ref, atol=5e-5, rtol=1e-5)
    assert leaf.grad.dtype == dtype
    tolerance = dict(atol=2e-3, rtol=1e-3) if dtype == torch.float16 else dict(atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, **tolerance)


def test_bad_arguments_are_named():
    hidden, weight, ids = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="liger-dspine: candidate scores expect"):
        liger_candidate_scores(hidden, weight[:, :7], ids)
    with pytest.raises(ValueError, match="freeze it"):
        liger_candidate_scores(hidden, weight.requires_grad_(True), ids)
