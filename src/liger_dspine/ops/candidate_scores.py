"""Scores of gathered head rows: s[n, k] = W[ids[n, k]] . h[n] in fp32, without keeping the gathered rows.

The DSpine refinement loss scores each proposal's K candidates against its refined state. Written as
``W[ids].float() @ h`` it materialises [N, K, H] fp32 (about 880 MB for 1920 rows, K = 16, H = 7168) and autograd
keeps it for the backward. Here Triton programs read the K head rows in [K, BLOCK_H] tiles and reduce in fp32: the
forward (one program per row) gives s[n, :], the backward (one per row and span of columns)
dh[n, :] = sum_k ds[n, k] W[ids[n, k], :]. The backward needs only W (frozen: it gets no gradient) and the ids, so
nothing of size K x H is kept. dh is returned in h's dtype. Both read K x H head elements per row and little else,
so their time is that read: the launch settings (``LAUNCH``) are the fastest of
``benchmark/bench_candidate_scores.py`` on an H200.
Without a Triton device (CPU without the interpreter, or fp64) the same sums run in torch, a block of rows at a time.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_TORCH_BLOCK_BYTES = 128 * 2**20
# forward: (BLOCK_H, num_warps); backward: (BLOCK_H, BLOCK_H tiles per program (0: the whole row), num_warps)
LAUNCH = {"forward": (128, 4), "backward": (1024, 0, 8)}


@triton.jit
def _candidate_scores_kernel(
    hidden_ptr,  # [N, H]
    weight_ptr,  # [V, H]
    ids_ptr,  # [N, K] int64
    scores_ptr,  # [N, K] fp32 out
    hidden_size,
    top_k,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_PAD)
    in_k = ks < top_k
    ids = tl.load(ids_ptr + row * top_k + ks, mask=in_k, other=0)
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        offsets = start + cols
        in_h = offsets < hidden_size
        h = tl.load(hidden_ptr + row * hidden_size + offsets, mask=in_h, other=0.0).to(tl.float32)
        w = tl.load(
            weight_ptr + ids[:, None] * hidden_size + offsets[None, :], mask=in_k[:, None] & in_h[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    tl.store(scores_ptr + row * top_k + ks, acc, mask=in_k)


@triton.jit
def _candidate_scores_backward_kernel(
    grad_scores_ptr,  # [N, K] fp32
    weight_ptr,  # [V, H]
    ids_ptr,  # [N, K] int64
    grad_hidden_ptr,  # [N, H] out, in the rows' dtype
    hidden_size,
    top_k,
    span,  # columns per program, a multiple of BLOCK_H
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per (row, ``span`` columns), in [K, BLOCK_H] tiles."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * span
    ks = tl.arange(0, K_PAD)
    cols = tl.arange(0, BLOCK_H)
    in_k = ks < top_k
    ids = tl.load(ids_ptr + row * top_k + ks, mask=in_k, other=0)
    g = tl.load(grad_scores_ptr + row * top_k + ks, mask=in_k, other=0.0)
    for start in range(first, first + span, BLOCK_H):
        offsets = start + cols
        in_h = offsets < hidden_size
        w = tl.load(
            weight_ptr + ids[:, None] * hidden_size + offsets[None, :], mask=in_k[:, None] & in_h[None, :], other=0.0
        ).to(tl.float32)
        dh = tl.sum(w * g[:, None], axis=0)
        tl.store(grad_hidden_ptr + row * hidden_size + offsets, dh.to(grad_hidden_ptr.dtype.element_ty), mask=in_h)


def launch_forward(hidden, weight, ids, scores, block_h: int, num_warps: int) -> None:
    """The forward kernel over every row (contiguous operands; ``scores`` [N, K] fp32 is written)."""
    rows, top_k = ids.shape
    _candidate_scores_kernel[(rows,)](
        hidden, weight, ids, scores, weight.shape[1], top_k,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_H=block_h, num_warps=num_warps,
    )  # fmt: skip


def launch_backward(grad_scores, weight, ids, grad_hidden, block_h: int, tiles: int, num_warps: int) -> None:
    """The backward kernel, each program ``tiles`` [K, block_h] tiles of one row, 0 for all of them
    (``grad_hidden`` is written)."""
    rows, top_k = ids.shape
    span = block_h * (tiles or triton.cdiv(weight.shape[1], block_h))
    _candidate_scores_backward_kernel[(rows, triton.cdiv(weight.shape[1], span))](
        grad_scores, weight, ids, grad_hidden, weight.shape[1], top_k, span,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_H=block_h, num_warps=num_warps,
    )  # fmt: skip


def _use_kernel(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        hidden.dtype != torch.float64
        and weight.dtype != torch.float64
        and kernel_runs_on(hidden, _candidate_scores_kernel)
    )


def _torch_blocks(rows: int, top_k: int, hidden_size: int):
    step = max(1, _TORCH_BLOCK_BYTES // max(1, top_k * hidden_size * 4))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


@liger_custom_op("liger_dspine::candidate_scores", mutates_args=())
def _candidate_scores(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """scores [N, K] fp32 of rows [N, H], the head [V, H] and ids [N, K] (all contiguous)."""
    rows, top_k = ids.shape
    hidden_size = weight.shape[1]
    scores = torch.empty(rows, top_k, dtype=torch.float32, device=hidden.device)
    if _use_kernel(hidden, weight):
        if rows:
            launch_forward(hidden, weight, ids, scores, *LAUNCH["forward"])
        return scores
    for start, end in _torch_blocks(rows, top_k, hidden_size):
        gathered = weight[ids[start:end]].float()  # [b, K, H]
        scores[start:end] = torch.bmm(gathered, hidden[start:end].float().unsqueeze(-1)).squeeze(-1)
    return scores


@_candidate_scores.register_fake
def _(hidden, weight, ids):
    return torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)


@liger_custom_op("liger_dspine::candidate_scores_backward", mutates_args=())
def _candidate_scores_backward(
    grad_scores: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, hidden_dtype: torch.dtype, use_kernel: bool
) -> torch.Tensor:
    """dh [N, H] in ``hidden_dtype`` from grad_scores [N, K] fp32 (contiguous)."""
    rows, top_k = ids.shape
    hidden_size = weight.shape[1]
    grad_hidden = torch.empty(rows, hidden_size, dtype=hidden_dtype, device=grad_scores.device)
    if use_kernel:
        if rows:
            launch_backward(grad_scores, weight, ids, grad_hidden, *LAUNCH["backward"])
        return grad_hidden
    for start, end in _torch_blocks(rows, top_k, hidden_size):
        gathered = weight[ids[start:end]].float()
        grad_hidden[start:end] = torch.bmm(grad_scores[start:end].unsqueeze(1), gathered).squeeze(1)
    return grad_hidden


@_candidate_scores_backward.register_fake
def _(grad_scores, weight, ids, hidden_dtype, use_kernel):
    return torch.empty(ids.shape[0], weight.shape[1], dtype=hidden_dtype, device=grad_scores.device)


class LigerCandidateScoresFunction(torch.autograd.Function):
    """``(h [N, H], W [V, H], ids [N, K])`` -> scores [N, K] fp32; differentiable in h only."""

    kernel_ops = ("liger_dspine::candidate_scores", "liger_dspine::candidate_scores_backward")

    @staticmethod
    def forward(ctx, hidden, weight, ids):
        scores = _candidate_scores(hidden, weight, ids)
        ctx.save_for_backward(weight, ids)
        ctx.hidden_dtype = hidden.dtype
        ctx.use_kernel = _use_kernel(hidden, weight)  # the backward runs where the forward did
        return scores

    @staticmethod
    @first_order_only
    def backward(ctx, grad_scores):
        weight, ids = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_scores = grad_scores.float().contiguous()
        return _candidate_scores_backward(grad_scores, weight, ids, ctx.hidden_dtype, ctx.use_kernel), None, None


def liger_candidate_scores(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """s[..., k] = W[ids[..., k]] . h[...] in fp32.

    Args:
        hidden: [..., H] rows (any float dtype).
        weight: [V, H] a frozen head (must not require grad while autograd is on).
        ids: [..., K] long, in [0, V).

    Returns:
        [..., K] fp32.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"liger-dspine: candidate scores expect rows [..., H], a head [V, H] and ids [..., K], got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(ids.shape)}"
        )
    if torch.is_grad_enabled() and weight.requires_grad:
        raise ValueError("liger-dspine: candidate scores give the head no gradient; freeze it")
    lead = ids.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_ids = ids.reshape(-1, ids.shape[-1]).to(torch.int64).contiguous()
    scores = LigerCandidateScoresFunction.apply(flat_hidden, weight.contiguous(), flat_ids)
    return scores.view(*lead, ids.shape[-1])
