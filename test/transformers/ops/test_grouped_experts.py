"""LigerGroupedExperts / the grouped-GEMM experts op against transformers' experts and a per-token reference.

References, computed independently of the op's expert sort and grouped GEMMs:
- transformers' ``DeepseekV3Experts`` with its eager per-expert loop, in the same dtype;
- ``per_token_reference``: each (token, slot) pair through its expert's weights (gathered), in fp64.

CPU tolerances: fp32 1e-5 (fp32 rounding in another summation order); fp64 1e-12 (the math itself).
CUDA tolerances: fp32 2e-4 of the reference's largest magnitude (TF32 off: rounding only); bf16 no further from the
fp64 reference than twice transformers' own bf16 experts, plus 2**-10 of the reference's largest magnitude.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

from liger_dspine.modules.grouped_experts import LigerGroupedExperts
from liger_dspine.ops import grouped_experts as ops
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_backward as fused
from tiny_models import native_experts_class
from tiny_models import tiny_deepseek_v3_config

# runs against every transformers version of the matrix
pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("one_cpu_thread")]

NativeExperts = native_experts_class()

FP32 = dict(atol=1e-5, rtol=1e-5)
FP64 = dict(atol=1e-12, rtol=1e-12)


CPU_GROUPED_MM = pytest.mark.skipif(
    ops.torch_grouped_mm_function() is None or Version(torch.__version__).release < (2, 9),
    reason="torch's grouped GEMM has a CPU kernel from torch 2.9",
)


def experts_config(num_experts: int, top_k: int, hidden: int = 32, intermediate: int = 16, **overrides):
    return tiny_deepseek_v3_config(
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        **overrides,
    )


def native_experts(config, implementation="eager", device="cpu", dtype=torch.float32, seed=0):
    config._experts_implementation = implementation
    torch.manual_seed(seed)
    experts = NativeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
    return experts.to(device=device, dtype=dtype)


def liger_experts(native: torch.nn.Module, build: str) -> LigerGroupedExperts:
    if build == "convert":
        twin = copy.deepcopy(native)
        LigerGroupedExperts.convert(twin)
        assert type(twin) is LigerGroupedExperts
        return twin
    liger = LigerGroupedExperts(native.config).to(native.gate_up_proj.device)
    liger.load_state_dict(native.state_dict())
    return liger


def routing(tokens: int, top_k: int, experts: list[int], seed: int = 1, device="cpu"):
    """Distinct experts per token drawn from ``experts`` (the others get no token); weights in (0.1, 1), fp32."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(experts)
    picks = torch.stack([torch.randperm(len(experts), generator=generator)[:top_k] for _ in range(tokens)])
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=generator)
    return allowed[picks].to(device), weights.to(device)


def per_token_reference(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """out[t] = sum_k w[t, k] * down[e] (silu(gate) * up), each (t, k) with its own gathered expert weights."""
    intermediate = down_proj.shape[-1]
    gate_up = torch.einsum("tkoh,th->tko", gate_up_proj[top_k_index], hidden_states)
    act = F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]
    y = torch.einsum("tkhi,tki->tkh", down_proj[top_k_index], act)
    return (top_k_weights[..., None] * y).sum(dim=1)


