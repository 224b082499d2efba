"""The forward of DeepSeek Sparse Attention's indexer with its scores in one fused kernel (ops/indexer_scores.py), for
DeepSeek-V3.2's indexer (``models/deepseek_v32/indexer.py``) and GLM-5's (``models/glm_moe_dsa/indexer.py``), which
differ only in their RoPE layout.

The projections, the key norm, the RoPE (the model's own function), the indexer-key cache, the mask and the top-k are
the native module's; only the scores ``sum_h w_h relu(q_h . k)`` skip the fp32 [B, S, index heads, T] tensor
transformers builds for them (4 GiB per layer at 4096 tokens). The native forward runs where the kernel cannot (a CPU
without the interpreter, a head dim that is no power of two >= 16) and for indexers that keep their own key cache
(GLM-5 before transformers 5.17).
"""

import torch

from liger_dspine.ops.indexer_scores import indexer_scores_apply
from liger_dspine.ops.indexer_scores import liger_indexer_scores

_ARGUMENTS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids", "cache")


class LigerDsaIndexer:
    """The fused-score forward of a DSA indexer; a subclass names the modeling module and its RoPE function."""

    modeling = None
    rope_function = "apply_rotary_pos_emb"

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        named = dict(zip(_ARGUMENTS, args), **kwargs)
        named.setdefault("cache", named.pop("past_key_values", None))
        hidden_states = named["hidden_states"]
        if hasattr(self, "_cached_keys") or not indexer_scores_apply(hidden_states, self.head_dim):
            return super().forward(*args, **kwargs)
        batch, seq_len, _ = hidden_states.shape
        cos, sin = named["position_embeddings"]
        rope, rotate = self.qk_rope_head_dim, getattr(self.modeling, self.rope_function)
        q = self.wq_b(named["q_resid"]).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states))  # [B, S, D]
        q_rot, k_rot = rotate(q[..., :rope], k[:, :, None, :rope], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], dim=-1)
        k = torch.cat([k_rot[:, :, 0], k[..., rope:]], dim=-1)
        if named["cache"] is not None:
            k = named["cache"].update_indexer(k, self.layer_idx)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        scores = liger_indexer_scores(q, k, weights, self.softmax_scale)  # [B, S, T] fp32
        mask = named["attention_mask"]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices.to(torch.int32)
