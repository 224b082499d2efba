"""The FP8 grouped GEMM's forward and gradients, group by group, against the dequantised and the exact float64
products (bounds derived in test_fp8_linear's docstring), with empty groups; and torch's layout checks of the CUDA
calls, run on fake CUDA tensors."""

import pytest
import torch
from test_fp8_linear import assert_fp8_gemm
from test_fp8_linear import assert_fp8_gemm_on_gpu
from torch._subclasses.fake_tensor import FakeTensorMode

from liger_dspine.ops.fp8_grouped_mm import GROUPED_FP8_CAPABILITIES
from liger_dspine.ops.fp8_grouped_mm import cuda_grouped_rows_mm
from liger_dspine.ops.fp8_grouped_mm import cuda_grouped_weight_grad
from liger_dspine.ops.fp8_grouped_mm import fp8_grouped_mm
from liger_dspine.ops.fp8_linear import check_fp8_device
from liger_dspine.ops.fp8_linear import cuda_scaled_mm
from liger_dspine.ops.fp8_quantize import quantize_columns
from liger_dspine.ops.fp8_quantize import quantize_columns_reference
from liger_dspine.ops.fp8_quantize import quantize_group_columns
from liger_dspine.ops.fp8_quantize import quantize_rowwise
from liger_dspine.ops.fp8_quantize import quantize_rowwise_reference


def inputs(counts, in_features, out_features, dtype, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    decades = torch.logspace(-5, 1, in_features)[torch.randperm(in_features, generator=generator)]
    x = torch.randn(rows, in_features, generator=generator) * decades
    weight = torch.randn(len(counts), out_features, in_features, generator=generator) / in_features**0.5
    grad = torch.randn(rows, out_features, generator=generator) * 1e-3
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x.to(device, dtype), weight.to(device, dtype), grad.to(device, dtype), offs.to(device)


def run(x, weight, grad, offs, need_x=True, need_weight=True):
    x = x.clone().requires_grad_(need_x)
    weight = weight.clone().requires_grad_(need_weight)
    out = fp8_grouped_mm(x, weight, offs)
    out.backward(grad)
    return out, x.grad, weight.grad


def check_groups(counts, x, weight, grad, out, grad_x, grad_weight, check):
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        w = weight[expert]
        if count:
            # y_e = x_e @ W_e.T: x per row over K, W_e per out-feature over K
            check(out[rows], x[rows], w, *quantize_rowwise_reference(x[rows]), *quantize_rowwise_reference(w))
            # dx_e = dy_e @ W_e: dy per row over N, W_e per in-feature over N
            qwt, swt = quantize_columns_reference(w)
            check(grad_x[rows], grad[rows], w.t(), *quantize_rowwise_reference(grad[rows]), qwt, swt)
        # dW_e = dy_e.T @ x_e: both per feature over the group's rows
        qgt, sgt = quantize_rowwise_reference(grad[rows].t())
        qxt, sxt = quantize_rowwise_reference(x[rows].t())
        check(grad_weight[expert], grad[rows].t(), x[rows].t(), qgt, sgt, qxt, sxt)
        if not count:
            assert (grad_weight[expert] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 17, 5], [0, 16, 0], [40]])
def test_forward_and_gradients(dtype, counts):
    x, weight, grad, offs = inputs(counts, 32, 16, dtype, seed=sum(counts))
    out, grad_x, grad_weight = run(x, weight, grad, offs)
    assert out.shape == (sum(counts), 16) and out.dtype == dtype
    assert grad_x.shape == x.shape and grad_x.dtype == dtype
    assert grad_weight.shape == weight.shape and grad_weight.dtype == dtype
    check_groups(counts, x, weight, grad, out, grad_x, grad_weight, assert_fp8_gemm)


def test_one_input_gradient_at_a_time():
    x, weight, grad, offs = inputs([5, 0, 12], 16, 32, torch.float32, seed=4)
    _, grad_x, grad_weight = run(x, weight, grad, offs)
    _, only_x, none_w = run(x, weight, grad, offs, need_weight=False)
    assert none_w is None and torch.equal(only_x, grad_x)
    _, none_x, only_w = run(x, weight, grad, offs, need_x=False)
    assert none_x is None and torch.equal(only_w, grad_weight)


def test_no_rows():
    x, weight, grad, offs = inputs([0, 0], 16, 16, torch.float32, seed=5)
    out, grad_x, grad_weight = run(x, weight, grad, offs)
    assert out.shape == (0, 16) and grad_x.shape == (0, 16)
    assert torch.equal(grad_weight, torch.zeros_like(weight))


