"""What the DeepSeek-V3 patch replaces, as data: each swap names the option that enables it.

- ``rms_norm``: final norm, input / post-attention norms, q_a_layernorm (with q_lora_rank), kv_a_layernorm.
- ``swiglu``: dense MLPs and shared experts; with it, the batched routed experts (``DeepseekV3NaiveMoe`` before
  transformers 5.9) on grouped GEMMs keeping only the gate/up output for backward (``grouped_experts``, the default)
  or through liger-kernel's fused MoE (``fused_experts``).
- ``rope``: MLA with the interleaved partial RoPE and the query / key assembly in Triton kernels;
  ``recompute_attention`` the same, keeping only the latents for backward (opt-in memory saver).
- ``moe_router``: sigmoid + grouped top-k routing in one kernel (the layout of transformers >= 5.13, and before it).
- the loss options: the causal LM's forward.
"""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.deepseek_v3.modeling_deepseek_v3"

DEEPSEEK_V3_SPEC = v3_like_spec(
    "deepseek_v3",
    MODELING,
    "DeepseekV3",
    mla_classes="liger_dspine.models.deepseek_v3.attention",
    router_classes="liger_dspine.models.deepseek_v3.router",
)
