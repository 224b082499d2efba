from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.glm4_moe_lite.spec import GLM4_MOE_LITE_SPEC


@checked_options
def apply_liger_kernel_to_glm4_moe_lite(
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
    """Swap the modules of GLM-4.7-Flash (``glm4_moe_lite``) for Liger kernels; liger-kernel's parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3`` (its modules are copies of
    DeepSeek-V3's): ``Glm4MoeLiteRMSNorm`` -> ``LigerRMSNorm``; ``Glm4MoeLiteMLP`` -> ``LigerSwiGLUMLP``; the routed
    experts -> ``LigerGroupedExperts`` / ``LigerFusedExperts``; ``Glm4MoeLiteTopkRouter`` ->
    ``LigerGlm4MoeLiteTopkRouter``; ``Glm4MoeLiteAttention`` (MLA) -> ``LigerGlm4MoeLiteAttention``;
    ``Glm4MoeLiteForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    ``fp8`` (keyword-only, opt-in): the MLA projections', MLPs' and experts' GEMMs in FP8
    (``LigerFP8Glm4MoeLiteAttention``, ``LigerFP8SwiGLUMLP``, ``LigerFP8GroupedExperts``), as for
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
    return apply_spec(GLM4_MOE_LITE_SPEC, options, model)


def revert_liger_kernel_to_glm4_moe_lite(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_glm4_moe_lite``: the classes without a model, else that instance."""
    return patching.revert(GLM4_MOE_LITE_SPEC, model)
