from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.mistral4.spec import MISTRAL4_SPEC


@checked_options
def apply_liger_kernel_to_mistral4(
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
    """Swap the modules of Mistral-Small-4 (``mistral4``) for Liger kernels; liger-kernel's usual parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3``: ``Mistral4RMSNorm`` ->
    ``LigerRMSNorm``; ``Mistral4MLP`` -> ``LigerSwiGLUMLP``; the routed experts -> ``LigerGroupedExperts`` /
    ``LigerFusedExperts``; ``Mistral4Attention`` (MLA, interleaved or half-split RoPE, per-position query scale) ->
    ``LigerMistral4Attention``; ``Mistral4TopkRouter`` -> ``LigerMistral4TopkRouter`` (softmax, groups scored by
    their top-2 sum, in one kernel; the softmax runs in fp32 where the native one runs in the model's dtype);
    ``Mistral4ForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    ``fp8`` (keyword-only, opt-in): the MLA projections', MLPs' and experts' GEMMs in FP8
    (``LigerFP8Mistral4Attention``, ``LigerFP8SwiGLUMLP``, ``LigerFP8GroupedExperts``), as for
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
    return apply_spec(MISTRAL4_SPEC, options, model)


def revert_liger_kernel_to_mistral4(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_mistral4``: the classes without a model, else that instance."""
    return patching.revert(MISTRAL4_SPEC, model)