def run(fn, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, grad_out):
    """(output, grads of hidden_states, routing weights, gate_up_proj, down_proj) of ``fn``."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden_states, top_k_weights, gate_up_proj, down_proj)]
    x, weights, gate_up, down = leaves
    out = fn(x, top_k_index, weights, gate_up, down)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def run_module(module, hidden_states, top_k_index, top_k_weights, grad_out):
    x = hidden_states.detach().clone().requires_grad_()
    weights = top_k_weights.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x, top_k_index, weights)
    out.backward(grad_out)
    return [out.detach(), x.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad]


def reference_results(native, hidden_states, top_k_index, top_k_weights, grad_out, dtype=torch.float64):
    def cast(t):
        return t.to(dtype)

    weights = (native.gate_up_proj, native.down_proj)
    return run(
        per_token_reference,
        cast(hidden_states),
        top_k_index,
        cast(top_k_weights),
        *map(cast, weights),
        cast(grad_out),
    )


NAMES = ("output", "hidden_states grad", "routing weights grad", "gate_up_proj grad", "down_proj grad")


def assert_results_close(actual, expected, **tolerance):
    for name, a, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(a, e.to(a.dtype), **tolerance, msg=lambda m: f"{name}: {m}")


# (tokens, top_k, experts, experts that get tokens)
CASES = [
    (1, 2, 4, [0, 1, 2, 3]),  # a single token
    (12, 2, 4, [0, 2, 3]),  # expert 1 gets nothing
    (9, 1, 3, [0, 1, 2]),  # top-1
    (16, 4, 8, [0, 1, 3, 4, 6, 7]),  # top-4, experts 2 and 5 get nothing
    (10, 3, 6, [1, 2, 4]),  # every token on the same three experts: four empty groups, first and last included
]


@pytest.mark.parametrize("build", ("convert", "construct"))
@pytest.mark.parametrize("tokens, top_k, num_experts, used", CASES)
def test_matches_transformers_and_reference_fp32(tokens, top_k, num_experts, used, build):
    config = experts_config(num_experts, top_k)
    native = native_experts(config)
    liger = liger_experts(native, build)
    index, weights = routing(tokens, top_k, used)
    x = torch.randn(tokens, config.hidden_size)
    grad_out = torch.randn(tokens, config.hidden_size)

    actual = run_module(liger, x, index, weights, grad_out)
    assert_results_close(actual, run_module(native, x, index, weights, grad_out), **FP32)
    assert_results_close(actual, reference_results(native, x, index, weights, grad_out), **FP32)
    unused = [e for e in range(num_experts) if e not in used]
    assert torch.count_nonzero(actual[3][unused]) == 0 and torch.count_nonzero(actual[4][unused]) == 0


@pytest.mark.parametrize("tokens, top_k, num_experts, used", CASES[1:4])
@pytest.mark.parametrize("piece_rows", (None, 5), ids=("one_piece", "pieces_of_5_rows"))
def test_matches_reference_fp64(tokens, top_k, num_experts, used, piece_rows, monkeypatch):
    if piece_rows is not None:  # the fp32 elementwise math in several row pieces, the last one partial
        monkeypatch.setattr(ops, "_ELEMENTWISE_ROWS", piece_rows)
    native = native_experts(experts_config(num_experts, top_k), dtype=torch.float64)
    index, weights = routing(tokens, top_k, used)
    x = torch.randn(tokens, 32, dtype=torch.float64)
    grad_out = torch.randn(tokens, 32, dtype=torch.float64)
    inputs = (x, index, weights.double(), native.gate_up_proj, native.down_proj, grad_out)
    assert_results_close(run(ops.liger_grouped_experts, *inputs), run(per_token_reference, *inputs), **FP64)


def test_input_shape_kept():
    config = experts_config(4, 2)
    liger = liger_experts(native_experts(config), "convert")
    index, weights = routing(6, 2, [0, 1, 2, 3])
    x = torch.randn(2, 3, config.hidden_size)
    out = liger(x, index.view(2, 3, 2), weights.view(2, 3, 2))
    assert out.shape == x.shape
    expected = per_token_reference(x.view(6, -1), index, weights, liger.gate_up_proj, liger.down_proj)
    torch.testing.assert_close(out.view(6, -1), expected.detach(), **FP32)


def test_int32_index_and_no_tokens():
    native = native_experts(experts_config(4, 2))
    index, weights = routing(6, 2, [0, 1, 3])
    x = torch.randn(6, 32)
    grad_out = torch.randn(6, 32)
    inputs = (native.gate_up_proj, native.down_proj, grad_out)
    assert_results_close(
        run(ops.liger_grouped_experts, x, index.int(), weights, *inputs),
        run(ops.liger_grouped_experts, x, index, weights, *inputs),
    )
    empty = run(ops.liger_grouped_experts, x[:0], index[:0], weights[:0], *inputs[:2], grad_out[:0])
    assert [tuple(t.shape) for t in empty] == [(0, 32), (0, 32), (0, 2), (4, 32, 32), (4, 32, 16)]
    assert torch.count_nonzero(empty[3]) == 0 and torch.count_nonzero(empty[4]) == 0


def saved_float_tensors(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every floating-point tensor autograd saves while ``fn()`` runs."""
    saved = []

    def pack(tensor):
        if tensor.is_floating_point():
            saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return saved


