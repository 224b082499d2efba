"""GLM-5.x's MoE router and DSA attention with liger-dspine's forwards.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

from liger_dspine.models.deepseek_v3.dsa_attention import LigerDSAAttention
from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerGlmMoeDsaTopkRouter(LigerTopkRouter, GlmMoeDsaTopkRouter):
    """GLM-5.x's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""


class LigerGlmMoeDsaAttention(LigerDSAAttention, GlmMoeDsaAttention):
    """GLM-5.x's MLA with its DSA key selection (its own indexer, or on ``"shared"`` layers the previous full layer's
    top-k indices), the query and key assembly in the Liger kernels; returns the indices as the native one does."""

    returns_indices = True


class LigerFP8GlmMoeDsaAttention(LigerGlmMoeDsaAttention):
    """``LigerGlmMoeDsaAttention`` with the MLA projections' GEMMs in FP8 (``fp8=True``)."""

    fp8 = True


class LigerGlmMoeDsaRecomputeAttention(LigerGlmMoeDsaAttention):
    """``LigerGlmMoeDsaAttention`` keeping only the latents for backward (``recompute_attention=True``)."""

    recompute_core = True
