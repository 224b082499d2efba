"""What the deepseek_v2 patch (DeepSeek-V2, V2.5, V2-Lite) replaces, and the spec helper of the MLA models whose
router (if any) is a softmax router without a correction bias (DeepSeek-V2, Mistral-Small-4, MiniCPM3).

- ``rms_norm``, ``swiglu`` (dense MLPs and shared experts; the batched routed experts through ``grouped_experts`` or
  ``fused_experts``) and the loss options: as for DeepSeek-V3.
- ``rope`` / ``recompute_attention``: MLA with DeepSeek-V2's in-place pair RoPE in the query / key kernels.
- ``moe_router``: softmax + greedy or group-max selection in one kernel: ``DeepseekV2TopkRouter`` (transformers
  >= 5.17) or ``DeepseekV2Moe.route_tokens_to_experts`` (before; the gate is a plain ``nn.Linear`` then).
"""

from liger_dspine.models.deepseek_v3.family import CAUSAL_LM_FORWARDS
from liger_dspine.models.deepseek_v3.family import LOSS_FORWARDS
from liger_dspine.models.deepseek_v3.family import experts_names
from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import ModuleCheck
from liger_dspine.patching import PatchSpec

MODELING = "transformers.models.deepseek_v2.modeling_deepseek_v2"


def softmax_moe_checks(prefix: str, moe_block: str) -> tuple[ModuleCheck, ...]:
    """The sizes the routing kernel and the experts read must agree with the config."""
    return (
        ModuleCheck((moe_block,), children=("gate", "experts", "shared_experts")),
        ModuleCheck((f"{prefix}TopkRouter",), shapes=(("weight", lambda c: (c.n_routed_experts, c.hidden_size)),)),
        ModuleCheck(
            experts_names(prefix),
            shapes=(
                ("gate_up_proj", lambda c: (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)),
                ("down_proj", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)),
            ),
        ),
    )


def mla_model_spec(
    model_type: str,
    modeling: str,
    prefix: str,
    *,
    modules: str,
    moe_block: str | None,
    route_method: str | None = None,
    router_optional: bool = False,
    forwards: str = CAUSAL_LM_FORWARDS,
) -> PatchSpec:
    """The swaps of ``<prefix>RMSNorm``, ``<prefix>MLP``, ``<prefix>Attention`` (MLA) and, with a ``moe_block``
    class name, ``<prefix>Experts`` and ``<prefix>TopkRouter``, of ``modeling``.

    Args:
        modules: the module defining ``Liger<prefix>Attention``, ``Liger<prefix>RecomputeAttention``,
            ``LigerFP8<prefix>Attention`` and ``Liger<prefix>TopkRouter``.
        moe_block: the MoE block class; None for a dense model.
        route_method: ``"module:function"`` replacing ``<moe_block>.route_tokens_to_experts`` where a transformers
            version routes in the MoE block.
        router_optional: some supported transformers versions have no ``<prefix>TopkRouter`` (DeepSeek-V2 before
            5.17: the gate is a plain ``nn.Linear``).
        forwards: the module defining ``lce_forward``, ``lce_forward_vocab_chunked`` and ``ce_forward``.
    """
    swaps = [
        ClassSwap("rms_norm", (f"{prefix}RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
        ClassSwap("swiglu", (f"{prefix}MLP",), "liger_dspine.modules.swiglu:LigerSwiGLUMLP"),
        ClassSwap("fp8_swiglu", (f"{prefix}MLP",), "liger_dspine.modules.swiglu:LigerFP8SwiGLUMLP"),
    ]
    if moe_block is not None:
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
    swaps += [
        ClassSwap("rope", (f"{prefix}Attention",), f"{modules}:Liger{prefix}Attention"),
        ClassSwap("recompute_attention", (f"{prefix}Attention",), f"{modules}:Liger{prefix}RecomputeAttention"),
        ClassSwap("fp8_rope", (f"{prefix}Attention",), f"{modules}:LigerFP8{prefix}Attention"),
    ]
    if moe_block is not None:
        swaps.append(
            ClassSwap(
                "moe_router",
                (f"{prefix}TopkRouter",),
                f"{modules}:Liger{prefix}TopkRouter",
                required=not router_optional,
            )
        )
    if route_method is not None:
        swaps.append(MethodSwap("moe_router", moe_block, "route_tokens_to_experts", route_method, required=False))
    swaps += [
        MethodSwap(option, f"{prefix}ForCausalLM", "forward", f"{forwards}:{forward}")
        for option, forward in LOSS_FORWARDS
    ]
    return PatchSpec(
        model_type=model_type,
        module=modeling,
        base_classes=(f"{modeling}:{prefix}PreTrainedModel",),
        swaps=tuple(swaps),
        checks=() if moe_block is None else softmax_moe_checks(prefix, moe_block),
    )


DEEPSEEK_V2_SPEC = mla_model_spec(
    "deepseek_v2",
    MODELING,
    "DeepseekV2",
    modules="liger_dspine.models.deepseek_v2.modules",
    moe_block="DeepseekV2Moe",
    route_method="liger_dspine.models.deepseek_v2.router:liger_deepseek_v2_route_tokens_to_experts",
    router_optional=True,
)
