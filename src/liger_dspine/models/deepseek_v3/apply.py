import importlib
import logging
import os
import sys

from liger_dspine import patching
from liger_dspine import pickling
from liger_dspine._versions import require_supported_versions
from liger_dspine.apply_options import checked_options
from liger_dspine.models.deepseek_v3.spec import DEEPSEEK_V3_SPEC

logger = logging.getLogger(__name__)

FUSED_MOE_AUTOTUNE = "LIGER_FUSED_MOE_AUTOTUNE"
FUSED_MOE_KERNELS = "liger_kernel.ops.fused_moe_kernels"


@checked_options
def apply_liger_kernel_to_deepseek_v3(
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
    """Swap DeepSeek-V3's modules for Liger kernels; same parameters as liger-kernel's function.

    Args:
        rope: MLA attention whose interleaved partial RoPE and query / key assembly run in Triton kernels
            (``LigerDeepseekV3Attention``: no ``torch.cat`` and no de-interleave copies). Default True here
            (liger-kernel's default is False, and its ``rope=True`` only warns). In training at long sequences
            (a layer's per-head query, key, value and output over 2 GiB) the heads run in groups, so that the
            backward's per-head gradients exist for one group at a time.
        cross_entropy: loss from Liger's cross-entropy kernel on materialised logits.
        fused_linear_cross_entropy: in training with labels, the loss from fused linear cross entropy and no
            logits (``lce_forward``). Exclusive with ``cross_entropy``.
        rms_norm: every ``DeepseekV3RMSNorm`` -> ``LigerRMSNorm``.
        swiglu: dense MLPs and shared experts -> ``LigerSwiGLUMLP``, which keeps no SiLU-mul product for backward;
            the batched routed experts -> ``LigerGroupedExperts`` (``grouped_experts``) or ``LigerFusedExperts``
            (``fused_experts``).
        moe_router: (keyword-only) DeepSeek-V3's sigmoid + grouped top-k routing in one Triton kernel, with a
            router-logit GEMM that keeps no fp32 copy of the hidden states for backward.
        fused_experts: (keyword-only) with ``swiglu``, routed experts through liger-kernel's fused MoE kernels
            (takes precedence over ``grouped_experts``). Default False: grouped GEMMs (transformers' own experts)
            took about 27 ms against 43 ms for liger-kernel's untuned fused MoE in a profiled H200 step (8 layers,
            4096 tokens), and start without an autotuning pass. True sets ``LIGER_FUSED_MOE_AUTOTUNE=0`` unless it
            is set: liger-kernel reads it once, when its fused-MoE module is first imported, so it then holds for
            the whole process (and a warning says so when that module was imported with autotuning before).
        grouped_experts: (keyword-only) with ``swiglu``, routed experts -> ``LigerGroupedExperts``: the grouped
            GEMMs of transformers' ``grouped_mm`` experts in one autograd op that keeps only the gate/up output
            for backward (transformers' keeps the gathered inputs, the activation and the down output too: about
            2 GiB more per MoE layer at 32768 tokens) and recomputes the rest. False leaves transformers' experts.
        vocab_chunked_lce: (keyword-only) with ``fused_linear_cross_entropy``, a fused linear cross entropy that
            chunks over the vocabulary instead of the tokens: it holds no lm_head gradient buffer from forward to
            backward and rounds each gradient element once, for one extra logits GEMM.
        recompute_attention: (keyword-only) with ``rope``, an opt-in memory saver: in training each attention layer
            keeps only its latents (``LigerDeepseekV3RecomputeAttention``), not the per-head query, key, value and
            output (``o_proj``'s input): 1.25 KiB per token and head, 5 GiB per layer at 32768 tokens at
            DeepSeek-V3 widths. The backward recomputes them a group of heads at a time (about 256 MiB of them
            alive at once), for one more attention forward. With eager attention, attention dropout or projections
            that are not plain bias-free ``nn.Linear`` (adapters) the whole core is checkpointed instead.
        fp8: (keyword-only) opt-in FP8 training: the MLA projections (``LigerFP8DeepseekV3Attention``, with
            ``rope``), the dense MLPs' and shared experts' projections (``LigerFP8SwiGLUMLP``) and the routed
            experts' grouped GEMMs (``LigerFP8GroupedExperts``) run on e4m3 operands with dynamic rowwise scales,
            forward and backward; weights, optimizer state, router, norms, the attention scores and values and the
            loss stay in their dtype. Needs ``swiglu`` and ``grouped_experts``, bf16 on a GPU with FP8 GEMMs (the
            grouped ones: compute capability 9.0 or 10.0); on a CPU a reference path computes the same rounding.
            See docs/fp8.md.
        model: None patches the transformers classes (models built afterwards, ``from_pretrained`` included, use
            the Liger modules); a built DeepSeek-V3 model patches only that instance.

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
    return apply_spec(DEEPSEEK_V3_SPEC, options, model)


def v3_options(
    *,
    rope: bool,
    cross_entropy: bool,
    fused_linear_cross_entropy: bool,
    rms_norm: bool,
    swiglu: bool,
    moe_router: bool = False,
    fused_experts: bool = False,
    grouped_experts: bool = False,
    vocab_chunked_lce: bool = False,
    recompute_attention: bool = False,
    fp8: bool = False,
    routed_experts: bool = True,
    fp8_attention: bool = True,
) -> dict[str, bool]:
    """The public options of DeepSeek-V3's apply function (and of the models built from its classes), checked
    against each other and resolved into one flag per swap of the spec: at most one enabled swap per target.

    ``routed_experts`` False: a dense model (no experts options, nothing for ``fp8`` to require of them).
    ``fp8_attention`` False: the spec's ``rope`` attention has no FP8 class, and keeps its bf16 swap under ``fp8``."""
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError(
            "liger-dspine: cross_entropy and fused_linear_cross_entropy cannot both be True: choose one loss path"
        )
    if recompute_attention and not rope:
        raise ValueError(
            "liger-dspine: recompute_attention=True needs rope=True: it is a mode of liger-dspine's MLA attention"
        )
    if fp8 and recompute_attention:
        raise ValueError(
            "liger-dspine: fp8=True and recompute_attention=True cannot be combined yet: the recompute runs the "
            "attention's projections by head groups in bf16"
        )
    if fp8 and not routed_experts and not swiglu:
        raise ValueError(
            "liger-dspine: fp8=True runs the MLPs' GEMMs in FP8 inside the Liger MLP (LigerFP8SwiGLUMLP): it needs "
            "swiglu=True"
        )
    if fp8 and routed_experts and not (swiglu and grouped_experts and not fused_experts):
        raise ValueError(
            "liger-dspine: fp8=True runs the MLPs and routed experts' GEMMs in FP8 inside the Liger modules: it needs "
            "swiglu=True and grouped_experts=True, and fused_experts=False (liger-kernel's fused MoE has no FP8 path)"
        )
    return dict(
        rope=rope and not recompute_attention and not (fp8 and fp8_attention),
        fp8_rope=rope and fp8 and fp8_attention,
        recompute_attention=recompute_attention,
        cross_entropy=cross_entropy,
        fused_linear_cross_entropy=fused_linear_cross_entropy and not vocab_chunked_lce,
        vocab_chunked_lce=fused_linear_cross_entropy and vocab_chunked_lce,
        rms_norm=rms_norm,
        swiglu=swiglu and not fp8,
        fp8_swiglu=swiglu and fp8,
        moe_router=moe_router,
        fused_experts=swiglu and fused_experts,
        grouped_experts=swiglu and grouped_experts and not fused_experts and not fp8,
        fp8_grouped_experts=fp8 and routed_experts,
    )


def apply_spec(spec: patching.PatchSpec, options: dict[str, bool], model=None) -> patching.PatchReport:
    """Apply resolved options: the classes of ``spec.module`` without a model, else that instance."""
    require_supported_versions()
    require_modeling_module(spec)
    if options.get("fused_experts"):
        untuned_fused_moe()
    if model is None:
        return patching.apply_class_level(spec, options)
    report = patching.apply_to_instance(spec, options, model)
    pickling.register_method_swaps(spec, options)
    return report


def revert_liger_kernel_to_deepseek_v3(model=None) -> list[str]:
    """Undo ``apply_liger_kernel_to_deepseek_v3``.

    ``model=None`` restores every module global and method a class-level call replaced (identity, not reload);
    a model turns that instance's converted modules and bound methods back into the native ones. Returns what was
    restored. Modules built under a class-level patch are not converted ones: revert the class level and rebuild.
    """
    return patching.revert(DEEPSEEK_V3_SPEC, model)


def require_modeling_module(spec: patching.PatchSpec) -> None:
    """An ImportError naming the model type when this transformers version lacks a modeling module the spec names
    (its own, or that of a swap or base class), before anything is patched."""
    names = [spec.module, *(swap.module for swap in spec.swaps if swap.module)]
    names += [path.partition(":")[0] for path in spec.base_classes]
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not name.startswith(str(error.name)):
                raise
            raise ImportError(
                f"liger-dspine: transformers {transformers_version()} has no {spec.model_type} model ({name}); "
                "upgrade transformers to patch it"
            ) from None


def transformers_version() -> str:
    from importlib import metadata

    return metadata.version("transformers")


def untuned_fused_moe() -> None:
    """Pin liger-kernel's fused-MoE kernels to one configuration each, before their module is imported.

    Its autotuner compiles dozens of configurations on the first backward (minutes at DeepSeek-V3 widths). The
    variable is read once, at that import, so it holds for the whole process; an explicit value is respected.
    """
    kernels = sys.modules.get(FUSED_MOE_KERNELS)
    if kernels is None:
        os.environ.setdefault(FUSED_MOE_AUTOTUNE, "0")
    elif not getattr(kernels, "_AUTOTUNE_DISABLED", True) and FUSED_MOE_AUTOTUNE not in os.environ:
        logger.warning(
            "liger-dspine: liger-kernel's fused MoE was imported before this patch, with autotuning on: the first "
            "backward autotunes its kernels (minutes at DeepSeek-V3 widths). Set %s=0 before importing liger_kernel "
            "to skip it",
            FUSED_MOE_AUTOTUNE,
        )
