"""The coefficients of manifold-constrained hyper-connections (mHC) from the flattened streams of each token:

    mix, invr = mhc_projection(x, fn)                                       (ops/mhc_projection.py)
    pre  = sigmoid(scale_pre  * mix_pre  + base_pre) + pre_eps                          [N, hc]
    post = post_mult * sigmoid(scale_post * mix_post + base_post)                       [N, hc]
    comb = Sinkhorn(softmax(scale_res * mix_res + base_res) + eps)                      [N, hc, hc]

Sinkhorn here is DeepSeek-V4's: a column normalisation, then ``iters - 1`` pairs of row and column normalisations,
each dividing by the sum plus eps (2 iters - 1 steps). One kernel computes the three from ``mix``; the backward
kernel recomputes the steps' inputs from the softmax instead of keeping them (for each step in reverse, the steps
before it again: about iters^2 normalisations of an hc x hc matrix per token, no memory). Token count and iteration
count are run-time values: one compilation per hc (liger-kernel's kernels compile again for each token count).
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.mhc_projection import liger_mhc_projection
from liger_dspine.ops.precompile import precompile

BLOCK_T = 32  # tokens per program


def _streams(num_out: int) -> int:
    """hc from M = hc * hc + 2 * hc."""
    return round((1 + num_out) ** 0.5) - 1


@triton.jit
def _comb_logits(mix_ptr, base_ptr, scale_ptr, rows, row_ok, HC: tl.constexpr, HP: tl.constexpr):
    """([T, HP, HP] fp32 logits of comb, [1, HP, HP] valid): entry [t, j, k] is mix[t, 2 hc + j hc + k]."""
    j = tl.arange(0, HP)[None, :, None]
    k = tl.arange(0, HP)[None, None, :]
    valid = (j < HC) & (k < HC)
    column = 2 * HC + j * HC + k
    loaded = tl.load(mix_ptr + rows[:, None, None] * (2 * HC + HC * HC) + column, mask=row_ok[:, None, None] & valid)
    base = tl.load(base_ptr + column, mask=valid, other=0.0)
    return loaded * tl.load(scale_ptr + 2) + base, valid


@triton.jit
def _row_softmax(logits, valid):
    logits = tl.where(valid, logits, -1e30)
    e = tl.where(valid, tl.exp(logits - tl.max(logits, axis=2)[:, :, None]), 0.0)
    total = tl.sum(e, axis=2)
    return e / tl.where(total > 0, total, 1.0)[:, :, None]


@triton.jit
def _divisor(p, by_column, eps):
    """Sum + eps of each column (over j) or each row (over k), broadcast to [T, HP, HP]."""
    columns = tl.sum(p, axis=1)[:, None, :] + eps
    rows = tl.sum(p, axis=2)[:, :, None] + eps
    return tl.where(by_column, columns, rows)


@triton.jit
def _sinkhorn_input(logits, valid, steps, eps):
    """The matrix before normalisation step ``steps`` (0: the softmax plus eps; even steps are by column)."""
    p = tl.where(valid, _row_softmax(logits, valid) + eps, 0.0)
    for step in range(0, steps):
        p = p / _divisor(p, step % 2 == 0, eps)
    return p


@triton.jit
def _mhc_sinkhorn_forward_kernel(
    mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, num_rows, iters, pre_eps, sinkhorn_eps, post_mult,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    streams = tl.arange(0, HP)
    ok = row_ok[:, None] & (streams < HC)[None, :]
    first = mix_ptr + rows[:, None] * (2 * HC + HC * HC) + streams[None, :]
    z_pre = tl.load(first, mask=ok) * tl.load(scale_ptr) + tl.load(base_ptr + streams, mask=streams < HC)
    z_post = tl.load(first + HC, mask=ok) * tl.load(scale_ptr + 1)
    z_post += tl.load(base_ptr + HC + streams, mask=streams < HC)
    out = rows[:, None] * HC + streams[None, :]
    tl.store(pre_ptr + out, tl.sigmoid(z_pre) + pre_eps, mask=ok)
    tl.store(post_ptr + out, post_mult * tl.sigmoid(z_post), mask=ok)

    logits, valid = _comb_logits(mix_ptr, base_ptr, scale_ptr, rows, row_ok, HC, HP)
    comb = _sinkhorn_input(logits, valid, 2 * iters - 1, sinkhorn_eps)
    entries = tl.arange(0, HP)[None, :, None] * HC + tl.arange(0, HP)[None, None, :]
    tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + entries, comb, mask=row_ok[:, None, None] & valid)


@triton.jit
def _mhc_sinkhorn_backward_kernel(
    mix_ptr, base_ptr, scale_ptr, grad_pre_ptr, grad_post_ptr, grad_comb_ptr, grad_logits_ptr,
    num_rows, iters, sinkhorn_eps, post_mult,
    HC: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """d logits [N, M] fp32 (logits = scale * mix + base, in mix's column order) from d pre, d post, d comb."""
    width = 2 * HC + HC * HC
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    streams = tl.arange(0, HP)
    ok = row_ok[:, None] & (streams < HC)[None, :]
    first = mix_ptr + rows[:, None] * width + streams[None, :]
    out = rows[:, None] * HC + streams[None, :]
    sig = tl.sigmoid(tl.load(first, mask=ok) * tl.load(scale_ptr) + tl.load(base_ptr + streams, mask=streams < HC))
    grad = tl.load(grad_pre_ptr + out, mask=ok, other=0.0) * sig * (1 - sig)
    tl.store(grad_logits_ptr + rows[:, None] * width + streams[None, :], grad, mask=ok)
    z_post = tl.load(first + HC, mask=ok) * tl.load(scale_ptr + 1)
    sig = tl.sigmoid(z_post + tl.load(base_ptr + HC + streams, mask=streams < HC))
    grad = tl.load(grad_post_ptr + out, mask=ok, other=0.0) * post_mult * sig * (1 - sig)
    tl.store(grad_logits_ptr + rows[:, None] * width + HC + streams[None, :], grad, mask=ok)

    logits, valid = _comb_logits(mix_ptr, base_ptr, scale_ptr, rows, row_ok, HC, HP)
    entries = tl.arange(0, HP)[None, :, None] * HC + tl.arange(0, HP)[None, None, :]
    comb_ok = row_ok[:, None, None] & valid
    grad = tl.load(grad_comb_ptr + rows[:, None, None] * (HC * HC) + entries, mask=comb_ok, other=0.0)
    steps = 2 * iters - 1
    for back in range(0, steps):  # d input of each step, last step first: y = x / s, d x = (d y - sum(d y * y)) / s
        step = steps - 1 - back
        by_column = step % 2 == 0
        x = _sinkhorn_input(logits, valid, step, sinkhorn_eps)
        divisor = _divisor(x, by_column, sinkhorn_eps)
        weighted = grad * (x / divisor)
        along = tl.where(by_column, tl.sum(weighted, axis=1)[:, None, :], tl.sum(weighted, axis=2)[:, :, None])
        grad = tl.where(valid, (grad - along) / divisor, 0.0)
    soft = _row_softmax(logits, valid)  # the eps is a constant: d softmax = d (softmax + eps)
    grad = soft * (grad - tl.sum(grad * soft, axis=2)[:, :, None])
    tl.store(grad_logits_ptr + rows[:, None, None] * width + 2 * HC + entries, grad, mask=comb_ok)


def _launch(rows: int):
    return (triton.cdiv(rows, BLOCK_T),)


def _sinkhorn_meta(hc: int) -> dict:
    """The Sinkhorn kernels' compile-time parameters (the forward, the backward and its precompilation)."""
    return dict(HC=hc, HP=triton.next_power_of_2(hc), BLOCK_T=BLOCK_T, num_warps=2)


@liger_custom_op("liger_dspine::mhc_sinkhorn", mutates_args=())
def _mhc_sinkhorn(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, pre_eps: float, sinkhorn_eps: float,
    post_mult: float, outer: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(pre [*outer, hc], post [*outer, hc], comb [*outer, hc, hc]) fp32 of contiguous fp32 mix [N, M]
    (N = prod(outer)), base [M] and scale [3]."""
    pre, post, comb = _sinkhorn_outputs(mix, outer)
    rows, hc = mix.shape[0], pre.shape[-1]
    if rows:
        _mhc_sinkhorn_forward_kernel[_launch(rows)](
            mix, base, scale, pre, post, comb, rows, iters, pre_eps, sinkhorn_eps, post_mult, **_sinkhorn_meta(hc),
        )  # fmt: skip
    return pre, post, comb


def _sinkhorn_outputs(mix: torch.Tensor, outer: list[int]):
    hc = _streams(mix.shape[1])
    return mix.new_empty(*outer, hc), mix.new_empty(*outer, hc), mix.new_empty(*outer, hc, hc)


@_mhc_sinkhorn.register_fake
def _(mix, base, scale, iters, pre_eps, sinkhorn_eps, post_mult, outer):
    return _sinkhorn_outputs(mix, outer)


@liger_custom_op("liger_dspine::mhc_sinkhorn_backward", mutates_args=())
def _mhc_sinkhorn_backward(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, grad_pre: torch.Tensor, grad_post: torch.Tensor,
    grad_comb: torch.Tensor, iters: int, sinkhorn_eps: float, post_mult: float,
) -> torch.Tensor:  # fmt: skip
    """d logits [N, M] fp32 from contiguous fp32 d pre [N, hc], d post [N, hc] and d comb [N, hc, hc]."""
    grad_logits = torch.empty_like(mix)
    rows, hc = mix.shape[0], grad_pre.shape[-1]
    if rows:
        _mhc_sinkhorn_backward_kernel[_launch(rows)](
            mix, base, scale, grad_pre, grad_post, grad_comb, grad_logits, rows, iters, sinkhorn_eps, post_mult,
            **_sinkhorn_meta(hc),
        )  # fmt: skip
    return grad_logits


@_mhc_sinkhorn_backward.register_fake
def _(mix, base, scale, grad_pre, grad_post, grad_comb, iters, sinkhorn_eps, post_mult):
    return torch.empty_like(mix)


class LigerMHCSinkhornFunction(torch.autograd.Function):
    """``(mix [N, M] fp32, base [M], scale [3], iters, pre_eps, sinkhorn_eps, post_mult, outer)`` -> ``(pre
    [*outer, hc], post [*outer, hc], comb [*outer, hc, hc])`` fp32, with M = hc * hc + 2 * hc and N = prod(outer)."""

    kernel_ops = ("liger_dspine::mhc_sinkhorn", "liger_dspine::mhc_sinkhorn_backward")

    @staticmethod
    def forward(ctx, mix, base, scale, iters, pre_eps, sinkhorn_eps, post_mult, outer):
        base32, scale32 = base.float().contiguous(), scale.float().contiguous()
        pre, post, comb = _mhc_sinkhorn(mix, base32, scale32, iters, pre_eps, sinkhorn_eps, post_mult, outer)
        if mix.is_cuda and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():
            precompile(
                _mhc_sinkhorn_backward_kernel, mix, base32, scale32, pre, post, comb, mix, mix.shape[0], iters,
                sinkhorn_eps, post_mult, **_sinkhorn_meta(pre.shape[-1]),
            )  # fmt: skip
        ctx.save_for_backward(mix, base32, scale32)
        ctx.iters, ctx.sinkhorn_eps, ctx.post_mult = iters, sinkhorn_eps, post_mult
        ctx.dtypes = (base.dtype, scale.dtype)
        return pre, post, comb

    @staticmethod
    @first_order_only
    def backward(ctx, grad_pre, grad_post, grad_comb):
        mix, base, scale = ctx.saved_tensors
        hc = _streams(mix.shape[1])
        grads = [g.float().reshape(mix.shape[0], *shape).contiguous() for g, shape in zip(
            (grad_pre, grad_post, grad_comb), ((hc,), (hc,), (hc, hc))
        )]  # fmt: skip
        grad_logits = _mhc_sinkhorn_backward(mix, base, scale, *grads, ctx.iters, ctx.sinkhorn_eps, ctx.post_mult)
        parts = (slice(0, hc), slice(hc, 2 * hc), slice(2 * hc, None))
        grad_mix = torch.cat([grad_logits[:, part] * scale[i] for i, part in enumerate(parts)], dim=1)
        grad_scale = torch.stack([(grad_logits[:, part] * mix[:, part]).sum() for part in parts])
        base_dtype, scale_dtype = ctx.dtypes
        return grad_mix, grad_logits.sum(0).to(base_dtype), grad_scale.to(scale_dtype), None, None, None, None, None


def liger_mhc_coefficients(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [..., hc], post [..., hc], comb [..., hc, hc])`` in fp32 for ``streams [..., hc, C]``, ``fn
    [hc * hc + 2 * hc, hc * C]``, ``base [hc * hc + 2 * hc]`` and ``scale [3]`` (pre, post, comb); see the module's
    docstring. ``comb[j, k]`` is the weight of input stream j in output stream k."""
    check_kernel_device(streams, "the mHC coefficients")
    hc, width = streams.shape[-2], streams.shape[-2] * streams.shape[-1]
    expected = hc * hc + 2 * hc
    if tuple(fn.shape) != (expected, width) or tuple(base.shape) != (expected,) or tuple(scale.shape) != (3,):
        raise ValueError(
            f"liger-dspine: mHC coefficients of {hc} streams of width {streams.shape[-1]} expect fn [{expected}, "
            f"{width}], base [{expected}] and scale [3], got {tuple(fn.shape)}, {tuple(base.shape)} and "
            f"{tuple(scale.shape)}"
        )
    if iters < 1:
        raise ValueError(f"liger-dspine: mHC coefficients need at least one Sinkhorn iteration, got {iters}")
    outer = streams.shape[:-2]
    mix, _ = liger_mhc_projection(streams.reshape(-1, width), fn, rms_eps)
    return LigerMHCSinkhornFunction.apply(
        mix, base, scale, int(iters), float(pre_eps), float(sinkhorn_eps), float(post_mult), list(outer)
    )
