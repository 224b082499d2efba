"""DeepSeek-V3.2's DSA indexer with its scores in one fused kernel (ops/indexer_scores.py).

The projections, the key norm, the half-split RoPE, the indexer-key cache, the mask and the top-k are the native
module's (its own submodules, transformers' RoPE function); only the scores ``sum_h w_h relu(q_h . k)`` skip the fp32
[B, S, index heads, T] tensor transformers builds for them (4 GiB per layer at 4096 tokens). Where the kernel cannot
run (a CPU without the interpreter, a head dim that is no power of two >= 16) the native forward runs.
"""

import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

from liger_dspine.ops.indexer_scores import indexer_scores_apply
from liger_dspine.ops.indexer_scores import liger_indexer_scores


class LigerDeepseekV32Indexer(modeling.DeepseekV32Indexer):
    """``DeepseekV32Indexer`` whose scores run in the fused indexer kernel; parameters as the native class."""

    @torch.no_grad()
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                **kwargs):  # fmt: skip
        cache = kwargs.pop("past_key_values", cache)
        head_dim = self.head_dim
        if not indexer_scores_apply(hidden_states, head_dim):
            return super().forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache)
        batch, seq_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        rope = self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(batch, seq_len, self.n_heads, head_dim)
        k = self.k_norm(self.wk(hidden_states))  # [B, S, D]
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q[..., :rope], k[:, :, None, :rope], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], dim=-1)
        k = torch.cat([k_rot[:, :, 0], k[..., rope:]], dim=-1)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        scores = liger_indexer_scores(q, k, weights, self.softmax_scale)  # [B, S, T] fp32
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
        return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices.to(torch.int32)
