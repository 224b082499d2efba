"""DeepSeek-V3.2's MoE router with liger-dspine's forward.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerDeepseekV32TopkRouter(LigerTopkRouter, DeepseekV32TopkRouter):
    """DeepSeek-V3.2's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
