"""Draft-block attention over [target context ; draft block] with a causal-block mask.

Supported implementations (``config._attn_implementation``): "sdpa" (default), "eager" and "flex_attention".
Dense masks are bool [B, 1, Q, S+Q] (True = attend). Rows with no visible key (dropped blocks) are made to attend
everywhere and their output is zeroed afterwards, so every implementation returns finite zeros there with zero
gradients, whatever the backend does with fully masked rows.
"""

import functools
import warnings
from dataclasses import dataclass
from dataclasses import field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from liger_dspine.ops.masked_attention import AttentionTiles
from liger_dspine.ops.masked_attention import TileSizes
from liger_dspine.ops.masked_attention import attention_tiles

SUPPORTED_ATTENTION = ("sdpa", "eager", "flex_attention")


@dataclass
class PreparedMask:
    """A mask in the form the attention call consumes.

    dense: bool [B, 1, Q, K] with fully masked rows opened up (None for flex).
    row_visible: [B, 1, Q, 1] bool, False for rows whose output is forced to zero (None for flex).
    block_mask: a flex ``BlockMask`` (None for dense).
    visible: the bool mask as given, fully masked rows included (None for flex; made from ``dense`` and
        ``row_visible`` when not given).
    """

    dense: torch.Tensor | None = None
    row_visible: torch.Tensor | None = None
    block_mask: object | None = None
    visible: torch.Tensor | None = None
    _biases: dict = field(default_factory=dict, repr=False, compare=False)
    _tiles: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.visible is None and self.dense is not None:
            self.visible = self.dense if self.row_visible is None else self.dense & self.row_visible

    def tiles(self, sizes: TileSizes, batch: int) -> AttentionTiles:
        """The tile lists of ``visible`` (broadcast to ``batch``) for the masked-attention kernels, made once for
        every layer."""
        tiles = self._tiles.get((sizes, batch))
        if tiles is None:
            visible = self.visible.expand(batch, *self.visible.shape[1:])
            tiles = self._tiles[(sizes, batch)] = attention_tiles(visible, sizes)
        return tiles

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``dense`` as an additive bias [B, 1, Q, K] in ``dtype`` (0 where attended, -inf elsewhere), made once.

        sdpa turns a bool mask into this bias itself, in every call, and its backward keeps each copy: one bias
        shared by every layer saves a [B, 1, Q, K] tensor per layer after the first.
        """
        bias = self._biases.get(dtype)
        if bias is None:
            bias = torch.zeros(self.dense.shape, dtype=dtype, device=self.dense.device)
            bias.masked_fill_(~self.dense, float("-inf"))
            self._biases[dtype] = bias
        return bias


def prepare_mask(mask) -> PreparedMask:
    """Accepts a bool tensor [B, 1, Q, K] (True = attend) or a flex ``BlockMask``."""
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"DSpine expects a bool attention mask [B, 1, Q, K], got {mask.dtype} {tuple(mask.shape)}")
        row_visible = mask.any(dim=-1, keepdim=True)
        return PreparedMask(dense=mask | ~row_visible, row_visible=row_visible, visible=mask)
    return PreparedMask(block_mask=mask)


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE. states [B, heads, T, d]; cos/sin [B, T, d]."""
    cos, sin = cos[:, None], sin[:, None]
    return states * cos + rotate_half(states) * sin


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def _eager(query, key, value, mask: PreparedMask, scaling: float, dropout: float, groups: int) -> torch.Tensor:
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask.dense, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value)


