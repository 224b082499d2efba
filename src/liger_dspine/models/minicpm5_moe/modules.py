"""MiniCPM5-MoE's MoE router with liger-dspine's forwards.

Made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

import torch
from transformers.models.minicpm5_moe.modeling_minicpm5_moe import MiniCPM5MoeTopkRouter

from liger_dspine.models.deepseek_v3.router import LigerTopkRouter


class LigerMiniCPM5MoeTopkRouter(LigerTopkRouter, MiniCPM5MoeTopkRouter):
    """MiniCPM5-MoE's router (DeepSeek-V3's sigmoid + grouped top-k) with the selection in one kernel.

    The native router computes its logits in fp32 with autocast off; so does this one (DeepSeek-V3's router, and the
    shared forward, let autocast run that GEMM in low precision).
    """

    def forward(self, hidden_states: torch.Tensor):
        with torch.autocast(hidden_states.device.type, enabled=False):
            return super().forward(hidden_states)
