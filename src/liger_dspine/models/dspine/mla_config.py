"""The MLA fields of a DSpine draft config (``dflash_config.attention_mode: "mla"``), read and checked.

SpecForge's names, at the config's top level: ``q_lora_rank`` (null: a direct ``q_proj``), ``kv_lora_rank``,
``qk_nope_head_dim`` (may be 0), ``qk_rope_head_dim`` (even) and ``v_head_dim``. In ``dflash_config``:
``mla_rope_interleaved`` (default: the config's ``rope_interleave``, else true) and ``mla_use_output_gate`` (default:
a top-level ``mla_use_output_gate``, else false).
"""

import copy
from dataclasses import dataclass

MLA_RANK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MLASettings:
    """Sizes and layout of a drafter's MLA attention (N heads; D = nope + rope per query / key head)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # True: pairs (2i, 2i + 1) turn by frequency i; False: rotate_half
    output_gate: bool  # a sigmoid gate g_proj(x) on each head's output before o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_settings(config) -> MLASettings:
    """Read the MLA fields of ``config``; a missing or invalid one is a ValueError naming it."""
    values = {name: getattr(config, name, None) for name in MLA_RANK_FIELDS}
    for name in MLA_RANK_FIELDS[1:]:
        if values[name] is None:
            raise ValueError(f"DSpine attention_mode 'mla' needs {name} in the config; it is missing")
    for name, value in values.items():
        if value is None:
            continue  # q_lora_rank only
        lowest = 0 if name == "qk_nope_head_dim" else 1
        if not _is_int(value) or value < lowest:
            raise ValueError(f"DSpine MLA {name} must be an int >= {lowest}, got {value!r}")
    if values["qk_rope_head_dim"] % 2:
        raise ValueError(f"DSpine MLA qk_rope_head_dim must be even, got {values['qk_rope_head_dim']}")

    dflash = dict(getattr(config, "dflash_config", None) or {})
    interleaved = dflash.get("mla_rope_interleaved", getattr(config, "rope_interleave", True))
    gate = dflash.get("mla_use_output_gate", getattr(config, "mla_use_output_gate", False))
    for name, value in (("mla_rope_interleaved", interleaved), ("mla_use_output_gate", gate)):
        if not isinstance(value, bool):
            raise ValueError(f"DSpine dflash_config.{name} must be a bool, got {value!r}")
    return MLASettings(**values, rope_interleaved=interleaved, output_gate=gate)


def rope_config(config):
    """A copy of ``config`` whose ``head_dim`` is the MLA rope width: Qwen3RotaryEmbedding sizes its frequencies
    by ``head_dim``, so built on it the rotary embedding gives cos / sin [B, S, qk_rope_head_dim]."""
    rope = copy.deepcopy(config)
    rope.head_dim = mla_settings(config).qk_rope_head_dim
    return rope
