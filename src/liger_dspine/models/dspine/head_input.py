"""What a target's head reads: its final-normed state, or that state scaled as the target scales its logits.

The DSpine teacher is ``lm_head(state)``, so the captured state must be the one whose projection gives the target's
own logits. Most causal LMs project the final-normed state directly; some scale it first or scale the logits after
(MiniCPM3 divides the state by ``logits_scaling = hidden_size / dim_model_base``, Granite divides the logits by
``logits_scaling``, Cohere multiplies them by ``logit_scale``). A bias-free head is linear, so a scale of the logits
is the same scale of the state. :func:`probe_head_input` reads those config fields, runs the target once on a short
probe and keeps the rule under which ``lm_head(rule(final state))`` reproduces the target's own logits. A soft-capped
head (``final_logit_softcapping``: ``cap * tanh(logits / cap)``) is not linear and is refused, as is a target whose
logits no rule reproduces.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from liger_dspine.modules.parallel_state import is_dtensor

# Config fields that scale a target's logits (or its head's input) by a constant, in one direction or the other.
SCALE_FIELDS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier")
# Config fields of a soft-capped head.
SOFT_CAP_FIELDS = ("final_logit_softcapping",)
PROBE_TOKENS = 8
# Largest |target logits - lm_head(rule(state))| over the largest |target logits| that counts as a match: fp32
# rounding of two matmul orders; in a 16-bit dtype the logits are rounded to 8 bits of mantissa (about 4e-3).
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
PROBE_TOLERANCE_16_BIT = 3e-2


@dataclass(frozen=True)
class HeadInput:
    """``state * value`` (or ``state / value`` when ``divide``), from the config field ``field``; the state itself
    when ``field`` is None."""

    field: str | None = None
    value: float = 1.0
    divide: bool = False

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        if self.field is None:
            return states
        return states / self.value if self.divide else states * self.value

    def __str__(self) -> str:
        if self.field is None:
            return "the final-normed state"
        return f"the final-normed state {'/' if self.divide else '*'} {self.field} ({self.value:g})"


def _configs(target: nn.Module) -> list:
    config = getattr(target, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _field_values(target: nn.Module, fields: tuple[str, ...]) -> dict[str, float]:
    values = {}
    for config in _configs(target):
        for name in fields:
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in values:
                values[name] = float(value)
    return values


def _model_type(target: nn.Module) -> str:
    return getattr(getattr(target, "config", None), "model_type", None) or type(target).__name__


def _candidates(target: nn.Module) -> list[HeadInput]:
    rules = [HeadInput()]
    for name, value in _field_values(target, SCALE_FIELDS).items():
        if math.isfinite(value) and value > 0 and value != 1.0:
            rules += [HeadInput(name, value, divide=True), HeadInput(name, value, divide=False)]
    return rules


@torch.no_grad()
def probe_head_input(target: nn.Module, decoder: nn.Module) -> HeadInput:
    """The rule that turns ``decoder.norm``'s output into what ``target``'s head reads, checked on a probe.

    Raises:
        ValueError: a soft-capped head (named by its config field), or logits that no rule reproduces.
    """
    model_type = _model_type(target)
    capped = {name: value for name, value in _field_values(target, SOFT_CAP_FIELDS).items() if value > 0}
    if capped:
        name, value = next(iter(capped.items()))
        raise ValueError(
            f"liger-dspine: DSpine cannot train against this {model_type} target: its logits are soft-capped "
            f"({name}={value:g}), cap * tanh(lm_head(state) / cap), which the objective's teacher lm_head(state) "
            "does not reproduce"
        )
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"liger-dspine: DSpine needs a target with an lm_head; this {model_type} has none")
    weight = head.weight
    if is_dtensor(weight):  # sharded (FSDP2, tensor parallelism): every rank gathers it here
        weight = weight.full_tensor()
    probe = (torch.arange(PROBE_TOKENS, device=weight.device) * 7 + 1) % weight.shape[0]
    kept = []
    handle = decoder.norm.register_forward_hook(lambda module, args, output: kept.append(output))
    try:
        output = target(input_ids=probe[None], use_cache=False)
    finally:
        handle.remove()
    logits = output.logits if hasattr(output, "logits") else output[0]
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"liger-dspine: this {model_type} target's forward returned no logits on a probe of its head")
    logits = logits.float()
    final = kept[-1][0] if isinstance(kept[-1], (tuple, list)) else kept[-1]
    final = final[:, final.shape[1] - logits.shape[1] :]
    bias = None if getattr(head, "bias", None) is None else head.bias.float()
    scale = logits.abs().max().clamp_min(1e-30)
    errors = []
    for rule in _candidates(target):
        projected = F.linear(rule(final).float(), weight.float(), bias)
        errors.append((float((logits - projected).abs().max() / scale), rule))
    error, rule = min(errors, key=lambda pair: pair[0])
    tolerance = PROBE_TOLERANCE.get(final.dtype, PROBE_TOLERANCE_16_BIT)
    if error <= tolerance:
        return rule
    plain = F.linear(final.float(), weight.float(), bias)
    factor = float((logits * plain).sum() / (plain * plain).sum().clamp_min(1e-30))
    fields = _field_values(target, SCALE_FIELDS)
    read = ", ".join(f"{name}={value:g}" for name, value in fields.items()) or f"none of {', '.join(SCALE_FIELDS)}"
    raise ValueError(
        f"liger-dspine: DSpine cannot train against this {model_type} target: its logits are not lm_head(final "
        f"normed state), nor that state scaled by a config field ({read}): on a probe they are about {factor:.4g} "
        f"times it, off by {error:.2g} of their largest value"
    )
