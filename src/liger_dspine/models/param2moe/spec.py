"""What the param2moe patch (Param2-MoE) replaces: its config builds ``Glm4MoeForCausalLM``, so GLM-4.5's swaps on
the classes of ``modeling_glm4_moe``, with GLM-4.5's router class (a class-level patch of either model type patches
the other's models too; the engine keeps a swap both hold until both are reverted)."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec
from liger_dspine.models.glm4_moe.spec import MODELING

PARAM2MOE_SPEC = v3_like_spec(
    "param2moe",
    MODELING,
    "Glm4Moe",
    mla_classes=None,
    router_classes="liger_dspine.models.glm4_moe.modules",
)
