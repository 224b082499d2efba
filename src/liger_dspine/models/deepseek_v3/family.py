"""The patch spec of a model whose modeling file copies DeepSeek-V3's classes under another prefix.

transformers generates such files from ``modular_*.py``: ``Glm4MoeLiteRMSNorm`` is a copy of ``DeepseekV3RMSNorm``,
not a subclass. A copy is swapped for the shared Liger module where that module is built from the same arguments
(``LigerRMSNorm``, ``LigerSwiGLUMLP``, the experts); the attention and the router are swapped for a class made from
the model's own native class and the Liger forward (``class LigerGlm4MoeLiteAttention(LigerMLAAttention,
Glm4MoeLiteAttention)``), so that their ``__init__`` builds the model's own submodules, which its own swaps replace.
"""

import importlib

from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import ModuleCheck
from liger_dspine.patching import PatchSpec

LOSS_FORWARDS = (
    ("fused_linear_cross_entropy", "lce_forward"),
    ("vocab_chunked_lce", "lce_forward_vocab_chunked"),
    ("cross_entropy", "ce_forward"),
)
CAUSAL_LM_FORWARDS = "liger_dspine.modules.causal_lm_forward"


def experts_names(prefix: str) -> tuple[str, ...]:
    """The batched routed experts class: ``<prefix>Experts``, ``<prefix>NaiveMoe`` before transformers 5.9."""
    return (f"{prefix}Experts", f"{prefix}NaiveMoe")


def moe_checks(prefix: str) -> tuple[ModuleCheck, ...]:
    """What the routing kernel and the experts read must agree with the config (E experts, hidden H, width I)."""
    return (
        ModuleCheck((f"{prefix}MoE",), children=("gate", "experts", "shared_experts")),
        ModuleCheck(
            (f"{prefix}TopkRouter",),
            shapes=(
                ("weight", lambda c: (c.n_routed_experts, c.hidden_size)),
                ("e_score_correction_bias", lambda c: (c.n_routed_experts,)),
            ),
        ),
        ModuleCheck(
            experts_names(prefix),
            shapes=(
                ("gate_up_proj", lambda c: (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)),
                ("down_proj", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)),
            ),
        ),
    )


def v3_like_spec(
    model_type: str,
    modeling: str,
    prefix: str,
    *,
    mla_classes: str | None,
    router_classes: str | None,
    causal_lm: str | None = None,
    causal_lm_module: str | None = None,
    base_class: str | None = None,
    forwards: str = CAUSAL_LM_FORWARDS,
) -> PatchSpec:
    """DeepSeek-V3's swaps for the classes ``<prefix>RMSNorm``, ``<prefix>MLP``, ... of ``modeling``.

    Args:
        mla_classes: the module defining ``Liger<prefix>Attention``, ``Liger<prefix>RecomputeAttention`` and
            ``LigerFP8<prefix>Attention``; None
            when the model's attention is not DeepSeek-V3's MLA (it stays native).
        router_classes: the module defining ``Liger<prefix>TopkRouter``; None for a dense model (no router, no
            routed experts).
        causal_lm: the class whose ``forward`` the loss options replace (``<prefix>ForCausalLM`` by default), in
            ``causal_lm_module`` (``modeling`` by default).
        base_class: ``"module:Class"`` an instance patch accepts (``<prefix>PreTrainedModel`` of ``modeling``).
        forwards: the module defining ``lce_forward``, ``lce_forward_vocab_chunked`` and ``ce_forward``.
    """
    swaps = [
        ClassSwap("rms_norm", (f"{prefix}RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
        ClassSwap("swiglu", (f"{prefix}MLP",), "liger_dspine.modules.swiglu:LigerSwiGLUMLP"),
        ClassSwap("fp8_swiglu", (f"{prefix}MLP",), "liger_dspine.modules.swiglu:LigerFP8SwiGLUMLP"),
    ]
    if router_classes is not None:
        swaps += [
            ClassSwap("fused_experts", experts_names(prefix), "liger_dspine.modules.experts:LigerFusedExperts"),
            ClassSwap(
                "grouped_experts", experts_names(prefix), "liger_dspine.modules.grouped_experts:LigerGroupedExperts"
            ),
            ClassSwap(
                "fp8_grouped_experts",
                experts_names(prefix),
                "liger_dspine.modules.grouped_experts:LigerFP8GroupedExperts",
            ),
        ]
    if mla_classes is not None:
        swaps += [
            ClassSwap("rope", (f"{prefix}Attention",), f"{mla_classes}:Liger{prefix}Attention"),
            ClassSwap("recompute_attention", (f"{prefix}Attention",), f"{mla_classes}:Liger{prefix}RecomputeAttention"),
            ClassSwap("fp8_rope", (f"{prefix}Attention",), f"{mla_classes}:LigerFP8{prefix}Attention"),
        ]
    if router_classes is not None:
        swaps += [
            ClassSwap("moe_router", (f"{prefix}TopkRouter",), f"{router_classes}:Liger{prefix}TopkRouter"),
            # transformers < 5.13 selects the experts in the MoE block
            MethodSwap(
                "moe_router",
                f"{prefix}MoE",
                "route_tokens_to_experts",
                "liger_dspine.models.deepseek_v3.router:liger_route_tokens_to_experts",
                required=False,
            ),
        ]
    owner = causal_lm or f"{prefix}ForCausalLM"
    swaps += [
        MethodSwap(option, owner, "forward", f"{forwards}:{forward}", module=causal_lm_module)
        for option, forward in LOSS_FORWARDS
    ]
    return PatchSpec(
        model_type=model_type,
        module=modeling,
        base_classes=(base_class or f"{modeling}:{prefix}PreTrainedModel",),
        swaps=tuple(swaps),
        checks=moe_checks(prefix) if router_classes is not None else (),
    )


def swapped_class_names(spec: PatchSpec) -> list[str]:
    """The native classes (first candidate name) and methods a spec replaces, in spec order, each once."""
    names = []
    for swap in spec.swaps:
        name = swap.names[0] if isinstance(swap, ClassSwap) else f"{swap.owner}.{swap.method}"
        if name not in names:
            names.append(name)
    return names


def refuse_rope(
    model_type: str, attention: str = "GQA attention", reason: str = "no RoPE kernel of this package fits it yet"
) -> None:
    raise ValueError(f"liger-dspine: the {model_type} patch leaves its {attention} native ({reason}); pass rope=False")


def dsa_rope(spec: PatchSpec, rope: bool | None) -> bool:
    """Whether the DSA model's MLA attention takes the Liger forward (its ``rope`` swap's class, a
    :class:`~liger_dspine.models.deepseek_v3.dsa_attention.LigerDSAAttention`).

    ``rope`` None: where that class fits the installed transformers (5.24 and later, whose DSA attention caches the
    compressed latents); True: required there, a ValueError before (those versions cache the expanded key and value,
    or build the sparse mask another way); False: native.
    """
    fits = _rope_swap_fits(spec)
    if rope is None:
        return fits
    if rope and not fits:
        refuse_rope(
            spec.model_type,
            "MLA attention with the DSA indexer",
            "the installed transformers' DSA attention does not cache the compressed latents, which the Liger MLA "
            "forward needs: transformers 5.24 or later",
        )
    return bool(rope)


def _rope_swap_fits(spec: PatchSpec) -> bool:
    module, _, name = next(s.replacement for s in spec.swaps if s.option == "rope").partition(":")
    try:
        liger_class = getattr(importlib.import_module(module), name)
    except ImportError:  # transformers lacks the model: the patch names that itself
        return False
    return liger_class.liger_forward_fits()
