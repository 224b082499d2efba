"""DeepSeek-V3.2's MoE router and DSA attention with liger-dspine's forwards.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

from liger_dspine.models.deepseek_v3.dsa_attention import LigerDSAAttention
from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerDeepseekV32TopkRouter(LigerTopkRouter, DeepseekV32TopkRouter):
    """DeepSeek-V3.2's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""


class LigerDeepseekV32Attention(LigerDSAAttention, DeepseekV32Attention):
    """DeepSeek-V3.2's MLA with its DSA key selection, the query and key assembly in the Liger kernels."""


class LigerFP8DeepseekV32Attention(LigerDeepseekV32Attention):
    """``LigerDeepseekV32Attention`` with the MLA projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerDeepseekV32RecomputeAttention(LigerDeepseekV32Attention):
    """``LigerDeepseekV32Attention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True
