"""DeepSeek-V3 multi-head latent attention with the interleaved RoPE and the query/key assembly in Triton.

:class:`LigerDeepseekV3Attention` computes what transformers' ``DeepseekV3Attention.forward`` computes, with the
same parameters and ``__init__``, so it can replace the class in ``modeling_deepseek_v3`` or be set as the
``__class__`` of a built module. The forward is the mixin :class:`LigerMLAAttention`: the models whose attention is a
copy of DeepSeek-V3's (GLM-4.7-Flash, A.X-K1, Youtu) each get a ``Liger<Native>`` class from it and their own class.
With ``config.rope_interleave`` it replaces, per layer:

- the query: split, interleaved RoPE, ``torch.cat((q_pass, q_rot))`` -> one kernel (:func:`liger_mla_query`);
- the key: interleaved RoPE of the shared ``k_rot``, broadcast to the heads and copy beside ``k_nope``
  (``expand_kv``) -> one kernel (:func:`liger_mla_key`), which also copies the value out of the ``kv_b_proj``
  output so that output is freed at once instead of being held to the backward by a value view;
- the copy of the attention output back to ``[B, S, H * D]`` for ``o_proj``: query, key and value are stored
  position-major, so flash / cuDNN attention write their output in that layout and ``o_proj`` reads it as is;
- in the backward, the matching copies, the head sum of the rope-key gradient and the concatenation of the key and
  value gradients.

Without ``rope_interleave`` (or with cos/sin that require a gradient) it runs the native forward.

Other models of the family differ in a few places, each a method a model's class overrides:
``_liger_rope_layout`` (the RoPE layout of :mod:`liger_dspine.ops.interleaved_rope`, or None for the native forward),
``_liger_angles`` (cos / sin from the position embeddings), ``_liger_query_scale`` (a factor of the query), and for
DSA models (``models/deepseek_v3/dsa_attention.py``) ``_liger_select_keys`` and ``_liger_outputs``.

transformers versions: before 5.17 the cache holds the expanded key and value (and flash attention pads the value
to the key width); from 5.17 it holds the compressed latents and ``expand_kv`` runs after the cache. Both are
followed, chosen by whether the native class has ``expand_kv``. The cache argument is ``past_key_values`` in 5.17
and ``cache`` in 5.24 (where ``past_key_values`` is deprecated); both names are accepted.
"""

import functools
import inspect
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from liger_dspine.modules.causal_mask import take_plain_causal
from liger_dspine.modules.config_reading import runs_plain_linear
from liger_dspine.modules.fp8_projection import check_fp8_linears
from liger_dspine.modules.fp8_projection import fp8_projection


