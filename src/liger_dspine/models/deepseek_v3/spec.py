"""What the DeepSeek-V3 patch replaces, as data: each swap names the option that enables it."""

from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import ModuleCheck
from liger_dspine.patching import PatchSpec

MODELING = "transformers.models.deepseek_v3.modeling_deepseek_v3"

# What the routing kernel and the experts read must agree with the config (E experts, hidden H, expert width I).
MOE_CHECKS = (
    ModuleCheck(("DeepseekV3MoE",), children=("gate", "experts", "shared_experts")),
    ModuleCheck(
        ("DeepseekV3TopkRouter",),
        shapes=(
            ("weight", lambda c: (c.n_routed_experts, c.hidden_size)),
            ("e_score_correction_bias", lambda c: (c.n_routed_experts,)),
        ),
    ),
    ModuleCheck(
        ("DeepseekV3Experts", "DeepseekV3NaiveMoe"),
        shapes=(
            ("gate_up_proj", lambda c: (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)),
            ("down_proj", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)),
        ),
    ),
)

DEEPSEEK_V3_SPEC = PatchSpec(
    model_type="deepseek_v3",
    module=MODELING,
    base_classes=(f"{MODELING}:DeepseekV3PreTrainedModel",),
    swaps=(
        # final norm, input / post-attention norms, q_a_layernorm (with q_lora_rank), kv_a_layernorm
        ClassSwap("rms_norm", ("DeepseekV3RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
        # dense MLPs and shared experts
        ClassSwap("swiglu", ("DeepseekV3MLP",), "liger_dspine.modules.swiglu:LigerSwiGLUMLP"),
        # batched routed experts (DeepseekV3NaiveMoe before transformers 5.9)
        ClassSwap(
            "fused_experts",
            ("DeepseekV3Experts", "DeepseekV3NaiveMoe"),
            "liger_dspine.modules.experts:LigerFusedExperts",
        ),
        # batched routed experts on grouped GEMMs, keeping only the gate/up output for backward (the default)
        ClassSwap(
            "grouped_experts",
            ("DeepseekV3Experts", "DeepseekV3NaiveMoe"),
            "liger_dspine.modules.grouped_experts:LigerGroupedExperts",
        ),
        # MLA with the interleaved partial RoPE and the query / key assembly in Triton kernels
        ClassSwap(
            "rope", ("DeepseekV3Attention",), "liger_dspine.models.deepseek_v3.attention:LigerDeepseekV3Attention"
        ),
        # the same, keeping only the latents for backward (opt-in memory saver)
        ClassSwap(
            "recompute_attention",
            ("DeepseekV3Attention",),
            "liger_dspine.models.deepseek_v3.attention:LigerDeepseekV3RecomputeAttention",
        ),
        # sigmoid + grouped top-k routing in one kernel (the layout of transformers >= 5.13, and before it)
        ClassSwap(
            "moe_router", ("DeepseekV3TopkRouter",), "liger_dspine.models.deepseek_v3.router:LigerDeepseekV3TopkRouter"
        ),
        MethodSwap(
            "moe_router",
            "DeepseekV3MoE",
            "route_tokens_to_experts",
            "liger_dspine.models.deepseek_v3.router:liger_route_tokens_to_experts",
            required=False,
        ),
        MethodSwap(
            "fused_linear_cross_entropy",
            "DeepseekV3ForCausalLM",
            "forward",
            "liger_dspine.modules.causal_lm_forward:lce_forward",
        ),
        MethodSwap(
            "vocab_chunked_lce",
            "DeepseekV3ForCausalLM",
            "forward",
            "liger_dspine.modules.causal_lm_forward:lce_forward_vocab_chunked",
        ),
        MethodSwap(
            "cross_entropy", "DeepseekV3ForCausalLM", "forward", "liger_dspine.modules.causal_lm_forward:ce_forward"
        ),
    ),
    checks=MOE_CHECKS,
)
