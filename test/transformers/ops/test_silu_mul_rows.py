"""The SiLU-mul row kernels against eager torch: float64 autograd, and the fp32 torch path of grouped_experts.

Distances are counted in ulps of the output dtype at the reference value. On a CPU (Triton's interpreter, fp32 and
fp16) the exponential is NumPy's, up to an ulp from torch's, which puts the fp32 activation up to 3 ulps from
torch's; fp16 results round the same fp32 values, so they sit within an fp16 ulp of torch's. The backward reuses
the forward's activation bit for bit, which the dot and scaled checks pin (built on the forward's output).
On CUDA the exponential is libdevice's and divisions round to nearest, as torch's kernels: fp32 equals torch's.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.ops.grouped_experts import row_dot
from liger_dspine.ops.grouped_experts import scaled_rows
from liger_dspine.ops.grouped_experts import silu_mul
from liger_dspine.ops.grouped_experts import silu_mul_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_supported

# (S, I): one row, widths that are not powers of two, and I = 3000 > the 2048-column block (a masked second step)
SHAPES = [(1, 8), (37, 48), (5, 3000)]
CPU_DTYPES = [torch.float32, torch.float16]  # bf16 is wrong in the interpreter
FLAGS = list(itertools.product([False, True], repeat=3))  # row_dot, scaled_act, in_place

# fp32 activation vs torch's on a CPU: NumPy's and torch's exponentials differ by up to an ulp (3 ulps observed)
FORWARD_ULPS = {torch.float32: 4, torch.float16: 1}


def random_rows(rows, half, dtype, device, seed=0):
    """gate ~ 3 N(0, 1) (both saturated tails of the SiLU), up and g ~ N(0, 1), routing weights in [0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    gate = 3.0 * torch.randn(rows, half, generator=generator)
    up = torch.randn(rows, half, generator=generator)
    g = torch.randn(rows, half, generator=generator)
    weight = torch.rand(rows, generator=generator)
    return torch.cat([gate, up], dim=1).to(device, dtype), g.to(device, dtype), weight.to(device)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in units of actual's dtype spacing at expected (subnormal spacing below the normals)."""
    info = torch.finfo(actual.dtype)
    _, exponent = torch.frexp(expected.double().abs())
    spacing = torch.ldexp(torch.full_like(expected, info.eps, dtype=torch.float64), exponent - 1)
    spacing = spacing.clamp_min(info.smallest_normal * info.eps)
    return (actual.double() - expected.double()).abs() / spacing


def autograd_reference(gate_up, g, weight):
    """float64 d(sum(weight * g * silu(gate) * up)) / d gate_up."""
    half = gate_up.shape[1] // 2
    x = gate_up.double().requires_grad_()
    act = F.silu(x[:, :half]) * x[:, half:]
    (act * (weight.double()[:, None] * g.double())).sum().backward()
    return x.grad


@pytest.mark.parametrize("rows, half", SHAPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_forward_matches_torch(rows, half, dtype, device):
    gate_up, _, _ = random_rows(rows, half, dtype, device)
    act = silu_mul_rows(gate_up)
    expected = silu_mul(gate_up)
    assert act.dtype == dtype and act.shape == (rows, half)
    assert ulps_apart(act, expected).max() <= FORWARD_ULPS[dtype]
    # the float64 value, to fp32 ulps plus the rounding to the dtype
    gate, up = gate_up.double().chunk(2, dim=1)
    rtol = FORWARD_ULPS[dtype] * torch.finfo(dtype).eps
    torch.testing.assert_close(act.double(), F.silu(gate) * up, atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("rows, half", SHAPES)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("row_dot_on, scaled_act, in_place", FLAGS)
def test_backward_matches_reference(rows, half, dtype, row_dot_on, scaled_act, in_place, device):
    gate_up, g, weight = random_rows(rows, half, dtype, device, seed=1)
    inputs = [t.clone() for t in (gate_up, g, weight)]
    act = silu_mul_rows(gate_up)  # the forward's activation, which the backward must reproduce
    expected_grad = autograd_reference(gate_up, g, weight)
    expected_dots = (g.double() * act.double()).sum(1)
    expected_scaled = weight.double()[:, None] * act.double()

    target = gate_up.clone() if in_place else gate_up
    d_gate_up, dots, scaled = silu_mul_rows_backward(
        target, g, weight, row_dot=row_dot_on, scaled_act=scaled_act, in_place=in_place
    )

    assert d_gate_up.dtype == dtype and d_gate_up.shape == gate_up.shape
    if in_place:
        assert d_gate_up is target  # written over the input, which now holds the gradient
    else:
        assert d_gate_up.data_ptr() != gate_up.data_ptr()
        assert torch.equal(gate_up, inputs[0])
    assert torch.equal(g, inputs[1]) and torch.equal(weight, inputs[2])

    if dtype == torch.float32:
        # fp32 roundings of the product terms; near silu'(x) = 0 (x ~ -1.28) relative errors grow, absolute do not
        torch.testing.assert_close(d_gate_up.double(), expected_grad, atol=1e-5, rtol=1e-5)
    else:
        assert ulps_apart(d_gate_up, expected_grad).max() <= 1  # fp32 math rounded once to fp16

    if row_dot_on:
        assert dots.dtype == torch.float32 and dots.shape == (rows,)
        # fp32 accumulation: within a few fp32 epsilons of the sum of the terms' magnitudes
        bound = 1e-6 * (g.double() * act.double()).abs().sum(1)
        assert ((dots.double() - expected_dots).abs() <= bound).all()
    else:
        assert dots is None
    if scaled_act:
        assert scaled.dtype == dtype and scaled.shape == (rows, half)
        assert ulps_apart(scaled, expected_scaled).max() <= 0.51  # one rounding of an fp32 product
    else:
        assert scaled is None


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_flags_leave_the_gradient_alone(dtype, device):
    """Every flag combination gives the same d_gate_up, dots and scaled, bit for bit."""
    gate_up, g, weight = random_rows(37, 48, dtype, device, seed=2)
    results = [
        silu_mul_rows_backward(gate_up.clone(), g, weight, row_dot=r, scaled_act=s, in_place=i) for r, s, i in FLAGS
    ]
    full = results[-1]
    for (row_dot_on, scaled_act, _), (d_gate_up, dots, scaled) in zip(FLAGS, results):
        assert torch.equal(d_gate_up, full[0])
        if row_dot_on:
            assert torch.equal(dots, full[1])
        if scaled_act:
            assert torch.equal(scaled, full[2])


@pytest.mark.parametrize("rows, half", SHAPES[1:])
def test_backward_matches_torch_path(rows, half, device):
    """fp32 against the torch functions this replaces (silu_mul_backward, row_dot, scaled_rows)."""
    gate_up, g, weight = random_rows(rows, half, torch.float32, device, seed=3)
    d_gate_up, dots, scaled = silu_mul_rows_backward(gate_up, g, weight, row_dot=True, scaled_act=True, in_place=False)
    act = silu_mul(gate_up)
    torch.testing.assert_close(dots, row_dot(g, act), atol=1e-5, rtol=1e-5)
    assert ulps_apart(scaled, scaled_rows(act, weight[:, None], torch.float32)).max() <= FORWARD_ULPS[torch.float32] + 1
    expected = silu_mul_backward(gate_up, g.clone(), weight[:, None])  # it scales g in place in fp32
    torch.testing.assert_close(d_gate_up, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("in_place", [False, True])
def test_strided_rows(in_place, device):
    """gate_up as the first 2I columns of wider rows, g with a column stride, weights [S, 1]: as if contiguous, and
    in place only the view's columns are written."""
    rows, half = 7, 24
    gate_up, g, weight = random_rows(rows, half, torch.float32, device, seed=4)
    buffer = torch.full((rows, 2 * half + 5), 7.0, device=device)
    buffer[:, : 2 * half] = gate_up
    view = buffer[:, : 2 * half]
    g_strided = g.t().contiguous().t()
    assert silu_mul_rows_supported(view) and g_strided.stride(-1) != 1

    assert torch.equal(silu_mul_rows(view), silu_mul_rows(gate_up))
    expected = silu_mul_rows_backward(gate_up, g, weight, row_dot=True, scaled_act=True, in_place=False)
    actual = silu_mul_rows_backward(view, g_strided, weight[:, None], row_dot=True, scaled_act=True, in_place=in_place)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    if in_place:
        assert torch.equal(buffer[:, : 2 * half], expected[0])
    assert (buffer[:, 2 * half :] == 7.0).all()


def test_empty(device):
    for rows, half in [(0, 16), (3, 0)]:
        gate_up = torch.randn(rows, 2 * half, device=device)
        assert silu_mul_rows(gate_up).shape == (rows, half)
        g = torch.randn(rows, half, device=device)
        d_gate_up, dots, scaled = silu_mul_rows_backward(
            gate_up, g, torch.rand(rows, device=device), row_dot=True, scaled_act=True, in_place=False
        )
        assert d_gate_up.shape == (rows, 2 * half) and scaled.shape == (rows, half)
        assert torch.equal(dots, torch.zeros(rows, device=device))


def test_supported(device):
    x = torch.randn(4, 16, device=device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert silu_mul_rows_supported(x.to(dtype))
    assert not silu_mul_rows_supported(x.double())
    assert not silu_mul_rows_supported(x.to(torch.int32))
    assert not silu_mul_rows_supported(x[:, :15])  # odd columns
    assert not silu_mul_rows_supported(x.reshape(-1))
    assert not silu_mul_rows_supported(x.reshape(2, 2, 16))
    assert not silu_mul_rows_supported(x.reshape(16, 4).t())  # column stride 4
    with pytest.raises(ValueError, match="2-D fp16/bf16/fp32"):
        silu_mul_rows(x.double())
    with pytest.raises(ValueError, match="g of shape"):
        silu_mul_rows_backward(x, x, torch.rand(4, device=device), row_dot=False, scaled_act=False, in_place=False)
    with pytest.raises(ValueError, match="4 row weights"):
        silu_mul_rows_backward(x, x[:, :8], torch.rand(5), row_dot=False, scaled_act=False, in_place=False)


def test_cpu_without_interpreter_is_not_supported():
    """Without TRITON_INTERPRET at import the kernels are compiled ones: CPU tensors take the torch path."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_DSPINE_INTERPRET")}
    code = (
        "import torch\n"
        "from liger_dspine.ops.silu_mul_rows import silu_mul_rows, silu_mul_rows_supported\n"
        "x = torch.randn(4, 16)\n"
        "assert not silu_mul_rows_supported(x)\n"
        "try:\n"
        "    silu_mul_rows(x)\n"
        "except RuntimeError as e:\n"
        "    assert 'CPU tensor' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# CUDA: bf16 (wrong in the interpreter) and the fp32 bit-for-bit claim


@pytest.mark.cuda
@pytest.mark.parametrize("rows, half", [(37, 48), (300, 2048), (5, 3000)])
def test_cuda_fp32_matches_torch_bit_for_bit(rows, half):
    gate_up, g, weight = random_rows(rows, half, torch.float32, "cuda", seed=5)
    assert torch.equal(silu_mul_rows(gate_up), silu_mul(gate_up))
    d_gate_up, _, _ = silu_mul_rows_backward(gate_up, g, weight, row_dot=False, scaled_act=False, in_place=False)
    assert torch.equal(d_gate_up, silu_mul_backward(gate_up, g.clone(), weight[:, None]))


@pytest.mark.cuda
@pytest.mark.parametrize("rows, half", [(37, 48), (300, 2048), (5, 3000)])
@pytest.mark.parametrize("in_place", [False, True])
def test_cuda_bf16_matches_torch(rows, half, in_place):
    gate_up, g, weight = random_rows(rows, half, torch.bfloat16, "cuda", seed=6)
    act = silu_mul_rows(gate_up)
    expected_act = silu_mul(gate_up)
    assert ulps_apart(act, expected_act).max() <= 1  # the same fp32 value rounded once (equal in practice)

    expected_dots = row_dot(g, expected_act)
    expected_scaled = scaled_rows(expected_act, weight[:, None], torch.bfloat16)
    expected_grad = silu_mul_backward(gate_up, g, weight[:, None])
    d_gate_up, dots, scaled = silu_mul_rows_backward(
        gate_up.clone() if in_place else gate_up, g, weight, row_dot=True, scaled_act=True, in_place=in_place
    )
    assert ulps_apart(d_gate_up, expected_grad).max() <= 1
    assert ulps_apart(scaled, expected_scaled).max() <= 1
    torch.testing.assert_close(dots, expected_dots, atol=1e-3, rtol=1e-4)  # fp32 sums in another order
    # against float64: bf16 rounding of the gradient
    torch.testing.assert_close(d_gate_up.double(), autograd_reference(gate_up, g, weight), atol=1e-5, rtol=2**-8)


@pytest.mark.cuda
def test_cuda_rows_past_int32_offsets():
    """S * 2I > 2**31 elements: the last rows (whose offsets need int64) against torch on a copy of them."""
    half = 2048
    rows = 2**31 // (2 * half) + 3
    gate_up = torch.zeros(rows, 2 * half, dtype=torch.bfloat16, device="cuda")
    g = torch.zeros(rows, half, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(rows, device="cuda")
    tail_gate_up, tail_g, tail_weight = random_rows(5, half, torch.bfloat16, "cuda", seed=7)
    gate_up[-5:], g[-5:], weight[-5:] = tail_gate_up, tail_g, tail_weight

    assert torch.equal(silu_mul_rows(gate_up)[-5:], silu_mul_rows(tail_gate_up))
    expected = silu_mul_rows_backward(tail_gate_up, tail_g, tail_weight, row_dot=True, scaled_act=True, in_place=False)
    actual = silu_mul_rows_backward(gate_up, g, weight, row_dot=True, scaled_act=True, in_place=True)
    for a, e in zip(actual, expected):
        assert torch.equal(a[-5:], e)
