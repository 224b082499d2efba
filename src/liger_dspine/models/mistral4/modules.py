"""Mistral-Small-4's MLA attention and softmax router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules. The
attention runs the MLA kernels in the interleaved layout (``rope_interleave``, the default) or the half-split one,
then multiplies the query by Llama-4's per-position scale, as the native forward does (one elementwise product).
"""

from transformers.models.mistral4.modeling_mistral4 import Mistral4Attention
from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

from liger_dspine.models.deepseek_v2.router import LigerSoftmaxTopkRouter
from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention


class LigerMistral4Attention(LigerMLAAttention, Mistral4Attention):
    """Mistral-Small-4's MLA with its RoPE fused into the query and key assembly and its query scale."""

    def _liger_rope_layout(self) -> str:
        return "interleaved" if self.config.rope_interleave else "halves"

    def _liger_query_scale(self, kwargs):
        """``get_llama_4_attn_scale(position_ids, ...)`` [B, 1, S, 1] of the native forward."""
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(
                "liger-dspine: Mistral-Small-4's attention scales the query by position: call it with position_ids"
            )
        rope = self.config.rope_parameters
        return self.modeling.get_llama_4_attn_scale(
            position_ids, rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        )


class LigerFP8Mistral4Attention(LigerMistral4Attention):
    """``LigerMistral4Attention`` with the projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerMistral4RecomputeAttention(LigerMistral4Attention):
    """``LigerMistral4Attention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True


class LigerMistral4TopkRouter(LigerSoftmaxTopkRouter, Mistral4TopkRouter):
    """Mistral-Small-4's softmax router (groups scored by their top-2 sum, no bias) with the selection in one
    kernel; its logits in the model's dtype, as natively."""

    logits_in_fp32 = False