def test_saves_no_rows_of_hidden_width():
    tokens, top_k, num_experts, hidden, intermediate = 12, 2, 4, 32, 16
    rows = tokens * top_k
    config = experts_config(num_experts, top_k)
    native = native_experts(config, implementation="grouped_mm")
    liger = liger_experts(native, "convert")
    index, weights = routing(tokens, top_k, [0, 2, 3])
    x = torch.randn(tokens, hidden, requires_grad=True)
    weights.requires_grad_()

    saved = saved_float_tensors(lambda: liger(x, index, weights))
    # the hidden states and routing weights given, the two weights, and the gate/up output [T*K, 2I]; nothing else
    assert sorted(saved) == sorted(
        [
            ((tokens, hidden), torch.float32),
            ((tokens, top_k), torch.float32),
            ((num_experts, 2 * intermediate, hidden), torch.float32),
            ((num_experts, hidden, intermediate), torch.float32),
            ((rows, 2 * intermediate), torch.float32),
        ]
    )
    # the census sees what transformers' grouped_mm experts keep: the gathered inputs and the down output [T*K, H]
    native_saved = saved_float_tensors(lambda: native(x, index, weights))
    assert sum(shape == (rows, hidden) for shape, _ in native_saved) >= 2


def count_group_gemms(monkeypatch) -> dict[str, int]:
    calls = {"rows_mm": 0, "weight_grad": 0}
    for name in calls:
        original = getattr(ops.ExpertGroups, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(ops.ExpertGroups, name, counted)
    return calls


# which inputs require grad -> (grouped GEMMs over rows, weight-gradient GEMMs) in backward
NEEDS = {
    "all": (("x", "weights", "gate_up", "down"), (2, 2)),
    "down_proj only": (("down",), (0, 1)),
    "routing weights only": (("weights",), (1, 0)),
    "gate_up_proj only": (("gate_up",), (1, 1)),
    "hidden_states only": (("x",), (2, 0)),
}


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("torch_elementwise", "triton_elementwise"))
@pytest.mark.parametrize("case", NEEDS)
def test_backward_computes_only_needed_grads(case, dtype, monkeypatch):
    """fp64 takes the torch elementwise path, fp32 the Triton one (through the interpreter on CPU), which runs
    whenever anything but down_proj alone needs a gradient."""
    needs, (rows_gemms, weight_gemms) = NEEDS[case]
    native = native_experts(experts_config(4, 2), dtype=dtype)
    index, weights = routing(8, 2, [0, 1, 3])
    tensors = dict(
        x=torch.randn(8, 32, dtype=dtype),
        weights=weights.to(dtype),
        gate_up=native.gate_up_proj.detach().clone(),
        down=native.down_proj.detach().clone(),
    )
    grad_out = torch.randn(8, 32, dtype=dtype)
    reference_inputs = [tensors["x"], index, tensors["weights"], tensors["gate_up"], tensors["down"], grad_out]
    reference_inputs = [t if t.dtype == torch.int64 else t.double() for t in reference_inputs]
    expected = dict(zip(("x", "weights", "gate_up", "down"), run(per_token_reference, *reference_inputs)[1:]))
    for name in needs:
        tensors[name].requires_grad_()
    calls = count_group_gemms(monkeypatch)
    fused_calls = []
    monkeypatch.setattr(ops, "silu_mul_rows_backward", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))

    out = ops.liger_grouped_experts(tensors["x"], index, tensors["weights"], tensors["gate_up"], tensors["down"])
    assert calls == {"rows_mm": 2, "weight_grad": 0}
    out.backward(grad_out)

    assert calls == {"rows_mm": 2 + rows_gemms, "weight_grad": weight_gemms}
    assert len(fused_calls) == (dtype == torch.float32 and needs != ("down",))
    for name, tensor in tensors.items():
        if name in needs:
            torch.testing.assert_close(
                tensor.grad, expected[name].to(dtype), **(FP64 if dtype == torch.float64 else FP32)
            )
        else:
            assert tensor.grad is None


