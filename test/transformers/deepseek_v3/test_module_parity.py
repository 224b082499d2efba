"""Every module the DeepSeek-V3 patch swaps in, against the native module it replaces: forward and backward.

CPU: fp32 through Triton's interpreter, tiny shapes, tolerance 1e-5 (fp32 rounding of a different summation
order). CUDA: bf16 at larger shapes, where the Liger result must be no further from an fp32 reference than twice
the native bf16 module's own error, plus 2**-10 of the reference's largest magnitude (1/8 of bf16's epsilon).

A Liger module is obtained two ways: ``convert`` of a copy of the native module (instance patch) and its own
constructor with the native weights loaded (class-level patch).
"""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules.experts import LigerFusedExperts
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from tiny_models import IGNORE_INDEX
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import modeling_module
from tiny_models import native_experts_class
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

MODELING = modeling_module()
NativeRMSNorm = MODELING.DeepseekV3RMSNorm
NativeMLP = MODELING.DeepseekV3MLP
NativeExperts = native_experts_class()

FP32 = dict(atol=1e-5, rtol=1e-5)
BUILDS = ("convert", "construct")


def converted(native: torch.nn.Module, liger_class) -> torch.nn.Module:
    twin = copy.deepcopy(native)
    liger_class.convert(twin)
    assert type(twin) is liger_class
    return twin


