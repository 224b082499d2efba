"""Ergo's RMSNorm and MoE router with liger-dspine's kernels.

The router is made from the model's own native class, so its ``__init__`` builds the model's own submodules.
"""

import torch
from torch import nn
from transformers.models.ergo.modeling_ergo import ErgoTopkRouter

from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.ops.moe_router import check_router_config
from liger_dspine.ops.moe_router import liger_moe_router_topk


class LigerErgoRMSNorm(LigerRMSNorm):
    """``ErgoRMSNorm``: fp32 statistics and the fp32 weight applied before the one rounding to the input dtype, which
    is liger-kernel's "gemma" casting with offset 0. Built as ``LigerErgoRMSNorm(hidden_size, eps)``, with an fp32
    weight as the native one."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps=eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.casting_mode = "gemma"

    @classmethod
    def convert(cls, module: nn.Module) -> None:
        super().convert(module)
        module.casting_mode = "gemma"


class LigerErgoTopkRouter(ErgoTopkRouter):
    """Ergo's router with the top-k selection in one kernel: ``forward(hidden [..., H]) -> (router_logits [T, E]
    fp32, topk_weights [T, K] fp32, topk_indices [T, K])``.

    The logits come from the native fp32-output projection (``self.linear``); the kernel takes them as one group of
    every expert (sigmoid scores, top-k of scores + bias, weights renormalised with ``+ 1e-20`` and scaled), and the
    weights are rounded to the input dtype and back, as natively.
    """

    @staticmethod
    def check_convertible(module: nn.Module) -> None:
        check_router_config(module.e_score_correction_bias.shape[0], module.top_k, 1, 1)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.linear.in_features)
        router_logits = self.linear(hidden_states)
        topk_weights, topk_indices = liger_moe_router_topk(
            router_logits,
            self.e_score_correction_bias,
            top_k=self.top_k,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        return router_logits, topk_weights.to(hidden_states.dtype).float(), topk_indices
