"""DSpine drafter configuration.

Two objects:
- :class:`DSpineConfig`: the frozen dataclass of the DSpine options (stored as the plain dict ``dspine_config``),
  with :meth:`DSpineConfig.validate` and the training :meth:`DSpineConfig.schedule`.
- :class:`DSpineDraftConfig`: a Qwen3 configuration (``model_type: "dspine"`` in memory) carrying the DFlash-family
  fields (``block_size``, ``num_target_layers``, ``dflash_config`` with ``mask_token_id`` and ``target_layer_ids``,
  ``is_causal``) and ``dspine_config``. It saves SpecForge's layout (``model_type: "qwen3"``,
  ``architectures: ["DSpineDraftModel"]``, ``auto_map``) and loads it, as well as this package's older
  ``model_type: "dspine"`` files. A plain Qwen3 config is refused.
"""

import dataclasses
import json
import math
from typing import Any

from transformers import Qwen3Config

from liger_dspine.models.dspine.mla_config import mla_settings

DRAFT_ARCHITECTURE = "DSpineDraftModel"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# SpecForge's DFlash family also has "kda" attention; this drafter builds GQA (MHA when the KV heads equal the heads)
# and MLA, the same kind in every layer.
SUPPORTED_ATTENTION_MODES = ("gqa", "mha", "mla")

_INT_FIELDS = ("transfer_rank", "message_size", "top_k", "alignment_warmup_steps", "replacement_layers")


