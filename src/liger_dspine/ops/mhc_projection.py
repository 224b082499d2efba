"""The projection of manifold-constrained hyper-connections (mHC): ``mix = rms(x) @ fn^T`` for the flattened
streams ``x [N, K]`` (K = streams x hidden) and ``fn [M, K]``, with the RMS factor ``invr [N]`` kept for backward.

    invr = rsqrt(mean_k x^2 + eps)                 mix = invr * (x @ fn^T)                   [N, M] fp32
    d x  = (d mix * invr) @ fn - (sum_m d mix * mix) * invr^2 * x / K
    d fn = (d mix * invr)^T @ x

liger-kernel's mHC projection does the same with the token count, the width and the strides as compile-time
constants and its K loop unrolled: at DeepSeek-V4's K = 4 x 4096 its forward takes about 70 s to compile (Triton 3.9,
sm_90), again for each new token count. Here the sizes are run-time values and the K loop is a loop: one compilation
per dtype. Products are fp32 (``ieee``) as transformers' fp32 ``F.linear``: the GEMMs are [N, K] x [K, M <= 32], a few
GFLOP, where TF32 or bf16 products would cost accuracy for no time that shows. Neither direction keeps an fp32 copy
of the streams (transformers' projection saves one, [N, K] fp32, per mix).
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.precompile import precompile

BLOCK_ROWS = 32
BLOCK_K = 128
ROWS_PER_PROGRAM = 512  # rows a backward program walks, summing its share of d fn before one atomic add


@triton.jit
def _mhc_projection_forward_kernel(
    x_ptr, fn_ptr, mix_ptr, invr_ptr, num_rows, width, num_out, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outs = tl.arange(0, BLOCK_M)
    row_ok, out_ok = rows < num_rows, outs < num_out
    acc = tl.zeros((BLOCK_ROWS, BLOCK_M), tl.float32)
    sum_sq = tl.zeros((BLOCK_ROWS,), tl.float32)
    for k0 in range(0, width, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < width
        x = tl.load(x_ptr + rows[:, None] * width + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        fn = tl.load(fn_ptr + outs[:, None] * width + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
        sum_sq += tl.sum(x * x, axis=1)
        acc += tl.dot(x, tl.trans(fn.to(tl.float32)), input_precision="ieee")
    invr = tl.rsqrt(sum_sq / width + eps)
    tl.store(mix_ptr + rows[:, None] * num_out + outs[None, :], acc * invr[:, None], mask=row_ok[:, None] & out_ok)
    tl.store(invr_ptr + rows, invr, mask=row_ok)


@triton.jit
def _mhc_projection_backward_kernel(
    x_ptr, fn_ptr, mix_ptr, invr_ptr, grad_mix_ptr, grad_x_ptr, grad_fn_ptr, num_rows, width, num_out,
    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """One [ROWS_PER_PROGRAM, BLOCK_K] slab of d x, and its rows' share of d fn [M, BLOCK_K] added atomically."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    outs = tl.arange(0, BLOCK_M)
    col_ok, out_ok = cols < width, outs < num_out
    fn = tl.load(fn_ptr + outs[:, None] * width + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
    fn = fn.to(tl.float32)
    grad_fn = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    first = tl.program_id(1).to(tl.int64) * ROWS_PER_PROGRAM
    for r0 in range(0, ROWS_PER_PROGRAM, BLOCK_ROWS):
        rows = first + r0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        tile_ok = row_ok[:, None] & out_ok[None, :]
        grad_mix = tl.load(grad_mix_ptr + rows[:, None] * num_out + outs[None, :], mask=tile_ok, other=0.0)
        mix = tl.load(mix_ptr + rows[:, None] * num_out + outs[None, :], mask=tile_ok, other=0.0)
        invr = tl.load(invr_ptr + rows, mask=row_ok, other=0.0)
        grad_z = grad_mix * invr[:, None]
        norm_term = tl.sum(grad_mix * mix, axis=1) * invr * invr / width
        x_ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * width + cols[None, :], mask=x_ok, other=0.0)
        x_f = x.to(tl.float32)
        grad_x = tl.dot(grad_z, fn, input_precision="ieee") - norm_term[:, None] * x_f
        tl.store(grad_x_ptr + rows[:, None] * width + cols[None, :], grad_x.to(x.dtype), mask=x_ok)
        grad_fn += tl.dot(tl.trans(grad_z), x_f, input_precision="ieee")
    tl.atomic_add(grad_fn_ptr + outs[:, None] * width + cols[None, :], grad_fn, mask=out_ok[:, None] & col_ok[None, :])


