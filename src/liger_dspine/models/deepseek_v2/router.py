"""Softmax + grouped top-k MoE routing in one Triton kernel: DeepSeek-V2's router and the routers built from it
(Mistral-Small-4). The selection is :func:`liger_dspine.ops.moe_router.liger_moe_router_topk` with
``score_func="softmax"`` and no correction bias.

- DeepSeek-V2 (``topk_method``): "greedy" takes the top-k of all experts (one group), "group_limited_greedy" keeps
  the ``topk_group`` groups of the largest score ("max" group score) first. No renormalisation (the router has no
  ``norm_topk_prob``). Logits in fp32.
- Mistral-Small-4 (no ``topk_method``): groups scored by the sum of their two largest scores, ``norm_topk_prob``.
  Its logits are in the model's dtype, as natively; the softmax and the selection then run in fp32 (natively in the
  model's dtype: in bf16 the weights may differ by bf16 rounding), and the weights come back in the model's dtype.

Three layouts of transformers: a router module whose forward returns ``(router_logits, topk_weights, topk_indices)``
(:class:`LigerSoftmaxTopkRouter`); for DeepSeek-V2 before 5.17, an ``nn.Linear`` gate and the selection in
``DeepseekV2Moe.route_tokens_to_experts(router_logits)`` (:func:`liger_deepseek_v2_route_tokens_to_experts`); for
Mistral-Small-4 before 5.13, a router returning only the logits (the Liger router then does the same) and the
selection in ``Mistral4MoE.route_tokens_to_experts`` (:func:`liger_top2_route_tokens_to_experts`). The layout is read
from the router instance (the newer one sets ``num_group``).

A grouping whose ``num_experts_per_tok`` exceeds the experts of the kept groups is routed by transformers' own code
(it picks experts of the dropped groups, tied at the masked score 0, in ``torch.topk``'s tie order): an instance patch
leaves such a router (or MoE block) native, and one built under a class-level patch calls the native forward or
method, with a warning (``ops.moe_router.masked_topk_reason``).
"""

import torch
import torch.nn.functional as F

from liger_dspine.ops.moe_router import check_router_config
from liger_dspine.ops.moe_router import liger_moe_router_topk
from liger_dspine.ops.moe_router import liger_router_logits
from liger_dspine.ops.moe_router import masked_topk_reason
from liger_dspine.patching import native_method
from liger_dspine.patching import warn_kept_native

TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2_selection(topk_method: str, n_group, topk_group) -> dict:
    """The kernel's grouping for DeepSeek-V2's ``topk_method``."""
    if topk_method == "greedy":
        return dict(n_group=1, topk_group=1, group_score="max")
    if topk_method == "group_limited_greedy":
        return dict(n_group=n_group, topk_group=topk_group, group_score="max")
    raise ValueError(
        f"liger-dspine: DeepSeek-V2's router selects with topk_method in {TOPK_METHODS}; got {topk_method!r}"
    )


class LigerSoftmaxTopkRouter:
    """``forward(hidden [..., H]) -> (router_logits [T, E], topk_weights [T, K], topk_indices [T, K])``, mixed in
    before a native softmax router class. Same parameters as the native router (``weight [E, H]``).

    ``logits_in_fp32``: the native router computes its logits from fp32 copies (DeepSeek-V2) rather than in the
    model's dtype (Mistral-Small-4).
    """

    logits_in_fp32 = True

    def _selection(self) -> dict:
        topk_method = getattr(self, "topk_method", None)
        if topk_method is None:
            return dict(n_group=self.num_group, topk_group=self.topk_group, group_score="top2")
        return deepseek_v2_selection(topk_method, self.num_group, self.topk_group)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reason = self.kept_native_reason(self)
        if reason is not None:
            warn_kept_native(f"{type(self).__name__}'s routing", reason)

    @classmethod
    def kept_native_reason(cls, module: torch.nn.Module) -> str | None:
        """Why the kernel does not route this router's selection (transformers' own routing does), or None."""
        if not hasattr(module, "num_group"):  # an older layout: the MoE block's method routes
            return None
        selection = cls._selection(module)
        return masked_topk_reason(module.weight.shape[0], module.top_k, selection["n_group"], selection["topk_group"])

    @classmethod
    def check_convertible(cls, module: torch.nn.Module) -> None:
        """Refuse, before a patch, a selection the kernel cannot honour (checked by the MoE block's method before
        transformers 5.13, where the router holds no grouping)."""
        if hasattr(module, "num_group"):
            selection = cls._selection(module)
            check_router_config(module.weight.shape[0], module.top_k, score_func="softmax", **selection)

    def forward(self, hidden_states: torch.Tensor):
        if self.kept_native_reason(self) is not None:
            return super().forward(hidden_states)
        hidden_states = hidden_states.view(-1, self.weight.shape[1])
        if self.logits_in_fp32:
            router_logits = liger_router_logits(hidden_states, self.weight)
        else:
            router_logits = F.linear(hidden_states, self.weight)
        if not hasattr(self, "num_group"):
            # transformers < 5.13 (Mistral-Small-4): the MoE block routes (see liger_top2_route_tokens_to_experts).
            return router_logits
        selection = self._selection()
        topk_weights, topk_indices = liger_moe_router_topk(
            router_logits,
            None,
            top_k=self.top_k,
            norm_topk_prob=getattr(self, "norm_topk_prob", False),
            routed_scaling_factor=self.routed_scaling_factor,
            score_func="softmax",
            **selection,
        )
        return router_logits, topk_weights, topk_indices


