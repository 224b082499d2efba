"""What the youtu patch (Youtu-LLM) replaces: DeepSeek-V3's swaps on the copies of its classes."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.youtu.modeling_youtu"

YOUTU_SPEC = v3_like_spec(
    "youtu",
    MODELING,
    "Youtu",
    mla_classes="liger_dspine.models.youtu.modules",
    router_classes=None,
)