def _block_m(num_out: int) -> int:
    """At least 32: V4's layers (M = 24) and its final collapse (M = 4) then share one compilation per direction."""
    return max(32, triton.next_power_of_2(num_out))


@liger_custom_op("liger_dspine::mhc_projection", mutates_args=())
def _mhc_projection(x: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mix [N, M] fp32, invr [N] fp32) of contiguous x [N, K] and fn [M, K]."""
    num_rows, width = x.shape
    num_out = fn.shape[0]
    mix = torch.empty(num_rows, num_out, dtype=torch.float32, device=x.device)
    invr = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        _mhc_projection_forward_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
            x, fn, mix, invr, num_rows, width, num_out, eps,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K, BLOCK_M=_block_m(num_out),
        )  # fmt: skip
    return mix, invr


@_mhc_projection.register_fake
def _(x, fn, eps):
    return x.new_empty(x.shape[0], fn.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32)


@liger_custom_op("liger_dspine::mhc_projection_backward", mutates_args=())
def _mhc_projection_backward(
    x: torch.Tensor, fn: torch.Tensor, mix: torch.Tensor, invr: torch.Tensor, grad_mix: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x like x, d fn [M, K] fp32); every input contiguous."""
    num_rows, width = x.shape
    num_out = fn.shape[0]
    grad_x = torch.empty_like(x)
    grad_fn = torch.zeros(fn.shape, dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(width, BLOCK_K), triton.cdiv(num_rows, ROWS_PER_PROGRAM))
        _mhc_projection_backward_kernel[grid](
            x, fn, mix, invr, grad_mix, grad_x, grad_fn, num_rows, width, num_out,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K, BLOCK_M=_block_m(num_out), ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
        )  # fmt: skip
    return grad_x, grad_fn


@_mhc_projection_backward.register_fake
def _(x, fn, mix, invr, grad_mix):
    return torch.empty_like(x), fn.new_empty(fn.shape, dtype=torch.float32)


class LigerMHCProjectionFunction(torch.autograd.Function):
    """``(x [N, K], fn [M, K], eps)`` -> ``(mix [N, M] fp32, invr [N] fp32)``; invr carries no gradient."""

    kernel_ops = ("liger_dspine::mhc_projection", "liger_dspine::mhc_projection_backward")

    @staticmethod
    def forward(ctx, x, fn, eps):
        mix, invr = _mhc_projection(x, fn, eps)
        if x.is_cuda and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():
            (num_rows, width), num_out = x.shape, fn.shape[0]
            precompile(
                _mhc_projection_backward_kernel, x, fn, mix, invr, mix, x, mix, num_rows, width, num_out,
                BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K, BLOCK_M=_block_m(num_out), ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
            )  # fmt: skip
        ctx.save_for_backward(x, fn, mix, invr)
        ctx.mark_non_differentiable(invr)
        return mix, invr

    @staticmethod
    @first_order_only
    def backward(ctx, grad_mix, _grad_invr):
        x, fn, mix, invr = ctx.saved_tensors
        grad_x, grad_fn = _mhc_projection_backward(x, fn, mix, invr, grad_mix.float().contiguous())
        return grad_x, grad_fn.to(fn.dtype), None


def liger_mhc_projection(x: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rsqrt(mean(x^2) + eps) * x @ fn^T, rsqrt(mean(x^2) + eps))`` in fp32 for x [N, K] and fn [M, K] (M <= 128;
    any float dtypes); see the module's docstring."""
    check_kernel_device(x, "the mHC projection")
    if x.dim() != 2 or fn.dim() != 2 or x.shape[1] != fn.shape[1]:
        raise ValueError(
            f"liger-dspine: the mHC projection expects x [N, K] and fn [M, K], got {tuple(x.shape)} and "
            f"{tuple(fn.shape)}"
        )
    if fn.shape[0] > 128:
        raise ValueError(f"liger-dspine: the mHC projection takes at most 128 outputs, got {fn.shape[0]}")
    return LigerMHCProjectionFunction.apply(x.contiguous(), fn.contiguous(), float(eps))
