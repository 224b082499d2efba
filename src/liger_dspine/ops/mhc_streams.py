"""The two stream operations of manifold-constrained hyper-connections (mHC), per token, for streams x [N, hc, C]:

    collapse:  y[c]    = sum_j pre[j] x[j, c]                                  (a block's input, [N, C])
    mix:       out[k, c] = post[k] f[c] + sum_j comb[j, k] x[j, c]             (the new streams, [N, hc, C])

with fp32 coefficients (pre, post [N, hc], comb [N, hc, hc]; ``comb[j, k]`` weighs input stream j in output stream
k, as DeepSeek-V4 reads it) and fp32 sums; outputs in the streams' dtype, the coefficients' gradients in fp32. The
token count and the width are run-time values: one compilation per (hc, dtype), where liger-kernel's mHC kernels
take the token count as a constant and compile again for each new one (about 5 s a time at V4's widths). Forward
programs cover [BLOCK_T tokens, BLOCK_C channels]; backward programs walk all channels of BLOCK_T tokens, so the
coefficients' gradients are summed in registers and written once.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.precompile import precompile

BLOCK_T = 4
BLOCK_C = 256


@triton.jit
def _mhc_collapse_kernel(
    x_ptr, pre_ptr, out_ptr, num_rows, width,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    streams = tl.arange(0, HP)
    row_ok = rows < num_rows
    pre = tl.load(pre_ptr + rows[:, None] * HC + streams[None, :], mask=row_ok[:, None] & (streams < HC)[None, :])
    ok = row_ok[:, None, None] & (streams < HC)[None, :, None] & (channels < width)[None, None, :]
    x = tl.load(x_ptr + (rows[:, None, None] * HC + streams[None, :, None]) * width + channels[None, None, :], mask=ok)
    out = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
    tl.store(
        out_ptr + rows[:, None] * width + channels[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (channels < width)[None, :],
    )


@triton.jit
def _mhc_collapse_backward_kernel(
    x_ptr, pre_ptr, grad_out_ptr, grad_x_ptr, grad_pre_ptr, num_rows, width,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """d x[j, c] = pre[j] d y[c]; d pre[j] = sum_c d y[c] x[j, c]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    streams = tl.arange(0, HP)
    row_ok = rows < num_rows
    coefficient_ok = row_ok[:, None] & (streams < HC)[None, :]
    pre = tl.load(pre_ptr + rows[:, None] * HC + streams[None, :], mask=coefficient_ok)
    grad_pre = tl.zeros((BLOCK_T, HP), tl.float32)
    for start in range(0, width, BLOCK_C):
        channels = start + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None, None] & (streams < HC)[None, :, None] & (channels < width)[None, None, :]
        offsets = (rows[:, None, None] * HC + streams[None, :, None]) * width + channels[None, None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        grad_out = tl.load(
            grad_out_ptr + rows[:, None] * width + channels[None, :],
            mask=row_ok[:, None] & (channels < width)[None, :],
            other=0.0,
        ).to(tl.float32)
        grad_x = pre[:, :, None] * grad_out[:, None, :]
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=ok)
        grad_pre += tl.sum(grad_out[:, None, :] * x, axis=2)
    tl.store(grad_pre_ptr + rows[:, None] * HC + streams[None, :], grad_pre, mask=coefficient_ok)


