"""Linear cross entropy chunked over the vocabulary: no [T, V] logits and no [V, H] gradient accumulator.

    loss = reduce_t  ce_t,   ce_t = logsumexp_v(z_t) - z_t[y_t],   z = hidden @ weight^T
    (mean: over the rows whose target is not ``ignore_index``; sum: their sum)

Why the vocabulary and not the tokens: liger-kernel's fused linear cross entropy chunks the tokens, so every chunk
adds its share of d weight into a [V, H] accumulator (one read-modify-write of the whole accumulator per chunk)
that lives from the forward to the backward. Chunking the vocabulary gives each chunk its own rows of d weight:
chunk j's gradient dW_j = dZ_j^T @ hidden is ONE GEMM with K = T, accumulated in fp32 inside cuBLAS, rounded once
and written straight into rows [j*Vc, (j+1)*Vc) of the weight gradient. No accumulator, no extra pass over dW.

The price: dZ_j needs the logsumexp of the WHOLE row, known only after every chunk was seen, so the logits are
computed twice (forward, then again in the backward): 4 GEMMs of 2*T*V*H FLOPs where liger needs 3. That is
~10 ms at T=4096 (V=129280, H=7168, H200) against liger's per-chunk accumulator passes; at long context the extra
GEMM grows with T while liger's accumulator passes do not (its chunk count is ~V/H whatever T), so there the
memory is what this op buys, not time.

Forward (no gradient buffers), for each vocabulary chunk j of Vc columns:
    Z_j = hidden @ W_j^T                      cuBLAS, in the input dtype (bf16 logits for bf16 inputs)
    one Triton program per row reads Z_j once and updates fp32 per-row state in place: running max, running
    sum of exp (rescaled as the max grows), the logit of the target when it falls in the chunk, and the running
    argmax (first index on ties, as ``torch.argmax``; a later chunk wins only with a strictly larger logit).
then lse = max + log(sumexp), ce_t = lse - z_t[y_t] (0 for ignored rows).
Saved: hidden, weight, targets, lse [T] fp32 and the loss scale (0-d). Nothing of size T x V or V x H.

Backward, for each chunk j (the same GEMM recomputes Z_j into the same buffer):
    dZ_j = (exp(Z_j - lse) - onehot(y)) * scale * grad_output     one Triton program per row, in place of Z_j,
                                                                   in Z_j's dtype; ignored rows are zero
    d weight[j-th rows] = dZ_j^T @ hidden                          written into its slice, no accumulator
    d hidden += dZ_j @ W_j                                         fp32 [T, H] accumulator (skipped with 1 chunk)
dZ is rounded to the logits' dtype before both GEMMs, as liger-kernel does. Nothing is computed for an input
that does not require grad (a frozen head skips all dW GEMMs).

Chunk size: Vc is the largest power of two such that a chunk of logits, counted as fp32, fits
``DEFAULT_CHUNK_BYTES`` (512 MiB), at least 1024 and at most V (DeepSeek-V3, V=129280: Vc = 32768 at T=4096,
4096 at T=32768). Transient memory: one [T, Vc] logits chunk, plus in the backward the fp32 [T, H] accumulator
of d hidden and d weight itself.

Reductions: ``mean`` divides by the number of non-ignored rows, counted on the device (no host sync). If every
row is ignored the loss is 0 (not NaN), the token accuracy 0 and every gradient zero. Token accuracy is the mean
over non-ignored rows of (argmax == target), without gradient. Targets other than ``ignore_index`` must lie in
[0, V) (checked on the device). Under autocast the GEMMs run in the autocast dtype, as ``F.linear`` would.
"""

import torch
import triton
import triton.language as tl
from packaging.version import Version

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.gemm_dtype import gemm_dtype

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 512 * 2**20
MIN_VOCAB_CHUNK = 1024
_MAX_BLOCK_V = 4096
_NUM_WARPS = 8
_HAS_OUT_DTYPE_MM = Version(torch.__version__.split("+")[0]) >= Version("2.8.0")