@dataclasses.dataclass(frozen=True)
class DSpineConfig:
    """DSpine options: spine widths, loss mixing and the alignment / teacher-forcing schedules."""

    transfer_rank: int = 1024
    message_size: int = 512
    top_k: int = 16
    ce_weight: float = 0.1
    alignment_weight: float = 0.5
    alignment_warmup_steps: int = 146
    replacement_layers: int = 3
    replacement_probability: float = 0.5
    replacement_hold_ratio: float = 1.0 / 6.0
    replacement_end_ratio: float = 1.0 / 3.0
    candidate_mass_threshold: float = 1e-4

    @classmethod
    def from_dict(cls, options: dict | None) -> "DSpineConfig":
        """Build from a ``dspine_config`` dict; unknown keys raise ValueError naming them."""
        options = dict(options or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"DSpine: unknown dspine_config field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError (message naming the field) unless every option is usable for this H and V."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"DSpine {name} must be an int, got {value!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"DSpine {field.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"DSpine {field.name} must be finite, got {value!r}")
        if not 0 < self.transfer_rank <= min(hidden_size, vocab_size - 1):
            raise ValueError(
                f"DSpine transfer_rank must be in (0, min(hidden_size, vocab_size - 1)] = "
                f"(0, {min(hidden_size, vocab_size - 1)}], got {self.transfer_rank}"
            )
        if self.message_size < 1:
            raise ValueError(f"DSpine message_size must be >= 1, got {self.message_size}")
        if not 1 <= self.top_k <= vocab_size:
            raise ValueError(f"DSpine top_k must be in [1, vocab_size={vocab_size}], got {self.top_k}")
        if not 0 <= self.ce_weight <= 1:
            raise ValueError(f"DSpine ce_weight must be in [0, 1], got {self.ce_weight}")
        if self.alignment_weight < 0:
            raise ValueError(f"DSpine alignment_weight must be >= 0, got {self.alignment_weight}")
        if self.alignment_warmup_steps < 0:
            raise ValueError(f"DSpine alignment_warmup_steps must be >= 0, got {self.alignment_warmup_steps}")
        if self.replacement_layers < 0:
            raise ValueError(f"DSpine replacement_layers must be >= 0, got {self.replacement_layers}")
        if not 0 <= self.replacement_probability <= 1:
            raise ValueError(f"DSpine replacement_probability must be in [0, 1], got {self.replacement_probability}")
        if not 0 <= self.replacement_hold_ratio < self.replacement_end_ratio <= 1:
            raise ValueError(
                "DSpine replacement_hold_ratio and replacement_end_ratio must satisfy 0 <= hold < end <= 1, got "
                f"replacement_hold_ratio={self.replacement_hold_ratio}, "
                f"replacement_end_ratio={self.replacement_end_ratio}"
            )
        if not 0 <= self.candidate_mass_threshold < 1:
            raise ValueError(f"DSpine candidate_mass_threshold must be in [0, 1), got {self.candidate_mass_threshold}")

    def schedule(self, step: int, total_steps: int | None) -> tuple[float, float]:
        """(beta, p_replace) at optimizer step ``step`` of ``total_steps``.

        beta ramps linearly from 0 to ``alignment_weight`` over ``alignment_warmup_steps``. p_replace holds
        ``replacement_probability`` until ``replacement_hold_ratio`` of training, then falls linearly to 0 at
        ``replacement_end_ratio``; without a horizon (``total_steps`` falsy or <= 0) it is 0.
        """
        step = max(step, 0)
        warmup = self.alignment_warmup_steps
        beta = self.alignment_weight * (min(step / warmup, 1.0) if warmup > 0 else 1.0)
        if not total_steps or total_steps <= 0:
            return beta, 0.0
        progress = step / total_steps
        hold, end = self.replacement_hold_ratio, self.replacement_end_ratio
        fraction = min(max((end - progress) / (end - hold), 0.0), 1.0)
        return beta, self.replacement_probability * fraction


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default taps: target decoder layers spread over [1, num_target_layers - 3] (banker's rounding)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + k * span / (num_draft_layers - 1)) for k in range(num_draft_layers)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_dspine_config_dict(config_dict: dict) -> bool:
    """True for a DSpine draft config: ``model_type "dspine"``, or a Qwen3 config marked as a DSpine draft."""
    model_type = config_dict.get("model_type")
    if model_type == DSpineDraftConfig.model_type:
        return True
    architectures = config_dict.get("architectures") or []
    marked = list(architectures) == [DRAFT_ARCHITECTURE] or config_dict.get("dspine_config") is not None
    return model_type in (None, "qwen3") and marked


class DSpineDraftConfig(Qwen3Config):
    r"""Configuration of a DSpine drafter: a Qwen3 config plus the DFlash-family and DSpine fields.

    Extra fields (all optional in the JSON, resolved and validated here):
        block_size (`int`): tokens per draft block (anchor + proposals), >= 2. Falls back to
            ``dflash_config["block_size"]``.
        num_target_layers (`int`): the target's layer count; only used for the default ``target_layer_ids``.
        dflash_config (`dict`): ``mask_token_id`` (int or None until a trainer resolves it) and
            ``target_layer_ids`` (0-based target decoder layers whose outputs are concatenated, T of them).
            SpecForge's ``attention_mode`` / ``attention_modes`` must be "gqa", "mha" or "mla" (absent: "gqa"; "mla"
            in every layer or none) and its ``projector_type`` null: other values are a ValueError, since this
            drafter builds nothing else. "mla" reads SpecForge's MLA fields (``q_lora_rank``, ``kv_lora_rank``,
            ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; ``dflash_config.mla_rope_interleaved`` and
            ``mla_use_output_gate``), see :mod:`liger_dspine.models.dspine.mla_config`.
        dspine_config (`dict`): the :class:`DSpineConfig` fields; written back complete.
        is_causal (`bool` or None): must not be False. None keeps SpecForge's older sliding-window masks (no window
            inside the draft block; see :mod:`liger_dspine.models.dspine.masks`).
        layer_types: "full_attention" or "sliding_attention" per layer; sliding layers need
            ``use_sliding_window=true`` and a positive ``sliding_window``.
    """

    model_type = "dspine"
    # There is no meaningful default drafter (block size and taps must be given); older transformers build
    # ``cls()`` to diff against unless this is set.
    has_no_defaults_at_init = True

    block_size: Any = None
    num_target_layers: Any = None
    dflash_config: Any = None
    dspine_config: Any = None
    is_causal: Any = None

    def __post_init__(self, **kwargs):
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"DSpine is_causal must be a bool or null, got {self.is_causal!r}")
        if self.is_causal is False:
            raise ValueError("DSpine requires causal attention; is_causal=false is not supported")
        super().__post_init__(**kwargs)
        self._resolve_dflash_fields()
        self._check_attention_mode()
        options = DSpineConfig.from_dict(self.dspine_config)
        options.validate(self.hidden_size, self.vocab_size)
        self.dspine_config = options.to_dict()
        if not self.architectures:
            self.architectures = [DRAFT_ARCHITECTURE]

    def _resolve_dflash_fields(self) -> None:
        dflash = dict(self.dflash_config or {})
        block_size = self.block_size if self.block_size is not None else dflash.get("block_size")
        if not _is_int(block_size):
            raise ValueError(f"DSpine block_size must be an int, got {block_size!r}")
        if block_size < 2:
            raise ValueError(f"DSpine block_size must be >= 2 (an anchor and at least one proposal), got {block_size}")
        self.block_size = block_size

        if self.num_target_layers is not None and not _is_int(self.num_target_layers):
            raise ValueError(f"DSpine num_target_layers must be an int, got {self.num_target_layers!r}")
        target_layer_ids = dflash.get("target_layer_ids")
        if target_layer_ids is None:
            if self.num_target_layers is None:
                raise ValueError("DSpine dflash_config.target_layer_ids is missing and num_target_layers is not set")
            target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        target_layer_ids = list(target_layer_ids)
        if not target_layer_ids or not all(_is_int(i) and i >= 0 for i in target_layer_ids):
            raise ValueError(f"DSpine target_layer_ids must be a non-empty list of ints >= 0, got {target_layer_ids}")
        dflash["target_layer_ids"] = target_layer_ids

        mask_token_id = dflash.get("mask_token_id")
        if mask_token_id is not None and not (_is_int(mask_token_id) and 0 <= mask_token_id < self.vocab_size):
            raise ValueError(f"DSpine mask_token_id must be an int in [0, {self.vocab_size}), got {mask_token_id!r}")
        dflash["mask_token_id"] = mask_token_id
        self.dflash_config = dflash

        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"DSpine layer_types must have num_hidden_layers={self.num_hidden_layers} entries, "
                f"got {len(self.layer_types)}"
            )
        unsupported = sorted(set(self.layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"DSpine layer_types supports only {SUPPORTED_LAYER_TYPES}, got {unsupported}")
        window = self.sliding_window
        if "sliding_attention" in self.layer_types and (
            not self.use_sliding_window or isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(
                "DSpine sliding_attention layers need use_sliding_window=true and a positive int sliding_window, got "
                f"use_sliding_window={self.use_sliding_window!r}, sliding_window={window!r}"
            )

    def _check_attention_mode(self) -> None:
        """Refuse SpecForge's DFlash options this drafter does not build (it would build GQA silently)."""
        dflash = self.dflash_config
        if "attention_mode" in dflash and "attention_modes" in dflash:
            raise ValueError("DSpine dflash_config sets both attention_mode and attention_modes; set one")
        modes = self._attention_modes()
        unsupported = sorted({str(mode) for mode in modes if str(mode).lower() not in SUPPORTED_ATTENTION_MODES})
        if unsupported:
            raise ValueError(
                f"DSpine attention_mode {', '.join(map(repr, unsupported))} is not supported: the drafter implements "
                f"{', '.join(SUPPORTED_ATTENTION_MODES)} attention only"
            )
        if "mha" in (str(mode).lower() for mode in modes) and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"DSpine attention_mode 'mha' needs num_key_value_heads == num_attention_heads, got "
                f"{self.num_key_value_heads} and {self.num_attention_heads}"
            )
        lowered = {str(mode).lower() for mode in modes}
        if "mla" in lowered and lowered != {"mla"}:
            raise ValueError(
                f"DSpine attention_mode 'mla' cannot be mixed with {sorted(lowered - {'mla'})}: every layer of the "
                "drafter has the same attention"
            )
        if self.uses_mla:
            mla_settings(self)
        if dflash.get("projector_type") is not None:
            raise ValueError(
                f"DSpine dflash_config.projector_type {dflash['projector_type']!r} is not supported: the drafter has "
                "no projector (projector_type must be null or absent)"
            )

    def _attention_modes(self) -> list:
        dflash = self.dflash_config
        modes = list(dflash.get("attention_modes") or [dflash.get("attention_mode", "gqa")])
        top_level = getattr(self, "attention_mode", None)  # some DFlash readers also look at the top level
        if top_level is not None:
            modes.append(top_level)
        return modes

    @property
    def uses_mla(self) -> bool:
        """Whether the drafter's attention is MLA (``attention_mode`` "mla"; its sizes: ``mla_settings(config)``)."""
        return {str(mode).lower() for mode in self._attention_modes()} == {"mla"}

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config["mask_token_id"]

    @property
    def dspine_options(self) -> DSpineConfig:
        return DSpineConfig.from_dict(self.dspine_config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Load either layout; a SpecForge file's ``model_type "qwen3"`` is expected here, not a mismatch."""
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        if not is_dspine_config_dict(config_dict):
            raise ValueError(
                f"not a DSpine draft config: model_type={config_dict.get('model_type')!r}, "
                f"architectures={config_dict.get('architectures')!r} and no dspine_config. A DSpine draft config has "
                f'model_type "dspine", or model_type "qwen3" with architectures ["{DRAFT_ARCHITECTURE}"] or a '
                "dspine_config entry"
            )
        config_dict = {key: value for key, value in config_dict.items() if key not in ("model_type", "auto_map")}
        return super().from_dict(config_dict, **kwargs)

    def to_specforge_dict(self) -> dict[str, Any]:
        """The SpecForge form of this config: ``model_type "qwen3"`` with the DSpine architecture and auto_map."""
        return {**self.to_dict(), **SPECFORGE_IDENTITY}

    def to_json_file(self, json_file_path, use_diff: bool = True):
        """Write the config in SpecForge's layout (what ``save_pretrained`` writes): ``model_type "qwen3"``,
        ``architectures ["DSpineDraftModel"]``, its ``auto_map``, and the complete ``dflash_config`` and
        ``dspine_config``."""
        config_dict = self.to_diff_dict() if use_diff else self.to_dict()
        config_dict.update(SPECFORGE_IDENTITY, dflash_config=self.dflash_config, dspine_config=self.dspine_config)
        config_dict.update(block_size=self.block_size)
        with open(json_file_path, "w", encoding="utf-8") as writer:
            writer.write(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")


# What makes a Qwen3 config a DSpine drafter's for SpecForge: its provider resolves the class from ``architectures``.
SPECFORGE_IDENTITY = {
    "model_type": "qwen3",
    "architectures": [DRAFT_ARCHITECTURE],
    "auto_map": {"AutoModel": f"dspine.{DRAFT_ARCHITECTURE}"},
}
