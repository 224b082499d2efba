"""The lightning indexer's scores of DeepSeek Sparse Attention (DeepSeek-V3.2, V4's CSA), fused:

    scores[b, s, t] = scale * sum_h weights[b, s, h] * relu(q[b, s, h, :] . k[b, t, :])          [B, S, T] fp32

transformers computes ``q . k`` for every head as an fp32 [B, S, H, T] tensor (64 heads: 4 GiB per layer at 4096
tokens, 64 GiB at 16384), scales it, applies the ReLU and sums over the heads, one full pass each. Here a program
holds a [BLOCK_S, BLOCK_T] tile of the result and loops over the heads: ``q . k`` on the tensor cores (bf16 products
are exact in fp32 and summed in fp32, as transformers' fp32 matmul of the same values; fp32 inputs keep fp32
products), the ReLU and the weighted sum in registers, one fp32 [B, S, T] write. Forward only: the indexer's output
is a top-k selection, which carries no gradient in transformers either.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op

BLOCK_S = 64
BLOCK_T = 64


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, out_ptr, seq_len, num_keys, num_heads, scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_wh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    keys = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, HEAD_DIM)
    row_ok, key_ok = rows < seq_len, keys < num_keys
    k = tl.load(k_ptr + batch * stride_kb + keys[:, None] * stride_kt + dims[None, :], mask=key_ok[:, None], other=0.0)
    q_base = q_ptr + batch * stride_qb + rows[:, None] * stride_qs + dims[None, :]
    w_base = w_ptr + batch * stride_wb + rows * stride_ws
    acc = tl.zeros((BLOCK_S, BLOCK_T), tl.float32)
    for head in range(0, num_heads):
        q = tl.load(q_base + head * stride_qh, mask=row_ok[:, None], other=0.0)
        if q.dtype != k.dtype:  # one side fp32 (V4's compressed keys): fp32 products
            dots = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        weight = tl.load(w_base + head * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
        acc += weight[:, None] * tl.maximum(dots, 0.0)
    out = out_ptr + (batch * seq_len + rows[:, None]) * num_keys + keys[None, :]
    tl.store(out, acc * scale, mask=row_ok[:, None] & key_ok[None, :])


@liger_custom_op("liger_dspine::indexer_scores", mutates_args=())
def _indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [B, S, T] fp32 of q [B, S, H, D] and k [B, T, D] (unit stride in D) and weights [B, S, H]."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_keys = k.shape[1]
    out = torch.empty(batch, seq_len, num_keys, dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (triton.cdiv(seq_len, BLOCK_S), triton.cdiv(num_keys, BLOCK_T), batch)
        _indexer_scores_kernel[grid](
            q, k, weights, out, seq_len, num_keys, num_heads, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), *weights.stride(),
            HEAD_DIM=head_dim, BLOCK_S=BLOCK_S, BLOCK_T=BLOCK_T,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    return out


@_indexer_scores.register_fake
def _(q, k, weights, scale):
    return q.new_empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32)


def indexer_scores_apply(tensor: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel runs for this device (CUDA, or a CPU through the interpreter) and head dim."""
    return kernel_runs_on(tensor, _indexer_scores_kernel) and head_dim >= 16 and not head_dim & (head_dim - 1)


def liger_indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * sum_h weights[..., h] * relu(q[:, :, h] . k)`` as [B, S, T] fp32 for q [B, S, H, D], k [B, T, D]
    and weights [B, S, H]; D a power of two, at least 16. No gradient flows back (see the module's docstring)."""
    check_kernel_device(q, "the indexer scores")
    if q.dim() != 4 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[3]:
        raise ValueError(
            f"liger-dspine: the indexer scores expect q [B, S, H, D] and k [B, T, D], got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    if tuple(weights.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"liger-dspine: the indexer scores expect weights {tuple(q.shape[:3])}, got {tuple(weights.shape)}"
        )
    head_dim = q.shape[3]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"liger-dspine: the indexer scores need a head dim that is a power of two >= 16, got {head_dim}"
        )
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q.detach(), k.detach()))
    return _indexer_scores(q, k, weights.detach(), float(scale))
