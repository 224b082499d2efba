"""The mHC collapse and mix (ops/mhc_streams.py) against fp64 torch, forward and backward: fp32 on a CPU through
Triton's interpreter (hc 4 as DeepSeek-V4, hc 3 for padded tiles, ragged token and channel tiles), bf16 on CUDA."""

import pytest
import torch

from liger_dspine.ops.mhc_streams import liger_mhc_collapse
from liger_dspine.ops.mhc_streams import liger_mhc_mix


def _inputs(outer, hc, width, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape, scale=1.0, kind=None):
        return (torch.randn(*shape, generator=generator) * scale).to(device, kind or dtype).requires_grad_()

    streams = make(*outer, hc, width)
    f = make(*outer, width)
    pre, post = make(*outer, hc, kind=torch.float32), make(*outer, hc, kind=torch.float32)
    comb = make(*outer, hc, hc, scale=0.5, kind=torch.float32)
    return streams, f, pre, post, comb


def run_both(outer, hc, width, dtype, device, tolerance, seed=0):
    streams, f, pre, post, comb = _inputs(outer, hc, width, dtype, device, seed)
    copies = [t.detach().double().requires_grad_() for t in (streams, f, pre, post, comb)]
    s64, f64, pre64, post64, comb64 = copies
    grad_y = torch.randn(*outer, width, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    grad_out = torch.randn(*outer, hc, width, generator=torch.Generator().manual_seed(seed + 2)).to(device, dtype)

    y = liger_mhc_collapse(streams, pre)
    ref_y = (pre64.unsqueeze(-1) * s64).sum(-2)
    out = liger_mhc_mix(streams, f, post, comb)
    ref_out = post64.unsqueeze(-1) * f64.unsqueeze(-2) + torch.einsum("...jk,...jc->...kc", comb64, s64)
    ((y * grad_y).sum() + (out * grad_out).sum()).backward()
    ((ref_y * grad_y.double()).sum() + (ref_out * grad_out.double()).sum()).backward()
    torch.testing.assert_close(y.double(), ref_y, **tolerance)
    torch.testing.assert_close(out.double(), ref_out, **tolerance)
    assert y.dtype == out.dtype == dtype and y.shape == ref_y.shape and out.shape == ref_out.shape
    for leaf, copy in zip((streams, f, pre, post, comb), copies):
        assert leaf.grad.dtype == leaf.dtype
        torch.testing.assert_close(leaf.grad.double(), copy.grad, **tolerance)


@pytest.mark.parametrize("outer, hc, width", [((2, 7), 4, 300), ((33,), 3, 64), ((1, 5), 4, 512), ((6,), 2, 40)])
def test_matches_fp64_reference_fp32(outer, hc, width, device):
    run_both(outer, hc, width, torch.float32, device, dict(atol=1e-5, rtol=1e-5), seed=hc * width)


def test_wrong_coefficient_shapes_are_an_error(device):
    streams = torch.zeros(2, 3, 4, 8, device=device)
    with pytest.raises(ValueError, match="expects pre of"):
        liger_mhc_collapse(streams, torch.zeros(2, 3, 5, device=device))
    with pytest.raises(ValueError, match="expects comb of"):
        liger_mhc_mix(streams, torch.zeros(2, 3, 8, device=device), torch.zeros(2, 3, 4, device=device),
                      torch.zeros(2, 3, 4, 3, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="expects the block output"):
        liger_mhc_mix(streams, torch.zeros(2, 3, 7, device=device), torch.zeros(2, 3, 4, device=device),
                      torch.zeros(2, 3, 4, 4, device=device))  # fmt: skip


@pytest.mark.cuda
def test_cuda_bf16_against_fp64():
    """bf16 streams at V4's widths (hc 4, C 4096): fp32 sums, so the only errors are the outputs' rounding (the
    streams' gradient is two rounded bf16 terms, collapse's and mix's, added in bf16: up to 1.5 ulp, 0.05 at 8)."""
    run_both((2, 300), 4, 4096, torch.bfloat16, "cuda", dict(atol=6.25e-2, rtol=1.6e-2), seed=3)
