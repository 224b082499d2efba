"""DeepSeek-V2's MLA attention and softmax router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
DeepSeek-V2 turns each rope pair in place (``view_as_complex(x) * freqs_cis``): the attention runs the MLA kernels in
the "pairs" layout, with cos / sin the real and imaginary parts of ``freqs_cis``.
"""

from transformers.models.deepseek_v2 import modeling_deepseek_v2

from liger_dspine.models.deepseek_v2.router import LigerSoftmaxTopkRouter
from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention


class LigerDeepseekV2Attention(LigerMLAAttention, modeling_deepseek_v2.DeepseekV2Attention):
    """DeepSeek-V2's MLA with its in-place pair RoPE fused into the query and key assembly."""

    def _liger_rope_layout(self) -> str:
        return "pairs"

    def _liger_angles(self, position_embeddings):
        """``freqs_cis [B, S, R / 2]`` complex (the attention scaling included) -> its cos and sin."""
        return position_embeddings.real, position_embeddings.imag


class LigerFP8DeepseekV2Attention(LigerDeepseekV2Attention):
    """``LigerDeepseekV2Attention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerDeepseekV2RecomputeAttention(LigerDeepseekV2Attention):
    """``LigerDeepseekV2Attention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True


if hasattr(modeling_deepseek_v2, "DeepseekV2TopkRouter"):  # transformers >= 5.17; before, the MoE block routes

    class LigerDeepseekV2TopkRouter(LigerSoftmaxTopkRouter, modeling_deepseek_v2.DeepseekV2TopkRouter):
        """DeepSeek-V2's softmax router ("greedy" or "group_limited_greedy") with the selection in one kernel."""
else:
    LigerDeepseekV2TopkRouter = None  # no router class to replace: the spec's swap of it is skipped
