"""``fp8=True`` of the family's patches (MLA, DSA, dense MLA, GQA MoE models and DeepSeek-V4): which modules it
swaps, that their GEMMs run on FP8 operands (the reference path on a CPU), its refusals, and a training step against
native.

The FP8 GEMMs themselves are checked elementwise against float64 bounds in test/transformers/ops/test_fp8_*.py;
here the question is the wiring: the MLPs and experts of a patched model compute with the FP8 ops and the model's
own weights, and everything else is left as the bf16 patch has it.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine import revert_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.modules.grouped_experts import LigerFP8GroupedExperts  # noqa: E402
from liger_dspine.modules.grouped_experts import LigerGroupedExperts  # noqa: E402
from liger_dspine.modules.swiglu import LigerFP8SwiGLUMLP  # noqa: E402
from liger_dspine.modules.swiglu import LigerSwiGLUMLP  # noqa: E402
from liger_dspine.ops.fp8_linear import fp8_linear  # noqa: E402
from liger_dspine.ops.liger_kernel_ops import silu_mul  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_models import tiny_deepseek_v3_config  # noqa: E402

# e4m3 keeps 3 mantissa bits: each quantised operand is off by at most 2^-4 relative (normal range), so a product of
# two is off by at most 2 * 2^-4 + 2^-8 relative to sum |a||b|. A gradient that passes through several FP8 GEMMs
# adds a bound like that per GEMM; three on the way give the 0.39 below, a norm-wise sanity bound for the whole
# gradient (the elementwise bounds are the op tests').
PRODUCT_BOUND = 2 * 2.0**-4 + 2.0**-8
GRADIENT_BOUND = 3 * PRODUCT_BOUND


# every FP8 GEMM's dims multiples of 16: kv_a_proj_with_mqa's kv_lora_rank + rope, the heads' widths
FP8_WIDTHS = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)


def build(model_type: str) -> tuple[nn.Module, object, int]:
    """(fp32 tiny model, its apply function, vocabulary size)."""
    if model_type == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**FP8_WIDTHS)).float()
        return model, apply_liger_kernel_to_deepseek_v3, 96
    case = CASES[model_type]
    if "text_config" in case.config_values:  # a multimodal model (Kimi K2.5): the widths are its text model's
        text_config = {**case.config_values["text_config"], **FP8_WIDTHS}
        return case.build(text_config=text_config), case.apply_fn(), case.vocab_size
    return case.build(**FP8_WIDTHS), case.apply_fn(), case.vocab_size


def mlps_and_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (LigerSwiGLUMLP, LigerGroupedExperts))]


def patched_kinds(model_type: str, fp8: bool) -> set[type]:
    """The classes of the MLPs and experts the patch builds: no experts in a dense model."""
    mlp, experts = (LigerFP8SwiGLUMLP, LigerFP8GroupedExperts) if fp8 else (LigerSwiGLUMLP, LigerGroupedExperts)
    return {mlp} if model_type in DENSE_MLA_MODELS else {mlp, experts}


DENSE_MLA_MODELS = ["youtu", "minicpm3"]  # no routed experts
MLA_MODELS = ["deepseek_v3", "deepseek_v2", "glm4_moe_lite", "kimi_k25", "axk1", "mistral4", "mistral3"]
MLA_MODELS += DENSE_MLA_MODELS
DSA_MODELS = ["deepseek_v32", "glm_moe_dsa"]  # MLA with the Liger forward from transformers 5.24 (rope=None)
GQA_MOE_MODELS = ["dots1", "glm4_moe", "param2moe", "minicpm5_moe"]  # their attention stays native
V4_MODELS = ["deepseek_v4"]  # its attention keeps the bf16 swap


@pytest.mark.parametrize("model_type", MLA_MODELS + DSA_MODELS + GQA_MOE_MODELS + V4_MODELS)
def test_fp8_swaps_the_mlps_and_experts_and_trains_close_to_native(model_type):
    native, apply, vocab = build(model_type)
    bf16_patched, fp8_patched = copy.deepcopy(native), copy.deepcopy(native)
    apply(model=bf16_patched)
    report = apply(model=fp8_patched, fp8=True)
    experts = model_type not in DENSE_MLA_MODELS
    assert "LigerFP8SwiGLUMLP" in str(report) and ("LigerFP8GroupedExperts" in str(report)) == experts
    assert {type(m) for m in mlps_and_experts(fp8_patched)} == patched_kinds(model_type, fp8=True)
    assert {type(m) for m in mlps_and_experts(bf16_patched)} == patched_kinds(model_type, fp8=False)
    # the attention is the bf16 patch's class with fp8 on; the rest of the patch is the bf16 one's
    swapped = set()
    for fp8_module, bf16_module in zip(fp8_patched.modules(), bf16_patched.modules(), strict=True):
        if type(fp8_module) is not type(bf16_module):
            assert issubclass(type(fp8_module), type(bf16_module)) and type(fp8_module).fp8, type(fp8_module)
            swapped.add(type(fp8_module).__name__)
    liger_attention = any(
        type(m).__name__.endswith("Attention") and type(m).__module__.startswith("liger_dspine")
        for m in bf16_patched.modules()
    )
    assert liger_attention == (model_type in MLA_MODELS + V4_MODELS) or model_type in DSA_MODELS
    fp8_attention = liger_attention and model_type not in V4_MODELS
    assert any(name.endswith("Attention") for name in swapped) == fp8_attention, swapped

    input_ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, model in (("native", native), ("bf16", bf16_patched), ("fp8", fp8_patched)):
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        losses[name] = out.loss.detach()
    assert torch.allclose(losses["bf16"], losses["native"], rtol=1e-5)
    assert torch.allclose(losses["fp8"], losses["native"], rtol=PRODUCT_BOUND)
    assert losses["fp8"] != losses["bf16"]  # the FP8 GEMMs ran

    # the whole gradient, norm-wise: a single expert's can differ more where a perturbed input flips its routes
    def gradient(model):
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    error = (gradient(fp8_patched) - gradient(native)).norm() / gradient(native).norm()
    assert 0 < error <= GRADIENT_BOUND, float(error)


def test_the_fp8_mlp_computes_with_the_fp8_ops_and_its_own_weights():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    torch.manual_seed(0)
    mlp = DeepseekV3MLP(tiny_deepseek_v3_config())
    LigerFP8SwiGLUMLP.convert(mlp)
    x = torch.randn(2, 5, 32, requires_grad=True)
    out = mlp(x)
    gate = fp8_linear(x.detach(), mlp.gate_proj.weight.detach())
    up = fp8_linear(x.detach(), mlp.up_proj.weight.detach())
    product = silu_mul(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])).view(gate.shape)
    expected = fp8_linear(product, mlp.down_proj.weight.detach())
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in mlp.parameters())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(fused_experts=True), "fused_experts=False"),
        (dict(swiglu=False), "swiglu=True"),
        (dict(grouped_experts=False), "grouped_experts=True"),
        (dict(fp8="yes"), "must be True or False"),
    ],
)
def test_fp8_refuses_what_it_cannot_run(options, message):
    model, apply, _ = build("deepseek_v3")
    with pytest.raises((ValueError, TypeError), match=message):
        apply(model=model, **{"fp8": True, **options})


@pytest.mark.parametrize("model_type", DENSE_MLA_MODELS)
def test_fp8_on_a_dense_model_needs_swiglu_only(model_type):
    model, apply, _ = build(model_type)
    with pytest.raises(ValueError, match="needs swiglu=True"):
        apply(model=model, fp8=True, swiglu=False)
    assert _liger_modules(model) == []


def _liger_modules(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("liger_dspine")]


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("deepseek_v3", dict(kv_lora_rank=8), "kv_a_proj_with_mqa.out_features': 24"),  # 8 + rope 16
        ("deepseek_v3", dict(intermediate_size=40), "gate_proj.out_features': 40"),  # the dense MLP
        # 2 shared experts: their MLP (48 wide) passes, the routed experts (24 wide) do not
        ("deepseek_v3", dict(moe_intermediate_size=24, n_shared_experts=2), "'expert width': 24"),
        ("deepseek_v3", dict(attention_bias=True), "q_a_proj has one"),
        ("deepseek_v2", dict(v_head_dim=6), "o_proj.in_features': 24"),  # 4 heads x 6
        ("glm4_moe_lite", dict(q_lora_rank=24), "q_a_proj.out_features': 24"),
    ],
)
def test_fp8_refuses_a_model_it_cannot_run_before_changing_it(model_type, overrides, message):
    """A dim an FP8 GEMM cannot take (not a multiple of 16) or a projection bias is refused when a built model is
    patched, naming the projection, and the model is left as it was (not at its first forward)."""
    if model_type == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**{**FP8_WIDTHS, **overrides})).float()
        apply = apply_liger_kernel_to_deepseek_v3
    else:
        case = CASES[model_type]
        model, apply = case.build(**{**FP8_WIDTHS, **overrides}), case.apply_fn()
    with pytest.raises(ValueError, match=message):
        apply(model=model, fp8=True)
    assert _liger_modules(model) == []
    apply(model=model)  # the bf16 patch takes it
    assert _liger_modules(model)


def test_an_fp8_projection_with_a_bias_is_refused_by_name():
    model, apply, _ = build("deepseek_v3")
    apply(model=model, fp8=True)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.bias = nn.Parameter(torch.zeros(mlp.up_proj.out_features))
    with pytest.raises(ValueError, match="up_proj has one"):
        mlp(torch.randn(1, 3, 32))


def test_fp8_at_class_level_builds_fp8_modules_and_reverts():
    from transformers import DeepseekV3ForCausalLM

    apply_liger_kernel_to_deepseek_v3(fp8=True)
    try:
        model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config())
        assert {type(m) for m in mlps_and_experts(model)} == {LigerFP8SwiGLUMLP, LigerFP8GroupedExperts}
    finally:
        revert_liger_kernel_to_deepseek_v3()
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config())
    assert not mlps_and_experts(model)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "youtu", "dots1", "mistral3", "glm_moe_dsa"])
def test_fp8_at_class_level_on_a_family_model_builds_fp8_modules_and_reverts(model_type):
    case = CASES[model_type]
    case.modeling_or_skip()
    case.apply_fn()(fp8=True)
    try:
        model = case.build()
        assert {type(m) for m in mlps_and_experts(model)} == patched_kinds(model_type, fp8=True)
    finally:
        case.revert_fn()()
    assert not mlps_and_experts(case.build())


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "youtu", "deepseek_v4"])
def test_fp8_trains_a_bf16_model_on_cuda_close_to_the_bf16_patch(model_type):
    """The CUDA FP8 GEMMs (torch's scaled matmuls, the Triton quantisers) in an MLA MoE, a GQA MoE, a dense MLA
    model and DeepSeek-V4 (its clamped MLPs and experts), against the bf16 patch of the same bf16 weights."""
    if torch.cuda.get_device_capability() not in ((9, 0), (10, 0)):
        pytest.skip("the FP8 grouped GEMMs run on compute capability 9.0 / 10.0")
    if model_type == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        torch.manual_seed(0)
        config = tiny_deepseek_v3_config(**FP8_WIDTHS, hidden_size=64, attn_implementation="sdpa")
        native, apply, vocab = DeepseekV3ForCausalLM(config), apply_liger_kernel_to_deepseek_v3, 96
    else:
        native, apply, vocab = build(model_type)
    bf16_patched = native.to("cuda", torch.bfloat16)
    fp8_patched = copy.deepcopy(bf16_patched)
    apply(model=bf16_patched)
    apply(model=fp8_patched, fp8=True)
    assert any(isinstance(m, LigerFP8SwiGLUMLP) for m in fp8_patched.modules())
    input_ids = torch.randint(0, vocab, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses, gradients = [], []
    for model in (bf16_patched, fp8_patched):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses.append(loss.float())
        gradients.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(losses[1], losses[0], rtol=PRODUCT_BOUND)
    error = (gradients[1] - gradients[0]).norm() / gradients[0].norm()
    assert torch.isfinite(gradients[1]).all() and 0 < error <= GRADIENT_BOUND, float(error)
