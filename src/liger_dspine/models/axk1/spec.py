"""What the axk1 patch (A.X-K1) replaces: DeepSeek-V3's swaps on the copies of its classes."""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.axk1.modeling_axk1"

AXK1_SPEC = v3_like_spec(
    "axk1",
    MODELING,
    "AXK1",
    mla_classes="liger_dspine.models.axk1.modules",
    router_classes="liger_dspine.models.axk1.modules",
)
