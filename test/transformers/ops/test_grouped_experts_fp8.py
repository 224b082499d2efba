"""The grouped experts op with ``fp8=True``: output and the four gradients against two references.

(a) A dequantised reference that walks the op's chain expert by expert (gate/up GEMM, SiLU-mul, down GEMM,
    weighted slot sum; backward grad_out @ down_proj, the routing-weight dots, the SiLU-mul derivative, the two
    weight gradients over the group's rows and the input gradient) in fp64, quantising each GEMM operand where the op
    does: its own value rounded to fp32, through the reference quantiser (bit-identical to the op's kernels), then
    dequantised. Every value carries an elementwise bound on the op's distance from it. A GEMM a @ b.T with operand
    bounds e_a, e_b adds, over its contraction length L,

        e_a |b|.T + |a| e_b.T + e_a e_b.T            (the operands' errors)
        + (L + 2) 2^-24 (|a| + e_a)(|b| + e_b).T     (fp32 sums of exact fp8 products, two fp32 scalings)

    and storing a value in fp32 half an ulp of |value| + bound. SiLU-mul propagates through |silu'| <= 1.1 and
    |silu''| <= 0.5 (clamps are 1-Lipschitz; where a value lies within its bound of a clamp, its gradient may be
    either side's), fp32 elementwise math adds 2^-20 of the magnitude, a slot sum (K + 1) 2^-24 of it. Quantising an
    operand whose op value lies within e of the reference's gives the same fp8 values (unless an element sits within
    e of an e4m3 rounding point, which these seeds avoid) and a scale, amax / 448, off by at most max(e) / amax
    relative (amax is 1-Lipschitz) plus 4 fp32 ulps. The bounds stay below 2^-12 of the largest magnitude, while a
    quantisation placed elsewhere than in the op moves values by up to 2^-4.

(b) The fp8=False op, norm-wise. Worst-case elementwise propagation over the chain's 4 to 6 quantised operands gives
    bounds larger than the values, so this is a model of the quantisation errors: each operand's elements are off by
    at most half an e4m3 ulp, 2^-4 relative, and taken as uniform in that range, a relative RMS error of 2^-4 / sqrt(3)
    per operand; independent operands add in quadrature along the chain, through gains of about 1 (random weights,
    |silu'| <= 1.1). The tolerance on the relative Frobenius error is that sum times 4 (the gains' allowance: the
    routing-weight dots cancel, at twice the model on these inputs), plus 2^-6 for bf16 stores on either side:

        || fp8 - plain ||_F <= (4 sqrt(m) 2^-4 / sqrt(3) + bf16 2^-6) || plain ||_F,   m = quantised operands upstream

    m = 4 for the output (x, gate_up_proj, act, down_proj), the routing-weight and the down_proj gradients (grad_out,
    down_proj or act, and act's two); 6 for the hidden-states and gate_up_proj gradients (d gate_up from grad_out,
    down_proj, x, gate_up_proj; then d gate_up and x or gate_up_proj). Under a clamp these two gradients jump where a
    gate or up value crosses it (the derivative's mask), which the model does not cover: there only (a) checks them.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from liger_dspine.modules.grouped_experts import LigerGroupedExperts
from liger_dspine.ops import fp8_expert_groups
from liger_dspine.ops import grouped_experts as ops
from liger_dspine.ops.fp8_expert_groups import check_fp8_experts
from liger_dspine.ops.fp8_grouped_mm import cuda_grouped_rows_mm
from liger_dspine.ops.fp8_grouped_mm import cuda_grouped_weight_grad
from liger_dspine.ops.fp8_quantize import quantize_group_columns
from liger_dspine.ops.fp8_quantize import quantize_rowwise
from liger_dspine.ops.fp8_quantize import quantize_rowwise_reference
from tiny_models import tiny_deepseek_v3_config

FP32_UNIT = 2.0**-24
SILU_SLOPE = 1.1  # max |silu'| = 1.09984...
SILU_CURVE = 0.5  # max |silu''|
ELEMENTWISE = 2.0**-20  # fp32 sigmoid, products and casts: 16 ulps
NAMES = ("output", "hidden_states grad", "routing weights grad", "gate_up_proj grad", "down_proj grad")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@dataclass
class Bounded:
    """A reference value (fp64) and an elementwise bound on the op's distance from it."""

    v: torch.Tensor
    e: torch.Tensor

    @property
    def mag(self) -> torch.Tensor:
        return self.v.abs() + self.e

    @property
    def T(self) -> "Bounded":
        return Bounded(self.v.t(), self.e.t())


