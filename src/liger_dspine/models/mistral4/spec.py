"""What the mistral4 patch (Mistral-Small-4) replaces: RMSNorm, SwiGLU MLPs and shared experts, the batched routed
experts, the softmax router (and, before transformers 5.13, the MoE block's routing), MLA with interleaved (or
half-split) RoPE and its query scale, and the loss."""

from liger_dspine.models.deepseek_v2.spec import mla_model_spec

MODELING = "transformers.models.mistral4.modeling_mistral4"

MISTRAL4_SPEC = mla_model_spec(
    "mistral4",
    MODELING,
    "Mistral4",
    modules="liger_dspine.models.mistral4.modules",
    moe_block="Mistral4MoE",
    # transformers < 5.13 selects the experts in the MoE block
    route_method="liger_dspine.models.deepseek_v2.router:liger_top2_route_tokens_to_experts",
)
