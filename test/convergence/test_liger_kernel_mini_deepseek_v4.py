"""liger-kernel's mini-model convergence check for DeepSeek-V4, with this package's apply_liger_kernel_to_deepseek_v4
in place of liger-kernel's.

As liger-kernel's test does: seed 42, a class-level patch before the model is built (``rope=False, swiglu=False``,
as liger-kernel passes for V4, so the norm, the loss and this package's keyword-only defaults are what run), AdamW
over 32 steps at lr 1e-5, then an eval step with ``skip_logits=False``; every step's loss, the eval top-k log-probs and
every weight, native against patched, within liger-kernel's ``mini_deepseek_v4`` tolerances. liger-kernel's mini
config: 4 layers (HCA, CSA, two sliding), two hash-routed and two learned MoE layers. Batches are random tokens (the
tokenized dataset liger-kernel trains on is not shipped here). bf16 and fp32 run on CUDA; on a CPU the fp32 check runs
with a small vocabulary for a few steps (Triton's interpreter).
"""

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v4
from liger_dspine import revert_liger_kernel_to_deepseek_v4

transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

MINI = dict(
    vocab_size=32000,
    hidden_size=32,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=8,
    num_experts_per_tok=2,
    n_routed_experts=4,
    hc_mult=2,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=4,
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "sliding_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    max_position_embeddings=128,
)
# (steps, batch, seq, config) on CUDA and on a CPU
SHAPES = {"cuda": (32, 16, 128, MINI), "cpu": (3, 2, 16, dict(MINI, vocab_size=96))}
TOP_K = 20
# (loss atol, loss rtol, log-prob atol, log-prob rtol, param atol, param rtol): liger-kernel's mini_deepseek_v4 rows,
# the same with and without logits
TOLERANCES = {
    torch.float32: (1e-5, 2e-3, 1e-1, 1e-2, 5e-3, 1e-5),
    torch.bfloat16: (1e-2, 5e-2, 1e-1, 1e-2, 1e-2, 1e-2),
}


def run(dtype, device, fused: bool, with_liger: bool):
    steps, batch, seq, values = SHAPES["cuda" if device == "cuda" else "cpu"]
    torch.manual_seed(42)
    revert_liger_kernel_to_deepseek_v4()
    if with_liger:
        options = dict(rope=False, rms_norm=True, swiglu=False, cross_entropy=False)
        apply_liger_kernel_to_deepseek_v4(fused_linear_cross_entropy=fused, **options)
    try:
        config = transformers_v4.DeepseekV4Config(**values)
        config._attn_implementation = "eager"  # transformers has no sdpa path for V4
        model = transformers_v4.DeepseekV4ForCausalLM(config).to(dtype).to(device)
        generator = torch.Generator().manual_seed(0)
        data = torch.randint(0, config.vocab_size, (steps + 1, batch, seq), generator=generator).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        losses = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(input_ids=data[step], labels=data[step], accum_dtype=torch.float32).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        extra = dict(skip_logits=False) if with_liger else {}
        with torch.no_grad():
            output = model(input_ids=data[steps], labels=data[steps], **extra)
        losses.append(output.loss.item())
        top = torch.log_softmax(output.logits.float(), dim=-1).topk(TOP_K, dim=-1).values
    finally:
        revert_liger_kernel_to_deepseek_v4()
    return torch.tensor(losses), top, model


def check(dtype, device, fused):
    loss_atol, loss_rtol, lp_atol, lp_rtol, p_atol, p_rtol = TOLERANCES[dtype]
    native_losses, native_top, native = run(dtype, device, fused, with_liger=False)
    liger_losses, liger_top, liger = run(dtype, device, fused, with_liger=True)
    torch.testing.assert_close(liger_losses, native_losses, atol=loss_atol, rtol=loss_rtol)
    torch.testing.assert_close(liger_top, native_top, atol=lp_atol, rtol=lp_rtol)
    for (name, p_native), (_, p_liger) in zip(native.named_parameters(), liger.named_parameters()):
        torch.testing.assert_close(p_liger, p_native, atol=p_atol, rtol=p_rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v4_fp32(fused, device):
    check(torch.float32, device, fused)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v4_bf16(fused):
    check(torch.bfloat16, "cuda", fused)