def run(module, inputs: list[torch.Tensor], grad_out: torch.Tensor, **kwargs):
    """(output, input grads, parameter grads) of ``module(*inputs)`` with ``grad_out`` as the output gradient."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    module.zero_grad(set_to_none=True)
    out = module(*inputs, **kwargs)
    out.backward(grad_out)
    input_grads = [x.grad for x in inputs if x.requires_grad]
    param_grads = {name: p.grad for name, p in module.named_parameters()}
    return out.detach(), input_grads, param_grads


def assert_same_results(actual, expected, **tolerance):
    out, input_grads, param_grads = actual
    ref_out, ref_input_grads, ref_param_grads = expected
    torch.testing.assert_close(out, ref_out, **tolerance)
    assert len(input_grads) == len(ref_input_grads)
    for grad, ref in zip(input_grads, ref_input_grads):
        torch.testing.assert_close(grad, ref, **tolerance)
    assert param_grads.keys() == ref_param_grads.keys()
    for name in ref_param_grads:
        torch.testing.assert_close(param_grads[name], ref_param_grads[name], **tolerance, msg=lambda m: f"{name}: {m}")


def native_rms_norm(size: int, eps: float, device="cpu", dtype=torch.float32):
    norm = NativeRMSNorm(size, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(size))
    return norm.to(device=device, dtype=dtype)


# hidden_size (32) and q_lora_rank = kv_lora_rank (16) of the tiny config, and a width not a power of two
@pytest.mark.parametrize("size", [32, 16, 24])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("build", BUILDS)
def test_rms_norm(size, eps, build):
    torch.manual_seed(size)
    native = native_rms_norm(size, eps)
    liger = converted(native, LigerRMSNorm) if build == "convert" else LigerRMSNorm(size, eps=eps)
    if build == "construct":
        liger.load_state_dict(native.state_dict())
    x = 2.0 * torch.randn(3, 5, size)
    grad_out = torch.randn(3, 5, size)
    expected = run(native, [x], grad_out.clone())

    given = grad_out.clone()
    actual = run(liger, [x], given)

    assert_same_results(actual, expected, **FP32)
    # the backward writes into a fresh buffer: the incoming gradient may be shared with another branch
    assert torch.equal(given, grad_out)


def native_mlp(config, intermediate_size=None, device="cpu", dtype=torch.float32):
    return NativeMLP(config, intermediate_size=intermediate_size).to(device=device, dtype=dtype)


# a dense layer's MLP (intermediate_size) and a shared expert (moe_intermediate_size * n_shared_experts)
@pytest.mark.parametrize("intermediate_size", [None, 16], ids=["dense", "shared_expert"])
@pytest.mark.parametrize("build", BUILDS)
def test_swiglu_mlp(intermediate_size, build):
    torch.manual_seed(0)
    config = tiny_deepseek_v3_config()
    native = native_mlp(config, intermediate_size)
    if build == "convert":
        liger = converted(native, LigerSwiGLUMLP)
    else:
        liger = LigerSwiGLUMLP(config, intermediate_size=intermediate_size)
        liger.load_state_dict(native.state_dict())
    assert liger.intermediate_size == native.intermediate_size
    x = torch.randn(2, 5, config.hidden_size)
    grad_out = torch.randn(2, 5, config.hidden_size)

    assert_same_results(run(liger, [x], grad_out.clone()), run(native, [x], grad_out.clone()), **FP32)


def test_swiglu_mlp_refuses_other_activations():
    config = tiny_deepseek_v3_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        LigerSwiGLUMLP(config)
    with pytest.raises(ValueError, match="gelu"):
        LigerSwiGLUMLP.convert(NativeMLP(config))


def native_experts(config, device="cpu", dtype=torch.float32):
    config._experts_implementation = "eager"  # the reference: transformers' per-expert loop
    experts = NativeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
    return experts.to(device=device, dtype=dtype)


def random_routing(tokens: int, num_experts: int, top_k: int, used_experts: int, device="cpu"):
    """Distinct experts per token drawn among the first ``used_experts``; weights in (0.1, 1)."""
    scores = torch.rand(tokens, num_experts)
    scores[:, used_experts:] = -1.0
    index = scores.topk(top_k, dim=-1).indices
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k)
    return index.to(device), weights.to(device)


@pytest.mark.parametrize("build", BUILDS)
def test_fused_experts(build):
    torch.manual_seed(0)
    config = tiny_deepseek_v3_config()  # 4 experts, hidden 32, moe_intermediate 16, top-2
    native = native_experts(config)
    if build == "convert":
        liger = converted(native, LigerFusedExperts)
    else:
        liger = LigerFusedExperts(config)
        liger.load_state_dict(native.state_dict())
    tokens, top_k = 12, config.num_experts_per_tok
    # the last expert gets no token: its weight gradients must be zero
    index, weights = random_routing(tokens, config.n_routed_experts, top_k, config.n_routed_experts - 1)
    x = torch.randn(tokens, config.hidden_size)
    grad_out = torch.randn(tokens, config.hidden_size)

    expected = run(native, [x, index, weights], grad_out.clone())
    actual = run(liger, [x, index, weights], grad_out.clone())

    assert_same_results(actual, expected, **FP32)
    assert len(actual[1]) == 2  # hidden states and routing weights
    assert torch.count_nonzero(actual[2]["gate_up_proj"][-1]) == 0
    assert torch.count_nonzero(actual[2]["down_proj"][-1]) == 0


def test_fused_experts_refuse_biases():
    experts = NativeExperts(tiny_deepseek_v3_config())
    experts.has_bias = True
    with pytest.raises(ValueError, match="bias"):
        LigerFusedExperts.convert(experts)


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config())


def test_patched_training_step_matches_native(native_model):
    """Every swap at once (instance patch, defaults): the lce_forward loss and every parameter gradient."""
    native = copy.deepcopy(native_model).train()
    patched = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=patched)
    input_ids, _ = random_batch(native.config, batch=2, seq=6)
    labels = labels_with_ignored(input_ids)
    assert (labels == IGNORE_INDEX).any()

    native_out, native_grads = loss_and_grads(native, input_ids, labels=labels)
    patched_out, patched_grads = loss_and_grads(patched, input_ids, labels=labels)

    assert patched_out.logits is None
    torch.testing.assert_close(patched_out.loss, native_out.loss, **FP32)
    assert_grads_close(patched_grads, native_grads, **FP32)


# CUDA: bf16 at larger shapes.


def assert_bf16_close(actual: torch.Tensor, native: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Liger bf16 no further from the fp32 reference than 2x native bf16, plus 2**-10 of the reference's scale."""
    reference = reference.float()
    err = (actual.float() - reference).abs().max().item()
    native_err = (native.float() - reference).abs().max().item()
    floor = 2.0**-10 * reference.abs().max().item()
    assert err <= 2.0 * native_err + floor, f"{what}: liger error {err:.3g}, native bf16 error {native_err:.3g}"