def _sdpa(query, key, value, mask: PreparedMask, scaling: float, dropout: float, groups: int) -> torch.Tensor:
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bias = mask.additive(query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


_FLEX_MIN_HEAD_DIM = 16  # inductor's flex-attention kernel takes no narrower query / key / value heads


def _flex(query, key, value, mask: PreparedMask, scaling: float, dropout: float, groups: int, **kwargs):
    if dropout > 0:
        raise ValueError("DSpine flex attention needs attention_dropout == 0")
    narrow = min(query.shape[-1], value.shape[-1]) < _FLEX_MIN_HEAD_DIM
    if query.is_cuda and not narrow:
        flex_attention = _compiled_flex_attention()
        options = {"kernel_options": kwargs["kernel_options"]} if kwargs.get("kernel_options") else {}
    else:  # the unfused flex attention: CPUs, and heads narrower than the compiled kernel takes
        from torch.nn.attention.flex_attention import flex_attention

        if query.is_cuda:
            warnings.warn(
                f"liger-dspine: DSpine flex attention with heads of {query.shape[-1]} / {value.shape[-1]} (below "
                f"{_FLEX_MIN_HEAD_DIM}, which the compiled flex kernel needs) runs unfused: the same numbers, with "
                "the [queries, keys] scores in memory",
                stacklevel=2,
            )
        options = {}
    return flex_attention(
        query, key, value, block_mask=mask.block_mask, scale=scaling, enable_gqa=groups > 1, **options
    )


class DSpineAttention(nn.Module):
    """Grouped-query attention of the draft block over [context ; draft], q/k RMS-normed per head."""

    def __init__(self, config, use_liger_kernel: bool = False):
        from liger_dspine.models.dspine import builders  # builders looks this class up at import

        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = builders.make_rms_norm(self.head_dim, config.rms_norm_eps, use_liger_kernel)
        self.k_norm = builders.make_rms_norm(self.head_dim, config.rms_norm_eps, use_liger_kernel)

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
            position_embeddings: (cos, sin), each [B, S+Q, d]; queries use the last Q positions.
            attention_mask: the prepared causal-block mask.

        Returns:
            [B, Q, H].
        """
        batch, q_len, _ = hidden_states.shape
        kv_input = torch.cat([context, hidden_states], dim=1)  # [B, S+Q, H]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query = apply_rotary(query, cos[:, -q_len:], sin[:, -q_len:])
        key = apply_rotary(key, cos, sin)

        output = self._attend_rows(query, key, value, attention_mask, **kwargs)
        return self.o_proj(output.reshape(batch, q_len, -1))

    def _attend_rows(self, query, key, value, attention_mask: PreparedMask, **kwargs) -> torch.Tensor:
        """:meth:`_attend` with the dropped rows zeroed, per query position: [B, Q, N, D]."""
        output = self._attend(query, key, value, attention_mask, **kwargs)
        if attention_mask.row_visible is not None:
            output = output * attention_mask.row_visible.to(output.dtype)
        return output.transpose(1, 2)

    def _attend(self, query, key, value, attention_mask: PreparedMask, **kwargs) -> torch.Tensor:
        """q [B, N, Q, D], k / v [B, N_kv, S+Q, D] -> [B, N, Q, D] through ``config._attn_implementation``."""
        return self._attend_grouped(query, key, value, attention_mask, self.num_key_value_groups, **kwargs)

    def _attend_repeated(self, query, key, value, attention_mask: PreparedMask, **kwargs) -> torch.Tensor:
        """:meth:`_attend` with k / v already repeated to the query heads, [B, N, S+Q, D]."""
        return self._attend_grouped(query, key, value, attention_mask, 1, **kwargs)

    def _attend_grouped(self, query, key, value, attention_mask: PreparedMask, groups: int, **kwargs):
        implementation = self.config._attn_implementation or "sdpa"
        dropout = self.attention_dropout if self.training else 0.0
        args = (query, key, value, attention_mask, self.scaling, dropout, groups)
        if implementation == "sdpa":
            return _sdpa(*args)
        if implementation == "eager":
            return _eager(*args)
        if implementation == "flex_attention":
            return _flex(*args, **kwargs)
        raise ValueError(f"DSpine attention supports {SUPPORTED_ATTENTION}, got {implementation!r}")
