from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.deepseek_v3.family import dsa_rope
from liger_dspine.models.deepseek_v32.spec import DEEPSEEK_V32_SPEC


@checked_options
def apply_liger_kernel_to_deepseek_v32(
    rope: bool | None = None,
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
    indexer: bool = True,
    recompute_attention: bool = False,
    fp8: bool = False,
) -> patching.PatchReport:
    """Swap the modules of DeepSeek-V3.2 (``deepseek_v32``) for Liger kernels; liger-kernel's parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_deepseek_v3`` (its modules are copies of
    DeepSeek-V3's): ``DeepseekV32RMSNorm`` -> ``LigerRMSNorm``; ``DeepseekV32MLP`` -> ``LigerSwiGLUMLP``; the routed
    experts -> ``LigerGroupedExperts`` / ``LigerFusedExperts``; ``DeepseekV32TopkRouter`` ->
    ``LigerDeepseekV32TopkRouter``; ``DeepseekV32ForCausalLM.forward`` -> ``lce_forward`` (or ``ce_forward``).

    ``indexer`` (keyword-only): ``DeepseekV32Indexer`` -> ``LigerDeepseekV32Indexer``, the DSA indexer's scores in
    one fused kernel without the fp32 [B, S, index heads, T] tensor; its projections, RoPE, mask and top-k as native.

    ``rope``: ``DeepseekV32Attention`` (MLA with the DSA key selection) -> ``LigerDeepseekV32Attention``, the
    query and key assembly with the interleaved RoPE in the Liger kernels, its indexer and sparse mask as the native
    forward's. It needs transformers 5.24 or later (earlier versions cache the expanded key and value): None (the
    default) takes it there and leaves the attention native before; True asks for it (a ValueError before 5.24);
    False leaves it native. ``recompute_attention`` (keyword-only): ``LigerDeepseekV32RecomputeAttention``, which keeps
    only the latents for backward.

    ``fp8`` (keyword-only, opt-in): the MLPs' and experts' GEMMs in FP8 (``LigerFP8SwiGLUMLP``,
    ``LigerFP8GroupedExperts``), and the MLA projections' where ``rope`` takes the Liger attention
    (``LigerFP8DeepseekV32Attention``), as for ``apply_liger_kernel_to_deepseek_v3``. The indexer stays in its dtype.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    options = v3_options(
        rope=dsa_rope(DEEPSEEK_V32_SPEC, rope),
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
    options.update(indexer=indexer)
    return apply_spec(DEEPSEEK_V32_SPEC, options, model)


def revert_liger_kernel_to_deepseek_v32(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_deepseek_v32``: the classes without a model, else that instance."""
    return patching.revert(DEEPSEEK_V32_SPEC, model)
