"""The FP8 linear's forward and both gradients against float64 products of the dequantised and of the exact operands.

Two references per GEMM A @ B.T (A [M, L], B [N, L], both quantised along L):

- dequantised: the same fp8 values and scales (the torch reference quantiser, bit-identical to the kernels) in
  float64. The op sums exact fp8 products in fp32 and applies two fp32 scales, so
  |out - ref| <= (L + 2) * 2^-24 * sum_l |a_l b_l| (dequantised), plus half an ulp of the output dtype (half the
  subnormal spacing below its normal range).
- exact: the un-quantised float64 product. e4m3 keeps 3 mantissa bits: a quantised element is off by at most
  e = 2^-4 |a| in the normal range and 2^-10 * scale below it (plus 2^-23 |a| from the fp32 quotient), so
  |a^ b^ - a b| <= e_a |b| + |a| e_b + e_a e_b for each product, summed over L (for |a| ~ |b| this is the
  (2 * 2^-4 + 2^-8) * sum |a||b| of the format), plus the dequantised bound above.
The scales in these bounds come from the inputs (amax / 448 in float64), not from the op.
"""

import pytest
import torch

from liger_dspine.ops.fp8_linear import LigerFP8LinearFunction
from liger_dspine.ops.fp8_linear import check_fp8_device
from liger_dspine.ops.fp8_linear import fp8_linear
from liger_dspine.ops.fp8_quantize import quantize_columns_reference
from liger_dspine.ops.fp8_quantize import quantize_rowwise_reference

E4M3_RELATIVE = 2.0**-4 + 2.0**-23  # half an e4m3 ulp, relative, plus the fp32 quotient's rounding
E4M3_SUBNORMAL = 2.0**-10  # half of e4m3's subnormal spacing 2^-9, times the scale
FP32_UNIT = 2.0**-24


