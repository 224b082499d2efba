"""Linear cross entropy on a vocabulary-parallel head: each rank holds rows [v0, v0 + Vr) of ``lm_head.weight``.

    loss = reduce_t  ce_t,   ce_t = logsumexp_v(z_t) - z_t[y_t],   z = hidden @ weight^T  (all V columns)

Tensor parallelism shards ``lm_head`` column-wise (the vocabulary); the native path gathers the [T, V] logits on
every rank. Here each rank runs the vocabulary-chunked loss's kernels (``ops/linear_cross_entropy.py``) on its own
rows only, and the ranks all-reduce three numbers per row instead of the logits: the row max (MAX), then the sum of
exponentials rescaled to it and the target's logit (SUM, in one call; exactly one rank holds each target). No rank
forms the whole logits.

Forward: the per-row statistics of the rank's rows (vocabulary chunks of Vc columns, one GEMM and one Triton pass
each), the two all-reduces, lse [T] fp32; saved: hidden, the local weight, the local targets and lse.
Backward, for each vocabulary chunk (the same GEMM recomputes Z_j):
    dZ_j = (exp(Z_j - lse) - onehot(y)) * scale          the rank's columns; ignored rows are zero
    d weight_r[j-th rows] = dZ_j^T @ hidden              written into its slice, no accumulator
    d hidden += dZ_j @ W_j                               fp32; a partial sum over the vocabulary, made whole by one
                                                         SUM all-reduce of [T, H] on every rank
hidden is replicated over the group (as the native column-parallel head's input is), so every rank returns the same
d hidden, as the native path's input all-reduce gives.

Transient memory per rank: one [T, Vc] logits chunk (``default_vocab_chunk`` of the local rows) and the fp32
d hidden [T, H], beside d weight_r itself. Reductions: "mean" over the rows whose target is not ``ignore_index`` (0
with zero gradients when there are none), or "sum". Targets outside [0, V) other than ``ignore_index`` are an error.
"""

import torch
import torch.distributed as dist

from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.gemm_dtype import gemm_dtype
from liger_dspine.ops.linear_cross_entropy import _vocab_chunked_ce_backward
from liger_dspine.ops.linear_cross_entropy import _vocab_chunked_ce_stats
from liger_dspine.ops.linear_cross_entropy import default_vocab_chunk

IGNORE_INDEX = -100
_KERNEL_IGNORE = -1  # the local targets' ignore index: valid rows map into [0, Vr] (Vr: held by another rank)


def local_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int, ignore_index: int) -> torch.Tensor:
    """Targets as column indices of the rank's rows: ``Vr`` where another rank holds the target (it matches no
    column), -1 for an ignored row."""
    local = targets - vocab_start
    local = torch.where((local >= 0) & (local < local_vocab), local, local_vocab)
    return torch.where(targets == ignore_index, _KERNEL_IGNORE, local)


class LigerVocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [T, H], weight_r [Vr, H], targets [T], vocab_start, group, ignore_index, reduction, vocab_chunk)``
    -> loss (0-d fp32), identical on every rank of ``group``."""

    kernel_ops = ("liger_dspine::vocab_chunked_ce_stats", "liger_dspine::vocab_chunked_ce_backward")

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, group, ignore_index, reduction, vocab_chunk):
        dtype = gemm_dtype(hidden, weight, "vocabulary-parallel linear cross entropy")
        local = local_targets(targets, vocab_start, weight.shape[0], ignore_index)
        row_max, row_sumexp, target_logit, _ = _vocab_chunked_ce_stats(hidden, weight, local, False, vocab_chunk, dtype)
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescaled = torch.where(row_max > float("-inf"), row_sumexp * torch.exp(row_max - global_max), 0.0)
        sums = torch.stack([rescaled, target_logit])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = global_max + torch.log(sums[0])
        valid = targets != ignore_index
        total = torch.where(valid, lse - sums[1], 0.0).sum()
        scale = 1.0 / valid.sum().clamp(min=1).float() if reduction == "mean" else torch.ones((), device=lse.device)
        ctx.save_for_backward(hidden, weight, local, lse, scale)
        ctx.group, ctx.vocab_chunk, ctx.compute_dtype = group, vocab_chunk, dtype
        return total * scale

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss):
        hidden, weight, local, lse, scale = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 6
        if not (need_hidden or need_weight):
            return None, None, *none
        grad_scale = (scale * grad_loss.float()).contiguous()
        grad_hidden, grad_weight = _vocab_chunked_ce_backward(
            hidden, weight, local, lse, grad_scale, _KERNEL_IGNORE, ctx.vocab_chunk, ctx.compute_dtype,
            need_hidden, need_weight,
        )  # fmt: skip
        if need_hidden:  # each rank's columns give a partial d hidden: summed in fp32
            whole = grad_hidden.float()
            dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=ctx.group)
            grad_hidden = whole.to(hidden.dtype)
        return grad_hidden if need_hidden else None, grad_weight if need_weight else None, *none


def liger_vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group=None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    vocab_chunk: int | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden [T, H] @ weight^T`` where ``weight [Vr, H]`` is this rank's slice of a [V, H] head
    starting at row ``vocab_start``, the slices of ``group``'s ranks covering [0, vocab_size). ``targets [T]`` and
    ``hidden`` are the same on every rank. Returns the loss (0-d fp32), the same on every rank."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"liger-dspine: vocabulary-parallel cross entropy takes hidden [T, H] and a weight slice [Vr, H], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"liger-dspine: targets must be integer [T={hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"liger-dspine: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0 <= vocab_start <= vocab_start + weight.shape[0] <= vocab_size:
        raise ValueError(
            f"liger-dspine: this rank's vocabulary rows [{vocab_start}, {vocab_start + weight.shape[0]}) are not "
            f"inside [0, {vocab_size})"
        )
    targets = targets.long()
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"liger-dspine: targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}")
    chunk = vocab_chunk or default_vocab_chunk(hidden.shape[0], weight.shape[0])
    return LigerVocabParallelLinearCrossEntropyFunction.apply(
        hidden, weight, targets, int(vocab_start), group, int(ignore_index), reduction, int(chunk)
    )