def test_fused_backward_refuses_a_second_pass():
    """The Triton backward writes over the saved gate/up output; a second backward says so instead of reading it."""
    native = native_experts(experts_config(4, 2))
    index, weights = routing(8, 2, [0, 1, 3])
    x = torch.randn(8, 32, requires_grad=True)
    out = ops.liger_grouped_experts(x, index, weights, native.gate_up_proj, native.down_proj)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@CPU_GROUPED_MM
@pytest.mark.parametrize("tokens, top_k, num_experts, used", CASES[1:])
@pytest.mark.parametrize("zero_fill", (False, True), ids=("grouped_mm_zeros", "explicit_zeros"))
def test_torch_grouped_mm_branch_on_cpu(tokens, top_k, num_experts, used, zero_fill, monkeypatch):
    """The branch CUDA takes (torch's grouped GEMM, its 2-D x 2-D weight-gradient form included), run on CPU;
    empty experts' gradients are zeros from the GEMM itself or from the explicit fill other GPUs get."""
    if zero_fill:
        monkeypatch.setattr(ops, "_empty_groups_are_zeros", lambda device: False)
    native = native_experts(experts_config(num_experts, top_k))
    index, weights = routing(tokens, top_k, used)
    x = torch.randn(tokens, 32)
    grad_out = torch.randn(tokens, 32)
    inputs = (x, index, weights, native.gate_up_proj, native.down_proj, grad_out)
    loop = run(ops.liger_grouped_experts, *inputs)

    real = ops.torch_grouped_mm_function()
    calls = []

    def counted(*args, **kwargs):
        calls.append([a.dim() for a in args[:2]])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "torch_grouped_mm_supported", lambda device: True)
    monkeypatch.setattr(ops, "torch_grouped_mm_function", lambda: counted)
    grouped = run(ops.liger_grouped_experts, *inputs)

    # forward: gate/up and down; backward: g, the two weight gradients (2-D x 2-D) and the input gradient
    assert sorted(calls) == [[2, 2], [2, 2], [2, 3], [2, 3], [2, 3], [2, 3]]
    assert_results_close(grouped, loop, **FP32)
    assert_results_close(grouped, reference_results(native, x, index, weights, grad_out), **FP32)
    unused = [e for e in range(num_experts) if e not in used]
    assert torch.count_nonzero(grouped[3][unused]) == 0 and torch.count_nonzero(grouped[4][unused]) == 0


@pytest.mark.parametrize("branch", ("loop", pytest.param("torch", marks=CPU_GROUPED_MM)))
def test_torch_compile_keeps_the_eager_numbers(branch, monkeypatch):
    """Inside a compiled MoE-like block (flatten, experts, reshape, residual add) the op runs as it is."""
    if branch == "torch":
        monkeypatch.setattr(ops, "torch_grouped_mm_supported", lambda device: True)
    native = native_experts(experts_config(4, 2))
    index, weights = routing(12, 2, [0, 1, 3])
    x = torch.randn(2, 6, 32, requires_grad=True)

    def block(x):
        flat = ops.liger_grouped_experts(x.view(-1, 32), index, weights, native.gate_up_proj, native.down_proj)
        return x + flat.view(x.shape)

    eager = block(x)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(block)(x)
    (compiled_grad,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, **FP32)
    torch.testing.assert_close(compiled_grad, eager_grad, **FP32)


