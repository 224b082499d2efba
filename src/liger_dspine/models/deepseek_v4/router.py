"""DeepSeek-V4's routers on liger-dspine's routing ops.

- ``DeepseekV4TopKRouter``: scores (sqrtsoftplus by default) plus the correction bias choose the top-k of all experts
  (no groups); the chosen scores, renormalised and scaled, weight them. One kernel per direction:
  :func:`liger_dspine.ops.moe_router.liger_moe_router_topk` with one group.
- ``DeepseekV4HashRouter`` (the first ``hash_moe`` layers): a frozen token -> experts table picks the experts; only
  their weights are computed (:func:`liger_dspine.ops.hash_router.liger_hash_router_weights`).

Both keep the native router GEMM in the model's dtype and return ``(router_logits, topk_weights, topk_indices)`` as
natively. The scores and weights are computed in fp32 and returned in the logits' dtype; natively they are computed
in the logits' dtype, so in bf16 the weights may differ by bf16 rounding. The top-k entries of a row come ordered by
biased score, largest first (native's ``topk(sorted=False)`` leaves the order unspecified).
"""

import torch.nn.functional as F
from torch import nn
from transformers.activations import SqrtSoftplusActivation
from transformers.models.deepseek_v4 import modeling_deepseek_v4

from liger_dspine.ops.hash_router import liger_hash_router_weights
from liger_dspine.ops.moe_router import liger_moe_router_topk

# the class of the router's ``score_fn`` (``ACT2FN[config.scoring_func]``) -> the kernels' score function
_SCORE_FUNCS = {SqrtSoftplusActivation: "sqrtsoftplus", nn.Sigmoid: "sigmoid"}


def score_func_of(router: nn.Module) -> str:
    """The kernels' name of the router's score function; a ValueError naming any other."""
    score_func = _SCORE_FUNCS.get(type(router.score_fn))
    if score_func is None:
        raise ValueError(
            f"liger-dspine: DeepSeek-V4's Liger routers score with sqrtsoftplus or sigmoid, got "
            f"{type(router.score_fn).__name__} (config.scoring_func)"
        )
    return score_func


class LigerDeepseekV4TopKRouter(modeling_deepseek_v4.DeepseekV4TopKRouter):
    """The learned top-k router with the score, selection and weights in one kernel (forward and backward)."""

    @staticmethod
    def check_convertible(module: nn.Module) -> None:
        score_func_of(module)

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat, self.weight)
        weights, indices = liger_moe_router_topk(
            logits,
            self.e_score_correction_bias,
            top_k=self.top_k,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=self.routed_scaling_factor,
            score_func=score_func_of(self),
            group_score="max",
        )
        return logits, weights, indices


class LigerDeepseekV4HashRouter(modeling_deepseek_v4.DeepseekV4HashRouter):
    """The hash router: the table's experts, their weights from the [T, K] chosen logits only."""

    @staticmethod
    def check_convertible(module: nn.Module) -> None:
        score_func_of(module)

    def forward(self, hidden_states, input_ids):
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat, self.weight)
        indices = self.tid2eid[input_ids.reshape(-1)].long()
        weights = liger_hash_router_weights(logits, indices, score_func_of(self), self.routed_scaling_factor)
        return logits, weights, indices
