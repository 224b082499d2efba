"""What the ergo patch replaces, as data.

Ergo builds on DeepSeek-V3's MoE block, with modules of its own:
- ``rms_norm``: every ``ErgoRMSNorm`` (the four norms of a layer, the q / k norms, the shared expert's norm, the
  final norm) -> ``LigerErgoRMSNorm`` (fp32 weight applied before the rounding: "gemma" casting).
- ``moe_router``: ``ErgoTopkRouter`` -> ``LigerErgoTopkRouter`` (native fp32-output projection, the selection in the
  router kernel as one group, the weights rounded as natively).
- ``cross_entropy``: ``ErgoForCausalLM.forward`` -> ``ce_forward`` (Liger's cross entropy on the head's fp32 logits).

Native, since no Liger module computes them: the ReLU² MLP, shared expert and routed experts (no gate; each routed
expert ends in its own RMSNorm, ``ErgoExpertNorm``), the GQA attention with a sliding window and q / k norms, the
residual gates, and the head (``ErgoLinearWithFP32Output``: fp32 logits from operands rounded to the weight's dtype,
where the fused linear cross entropy would round the logits to that dtype).
"""

from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import ModuleCheck
from liger_dspine.patching import PatchSpec

MODELING = "transformers.models.ergo.modeling_ergo"
MODULES = "liger_dspine.models.ergo.modules"

ERGO_SPEC = PatchSpec(
    model_type="ergo",
    module=MODELING,
    base_classes=(f"{MODELING}:ErgoPreTrainedModel",),
    swaps=(
        ClassSwap("rms_norm", ("ErgoRMSNorm",), f"{MODULES}:LigerErgoRMSNorm"),
        ClassSwap("moe_router", ("ErgoTopkRouter",), f"{MODULES}:LigerErgoTopkRouter"),
        MethodSwap("cross_entropy", "ErgoForCausalLM", "forward", "liger_dspine.modules.causal_lm_forward:ce_forward"),
    ),
    checks=(ModuleCheck(("ErgoTopkRouter",), shapes=(("e_score_correction_bias", lambda c: (c.num_experts,)),)),),
)
