"""Multi-head latent attention (MLA) of the draft block over [context ; draft], SpecForge's parameterization.

Per token x [H] (context and draft alike): the latent ``kv_a_proj_with_mqa(x)`` [kv_lora_rank + R] splits into
c [kv_lora_rank] and the rope key shared by all heads [R]; ``kv_b_proj(kv_a_layernorm(c))`` gives each head its
nope key [nope] and value [V]. Queries come from the draft stream only, through ``q_proj`` or the low-rank
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; per head [nope + R], the last R columns rotated. The keys are
expanded per head, so the attention is the plain multi-head call of :class:`DSpineAttention` (sdpa, eager or flex,
the same prepared mask and zeroed dropped rows), scaled by (nope + R)^-0.5. An optional ``g_proj`` gate,
sigmoid(g_proj(x)) [N * V], multiplies the heads' output before ``o_proj``. No q / k norms.

RoPE positions are the drafter's position ids; ``position_embeddings`` is the model's (cos, sin) [B, S+Q, R], built
by a rotary embedding of width R (see :func:`liger_dspine.models.dspine.mla_config.rope_config`).
"""

import torch
from torch import nn

from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.models.dspine.attention import apply_rotary
from liger_dspine.models.dspine.mla_config import mla_settings


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): each consecutive pair turned by 90 degrees."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_mla_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of states [B, heads, T, R] with cos / sin [B, T, R] (``cat(freqs, freqs)``).

    interleaved: pair (2i, 2i+1) turns by frequency i, in place; else rotate_half (pair (i, R/2 + i)).
    """
    if not interleaved:
        return apply_rotary(states, cos, sin)
    cos, sin = cos[:, None], sin[:, None]
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return states * cos + rotate_pairs(states) * sin


class DSpineMLAAttention(nn.Module):
    """MLA of the draft block over [context ; draft] (parameter names as SpecForge's ``Qwen3DFlashMLAAttention``)."""

    # the attention call of the GQA module: sdpa / eager / flex over the prepared mask, dropped rows zeroed
    _attend = DSpineAttention._attend
    _attend_rows = DSpineAttention._attend_rows
    _attend_grouped = DSpineAttention._attend_grouped

    def __init__(self, config, use_liger_kernel: bool = False):
        from liger_dspine.models.dspine import builders  # builders looks this class up at import

        super().__init__()
        settings = mla_settings(config)
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1  # keys are expanded per head
        self.q_lora_rank = settings.q_lora_rank
        self.kv_lora_rank = settings.kv_lora_rank
        self.qk_nope_head_dim = settings.qk_nope_head_dim
        self.qk_rope_head_dim = settings.qk_rope_head_dim
        self.v_head_dim = settings.v_head_dim
        self.qk_head_dim = settings.qk_head_dim
        self.rope_interleaved = settings.rope_interleaved
        self.use_output_gate = settings.output_gate
        self.scaling = self.qk_head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        bias, hidden, heads = config.attention_bias, config.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_head_dim, bias=bias)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = builders.make_rms_norm(self.q_lora_rank, config.rms_norm_eps, use_liger_kernel)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=bias)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = builders.make_rms_norm(self.kv_lora_rank, config.rms_norm_eps, use_liger_kernel)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=bias)
        if self.use_output_gate:
            self.g_proj = nn.Linear(hidden, heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: PreparedMask,
        **kwargs,
    ) -> torch.Tensor:
        """
        Args:
            hidden_states: [B, Q, H] normed draft stream (Q = N*b).
            context: [B, S, H] fused target context.
            position_embeddings: (cos, sin), each [B, S+Q, R]; queries use the last Q positions.
            attention_mask: the prepared causal-block mask.

        Returns:
            [B, Q, H].
        """
        batch, q_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        query, key, value = self._query_key_value(hidden_states, context, cos, sin)
        output = self._attend_rows(query, key, value, attention_mask, **kwargs)  # [B, Q, N, V]
        if self.use_output_gate:
            output = output * torch.sigmoid(self.g_proj(hidden_states)).view(batch, q_len, -1, self.v_head_dim)
        return self.o_proj(output.reshape(batch, q_len, -1))

    def _project_query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, Q, H] -> [B, N, Q, nope + R]: a view of the projection's [B, Q, N * (nope + R)] output."""
        batch, q_len, _ = hidden_states.shape
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return query.view(batch, q_len, -1, self.qk_head_dim).transpose(1, 2)

    def _project_key_value(self, kv_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, K, H] -> (kv [B, N, K, nope + V] per head, rope key [B, 1, K, R] before its RoPE)."""
        batch, kv_len, _ = kv_input.shape
        latent, k_rot = self.kv_a_proj_with_mqa(kv_input).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        return kv.view(batch, kv_len, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2), k_rot[:, None]

    def _query_key_value(self, hidden_states, context, cos, sin):
        """query [B, N, Q, nope + R], key [B, N, S+Q, nope + R], value [B, N, S+Q, V]."""
        q_len = hidden_states.shape[1]
        q_nope, q_rot = self._project_query(hidden_states).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        kv, k_rot = self._project_key_value(torch.cat([context, hidden_states], dim=1))
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q_rot = apply_mla_rotary(q_rot, cos[:, -q_len:], sin[:, -q_len:], self.rope_interleaved)
        k_rot = apply_mla_rotary(k_rot, cos, sin, self.rope_interleaved).expand(-1, self.num_heads, -1, -1)
        return torch.cat([q_nope, q_rot], dim=-1), torch.cat([k_nope, k_rot], dim=-1), value
