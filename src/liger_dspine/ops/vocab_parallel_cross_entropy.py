"""Linear cross entropy on a vocabulary-parallel head: each rank holds rows [v0, v0 + Vr) of ``lm_head.weight``.

    loss = reduce_t  ce_t,   ce_t = logsumexp_v(z_t) - z_t[y_t],   z = hidden @ weight^T  (all V columns)

Tensor parallelism shards ``lm_head`` column-wise (the vocabulary); the native path gathers the [T, V] logits on
every rank. Here each rank computes its [T, Vr] logits in chunks of tokens and the ranks all-reduce three numbers
per row instead: the row max (MAX), then the sum of exponentials below it and the target's logit (SUM, in one
call; exactly one rank holds each target). The full logits never exist on any rank.

Forward, for each chunk of Tc tokens:   Z = hidden_c @ W_r^T (the input dtype, fp32 statistics), then the two
all-reduces; saved: hidden, the local weight, targets and lse [T] fp32.
Backward, for each chunk (the same GEMM recomputes Z):
    dZ = (exp(Z - lse) - onehot_r(y)) * scale          the rank's columns only; ignored rows are zero
    d weight_r += dZ^T @ hidden_c                      fp32 accumulator of the rank's rows
    d hidden_c  = dZ @ W_r                             a partial sum over the vocabulary: one SUM all-reduce of
                                                       [T, H] at the end makes it whole on every rank
hidden is replicated over the group (as the native column-parallel head's input is), so every rank returns the
same d hidden, as the native path's input all-reduce gives.

Transient memory per rank: one [Tc, Vr] chunk (Tc the largest multiple of 64 whose fp32 chunk fits
``DEFAULT_CHUNK_BYTES``), the fp32 d weight_r [Vr, H] and d hidden [T, H]. Reductions: "mean" over the rows whose
target is not ``ignore_index`` (0 with zero gradients when there are none), or "sum". Targets outside [0, V) other
than ``ignore_index`` are an error. These are torch GEMMs and collectives, no Triton kernel: the op runs wherever
the process group's backend does (gloo on CPU, NCCL on GPUs).
"""

import torch
import torch.distributed as dist

from liger_dspine.ops.first_order import first_order_only

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_token_chunk(tokens: int, local_vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: the largest multiple of 64 whose [rows, local_vocab] fp32 chunk fits ``chunk_bytes``."""
    rows = max(64, (chunk_bytes // (4 * max(local_vocab, 1))) // 64 * 64)
    return min(rows, max(tokens, 1))


def _chunk_logits(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden_c @ weight.t()).float()  # [Tc, Vr]


def _local_targets(targets_c: torch.Tensor, vocab_start: int, local_vocab: int):
    """(index into the rank's columns, clamped to a valid column; whether the target is on this rank)."""
    local = targets_c - vocab_start
    here = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), here


class LigerVocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [T, H], weight_r [Vr, H], targets [T], vocab_start, group, ignore_index, reduction, token_chunk)``
    -> loss (0-d fp32), identical on every rank of ``group``."""

    kernel_ops = ()  # torch GEMMs and collectives only

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, group, ignore_index, reduction, token_chunk):
        local_vocab = weight.shape[0]
        lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        target_logit = torch.zeros_like(lse)
        for start in range(0, hidden.shape[0], token_chunk):
            rows = slice(start, start + token_chunk)
            z = _chunk_logits(hidden[rows], weight)
            row_max = z.amax(dim=1)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            local, here = _local_targets(targets[rows], vocab_start, local_vocab)
            sums = torch.stack(
                [torch.exp(z - row_max[:, None]).sum(dim=1), torch.where(here, z.gather(1, local[:, None])[:, 0], 0.0)]
            )
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            lse[rows] = row_max + torch.log(sums[0])
            target_logit[rows] = sums[1]
        valid = targets != ignore_index
        total = torch.where(valid, lse - target_logit, 0.0).sum()
        scale = 1.0 / valid.sum().clamp(min=1).float() if reduction == "mean" else torch.ones((), device=lse.device)
        ctx.save_for_backward(hidden, weight, targets, lse, scale)
        ctx.vocab_start, ctx.group, ctx.ignore_index, ctx.token_chunk = vocab_start, group, ignore_index, token_chunk
        return total * scale

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse, scale = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        row_scale = torch.where(targets != ctx.ignore_index, scale * grad_loss, 0.0)  # [T] fp32
        for start in range(0, hidden.shape[0], ctx.token_chunk):
            rows = slice(start, start + ctx.token_chunk)
            z = _chunk_logits(hidden[rows], weight)
            grad_z = torch.exp(z - lse[rows, None])
            local, here = _local_targets(targets[rows], ctx.vocab_start, weight.shape[0])
            grad_z.scatter_add_(1, local[:, None], -here.to(grad_z.dtype)[:, None])
            grad_z = (grad_z * row_scale[rows, None]).to(hidden.dtype)  # rounded as the logits path's dZ is
            if need_weight:
                grad_weight.addmm_(grad_z.t().float(), hidden[rows].float())
            if need_hidden:
                grad_hidden[rows] = grad_z.float() @ weight.float()
        if need_hidden:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def liger_vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group=None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    token_chunk: int | None = None,
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
    chunk = token_chunk or default_token_chunk(hidden.shape[0], weight.shape[0])
    return LigerVocabParallelLinearCrossEntropyFunction.apply(
        hidden, weight, targets, int(vocab_start), group, int(ignore_index), reduction, int(chunk)
    )