@triton.jit
def _mhc_mix_kernel(
    x_ptr, f_ptr, post_ptr, comb_ptr, out_ptr, num_rows, width,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    streams = tl.arange(0, HP)
    row_ok = rows < num_rows
    channel_ok = (channels < width)[None, :]
    coefficient_ok = row_ok[:, None] & (streams < HC)[None, :]
    post = tl.load(post_ptr + rows[:, None] * HC + streams[None, :], mask=coefficient_ok, other=0.0)
    f = tl.load(f_ptr + rows[:, None] * width + channels[None, :], mask=row_ok[:, None] & channel_ok, other=0.0)
    out = post[:, :, None] * f.to(tl.float32)[:, None, :]
    for j in tl.static_range(HC):  # input stream j into every output stream k
        x = tl.load(
            x_ptr + (rows[:, None] * HC + j) * width + channels[None, :], mask=row_ok[:, None] & channel_ok, other=0.0
        )
        comb = tl.load(comb_ptr + (rows[:, None] * HC + j) * HC + streams[None, :], mask=coefficient_ok, other=0.0)
        out += comb[:, :, None] * x.to(tl.float32)[:, None, :]
    offsets = (rows[:, None, None] * HC + streams[None, :, None]) * width + channels[None, None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=coefficient_ok[:, :, None] & channel_ok[None])


@triton.jit
def _mhc_mix_backward_kernel(
    x_ptr, f_ptr, post_ptr, comb_ptr, grad_out_ptr, grad_x_ptr, grad_f_ptr, grad_post_ptr, grad_comb_ptr,
    num_rows, width,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """d f[c] = sum_k post[k] g[k, c]; d x[j, c] = sum_k comb[j, k] g[k, c]; d post[k] = sum_c g[k, c] f[c];
    d comb[j, k] = sum_c x[j, c] g[k, c]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    streams = tl.arange(0, HP)
    row_ok = rows < num_rows
    coefficient_ok = row_ok[:, None] & (streams < HC)[None, :]
    post = tl.load(post_ptr + rows[:, None] * HC + streams[None, :], mask=coefficient_ok, other=0.0)
    grad_post = tl.zeros((BLOCK_T, HP), tl.float32)
    grad_comb = tl.zeros((BLOCK_T, HP, HP), tl.float32)  # [t, j, k]
    for start in range(0, width, BLOCK_C):
        channels = start + tl.arange(0, BLOCK_C)
        flat_ok = row_ok[:, None] & (channels < width)[None, :]
        grad_out = tl.load(
            grad_out_ptr + (rows[:, None, None] * HC + streams[None, :, None]) * width + channels[None, None, :],
            mask=coefficient_ok[:, :, None] & (channels < width)[None, None, :],
            other=0.0,
        ).to(tl.float32)  # [t, k, c]
        f = tl.load(f_ptr + rows[:, None] * width + channels[None, :], mask=flat_ok, other=0.0).to(tl.float32)
        grad_f = tl.sum(post[:, :, None] * grad_out, axis=1)
        grad_f_at = grad_f_ptr + rows[:, None] * width + channels[None, :]
        tl.store(grad_f_at, grad_f.to(grad_f_ptr.dtype.element_ty), mask=flat_ok)
        grad_post += tl.sum(grad_out * f[:, None, :], axis=2)
        for j in tl.static_range(HC):
            x = tl.load(x_ptr + (rows[:, None] * HC + j) * width + channels[None, :], mask=flat_ok, other=0.0)
            comb = tl.load(comb_ptr + (rows[:, None] * HC + j) * HC + streams[None, :], mask=coefficient_ok, other=0.0)
            grad_x = tl.sum(comb[:, :, None] * grad_out, axis=1)
            tl.store(
                grad_x_ptr + (rows[:, None] * HC + j) * width + channels[None, :],
                grad_x.to(grad_x_ptr.dtype.element_ty),
                mask=flat_ok,
            )
            row_j = tl.sum(x.to(tl.float32)[:, None, :] * grad_out, axis=2)  # [t, k]
            grad_comb += tl.where(streams[None, :, None] == j, row_j[:, None, :], 0.0)
    tl.store(grad_post_ptr + rows[:, None] * HC + streams[None, :], grad_post, mask=coefficient_ok)
    tl.store(
        grad_comb_ptr + (rows[:, None, None] * HC + streams[None, :, None]) * HC + streams[None, None, :],
        grad_comb,
        mask=coefficient_ok[:, :, None] & (streams < HC)[None, None, :],
    )


def _meta(hc: int) -> dict:
    return dict(HC=hc, HP=triton.next_power_of_2(hc), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)


def _sizes(x: torch.Tensor) -> tuple[int, int, int]:
    """(tokens, hc, C) of streams [..., hc, C]."""
    hc, width = x.shape[-2], x.shape[-1]
    return x.numel() // max(hc * width, 1), hc, width


@liger_custom_op("liger_dspine::mhc_collapse", mutates_args=())
def _mhc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """y [..., C] (x's dtype) of contiguous x [..., hc, C] and fp32 pre [..., hc]."""
    rows, hc, width = _sizes(x)
    out = x.new_empty(*x.shape[:-2], width)
    if rows and width:
        grid = (triton.cdiv(rows, BLOCK_T), triton.cdiv(width, BLOCK_C))
        _mhc_collapse_kernel[grid](x, pre, out, rows, width, **_meta(hc))
    return out


@_mhc_collapse.register_fake
def _(x, pre):
    return x.new_empty(*x.shape[:-2], x.shape[-1])


@liger_custom_op("liger_dspine::mhc_collapse_backward", mutates_args=())
def _mhc_collapse_backward(
    x: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x like x, d pre like pre, fp32); every input contiguous."""
    rows, hc, width = _sizes(x)
    grad_x, grad_pre = torch.empty_like(x), torch.zeros_like(pre)
    if rows:
        _mhc_collapse_backward_kernel[(triton.cdiv(rows, BLOCK_T),)](
            x, pre, grad_out, grad_x, grad_pre, rows, width, **_meta(hc)
        )
    return grad_x, grad_pre


@_mhc_collapse_backward.register_fake
def _(x, pre, grad_out):
    return torch.empty_like(x), torch.empty_like(pre)


@liger_custom_op("liger_dspine::mhc_mix", mutates_args=())
def _mhc_mix(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out like x of contiguous x [..., hc, C], f [..., C], fp32 post [..., hc] and comb [..., hc, hc]."""
    rows, hc, width = _sizes(x)
    out = torch.empty_like(x)
    if rows and width:
        grid = (triton.cdiv(rows, BLOCK_T), triton.cdiv(width, BLOCK_C))
        _mhc_mix_kernel[grid](x, f, post, comb, out, rows, width, **_meta(hc))
    return out


@_mhc_mix.register_fake
def _(x, f, post, comb):
    return torch.empty_like(x)


@liger_custom_op("liger_dspine::mhc_mix_backward", mutates_args=())
def _mhc_mix_backward(
    x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d x like x, d f like f, d post like post, d comb like comb); every input contiguous."""
    rows, hc, width = _sizes(x)
    grad_x, grad_f = torch.empty_like(x), torch.empty_like(f)
    grad_post, grad_comb = torch.zeros_like(post), torch.zeros_like(comb)
    if rows:
        _mhc_mix_backward_kernel[(triton.cdiv(rows, BLOCK_T),)](
            x, f, post, comb, grad_out, grad_x, grad_f, grad_post, grad_comb, rows, width, **_meta(hc)
        )
    return grad_x, grad_f, grad_post, grad_comb


@_mhc_mix_backward.register_fake
def _(x, f, post, comb, grad_out):
    return torch.empty_like(x), torch.empty_like(f), torch.empty_like(post), torch.empty_like(comb)


def _precompiles(ctx, x: torch.Tensor) -> bool:
    """Whether to compile the backward's kernel while the forward goes on (ops/precompile.py)."""
    return x.is_cuda and any(ctx.needs_input_grad) and not torch.compiler.is_compiling()


class LigerMHCCollapseFunction(torch.autograd.Function):
    """``(x [..., hc, C], pre [..., hc] fp32)`` -> ``y [..., C]``, inputs contiguous; see the module's docstring."""

    kernel_ops = ("liger_dspine::mhc_collapse", "liger_dspine::mhc_collapse_backward")

    @staticmethod
    def forward(ctx, x, pre):
        ctx.save_for_backward(x, pre)
        out = _mhc_collapse(x, pre)
        if _precompiles(ctx, x):
            rows, hc, width = _sizes(x)
            precompile(_mhc_collapse_backward_kernel, x, pre, out, x, pre, rows, width, **_meta(hc))
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        x, pre = ctx.saved_tensors
        return _mhc_collapse_backward(x, pre, grad_out.contiguous())


class LigerMHCMixFunction(torch.autograd.Function):
    """``(x [..., hc, C], f [..., C], post [..., hc] fp32, comb [..., hc, hc] fp32)`` -> ``out`` like x, inputs
    contiguous."""

    kernel_ops = ("liger_dspine::mhc_mix", "liger_dspine::mhc_mix_backward")

    @staticmethod
    def forward(ctx, x, f, post, comb):
        ctx.save_for_backward(x, f, post, comb)
        out = _mhc_mix(x, f, post, comb)
        if _precompiles(ctx, x):
            rows, hc, width = _sizes(x)
            precompile(
                _mhc_mix_backward_kernel, x, f, post, comb, out, x, f, post, comb, rows, width, **_meta(hc)
            )  # fmt: skip
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        x, f, post, comb = ctx.saved_tensors
        return _mhc_mix_backward(x, f, post, comb, grad_out.contiguous())


def _checked_streams(streams: torch.Tensor, what: str) -> torch.Tensor:
    check_kernel_device(streams, what)
    if streams.dim() < 3:
        raise ValueError(f"liger-dspine: {what} expects streams [..., hc, C], got {tuple(streams.shape)}")
    return streams.contiguous()


def _coefficient(value: torch.Tensor, shape: tuple, name: str, what: str) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"liger-dspine: {what} expects {name} of shape {tuple(shape)}, got {tuple(value.shape)}")
    return value.float().contiguous()


def liger_mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre[..., j] streams[..., j, :]`` for ``streams [..., hc, C]`` and ``pre [..., hc]``, summed in fp32,
    in the streams' dtype."""
    x = _checked_streams(streams, "the mHC collapse")
    return LigerMHCCollapseFunction.apply(x, _coefficient(pre, x.shape[:-1], "pre", "the mHC collapse"))


def liger_mhc_mix(
    streams: torch.Tensor, block_output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``post[..., k] f + sum_j comb[..., j, k] streams[..., j, :]`` for each output stream k: streams [..., hc, C],
    the block's output f [..., C], post [..., hc], comb [..., hc, hc]; summed in fp32, in the streams' dtype."""
    what = "the mHC mix"
    x = _checked_streams(streams, what)
    expected = (*x.shape[:-2], x.shape[-1])
    if tuple(block_output.shape) != expected:
        raise ValueError(
            f"liger-dspine: {what} expects the block output of shape {expected} for streams {tuple(x.shape)}, got "
            f"{tuple(block_output.shape)}"
        )
    f = block_output.to(x.dtype).contiguous()
    post = _coefficient(post, x.shape[:-1], "post", what)
    comb = _coefficient(comb, (*x.shape[:-1], x.shape[-2]), "comb", what)
    return LigerMHCMixFunction.apply(x, f, post, comb)
