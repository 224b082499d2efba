"""DSpine's draft-block attention keeping only the key-value heads for the backward.

:class:`LigerDSpineAttention` has the parameters and the forward of :class:`DSpineAttention`. Its attention keeps the
key and value heads, not their repeats to the query heads (two [B, N, S+Q, D] tensors per layer, 352 MiB per layer of
a Qwen3-8B-like drafter at batch 2, context 3072, 512 anchors), from the forward to the backward:

- where sdpa would run its memory-efficient kernel for the masked call (CUDA, bf16 / fp16, no dropout), through
  :func:`liger_dspine.ops.grouped_attention.liger_grouped_attention`;
- elsewhere with sdpa or eager (cuDNN's attention on an H200, the math kernel on a CPU), the native attention with
  :func:`~liger_dspine.models.dspine.grouped_saved_heads.saved_as_grouped` around it, which keeps the grouped heads
  for what the kernel saves and repeats them again in its backward.

flex_attention (grouped natively) is the native attention.
"""

from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.models.dspine.attention import repeat_kv
from liger_dspine.models.dspine.grouped_saved_heads import keeps_grouped
from liger_dspine.models.dspine.grouped_saved_heads import saved_as_grouped
from liger_dspine.ops.grouped_attention import grouped_attention_runs
from liger_dspine.ops.grouped_attention import liger_grouped_attention


class LigerDSpineAttention(DSpineAttention):
    def _attend(self, query, key, value, attention_mask: PreparedMask, **kwargs):
        dropout = self.attention_dropout if self.training else 0.0
        implementation = self.config._attn_implementation or "sdpa"
        if implementation == "sdpa" and attention_mask.dense is not None:
            bias = attention_mask.additive(query.dtype)
            if grouped_attention_runs(query, key, bias, dropout):
                return liger_grouped_attention(query, key, value, bias, self.scaling)
        groups = self.num_key_value_groups
        if implementation not in ("sdpa", "eager") or not keeps_grouped(groups):
            return super()._attend(query, key, value, attention_mask, **kwargs)
        repeated_key, repeated_value = repeat_kv(key, groups), repeat_kv(value, groups)
        with saved_as_grouped(((repeated_key, key), (repeated_value, value)), groups):
            return self._attend_repeated(query, repeated_key, repeated_value, attention_mask, **kwargs)