def test_branch_choice(monkeypatch):
    weights = (torch.zeros(4, 32, 32), torch.zeros(4, 32, 16))
    assert not ops.use_torch_grouped_mm(torch.zeros(2, 32), *weights, torch.float32)  # CPU: the loop
    monkeypatch.setattr(ops, "torch_grouped_mm_supported", lambda device: True)
    assert ops.use_torch_grouped_mm(torch.zeros(2, 32), *weights, torch.float32)
    # rows of 30 fp32 (120 bytes) break the 16-byte alignment torch's grouped GEMM needs: the loop again
    odd = (torch.zeros(4, 32, 30), torch.zeros(4, 30, 16))
    assert not ops.use_torch_grouped_mm(torch.zeros(2, 30), *odd, torch.float32)
    assert ops.use_torch_grouped_mm(torch.zeros(2, 32), *weights, torch.bfloat16)  # 64 bytes
    assert not ops.use_torch_grouped_mm(
        torch.zeros(2, 36), torch.zeros(4, 32, 36), torch.zeros(4, 36, 16), torch.bfloat16
    )


def test_cpu_autocast_computes_in_the_autocast_dtype():
    """Under autocast the GEMMs run in the autocast dtype; output and grads keep the fp32 inputs' dtypes. fp16: the
    CPU interpreter refuses bf16 tensors."""
    native = native_experts(experts_config(4, 2))
    index, weights = routing(12, 2, [0, 1, 3])
    x = torch.randn(12, 32)
    grad_out = torch.randn(12, 32)
    inputs = (x, index, weights, native.gate_up_proj, native.down_proj, grad_out)
    with torch.autocast("cpu", dtype=torch.float16):
        actual = run(ops.liger_grouped_experts, *inputs)
    reference = reference_results(native, x, index, weights, grad_out)
    assert all(t.dtype == torch.float32 for t in actual)
    for name, a, r in zip(NAMES, actual, reference):
        scale = r.abs().max().item()
        # fp16 operands (11 bits of precision): a few fp16 roundings (2**-11) of the largest magnitude
        assert (a.double() - r).abs().max().item() <= 4 * 2.0**-11 * scale, name
        assert (a.double() - r).abs().max().item() > 0, name  # fp16 was used: not fp32-exact


def test_refuses_biases_activations_and_layouts():
    config = experts_config(4, 2)
    experts = NativeExperts(config)
    experts.has_bias = True
    with pytest.raises(ValueError, match="bias"):
        LigerGroupedExperts.convert(experts)
    assert type(experts) is NativeExperts

    experts = NativeExperts(config)
    experts.is_transposed = True
    with pytest.raises(ValueError, match="is_transposed"):
        LigerGroupedExperts.convert(experts)

    gelu = experts_config(4, 2, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        LigerGroupedExperts(gelu)
    with pytest.raises(ValueError, match="gelu"):
        LigerGroupedExperts.convert(NativeExperts(gelu))


def test_refuses_bad_inputs():
    native = native_experts(experts_config(4, 2))
    liger = liger_experts(native, "convert")
    x = torch.randn(3, 32)
    weights = torch.rand(3, 2)
    with pytest.raises(ValueError, match="outside"):
        liger(x, torch.tensor([[0, 1], [2, 4], [1, 3]]), weights)
    with pytest.raises(ValueError, match="outside"):
        liger(x, torch.tensor([[0, 1], [2, -1], [1, 3]]), weights)
    with pytest.raises(ValueError, match="bfloat16"):
        liger(x.bfloat16(), torch.tensor([[0, 1], [2, 3], [1, 3]]), weights)


# CUDA: T=512, H=256, I=128, E=16, K=2, expert 5 without tokens.

CUDA_SHAPE = dict(tokens=512, top_k=2, num_experts=16, hidden=256, intermediate=128)
CUDA_USED = [e for e in range(16) if e != 5]


def cuda_case(dtype, tokens=CUDA_SHAPE["tokens"]):
    config = experts_config(
        CUDA_SHAPE["num_experts"], CUDA_SHAPE["top_k"], CUDA_SHAPE["hidden"], CUDA_SHAPE["intermediate"]
    )
    native = native_experts(config, device="cuda", dtype=dtype)
    index, weights = routing(tokens, CUDA_SHAPE["top_k"], CUDA_USED, device="cuda")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, CUDA_SHAPE["hidden"], generator=generator).to("cuda", dtype)
    grad_out = torch.randn(tokens, CUDA_SHAPE["hidden"], generator=generator).to("cuda", dtype)
    return native, x, index, weights, grad_out


