"""Tiny DeepSeek-V3 configurations and helpers shared by the tests (CPU-sized: the interpreter is slow)."""

import torch
from transformers import DeepseekV3Config


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """2 layers (1 dense + 1 MoE), MLA with q_lora_rank, 4 routed experts top-2 in 2 groups, 1 shared expert."""
    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    values.update(overrides)
    config = DeepseekV3Config(**values)
    config._attn_implementation = values["attn_implementation"]
    return config


def build_model(config, seed: int = 0, dtype=torch.float32, device="cpu"):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(device=device, dtype=dtype)
    with torch.no_grad():  # a non-zero router bias makes the group choice depend on it
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def random_batch(config, batch: int = 2, seq: int = 8, seed: int = 1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
    return input_ids, input_ids.clone()
