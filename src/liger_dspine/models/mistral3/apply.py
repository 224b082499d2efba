from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.apply import v3_options
from liger_dspine.models.mistral3.spec import MISTRAL3_SPEC


@checked_options
def apply_liger_kernel_to_mistral3(
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
    """Swap the text model of Mistral-Small-4 checkpoints (``mistral3`` with a ``mistral4`` text model) for Liger
    kernels; liger-kernel's usual parameter order.

    The options mean what they mean for ``apply_liger_kernel_to_mistral4``, on Mistral4's classes; ``rms_norm`` also
    swaps the projector's ``Mistral3RMSNorm``. The loss options replace ``Mistral3ForConditionalGeneration.forward``
    (``models/mistral3/forward.py``): the Liger loss for text-only batches, transformers' forward for batches with
    images. The Pixtral vision tower stays native. An instance whose text model is not ``mistral4`` (Mistral-Small-3)
    is refused.

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
    if model is not None:
        _require_mistral4_text(model)
    return apply_spec(MISTRAL3_SPEC, options, model)


def _require_mistral4_text(model) -> None:
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    text_type = getattr(text_config, "model_type", None)
    if text_config is not None and text_type != "mistral4":
        raise ValueError(
            f"liger-dspine: the mistral3 patch covers Mistral-Small-4 (a mistral4 text model); this model's text "
            f"model is {text_type!r}, which it does not patch; nothing was patched"
        )


def revert_liger_kernel_to_mistral3(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_mistral3``: the classes (Mistral4's included) without a model, else that
    instance."""
    return patching.revert(MISTRAL3_SPEC, model)