def exact(t: torch.Tensor) -> Bounded:
    return Bounded(t.double(), torch.zeros_like(t, dtype=torch.float64))


def stored(x: Bounded, elementwise: float = 0.0) -> Bounded:
    """x computed (elementwise math: 2^-20 of its magnitude) and stored in fp32."""
    e = x.e + elementwise * x.mag
    return Bounded(x.v, e + FP32_UNIT * (x.v.abs() + e))


def quantised(x: Bounded) -> Bounded:
    """x as the fp8 operand of a GEMM, scaled along its last dim, dequantised."""
    q, scale = quantize_rowwise_reference(x.v.float())
    deq = q.double() * scale.double()[..., None]
    relative = x.e.amax(-1, keepdim=True) / x.v.abs().amax(-1, keepdim=True).clamp(min=1e-30) + 4 * FP32_UNIT
    return Bounded(deq, deq.abs() * relative)


def mm(a: Bounded, b: Bounded) -> Bounded:
    """a [M, L] @ b [N, L].T of the two operands quantised along L, stored."""
    a, b = quantised(a), quantised(b)
    e = a.e @ b.v.abs().t() + a.v.abs() @ b.e.t() + a.e @ b.e.t()
    e = e + (a.v.shape[-1] + 2) * FP32_UNIT * (a.mag @ b.mag.t())
    return stored(Bounded(a.v @ b.v.t(), e))


def halves(x: torch.Tensor):
    return x.chunk(2, dim=-1)


def clamped(gate, up, limit):
    return (gate, up) if limit is None else (gate.clamp(max=limit), up.clamp(-limit, limit))


def silu_mul(gate_up: Bounded, limit) -> Bounded:
    (gate, up), (e_gate, e_up) = clamped(*halves(gate_up.v), limit), halves(gate_up.e)
    silu = F.silu(gate)
    e = SILU_SLOPE * e_gate * (up.abs() + e_up) + silu.abs() * e_up
    return stored(Bounded(silu * up, e), ELEMENTWISE)


def silu_mul_backward(gate_up: Bounded, g: Bounded, w: torch.Tensor, limit) -> Bounded:
    """d gate_up [n, 2I] from d act = w * g."""
    (gate_raw, up_raw), (e_gate, e_up) = halves(gate_up.v), halves(gate_up.e)
    gate, up = clamped(gate_raw, up_raw, limit)
    d_act = Bounded(w[:, None] * g.v, w.abs()[:, None] * g.e)
    sig = torch.sigmoid(gate)
    silu, slope = gate * sig, sig * (1 + gate * (1 - sig))
    d_up = Bounded(d_act.v * silu, d_act.e * (silu.abs() + SILU_SLOPE * e_gate) + d_act.v.abs() * SILU_SLOPE * e_gate)
    d_gate_e = SILU_SLOPE * (d_act.e * (up.abs() + e_up) + d_act.v.abs() * e_up)
    d_gate = Bounded(d_act.v * up * slope, d_gate_e + d_act.v.abs() * up.abs() * SILU_CURVE * e_gate)
    if limit is not None:
        for d, value, err, passes, reach in (
            (d_up, up_raw, e_up, up_raw.abs() <= limit, d_act.mag * (silu.abs() + SILU_SLOPE * e_gate)),
            (d_gate, gate_raw, e_gate, gate_raw <= limit, SILU_SLOPE * d_act.mag * (up.abs() + e_up)),
        ):
            d.v = torch.where(passes, d.v, 0.0)
            near = (value.abs() - limit).abs() <= err if d is d_up else (value - limit).abs() <= err
            d.e = torch.where(near, d.e + 2 * reach, d.e)  # either side of the clamp
    return stored(Bounded(torch.cat([d_gate.v, d_up.v], -1), torch.cat([d_gate.e, d_up.e], -1)), ELEMENTWISE)


