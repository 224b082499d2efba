from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.axk1.spec import AXK1_SPEC
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options


@checked_options
def apply_liger_kernel_to_axk1(
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
    """Swap the modules of A.X-K1 (``axk1``) for Liger kernels; liger-kernel's parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3`` (its modules are copies of
    DeepSeek-V3's): ``AXK1RMSNorm`` -> ``LigerRMSNorm``; ``AXK1MLP`` -> ``LigerSwiGLUMLP``; the routed experts ->
    ``LigerGroupedExperts`` / ``LigerFusedExperts``; ``AXK1TopkRouter`` -> ``LigerAXK1TopkRouter``;
    ``AXK1Attention`` (MLA) -> ``LigerAXK1Attention``; ``AXK1ForCausalLM.forward`` -> ``lce_forward`` (or
    ``ce_forward``). ``fp8=True`` runs the MLA projections, MLPs and routed experts in FP8 (``LigerFP8AXK1Attention``;
    docs/fp8.md).

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
    return apply_spec(AXK1_SPEC, options, model)


def revert_liger_kernel_to_axk1(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_axk1``: the classes without a model, else that instance."""
    return patching.revert(AXK1_SPEC, model)
