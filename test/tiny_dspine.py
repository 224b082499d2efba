"""Tiny DSpine set-ups for the tests: a random Qwen3 target, a matching drafter and a batch.

Nothing is downloaded: the target is built from a config with random weights.
"""

from dataclasses import dataclass

import torch
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM

from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.modeling import DSpineDraftModel

TINY_HIDDEN = 32
TINY_VOCAB = 96
TINY_TARGET_LAYERS = 4
TINY_TAPS = [0, 2]
TINY_MASK_TOKEN = TINY_VOCAB - 1

# The Qwen3-8B DSpine draft config of SpecForge (configs/qwen3-8b-dspine.json), as a SpecForge-style dict.
QWEN3_8B_DSPINE = {
    "architectures": ["DSpineDraftModel"],
    "auto_map": {"AutoModel": "dspine.DSpineDraftModel"},
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 5,
    "layer_types": ["full_attention"] * 5,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "is_causal": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dspine_config": {
        "transfer_rank": 1024,
        "message_size": 512,
        "top_k": 16,
        "ce_weight": 0.1,
        "alignment_weight": 0.5,
        "alignment_warmup_steps": 146,
        "replacement_layers": 3,
        "replacement_probability": 0.5,
        "replacement_hold_ratio": 0.16666666666666666,
        "replacement_end_ratio": 0.3333333333333333,
        "candidate_mass_threshold": 0.0001,
    },
    "dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
}


def tiny_draft_config(**overrides) -> DSpineDraftConfig:
    """H 32, 4 heads of 8 (2 KV heads), 2 layers, vocab 96, block 4, r 8, m 4, K 3, taps [0, 2]."""
    values = dict(
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=256,
        block_size=4,
        dflash_config={"mask_token_id": TINY_MASK_TOKEN, "target_layer_ids": list(TINY_TAPS)},
        dspine_config={"transfer_rank": 8, "message_size": 4, "top_k": 3},
    )
    values.update(overrides)
    return DSpineDraftConfig(**values)


def seeded_draft(target, config: DSpineDraftConfig, seed: int) -> DSpineDraftModel:
    """A native fp32 drafter on the CPU after ``torch.manual_seed(seed)``: its transfer space from the target's head,
    its spine writes drawn at 0.05 (zero-initialised writes would leave the spine out of the first step)."""
    torch.manual_seed(seed)
    draft = DSpineDraftModel(config)
    draft.initialize_transfer_space(target.lm_head.weight.float().cpu())
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.05)
    return draft


def to_device(draft: DSpineDraftModel, device, dtype) -> DSpineDraftModel:
    """The drafter in ``device`` / ``dtype``, its transfer codes kept in fp32 (as with bf16 weights in training)."""
    draft = draft.to(device=device, dtype=dtype)
    draft.transfer_codes = draft.transfer_codes.float()
    return draft


def tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """A random 4-layer Qwen3 target with the tiny draft's width and vocabulary (eval mode, frozen)."""
    config = Qwen3Config(
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=TINY_TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=256,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(config).to(dtype).eval().requires_grad_(False)
    torch.random.set_rng_state(generator_state)
    return target


@dataclass
class TargetBatch:
    """input_ids [B, S]; loss_mask [B, S]; hidden_states [B, S, T*H] taps; target_last_hidden_states [B, S, H]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    target_last_hidden_states: torch.Tensor

    def as_kwargs(self) -> dict:
        return dict(
            input_ids=self.input_ids,
            hidden_states=self.hidden_states,
            loss_mask=self.loss_mask,
            target_last_hidden_states=self.target_last_hidden_states,
        )


@torch.no_grad()
def target_batch(
    target: Qwen3ForCausalLM,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    target_layer_ids: list[int] = TINY_TAPS,
) -> TargetBatch:
    """Run the target once and capture its taps (``hidden_states[i + 1]``) and its final-normed states."""
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids, dtype=torch.float32)
    outputs = target(input_ids, output_hidden_states=True)
    taps = torch.cat([outputs.hidden_states[i + 1] for i in target_layer_ids], dim=-1)
    last = target.model(input_ids).last_hidden_state
    return TargetBatch(input_ids, loss_mask, taps, last)


# SpecForge's MLA fields (customization.md) at the tiny width: 4 heads, query / key heads 12 + 4 (nope + rope),
# value heads 16, latent ranks 12 (query) and 8 (key-value).
TINY_MLA = dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=16)


def tiny_mla_draft_config(rope_interleaved: bool = True, output_gate: bool = True, **overrides) -> DSpineDraftConfig:
    """The tiny drafter with ``dflash_config.attention_mode: "mla"`` (and the MLA options); overrides win."""
    dflash = {
        "mask_token_id": TINY_MASK_TOKEN,
        "target_layer_ids": list(TINY_TAPS),
        "attention_mode": "mla",
        "mla_rope_interleaved": rope_interleaved,
        "mla_use_output_gate": output_gate,
    }
    return tiny_draft_config(**{**TINY_MLA, "dflash_config": dflash, **overrides})
