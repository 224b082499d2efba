from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v2.spec import DEEPSEEK_V2_SPEC
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options


@checked_options
def apply_liger_kernel_to_deepseek_v2(
    rope: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    model=None,
    *,
    moe_router: bool = True,
    fused_experts: bool = False,
    grouped_experts: bool = True,
    vocab_chunked_lce: bool = False,
    recompute_attention: bool = False,
    fp8: bool = False,
) -> patching.PatchReport:
    """Swap the modules of DeepSeek-V2 / V2.5 / V2-Lite (``deepseek_v2``) for Liger kernels; liger-kernel's
    parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3``: ``DeepseekV2RMSNorm`` ->
    ``LigerRMSNorm``; ``DeepseekV2MLP`` -> ``LigerSwiGLUMLP``; the routed experts -> ``LigerGroupedExperts`` /
    ``LigerFusedExperts``; ``DeepseekV2Attention`` (MLA, RoPE turning pairs in place) -> ``LigerDeepseekV2Attention``
    (``rope``, default True: liger-kernel's function has no RoPE kernel for this model and only warns);
    ``DeepseekV2TopkRouter`` -> ``LigerDeepseekV2TopkRouter`` (softmax, "greedy" or "group_limited_greedy" selection
    in one kernel; ``DeepseekV2Moe.route_tokens_to_experts`` before transformers 5.17);
    ``DeepseekV2ForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    ``fp8`` (keyword-only, opt-in): the MLA projections', MLPs' and experts' GEMMs in FP8
    (``LigerFP8DeepseekV2Attention``, ``LigerFP8SwiGLUMLP``, ``LigerFP8GroupedExperts``), as for
    ``apply_liger_kernel_to_deepseek_v3``.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    options = v3_options(
        rope=rope,
        cross_entropy=cross_entropy,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        rms_norm=rms_norm,
        swiglu=swiglu,
        moe_router=moe_router,
        fused_experts=fused_experts,
        grouped_experts=grouped_experts,
        vocab_chunked_lce=vocab_chunked_lce,
        recompute_attention=recompute_attention,
        fp8=fp8,
    )
    return apply_spec(DEEPSEEK_V2_SPEC, options, model)


def revert_liger_kernel_to_deepseek_v2(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_deepseek_v2``: the classes without a model, else that instance."""
    return patching.revert(DEEPSEEK_V2_SPEC, model)
