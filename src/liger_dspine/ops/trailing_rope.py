"""RoPE of the trailing slice of each head, with pairs turned in place, optionally after a weightless RMSNorm.

DeepSeek-V4 normalises each query head without a weight (``x * rsqrt(mean(x^2) + eps)``, the factor rounded to the
input's dtype first) and then turns the pairs (2i, 2i+1) of its last R channels by the angle of frequency i; its
attention output gets the inverse turn (``-sin``). transformers runs that as a dozen torch passes over the
[B, S, N, D] heads (an fp32 copy, the square, the mean, the products, a stacked rotation, a concatenation). Here one
Triton pass reads each head vector once and writes it once, forward and backward:

    y = x * r,  r = rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype       (when normalising)
    out[..., :D-R] = y[..., :D-R]
    out[2i] = y[2i] cos_i - y[2i+1] sin_i,  out[2i+1] = y[2i+1] cos_i + y[2i] sin_i   (on the last R channels, fp32)

Backward: the rotation transposed, then dx = r g - x r^3 (g . x) / D (fp32 inside, the result in x's dtype).
``cos`` / ``sin`` are the half-sized [B or 1, S, R/2] tables of V4's rotary embedding (one angle per pair).
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.precompile import precompile

ROWS = 4  # head vectors per program


@triton.jit
def _row_coordinates(num_rows, seq_len, num_heads, ROWS: tl.constexpr):
    """This program's head vectors (rows of [B * S * N]): the rows, their mask, and their batch, position and head."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows * D passes 2^31 at V4's widths
    return rows, rows < num_rows, rows // (num_heads * seq_len), (rows // num_heads) % seq_len, rows % num_heads


