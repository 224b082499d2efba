from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.youtu.spec import YOUTU_SPEC


@checked_options
def apply_liger_kernel_to_youtu(
    rope: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    model=None,
    *,
    vocab_chunked_lce: bool = False,
    recompute_attention: bool = False,
    fp8: bool = False,
) -> patching.PatchReport:
    """Swap the modules of Youtu-LLM (``youtu``) for Liger kernels; liger-kernel's parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3`` (its modules are copies of
    DeepSeek-V3's): ``YoutuRMSNorm`` -> ``LigerRMSNorm``; ``YoutuMLP`` -> ``LigerSwiGLUMLP``; ``YoutuAttention``
    (MLA) -> ``LigerYoutuAttention``; ``YoutuForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    ``fp8`` (keyword-only, opt-in): the MLA projections' and MLPs' GEMMs in FP8 (``LigerFP8YoutuAttention``,
    ``LigerFP8SwiGLUMLP``), as for ``apply_liger_kernel_to_deepseek_v3``.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    options = v3_options(
        rope=rope,
        cross_entropy=cross_entropy,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        rms_norm=rms_norm,
        swiglu=swiglu,
        vocab_chunked_lce=vocab_chunked_lce,
        recompute_attention=recompute_attention,
        fp8=fp8,
        routed_experts=False,
    )
    return apply_spec(YOUTU_SPEC, options, model)


def revert_liger_kernel_to_youtu(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_youtu``: the classes without a model, else that instance."""
    return patching.revert(YOUTU_SPEC, model)