def row_dot(g: Bounded, act: Bounded) -> Bounded:
    e = (g.e * act.v.abs() + g.v.abs() * act.e + g.e * act.e).sum(-1)
    e = e + (g.v.shape[-1] + 2) * FP32_UNIT * (g.mag * act.mag).sum(-1)
    v = (g.v * act.v).sum(-1)
    return Bounded(v, e + FP32_UNIT * (v.abs() + e))  # in the routing weights' fp32


class SlotSum:
    """sum over a token's K slots of w * rows, in fp32, stored in the hidden states' dtype."""

    def __init__(self, tokens, width, device):
        self.v, self.e, self.mag = (torch.zeros(tokens, width, dtype=torch.float64, device=device) for _ in "vem")

    def add(self, token, rows: Bounded, w):
        w = w[:, None]
        self.v.index_add_(0, token, w * rows.v)
        self.e.index_add_(0, token, w.abs() * rows.e)
        self.mag.index_add_(0, token, w.abs() * rows.mag)

    def result(self, top_k) -> Bounded:
        return stored(Bounded(self.v, self.e + (top_k + 1) * FP32_UNIT * self.mag))


def walk_experts(x, index, weights, gate_up_proj, down_proj, grad_out, limit=None):
    """(output, grads of hidden_states, routing weights, gate_up_proj, down_proj) as Bounded, expert by expert."""
    (tokens, top_k), device = index.shape, x.device
    hidden, intermediate = down_proj.shape[1:]
    out, grad_x = SlotSum(tokens, hidden, device), SlotSum(tokens, hidden, device)
    zeros = dict(dtype=torch.float64, device=device)
    grad_w = Bounded(torch.zeros(tokens * top_k, **zeros), torch.zeros(tokens * top_k, **zeros))
    grad_gate_up = Bounded(torch.zeros(gate_up_proj.shape, **zeros), torch.zeros(gate_up_proj.shape, **zeros))
    grad_down = Bounded(torch.zeros(down_proj.shape, **zeros), torch.zeros(down_proj.shape, **zeros))
    flat_weights = weights.reshape(-1).double()
    for expert in range(gate_up_proj.shape[0]):
        slots = (index.reshape(-1) == expert).nonzero().squeeze(1)
        if slots.numel() == 0:
            continue  # its weight gradients are exact zeros
        token, w = slots // top_k, flat_weights[slots]
        x_rows, grad_rows = exact(x[token]), exact(grad_out[token])
        gate_up = mm(x_rows, exact(gate_up_proj[expert]))  # [n, 2I]
        act = silu_mul(gate_up, limit)  # [n, I]
        out.add(token, mm(act, exact(down_proj[expert])), w)
        g = mm(grad_rows, exact(down_proj[expert].t()))  # [n, I]
        dots = row_dot(g, act)
        grad_w.v[slots], grad_w.e[slots] = dots.v, dots.e
        scaled_act = stored(Bounded(w[:, None] * act.v, w.abs()[:, None] * act.e), ELEMENTWISE)
        down_grad = mm(grad_rows.T, scaled_act.T)  # [H, I], over the group's rows
        grad_down.v[expert], grad_down.e[expert] = down_grad.v, down_grad.e
        d_gate_up = silu_mul_backward(gate_up, g, w, limit)  # [n, 2I]
        gate_up_grad = mm(d_gate_up.T, x_rows.T)  # [2I, H]
        grad_gate_up.v[expert], grad_gate_up.e[expert] = gate_up_grad.v, gate_up_grad.e
        grad_x.add(token, mm(d_gate_up, exact(gate_up_proj[expert].t())), torch.ones_like(w))
    grad_w = Bounded(grad_w.v.view(tokens, top_k), grad_w.e.view(tokens, top_k))
    return out.result(top_k), grad_x.result(top_k), grad_w, grad_gate_up, grad_down


