"""Youtu-LLM's MLA attention with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.youtu.modeling_youtu import YoutuAttention

from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention


class LigerYoutuAttention(LigerMLAAttention, YoutuAttention):
    """Youtu-LLM's MLA (a copy of DeepSeek-V3's) with the interleaved RoPE fused into the query and key assembly."""


class LigerFP8YoutuAttention(LigerYoutuAttention):
    """``LigerYoutuAttention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerYoutuRecomputeAttention(LigerYoutuAttention):
    """``LigerYoutuAttention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True
