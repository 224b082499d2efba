"""What the glm_moe_dsa patch (GLM-5.x) replaces: DeepSeek-V3's swaps on the copies of its classes.

RMSNorm (the q / kv latent norms included), the SwiGLU MLPs and shared experts, the batched routed experts, the router,
the MLA attention (``rope`` / ``recompute_attention``: the Liger MLA forward with the DSA key selection,
``models/deepseek_v3/dsa_attention.py``, transformers 5.24 and later; a layer of indexer type ``"shared"`` reuses the
previous layer's top-k indices, and the attention returns them as a third value) and the causal LM's loss; and
(``indexer``) the DSA indexer's scores, in one fused kernel instead of transformers' fp32 [B, S, index heads, T]
tensor. The indexer's ``k_norm`` is an ``nn.LayerNorm`` and stays native.
"""

import dataclasses

from liger_dspine.models.deepseek_v3.family import v3_like_spec
from liger_dspine.patching import ClassSwap

INDEXER = "liger_dspine.models.glm_moe_dsa.indexer"
MODELING = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"

_V3_LIKE = v3_like_spec(
    "glm_moe_dsa",
    MODELING,
    "GlmMoeDsa",
    mla_classes="liger_dspine.models.glm_moe_dsa.modules",
    router_classes="liger_dspine.models.glm_moe_dsa.modules",
)
GLM_MOE_DSA_SPEC = dataclasses.replace(
    _V3_LIKE,
    swaps=(*_V3_LIKE.swaps, ClassSwap("indexer", ("GlmMoeDsaIndexer",), f"{INDEXER}:LigerGlmMoeDsaIndexer")),
)