def run(x, index, weights, gate_up_proj, down_proj, grad_out, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
    out = ops.liger_grouped_experts(leaves[0], index, leaves[1], *leaves[2:], **options)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def inputs(tokens, top_k, num_experts, used, hidden=32, intermediate=16, seed=0, device="cpu", dtype=torch.float32):
    """Distinct experts per token from ``used``; hidden features over four decades (some quantised elements in
    e4m3's subnormal range)."""
    generator = torch.Generator(device).manual_seed(seed)
    options = dict(generator=generator, device=device)
    picks = torch.rand(tokens, len(used), **options).argsort(dim=1)[:, :top_k]
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, **options)
    decades = torch.logspace(-3, 1, hidden, device=device)[torch.randperm(hidden, **options)]
    x = torch.randn(tokens, hidden, **options) * decades
    gate_up_proj = torch.randn(num_experts, 2 * intermediate, hidden, **options) / hidden**0.5
    down_proj = torch.randn(num_experts, hidden, intermediate, **options) / intermediate**0.5
    grad_out = torch.randn(tokens, hidden, **options)
    index = torch.tensor(used, device=device)[picks]
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (x, index)) + (
        weights,
        *(t.to(dtype) for t in (gate_up_proj, down_proj, grad_out)),
    )


def assert_within(actual, bounded, what, name):
    err = (actual.double() - bounded.v).abs()
    assert (err <= bounded.e).all(), f"{what} {name}: error / bound up to {(err / bounded.e).max().item():.3g}"


# (tokens, top_k, experts, experts that get tokens, limit)
CASES = [
    (12, 2, 4, [0, 2, 3], None),  # expert 1 gets nothing
    (16, 4, 8, [0, 1, 3, 4, 6, 7], None),  # top-4, experts 2 and 5 get nothing
    (10, 3, 6, [1, 2, 4], 0.7),  # the clamp of DeepSeek-V4's experts; first and last experts empty
]


@pytest.mark.parametrize("tokens, top_k, num_experts, used, limit", CASES)
def test_matches_the_dequantised_reference(tokens, top_k, num_experts, used, limit):
    tensors = inputs(tokens, top_k, num_experts, used, seed=tokens)
    actual = run(*tensors, limit=limit, fp8=True)
    reference = walk_experts(*tensors, limit=limit)
    for name, a, r in zip(NAMES, actual, reference):
        assert a.dtype == torch.float32
        assert_within(a, r, "dequantised reference", name)
        assert (r.e <= 2.0**-12 * r.mag.amax()).all(), name  # tight: far below e4m3's 2^-4
    for grad in actual[3:]:
        unused = [e for e in range(num_experts) if e not in used]
        assert torch.count_nonzero(grad[unused]) == 0


QUANTISED_UPSTREAM = (4, 6, 4, 6, 4)  # m of the module docstring, per entry of NAMES
THROUGH_THE_CLAMP_MASK = ("hidden_states grad", "gate_up_proj grad")


