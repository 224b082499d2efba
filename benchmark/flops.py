"""Model FLOPs of a DeepSeek-V3 training step, counted from the matrix products of the architecture.

A multiply-add counts 2 FLOPs. Causal attention scores cost half of the full square. A training step
(forward + backward) counts 3x the forward. Elementwise work, norms, softmax and the router's top-k are left out.
"""


def forward_macs_per_token(config, seq_len: int) -> dict[str, float]:
    """Multiply-adds per token of one forward pass at sequence length ``seq_len``, by component.

    Components: ``attention_projections`` (MLA: q down/up or q, kv down, kv up, output; GQA: q, k, v, output),
    ``attention_scores`` (q.k and p.v over a causal context of seq_len / 2 on average), ``dense_mlp``, ``router``,
    ``routed_experts`` (top-k active experts), ``shared_experts``, ``lm_head``.
    """
    if getattr(config, "model_type", "") == "deepseek_v4":
        return _deepseek_v4_forward_macs_per_token(config, seq_len)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) is None:
        projections_per_layer, scores_per_layer = _gqa_macs_per_layer(config, seq_len)
    else:
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        v_head = config.v_head_dim
        q_lora = getattr(config, "q_lora_rank", None)
        q_proj = hidden * q_lora + q_lora * heads * qk_head if q_lora else hidden * heads * qk_head
        kv_down = hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv_up = config.kv_lora_rank * heads * (config.qk_nope_head_dim + v_head)
        out_proj = heads * v_head * hidden
        projections_per_layer = q_proj + kv_down + kv_up + out_proj
        scores_per_layer = heads * (qk_head + v_head) * seq_len / 2

    layers = config.num_hidden_layers
    kinds = getattr(config, "mlp_layer_types", None)  # GLM-4.7-Flash / V3.2 configs: "dense" / "sparse" per layer
    dense_layers = sum(k == "dense" for k in kinds[:layers]) if kinds else min(config.first_k_dense_replace, layers)
    moe_layers = layers - dense_layers
    experts = config.n_routed_experts
    expert_mlp = 3 * hidden * config.moe_intermediate_size
    return {
        "attention_projections": layers * projections_per_layer,
        "attention_scores": layers * scores_per_layer,
        "dense_mlp": dense_layers * 3 * hidden * config.intermediate_size,
        "router": moe_layers * hidden * experts,
        "routed_experts": moe_layers * config.num_experts_per_tok * expert_mlp,
        "shared_experts": moe_layers * config.n_shared_experts * expert_mlp,
        "lm_head": hidden * config.vocab_size,
    }


def _gqa_macs_per_layer(config, seq_len: int) -> tuple[float, float]:
    """(projections, scores) per token of one GQA layer; MiniCPM5-MoE's query projection also yields its output gate,
    as wide as the query."""
    hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
    query = heads * head_dim * (2 if config.model_type == "minicpm5_moe" else 1)
    projections = hidden * (query + 2 * config.num_key_value_heads * head_dim) + heads * head_dim * hidden
    return projections, heads * 2 * head_dim * seq_len / 2


def _deepseek_v4_forward_macs_per_token(config, seq_len: int) -> dict[str, float]:
    """DeepSeek-V4: q down / up, the shared key-value projection, the grouped low-rank output projection; scores
    over the sliding window and, in compressed layers, over about seq_len / (2 rate) compressed entries; every layer
    MoE. The compressors, the CSA indexer and the hyper-connections are left out."""
    hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
    layers = config.num_hidden_layers
    q_proj = hidden * config.q_lora_rank + config.q_lora_rank * heads * head_dim
    out_proj = heads * head_dim * config.o_lora_rank + config.o_groups * config.o_lora_rank * hidden
    projections = layers * (q_proj + hidden * head_dim + out_proj)
    keys = 0.0
    for kind in config.layer_types[:layers]:
        keys += min(config.sliding_window, seq_len / 2)
        rate = config.compress_rates.get(kind) if kind != "sliding_attention" else None
        keys += seq_len / (2 * rate) if rate else 0.0
    expert_mlp = 3 * hidden * config.moe_intermediate_size
    return {
        "attention_projections": projections,
        "attention_scores": heads * 2 * head_dim * keys,
        "router": layers * hidden * config.n_routed_experts,
        "routed_experts": layers * config.num_experts_per_tok * expert_mlp,
        "shared_experts": layers * config.n_shared_experts * expert_mlp,
        "lm_head": hidden * config.vocab_size,
    }


def train_step_flops(config, batch: int, seq_len: int) -> float:
    """FLOPs of one forward + backward over ``batch`` sequences of ``seq_len`` tokens (3x the forward)."""
    forward_per_token = 2 * sum(forward_macs_per_token(config, seq_len).values())
    return 3 * forward_per_token * batch * seq_len
