"""dots.llm1's MoE router with liger-dspine's forwards.

Each class is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter

from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerDots1TopkRouter(LigerTopkRouter, Dots1TopkRouter):
    """dots.llm1's router (a copy of DeepSeek-V3's) with the grouped top-k selection in one kernel."""
