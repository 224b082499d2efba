"""SwiGLU fused with the down projection (and LigerSwiGLUMLP on it) against eager ``F.linear(F.silu(a) * b, W)``.

CPU: fp32 through Triton's interpreter, tiny shapes. Tolerance 1e-5: the GEMMs are torch's own on both sides, and
only the SiLU (Triton's sigmoid against torch's) and the order of the SiLU gradient's terms differ, by fp32 ulps.
CUDA: fp32 at tolerance 1e-4 (the same differences, summed over more rows); bf16 no further from an fp32 reference
than twice the eager bf16 composition, plus 2**-10 of the reference's largest magnitude (as test_module_parity).
"""

import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from liger_kernel.ops import LigerSiLUMulFunction
from torch import nn

from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.ops.swiglu_down import liger_swiglu_down

FP32 = dict(atol=1e-5, rtol=1e-5)
HIDDEN = 16

# leading shape, intermediate width: 2-D and 3-D inputs, one row, no rows, widths that are not powers of two
SHAPES = [((5,), 32), ((2, 3), 40), ((1,), 24), ((2, 1, 3), 64), ((0,), 24)]


def eager_swiglu_down(gate, up, down_weight):
    return F.linear(F.silu(gate) * up, down_weight)


def random_inputs(lead, width, hidden=HIDDEN, seed=0, device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    gate = 2.0 * torch.randn(*lead, width, generator=generator)
    up = torch.randn(*lead, width, generator=generator)
    weight = torch.randn(hidden, width, generator=generator) / width**0.5
    grad_out = torch.randn(*lead, hidden, generator=generator)
    return [t.to(device=device, dtype=dtype) for t in (gate, up, weight, grad_out)]


def op_results(fn, gate, up, weight, grad_out, needs_grad=(True, True, True)):
    """(output, [grads of gate, up, weight]) of ``fn(gate, up, weight)``; None where no grad is asked."""
    leaves = [t.detach().clone().requires_grad_(rg) for t, rg in zip((gate, up, weight), needs_grad)]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def assert_op_close(actual, expected, **tolerance):
    torch.testing.assert_close(actual[0], expected[0], **tolerance)
    for name, grad, ref in zip(("gate", "up", "weight"), actual[1], expected[1]):
        if ref is None:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, ref, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lead, width", SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_matches_eager(lead, width, in_place):
    gate, up, weight, grad_out = random_inputs(lead, width)
    given = grad_out.clone()
    actual = op_results(lambda a, b, w: liger_swiglu_down(a, b, w, in_place=in_place), gate, up, weight, given)
    expected = op_results(eager_swiglu_down, gate, up, weight, grad_out)
    assert actual[0].shape == (*lead, HIDDEN)
    assert_op_close(actual, expected, **FP32)
    assert torch.equal(given, grad_out), "the backward wrote into the incoming gradient"


@pytest.mark.parametrize("needs_grad", [c for c in itertools.product([True, False], repeat=3) if any(c)])
def test_grads_only_where_asked(needs_grad):
    gate, up, weight, grad_out = random_inputs((2, 3), 40, seed=1)
    actual = op_results(liger_swiglu_down, gate, up, weight, grad_out, needs_grad)
    expected = op_results(eager_swiglu_down, gate, up, weight, grad_out, needs_grad)
    assert_op_close(actual, expected, **FP32)


def graph_inputs(lead=(2, 3), width=40, seed=2):
    """gate and up as results of the graph (as in the MLP), from leaves ``(g, u)``: gate = 1.5 g, up = u + 1."""
    gate, up, weight, grad_out = random_inputs(lead, width, seed=seed)
    g, u, w = (t.clone().requires_grad_() for t in (gate, up, weight))
    return g, u, w, grad_out


@pytest.mark.parametrize("in_place", [False, True])
def test_graph_intermediates(in_place):
    """gate and up computed in the graph: gradients flow through; without in_place they keep their values."""
    g, u, w, grad_out = graph_inputs()
    gate, up = 1.5 * g, u + 1.0
    gate_before, up_before = gate.detach().clone(), up.detach().clone()
    liger_swiglu_down(gate, up, w, in_place=in_place).backward(grad_out)
    actual = [t.grad for t in (g, u, w)]

    ref = [t.detach().clone().requires_grad_() for t in (g, u, w)]
    eager_swiglu_down(1.5 * ref[0], ref[1] + 1.0, ref[2]).backward(grad_out)
    for grad, leaf in zip(actual, ref):
        torch.testing.assert_close(grad, leaf.grad, **FP32)
    if not in_place:
        assert torch.equal(gate, gate_before) and torch.equal(up, up_before)


def test_strided_inputs_are_not_overwritten():
    """gate and up as column slices of one buffer (copied for the kernels): the buffer keeps its values."""
    g, _, w, grad_out = graph_inputs(width=40)
    fused = torch.cat([g, 0.5 * g], dim=-1)  # [2, 3, 80]
    before = fused.detach().clone()
    liger_swiglu_down(fused[..., :40], fused[..., 40:], w, in_place=True).backward(grad_out)
    assert torch.equal(fused, before)

    ref_g, ref_w = g.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    eager_swiglu_down(ref_g, 0.5 * ref_g, ref_w).backward(grad_out)
    torch.testing.assert_close(g.grad, ref_g.grad, **FP32)
    torch.testing.assert_close(w.grad, ref_w.grad, **FP32)


def test_gate_is_up():
    """One tensor as gate and up: silu(a) * a, gradients summed."""
    g, _, w, grad_out = graph_inputs(width=24)
    a = 1.5 * g
    liger_swiglu_down(a, a, w, in_place=True).backward(grad_out)
    ref_g, ref_w = g.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_a = 1.5 * ref_g
    eager_swiglu_down(ref_a, ref_a, ref_w).backward(grad_out)
    torch.testing.assert_close(g.grad, ref_g.grad, **FP32)
    torch.testing.assert_close(w.grad, ref_w.grad, **FP32)


def test_retain_graph():
    g, u, w, grad_out = graph_inputs()
    out = liger_swiglu_down(1.5 * g, u + 1.0, w)
    out.backward(grad_out, retain_graph=True)
    first = [t.grad.clone() for t in (g, u, w)]
    out.backward(grad_out)
    for grad, once in zip((g.grad, u.grad, w.grad), first):
        torch.testing.assert_close(grad, 2.0 * once, **FP32)

    # in place, the saved gate and up hold gradients after the first backward: a second one must refuse
    out = liger_swiglu_down(1.5 * g, u + 1.0, w, in_place=True)
    out.backward(grad_out, retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        out.backward(grad_out)


def test_autocast_dtypes():
    """Under autocast the GEMMs run in its dtype (output bf16) and the weight gradient comes back in fp32."""
    gate, up, weight, grad_out = random_inputs((2, 3), 40, seed=3)
    results = []
    for fn in (liger_swiglu_down, eager_swiglu_down):
        leaves = [t.clone().requires_grad_() for t in (gate, up, weight)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        results.append((out, [t.grad for t in leaves]))
    (out, grads), (ref_out, ref_grads) = results
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [g.dtype for g in ref_grads] == [torch.float32] * 3
    # the same bf16 GEMMs on both sides; an fp32 ulp of silu(a) * b may round to a neighbouring bf16 value
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=2e-2, rtol=2e-2)


def test_bad_inputs():
    gate, up, weight, _ = random_inputs((2, 3), 40)
    with pytest.raises(ValueError, match="one shape"):
        liger_swiglu_down(gate, up[..., :32], weight)
    with pytest.raises(ValueError, match="must match"):
        liger_swiglu_down(gate, up.double(), weight)
    with pytest.raises(ValueError, match=r"\[H, 40\]"):
        liger_swiglu_down(gate, up, weight.t())
    with pytest.raises(ValueError, match="weight is torch.float64"):
        liger_swiglu_down(gate, up, weight.double())


# LigerSwiGLUMLP on the fused op


def mlp_config(width=40):
    return types.SimpleNamespace(hidden_size=HIDDEN, intermediate_size=width, hidden_act="silu")


def make_mlp(width=40, seed=0):
    torch.manual_seed(seed)
    return LigerSwiGLUMLP(mlp_config(width))


def eager_mlp(mlp, x):
    return F.linear(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)


def mlp_results(mlp, forward, x, grad_out, x_needs_grad=True):
    x = x.detach().clone().requires_grad_(x_needs_grad)
    mlp.zero_grad(set_to_none=True)
    out = forward(mlp, x)
    out.backward(grad_out)
    return out.detach(), x.grad, {name: p.grad for name, p in mlp.named_parameters()}


def assert_mlp_close(actual, expected, **tolerance):
    torch.testing.assert_close(actual[0], expected[0], **tolerance)
    torch.testing.assert_close(actual[1], expected[1], **tolerance)
    assert actual[2].keys() == expected[2].keys()
    for name, ref in expected[2].items():
        if ref is None:
            assert actual[2][name] is None, name
        else:
            torch.testing.assert_close(actual[2][name], ref, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lead, width", [((2, 3), 40), ((5,), 32)])
def test_mlp_matches_eager(lead, width):
    mlp = make_mlp(width)
    x, grad_out = torch.randn(*lead, HIDDEN), torch.randn(*lead, HIDDEN)
    assert_mlp_close(
        mlp_results(mlp, nn.Module.__call__, x, grad_out), mlp_results(mlp, eager_mlp, x, grad_out), **FP32
    )


# which parameters are frozen, and whether x needs a gradient
FROZEN = {
    "down": (("down_proj",), True),
    "gate_up": (("gate_proj", "up_proj"), True),
    "gate_up_no_x": (("gate_proj", "up_proj"), False),
    "gate_down": (("gate_proj", "down_proj"), True),
}


@pytest.mark.parametrize("frozen", FROZEN.values(), ids=FROZEN.keys())
def test_mlp_frozen_weights(frozen):
    names, x_needs_grad = frozen
    mlp = make_mlp(seed=1)
    for name in names:
        getattr(mlp, name).weight.requires_grad_(False)
    x, grad_out = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    actual = mlp_results(mlp, nn.Module.__call__, x, grad_out, x_needs_grad)
    expected = mlp_results(mlp, eager_mlp, x, grad_out, x_needs_grad)
    assert_mlp_close(actual, expected, **FP32)
    assert {n for n, g in actual[2].items() if g is None} == {f"{n}.weight" for n in names}


def test_mlp_accumulates_gradients():
    """Two forward-backward passes add into .grad: twice one pass, for inputs and every weight."""
    mlp = make_mlp(seed=2)
    x, grad_out = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    _, x_grad, once = mlp_results(mlp, nn.Module.__call__, x, grad_out)
    x = x.clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    for _ in range(2):
        mlp(x).backward(grad_out)
    torch.testing.assert_close(x.grad, 2.0 * x_grad, **FP32)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, 2.0 * once[name], **FP32, msg=lambda m: f"{name}: {m}")


def test_mlp_hooked_projection_output_kept():
    """A forward hook that keeps the gate projection's output sees it unchanged after the backward."""
    mlp = make_mlp(seed=3)
    kept = []
    mlp.gate_proj.register_forward_hook(lambda module, args, out: kept.append(out))
    x, grad_out = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    expected = mlp_results(mlp, eager_mlp, x, grad_out)
    kept.clear()
    actual = mlp_results(mlp, nn.Module.__call__, x, grad_out)
    assert_mlp_close(actual, expected, **FP32)
    torch.testing.assert_close(kept[0], mlp.gate_proj(x), **FP32)


class DoubledLinear(nn.Linear):
    """A down_proj with a forward of its own (as LoRA or quantised layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def test_mlp_custom_down_proj_runs_its_forward():
    mlp = make_mlp(seed=4)
    doubled = DoubledLinear(mlp.intermediate_size, HIDDEN, bias=False)
    doubled.load_state_dict(mlp.down_proj.state_dict())
    mlp.down_proj = doubled
    x, grad_out = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    expected = mlp_results(mlp, lambda m, x: 2.0 * eager_mlp(m, x), x, grad_out)
    assert_mlp_close(mlp_results(mlp, nn.Module.__call__, x, grad_out), expected, **FP32)


def test_mlp_refuses_down_proj_bias():
    mlp = make_mlp()
    mlp.down_proj = nn.Linear(mlp.intermediate_size, HIDDEN, bias=True)
    with pytest.raises(ValueError, match="bias"):
        mlp(torch.randn(2, HIDDEN))


def test_mlp_state_dict_unchanged():
    mlp = make_mlp()
    assert list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_output_is_a_tensor_of_its_own(lead):
    """Not a view of a tensor made inside the op: torch 2.11's compile turned such a view, returned at a graph break,
    into a fake tensor of its base's shape ([B * S, H] for [B, S, H])."""
    gate, up, weight, _ = random_inputs(lead, 24)
    gate, up, weight = (t.requires_grad_() for t in (gate, up, weight))
    out = liger_swiglu_down(gate * 1.0, up * 1.0, weight, in_place=True)
    assert out._base is None and out.shape == (*lead, HIDDEN)


def test_mlp_under_torch_compile_keeps_the_eager_numbers():
    """The op runs outside the graph (a graph break on each side); compiled code reads its output and feeds it its
    gradient. 3-D input, so the output reaches the next graph as a [B, S, H] tensor."""
    mlp = make_mlp(seed=5)
    x, grad_out = torch.randn(2, 3, HIDDEN), torch.randn(2, 3)

    def block(mlp, x):
        return (x + mlp(2.0 * x)).square().sum(-1)

    expected = mlp_results(mlp, block, x, grad_out)
    torch._dynamo.reset()
    actual = mlp_results(mlp, torch.compile(block), x, grad_out)
    assert_mlp_close(actual, expected, **FP32)


# Memory: what one forward keeps for the backward


def saved_activations(forward, mlp, x, tokens, width):
    """Distinct storages of the [tokens, width]-sized tensors autograd saves during ``forward(mlp, x)``,
    with the storages of the gate and up projections' outputs."""
    saved, projections = [], []
    handles = [
        p.register_forward_hook(lambda m, args, out: projections.append(out)) for p in (mlp.gate_proj, mlp.up_proj)
    ]

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(mlp, x)
    for handle in handles:
        handle.remove()
    activations = {t.untyped_storage().data_ptr() for t in saved if t.numel() == tokens * width}
    gate_up = {t.untyped_storage().data_ptr() for t in projections}
    return out, activations, gate_up


def old_composition(mlp, x):
    return mlp.down_proj(LigerSiLUMulFunction.apply(mlp.gate_proj(x), mlp.up_proj(x)))


def test_mlp_does_not_save_the_product():
    width, lead = 40, (2, 3)  # 6 tokens: no weight has 6 * 40 elements
    tokens = 6
    mlp = make_mlp(width)
    x = torch.randn(*lead, HIDDEN, requires_grad=True)

    old_out, old_saved, old_gate_up = saved_activations(old_composition, mlp, x, tokens, width)
    assert len(old_gate_up) == 2 and old_gate_up < old_saved
    assert len(old_saved) == 3  # gate, up and silu(gate) * up

    new_out, new_saved, new_gate_up = saved_activations(nn.Module.__call__, mlp, x, tokens, width)
    assert new_saved == new_gate_up and len(new_saved) == 2  # gate and up only
    torch.testing.assert_close(new_out, old_out, **FP32)


# CUDA


def bf16_error_within(actual, eager_bf16, reference, what):
    reference = reference.float()
    err = (actual.float() - reference).abs().max().item()
    eager_err = (eager_bf16.float() - reference).abs().max().item()
    floor = 2.0**-10 * reference.abs().max().item()
    assert err <= 2.0 * eager_err + floor, f"{what}: fused error {err:.3g}, eager bf16 error {eager_err:.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("lead, width", [((4, 512), 2816), ((2048,), 4096), ((3, 333), 1408)])
def test_matches_eager_fp32_cuda(lead, width):
    gate, up, weight, grad_out = random_inputs(lead, width, hidden=1024, device="cuda")
    actual = op_results(liger_swiglu_down, gate, up, weight, grad_out)
    expected = op_results(eager_swiglu_down, gate, up, weight, grad_out)
    assert_op_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("lead, width", [((4, 512), 2816), ((2048,), 4096), ((3, 333), 1408)])
def test_matches_eager_bf16_cuda(lead, width):
    inputs = random_inputs(lead, width, hidden=1024, device="cuda", dtype=torch.bfloat16)
    actual = op_results(liger_swiglu_down, *inputs)
    eager = op_results(eager_swiglu_down, *inputs)
    reference = op_results(eager_swiglu_down, *[t.float() for t in inputs])
    bf16_error_within(actual[0], eager[0], reference[0], "output")
    for name, grad, eager_grad, ref in zip(("gate", "up", "weight"), actual[1], eager[1], reference[1]):
        assert grad.dtype == torch.bfloat16
        bf16_error_within(grad, eager_grad, ref, f"{name} grad")


@pytest.mark.cuda
def test_mlp_keeps_one_activation_less_cuda():
    """Memory held after the forward: the old composition's minus the fused op's is the product's size."""
    width, tokens = 2816, 4096
    mlp = make_mlp(width).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    held = []
    for forward in (old_composition, nn.Module.__call__):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = forward(mlp, x)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        out.sum().backward()
        del out
    product_bytes = tokens * width * 2
    assert held[0] - held[1] >= 0.99 * product_bytes, held
