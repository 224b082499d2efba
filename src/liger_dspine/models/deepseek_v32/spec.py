"""What the deepseek_v32 patch (DeepSeek-V3.2) replaces: DeepSeek-V3's swaps on the copies of its classes.

RMSNorm (the q / kv latent norms included), the SwiGLU MLPs and shared experts, the batched routed experts, the router,
the MLA attention (``rope`` / ``recompute_attention``: the Liger MLA forward with the DSA key selection,
``models/deepseek_v3/dsa_attention.py``; transformers 5.24 and later) and the causal LM's loss; and (``indexer``) the
DSA indexer's scores, in one fused kernel instead of transformers' fp32 [B, S, index heads, T] tensor (about 69 GB at
16384 tokens at V3.2's widths). The indexer's ``k_norm`` is an ``nn.LayerNorm`` and stays native.
"""

import dataclasses

from liger_dspine.models.deepseek_v3.family import v3_like_spec
from liger_dspine.patching import ClassSwap

MODELING = "transformers.models.deepseek_v32.modeling_deepseek_v32"

_V3_LIKE = v3_like_spec(
    "deepseek_v32",
    MODELING,
    "DeepseekV32",
    mla_classes="liger_dspine.models.deepseek_v32.modules",
    router_classes="liger_dspine.models.deepseek_v32.modules",
)
DEEPSEEK_V32_SPEC = dataclasses.replace(
    _V3_LIKE,
    swaps=(
        *_V3_LIKE.swaps,
        ClassSwap(
            "indexer", ("DeepseekV32Indexer",), "liger_dspine.models.deepseek_v32.indexer:LigerDeepseekV32Indexer"
        ),
    ),
)