def test_bad_inputs(monkeypatch):
    x, weight, _, offs = inputs([2, 3], 16, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match="liger-dspine: FP8 grouped GEMM needs x"):
        fp8_grouped_mm(x, weight[0], offs)
    with pytest.raises(ValueError, match="int32 cumulative row ends"):
        fp8_grouped_mm(x, weight, offs.long())
    with pytest.raises(ValueError, match="int32 cumulative row ends"):
        fp8_grouped_mm(x, weight, offs[:1])
    with pytest.raises(ValueError, match="multiples of 16.*'N': 8"):
        fp8_grouped_mm(x, weight[:, :8], offs)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(RuntimeError, match=r"compute capability 9.0 or 10.0\), got 8.9"):
        check_fp8_device(torch.device("cuda"), "FP8 grouped GEMM", GROUPED_FP8_CAPABILITIES)


def test_cuda_calls_pass_torch_layout_checks():
    """The CUDA branches' torch calls on fake CUDA tensors of the quantisers' layouts: torch's meta functions check
    dtypes, row- and column-major strides, 16-byte alignment, scale shapes and offsets, and give the output shape."""
    tokens, hidden, out_features, experts = 40, 64, 48, 4
    with FakeTensorMode():
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        weight = torch.empty(out_features, hidden, dtype=torch.bfloat16, device="cuda")
        grad = torch.empty(tokens, out_features, dtype=torch.bfloat16, device="cuda")
        # fp8_linear: forward, dx, dW
        assert cuda_scaled_mm(*quantize_rowwise(x), *quantize_rowwise(weight), torch.bfloat16).shape == (40, 48)
        assert cuda_scaled_mm(*quantize_rowwise(grad), *quantize_columns(weight), torch.bfloat16).shape == (40, 64)
        assert cuda_scaled_mm(*quantize_columns(grad), *quantize_columns(x), torch.bfloat16).shape == (48, 64)
        # fp8_grouped_mm: forward, dx (2-D x 3-D), dW (2-D x 2-D along the padded rows)
        experts_weight = torch.empty(experts, out_features, hidden, dtype=torch.bfloat16, device="cuda")
        offs = torch.empty(experts, dtype=torch.int32, device="cuda")
        q_w, s_w = quantize_rowwise(experts_weight.reshape(-1, hidden))
        q_w, s_w = q_w.view(experts, out_features, hidden), s_w.view(experts, out_features)
        out = cuda_grouped_rows_mm(*quantize_rowwise(x), q_w, s_w, offs)
        assert out.shape == (tokens, out_features) and out.dtype == torch.bfloat16
        grad_x = cuda_grouped_rows_mm(*quantize_rowwise(grad), *quantize_columns(experts_weight), offs)
        assert grad_x.shape == (tokens, hidden)
        q_gt, s_gt, padded_offs = quantize_group_columns(grad, offs)
        q_xt, s_xt, _ = quantize_group_columns(x, offs)
        grad_w = cuda_grouped_weight_grad(q_gt, s_gt, q_xt, s_xt, padded_offs)
        assert grad_w.shape == (experts, out_features, hidden) and grad_w.dtype == torch.bfloat16
        # and they do check: a row-major mat_b (the transpose of what the quantiser writes) is refused
        square = torch.empty(experts, hidden, hidden, dtype=torch.float8_e4m3fn, device="cuda")
        with pytest.raises(RuntimeError, match="column major"):
            cuda_grouped_rows_mm(
                *quantize_rowwise(x), square.transpose(-2, -1), torch.empty(experts, hidden, device="cuda"), offs
            )


@pytest.mark.cuda
def test_scaled_grouped_mm_matches_the_reference_on_cuda():
    """torch._scaled_grouped_mm (bf16 out) at DeepSeek-V3 widths, 8 experts of uneven sizes including empty ones,
    against the dequantised and exact float64 products (bounds of assert_fp8_gemm_on_gpu)."""
    counts = [700, 0, 1, 1500, 16, 900, 0, 979]
    x, weight, grad, offs = inputs(counts, 7168, 2048, torch.bfloat16, seed=0, device="cuda")
    out, grad_x, grad_weight = run(x, weight, grad, offs)
    check_groups(counts, x, weight, grad, out, grad_x, grad_weight, assert_fp8_gemm_on_gpu)