def output_rounding(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """Bound on rounding a value of this magnitude to dtype: half an ulp, relative (normal range), or half the
    subnormal spacing."""
    info = torch.finfo(dtype)
    return info.eps / 2 * (magnitude + info.smallest_normal)


def input_scales(a: torch.Tensor) -> torch.Tensor:
    """amax / 448 of each row of a, in float64, from the input itself."""
    amax = a.double().abs().amax(dim=-1) if a.shape[-1] else a.new_zeros(a.shape[:-1], dtype=torch.float64)
    return amax.clamp(min=1e-12) / 448


def quantisation_error(a: torch.Tensor) -> torch.Tensor:
    """Bound on |a^ - a| per element, a quantised along its last dim (float64)."""
    return E4M3_RELATIVE * a.double().abs() + E4M3_SUBNORMAL * input_scales(a)[..., None]


def dequantised_product(qa, sa, qb, sb) -> torch.Tensor:
    """(a^ @ b^.T, |a^| @ |b^|.T) in float64 from fp8 values [M, L], [N, L] and their row scales."""
    a, b = qa.double() * sa.double()[:, None], qb.double() * sb.double()[:, None]
    return a @ b.t(), a.abs() @ b.abs().t()


def assert_fp8_gemm(out, a, b, qa, sa, qb, sb):
    """out ~ a @ b.T (a [M, L], b [N, L] the exact operands; qa, sa, qb, sb their fp8 values and scales), within
    the bounds of the module docstring, elementwise."""
    length = a.shape[-1]
    ref, abs_ref = dequantised_product(qa, sa, qb, sb)
    rounding = (length + 2) * FP32_UNIT * abs_ref + output_rounding(out.dtype, ref.abs())
    assert ((out.double() - ref).abs() <= rounding).all(), (out.double() - ref).abs().max()

    a64, b64 = a.double(), b.double()
    e_a, e_b = quantisation_error(a), quantisation_error(b)
    fp8 = e_a @ b64.abs().t() + a64.abs() @ e_b.t() + e_a @ e_b.t()
    exact = a64 @ b64.t()
    # the output's rounding is relative to |out|; |out| <= |exact| + fp8 + the fp32 terms
    bound = fp8 + (length + 2) * FP32_UNIT * abs_ref + output_rounding(out.dtype, exact.abs() + fp8 + abs_ref)
    assert ((out.double() - exact).abs() <= bound).all(), ((out.double() - exact).abs() / bound).max()
    return exact


def assert_fp8_gemm_on_gpu(out, a, b, qa, sa, qb, sb):
    """:func:`assert_fp8_gemm` for torch's FP8 GEMMs (bf16 out). Hopper's FP8 tensor cores add with about 14
    mantissa bits within a k-chunk (DeepSeek-V3's report), and with use_fast_accum=False the partial sums are
    promoted to fp32 between chunks: allow 2^-10 of sum |a^ b^| for that (16 times 2^-14), on top of half a bf16
    ulp (2^-8 relative) for the output."""
    ref, abs_ref = dequantised_product(qa, sa, qb, sb)
    bound = 2.0**-8 * ref.abs() + 2.0**-10 * abs_ref
    assert ((out.double() - ref).abs() <= bound).all()
    e_a, e_b = quantisation_error(a), quantisation_error(b)
    exact = a.double() @ b.double().t()
    fp8 = e_a @ b.double().abs().t() + a.double().abs() @ e_b.t() + e_a @ e_b.t()
    assert ((out.double() - exact).abs() <= fp8 + bound + 2.0**-8 * fp8).all()


def run_linear(x, weight, grad, need_x=True, need_weight=True):
    x = x.clone().requires_grad_(need_x)
    weight = weight.clone().requires_grad_(need_weight)
    out = fp8_linear(x, weight)
    out.backward(grad)
    return out, x.grad, weight.grad


def inputs(lead, in_features, out_features, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    # magnitudes over six decades, so that some quantised elements land in e4m3's subnormal range
    decades = torch.logspace(-5, 1, in_features)[torch.randperm(in_features, generator=generator)]
    x = torch.randn(*lead, in_features, generator=generator) * decades
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    grad = torch.randn(*lead, out_features, generator=generator) * 1e-3
    x.view(-1, in_features)[:1, :4] *= 50  # outliers in one token: its other elements fall towards subnormal e4m3
    return x.to(dtype), weight.to(dtype), grad.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead, in_features, out_features", [((3, 5), 32, 48), ((16,), 16, 16), ((2, 1), 48, 32)])
def test_forward_and_gradients(dtype, lead, in_features, out_features):
    x, weight, grad = inputs(lead, in_features, out_features, dtype, seed=in_features + out_features)
    out, grad_x, grad_weight = run_linear(x, weight, grad)
    assert out.shape == (*lead, out_features) and out.dtype == dtype
    assert grad_x.shape == x.shape and grad_x.dtype == dtype
    assert grad_weight.shape == weight.shape and grad_weight.dtype == dtype

    x2, g2 = x.reshape(-1, in_features), grad.reshape(-1, out_features)
    # forward: x per token over K, W per out-feature over K
    qx, sx = quantize_rowwise_reference(x2)
    qw, sw = quantize_rowwise_reference(weight)
    assert_fp8_gemm(out.reshape(-1, out_features), x2, weight, qx, sx, qw, sw)
    # dx = dy @ W: dy per token over N, W per in-feature over N
    qg, sg = quantize_rowwise_reference(g2)
    qwt, swt = quantize_columns_reference(weight)
    assert_fp8_gemm(grad_x.reshape(-1, in_features), g2, weight.t(), qg, sg, qwt, swt)
    # dW = dy.T @ x: dy per out-feature over tokens, x per in-feature over tokens (zero-padded to 16 tokens)
    qgt, sgt = quantize_columns_reference(g2)
    qxt, sxt = quantize_columns_reference(x2)
    tokens = x2.shape[0]
    assert (qgt.view(torch.uint8)[:, tokens:] == 0).all() and (qxt.view(torch.uint8)[:, tokens:] == 0).all()
    assert_fp8_gemm(grad_weight, g2.t(), x2.t(), qgt[:, :tokens], sgt, qxt[:, :tokens], sxt)


def test_one_input_gradient_at_a_time():
    x, weight, grad = inputs((5,), 32, 16, torch.float32, seed=1)
    _, grad_x, grad_weight = run_linear(x, weight, grad)
    out, only_x, none_w = run_linear(x, weight, grad, need_weight=False)
    assert none_w is None and torch.equal(only_x, grad_x)
    _, none_x, only_w = run_linear(x, weight, grad, need_x=False)
    assert none_x is None and torch.equal(only_w, grad_weight)
    assert out.grad_fn is not None


def test_no_tokens():
    x, weight, grad = inputs((0,), 16, 32, torch.float32, seed=2)
    out, grad_x, grad_weight = run_linear(x, weight, grad)
    assert out.shape == (0, 32) and grad_x.shape == (0, 16)
    assert torch.equal(grad_weight, torch.zeros_like(weight))


def test_bad_inputs(monkeypatch):
    with pytest.raises(ValueError, match="liger-dspine: FP8 linear needs these dims to be multiples of 16"):
        fp8_linear(torch.randn(4, 24), torch.randn(16, 24))
    with pytest.raises(ValueError, match="multiples of 16.*'N': 8"):
        fp8_linear(torch.randn(4, 16), torch.randn(8, 16))
    with pytest.raises(ValueError, match="liger-dspine: FP8 linear needs x"):
        fp8_linear(torch.randn(4, 16), torch.randn(16, 32))
    with pytest.raises(ValueError, match="outside autocast they must match"):
        fp8_linear(torch.randn(4, 16), torch.randn(16, 16, dtype=torch.float16))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"liger-dspine: FP8 linear needs a GPU with FP8 GEMMs .*got 8.0"):
        check_fp8_device(torch.device("cuda"), "FP8 linear")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_fp8_device(torch.device("cuda"), "FP8 linear")


def test_second_order_is_refused():
    x, weight, _ = inputs((4,), 16, 16, torch.float32, seed=3)
    x.requires_grad_(True)
    out = LigerFP8LinearFunction.apply(x, weight)
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.cuda
def test_scaled_mm_matches_the_reference_on_cuda():
    """torch._scaled_mm (bf16 out) against the dequantised fp64 product and the exact one, at DeepSeek-V3 widths."""
    torch.manual_seed(0)
    tokens, hidden, out_features = 4096, 7168, 2048
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    weight = (torch.randn(out_features, hidden, device="cuda") / hidden**0.5).bfloat16()
    grad = (torch.randn(tokens, out_features, device="cuda") * 1e-3).bfloat16()
    out, grad_x, grad_weight = run_linear(x, weight, grad)

    check = assert_fp8_gemm_on_gpu
    check(out, x, weight, *quantize_rowwise_reference(x), *quantize_rowwise_reference(weight))
    check(grad_x, grad, weight.t(), *quantize_rowwise_reference(grad), *quantize_columns_reference(weight))
    qgt, sgt = quantize_columns_reference(grad)
    qxt, sxt = quantize_columns_reference(x)
    check(grad_weight, grad.t(), x.t(), qgt, sgt, qxt, sxt)