def liger_deepseek_v2_route_tokens_to_experts(self, router_logits: torch.Tensor):
    """Replacement for ``DeepseekV2Moe.route_tokens_to_experts`` of transformers < 5.17: ``router_logits [B, S, E]``
    fp32 -> ``(topk_indices [T, K] int64, topk_weights [T, K] fp32)``, in that method's order; a grouping the kernel
    does not route runs the native method."""
    reason = _v2_block_reason(self, router_logits.shape[-1])
    if reason is not None:
        return _native_routing(self, router_logits, liger_deepseek_v2_route_tokens_to_experts, reason)
    router_logits = router_logits.reshape(-1, router_logits.shape[-1])
    topk_weights, topk_indices = liger_moe_router_topk(
        router_logits,
        None,
        top_k=self.top_k,
        norm_topk_prob=False,
        routed_scaling_factor=self.routed_scaling_factor,
        score_func="softmax",
        **deepseek_v2_selection(self.topk_method, self.num_group, self.topk_group),
    )
    return topk_indices, topk_weights


def liger_top2_route_tokens_to_experts(self, router_logits: torch.Tensor):
    """Replacement for ``Mistral4MoE.route_tokens_to_experts`` of transformers < 5.13 (softmax, groups scored by
    their top-2 sum, ``norm_topk_prob``): ``router_logits [T, E]`` -> ``(topk_indices [T, K] int64, topk_weights
    [T, K])``, in that method's order; the selection in fp32, as :class:`LigerSoftmaxTopkRouter`'s. A grouping the
    kernel does not route runs the native method."""
    reason = _top2_block_reason(self, router_logits.shape[-1])
    if reason is not None:
        return _native_routing(self, router_logits, liger_top2_route_tokens_to_experts, reason)
    topk_weights, topk_indices = liger_moe_router_topk(
        router_logits,
        None,
        top_k=self.top_k,
        n_group=self.n_group,
        topk_group=self.topk_group,
        norm_topk_prob=self.norm_topk_prob,
        routed_scaling_factor=self.routed_scaling_factor,
        score_func="softmax",
        group_score="top2",
    )
    return topk_indices, topk_weights


def _v2_block_reason(block: torch.nn.Module, num_experts: int | None = None) -> str | None:
    """Why the kernel does not route DeepSeek-V2's MoE block (transformers < 5.17), or None."""
    num_experts = block.gate.weight.shape[0] if num_experts is None else num_experts
    selection = deepseek_v2_selection(block.topk_method, block.num_group, block.topk_group)
    return masked_topk_reason(num_experts, block.top_k, selection["n_group"], selection["topk_group"])


def _top2_block_reason(block: torch.nn.Module, num_experts: int | None = None) -> str | None:
    """Why the kernel does not route Mistral-Small-4's MoE block (transformers < 5.13), or None."""
    num_experts = block.gate.weight.shape[0] if num_experts is None else num_experts
    return masked_topk_reason(num_experts, block.top_k, block.n_group, block.topk_group)


def _native_routing(block: torch.nn.Module, router_logits: torch.Tensor, replacement, reason: str):
    """transformers' own ``route_tokens_to_experts`` of ``block``, with the warning that says so."""
    warn_kept_native(f"{type(block).__name__}.route_tokens_to_experts", reason)
    return native_method(block, "route_tokens_to_experts", replacement)(block, router_logits)


liger_deepseek_v2_route_tokens_to_experts.kept_native_reason = _v2_block_reason
liger_top2_route_tokens_to_experts.kept_native_reason = _top2_block_reason
