from liger_dspine import patching
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.apply import apply_spec
from liger_dspine.models.deepseek_v3.family import refuse_rope
from liger_dspine.models.ergo.spec import ERGO_SPEC


@checked_options
def apply_liger_kernel_to_ergo(
    rope: bool = False,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = False,
    rms_norm: bool = True,
    swiglu: bool = False,
    model=None,
    *,
    moe_router: bool = True,
) -> patching.PatchReport:
    """Swap the modules of Ergo (``ergo``) for Liger kernels; liger-kernel's parameter order.

    ``rms_norm``: every ``ErgoRMSNorm`` -> ``LigerErgoRMSNorm``; ``moe_router`` (keyword-only): ``ErgoTopkRouter`` ->
    ``LigerErgoTopkRouter``; ``cross_entropy``: the loss from Liger's cross-entropy kernel on the head's fp32 logits
    (``ErgoForCausalLM.forward`` -> ``ce_forward``). See ``models/ergo/spec.py`` for what stays native.

    ``rope``, ``fused_linear_cross_entropy`` and ``swiglu``, kept for liger-kernel's parameter order, must be False:
    the attention stays native, the head's fp32 logits are not what the fused linear cross entropy computes, and the
    MLPs and experts are ReLU² without a gate.

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    if rope:
        refuse_rope("ergo", "GQA attention", "its q / k norms, sliding window and position-free global layers")
    if fused_linear_cross_entropy:
        raise ValueError(
            "liger-dspine: the ergo patch cannot take fused_linear_cross_entropy=True: Ergo's head "
            "(ErgoLinearWithFP32Output) returns fp32 logits of operands rounded to its weight's dtype, where the fused "
            "linear cross entropy rounds the logits to that dtype; pass False (cross_entropy=True takes Liger's cross "
            "entropy on the head's own logits)"
        )
    if swiglu:
        raise ValueError(
            "liger-dspine: the ergo patch cannot take swiglu=True: Ergo's MLPs, shared expert and routed experts are "
            "ReLU² without a gate (the routed experts with a norm each), which no Liger module computes; pass False"
        )
    options = dict(rms_norm=rms_norm, moe_router=moe_router, cross_entropy=cross_entropy)
    return apply_spec(ERGO_SPEC, options, model)


def revert_liger_kernel_to_ergo(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_ergo``: the classes without a model, else that instance."""
    return patching.revert(ERGO_SPEC, model)
