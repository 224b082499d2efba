"""Native DSpine drafter: DFlash-style decoder layers over [target context ; draft block] plus the spine.

The state dict matches SpecForge's DSpine checkpoints key for key (``layers.{i}.*``, ``norm``, ``fc``,
``hidden_norm``, ``injection.*``, ``transfer_codes``, ``transfer_ready``). RMSNorm and MLP modules come from
:mod:`liger_dspine.models.dspine.builders` (``use_liger_kernel`` picks liger-kernel's modules at build time; it is
not saved in the config).
"""

from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from liger_dspine.models.dspine import builders
from liger_dspine.models.dspine.attention import prepare_mask
from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.configuration import is_dspine_config_dict
from liger_dspine.models.dspine.injection import AdjacentInjection
from liger_dspine.models.dspine.injection import compute_transfer_space
from liger_dspine.models.dspine.mla_config import rope_config


class DSpineOutput(NamedTuple):
    """hidden_states [B, N, b, H] (final-normed), pre_injection [B, N, b, H] (last layer, un-normed),
    layer_features [L, B, N, b, r] (readout features of each layer's post-injection state)."""

    hidden_states: torch.Tensor
    pre_injection: torch.Tensor
    layer_features: torch.Tensor


class DSpineDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual block: attention of the draft over [context ; draft], then a SwiGLU MLP."""

    def __init__(self, config, use_liger_kernel: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = builders.make_attention(config, use_liger_kernel)
        self.mlp = builders.make_mlp(config, use_liger_kernel)
        self.input_layernorm = builders.make_rms_norm(config.hidden_size, config.rms_norm_eps, use_liger_kernel)
        self.post_attention_layernorm = builders.make_rms_norm(
            config.hidden_size, config.rms_norm_eps, use_liger_kernel
        )

    def forward(self, hidden_states, context, position_embeddings, attention_mask, **kwargs) -> torch.Tensor:
        """hidden_states [B, Q, H], context [B, S, H] (shared by all layers, not normed here) -> [B, Q, H]."""
        attended = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, **kwargs
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DSpinePreTrainedModel(PreTrainedModel):
    config_class = DSpineDraftConfig
    config: DSpineDraftConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DSpineDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, AdjacentInjection):
            module.reset_parameters()
        elif getattr(module, "_dspine_spine_child", False):
            return  # initialised with its AdjacentInjection
        else:
            super()._init_weights(module)


class DSpineDraftModel(DSpinePreTrainedModel):
    """DSpine block drafter (no embedding, no LM head: those are the target's, frozen).

    Args:
        config: a :class:`DSpineDraftConfig` (a SpecForge-style ``Qwen3Config`` is converted).
        use_liger_kernel: build RMSNorm / MLP modules from liger-kernel instead of transformers.
    """

    def __init__(self, config, use_liger_kernel: bool = False):
        if not isinstance(config, DSpineDraftConfig):
            config_dict = config.to_dict()
            if not is_dspine_config_dict(config_dict):
                raise ValueError(f"DSpineDraftModel needs a DSpine draft config, got model_type={config.model_type!r}")
            config = DSpineDraftConfig.from_dict(config_dict)
        super().__init__(config)
        self.use_liger_kernel = use_liger_kernel
        self.block_size = config.block_size
        self.target_layer_ids = config.target_layer_ids
        self.mask_token_id = config.mask_token_id
        self.layer_types = list(config.layer_types)
        self.dspine_config = config.dspine_options
        hidden = config.hidden_size
        eps = config.rms_norm_eps

        self.layers = nn.ModuleList(
            DSpineDecoderLayer(config, use_liger_kernel) for _ in range(config.num_hidden_layers)
        )
        self.norm = builders.make_rms_norm(hidden, eps, use_liger_kernel)
        # an MLA drafter turns only the rope part of its query / key heads: cos / sin of that width
        self.rotary_emb = Qwen3RotaryEmbedding(config=rope_config(config) if config.uses_mla else config)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = builders.make_rms_norm(hidden, eps, use_liger_kernel)
        options = self.dspine_config
        self.injection = builders.make_injection(
            hidden,
            config.num_hidden_layers,
            options.transfer_rank,
            options.message_size,
            options.replacement_layers,
            use_liger_kernel,
        )
        for child in self.injection.children():
            for module in child.modules():
                module._dspine_spine_child = True
        self.register_buffer("transfer_codes", torch.zeros(config.vocab_size, options.transfer_rank))
        self.register_buffer("transfer_ready", torch.zeros((), dtype=torch.bool))
        self.post_init()

    # ----------------------------------------------------------------------------------------------- transfer space
    @torch.no_grad()
    def initialize_transfer_space(self, head_weight: torch.Tensor, chunk_size: int = 4096) -> None:
        """Fill ``transfer_codes`` and every readout from the frozen target head [V, H]; mark the space ready."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(head_weight.shape) != expected:
            raise ValueError(
                f"DSpine transfer space needs a head weight of shape {expected}, got {tuple(head_weight.shape)}"
            )
        codes, basis = compute_transfer_space(head_weight, self.injection.rank, chunk_size)
        self.transfer_codes.copy_(codes)
        for readout in self.injection.readouts:
            readout.weight.copy_(basis.T)
        self.transfer_ready.fill_(True)

    def _assert_transfer_ready(self) -> None:
        torch._assert_async(
            self.transfer_ready, "DSpine transfer space is not initialised: call initialize_transfer_space(lm_head)"
        )

    # ------------------------------------------------------------------------------------------------------ forward
    def _prepare_masks(self, attention_mask) -> dict:
        if isinstance(attention_mask, dict):
            missing = sorted(set(self.layer_types) - set(attention_mask))
            if missing:
                raise ValueError(f"DSpine attention mask dict lacks layer types {missing}")
            return {kind: prepare_mask(attention_mask[kind]) for kind in set(self.layer_types)}
        if "sliding_attention" in self.layer_types:
            raise ValueError(
                "DSpine has sliding_attention layers: pass attention_mask as a dict {layer_type: mask} "
                "(masks.draft_attention_masks builds it), not one mask for every layer"
            )
        prepared = prepare_mask(attention_mask)
        return {kind: prepared for kind in set(self.layer_types)}

    def forward(
        self,
        position_ids: torch.Tensor,
        attention_mask,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        block_token_ids: torch.Tensor,
        replace_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> DSpineOutput:
        """
        Args:
            position_ids: [B, S + N*b] long (context 0..S-1, then anchor + j per draft slot).
            attention_mask: bool [B, 1, N*b, S + N*b] or flex BlockMask, or a dict {layer_type: mask}.
            noise_embedding: [B, N*b, H] target embeddings of the draft input ids.
            target_hidden: [B, S, T*H] concatenated target taps.
            block_token_ids: [B, N, b] long, anchor and ground-truth continuations of each block.
            replace_mask: [B, N] bool or None, blocks whose early-layer predecessors are teacher-forced.
            **kwargs: forwarded to every layer (e.g. flex ``kernel_options``).
        """
        self._assert_transfer_ready()
        if use_cache or past_key_values is not None:
            raise ValueError("DSpine drafts without a draft KV cache: use_cache / past_key_values are not supported")
        if attention_mask is None:
            raise ValueError("DSpine needs an explicit causal block attention mask")
        batch, num_blocks, block_size = block_token_ids.shape
        if block_size != self.block_size:
            raise ValueError(f"DSpine block_token_ids has block size {block_size}, the config says {self.block_size}")
        if tuple(noise_embedding.shape[:2]) != (batch, num_blocks * block_size):
            raise ValueError(
                f"DSpine noise_embedding must be [B, N*b] = {(batch, num_blocks * block_size)} in its first dims, "
                f"got {tuple(noise_embedding.shape[:2])}"
            )
        masks = self._prepare_masks(attention_mask)
        context = self.hidden_norm(self.fc(target_hidden))  # [B, S, H]
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)

        hidden = noise_embedding
        features = []
        for layer_index, layer in enumerate(self.layers):
            hidden = layer(hidden, context, position_embeddings, masks[self.layer_types[layer_index]], **kwargs)
            pre_injection = hidden.view(batch, num_blocks, block_size, -1)
            post, post_features = self.injection(
                pre_injection, layer_index, block_token_ids, self.transfer_codes, replace_mask
            )
            hidden = post.reshape(batch, num_blocks * block_size, -1)
            features.append(post_features)
        return DSpineOutput(self.norm(post), pre_injection, torch.stack(features))

    # ------------------------------------------------------------------------------------------------------ decoding
    def refine(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor) -> torch.Tensor:
        """Replay the last layer's injection with a concrete predecessor token, then the final norm.

        Args:
            hidden: [..., H] last-layer pre-injection states.
            predecessor_ids: [...] long.

        Returns:
            [..., H].
        """
        self._assert_transfer_ready()
        layer = len(self.layers) - 1
        injection = self.injection
        predecessor = injection.token_codes(predecessor_ids, self.transfer_codes)
        return self.norm(injection.write(hidden, injection.feature(hidden, layer), predecessor, layer))

    def transition_scores(
        self,
        pre_injection: torch.Tensor,
        candidate_ids: torch.Tensor,
        anchor_ids: torch.Tensor,
        head_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Scores of every candidate under every predecessor choice.

        Args:
            pre_injection: [..., P', H] pre-injection states of the proposal slots.
            candidate_ids: [..., P', K] long.
            anchor_ids: [...] long, the predecessor of slot 0.
            head_weight: [V, H].

        Returns:
            [..., P', K, K] fp32: ``scores[..., i, k, j] = <refine(pre[i], pred[i, k]), head[cand[i, j]]>`` where
            pred[0, k] = anchor and pred[i, k] = cand[i-1, k].
        """
        top_k = candidate_ids.shape[-1]
        anchors = anchor_ids[..., None, None].expand(*anchor_ids.shape, 1, top_k)
        predecessors = torch.cat([anchors, candidate_ids[..., :-1, :]], dim=-2)  # [..., P', K]
        states = pre_injection[..., None, :].expand(*predecessors.shape, pre_injection.shape[-1])
        refined = self.refine(states, predecessors).float()  # [..., P', K, H]
        candidates = head_weight[candidate_ids].float()  # [..., P', K, H]
        return torch.matmul(refined, candidates.transpose(-1, -2))

    @staticmethod
    def select_cached(scores: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Greedy left-to-right path through ``transition_scores``.

        Args:
            scores: [..., P', K, K]; candidate_ids: [..., P', K].

        Returns:
            [..., P'] long, the chosen candidate ids.
        """
        index = torch.zeros(candidate_ids.shape[:-2], dtype=torch.long, device=candidate_ids.device)
        chosen = []
        for slot in range(candidate_ids.shape[-2]):
            row = scores[..., slot, :, :].gather(-2, index[..., None, None].expand(*index.shape, 1, scores.shape[-1]))
            index = row.squeeze(-2).argmax(dim=-1)
            chosen.append(candidate_ids[..., slot, :].gather(-1, index[..., None]).squeeze(-1))
        return torch.stack(chosen, dim=-1)

    def spec_generate(
        self,
        target,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        refine: bool = True,
        generator: torch.Generator | None = None,
    ):
        """Speculative decoding of ``input_ids`` [1, S] with ``target`` verifying this drafter's blocks (SpecForge's
        DFlash signature); see :func:`liger_dspine.models.dspine.generation.spec_generate`.

        Returns:
            ``SpecGenerateOutput``: ``sequences`` [1, S + new tokens] and the acceptance statistics.
        """
        from liger_dspine.models.dspine.generation import spec_generate

        return spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature, refine, generator)
