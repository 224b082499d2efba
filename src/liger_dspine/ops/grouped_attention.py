"""Grouped-query attention with an additive mask that keeps only the key-value heads for the backward.

``F.scaled_dot_product_attention`` has no grouped-query form for a masked call on CUDA (its ``enable_gqa`` runs the
math kernel there), so callers repeat the key and value heads to the query heads first, and the memory-efficient
kernel's backward keeps those repeated copies: ``groups`` times the key and value, two [B, N, K, D] tensors per
layer. This op runs the same kernel (``aten._scaled_dot_product_efficient_attention`` and its backward, the ones
sdpa picks for a masked bf16 / fp16 call) but keeps the [B, N / groups, K, D] key and value and repeats them again
in the backward, where the repeated copies live for that layer's backward only; the key and value gradients are
summed over each group. Forward and gradients are what that kernel gives for the repeated tensors.

Where sdpa would not pick that kernel (CPU, fp32, dropout, or a faster kernel such as cuDNN's attention) callers use
sdpa as before.
"""

import torch
from torch.nn.attention import SDPBackend

from liger_dspine.ops.first_order import first_order_only


def _repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, N / groups, K, D] -> [B, N, K, D], head h reading key-value head h // groups."""
    return states.repeat_interleave(groups, dim=1)


class LigerGroupedAttentionFunction(torch.autograd.Function):
    """``(q [B, N, Q, D], k [B, N/g, K, D], v [B, N/g, K, D], bias [B, 1, Q, K], scale, groups) -> [B, N, Q, D]``."""

    kernel_ops = ()  # torch's own attention ops, which have fake implementations

    @staticmethod
    def forward(ctx, query, key, value, bias, scale, groups):
        batch, heads, q_len, _ = query.shape
        expanded_bias = bias.expand(batch, heads, q_len, key.shape[2])
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            query,
            _repeat_heads(key, groups),
            _repeat_heads(value, groups),
            expanded_bias,
            True,
            0.0,
            False,
            scale=scale,
        )
        ctx.save_for_backward(query, key, value, bias, out, lse, seed, offset)
        ctx.scale, ctx.groups = scale, groups
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        query, key, value, bias, out, lse, seed, offset = ctx.saved_tensors
        groups = ctx.groups
        batch, heads, q_len, _ = query.shape
        grad_query, grad_key, grad_value, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(),
            query,
            _repeat_heads(key, groups),
            _repeat_heads(value, groups),
            bias.expand(batch, heads, q_len, key.shape[2]),
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
            scale=ctx.scale,
        )
        kv_heads = key.shape[1]
        grad_key = grad_key.view(batch, kv_heads, groups, *grad_key.shape[2:]).sum(2)
        grad_value = grad_value.view(batch, kv_heads, groups, *grad_value.shape[2:]).sum(2)
        return grad_query, grad_key, grad_value, None, None, None


def grouped_attention_runs(query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`liger_grouped_attention` applies: CUDA, half precision, no dropout, key heads grouped, head
    width a multiple of 8 up to 128, a key length the kernel's bias alignment (16) takes as it is, and sdpa itself
    would pick the memory-efficient kernel for the repeated heads (elsewhere, cuDNN's attention for one, this op
    would trade sdpa's kernel for a slower one)."""
    head_dim = query.shape[-1]
    if not (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and query.shape[1] > key.shape[1]
        and head_dim % 8 == 0
        and head_dim <= 128
        and key.shape[2] % 16 == 0
    ):
        return False
    repeated = key[:, :1].expand(key.shape[0], query.shape[1], *key.shape[2:])  # sizes only: no copy
    choice = torch._fused_sdp_choice(query, repeated, repeated, bias, dropout, False, scale=None)
    return choice == int(SDPBackend.EFFICIENT_ATTENTION)


def liger_grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked grouped-query attention: q [B, N, Q, D], k / v [B, N/g, K, D], additive bias [B, 1, Q, K] in the
    query's dtype (0 / -inf; no row may be all -inf) -> [B, N, Q, D], keeping only k and v for the backward."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads or value.shape[1] != kv_heads:
        raise ValueError(
            f"liger-dspine: grouped attention needs key / value heads dividing the query heads, got {heads} query, "
            f"{kv_heads} key and {value.shape[1]} value heads"
        )
    if bias.dtype != query.dtype or bias.dim() != 4 or bias.shape[1] != 1:
        raise ValueError(
            f"liger-dspine: grouped attention needs a [B, 1, Q, K] bias in {query.dtype}, got {bias.dtype} "
            f"{tuple(bias.shape)}"
        )
    return LigerGroupedAttentionFunction.apply(query, key, value, bias, float(scale), heads // kv_heads)
