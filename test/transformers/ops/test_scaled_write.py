"""The spine's lean write and feature (ops/scaled_write.py) against the torch expressions of AdjacentInjection, and
gradcheck in fp64. The write's kernels run for fp32 / fp16 (through the interpreter on a CPU); fp64 takes the torch
expressions."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.ops.scaled_write import liger_scaled_write
from liger_dspine.ops.scaled_write import liger_unit_feature


def native_write(states, message, weight):
    scale = torch.linalg.vector_norm(states.float(), dim=-1, keepdim=True) / math.sqrt(states.shape[-1])
    return states + scale.to(states.dtype) * F.linear(message, weight)


def native_feature(projected, scale):
    return (scale * F.normalize(projected.float(), dim=-1, eps=1e-12)).to(projected.dtype)


def grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    upstream = upstream.to(device=out.device, dtype=out.dtype)
    (out * upstream).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def write_inputs(dtype, zero_row=True):
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 3, 5, 64, generator=generator)
    if zero_row:
        states[0, 1, 2] = 0.0  # rms 0: finite, no gradient through the norm
    message = torch.randn(2, 3, 5, 8, generator=generator)
    weight = torch.randn(64, 8, generator=generator) * 0.1
    return states.to(dtype), message.to(dtype), weight.to(dtype)


def test_write_matches_the_torch_expression():
    states, message, weight = write_inputs(torch.float32)
    out, (d_states, d_message, d_weight) = grads(liger_scaled_write, states, message, weight)
    ref, (r_states, r_message, r_weight) = grads(native_write, states, message, weight)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for got, expected in ((d_states, r_states), (d_message, r_message), (d_weight, r_weight)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(d_states).all()


@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 5, 48), (7, 200)])
def test_write_kernels_round_as_the_torch_expression_half(device, shape):
    """fp16 (bf16 on a GPU) states, message and weight: the same fp32 RMS, each product and sum rounded once to the
    half dtype, so the output and d delta match the torch expression to the last bit but for an RMS whose fp32
    sum rounds the other way; the GEMM gradients follow."""
    half = torch.bfloat16 if device == "cuda" else torch.float16
    generator = torch.Generator().manual_seed(7)
    states = torch.randn(*shape, generator=generator)
    message = torch.randn(*shape[:-1], 8, generator=generator)
    weight = torch.randn(shape[-1], 8, generator=generator) * 0.1
    states, message, weight = (t.to(device=device, dtype=half) for t in (states, message, weight))
    out, (d_states, d_message, d_weight) = grads(liger_scaled_write, states, message, weight)
    ref, (r_states, r_message, r_weight) = grads(native_write, states, message, weight)
    assert out.dtype == half and d_states.dtype == half
    eps = torch.finfo(half).eps
    torch.testing.assert_close(out, ref, atol=4 * eps, rtol=2 * eps)
    for got, expected in ((d_states, r_states), (d_message, r_message), (d_weight, r_weight)):
        torch.testing.assert_close(got.float(), expected.float(), atol=8 * eps, rtol=8 * eps)


def test_write_of_broadcast_states_matches():
    """States expanded over a dim (stride 0), as the transition scores pass them: the gradient sums over it."""
    generator = torch.Generator().manual_seed(9)
    states = torch.randn(4, 1, 32, generator=generator).expand(4, 3, 32)
    message = torch.randn(4, 3, 8, generator=generator)
    weight = torch.randn(32, 8, generator=generator) * 0.1
    out, (d_states, d_message, d_weight) = grads(liger_scaled_write, states, message, weight)
    ref, (r_states, r_message, r_weight) = grads(native_write, states, message, weight)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for got, expected in ((d_states, r_states), (d_message, r_message), (d_weight, r_weight)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_write_gradcheck_fp64():
    states, message, weight = (t.requires_grad_(True) for t in write_inputs(torch.float64, zero_row=False))
    assert torch.autograd.gradcheck(liger_scaled_write, (states, message, weight))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # fp16: c / eps times the gradient is inf in both
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_feature_matches_the_torch_expression(dtype):
    generator = torch.Generator().manual_seed(1)
    projected = torch.randn(4, 7, 32, generator=generator)
    projected[1, 3] = 0.0  # below eps: a plain scaling, as F.normalize
    out, (grad,) = grads(lambda p: liger_unit_feature(p, math.sqrt(32)), projected.to(dtype))
    ref, (ref_grad,) = grads(lambda p: native_feature(p, math.sqrt(32)), projected.to(dtype))
    # half dtypes: the same fp32 values rounded once, but for a norm whose fp32 sum rounds the other way (one step)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(out, ref, **tolerance)
    grad_tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(grad.float(), ref_grad.float(), **grad_tolerance)


def test_feature_gradcheck_fp64():
    projected = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: liger_unit_feature(p, 4.0), (projected,))


def test_write_keeps_no_fp32_copy_nor_delta():
    """Saved for the backward: the states, the message, the weight and the [.., 1] RMS, nothing of [N, H] else."""
    states, message, weight = write_inputs(torch.bfloat16)
    states.requires_grad_(True)
    weight.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        liger_scaled_write(states, message, weight)
    big = [t for t in saved if t.numel() >= states.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() == states.data_ptr()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        native_write(states, message, weight)
    assert sum(t.numel() >= states.numel() for t in saved) > 1  # the torch expression keeps more


def test_write_under_autocast_matches_the_torch_expression():
    """fp32 states and weights under bf16 autocast (mixed-precision training): the GEMM runs in bf16 in both, the
    backward recomputes it in that dtype, and the gradients come back in each input's dtype."""
    states, message, weight = write_inputs(torch.float32, zero_row=False)
    message = message.bfloat16()  # as the injection's gated message comes out of autocast's Linear

    def under_autocast(fn):  # the forward under autocast, the backward outside it, as recommended for training
        def run(*tensors):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*tensors)

        return run

    out, (d_states, d_message, d_weight) = grads(under_autocast(liger_scaled_write), states, message, weight)
    ref, (r_states, r_message, r_weight) = grads(under_autocast(native_write), states, message, weight)
    assert out.dtype == ref.dtype == torch.float32
    assert (d_states.dtype, d_message.dtype, d_weight.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)  # the same bf16 delta, the same fp32 sum
    # bf16 GEMMs of the gradients in both; only their operands' last-bit rounding may differ
    for got, expected in ((d_states, r_states), (d_message, r_message), (d_weight, r_weight)):
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
