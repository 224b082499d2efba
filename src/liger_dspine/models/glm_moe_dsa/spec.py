"""What the glm_moe_dsa patch (GLM-5.x) replaces: DeepSeek-V3's swaps on the copies of its classes, but the attention.

RMSNorm (the q / kv latent norms included), the SwiGLU MLPs and shared experts, the batched routed experts, the router
and the causal LM's loss. The MLA attention and its DSA indexer stay native: the indexer's top-k indices become a sparse
mask folded into the attention mask, which the shared Liger MLA forward (``models/deepseek_v3/attention.py``) does not
apply. A layer of indexer type ``"shared"`` reuses the previous layer's top-k indices, and the attention returns them as
a third value (the shared forward returns two). The indexer's ``k_norm`` is an ``nn.LayerNorm`` and stays native too.

The indexer's fp32 [B, S, index heads, T] scores are a memory wall at long context (about 69 GB at 16384 tokens at
V3.2's widths); a fused indexer-score + top-k kernel would remove it, and none exists here yet.
"""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"

GLM_MOE_DSA_SPEC = v3_like_spec(
    "glm_moe_dsa",
    MODELING,
    "GlmMoeDsa",
    mla_classes=None,
    router_classes="liger_dspine.models.glm_moe_dsa.modules",
)
