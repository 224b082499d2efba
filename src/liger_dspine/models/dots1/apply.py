from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.deepseek_v3.family import refuse_rope
from liger_dspine.models.dots1.spec import DOTS1_SPEC


@checked_options
def apply_liger_kernel_to_dots1(
    rope: bool = False,
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
    fp8: bool = False,
) -> patching.PatchReport:
    """Swap the modules of dots.llm1 (``dots1``) for Liger kernels; liger-kernel's parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3`` (its modules are copies of
    DeepSeek-V3's): ``Dots1RMSNorm`` -> ``LigerRMSNorm``; ``Dots1MLP`` -> ``LigerSwiGLUMLP``; the routed experts ->
    ``LigerGroupedExperts`` / ``LigerFusedExperts``; ``Dots1TopkRouter`` -> ``LigerDots1TopkRouter``;
    ``Dots1ForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    Its GQA attention stays native (no RoPE kernel of this package fits it yet), so ``rope``, kept for
    liger-kernel's parameter order, must be False.

    ``fp8`` (keyword-only, opt-in): the MLPs' and routed experts' GEMMs in FP8 (``LigerFP8SwiGLUMLP``,
    ``LigerFP8GroupedExperts``), as for ``apply_liger_kernel_to_deepseek_v3``; the attention stays native, in
    its dtype.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    if rope:
        refuse_rope("dots1")
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
        fp8=fp8,
    )
    return apply_spec(DOTS1_SPEC, options, model)


def revert_liger_kernel_to_dots1(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_dots1``: the classes without a model, else that instance."""
    return patching.revert(DOTS1_SPEC, model)
