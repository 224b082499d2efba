"""The mHC projection (ops/mhc_projection.py) against an fp64 torch reference, forward and backward: fp32 on a CPU
through Triton's interpreter, bf16 streams with fp32 / bf16 ``fn`` on CUDA."""

import pytest
import torch

from liger_dspine.ops.mhc_projection import liger_mhc_projection


def reference(x, fn, eps):
    x64 = x.double()
    invr = torch.rsqrt(x64.square().mean(-1) + eps)
    return (x64 * invr[:, None]) @ fn.double().t(), invr


def check(rows, width, outs, x_dtype, fn_dtype, device, tolerance):
    generator = torch.Generator().manual_seed(rows * width + outs)
    x = (torch.randn(rows, width, generator=generator) * 3).to(device, x_dtype).requires_grad_()
    fn = (torch.randn(outs, width, generator=generator) / width**0.5).to(device, fn_dtype).requires_grad_()
    grad_mix = torch.randn(rows, outs, generator=generator).to(device)
    mix, invr = liger_mhc_projection(x, fn, 1e-6)
    assert mix.dtype == invr.dtype == torch.float32 and mix.shape == (rows, outs)
    (mix * grad_mix).sum().backward()
    x64, fn64 = x.detach().double().requires_grad_(), fn.detach().double().requires_grad_()
    ref_mix, ref_invr = reference(x64, fn64, 1e-6)
    (ref_mix * grad_mix.double()).sum().backward()
    assert x.grad.dtype == x.dtype and fn.grad.dtype == fn.dtype
    torch.testing.assert_close(mix.double(), ref_mix, **tolerance)
    torch.testing.assert_close(invr.double(), ref_invr, **tolerance)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tolerance)
    torch.testing.assert_close(fn.grad.double(), fn64.grad, **tolerance)


@pytest.mark.parametrize(
    "rows, width, outs",
    [(37, 200, 24), (5, 64, 8), (70, 300, 15), (600, 96, 24)],  # ragged tiles; 600 rows: two backward programs
)
def test_matches_fp64_reference_fp32(rows, width, outs, device):
    check(rows, width, outs, torch.float32, torch.float32, device, dict(atol=1e-4, rtol=1e-4))


def test_no_rows_gives_empty_outputs(device):
    x, fn = torch.zeros(0, 32, device=device, requires_grad=True), torch.randn(8, 32, device=device)
    mix, invr = liger_mhc_projection(x, fn, 1e-6)
    assert mix.shape == (0, 8) and invr.shape == (0,)


def test_bad_shapes_are_an_error(device):
    with pytest.raises(ValueError, match=r"expects x \[N, K\] and fn \[M, K\]"):
        liger_mhc_projection(torch.zeros(4, 32, device=device), torch.zeros(8, 16, device=device), 1e-6)
    with pytest.raises(ValueError, match="at most 128 outputs"):
        liger_mhc_projection(torch.zeros(4, 32, device=device), torch.zeros(200, 32, device=device), 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.bfloat16], ids=["fn_fp32", "fn_bf16"])
def test_matches_fp64_reference_bf16_streams_cuda(fn_dtype):
    """V4's widths (4 streams of 4096, 24 outputs): fp32 products, so only the bf16 rounding of d x remains."""
    check(1000, 4 * 4096, 24, torch.bfloat16, fn_dtype, "cuda", dict(atol=2e-2, rtol=1e-2))
