"""DSpine's draft-block attention keeping only the key-value heads for the backward.

:class:`LigerDSpineAttention` has the parameters and the forward of :class:`DSpineAttention`. Where sdpa would run
its memory-efficient kernel for the masked call (CUDA, bf16 / fp16, no dropout), it runs that kernel through
:func:`liger_dspine.ops.grouped_attention.liger_grouped_attention`, without the repeated key and value heads held
from the forward to the backward (two [B, N, S+Q, D] tensors per layer, 352 MiB per layer of a Qwen3-8B-like drafter
at batch 2, context 3072, 512 anchors). Everywhere else it is the native attention.
"""

from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.ops.grouped_attention import grouped_attention_runs
from liger_dspine.ops.grouped_attention import liger_grouped_attention


class LigerDSpineAttention(DSpineAttention):
    def _attend(self, query, key, value, attention_mask: PreparedMask, **kwargs):
        dropout = self.attention_dropout if self.training else 0.0
        sdpa = (self.config._attn_implementation or "sdpa") == "sdpa"
        if sdpa and attention_mask.dense is not None:
            bias = attention_mask.additive(query.dtype)
            if grouped_attention_runs(query, key, bias, dropout):
                return liger_grouped_attention(query, key, value, bias, self.scaling)
        return super()._attend(query, key, value, attention_mask, **kwargs)
