"""The top-k candidate kernel (ops/frozen_head_candidates.py) against torch.topk over the whole row.

The kernel reads only the K sub-blocks with the largest maxima, so it must find the same K largest logits as a
top-k over all V, largest first, and the teacher's probabilities at them. Rows with ties, -inf and NaN logits are
checked for what the contract promises there: the same multiset of values, no id twice, ids inside the vocabulary.
"""

import pytest
import torch

from liger_dspine.ops.frozen_head_candidates import MAX_TOP_K
from liger_dspine.ops.frozen_head_candidates import top_candidates

SUB = 256


def sub_maxima(z: torch.Tensor) -> torch.Tensor:
    rows, vocab = z.shape
    padded = torch.full((rows, -(-vocab // SUB) * SUB), float("-inf"), dtype=torch.float32, device=z.device)
    padded[:, :vocab] = z.float()
    return padded.view(rows, -1, SUB).amax(dim=-1)


def run(z, y, top_k):
    lse = torch.logsumexp(y.float(), dim=-1)
    ids, probs = top_candidates(z, y, sub_maxima(z), lse, top_k, SUB)
    return ids, probs, lse


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("vocab, top_k", [(3000, 4), (3000, 5), (2100, 7), (5000, 16)])
def test_candidates_match_a_full_row_topk(device, half, vocab, top_k):
    """fp32, and the GEMM's half dtype (bf16 on a GPU; fp16 through the CPU interpreter, which has no bf16)."""
    dtype = (torch.bfloat16 if device == "cuda" else torch.float16) if half else torch.float32
    generator = torch.Generator().manual_seed(vocab + top_k)
    z = (torch.randn(6, vocab, generator=generator) * 3).to(device=device, dtype=dtype)
    y = (torch.randn(6, vocab, generator=generator) * 3).to(device=device, dtype=dtype)
    z[1, :SUB] += 20  # one sub-block holds every candidate
    z[2, -3:] += 20  # the last, partial sub-block holds some
    ids, probs, lse = run(z, y, top_k)
    expected = torch.topk(z.float(), top_k, dim=-1)
    assert ids.dtype == torch.int64 and probs.dtype == torch.float32
    torch.testing.assert_close(z.float().gather(-1, ids), expected.values, atol=0, rtol=0)  # same values, in order
    if dtype == torch.float32:  # continuous values: no ties, so the same ids
        assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(probs, torch.exp(y.float().gather(-1, ids) - lse[:, None]), atol=1e-6, rtol=1e-5)


def test_ties_inf_and_nan_keep_the_contract(device):
    vocab, top_k = 1700, 6
    generator = torch.Generator().manual_seed(5)
    z = torch.randn(4, vocab, generator=generator)
    z[0] = 1.0  # every logit tied
    z[1] = float("-inf")
    z[1, 700:703] = 2.0  # three finite logits, the rest -inf
    z[2, 11] = float("nan")  # NaN ranks first, as in torch.topk
    z, y = z.to(device), torch.randn(4, vocab, generator=generator).to(device)
    ids, _, _ = run(z, y, top_k)
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    for row in range(4):
        assert len(set(ids[row].tolist())) == top_k, f"row {row}: an id twice"
    assert (z[0].gather(-1, ids[0]) == 1.0).all()
    assert sorted(ids[1, :3].tolist()) == [700, 701, 702]
    assert (z[1].gather(-1, ids[1, 3:]) == float("-inf")).all()
    assert int(ids[2, 0]) == 11
    rest = torch.topk(z[2].masked_fill(z[2].isnan(), float("-inf")), top_k - 1).values
    torch.testing.assert_close(z[2].gather(-1, ids[2, 1:]), rest, atol=0, rtol=0)


def test_out_of_range_top_k_is_named(device):
    z = torch.randn(2, 600, device=device)
    with pytest.raises(ValueError, match="top_candidates needs"):
        run(z, z, MAX_TOP_K + 1)
    with pytest.raises(ValueError, match="top_candidates needs"):
        run(z, z, 3)  # 3 x 256 >= 600: torch's top-k serves that
