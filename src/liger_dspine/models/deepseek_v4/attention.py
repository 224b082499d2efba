"""DeepSeek-V4's attention with the sink-attention kernel in place of the eager scores.

:class:`LigerDeepseekV4Attention` keeps the native ``__init__`` (its own norms, compressor and grouped output
projection) and the native steps around the attention: the query and key-value projections, the key-value head's
norm and RoPE, the compressor (HCA, or CSA with its indexer) and its block bias, and the grouped low-rank output
projection. The attention call changes: transformers' eager attention materialises [B, N, S, S + C] scores,
probabilities and copies; :func:`liger_dspine.ops.sink_attention.liger_sink_attention` streams the sliding window
and the compressed entries through an online softmax with the per-head sink and keeps an output and a log-sum-exp
per row.

The query heads' weightless RMSNorm and RoPE, and the inverse RoPE of the output, run in one Triton pass each
(:func:`liger_dspine.ops.trailing_rope.liger_trailing_rope`); the key-value head's norm and RoPE stay native.

The kernel path runs where the layer has no past (training, and the prefill of generation: the cache, if any, is
updated as the native forward updates it), with the eager mask tensor (the sliding-window causal mask, read on the
window only) and a head dim that is a power of two; elsewhere (decoding with a past, dropout, another attention
implementation, attention weights requested with ``output_attentions``) the module runs the native forward.
"""

import sys

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.transformers_compat import attention_weights_recorded
from liger_dspine.transformers_compat import cache_argument_name
from liger_dspine.transformers_compat import norm_epsilon


class LigerDeepseekV4Attention(DeepseekV4Attention):
    """V4 attention with :func:`liger_sink_attention`; parameters and submodules as the native class."""

    native_cache_arg = cache_argument_name(DeepseekV4Attention.forward)
    cache_update_takes_kwargs = native_cache_arg == "cache"  # transformers 5.24 hands its kwargs to cache.update
    modeling = sys.modules[DeepseekV4Attention.__module__]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if cache is None:
            cache = past_key_values
        if not self._liger_applies(hidden_states, attention_mask, cache):
            return super().forward(
                hidden_states, position_embeddings, position_ids, attention_mask, **{self.native_cache_arg: cache},
                **kwargs,
            )  # fmt: skip
        from liger_dspine.ops.sink_attention import liger_sink_attention
        from liger_dspine.ops.trailing_rope import liger_trailing_rope

        rotate = self.modeling.apply_rotary_pos_emb
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        angles = position_embeddings  # {"main", "compress"} in the model; one (cos, sin) pair also works
        cos, sin = angles[self.rope_layer_type] if isinstance(angles, dict) else angles
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        # the query heads' weightless norm and RoPE in one pass; [B, N, S, D] as a view of [B, S, N, D]
        q = liger_trailing_rope(
            self.q_b_proj(q_residual).view(*hidden_shape), cos, sin, eps=norm_epsilon(self.q_b_norm)
        )
        q = q.transpose(1, 2)
        kv = rotate(self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2), cos, sin)
        if cache is not None:  # no past here: the update stores the window and returns kv as it is
            update_kwargs = {"kwargs": kwargs} if self.cache_update_takes_kwargs else {}
            kv = cache.update(kv, kv, self.layer_idx, **update_kwargs)[0]
        block_bias = None
        if self.compressor is not None:
            compressed_kv, block_bias = self.compressor(hidden_states, q_residual, position_ids, cache, self.layer_idx)
            kv = torch.cat([kv, compressed_kv], dim=2)
        attn_output = liger_sink_attention(
            q, kv[:, 0], self.sinks, self.sliding_window, self.scaling, mask=attention_mask, bias=block_bias
        )  # [B, S, N, D]
        attn_output = liger_trailing_rope(attn_output, cos, -sin)  # the inverse turn of the output's rope slice
        grouped = self.o_a_proj(attn_output.reshape(*input_shape, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None

    def _liger_applies(self, hidden_states: torch.Tensor, attention_mask, cache) -> bool:
        """No past in the cache, no attention dropout in training, no attention weights recorded (the kernel keeps
        none), the eager implementation's float mask tensor, a head dim the kernel takes, and a device the Triton
        kernels run on."""
        from liger_dspine.ops.sink_attention import _sink_attention_forward_kernel

        head_dim = self.head_dim
        return (
            (cache is None or cache.get_seq_length(self.layer_idx) == 0)
            and not (self.training and self.attention_dropout > 0)
            and not attention_weights_recorded()
            and isinstance(attention_mask, torch.Tensor)
            and attention_mask.is_floating_point()
            and attention_mask.dim() == 4
            and head_dim >= 16
            and head_dim & (head_dim - 1) == 0
            and kernel_runs_on(hidden_states, _sink_attention_forward_kernel)
        )
