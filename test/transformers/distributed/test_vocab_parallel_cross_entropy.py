"""The vocabulary-parallel linear cross entropy on 2 and 4 gloo ranks against the cross entropy of the whole logits.

Each rank holds an uneven slice of the head's rows (V = 37). fp32: the reference is float64 logits on the whole head;
1e-5 covers the reordered fp32 reductions. The loss and d hidden are compared on every rank (they must agree), d weight
row by row against the reference's rows of that rank.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.ops.vocab_parallel_cross_entropy import liger_vocab_parallel_linear_cross_entropy
from spawned_ranks import run_on_gloo_ranks

T, H, V = 21, 12, 37
FP32 = dict(atol=1e-5, rtol=1e-5)


def _inputs(all_ignored=False):
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) * 0.5
    targets = torch.randint(0, V, (T,), generator=generator)
    targets[::4] = -100
    if all_ignored:
        targets[:] = -100
    return hidden, weight, targets


def _slices(world_size):
    bounds = torch.linspace(0, V, world_size + 1).round().long().tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _rank_case(rank, world_size, reduction, vocab_chunk, all_ignored):
    import torch.distributed as dist

    hidden, weight, targets = _inputs(all_ignored)
    start, end = _slices(world_size)[rank]
    hidden = hidden.clone().requires_grad_()
    local = weight[start:end].clone().requires_grad_()
    loss = liger_vocab_parallel_linear_cross_entropy(
        hidden, local, targets, start, V, reduction=reduction, vocab_chunk=vocab_chunk
    )
    (loss * 1.5).backward()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (loss.detach(), hidden.grad, local.grad))
    return gathered


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("reduction", "vocab_chunk", "all_ignored"), [("mean", 8, False), ("sum", None, False), ("mean", 5, True)]
)
def test_matches_whole_logits(tmp_path, world_size, reduction, vocab_chunk, all_ignored):
    per_rank = run_on_gloo_ranks(tmp_path, world_size, _rank_case, reduction, vocab_chunk, all_ignored)

    hidden, weight, targets = _inputs(all_ignored)
    hidden64, weight64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = F.cross_entropy(hidden64 @ weight64.t(), targets, ignore_index=-100, reduction="sum")
    if reduction == "mean":
        loss = loss / (targets != -100).sum().clamp(min=1)
    (loss * 1.5).backward()

    for rank, (rank_loss, grad_hidden, grad_local) in enumerate(per_rank):
        start, end = _slices(world_size)[rank]
        torch.testing.assert_close(rank_loss.double(), loss.detach(), **FP32)
        torch.testing.assert_close(grad_hidden.double(), hidden64.grad, **FP32)
        torch.testing.assert_close(grad_local.double(), weight64.grad[start:end], **FP32)
    if all_ignored:
        assert per_rank[0][0].item() == 0.0 and not per_rank[0][1].any()


def test_bad_input_is_named():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=r"rows \[30, 40\) are not inside \[0, 37\)"):
        liger_vocab_parallel_linear_cross_entropy(hidden, weight[:10], targets, 30, V)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 37\)"):
        liger_vocab_parallel_linear_cross_entropy(hidden, weight, targets + 40, 0, V)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        liger_vocab_parallel_linear_cross_entropy(hidden, weight, targets, 0, V, reduction="none")
