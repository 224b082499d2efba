"""DeepSeek-V4's CSA indexer scorer with its scores in one fused kernel (ops/indexer_scores.py).

``sum_h w_h relu(q_h . k) * scale`` without the fp32 [B, S, index heads, S / rate] tensor transformers builds (64 GiB
at 32768 tokens, where it is what runs out of memory first); the weights' projection is the native module's. The
indexer's compressor, RoPE, causal mask and top-k stay native. Where the kernel cannot run (a CPU without the
interpreter, a head dim that is no power of two >= 16) the native forward runs.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from liger_dspine.ops.indexer_scores import indexer_scores_apply
from liger_dspine.ops.indexer_scores import liger_indexer_scores


class LigerDeepseekV4IndexerScorer(DeepseekV4IndexerScorer):
    """``DeepseekV4IndexerScorer`` in the fused indexer kernel; parameters as the native class."""

    def forward(self, q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if not indexer_scores_apply(q, q.shape[-1]):
            return super().forward(q, compressed_kv, hidden_states)
        with torch.no_grad():  # the scores only pick the top-k entries: no gradient, as in transformers
            weights = self.weights_proj(hidden_states).float() * self.weights_scaling
            return liger_indexer_scores(q, compressed_kv, weights, self.softmax_scale)
