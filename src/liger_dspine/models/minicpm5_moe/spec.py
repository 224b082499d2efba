"""What the minicpm5_moe patch (MiniCPM5-MoE) replaces: DeepSeek-V3's swaps on the copies of its classes.

Its norms, MLPs, experts and MoE block are DeepSeek-V3's; its router computes the logits in fp32 also under autocast
(``LigerMiniCPM5MoeTopkRouter`` does the same). Its gated GQA attention (a sigmoid gate on the output) is not MLA:
it stays native.
"""

from liger_dspine.models.deepseek_v3.family import v3_like_spec

MODELING = "transformers.models.minicpm5_moe.modeling_minicpm5_moe"

MINICPM5_MOE_SPEC = v3_like_spec(
    "minicpm5_moe",
    MODELING,
    "MiniCPM5Moe",
    mla_classes=None,
    router_classes="liger_dspine.models.minicpm5_moe.modules",
)
