"""The mHC coefficients' split, sigmoids and Sinkhorn (ops/mhc_coefficients.py) against DeepSeek-V4's formula in
fp64 torch, forward and backward: fp32 on a CPU through Triton's interpreter, on CUDA too. hc 4 (V4's) and 3 (padded
tiles), 1 to 20 Sinkhorn iterations, token counts that leave ragged programs."""

import pytest
import torch

from liger_dspine.ops.mhc_coefficients import LigerMHCSinkhornFunction


def reference(mix, base, scale, iters, pre_eps, eps, post_mult, hc):
    """V4's ``DeepseekV4HyperConnection`` after its projection."""
    z = mix * torch.cat([scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc)]) + base
    pre = torch.sigmoid(z[:, :hc]) + pre_eps
    post = post_mult * torch.sigmoid(z[:, hc : 2 * hc])
    comb = torch.softmax(z[:, 2 * hc :].view(-1, hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@pytest.mark.parametrize("hc, rows, iters", [(4, 70, 20), (4, 5, 1), (3, 33, 2), (4, 32, 7), (2, 9, 3)])
def test_matches_fp64_reference(hc, rows, iters, device):
    generator = torch.Generator().manual_seed(hc * 100 + rows + iters)
    width = hc * hc + 2 * hc
    mix = (torch.randn(rows, width, generator=generator) * 2).to(device).requires_grad_()
    base = torch.randn(width, generator=generator).to(device).requires_grad_()
    scale = (torch.rand(3, generator=generator) + 0.5).to(device).requires_grad_()
    grads = [torch.randn(rows, *shape, generator=generator).to(device) for shape in ((hc,), (hc,), (hc, hc))]
    outputs = LigerMHCSinkhornFunction.apply(mix, base, scale, iters, 1e-6, 1e-3, 2.0, [rows])
    sum(((o * g).sum() for o, g in zip(outputs, grads))).backward()
    leaves = [t.detach().double().requires_grad_() for t in (mix, base, scale)]
    expected = reference(*leaves, iters, 1e-6, 1e-3, 2.0, hc)
    sum(((o * g.double()).sum() for o, g in zip(expected, grads))).backward()
    for got, want in zip(outputs, expected):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    for got, want in zip((mix, base, scale), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=2e-4)


def test_a_wrong_step_order_is_caught(device):
    """The check above can fail: a Sinkhorn that starts with the rows is off by far more than its tolerance."""
    hc, rows = 4, 16
    generator = torch.Generator().manual_seed(0)
    mix = torch.randn(rows, hc * hc + 2 * hc, generator=generator).to(device) * 2
    base, scale = torch.zeros(hc * hc + 2 * hc, device=device), torch.ones(3, device=device)
    _, _, comb = LigerMHCSinkhornFunction.apply(mix, base, scale, 2, 1e-6, 1e-6, 2.0, [rows])
    z = mix[:, 2 * hc :].double().view(-1, hc, hc)
    rows_first = torch.softmax(z, dim=-1) + 1e-6
    for dim in (-1, -2, -1):
        rows_first = rows_first / (rows_first.sum(dim=dim, keepdim=True) + 1e-6)
    assert (comb.double() - rows_first).abs().max() > 1e-3
