"""DSpine's draft-block attention: only the tiles a draft block can see, and only the key-value heads kept.

:class:`LigerDSpineAttention` has the parameters and the forward of :class:`DSpineAttention`. With sdpa or eager
attention and a dense mask, where the kernels run (CUDA; a CPU through Triton's interpreter), no dropout and a head
width that is a power of two, it runs :func:`liger_dspine.ops.masked_attention.liger_masked_attention`: a draft
block sees the context before its anchor and its own block, about 15% of the [Q, S+Q] tiles of a Qwen3-8B-like
drafter at context 3072 and 512 anchors, and that kernel visits only those (sdpa computes them all). It keeps the
key-value heads, not their repeats to the query heads, for the backward. Elsewhere it keeps the grouped heads too:

- where sdpa would run its memory-efficient kernel for the masked call (CUDA, bf16 / fp16, no dropout), through
  :func:`liger_dspine.ops.grouped_attention.liger_grouped_attention`;
- otherwise with sdpa or eager, the native attention with
  :func:`~liger_dspine.models.dspine.grouped_saved_heads.saved_as_grouped` around it, which keeps the grouped heads
  for what the kernel saves and repeats them again in its backward.

flex_attention (grouped and block-sparse natively) is the native attention.
"""

from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.models.dspine.attention import repeat_kv
from liger_dspine.models.dspine.grouped_saved_heads import keeps_grouped
from liger_dspine.models.dspine.grouped_saved_heads import saved_as_grouped
from liger_dspine.ops.grouped_attention import grouped_attention_runs
from liger_dspine.ops.grouped_attention import liger_grouped_attention
from liger_dspine.ops.masked_attention import liger_masked_attention
from liger_dspine.ops.masked_attention import masked_attention_runs
from liger_dspine.ops.masked_attention import tile_sizes


class LigerDSpineAttention(DSpineAttention):
    def _attend(self, query, key, value, attention_mask: PreparedMask, **kwargs):
        dropout = self.attention_dropout if self.training else 0.0
        implementation = self.config._attn_implementation or "sdpa"
        dense = implementation in ("sdpa", "eager") and attention_mask.dense is not None
        if dense and masked_attention_runs(query, key, dropout):
            tiles = attention_mask.tiles(tile_sizes(query.dtype, query.shape[-1], query.device), query.shape[0])
            out = liger_masked_attention(query, key, value, attention_mask.visible, self.scaling, tiles=tiles)
            return out.transpose(1, 2)
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
