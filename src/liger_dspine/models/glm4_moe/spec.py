"""What the glm4_moe patch (GLM-4.5 / 4.6 / 4.7) replaces: DeepSeek-V3's swaps on the copies of its classes."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.glm4_moe.modeling_glm4_moe"

GLM4_MOE_SPEC = v3_like_spec(
    "glm4_moe",
    MODELING,
    "Glm4Moe",
    mla_classes=None,
    router_classes="liger_dspine.models.glm4_moe.modules",
)
