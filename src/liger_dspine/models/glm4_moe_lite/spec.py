"""What the glm4_moe_lite patch (GLM-4.7-Flash) replaces: DeepSeek-V3's swaps on the copies of its classes."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite"

GLM4_MOE_LITE_SPEC = v3_like_spec(
    "glm4_moe_lite",
    MODELING,
    "Glm4MoeLite",
    mla_classes="liger_dspine.models.glm4_moe_lite.modules",
    router_classes="liger_dspine.models.glm4_moe_lite.modules",
)
