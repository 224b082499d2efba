"""The clamped SiLU-mul (DeepSeek-V4's ``swiglu_limit``) against transformers' eager formula in fp32:
``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``, differentiated by torch's autograd.

Gate and up straddle the limit, and some entries sit exactly on it, where torch's clamp passes the gradient. Both the
Triton row kernels (through the interpreter on a CPU) and the torch path of ``ops/grouped_experts.py`` are checked,
and the grouped experts with a limit against a per-expert loop of transformers' ``DeepseekV4Experts`` math.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.ops.grouped_experts import liger_grouped_experts
from liger_dspine.ops.grouped_experts import silu_mul
from liger_dspine.ops.grouped_experts import silu_mul_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_backward

LIMIT = 1.5
FORWARD_ULPS = 4  # NumPy's exponential in the interpreter against torch's (see test_silu_mul_rows.py)


def clamped_rows(rows, half, seed=0):
    """gate ~ 3 N(0, 1), up ~ 2 N(0, 1) (a third to a half beyond the limit), some entries exactly on +-limit;
    g ~ N(0, 1), routing weights in [0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    gate = 3.0 * torch.randn(rows, half, generator=generator)
    up = 2.0 * torch.randn(rows, half, generator=generator)
    gate[:, 0], up[:, 0], up[:, -1] = LIMIT, LIMIT, -LIMIT
    g = torch.randn(rows, half, generator=generator)
    weight = torch.rand(rows, generator=generator)
    return torch.cat([gate, up], dim=1), g, weight


def eager(gate_up, g, weight):
    """transformers' clamped SwiGLU in fp32: (act, d gate_up of sum(weight * g * act))."""
    half = gate_up.shape[1] // 2
    x = gate_up.clone().requires_grad_()
    gate = x[:, :half].clamp(max=LIMIT)
    up = x[:, half:].clamp(min=-LIMIT, max=LIMIT)
    act = F.silu(gate) * up
    (act * (weight[:, None] * g)).sum().backward()
    return act.detach(), x.grad


def ulps_apart(actual, expected):
    _, exponent = torch.frexp(expected.double().abs())
    spacing = torch.ldexp(torch.full_like(expected, torch.finfo(torch.float32).eps, dtype=torch.float64), exponent - 1)
    return (actual.double() - expected.double()).abs() / spacing.clamp_min(1e-45)


def assert_clamped_gradient(d_gate_up, gate_up, expected):
    """Within fp32 roundings of autograd's, and exactly 0 where a value was clamped (not on the bound itself)."""
    half = gate_up.shape[1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    torch.testing.assert_close(d_gate_up, expected, atol=1e-5, rtol=1e-5)
    assert (d_gate_up[:, :half][gate > LIMIT] == 0).all() and (d_gate_up[:, half:][up.abs() > LIMIT] == 0).all()
    assert (d_gate_up[:, :half][gate > LIMIT].numel() > 0) and (up.abs() > LIMIT).any()
    assert (d_gate_up[:, 0] != 0).all() and (d_gate_up[:, half] != 0).all()  # gate, up exactly on the limit


@pytest.mark.parametrize("rows, half", [(1, 8), (37, 48), (5, 3000)])
def test_kernel_forward_matches_eager(rows, half, device):
    gate_up, g, weight = clamped_rows(rows, half)
    expected, _ = eager(gate_up, g, weight)
    act = silu_mul_rows(gate_up.to(device), LIMIT).cpu()
    assert ulps_apart(act, expected).max() <= FORWARD_ULPS
    assert torch.equal(silu_mul(gate_up, LIMIT), expected)  # the torch path computes transformers' formula


@pytest.mark.parametrize("rows, half", [(1, 8), (37, 48)])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernel_backward_matches_eager(rows, half, in_place, device):
    gate_up, g, weight = clamped_rows(rows, half, seed=1)
    expected_act, expected = eager(gate_up, g, weight)
    target = gate_up.to(device, copy=True)
    d_gate_up, dots, scaled = silu_mul_rows_backward(
        target, g.to(device), weight.to(device), row_dot=True, scaled_act=True, in_place=in_place, limit=LIMIT
    )
    assert (d_gate_up is target) is in_place
    assert_clamped_gradient(d_gate_up.cpu(), gate_up, expected)
    act = silu_mul_rows(gate_up.to(device), LIMIT).cpu()  # the backward reuses the forward's activation
    torch.testing.assert_close(dots.cpu(), (g * act).sum(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scaled.cpu(), weight[:, None] * expected_act, atol=1e-6, rtol=1e-5)


def test_torch_path_backward_matches_eager():
    gate_up, g, weight = clamped_rows(37, 48, seed=2)
    _, expected = eager(gate_up, g, weight)
    assert_clamped_gradient(silu_mul_backward(gate_up, g.clone(), weight[:, None], LIMIT), gate_up, expected)


def test_a_limit_beyond_every_value_changes_no_bit(device):
    gate_up, g, weight = (t.to(device) for t in clamped_rows(37, 48, seed=3))
    assert torch.equal(silu_mul_rows(gate_up, 1e30), silu_mul_rows(gate_up))
    clamped = silu_mul_rows_backward(gate_up, g, weight, row_dot=True, scaled_act=True, in_place=False, limit=1e30)
    plain = silu_mul_rows_backward(gate_up, g, weight, row_dot=True, scaled_act=True, in_place=False)
    assert all(torch.equal(a, b) for a, b in zip(clamped, plain))


def experts_reference(x, index, weights, gate_up_proj, down_proj):
    """DeepseekV4Experts' loop: per expert, clamp, SiLU-mul, down projection, routing weight, summed per token."""
    out = torch.zeros_like(x)
    for expert in range(gate_up_proj.shape[0]):
        token, slot = torch.where(index == expert)
        gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
        act = F.silu(gate.clamp(max=LIMIT)) * up.clamp(min=-LIMIT, max=LIMIT)
        out.index_add_(0, token, F.linear(act, down_proj[expert]) * weights[token, slot, None])
    return out


def test_grouped_experts_with_a_limit_match_eager(device):
    generator = torch.Generator().manual_seed(4)
    tokens, hidden, inter, experts, top_k = 6, 8, 6, 3, 2
    x = torch.randn(tokens, hidden, generator=generator)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    gate_up_proj = torch.randn(experts, 2 * inter, hidden, generator=generator)  # gate / up values of a few units
    down_proj = torch.randn(experts, hidden, inter, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
    expected = experts_reference(leaves[0], index, *leaves[1:])
    grad = torch.randn(expected.shape, generator=generator)
    expected_grads = torch.autograd.grad(expected, leaves, grad)

    ours = [t.to(device).requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
    out = liger_grouped_experts(ours[0], index.to(device), *ours[1:], limit=LIMIT)
    grads = torch.autograd.grad(out, ours, grad.to(device))
    torch.testing.assert_close(out.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for actual, reference in zip(grads, expected_grads):
        torch.testing.assert_close(actual.cpu(), reference, atol=1e-5, rtol=1e-5)
    unclamped = liger_grouped_experts(ours[0], index.to(device), *ours[1:])
    assert not torch.allclose(unclamped, out)  # the limit is reached at these widths
