"""MiniCPM3's MLA attention with liger-dspine's forward.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules. MiniCPM3 turns its
rope columns with ``rotate_half``: the attention runs the MLA kernels in the "halves" layout.
"""

from transformers.models.minicpm3.modeling_minicpm3 import MiniCPM3Attention

from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention


class LigerMiniCPM3Attention(LigerMLAAttention, MiniCPM3Attention):
    """MiniCPM3's MLA with its half-split RoPE fused into the query and key assembly."""

    def _liger_rope_layout(self) -> str:
        return "halves"


class LigerFP8MiniCPM3Attention(LigerMiniCPM3Attention):
    """``LigerMiniCPM3Attention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerMiniCPM3RecomputeAttention(LigerMiniCPM3Attention):
    """``LigerMiniCPM3Attention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True
