"""Candidate scores (ops/candidate_scores.py) against the eager ``W[ids].float() @ h`` of the refinement loss."""

import pytest
import torch

from liger_dspine.ops.candidate_scores import liger_candidate_scores


def eager_scores(hidden, weight, ids):
    return torch.matmul(weight[ids].float(), hidden.float()[..., None]).squeeze(-1)


@pytest.mark.parametrize("block_bytes", [1, 3 * 4 * 16 * 4, 2**20])  # one row per block, 4 rows, all rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_forward_and_backward(block_bytes, dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=generator, dtype=dtype)
    weight = torch.randn(50, 16, generator=generator, dtype=dtype)
    ids = torch.randint(0, 50, (2, 5, 3), generator=generator)
    upstream = torch.randn(2, 5, 3, generator=generator)

    leaf = hidden.clone().requires_grad_(True)
    scores = liger_candidate_scores(leaf, weight, ids, block_bytes=block_bytes)
    (scores * upstream).sum().backward()
    ref_leaf = hidden.clone().requires_grad_(True)
    ref = eager_scores(ref_leaf, weight, ids)
    (ref * upstream).sum().backward()

    assert scores.dtype == torch.float32 and scores.shape == (2, 5, 3)
    torch.testing.assert_close(scores, ref, atol=1e-5, rtol=1e-6)
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=1e-5, rtol=1e-6)


def test_bad_arguments_are_named():
    hidden, weight, ids = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="liger-dspine: candidate scores expect"):
        liger_candidate_scores(hidden, weight[:, :7], ids)
    with pytest.raises(ValueError, match="freeze it"):
        liger_candidate_scores(hidden, weight.requires_grad_(True), ids)
