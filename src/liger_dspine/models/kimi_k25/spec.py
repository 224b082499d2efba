"""What the kimi_k25 patch (Kimi K2.5 / K2.6) replaces.

Its text model is DeepSeek-V3's own (``text_config`` is a ``deepseek_v3`` config, built through ``AutoModel``), so
the swaps are DeepSeek-V3's, on the classes of ``modeling_deepseek_v3``: RMSNorm, SwiGLU MLPs and shared experts, the
batched routed experts, MLA with the interleaved RoPE, the router. The loss options replace
``Kimi_K25ForConditionalGeneration.forward`` (its own forwards: text-only batches, ``text_config``'s vocabulary).
The vision tower and the projector (LayerNorm, GELU MLPs, their attention) stay native.

At class level the swaps rebind DeepSeek-V3's classes, which plain DeepSeek-V3 models share: a class-level
``kimi_k25`` patch patches their modules too, and its revert restores them.
"""

from liger_dspine.models.deepseek_v3.family import v3_like_spec
from liger_dspine.models.deepseek_v3.spec import MODELING as DEEPSEEK_V3_MODELING

MODELING = "transformers.models.kimi_k25.modeling_kimi_k25"

KIMI_K25_SPEC = v3_like_spec(
    "kimi_k25",
    DEEPSEEK_V3_MODELING,
    "DeepseekV3",
    mla_classes="liger_dspine.models.deepseek_v3.attention",
    router_classes="liger_dspine.models.deepseek_v3.router",
    causal_lm="Kimi_K25ForConditionalGeneration",
    causal_lm_module=MODELING,
    base_class=f"{MODELING}:Kimi_K25PreTrainedModel",
    forwards="liger_dspine.models.kimi_k25.forward",
)