def assert_fp8_close(fp8, plain, limit=None, bf16=False):
    """(b) of the module docstring: relative Frobenius error within the model's tolerance, and above 2^-8 (the
    GEMMs did run on fp8)."""
    for name, a, p, m in zip(NAMES, fp8, plain, QUANTISED_UPSTREAM):
        pieces = list(zip(a.split(64), p.split(64)))  # fp64 a piece at a time: the CUDA case's weights are large
        error = sum((x.double() - y.double()).square().sum() for x, y in pieces)
        relative = (error / sum(y.double().square().sum() for _, y in pieces)).sqrt().item()
        tolerance = 4 * m**0.5 * 2.0**-4 / 3**0.5 + (2.0**-6 if bf16 else 0.0)
        if limit is None or name not in THROUGH_THE_CLAMP_MASK:
            assert relative <= tolerance, f"{name}: relative error {relative:.3g} over {tolerance:.3g}"
        assert relative > 2.0**-8, name


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("tokens, top_k, num_experts, used, limit", CASES)
def test_close_to_the_unquantised_op(tokens, top_k, num_experts, used, limit, seed):
    tensors = inputs(tokens, top_k, num_experts, used, seed=100 * seed + tokens)
    assert_fp8_close(run(*tensors, limit=limit, fp8=True), run(*tensors, limit=limit), limit)


def test_every_gemm_goes_through_fp8_groups(monkeypatch):
    calls = []
    for cls in (ops.ExpertGroups, fp8_expert_groups.FP8ExpertGroups):
        for name in ("rows_mm", "rows_mm_keeping_amax", "weight_grad"):
            original = getattr(cls, name, None)
            if original is None:
                continue

            def counted(self, *args, _key=(cls.__name__, name), _original=original):
                calls.append(_key)
                return _original(self, *args)

            monkeypatch.setattr(cls, name, counted)
    run(*inputs(12, 2, 4, [0, 2, 3]), fp8=True)
    # the forward's two products keep the weights' column amax for the backward's two
    expected = [("FP8ExpertGroups", "rows_mm")] * 2 + [("FP8ExpertGroups", "rows_mm_keeping_amax")] * 2
    assert sorted(calls) == expected + [("FP8ExpertGroups", "weight_grad")] * 2