def assert_bf16_results(actual, native, reference, what: str) -> None:
    assert_bf16_close(actual[0], native[0], reference[0], f"{what} output")
    for i, (a, n, r) in enumerate(zip(actual[1], native[1], reference[1])):
        assert_bf16_close(a, n, r, f"{what} input grad {i}")
    for name in reference[2]:
        assert_bf16_close(actual[2][name], native[2][name], reference[2][name], f"{what} {name} grad")


def bf16_parity(native_fp32: torch.nn.Module, liger_class, inputs, grad_out, what: str, **kwargs):
    native_bf16 = copy.deepcopy(native_fp32).to(torch.bfloat16)
    # the reference: native module in fp32 on the same bf16-rounded weights and inputs
    reference_module = copy.deepcopy(native_bf16).float()
    liger = converted(native_bf16, liger_class)
    bf16_inputs = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs]
    fp32_inputs = [x.float() if x.is_floating_point() else x for x in bf16_inputs]
    grad_bf16 = grad_out.to(torch.bfloat16)
    reference = run(reference_module, fp32_inputs, grad_bf16.float(), **kwargs)
    native = run(native_bf16, bf16_inputs, grad_bf16.clone(), **kwargs)
    actual = run(liger, bf16_inputs, grad_bf16.clone(), **kwargs)
    assert_bf16_results(actual, native, reference, what)


@pytest.mark.cuda
@pytest.mark.parametrize("size", [7168, 1536, 512])  # DeepSeek-V3 hidden, q_lora_rank, kv_lora_rank
def test_rms_norm_bf16_cuda(size):
    torch.manual_seed(0)
    native = native_rms_norm(size, 1e-6, device="cuda")
    x = 2.0 * torch.randn(4, 256, size, device="cuda")
    grad_out = torch.randn(4, 256, size, device="cuda")
    bf16_parity(native, LigerRMSNorm, [x], grad_out, f"RMSNorm {size}")


@pytest.mark.cuda
@pytest.mark.parametrize("intermediate_size", [2816, 512], ids=["dense", "shared_expert"])
def test_swiglu_mlp_bf16_cuda(intermediate_size):
    torch.manual_seed(0)
    config = tiny_deepseek_v3_config(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512)
    native = native_mlp(config, intermediate_size, device="cuda")
    x = torch.randn(4, 256, 1024, device="cuda")
    grad_out = torch.randn(4, 256, 1024, device="cuda")
    bf16_parity(native, LigerSwiGLUMLP, [x], grad_out, "SwiGLU MLP")


@pytest.mark.cuda
def test_fused_experts_bf16_cuda():
    torch.manual_seed(0)
    config = tiny_deepseek_v3_config(
        hidden_size=1024, moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=4, n_group=4
    )
    native = native_experts(config, device="cuda")
    tokens = 1024
    index, weights = random_routing(tokens, 16, 4, 16, device="cuda")
    x = torch.randn(tokens, 1024, device="cuda")
    grad_out = torch.randn(tokens, 1024, device="cuda")
    bf16_parity(native, LigerFusedExperts, [x, index, weights], grad_out, "fused experts")


@pytest.mark.cuda
def test_patched_training_step_bf16_cuda():
    config = tiny_deepseek_v3_config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        max_position_embeddings=1024,
    )
    fp32 = build_model(config, device="cuda").train()
    native = copy.deepcopy(fp32).to(torch.bfloat16)
    reference = copy.deepcopy(native).float()
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    input_ids, _ = random_batch(config, batch=2, seq=512, device="cuda")
    labels = labels_with_ignored(input_ids)

    ref_out, _ = loss_and_grads(reference, input_ids, labels=labels)
    native_out, _ = loss_and_grads(native, input_ids, labels=labels)
    patched_out, _ = loss_and_grads(patched, input_ids, labels=labels)

    # bf16 routing may pick other experts for a few tokens: compare the loss only, at bf16 scale
    native_err = abs(native_out.loss.item() - ref_out.loss.item())
    patched_err = abs(patched_out.loss.item() - ref_out.loss.item())
    assert patched_err <= 2.0 * native_err + 1e-2 * ref_out.loss.item()