@triton.jit
def _pair_angles(cos_ptr, sin_ptr, batch, position, stride_cb, stride_cs, cols, rope_start, rows_ok):
    """cos / sin of each channel's pair ([ROWS, D], 1 / 0 outside the rope slice)."""
    in_rope = cols >= rope_start
    pair = tl.where(in_rope, (cols - rope_start) // 2, 0)
    offsets = batch[:, None] * stride_cb + position[:, None] * stride_cs + pair[None, :]
    active = rows_ok[:, None] & in_rope[None, :]
    cos = tl.load(cos_ptr + offsets, mask=active, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + offsets, mask=active, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _partner(values, cols, HEAD_DIM: tl.constexpr):
    """Each channel's pair partner: values[..., c ^ 1] (pairs (2i, 2i+1); the rope slice starts at an even channel)."""
    pairs = tl.reshape(values, (values.shape[0], HEAD_DIM // 2, 2))
    first, second = tl.split(pairs)
    return tl.reshape(tl.join(second, first), (values.shape[0], HEAD_DIM))


@triton.jit
def _trailing_rope_forward_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr,
    num_rows, seq_len, num_heads, rope_start, eps,
    stride_xb, stride_xs, stride_xn, stride_cb, stride_cs,
    NORM: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """x [B, S, N, D] (any strides, channels contiguous) -> out [B, S, N, D] contiguous; rstd [B*S*N] fp32."""
    rows, rows_ok, batch, position, head = _row_coordinates(num_rows, seq_len, num_heads, ROWS)
    cols = tl.arange(0, HEAD_DIM)
    x_offsets = batch[:, None] * stride_xb + position[:, None] * stride_xs + head[:, None] * stride_xn + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=rows_ok[:, None], other=0.0)
    y = x.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / HEAD_DIM + eps)
        rstd = rstd.to(x.dtype).to(tl.float32)  # V4 rounds the factor to the heads' dtype, then multiplies
        y = (y * rstd[:, None]).to(x.dtype).to(tl.float32)
        tl.store(rstd_ptr + rows, rstd, mask=rows_ok)
    cos, sin = _pair_angles(cos_ptr, sin_ptr, batch, position, stride_cb, stride_cs, cols, rope_start, rows_ok)
    sign = tl.where(cols % 2 == 0, -1.0, 1.0)  # out[2i] takes -y[2i+1] sin, out[2i+1] takes +y[2i] sin
    out = y * cos + sign[None, :] * _partner(y, cols, HEAD_DIM) * sin
    tl.store(
        out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None]
    )


@triton.jit
def _trailing_rope_backward_kernel(
    grad_ptr, x_ptr, rstd_ptr, cos_ptr, sin_ptr, grad_x_ptr,
    num_rows, seq_len, num_heads, rope_start,
    stride_xb, stride_xs, stride_xn, stride_cb, stride_cs,
    NORM: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """grad [B, S, N, D] contiguous -> grad_x [B, S, N, D] contiguous (x's strides for x)."""
    rows, rows_ok, batch, position, head = _row_coordinates(num_rows, seq_len, num_heads, ROWS)
    cols = tl.arange(0, HEAD_DIM)
    grad = tl.load(grad_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=rows_ok[:, None], other=0.0)
    grad = grad.to(tl.float32)
    cos, sin = _pair_angles(cos_ptr, sin_ptr, batch, position, stride_cb, stride_cs, cols, rope_start, rows_ok)
    # the transposed turn: gy[2i] = g[2i] cos + g[2i+1] sin, gy[2i+1] = g[2i+1] cos - g[2i] sin
    sign = tl.where(cols % 2 == 0, 1.0, -1.0)
    grad_y = grad * cos + sign[None, :] * _partner(grad, cols, HEAD_DIM) * sin
    if NORM:
        x_offsets = batch[:, None] * stride_xb + position[:, None] * stride_xs + head[:, None] * stride_xn
        x = tl.load(x_ptr + x_offsets + cols[None, :], mask=rows_ok[:, None], other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows_ok, other=0.0)
        dot = tl.sum(grad_y * x, axis=1)
        grad_y = rstd[:, None] * grad_y - x * (rstd * rstd * rstd * dot / HEAD_DIM)[:, None]
    tl.store(
        grad_x_ptr + rows[:, None] * HEAD_DIM + cols[None, :],
        grad_y.to(grad_x_ptr.dtype.element_ty),
        mask=rows_ok[:, None],
    )


def _angle_strides(cos: torch.Tensor) -> tuple[int, int]:
    return (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


@liger_custom_op("liger_dspine::trailing_rope", mutates_args=())
def _trailing_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, N, D] contiguous, rstd [B*S*N] fp32, empty without ``norm``)."""
    batch, seq_len, num_heads, head_dim = x.shape
    rope_dim = 2 * cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = batch * seq_len * num_heads
    rstd = torch.empty(rows if norm else 0, dtype=torch.float32, device=x.device)
    if rows:
        _trailing_rope_forward_kernel[(triton.cdiv(rows, ROWS),)](
            x, cos, sin, out, rstd, rows, seq_len, num_heads, head_dim - rope_dim, eps,
            x.stride(0), x.stride(1), x.stride(2), *_angle_strides(cos),
            NORM=norm, HEAD_DIM=head_dim, ROWS=ROWS,
        )  # fmt: skip
    return out, rstd


@_trailing_rope.register_fake
def _(x, cos, sin, eps, norm):
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty(rows if norm else 0, dtype=torch.float32)


@liger_custom_op("liger_dspine::trailing_rope_backward", mutates_args=())
def _trailing_rope_backward(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: bool
) -> torch.Tensor:
    batch, seq_len, num_heads, head_dim = x.shape
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = batch * seq_len * num_heads
    if rows:
        _trailing_rope_backward_kernel[(triton.cdiv(rows, ROWS),)](
            grad, x, rstd, cos, sin, grad_x, rows, seq_len, num_heads, head_dim - 2 * cos.shape[-1],
            x.stride(0), x.stride(1), x.stride(2), *_angle_strides(cos),
            NORM=norm, HEAD_DIM=head_dim, ROWS=ROWS,
        )  # fmt: skip
    return grad_x


@_trailing_rope_backward.register_fake
def _(grad, x, rstd, cos, sin, norm):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class LigerTrailingRopeFunction(torch.autograd.Function):
    """``(x [B, S, N, D], cos, sin [B or 1, S, R/2], eps, norm)`` -> [B, S, N, D] contiguous."""

    kernel_ops = ("liger_dspine::trailing_rope", "liger_dspine::trailing_rope_backward")

    @staticmethod
    def forward(ctx, x, cos, sin, eps, norm):
        out, rstd = _trailing_rope(x, cos, sin, eps, norm)
        if x.is_cuda and ctx.needs_input_grad[0] and not torch.compiler.is_compiling():
            # the backward's kernel, compiled while the forward goes on (ops/precompile.py); without the norm it
            # gets the contiguous gradient in x's place
            batch, seq_len, num_heads, head_dim = x.shape
            strides = x.stride()[:3] if norm else out.stride()[:3]
            precompile(
                _trailing_rope_backward_kernel, out, x, rstd, cos, sin, x, batch * seq_len * num_heads, seq_len,
                num_heads, head_dim - 2 * cos.shape[-1], *strides, *_angle_strides(cos),
                NORM=norm, HEAD_DIM=head_dim, ROWS=ROWS,
            )  # fmt: skip
        ctx.save_for_backward(x if norm else x.new_empty(0), rstd, cos, sin)
        ctx.norm = norm
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        x, rstd, cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        # without the norm the kernel never reads x: the gradient stands in for it (same shape)
        grad_x = _trailing_rope_backward(grad, x if ctx.norm else grad, rstd, cos, sin, ctx.norm)
        return grad_x, None, None, None, None


def liger_trailing_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None = None
) -> torch.Tensor:
    """RoPE (pairs in place) on the last 2 * cos.shape[-1] channels of each head of x [B, S, N, D], after a
    weightless RMSNorm of each head when ``eps`` is given; cos / sin [B or 1, S, R/2]. Returns [B, S, N, D]
    contiguous in x's dtype. D must be a power of two."""
    check_kernel_device(x, "the trailing RoPE")
    if x.dim() != 4 or x.stride(3) != 1:
        raise ValueError(
            f"liger-dspine: trailing RoPE expects x [B, S, N, D] with contiguous heads, got {tuple(x.shape)}"
        )
    batch, seq_len, _, head_dim = x.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"liger-dspine: trailing RoPE needs a head dim that is a power of two, got {head_dim}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(
            f"liger-dspine: trailing RoPE expects cos / sin [B or 1, {seq_len}, R/2], got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}"
        )
    if 2 * cos.shape[-1] > head_dim:
        raise ValueError(f"liger-dspine: trailing RoPE of {2 * cos.shape[-1]} channels exceeds the head dim {head_dim}")
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    norm = eps is not None
    return LigerTrailingRopeFunction.apply(x, cos, sin, float(eps) if norm else 0.0, norm)
