"""DeepSeek-V3 MoE router with the grouped top-k selection in one Triton kernel.

Two layouts of transformers are covered:
- 5.13 and later: ``DeepseekV3TopkRouter.forward(hidden) -> (router_logits, topk_weights, topk_indices)``, the
  router holding ``top_k``, ``num_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``.
  ``LigerDeepseekV3TopkRouter`` replaces it (class swap or ``module.__class__`` swap; no extra state).
- before (5.8.1 to 5.12): the router returns only the logits and ``DeepseekV3MoE.route_tokens_to_experts(logits)
  -> (topk_indices, topk_weights)`` does the selection. ``LigerDeepseekV3TopkRouter`` then returns only the logits
  (like its parent), and ``liger_route_tokens_to_experts`` is the replacement for that method.
The layout is read from the router instance itself (the newer one sets ``num_group``; GLM's older routers already
hold ``top_k`` and ``n_group`` but still return only the logits), not from a version number.

The forward is the mixin :class:`LigerTopkRouter`: models whose router is a copy of DeepSeek-V3's (GLM-4.5,
GLM-4.7-Flash, dots.llm1, A.X-K1) each get a ``Liger<Native>`` class from it and their own router class.

Numbers equal the native ones up to fp32 rounding; within a token the ``top_k`` entries are ordered by biased
score, largest first (transformers leaves the order unspecified; the experts combine by weight).

A grouping whose ``num_experts_per_tok`` exceeds the experts of the kept groups (transformers' tiny test config: 8
experts, 2 groups, 1 kept, top-8) is routed natively: transformers then takes experts of the dropped groups, tied at
their masked score, in ``torch.topk``'s tie order (``ops.moe_router.masked_topk_reason``). An instance patch leaves
such a router native; one built under a class-level patch, or the MoE block's method, calls transformers' own code.
A warning says so.
"""

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from liger_dspine.modules.parallel_state import full_shape
from liger_dspine.ops.moe_router import check_router_config
from liger_dspine.ops.moe_router import liger_moe_router_topk
from liger_dspine.ops.moe_router import liger_router_logits
from liger_dspine.ops.moe_router import masked_topk_reason
from liger_dspine.patching import native_method
from liger_dspine.patching import warn_kept_native


class LigerTopkRouter:
    """``forward(hidden [..., H]) -> (router_logits [T, E] fp32, topk_weights [T, K] fp32, topk_indices [T, K])``,
    mixed in before a native router class (DeepSeek-V3's sigmoid + grouped top-k router, or a copy of it).

    Same parameters and buffers as the native router (``weight [E, H]``, ``e_score_correction_bias [E]``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reason = self.kept_native_reason(self)
        if reason is not None:
            warn_kept_native(f"{type(self).__name__}'s routing", reason)

    @staticmethod
    def kept_native_reason(module: torch.nn.Module) -> str | None:
        """Why the kernel does not route this router's grouping (transformers' own routing does), or None."""
        if not hasattr(module, "num_group"):  # transformers < 5.13: the MoE block's method routes
            return None
        return masked_topk_reason(full_shape(module.weight)[0], module.top_k, module.num_group, module.topk_group)

    @staticmethod
    def check_convertible(module: torch.nn.Module) -> None:
        """Refuse, before a patch, a grouping the kernel cannot honour (checked by the MoE block's method before
        transformers 5.13, where the router holds no grouping)."""
        if hasattr(module, "num_group"):
            check_router_config(full_shape(module.weight)[0], module.top_k, module.num_group, module.topk_group)

    def forward(self, hidden_states: torch.Tensor):
        if self.kept_native_reason(self) is not None:
            return super().forward(hidden_states)
        hidden_states = hidden_states.view(-1, self.weight.shape[1])
        router_logits = liger_router_logits(hidden_states, self.weight)
        if not hasattr(self, "num_group"):
            # transformers < 5.13: the MoE block routes (see liger_route_tokens_to_experts).
            return router_logits
        topk_weights, topk_indices = liger_moe_router_topk(
            router_logits,
            self.e_score_correction_bias,
            top_k=self.top_k,
            n_group=self.num_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        return router_logits, topk_weights, topk_indices


class LigerDeepseekV3TopkRouter(LigerTopkRouter, DeepseekV3TopkRouter):
    """DeepSeek-V3's router with the grouped top-k selection in one kernel (see :class:`LigerTopkRouter`)."""


def liger_route_tokens_to_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replacement for ``DeepseekV3MoE.route_tokens_to_experts`` (and its copies) of transformers < 5.13.

    ``router_logits [T, E]`` -> ``(topk_indices [T, K] int64, topk_weights [T, K])``, in that method's order.
    A grouping the kernel does not route runs the native method.
    """
    reason = masked_topk_reason(router_logits.shape[-1], self.top_k, self.n_group, self.topk_group)
    if reason is not None:
        warn_kept_native(f"{type(self).__name__}.route_tokens_to_experts", reason)
        return native_method(self, "route_tokens_to_experts", liger_route_tokens_to_experts)(self, router_logits)
    topk_weights, topk_indices = liger_moe_router_topk(
        router_logits,
        self.gate.e_score_correction_bias,
        top_k=self.top_k,
        n_group=self.n_group,
        topk_group=self.topk_group,
        norm_topk_prob=self.norm_topk_prob,
        routed_scaling_factor=self.routed_scaling_factor,
    )
    return topk_indices, topk_weights


def _moe_block_reason(block: torch.nn.Module) -> str | None:
    """``kept_native_reason`` of a MoE block routing in its own method (transformers < 5.13)."""
    return masked_topk_reason(full_shape(block.gate.weight)[0], block.top_k, block.n_group, block.topk_group)


liger_route_tokens_to_experts.kept_native_reason = _moe_block_reason
