"""GLM-4.7-Flash's MLA attention and MoE router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteAttention
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter

from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention
from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerGlm4MoeLiteAttention(LigerMLAAttention, Glm4MoeLiteAttention):
    """GLM-4.7-Flash's MLA (a copy of DeepSeek-V3's) with the interleaved RoPE fused into the query and key assembly."""


class LigerFP8Glm4MoeLiteAttention(LigerGlm4MoeLiteAttention):
    """``LigerGlm4MoeLiteAttention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerGlm4MoeLiteRecomputeAttention(LigerGlm4MoeLiteAttention):
    """``LigerGlm4MoeLiteAttention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True


class LigerGlm4MoeLiteTopkRouter(LigerTopkRouter, Glm4MoeLiteTopkRouter):
    """GLM-4.7-Flash's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
