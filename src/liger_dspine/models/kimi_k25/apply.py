from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.kimi_k25.spec import KIMI_K25_SPEC


@checked_options
def apply_liger_kernel_to_kimi_k25(
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
    """Swap the text model of Kimi K2.5 / K2.6 (``kimi_k25``) for Liger kernels; liger-kernel's parameter order.

    Its text model is DeepSeek-V3's, so the options mean what they mean for ``apply_liger_kernel_to_deepseek_v3``,
    on DeepSeek-V3's classes: ``DeepseekV3RMSNorm`` -> ``LigerRMSNorm``; ``DeepseekV3MLP`` -> ``LigerSwiGLUMLP``;
    the routed experts -> ``LigerGroupedExperts`` / ``LigerFusedExperts``; ``DeepseekV3Attention`` ->
    ``LigerDeepseekV3Attention``; ``DeepseekV3TopkRouter`` -> ``LigerDeepseekV3TopkRouter``. ``fp8=True`` runs the
    text model's MLA projections, MLPs and routed experts in FP8 as for DeepSeek-V3 (docs/fp8.md). The loss options
    replace ``Kimi_K25ForConditionalGeneration.forward`` (``models/kimi_k25/forward.py``): the Liger loss for
    text-only batches, transformers' forward for batches with images or videos. The vision tower stays native.

    ``model=None`` patches the classes, DeepSeek-V3's included: DeepSeek-V3 models built afterwards get the Liger
    modules too, and ``revert_liger_kernel_to_kimi_k25()`` restores them.

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
    return apply_spec(KIMI_K25_SPEC, options, model)


def revert_liger_kernel_to_kimi_k25(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_kimi_k25``: the classes (DeepSeek-V3's included) without a model, else that
    instance."""
    return patching.revert(KIMI_K25_SPEC, model)