@triton.jit
def _chunk_row_stats_kernel(
    logits_ptr,  # [T, Vc] chunk of logits, contiguous
    targets_ptr,  # [T] int64
    row_max_ptr,  # [T] fp32, updated: running max
    row_sumexp_ptr,  # [T] fp32, updated: running sum of exp(z - max)
    best_ptr,  # [T] int64, updated: running first argmax (vocabulary index)
    target_logit_ptr,  # [T] fp32, written where the target falls in the chunk
    chunk_start,  # vocabulary index of the chunk's first column
    chunk_width,
    TRACK_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * chunk_width
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.load(row_max_ptr + row)
    running_sum = tl.load(row_sumexp_ptr + row)
    if TRACK_ARGMAX:
        best = tl.load(best_ptr + row)
    for start in range(0, chunk_width, BLOCK_V):
        offsets = start + cols
        z = tl.load(logits_row + offsets, mask=offsets < chunk_width, other=float("-inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        if TRACK_ARGMAX:
            block_best = chunk_start + start + tl.argmax(z, axis=0, tie_break_left=True)
            best = tl.where(block_max > running_max, block_best, best)  # strict: earlier columns win ties
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    tl.store(row_max_ptr + row, running_max)
    tl.store(row_sumexp_ptr + row, running_sum)
    if TRACK_ARGMAX:
        tl.store(best_ptr + row, best)

    local_target = tl.load(targets_ptr + row) - chunk_start
    in_chunk = (local_target >= 0) & (local_target < chunk_width)
    target_logit = tl.load(logits_row + tl.where(in_chunk, local_target, 0)).to(tl.float32)
    tl.store(target_logit_ptr + row, target_logit, mask=in_chunk)


@triton.jit
def _chunk_logits_grad_kernel(
    logits_ptr,  # [T, Vc] chunk of logits, contiguous: overwritten with d loss / d z
    targets_ptr,  # [T] int64
    lse_ptr,  # [T] fp32
    grad_scale_ptr,  # [] fp32: loss scale x grad_output
    chunk_start,
    chunk_width,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * chunk_width
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row)
    grad_scale = tl.where(target != ignore_index, tl.load(grad_scale_ptr), 0.0)
    lse = tl.load(lse_ptr + row)
    local_target = target - chunk_start
    for start in range(0, chunk_width, BLOCK_V):
        offsets = start + cols
        in_row = offsets < chunk_width
        z = tl.load(logits_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        grad = grad_scale * (tl.exp(z - lse) - tl.where(offsets == local_target, 1.0, 0.0))
        tl.store(logits_row + offsets, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def default_vocab_chunk(tokens: int, vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Largest power of two Vc with tokens x Vc x 4 bytes <= ``chunk_bytes``, then clamped to [1024, V]."""
    columns = max(1, chunk_bytes // (4 * max(tokens, 1)))
    power = 1 << (columns.bit_length() - 1)
    return min(max(power, MIN_VOCAB_CHUNK), vocab_size)


def _vocab_chunks(vocab_size: int, vocab_chunk: int):
    for start in range(0, vocab_size, vocab_chunk):
        yield start, min(start + vocab_chunk, vocab_size)


def _chunk_logits(hidden: torch.Tensor, weight_rows: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] @ weight_rows [Vc, H]^T into the front of ``storage``, as a contiguous [T, Vc] view."""
    logits = storage[: hidden.shape[0] * weight_rows.shape[0]].view(hidden.shape[0], weight_rows.shape[0])
    return torch.mm(hidden, weight_rows.t(), out=logits)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b; ``out`` may be fp32 while a, b are bf16/fp16 (then fp32 accumulation inside cuBLAS)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif _HAS_OUT_DTYPE_MM and out.is_cuda and torch.cuda.get_device_capability(out.device)[0] >= 8:
        if not accumulate:
            out.zero_()
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out += (a @ b).to(out.dtype)
    else:
        out.copy_(a @ b)


@liger_custom_op("liger_dspine::vocab_chunked_ce_stats", mutates_args=())
def _vocab_chunked_ce_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    track_argmax: bool,
    vocab_chunk: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's chunk loop: (row max [T], row sum of exp(z - max) [T], target logit [T], first argmax [T])."""
    tokens, vocab_size = hidden.shape[0], weight.shape[0]
    device = hidden.device
    row_max, row_sumexp, target_logit, best = _stats_fake(hidden, weight, targets, track_argmax, vocab_chunk, dtype)
    row_max.fill_(float("-inf"))
    row_sumexp.zero_()
    target_logit.zero_()
    best.zero_()
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab_chunk))
    with torch.autocast(device.type, enabled=False):
        compute_hidden, compute_weight = hidden.to(dtype), weight.to(dtype)
        storage = torch.empty(tokens * vocab_chunk, dtype=dtype, device=device)
        for start, end in _vocab_chunks(vocab_size, vocab_chunk):
            logits = _chunk_logits(compute_hidden, compute_weight[start:end], storage)
            if tokens:
                _chunk_row_stats_kernel[(tokens,)](
                    logits,
                    targets,
                    row_max,
                    row_sumexp,
                    best,
                    target_logit,
                    start,
                    end - start,
                    TRACK_ARGMAX=track_argmax,
                    BLOCK_V=block_v,
                    num_warps=_NUM_WARPS,
                )
    return row_max, row_sumexp, target_logit, best


@_vocab_chunked_ce_stats.register_fake
def _stats_fake(hidden, weight, targets, track_argmax, vocab_chunk, dtype):
    tokens, device = hidden.shape[0], hidden.device
    fp32 = [torch.empty(tokens, dtype=torch.float32, device=device) for _ in range(3)]
    return *fp32, torch.empty(tokens, dtype=torch.int64, device=device)


@liger_custom_op("liger_dspine::vocab_chunked_ce_backward", mutates_args=())
def _vocab_chunked_ce_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    vocab_chunk: int,
    dtype: torch.dtype,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden [T, H], grad_weight [V, H]), each an empty [0] tensor when not needed."""
    grad_hidden, grad_weight = _backward_fake(
        hidden, weight, targets, lse, grad_scale, ignore_index, vocab_chunk, dtype, need_hidden, need_weight
    )
    tokens, vocab_size = hidden.shape[0], weight.shape[0]
    single_chunk = vocab_chunk >= vocab_size
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab_chunk))
    with torch.autocast(hidden.device.type, enabled=False):
        compute_hidden, compute_weight = hidden.to(dtype), weight.to(dtype)
        if need_hidden:
            # Several chunks add into d hidden: in fp32 (reused as is when hidden is fp32).
            accumulate_in_output = single_chunk or hidden.dtype == torch.float32
            hidden_acc = grad_hidden if accumulate_in_output else torch.empty_like(grad_hidden, dtype=torch.float32)
        storage = torch.empty(tokens * vocab_chunk, dtype=dtype, device=hidden.device)
        for start, end in _vocab_chunks(vocab_size, vocab_chunk):
            grad_logits = _chunk_logits(compute_hidden, compute_weight[start:end], storage)
            if tokens:
                _chunk_logits_grad_kernel[(tokens,)](
                    grad_logits,
                    targets,
                    lse,
                    grad_scale,
                    start,
                    end - start,
                    ignore_index,
                    BLOCK_V=block_v,
                    num_warps=_NUM_WARPS,
                )
            if need_weight:
                _mm_into(grad_weight[start:end], grad_logits.t(), compute_hidden, accumulate=False)
            if need_hidden:
                _mm_into(hidden_acc, grad_logits, compute_weight[start:end], accumulate=start > 0)
        del storage
        if need_hidden and hidden_acc is not grad_hidden:
            grad_hidden.copy_(hidden_acc)
    return grad_hidden, grad_weight


@_vocab_chunked_ce_backward.register_fake
def _backward_fake(hidden, weight, *args):
    need_hidden, need_weight = args[-2:]

    def grad_of(x, need):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else x.new_empty(0)

    return grad_of(hidden, need_hidden), grad_of(weight, need_weight)


class LigerVocabChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [T, H], weight [V, H], targets [T], ignore_index, reduction, track_argmax, vocab_chunk)`` ->
    ``(loss [] fp32, token_accuracy [] fp32)``; token_accuracy has no gradient (0 when not tracked)."""

    kernel_ops = ("liger_dspine::vocab_chunked_ce_stats", "liger_dspine::vocab_chunked_ce_backward")

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, track_argmax, vocab_chunk):
        dtype = gemm_dtype(hidden, weight, "linear cross entropy")
        row_max, row_sumexp, target_logit, best = _vocab_chunked_ce_stats(
            hidden, weight, targets, track_argmax, vocab_chunk, dtype
        )
        valid = targets != ignore_index
        valid_count = valid.sum().clamp_min(1).to(torch.float32)
        lse = row_max + torch.log(row_sumexp)
        loss = torch.where(valid, lse - target_logit, 0.0).sum()
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
        if reduction == "mean":
            scale = scale / valid_count
        loss = loss * scale
        token_accuracy = ((best == targets) & valid).sum() / valid_count if track_argmax else loss.new_zeros(())

        ctx.mark_non_differentiable(token_accuracy)
        ctx.compute_dtype = dtype
        ctx.ignore_index = ignore_index
        ctx.vocab_chunk = vocab_chunk
        ctx.save_for_backward(hidden, weight, targets, lse, scale)
        return loss, token_accuracy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_accuracy):
        hidden, weight, targets, lse, scale = ctx.saved_tensors
        hidden_needs_grad, weight_needs_grad = ctx.needs_input_grad[:2]
        if not (hidden_needs_grad or weight_needs_grad):
            return None, None, None, None, None, None, None
        grad_scale = (scale * grad_loss.float()).contiguous()
        grad_hidden, grad_weight = _vocab_chunked_ce_backward(
            hidden, weight, targets, lse, grad_scale, ctx.ignore_index, ctx.vocab_chunk, ctx.compute_dtype,
            hidden_needs_grad, weight_needs_grad,
        )  # fmt: skip
        grad_hidden = grad_hidden if hidden_needs_grad else None
        grad_weight = grad_weight if weight_needs_grad else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _check_inputs(hidden, weight, targets, reduction, vocab_chunk):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"liger-dspine: linear cross entropy expects hidden [T, H] and weight [V, H], "
            f"got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"liger-dspine: linear cross entropy expects targets [{hidden.shape[0]}], got {tuple(targets.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"liger-dspine: reduction must be 'mean' or 'sum', got {reduction!r}")
    if vocab_chunk is not None and vocab_chunk < 1:
        raise ValueError(f"liger-dspine: vocab_chunk must be >= 1, got {vocab_chunk}")


def liger_vocab_chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    return_token_accuracy: bool = True,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross entropy of ``hidden @ weight^T`` against ``targets``, chunked over the vocabulary.

    Args:
        hidden: [T, H] rows (any float dtype; the same as ``weight`` outside autocast); may not require grad.
        weight: [V, H] the output projection (no bias); may not require grad (then no dW work at all).
        targets: [T] integer targets in [0, V), or ``ignore_index`` for rows without loss.
        ignore_index: target value of ignored rows.
        reduction: "mean" (over non-ignored rows; 0 if there are none) or "sum".
        return_token_accuracy: also return the fraction of non-ignored rows whose argmax is the target.
        vocab_chunk: columns per chunk; None picks :func:`default_vocab_chunk`. Results do not depend on it
            beyond fp32 rounding.

    Returns:
        (loss [] fp32, token_accuracy [] fp32 without gradient, or None).
    """
    _check_inputs(hidden, weight, targets, reduction, vocab_chunk)
    check_kernel_device(hidden, "vocab-chunked linear cross entropy")
    tokens, vocab_size = hidden.shape[0], weight.shape[0]
    vocab_chunk = min(vocab_chunk, vocab_size) if vocab_chunk else default_vocab_chunk(tokens, vocab_size)
    targets = targets.to(device=hidden.device, dtype=torch.int64).contiguous()
    torch._assert_async(((targets == ignore_index) | ((targets >= 0) & (targets < vocab_size))).all())
    loss, token_accuracy = LigerVocabChunkedLinearCrossEntropyFunction.apply(
        hidden, weight, targets, int(ignore_index), reduction, bool(return_token_accuracy), int(vocab_chunk)
    )
    return loss, token_accuracy if return_token_accuracy else None