class LigerMLAAttention:
    """The Liger MLA forward, mixed in before a model's own native MLA class (DeepSeek-V3's or a copy of it).

    ``class Liger<Native>(LigerMLAAttention, <Native>)`` keeps the native ``__init__``, so its submodules (the q / kv
    norms) are the model's own classes, and ``super().forward`` is the native forward. What differs between
    transformers versions is read from the native class when the Liger class is defined:

    - ``native_cache_arg``: the cache argument of the native forward ("past_key_values" in 5.17, "cache" in 5.24);
      the forwards that take ``cache=`` also hand their kwargs to ``cache.update(..., kwargs=kwargs)``;
    - ``latent_cache``: the native class caches the compressed latents (it has ``expand_kv``, transformers >= 5.17);
    - ``modeling``: the native class's modeling module (its attention functions).
    """

    recompute_core = False  # see LigerDeepseekV3RecomputeAttention
    fp8 = False  # the projections' GEMMs on FP8 operands (LigerFP8DeepseekV3Attention)
    FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    @classmethod
    def check_convertible(cls, module) -> None:
        """With ``fp8``: a ValueError for a projection that has a bias or a dim that is not a multiple of 16."""
        if cls.fp8:
            check_fp8_linears("attention", module, cls.FP8_PROJECTIONS)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if any(hasattr(base, "modeling") for base in cls.__bases__):
            return  # a subclass of a Liger class inherits what its parent read
        native = next((base for base in cls.__mro__[1:] if base.__module__.startswith("transformers.")), None)
        if native is None:
            return  # a mixin refining this one (DSA); its Liger<Native> classes read their native class
        params = inspect.signature(native.forward).parameters
        cls.native_cache_arg = "cache" if "cache" in params else "past_key_values"
        cls.cache_update_takes_kwargs = cls.native_cache_arg == "cache"
        cls.latent_cache = hasattr(native, "expand_kv")
        cls.modeling = sys.modules[native.__module__]

    def _liger_flash_pads_value(self) -> bool:
        is_flash = getattr(self.modeling, "is_flash_attention_requested", None)
        if is_flash is not None:
            return bool(is_flash(self.config))
        return "flash" in str(getattr(self.config, "_attn_implementation", "") or "")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, S, hidden]; position_embeddings (cos, sin) [B or 1, S, qk_rope_head_dim].

        Returns (attn_output [B, S, hidden], attention weights or None), as the native forward.
        """
        if cache is None:
            cache = past_key_values
        plain_causal = take_plain_causal(kwargs)
        cos, sin = self._liger_angles(position_embeddings)
        layout = self._liger_rope_layout()
        if layout is None or cos.requires_grad or sin.requires_grad:
            if self.fp8:
                raise ValueError(
                    f"liger-dspine: fp8=True: {type(self).__name__} would run transformers' forward here (a RoPE "
                    "layout its kernels do not take, or angles that need gradients), whose projections are not FP8: "
                    "pass fp8=False"
                )
            # by keyword: the native forwards of the family order their arguments differently
            native = functools.partial(
                super().forward, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs
            )
            if self.recompute_core and cache is None and torch.is_grad_enabled():
                return checkpoint(lambda h: native(hidden_states=h), hidden_states, use_reentrant=False)
            return native(hidden_states=hidden_states, **{self.native_cache_arg: cache})

        batch_size, seq_length = hidden_states.shape[:-1]
        # The latents: the query's after q_a_layernorm (or the hidden states without q_lora_rank), the key/value's
        # after kv_a_layernorm, and the shared rope key.
        if self.q_lora_rank is None:
            q_latent = hidden_states
        else:
            q_latent = self.q_a_layernorm(self._liger_linear(self.q_a_proj, hidden_states, "q_a_proj"))
        compressed_kv = self._liger_linear(self.kv_a_proj_with_mqa, hidden_states, "kv_a_proj_with_mqa")
        kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)

        key_angles = (cos, sin)
        if self.latent_cache and cache is not None:
            # The cache takes the turned rope key and returns every position's latents (outside any recompute).
            kv_nope, k_rot = self._liger_cache_latents(kv_nope, k_rot, cos, sin, cache, kwargs, layout)
            key_angles = (None, None)
        model_mask = attention_mask
        attention_mask, kwargs, selected = self._liger_select_keys(
            hidden_states, q_latent, position_embeddings, attention_mask, cache, kwargs, k_rot.shape[-2]
        )
        if plain_causal and attention_mask is model_mask and self._liger_sdpa_is_causal():
            attention_mask = None  # the model's mask is the causal one: sdpa's is_causal (modules/causal_mask.py)

        def core(q_latent, kv_nope, k_rot, q_weight=None, kv_weight=None):
            return self._liger_attention_core(
                q_latent, kv_nope, k_rot, cos, sin, key_angles, attention_mask, cache, kwargs, q_weight, kv_weight,
                layout,
            )  # fmt: skip

        # transformers' models make a cache in training too (use_cache defaults to True): with latents in it the
        # core is still recomputable; an expanded-key cache (transformers < 5.17) is updated inside the core.
        recomputable = cache is None or self.latent_cache
        if torch.is_grad_enabled() and self._liger_head_groups_apply():
            group = self._liger_heads_per_group(q_latent)
            if self.recompute_core or group < self.num_heads:
                attn_output = self._liger_head_grouped(q_latent, kv_nope, k_rot, core, group)
                return self._liger_outputs(attn_output, None, selected)
        if self.recompute_core and recomputable and torch.is_grad_enabled():
            attn_output, attn_weights = checkpoint(core, q_latent, kv_nope, k_rot, use_reentrant=False)
        else:
            attn_output, attn_weights = core(q_latent, kv_nope, k_rot)
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
        attn_output = self._liger_linear(self.o_proj, attn_output, "o_proj")
        return self._liger_outputs(attn_output, attn_weights, selected)

    def _liger_sdpa_is_causal(self) -> bool:
        """Whether this layer's attention is sdpa with ``is_causal``, which a missing mask turns on."""
        return self.config._attn_implementation == "sdpa" and getattr(self, "is_causal", True)

    def _liger_linear(self, linear: torch.nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
        """``linear(x)``, with its GEMMs in FP8 when the class says so."""
        return fp8_projection(linear, x, name) if self.fp8 else linear(x)

    def _liger_select_keys(self, hidden_states, q_latent, position_embeddings, attention_mask, cache, kwargs, length):
        """``(attention_mask, kwargs, selection)`` for the attention over ``length`` keys (the cache's included),
        after the cache update: a model whose keys are selected per query (DSA) folds that into the mask here."""
        return attention_mask, kwargs, None

    def _liger_outputs(self, attn_output, attn_weights, selection) -> tuple:
        """What the forward returns: the native forward's outputs (``selection`` from :meth:`_liger_select_keys`)."""
        return attn_output, attn_weights

    def _liger_rope_layout(self) -> str | None:
        """The RoPE layout of the query and key rows, or None to run the native forward."""
        return "interleaved" if self.config.rope_interleave else None

    def _liger_angles(self, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B or 1, S, >= R / 2] from what the model passes as ``position_embeddings``."""
        return position_embeddings

    def _liger_query_scale(self, kwargs) -> torch.Tensor | None:
        """A factor the query is multiplied by after its RoPE (broadcast over [B, H, S, D]), or None."""
        return None

    def _liger_attention_core(
        self,
        q_latent,
        kv_nope,
        k_rot,
        cos,
        sin,
        key_angles,
        attention_mask,
        cache,
        kwargs,
        q_weight,
        kv_weight,
        layout="interleaved",
    ):
        """From the latents to the attention output [B, S, H, v_head_dim] and the attention weights (or None).

        ``q_weight`` / ``kv_weight``: rows of the query / key-value up-projections of some heads, which then run
        alone (head-grouped recompute); None: the modules' own projections, every head.
        """
        from liger_dspine.ops.interleaved_rope import liger_mla_query

        batch_size, seq_length = q_latent.shape[:-1]
        # Key and value first, then the query: the backward runs in the opposite order, so the query gradient
        # (turned in place) is consumed by q_b_proj before the key backward allocates the kv_b_proj gradient.
        if self.latent_cache:
            from liger_dspine.ops.interleaved_rope import liger_mla_key

            # key_angles (None, None): k_rot came out of the cache already turned
            kv_heads = self._liger_kv_heads(kv_nope.view(batch_size, 1, -1, self.kv_lora_rank), kv_weight)
            key_states, value_states = liger_mla_key(kv_heads, k_rot, *key_angles, self.qk_nope_head_dim, layout)
        else:
            key_states, value_states = self._liger_expanded_key_value(kv_nope, k_rot, cos, sin, cache, layout)

        if q_weight is None:
            q_states = self._liger_linear(self._liger_q_up_proj(), q_latent, "the query up-projection")
        else:
            q_states = F.linear(q_latent, q_weight)
        # [B, S, H * D] -> [B, H, S, D] view; the kernel reads it in place.
        q_states = q_states.view(batch_size, seq_length, -1, self.qk_head_dim).transpose(1, 2)
        query_states = liger_mla_query(q_states, cos, sin, self.qk_rope_head_dim, layout)
        query_scale = self._liger_query_scale(kwargs)
        if query_scale is not None:
            query_states = query_states * query_scale.to(query_states.dtype)

        pad_value = not self.latent_cache and self.qk_head_dim != self.v_head_dim and self._liger_flash_pads_value()
        if pad_value:
            value_states = F.pad(value_states, [0, self.qk_head_dim - self.v_head_dim])

        attention_interface = self.modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self.modeling.eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        if pad_value:
            attn_output = attn_output[:, :, :, : self.v_head_dim]
        return attn_output, attn_weights

    def _liger_head_groups_apply(self) -> bool:
        """Whether attention can run by head groups: latents in the cache (if any), bias-free plain Linear up- and
        output projections without hooks (their weight rows are used directly), no attention dropout and an
        attention that returns no weights (eager's would be lost). Otherwise the recompute checkpoints the core
        whole and the plain attention runs every head at once."""
        # hooks on a projection would not run: its weight rows are multiplied directly
        projections = (self._liger_q_up_proj(), self.kv_b_proj, self.o_proj)
        plain = all(runs_plain_linear(m) and m.bias is None for m in projections)
        dropout = self.attention_dropout if self.training else 0.0
        eager = self.config._attn_implementation in (None, "eager")
        # head groups multiply weight rows in bf16: with fp8 every head runs at once, its projections in FP8
        return self.latent_cache and plain and dropout == 0.0 and not eager and not self.fp8

    def _liger_heads_per_group(self, q_latent: torch.Tensor) -> int:
        from liger_dspine.models.deepseek_v3 import head_groups

        budget = head_groups.RECOMPUTE_GROUP_BYTES if self.recompute_core else head_groups.KEPT_GROUP_BYTES
        per_token_head = (2 * self.qk_head_dim + 2 * self.v_head_dim) * q_latent.element_size()
        return head_groups.heads_per_group(self.num_heads, q_latent.shape[:-1].numel(), per_token_head, budget)

    def _liger_head_grouped(self, q_latent, kv_nope, k_rot, core, group: int) -> torch.Tensor:
        """``o_proj`` output [B, S, hidden] of :class:`LigerHeadGroupedAttentionFunction`, ``group`` heads at a time."""
        from liger_dspine.models.deepseek_v3.head_groups import liger_head_grouped_attention

        widths = (self.num_heads, self.qk_head_dim, self.qk_nope_head_dim + self.v_head_dim, self.v_head_dim)
        run_group = lambda *args: core(*args)[0]  # noqa: E731
        weights = (self._liger_q_up_proj().weight, self.kv_b_proj.weight, self.o_proj.weight)
        return liger_head_grouped_attention(
            run_group, widths, group, self.recompute_core, q_latent, kv_nope, k_rot, *weights
        )

    def _liger_q_up_proj(self) -> torch.nn.Module:
        """The projection from the query latent to the per-head queries."""
        return self.q_proj if self.q_lora_rank is None else self.q_b_proj

    def _liger_kv_heads(self, kv_latent: torch.Tensor, kv_weight: torch.Tensor | None = None) -> torch.Tensor:
        """kv_latent [B, (1,) L, kv_lora_rank] -> kv_b_proj output (or that of ``kv_weight``'s rows) viewed
        [B, H, L, nope + v] (no copy)."""
        if kv_weight is None:
            kv = self._liger_linear(self.kv_b_proj, kv_latent, "kv_b_proj")
        else:
            kv = F.linear(kv_latent, kv_weight)
        batch_size, length = kv.shape[0], kv.shape[-2]
        return kv.view(batch_size, length, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)

    def _liger_cache_latents(self, kv_nope, k_rot, cos, sin, cache, kwargs, layout="interleaved"):
        """transformers >= 5.17: the cache stores (kv_nope [B, 1, L, kv_lora_rank], turned k_rot [B, 1, L, R]);
        returns both for every cached position."""
        from liger_dspine.ops.interleaved_rope import liger_interleaved_rope_single

        batch_size, _, seq_length, _ = k_rot.shape
        kv_nope = kv_nope.view(batch_size, 1, seq_length, self.kv_lora_rank)
        k_rot = liger_interleaved_rope_single(k_rot, cos, sin, layout)
        if self.cache_update_takes_kwargs:
            return cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
        return cache.update(kv_nope, k_rot, self.layer_idx)

    def _liger_expanded_key_value(self, kv_nope, k_rot, cos, sin, cache, layout="interleaved"):
        """transformers < 5.17: the cache stores the expanded key [B, H, L, nope + R] and value [B, H, L, v]."""
        from liger_dspine.ops.interleaved_rope import liger_mla_key

        kv_heads = self._liger_kv_heads(kv_nope)
        key_states, value_states = liger_mla_key(kv_heads, k_rot, cos, sin, self.qk_nope_head_dim, layout)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        return key_states, value_states


class LigerDeepseekV3Attention(LigerMLAAttention, DeepseekV3Attention):
    """MLA with the interleaved RoPE fused into the query and key assembly; parameters as the native class."""


# What the DeepSeek-V3 class read from transformers (see LigerMLAAttention).
NATIVE_CACHE_ARG = LigerDeepseekV3Attention.native_cache_arg
LATENT_CACHE = LigerDeepseekV3Attention.latent_cache


class LigerFP8DeepseekV3Attention(LigerDeepseekV3Attention):
    """``LigerDeepseekV3Attention`` with the five projections' GEMMs in FP8 (``fp8=True``); every head at once."""

    fp8 = True


class LigerDeepseekV3RecomputeAttention(LigerDeepseekV3Attention):
    """``LigerDeepseekV3Attention`` that keeps only the latents for backward (an opt-in memory saver).

    In training, the query / key / value up-projections, their assembly and the attention forward run again in
    the backward, a group of heads at a time (:mod:`liger_dspine.models.deepseek_v3.head_groups`), instead of
    keeping the per-head query, key, value and attention output (at 128 heads in bf16: 1.25 KiB per token and
    head, 5 GiB per layer at 32768 tokens). The price is one more attention forward and the heads' up-projections
    again in the backward.
    """

    recompute_core = True
