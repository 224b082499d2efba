"""GLM-4.5 / 4.6 / 4.7's MoE router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerGlm4MoeTopkRouter(LigerTopkRouter, Glm4MoeTopkRouter):
    """GLM-4.5 / 4.6 / 4.7's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
