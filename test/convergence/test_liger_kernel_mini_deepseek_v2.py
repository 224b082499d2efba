"""liger-kernel's mini-model convergence check for DeepSeek-V2, with this package's apply_liger_kernel_to_deepseek_v2
in place of liger-kernel's.

As liger-kernel's test does: seed 42, a class-level patch (rope, rms_norm, swiglu; the fused loss, or neither loss
kernel for the with-logits variant) before the model is built, so both runs start from the same weights only if the
patched classes build them alike; AdamW over the training steps; an eval step with ``skip_logits=False``; then every
step's loss and the eval loss, the eval top-k log-probs and every weight, native against patched, within
liger-kernel's tolerances for its MoE mini models (``mini_qwen3_moe``'s rows). Batches are random tokens (the
tokenized dataset liger-kernel trains on is not shipped here). bf16 and the full-size fp32 run on CUDA; on a CPU the
fp32 check runs on a tiny model for a few steps (Triton's interpreter).
"""

import pytest
import torch
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM

from liger_dspine import apply_liger_kernel_to_deepseek_v2
from liger_dspine import revert_liger_kernel_to_deepseek_v2

MINI = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=None,  # DeepSeek-V2-Lite's layout: q_proj without LoRA
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    topk_method="greedy",
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
TINY = dict(MINI, vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2)
TINY.update(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8)
TINY.update(v_head_dim=8, n_routed_experts=4, max_position_embeddings=128)
# (steps, batch, seq, config) on CUDA and on a CPU
SHAPES = {"cuda": (32, 16, 128, MINI), "cpu": (3, 2, 16, TINY)}
TOP_K = 20
# (loss atol, loss rtol, log-prob atol, log-prob rtol, param atol, param rtol): liger-kernel's mini_qwen3_moe rows
TOLERANCES = {
    (torch.float32, True): (1e-5, 1e-3, 5e-3, 1e-2, 5e-3, 1e-5),
    (torch.float32, False): (1e-5, 1e-3, 5e-3, 1e-5, 5e-3, 1e-5),
    (torch.bfloat16, True): (5e-2, 2e-1, 1e-1, 1e-1, 1e-2, 1e-2),
    (torch.bfloat16, False): (1e-2, 2e-1, 1e-1, 1e-2, 1e-2, 1e-2),
}


def run(dtype, device, fused: bool, with_liger: bool):
    steps, batch, seq, values = SHAPES["cuda" if device == "cuda" else "cpu"]
    torch.manual_seed(42)
    revert_liger_kernel_to_deepseek_v2()
    if with_liger:
        options = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False)
        apply_liger_kernel_to_deepseek_v2(fused_linear_cross_entropy=fused, **options)
    try:
        config = DeepseekV2Config(**values)
        config._attn_implementation = "sdpa" if device == "cuda" else "eager"
        model = DeepseekV2ForCausalLM(config).to(dtype).to(device)
        generator = torch.Generator().manual_seed(0)
        data = torch.randint(0, config.vocab_size, (steps + 1, batch, seq), generator=generator).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        losses = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(input_ids=data[step], labels=data[step]).loss
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
        revert_liger_kernel_to_deepseek_v2()
    return torch.tensor(losses), top, model


def check(dtype, device, fused):
    loss_atol, loss_rtol, lp_atol, lp_rtol, p_atol, p_rtol = TOLERANCES[(dtype, fused)]
    native_losses, native_top, native = run(dtype, device, fused, with_liger=False)
    liger_losses, liger_top, liger = run(dtype, device, fused, with_liger=True)
    torch.testing.assert_close(liger_losses, native_losses, atol=loss_atol, rtol=loss_rtol)
    torch.testing.assert_close(liger_top, native_top, atol=lp_atol, rtol=lp_rtol)
    for (name, p_native), (_, p_liger) in zip(native.named_parameters(), liger.named_parameters()):
        torch.testing.assert_close(p_liger, p_native, atol=p_atol, rtol=p_rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v2_fp32(fused, device):
    check(torch.float32, device, fused)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v2_bf16(fused):
    check(torch.bfloat16, "cuda", fused)
