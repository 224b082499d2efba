from importlib import metadata

from packaging.version import Version

from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.deepseek_v4.spec import DEEPSEEK_V4_SPEC


@checked_options
def apply_liger_kernel_to_deepseek_v4(
    rope: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    model=None,
    *,
    moe_router: bool = True,
    grouped_experts: bool = True,
    vocab_chunked_lce: bool = False,
    hyper_connections: bool = True,
    indexer: bool = True,
    fp8: bool = False,
) -> patching.PatchReport:
    """Swap DeepSeek-V4's modules for Liger kernels; liger-kernel's parameter order.

    Args:
        rope: ``DeepseekV4Attention`` -> ``LigerDeepseekV4Attention``, as ``rope`` swaps DeepSeek-V3's attention:
            the query heads' norm and RoPE and the output's inverse RoPE in one Triton pass each, and the attention
            itself (sinks, sliding window, compressed entries) in Triton kernels that never hold the [S, S + C]
            scores; the projections, the key-value head's norm and RoPE and the compressors stay native. Where it
            cannot run (a past in the cache, a mask it does not read, a head dim that is not a power of two) the
            layer runs the native attention.
        cross_entropy: loss from Liger's cross-entropy kernel on materialised logits.
        fused_linear_cross_entropy: in training with labels, the loss from fused linear cross entropy and no
            logits (``lce_forward``). Exclusive with ``cross_entropy``. Either loss adds the load-balancing
            auxiliary loss as transformers does (``output_router_logits``, ``router_aux_loss_coef``).
        rms_norm: every ``DeepseekV4RMSNorm`` -> ``LigerDeepseekV4RMSNorm``, in the installed transformers'
            casting (5.24: multiply by the fp32 weight, then cast). The weightless query norm stays native.
        swiglu: the clamped shared-expert MLPs -> ``LigerSwiGLUMLP`` and, with ``grouped_experts``, the clamped
            routed experts -> ``LigerGroupedExperts``: ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``
            with ``config.swiglu_limit``, forward and backward in the SiLU-mul kernels.
        moe_router: (keyword-only) the learned top-k router (sqrtsoftplus or sigmoid scores plus the correction
            bias, renormalised and scaled) in one Triton kernel per direction, and the hash router's weights
            computed from its table's experts only (``models/deepseek_v4/router.py``).
        grouped_experts: (keyword-only) as for ``apply_liger_kernel_to_deepseek_v3``; liger-kernel's fused MoE
            has no clamp, so there is no ``fused_experts`` option here.
        vocab_chunked_lce: (keyword-only) as for ``apply_liger_kernel_to_deepseek_v3``.
        hyper_connections: (keyword-only) ``DeepseekV4DecoderLayer`` -> ``LigerDeepseekV4DecoderLayer``: each
            layer's two hyper-connection mixes (coefficients with their Sinkhorn normalisation, collapse, expand and
            mix) in this package's Triton kernels, all with the token count as a run-time value; and
            ``DeepseekV4HyperHead`` -> ``LigerDeepseekV4HyperHead``, the final collapse of the streams, the same
            way. Native under ``torch.compile``.
        indexer: (keyword-only) ``DeepseekV4IndexerScorer`` -> ``LigerDeepseekV4IndexerScorer``: the CSA indexer's
            scores in one fused kernel, without the fp32 [B, S, index heads, S / rate] tensor (the indexer's
            compressor, RoPE, mask and top-k stay native).
        fp8: (keyword-only, opt-in) the clamped MLPs' and routed experts' GEMMs in FP8 (``LigerFP8SwiGLUMLP``,
            ``LigerFP8GroupedExperts``), as for ``apply_liger_kernel_to_deepseek_v3``; needs ``swiglu`` and
            ``grouped_experts``. The attention, its projections and the compressors stay in their dtype.
        model: None patches the transformers classes; a built DeepSeek-V4 model patches only that instance.

    The key-value head's norm and RoPE and the compressors stay native.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    require_clamping_mlp()
    options = v3_options(
        rope=rope,
        cross_entropy=cross_entropy,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        rms_norm=rms_norm,
        swiglu=swiglu,
        moe_router=moe_router,
        grouped_experts=grouped_experts,
        vocab_chunked_lce=vocab_chunked_lce,
        fp8=fp8,
        fp8_attention=False,  # the FP8 projections are MLA's: DeepSeek-V4's attention keeps the bf16 swap
    )
    options.update(hyper_connections=hyper_connections, indexer=indexer)
    return apply_spec(DEEPSEEK_V4_SPEC, options, model)


def revert_liger_kernel_to_deepseek_v4(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_deepseek_v4``: the classes without a model, else that instance."""
    return patching.revert(DEEPSEEK_V4_SPEC, model)


# Before this transformers version DeepseekV4MLP does not clamp (only the routed experts do), while its config carries
# swiglu_limit: a Liger MLP built from that config would clamp where the native one does not.
MIN_TRANSFORMERS = Version("5.17")


def require_clamping_mlp() -> None:
    found = Version(metadata.version("transformers"))
    if found < MIN_TRANSFORMERS:
        raise ImportError(
            f"liger-dspine: the deepseek_v4 patch needs transformers >= {MIN_TRANSFORMERS} (found {found}): before it "
            "DeepseekV4MLP leaves its SwiGLU unclamped while the config sets swiglu_limit"
        )
