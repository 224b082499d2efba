"""DeepSeek-V4's hash routing: a token -> experts table picks the experts; only their weights are computed here.

    weights = s / (sum(s) + 1e-20) * routed_scaling_factor,  s = score_func(router_logits) at the K table experts

The forward scores the K chosen logits of each row only ([T, K] work, where the native router scores all [T, E]);
the backward is the MoE router's backward kernel (:func:`liger_dspine.ops.moe_router.moe_router_backward`), which
writes the dense [T, E] gradient in one pass. NaN logits follow that kernel's rule: a row with a NaN logit among its
experts has NaN weights; a row with a NaN logit elsewhere gets a NaN gradient over the whole row (native: NaN at the
NaN logits only, since the score function's derivative there is NaN).
"""

import torch
import torch.nn.functional as F

from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.moe_router import moe_router_backward

HASH_SCORE_FUNCS = ("sigmoid", "sqrtsoftplus")


def _scores(chosen_logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sqrtsoftplus":
        return F.softplus(chosen_logits).sqrt()
    return torch.sigmoid(chosen_logits)


class LigerHashRouterFunction(torch.autograd.Function):
    """``(router_logits [T, E] fp32, topk_indices [T, K] int64, score_func, routed_scaling_factor) -> topk_weights
    [T, K] fp32``; differentiable in ``router_logits``."""

    kernel_ops = ("liger_dspine::moe_router_select_backward",)

    @staticmethod
    def forward(ctx, router_logits, topk_indices, score_func, routed_scaling_factor):
        with torch.no_grad():
            scores = _scores(router_logits.gather(1, topk_indices), score_func)
            weights = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
            nan_counts = torch.isnan(router_logits).sum(dim=1, dtype=torch.int32)
        ctx.save_for_backward(scores, topk_indices, nan_counts)
        ctx.num_experts = router_logits.shape[1]
        ctx.score_func = score_func
        ctx.routed_scaling_factor = routed_scaling_factor
        return weights

    @staticmethod
    @first_order_only
    def backward(ctx, grad_weights):
        scores, indices, nan_counts = ctx.saved_tensors
        grad_logits = None
        if ctx.needs_input_grad[0]:
            grad_logits = moe_router_backward(
                grad_weights, scores, indices, nan_counts, ctx.num_experts, True, ctx.routed_scaling_factor,
                score_func=ctx.score_func,
            )  # fmt: skip
        return grad_logits, None, None, None


def liger_hash_router_weights(
    router_logits: torch.Tensor, topk_indices: torch.Tensor, score_func: str, routed_scaling_factor: float
) -> torch.Tensor:
    """Normalised, scaled weights of the table's experts: ``router_logits [T, E]``, ``topk_indices [T, K]`` ->
    ``[T, K]`` in the logits' dtype (computed in fp32)."""
    if score_func not in HASH_SCORE_FUNCS:
        raise ValueError(
            f"liger-dspine: the hash router's score_func must be one of {HASH_SCORE_FUNCS}, got {score_func!r}"
        )
    if router_logits.dim() != 2 or topk_indices.dim() != 2 or topk_indices.shape[0] != router_logits.shape[0]:
        raise ValueError(
            f"liger-dspine: hash routing needs router_logits [T, E] and topk_indices [T, K], got "
            f"{tuple(router_logits.shape)} and {tuple(topk_indices.shape)}"
        )
    # an expert id outside [0, E) fails in the forward's gather, as natively
    weights = LigerHashRouterFunction.apply(
        router_logits.float(), topk_indices.long().contiguous(), score_func, float(routed_scaling_factor)
    )
    return weights.to(router_logits.dtype)
