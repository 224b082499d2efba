"""What the dots1 patch (dots.llm1) replaces: DeepSeek-V3's swaps on the copies of its classes."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.dots1.modeling_dots1"

DOTS1_SPEC = v3_like_spec(
    "dots1",
    MODELING,
    "Dots1",
    mla_classes=None,
    router_classes="liger_dspine.models.dots1.modules",
)
