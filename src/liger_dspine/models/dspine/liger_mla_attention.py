"""The drafter's MLA with the query and key assembly in Triton (the ``attention`` option of the patch).

:class:`LigerDSpineMLAAttention` has the parameters and the numbers of :class:`DSpineMLAAttention`. The kernels of
:mod:`liger_dspine.ops.interleaved_rope` that DeepSeek-V3's MLA uses fit the [context ; draft] layout as they are:
the key and value of all S+Q tokens come from one ``kv_b_proj`` output, so

- the query: split, RoPE of the rope columns and ``cat((q_nope, q_rot))`` -> one kernel (:func:`liger_mla_query`),
  with the last Q positions' angles;
- the key: RoPE of the shared rope key, its broadcast to the heads beside the nope key, and the value copied out of
  the ``kv_b_proj`` output (freed at once, not held to the backward by a view) -> one kernel
  (:func:`liger_mla_key`), with the angles of all S+Q positions.

SpecForge's interleaved RoPE turns each pair in place (the kernels' "pairs" layout); without
``mla_rope_interleaved`` it is rotate_half ("halves"). ``qk_nope_head_dim`` 0 leaves no nope key for the key
kernel: that drafter runs the native assembly. The attention call is the native one (with one key head per query
head there are no repeated heads for the grouped kernel of :class:`LigerDSpineAttention` to save).
"""

import torch

from liger_dspine.models.dspine.mla_attention import DSpineMLAAttention


class LigerDSpineMLAAttention(DSpineMLAAttention):
    def _query_key_value(self, hidden_states, context, cos, sin):
        if self.qk_nope_head_dim == 0 or cos.requires_grad or sin.requires_grad:
            return super()._query_key_value(hidden_states, context, cos, sin)
        from liger_dspine.ops.interleaved_rope import liger_mla_key
        from liger_dspine.ops.interleaved_rope import liger_mla_query

        layout = "pairs" if self.rope_interleaved else "halves"
        q_len = hidden_states.shape[1]
        # key and value first: the backward runs the other way, so the query's gradient reaches its projection
        # before the key's backward allocates the kv_b_proj gradient
        kv, k_rot = self._project_key_value(torch.cat([context, hidden_states], dim=1))
        key, value = liger_mla_key(kv, k_rot, cos, sin, self.qk_nope_head_dim, layout)
        query = liger_mla_query(
            self._project_query(hidden_states), cos[:, -q_len:], sin[:, -q_len:], self.qk_rope_head_dim, layout
        )
        return query, key, value