def saved_tensors(fn) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """Shape, dtype and bytes of every tensor autograd saves while ``fn()`` runs."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sorted(saved, key=str)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_saves_what_the_unquantised_op_saves(dtype):
    x, index, weights, gate_up_proj, down_proj, _ = inputs(12, 2, 4, [0, 2, 3], dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]

    def call(fp8):
        return lambda: ops.liger_grouped_experts(leaves[0], index, leaves[1], *leaves[2:], fp8=fp8)

    saved = saved_tensors(call(True))
    plain = saved_tensors(call(False))
    # and the weights' column amaxes (int32 [E, H] and [E, I]); the unquantised op saves two empty tensors there
    amaxes = [((4, 32), torch.int32, 4 * 32 * 4), ((4, 16), torch.int32, 4 * 16 * 4)]
    assert sorted(amaxes, key=str) == [entry for entry in saved if entry[1] == torch.int32 and len(entry[0]) == 2]
    empty = (torch.int32, 0)
    assert [entry for entry in plain if entry[1:] == empty] == [((0,), *empty)] * 2
    assert [entry for entry in saved if entry not in amaxes] == [entry for entry in plain if entry[1:] != empty]
    assert ((24, 32), dtype, 24 * 32 * dtype.itemsize) in saved  # the gate/up output, in the GEMM dtype
    assert not any(d == torch.float8_e4m3fn for _, d, _ in saved)


def test_weights_of_another_layout_find_their_amax_in_the_backward():
    """Expert weights stored transposed (a column-major [E, 2I, H] view): the forward cannot keep their column amax,
    the backward finds it itself, with the numbers of row-major weights; fake tensors give the same outputs."""
    x, index, weights, gate_up_proj, down_proj, grad_out = inputs(12, 2, 4, [0, 2, 3])
    transposed = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up_proj, down_proj)]
    assert not any(w.is_contiguous() for w in transposed)
    expected = run(x, index, weights, gate_up_proj, down_proj, grad_out, fp8=True)
    for a, b in zip(run(x, index, weights, *transposed, grad_out, fp8=True), expected):
        assert torch.equal(a, b)
    real = ops._grouped_experts(x, index, weights, *transposed, torch.float32, None, True)
    assert [t.shape for t in real[-2:]] == [(0,), (0,)]
    with FakeTensorMode() as mode:
        fake = ops._grouped_experts(*[mode.from_tensor(t) for t in (x, index, weights, *transposed)], torch.float32,
                                    None, True)  # fmt: skip
        assert [t.shape for t in fake] == [t.shape for t in real]


def test_backward_takes_the_weights_column_amax_from_the_forward(monkeypatch):
    """The forward's rowwise passes over the weights find the column amaxes that the backward's column quantisers
    need: no amax pass runs, and the gradients are those of a backward that finds the amaxes itself."""
    from liger_dspine.ops import fp8_quantize

    passes = []
    launch = fp8_quantize._launch_column_amax
    monkeypatch.setattr(fp8_quantize, "_launch_column_amax", lambda *args: passes.append(1) or launch(*args))
    tensors = inputs(12, 2, 4, [0, 2, 3])
    kept = run(*tensors, fp8=True)
    assert passes == []
    groups = fp8_expert_groups.FP8ExpertGroups
    monkeypatch.setattr(groups, "rows_mm_keeping_amax", lambda self, rows, weights: (
        self.rows_mm(rows, weights), rows.new_empty(0, dtype=torch.int32)))  # fmt: skip
    found = run(*tensors, fp8=True)
    assert len(passes) == 2  # gate_up_proj's and down_proj's, in the backward
    for a, b in zip(kept, found):
        assert torch.equal(a, b)


def test_no_tokens():
    x, index, weights, gate_up_proj, down_proj, grad_out = inputs(6, 2, 4, [0, 1, 3])
    empty = run(x[:0], index[:0], weights[:0], gate_up_proj, down_proj, grad_out[:0], fp8=True)
    assert [tuple(t.shape) for t in empty] == [(0, 32), (0, 32), (0, 2), (4, 32, 32), (4, 32, 16)]
    assert torch.count_nonzero(empty[3]) == 0 and torch.count_nonzero(empty[4]) == 0


def test_fake_tensors_give_the_real_layouts():
    tensors = inputs(12, 2, 4, [0, 2, 3])

    def layouts(outputs):
        return [(tuple(t.shape), t.dtype, t.stride()) for t in outputs]

    real = layouts(run(*tensors, fp8=True))
    with FakeTensorMode() as mode:
        assert layouts(run(*[mode.from_tensor(t) for t in tensors], fp8=True)) == real


def test_cuda_layouts_pass_torch_checks():
    """The six products of the op as torch._scaled_grouped_mm calls on fake CUDA tensors, with the operands
    FP8ExpertGroups quantises (each weight layout the op passes: transposed views in forward, row-major in
    backward): torch's meta functions check dtypes, strides, alignment, scale shapes and give the output shape."""
    rows, hidden, intermediate, experts = 40, 64, 32, 4
    with FakeTensorMode():

        def empty(*shape):
            return torch.empty(*shape, dtype=torch.bfloat16, device="cuda")

        gate_up_proj, down_proj = empty(experts, 2 * intermediate, hidden), empty(experts, hidden, intermediate)
        offs = torch.empty(experts, dtype=torch.int32, device="cuda")
        products = [
            (empty(rows, hidden), gate_up_proj.transpose(1, 2), (rows, 2 * intermediate)),  # forward gate/up
            (empty(rows, intermediate), down_proj.transpose(1, 2), (rows, hidden)),  # forward down
            (empty(rows, hidden), down_proj, (rows, intermediate)),  # grad_out @ down_proj
            (empty(rows, 2 * intermediate), gate_up_proj, (rows, hidden)),  # input gradient
        ]
        for a, weights, shape in products:
            q_weights, scale_weights, _ = fp8_expert_groups._per_column(weights)
            out = cuda_grouped_rows_mm(*quantize_rowwise(a), q_weights, scale_weights, offs)
            assert out.shape == shape and out.dtype == torch.bfloat16
        for left, right in (
            (empty(rows, hidden), empty(rows, intermediate)),
            (empty(rows, 2 * intermediate), empty(rows, hidden)),
        ):
            q_left, scale_left, padded = quantize_group_columns(left, offs)
            out = cuda_grouped_weight_grad(q_left, scale_left, *quantize_group_columns(right, offs)[:2], padded)
            assert out.shape == (experts, left.shape[1], right.shape[1])


