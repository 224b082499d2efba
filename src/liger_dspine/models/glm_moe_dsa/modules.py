"""GLM-5.x's MoE router with liger-dspine's forward.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerGlmMoeDsaTopkRouter(LigerTopkRouter, GlmMoeDsaTopkRouter):
    """GLM-5.x's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
