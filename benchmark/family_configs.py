"""The DeepSeek-family models of the benchmark: real widths at fewer layers, their lengths, and what serves them.

``deepseek_v2``, ``glm4_moe_lite`` and ``minicpm5_moe`` keep their real expert counts (64 experts of width 1408 /
1536, 160 of width 512: they fit one GPU);
``deepseek_v32`` has DeepSeek-V3's widths, so its experts are slimmed as in bench_deepseek_v3.py.
--tiny builds the tests' tiny configuration of the model (test/tiny_family.py) at the same depth.
"""

import importlib
import importlib.util
import os
import sys

# DeepSeek-V2-Lite: no q LoRA, softmax greedy top-6 of 64 experts, 2 shared experts.
DEEPSEEK_V2_LITE = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
)
# GLM-4.7-Flash: sigmoid top-4 of 64 experts with a correction bias, 1 shared expert; the first layer dense.
GLM_47_FLASH = dict(
    vocab_size=154880,
    hidden_size=2048,
    intermediate_size=10240,
    moe_intermediate_size=1536,
    num_attention_heads=20,
    num_key_value_heads=20,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    n_routed_experts=64,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.8,
    norm_topk_prob=True,
)
# DeepSeek-V3.2: DeepSeek-V3's widths with the slimming of bench_deepseek_v3.py, and its DSA indexer.
DEEPSEEK_V32_SLIM = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=1.0,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
)

# MiniCPM5-15B-A2.5B, the config's defaults spelled out: sigmoid top-16 of 160 experts of width 512 with a correction
# bias (one group), 1 shared expert; gated GQA attention, 32 heads of width 128 on 2 key-value heads.
MINICPM5_MOE = dict(
    vocab_size=130560,
    hidden_size=2048,
    intermediate_size=8192,
    moe_intermediate_size=512,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    n_routed_experts=160,
    num_experts_per_tok=16,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=3.66,
    norm_topk_prob=True,
)

# DeepSeek-V4-Flash: the config's defaults (hidden 4096, 64 heads of width 512 on one shared key-value head, window
# 128, CSA rate 4 with a top-512 indexer, HCA rate 128, 4 hyper-connection streams, top-6 routing) with 16 routed
# experts; the layer plan (LAYER_PLANS) has one layer of each attention kind and both router kinds.
DEEPSEEK_V4_SLIM = dict(n_routed_experts=16)

# model type -> (what it stands for, ForCausalLM class prefix, real widths, token counts benchmarked)
FAMILY = {
    "deepseek_v2": ("DeepSeek-V2-Lite-like", "DeepseekV2", DEEPSEEK_V2_LITE, (4096, 16384)),
    "glm4_moe_lite": ("GLM-4.7-Flash-like", "Glm4MoeLite", GLM_47_FLASH, (4096, 16384)),
    "deepseek_v32": ("DeepSeek-V3.2-like", "DeepseekV32", DEEPSEEK_V32_SLIM, (4096, 8192)),
    "deepseek_v4": ("DeepSeek-V4-Flash-like", "DeepseekV4", DEEPSEEK_V4_SLIM, (4096, 7168, 8192)),
    "minicpm5_moe": ("MiniCPM5-MoE-like", "MiniCPM5Moe", MINICPM5_MOE, (4096, 16384)),
}
# models benchmarked at another depth than 2 layers, with their per-layer plan
LAYER_PLANS = {
    "deepseek_v4": dict(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
    ),
}
# liger-dspine options of the benchmark beyond the defaults (swaps that are opt-in)
LIGER_DSPINE_OPTIONS: dict[str, dict] = {}


def family_layers(model: str, default: int = 2) -> int:
    plan = LAYER_PLANS.get(model)
    return len(plan["layer_types"]) if plan else default


def _mlp_layout(model: str, layers: int) -> dict:
    """The first layer dense, the rest MoE, in the form the config class takes (or the model's layer plan)."""
    if model in LAYER_PLANS:
        return dict(LAYER_PLANS[model])
    if model == "deepseek_v2":
        return {}  # first_k_dense_replace=1 is in the widths
    return dict(first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))


def family_config(model: str, layers: int, tiny: bool, max_seq: int):
    from transformers import AutoConfig

    max_positions = max(max_seq, 4096)
    if tiny:
        case = tiny_case(model)
        return case.config(num_hidden_layers=layers, max_position_embeddings=max_positions)
    _, _, widths, _ = FAMILY[model]
    values = dict(widths, **_mlp_layout(model, layers))
    return AutoConfig.for_model(model, num_hidden_layers=layers, max_position_embeddings=max_positions, **values)


def family_class(model: str):
    _, prefix, _, _ = FAMILY[model]
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    return getattr(modeling, f"{prefix}ForCausalLM")


def tiny_case(model: str):
    """The tests' tiny case of ``model`` (test/tiny_family.py), or None."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test"))
    from tiny_family import CASES

    return CASES.get(model)


def why_not_available(model: str, tiny: bool) -> str | None:
    """None where the installed transformers and liger-dspine both have ``model``; else the reason."""
    import transformers

    if importlib.util.find_spec(f"transformers.models.{model}") is None:
        return f"transformers {transformers.__version__} has no {model} (a newer one: run_gpu.sh NEW_TRANSFORMERS=1)"
    from liger_dspine import registry

    if model not in registry.MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-dspine has no {model} patch yet"
    if tiny and tiny_case(model) is None:
        return f"test/tiny_family.py has no tiny {model}"
    return None


def liger_kernel_serves(model: str) -> bool:
    from liger_kernel.transformers import monkey_patch

    return hasattr(monkey_patch, f"apply_liger_kernel_to_{model}")
