from liger_dspine import patching
from liger_dspine import pickling
from liger_dspine._versions import require_supported_versions
from liger_dspine.apply_options import checked_options
from liger_dspine.models.dspine.spec import DSPINE_SPEC


@checked_options
def apply_liger_kernel_to_dspine(
    rms_norm: bool = True,
    swiglu: bool = True,
    fused_objective: bool = True,
    model=None,
    *,
    injection: bool = True,
    attention: bool = True,
) -> patching.PatchReport:
    """Swap a DSpine drafter's modules (and its objective's frozen-head terms) for Liger kernels.

    Args:
        rms_norm: every RMSNorm (layer norms, q/k norms or MLA's q_a / kv_a norms, ``hidden_norm``, final
            ``norm``) -> ``LigerRMSNorm``.
        swiglu: the decoder layers' SwiGLU MLPs -> ``LigerSwiGLUMLP``.
        fused_objective: objectives built without an explicit ``fused_objective`` compute the backbone CE, the L1
            to the teacher and the top-k candidates through the frozen head with the fused kernel, chunk by chunk
            (no [rows, vocab] logits kept, the input gradient formed in the forward, no head gradient).
        injection: (keyword-only) the spine's ``AdjacentInjection`` -> ``LigerAdjacentInjection``, whose writes and
            features keep about three [tokens, hidden] buffers per layer fewer for the backward.
        attention: (keyword-only) ``DSpineAttention`` -> ``LigerDSpineAttention``: with sdpa or eager, a masked
            attention kernel that visits only the [query, key] tiles a draft block can see, keeping the key-value
            heads, not their repeats to every query head, for the backward (where it cannot run, the native
            attention keeping the grouped heads: two [B, heads, context + draft, head_dim] tensors per layer
            fewer); and an MLA drafter's
            ``DSpineMLAAttention`` -> ``LigerDSpineMLAAttention``, its query and key assembly (RoPE included) in
            Triton kernels.
        model: None patches at class level (every drafter built afterwards, every objective); a ``DSpineDraftModel``
            or a ``DSpineObjective`` patches that instance only (an objective includes its drafter).

    Returns:
        A ``PatchReport`` listing what was replaced, old -> new.
    """
    require_supported_versions()
    options = dict(
        rms_norm=rms_norm, swiglu=swiglu, fused_objective=fused_objective, injection=injection, attention=attention
    )
    if model is None:
        return patching.apply_class_level(DSPINE_SPEC, options)
    report = patching.apply_to_instance(DSPINE_SPEC, options, model)
    pickling.register_method_swaps(DSPINE_SPEC, options)
    return report


def revert_liger_kernel_to_dspine(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_dspine``.

    ``model=None`` restores every module global and method a class-level call replaced (identity, not reload);
    a model turns that instance's converted modules and bound methods back into the native ones. Returns what was
    restored. Modules built under a class-level patch are not converted ones: revert the class level and rebuild.
    """
    return patching.revert(DSPINE_SPEC, model)
