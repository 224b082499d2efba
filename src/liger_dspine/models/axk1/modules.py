"""A.X-K1's MLA attention and MoE router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.axk1.modeling_axk1 import AXK1Attention
from transformers.models.axk1.modeling_axk1 import AXK1TopkRouter

from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention
from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerAXK1Attention(LigerMLAAttention, AXK1Attention):
    """A.X-K1's MLA (a copy of DeepSeek-V3's) with the interleaved RoPE fused into the query and key assembly."""


class LigerFP8AXK1Attention(LigerAXK1Attention):
    """``LigerAXK1Attention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerAXK1RecomputeAttention(LigerAXK1Attention):
    """``LigerAXK1Attention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True


class LigerAXK1TopkRouter(LigerTopkRouter, AXK1TopkRouter):
    """A.X-K1's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