def test_refusals(monkeypatch):
    x, index, weights, gate_up_proj, down_proj, _ = inputs(4, 2, 4, [0, 1, 2, 3], hidden=24)
    with pytest.raises(ValueError, match=r"liger-dspine: FP8 grouped experts needs .* multiples of 16.*'H': 24"):
        ops.liger_grouped_experts(x, index, weights, gate_up_proj, down_proj, fp8=True)
    x, index, weights, gate_up_proj, down_proj, _ = inputs(4, 2, 4, [0, 1, 2, 3], dtype=torch.float64)
    with pytest.raises(ValueError, match="compute in float16 / bfloat16 / float32 on cpu, got torch.float64"):
        ops.liger_grouped_experts(x, index, weights, gate_up_proj, down_proj, fp8=True)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(RuntimeError, match=r"compute capability 9.0 or 10.0\), got 8.9"):
        check_fp8_experts(cuda, torch.bfloat16, 7168, 2048)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="compute in bfloat16 on cuda, got torch.float16"):
        check_fp8_experts(cuda, torch.float16, 7168, 2048)
    check_fp8_experts(cuda, torch.bfloat16, 7168, 2048)


def test_module_option_matches_the_op():
    config = tiny_deepseek_v3_config(
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, hidden_size=32, moe_intermediate_size=16
    )
    x, index, weights, gate_up_proj, down_proj, grad_out = inputs(12, 2, 4, [0, 2, 3])
    assert LigerGroupedExperts(config).fp8 is False
    module = LigerGroupedExperts(config, fp8=True)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up_proj)
        module.down_proj.copy_(down_proj)
    leaves = [t.clone().requires_grad_() for t in (x, weights)]
    out = module(leaves[0].view(3, 4, 32), index.view(3, 4, 2), leaves[1].view(3, 4, 2))
    out.backward(grad_out.view(3, 4, 32))
    actual = [out.detach().view(12, 32), *(t.grad for t in leaves), module.gate_up_proj.grad, module.down_proj.grad]
    for name, a, e in zip(NAMES, actual, run(x, index, weights, gate_up_proj, down_proj, grad_out, fp8=True)):
        assert torch.equal(a, e), name
    assert not torch.equal(actual[0], run(x, index, weights, gate_up_proj, down_proj, grad_out)[0])


@pytest.mark.cuda
def test_cuda_deepseek_v3_widths():
    """T = 4096 tokens, H = 7168, 256 experts top-8 (experts 5 and 200 get nothing), I scaled from 2048 to 512, bf16:
    torch._scaled_grouped_mm against the bf16 op (torch's grouped GEMM), (b) of the module docstring."""
    if torch.cuda.get_device_capability() not in ((9, 0), (10, 0)):
        pytest.skip("torch's FP8 grouped GEMM runs on compute capability 9.0 and 10.0")
    used = [e for e in range(256) if e not in (5, 200)]
    tensors = inputs(4096, 8, 256, used, hidden=7168, intermediate=512, device="cuda", dtype=torch.bfloat16)
    fp8 = run(*tensors, fp8=True)
    plain = run(*tensors)
    for name, a, p in zip(NAMES, fp8, plain):
        assert a.dtype == p.dtype and torch.isfinite(a).all(), name
    assert_fp8_close(fp8, plain, bf16=True)
    assert torch.count_nonzero(fp8[3][[5, 200]]) == 0 and torch.count_nonzero(fp8[4][[5, 200]]) == 0