@pytest.mark.cuda
def test_cuda_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    native, x, index, weights, grad_out = cuda_case(torch.float32)
    actual = run_module(liger_experts(native, "convert"), x, index, weights, grad_out)
    reference = reference_results(native, x, index, weights, grad_out)
    for name, a, r in zip(NAMES, actual, reference):
        err = (a.double() - r).abs().max().item()
        assert err <= 2e-4 * r.abs().max().item(), f"{name}: error {err:.3g}"
    assert torch.count_nonzero(actual[3][5]) == 0 and torch.count_nonzero(actual[4][5]) == 0


@pytest.mark.cuda
def test_cuda_bf16():
    native, x, index, weights, grad_out = cuda_case(torch.bfloat16)
    actual = run_module(liger_experts(native, "convert"), x, index, weights, grad_out)
    native_bf16 = run_module(native, x, index, weights, grad_out)
    reference = reference_results(native, x, index, weights, grad_out)
    for name, a, n, r in zip(NAMES, actual, native_bf16, reference):
        assert a.dtype == n.dtype, name
        err = (a.double() - r).abs().max().item()
        native_err = (n.double() - r).abs().max().item()
        floor = 2.0**-10 * r.abs().max().item()
        assert err <= 2.0 * native_err + floor, f"{name}: error {err:.3g}, transformers bf16 error {native_err:.3g}"
    assert torch.count_nonzero(actual[3][5]) == 0 and torch.count_nonzero(actual[4][5]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_cuda_takes_torch_grouped_mm(dtype, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's grouped GEMM needs compute capability 8.0")
    native, x, index, weights, grad_out = cuda_case(dtype)
    liger = liger_experts(native, "convert")
    assert ops.use_torch_grouped_mm(x, liger.gate_up_proj, liger.down_proj, dtype)
    real = ops.torch_grouped_mm_function()
    calls = []

    def counted(*args, **kwargs):
        calls.append([a.dim() for a in args[:2]])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "torch_grouped_mm_function", lambda: counted)
    run_module(liger, x, index, weights, grad_out)
    # every GEMM of forward (2) and backward (4) went through it: none through the per-expert loop
    assert sorted(calls) == [[2, 2], [2, 2], [2, 3], [2, 3], [2, 3], [2, 3]]


@pytest.mark.cuda
def test_cuda_memory_kept_for_backward():
    """Memory held from forward to backward: the output, the gate/up output and small integer tensors only, against
    transformers' grouped_mm experts, which hold at least two more [T*K, H] tensors."""
    tokens = 4096
    native, x, index, weights, grad_out = cuda_case(torch.bfloat16, tokens=tokens)
    rows, hidden, intermediate = tokens * CUDA_SHAPE["top_k"], CUDA_SHAPE["hidden"], CUDA_SHAPE["intermediate"]
    x.requires_grad_()
    weights.requires_grad_()

    def held_after_forward(module):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = module(x, index, weights)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.backward(grad_out)
        return held

    liger = liger_experts(native, "convert")
    native.config._experts_implementation = "grouped_mm"
    for module in (liger, native):  # warm-up: library workspaces are allocated on first use and then kept
        held_after_forward(module)
    liger_held = held_after_forward(liger)
    native_held = held_after_forward(native)

    output_and_gate_up = 2 * (tokens * hidden + rows * 2 * intermediate)
    small = 2 * 8 * rows + 4 * CUDA_SHAPE["num_experts"] + 64 * 1024  # permutation, inverse, offsets, slack
    assert liger_held <= output_and_gate_up + small
    assert native_held - liger_held >= 2 * (2 * rows * hidden)
