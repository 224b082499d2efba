"""The top-k draft candidates of a chunk of logit rows, and the teacher's probabilities there, in one kernel.

Per row of draft logits z [C, V], with the maxima of z over each ``sub`` columns [C, NS] (the stats kernel's):

1. the K sub-blocks with the largest maxima (the K largest elements of a row lie in them: each of those sub-blocks
   holds an element at least as large as the K-th largest sub-block maximum);
2. the K largest of those sub-blocks' K x ``sub`` logits, largest first: the candidate ids;
3. exp(y[id] - logsumexp(y)) at each id, from the teacher logits y [C, V] and their log-sum-exp: its probabilities.

Each selection takes the largest remaining element K times (ties: the lowest position first). Elements are ranked
by an int32 key that orders as the floats do, so that a taken element (key INT32_MIN) ranks below every float,
-inf included. Torch's sort-based top-k over the same columns costs several launches and [C, K x sub] temporaries
per chunk; this kernel reads the sub-block maxima and the K x ``sub`` logits of each row once.
"""

import torch
import triton
import triton.language as tl

_TAKEN = tl.constexpr(-(2**31))  # below the key of every float
MAX_TOP_K = 64  # larger K keep torch's top-k (the kernel holds K x sub logits per row in registers)


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 keys in the floats' order: non-negative floats keep their bits, negative ones flip the rest."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def row_candidates(
    draft_row,  # one row of draft logits [V]
    teacher_row,  # one row of teacher logits [V]
    sub_max_row,  # its sub-block maxima [NS] fp32
    teacher_lse,  # fp32 scalar: logsumexp of the teacher row
    ids_row,  # [K] int64 out
    probs_row,  # [K] fp32 out
    vocab_size,
    num_sub,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_S: tl.constexpr,  # next power of two >= NS
    SUB: tl.constexpr,
):
    """Write one row's candidates and teacher probabilities; returns its first candidate: the row's first argmax
    (no NaN in the row)."""
    ranks = tl.arange(0, BLOCK_K)

    # 1. the TOP_K sub-blocks with the largest maxima
    subs = tl.arange(0, BLOCK_S)
    sub_max = tl.load(sub_max_row + subs, mask=subs < num_sub, other=float("-inf"))
    keys = tl.where(subs < num_sub, _ordered_key(sub_max), _TAKEN)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    for rank in tl.static_range(TOP_K):
        best = tl.argmax(keys, axis=0, tie_break_left=True)
        chosen = tl.where(ranks == rank, best, chosen)
        keys = tl.where(subs == best, _TAKEN, keys)

    # 2. the TOP_K largest logits of those sub-blocks, largest first
    cols = chosen[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [BLOCK_K, SUB]
    valid = (ranks[:, None] < TOP_K) & (cols < vocab_size)
    z = tl.load(draft_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    keys = tl.reshape(tl.where(valid, _ordered_key(z), _TAKEN), (BLOCK_K * SUB,))
    positions = tl.arange(0, BLOCK_K * SUB)  # rank of the sub-block * SUB + column in it
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for rank in tl.static_range(TOP_K):
        best = tl.argmax(keys, axis=0, tie_break_left=True)
        block = tl.sum(tl.where(ranks == best // SUB, chosen, 0), axis=0)
        ids = tl.where(ranks == rank, block * SUB + best % SUB, ids)
        keys = tl.where(positions == best, _TAKEN, keys)

    # 3. the teacher's probabilities at the candidates
    out = ranks < TOP_K
    y = tl.load(teacher_row + ids, mask=out, other=0.0).to(tl.float32)
    tl.store(ids_row + ranks, ids.to(tl.int64), mask=out)
    tl.store(probs_row + ranks, tl.exp(y - teacher_lse), mask=out)
    return tl.sum(tl.where(ranks == 0, ids, 0), axis=0)


@triton.jit
def _frozen_head_candidates_kernel(
    draft_logits_ptr,  # [C, V] contiguous
    teacher_logits_ptr,  # [C, V] contiguous
    sub_max_ptr,  # [C, NS] fp32 contiguous
    teacher_lse_ptr,  # [C] fp32
    ids_ptr,  # [C, K] int64 out
    probs_ptr,  # [C, K] fp32 out
    vocab_size,
    num_sub,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SUB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_candidates(
        draft_logits_ptr + row * vocab_size,
        teacher_logits_ptr + row * vocab_size,
        sub_max_ptr + row * num_sub,
        tl.load(teacher_lse_ptr + row),
        ids_ptr + row * TOP_K,
        probs_ptr + row * TOP_K,
        vocab_size,
        num_sub,
        TOP_K,
        BLOCK_K,
        BLOCK_S,
        SUB,
    )


def kernel_takes(top_k: int, vocab_size: int, sub: int) -> bool:
    """Whether the candidates kernel serves this K: 1 <= K <= ``MAX_TOP_K`` and K x ``sub`` < V."""
    return 1 <= top_k <= MAX_TOP_K and top_k * sub < vocab_size


def top_candidates(
    z: torch.Tensor, y: torch.Tensor, sub_max: torch.Tensor, teacher_lse: torch.Tensor, top_k: int, sub: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [C, K] int64, largest logit first; the teacher's probabilities there [C, K] fp32) for 1 <= K <=
    ``MAX_TOP_K`` and K x ``sub`` < V; z, y [C, V] contiguous, sub_max [C, ceil(V / sub)] fp32."""
    rows, vocab_size = z.shape
    if not kernel_takes(top_k, vocab_size, sub):
        raise ValueError(
            f"liger-dspine: top_candidates needs 1 <= top_k <= {MAX_TOP_K} and top_k x {sub} < {vocab_size}, "
            f"got top_k {top_k}"
        )
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=z.device)
    probs = torch.empty(rows, top_k, dtype=torch.float32, device=z.device)
    if rows:
        _frozen_head_candidates_kernel[(rows,)](
            z, y, sub_max, teacher_lse, ids, probs, vocab_size, sub_max.shape[1],
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_S=triton.next_power_of_2(sub_max.shape[1]),
            SUB=sub, num_warps=4,
        )  # fmt: skip
    return ids, probs
