"""The coefficients of manifold-constrained hyper-connections (mHC) from the flattened streams of each token:

    mix, invr = mhc_projection(x, fn)                                       (ops/mhc_projection.py)
    pre  = sigmoid(scale_pre  * mix_pre  + base_pre) + pre_eps                          [N, hc]
    post = post_mult * sigmoid(scale_post * mix_post + base_post)                       [N, hc]
    comb = Sinkhorn(softmax(scale_res * mix_res + base_res) + eps)                      [N, hc, hc]

The split, the sigmoids and the Sinkhorn iterations run in liger-kernel's kernels (one program per token; the
backward replays the iterations from their saved history); the projection in this package's kernel.
"""

import torch

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.mhc_projection import liger_mhc_projection


def _streams(num_out: int) -> int:
    """hc from M = hc * hc + 2 * hc."""
    return round((1 + num_out) ** 0.5) - 1


@torch.library.custom_op("liger_dspine::mhc_sinkhorn", mutates_args=())
def _mhc_sinkhorn(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, pre_eps: float, sinkhorn_eps: float,
    post_mult: float, outer: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(pre [*outer, hc], post [*outer, hc], comb [*outer, hc, hc], history [N, iters, hc, hc]) fp32 of contiguous
    fp32 mix [N, M] (N = prod(outer)), base [M] and scale [3], in liger-kernel's kernel."""
    from liger_kernel.ops.mhc import mhc_split_sinkhorn_fwd

    pre, post, comb, history = _sinkhorn_outputs(mix, iters, outer)
    rows, hc = mix.shape[0], pre.shape[-1]
    alphas = [scale[i].contiguous() for i in range(3)]
    mhc_split_sinkhorn_fwd(
        mix, base, *alphas, tmax=iters, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult,
        out_hpre=pre.view(rows, hc), out_hpost=post.view(rows, hc), out_hres=comb.view(rows, hc, hc),
        out_hist=history, return_hist=True,
    )  # fmt: skip
    return pre, post, comb, history


def _sinkhorn_outputs(mix: torch.Tensor, iters: int, outer: list[int]):
    hc = _streams(mix.shape[1])
    return (
        mix.new_empty(*outer, hc),
        mix.new_empty(*outer, hc),
        mix.new_empty(*outer, hc, hc),
        mix.new_empty(mix.shape[0], iters, hc, hc),
    )


@_mhc_sinkhorn.register_fake
def _(mix, base, scale, iters, pre_eps, sinkhorn_eps, post_mult, outer):
    return _sinkhorn_outputs(mix, iters, outer)


@torch.library.custom_op("liger_dspine::mhc_sinkhorn_backward", mutates_args=())
def _mhc_sinkhorn_backward(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, grad_comb: torch.Tensor, history: torch.Tensor,
    sinkhorn_eps: float,
) -> torch.Tensor:  # fmt: skip
    """d logits of comb [N, hc, hc] fp32 from d comb, replaying the saved Sinkhorn iterations (liger-kernel's)."""
    from liger_kernel.ops.mhc import mhc_sinkhorn_bwd

    return mhc_sinkhorn_bwd(
        mix, base, scale[2].contiguous(), grad_comb, tmax=history.shape[1], sinkhorn_eps=sinkhorn_eps, hist=history
    )


@_mhc_sinkhorn_backward.register_fake
def _(mix, base, scale, grad_comb, history, sinkhorn_eps):
    return torch.empty_like(grad_comb)


class LigerMHCSinkhornFunction(torch.autograd.Function):
    """``(mix [N, M] fp32, base [M], scale [3], iters, pre_eps, sinkhorn_eps, post_mult, outer)`` -> ``(pre
    [*outer, hc], post [*outer, hc], comb [*outer, hc, hc])`` fp32, with M = hc * hc + 2 * hc and N = prod(outer)."""

    kernel_ops = ("liger_dspine::mhc_sinkhorn", "liger_dspine::mhc_sinkhorn_backward")

    @staticmethod
    def forward(ctx, mix, base, scale, iters, pre_eps, sinkhorn_eps, post_mult, outer):
        base32, scale32 = base.float().contiguous(), scale.float().contiguous()
        pre, post, comb, history = _mhc_sinkhorn(mix, base32, scale32, iters, pre_eps, sinkhorn_eps, post_mult, outer)
        ctx.save_for_backward(mix, base32, scale32, history)
        ctx.iters, ctx.sinkhorn_eps, ctx.post_mult = iters, sinkhorn_eps, post_mult
        ctx.dtypes = (base.dtype, scale.dtype)
        return pre, post, comb

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_comb):
        mix, base, scale, history = ctx.saved_tensors
        hc = grad_pre.shape[-1]
        grad_pre, grad_post = grad_pre.reshape(-1, hc), grad_post.reshape(-1, hc)
        mix_pre, mix_post, mix_res = mix[:, :hc], mix[:, hc : 2 * hc], mix[:, 2 * hc :]
        # d logits of each part; pre's eps and post's multiplier are constants of the sigmoids
        sig_pre = torch.sigmoid(mix_pre * scale[0] + base[:hc])
        sig_post = torch.sigmoid(mix_post * scale[1] + base[hc : 2 * hc])
        grad_pre_logits = grad_pre.float() * sig_pre * (1 - sig_pre)
        grad_post_logits = grad_post.float() * ctx.post_mult * sig_post * (1 - sig_post)
        grad_res_logits = _mhc_sinkhorn_backward(
            mix, base, scale, grad_comb.float().reshape(-1, hc, hc).contiguous(), history, ctx.sinkhorn_eps
        ).reshape(mix.shape[0], hc * hc)
        logits_grads = (grad_pre_logits, grad_post_logits, grad_res_logits)
        grad_mix = torch.cat([g * scale[i] for i, g in enumerate(logits_grads)], dim=1)
        grad_base = torch.cat([g.sum(0) for g in logits_grads])
        grad_scale = torch.stack([(g * m).sum() for g, m in zip(logits_grads, (mix_pre, mix_post, mix_res))])
        base_dtype, scale_dtype = ctx.dtypes
        return grad_mix, grad_base.to(base_dtype), grad_scale.to(scale_dtype), None, None, None, None, None


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
