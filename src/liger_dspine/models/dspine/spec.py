"""What the DSpine patch replaces, as data."""

from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import PatchSpec

BUILDERS = "liger_dspine.models.dspine.builders"

DSPINE_SPEC = PatchSpec(
    model_type="dspine",
    module=BUILDERS,
    base_classes=(
        "liger_dspine.models.dspine.modeling:DSpinePreTrainedModel",
        "liger_dspine.models.dspine.objective:DSpineObjective",
    ),
    swaps=(
        # layer norms, q/k norms (MLA: q_a / kv_a norms), hidden_norm and the final norm are all built through
        # builders.Qwen3RMSNorm
        ClassSwap("rms_norm", ("Qwen3RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
        ClassSwap("swiglu", ("Qwen3MLP",), "liger_dspine.modules.swiglu:LigerSwiGLUMLP"),
        # the draft-block attention: only the tiles a draft block sees, the key-value heads (not their repeats) kept
        ClassSwap("attention", ("DSpineAttention",), "liger_dspine.models.dspine.liger_attention:LigerDSpineAttention"),
        # an MLA drafter's attention (same option): its query and key assembly with the RoPE in Triton kernels
        ClassSwap(
            "attention",
            ("DSpineMLAAttention",),
            "liger_dspine.models.dspine.liger_mla_attention:LigerDSpineMLAAttention",
        ),
        # the spine's writes and features, keeping no fp32 copy of the states nor the written delta
        ClassSwap(
            "injection", ("AdjacentInjection",), "liger_dspine.models.dspine.liger_injection:LigerAdjacentInjection"
        ),
        # the objective's backbone CE / L1 / top-k through the frozen head, chunked in Triton kernels; an objective
        # built with an explicit fused_objective=True or False keeps its own choice
        MethodSwap(
            "fused_objective",
            "DSpineObjective",
            "patched_fused_objective",
            "liger_dspine.models.dspine.fused_switch:fused_objective_on",
            module="liger_dspine.models.dspine.objective",
        ),
    ),
)
