"""The Liger MLA forward for models whose attention keeps, per query, the keys a DSA indexer selects (DeepSeek-V3.2,
GLM-5.x).

Their native attention (transformers 5.24) is DeepSeek-V3's MLA (latents in the cache, ``expand_kv``, the
interleaved RoPE) plus: after the cache update the
layer's indexer (or, on GLM-5's ``"shared"`` layers, the previous full layer's ``prev_topk_indices``) gives the top-k
key positions of every query; eager and sdpa attention fold them into the attention mask (the other positions
masked), other attention implementations get them as ``indices``. :class:`LigerDSAAttention` does the same in
:meth:`_liger_select_keys`, so the query, key and value come from the Liger kernels and the indexer is the model's
own (the Liger indexer when that option is on). GLM-5's attention also returns the indices (a third output). Earlier
transformers versions cache the expanded key and value (5.17) or build the sparse mask another way (5.8.1): there
the class runs the native forward, and the apply functions leave the attention native.
"""

import torch

from liger_dspine.models.deepseek_v3.attention import LigerMLAAttention


class LigerDSAAttention(LigerMLAAttention):
    """Mixed in before a DSA model's native attention class (see the module)."""

    returns_indices = False  # GLM-5's attention returns (output, weights, top-k indices)

    @classmethod
    def liger_forward_fits(cls) -> bool:
        """Whether the native class caches the compressed latents (transformers 5.24, whose forward takes ``cache``);
        before, it caches the expanded key and value (5.17) or builds the mask another way (5.8.1)."""
        return cls.latent_cache and cls.native_cache_arg == "cache"

    def _liger_rope_layout(self) -> str | None:
        """Interleaved, as the native forward always turns it; None (the native forward) where the Liger forward does
        not fit the installed transformers."""
        return "interleaved" if self.liger_forward_fits() else None

    def _liger_select_keys(self, hidden_states, q_latent, position_embeddings, attention_mask, cache, kwargs, length):
        kwargs = dict(kwargs)
        position_ids = kwargs.pop("position_ids", None)
        previous = kwargs.pop("prev_topk_indices", None)
        if getattr(self, "indexer", None) is not None:
            topk = self.indexer(
                hidden_states, q_latent, position_embeddings, attention_mask[:, 0, :, :], position_ids, cache=cache
            )
        elif previous is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        else:
            topk = previous
        indices = None
        if self.config._attn_implementation in ("eager", "sdpa"):
            batch_size, seq_length = hidden_states.shape[:-1]
            unselected = (
                topk.new_ones((batch_size, seq_length, length), dtype=torch.bool)
                .scatter(-1, topk.long(), False)
                .unsqueeze(1)
            )
            if attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & ~unselected
            else:
                attention_mask = attention_mask.masked_fill(unselected, torch.finfo(hidden_states.dtype).min)
        else:
            indices = topk
        kwargs["indices"] = indices
        return attention_mask, kwargs, topk

    def _liger_outputs(self, attn_output, attn_weights, selection) -> tuple:
        if self.returns_indices:
            return attn_output, attn_weights, selection
        return attn_output, attn_weights
