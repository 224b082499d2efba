"""What the deepseek_v4 patch (DeepSeek-V4) replaces, as data: each swap names the option that enables it.

- ``rms_norm``: the decoder's input / post-attention norms, the final norm, and the attention's and compressors'
  ``q_a_norm`` / ``kv_norm`` (``DeepseekV4RMSNorm``, in the installed transformers' casting); the weightless
  per-head query norm stays native.
- ``swiglu``: the clamped shared-expert MLPs; with it the clamped routed experts on grouped GEMMs
  (``grouped_experts``).
- ``moe_router``: the learned top-k router (sqrtsoftplus or sigmoid scores, correction bias, no groups) in the MoE
  router kernel, and the hash router's weights from its table's experts only (``models/deepseek_v4/router.py``).
- ``rope``: ``DeepseekV4Attention`` -> ``LigerDeepseekV4Attention`` (``models/deepseek_v4/attention.py``): the query
  norm and RoPE in one pass, and the sink-attention kernel over the sliding window and the compressed entries instead
  of the eager scores.
- ``hyper_connections``: ``DeepseekV4DecoderLayer`` -> ``LigerDeepseekV4DecoderLayer`` and ``DeepseekV4HyperHead``
  -> ``LigerDeepseekV4HyperHead`` (``models/deepseek_v4/hyper_connections.py``): the two hyper-connection mixes of
  each layer and the final collapse of the streams in Triton kernels.
- ``indexer``: ``DeepseekV4IndexerScorer`` -> ``LigerDeepseekV4IndexerScorer`` (``models/deepseek_v4/indexer.py``):
  the CSA indexer's scores in one fused kernel.
- the loss options: the causal LM's forward, with the load-balancing auxiliary loss.

The compressors, and the indexer's own compressor, RoPE, mask and top-k, stay native.
"""

from liger_dspine.models.deepseek_v3.family import LOSS_FORWARDS
from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import ModuleCheck
from liger_dspine.patching import PatchSpec

MODELING = "transformers.models.deepseek_v4.modeling_deepseek_v4"
FORWARDS = "liger_dspine.models.deepseek_v4.forward"
ROUTERS = "liger_dspine.models.deepseek_v4.router"

DEEPSEEK_V4_SPEC = PatchSpec(
    model_type="deepseek_v4",
    module=MODELING,
    base_classes=(f"{MODELING}:DeepseekV4PreTrainedModel",),
    swaps=(
        ClassSwap("rms_norm", ("DeepseekV4RMSNorm",), "liger_dspine.models.deepseek_v4.modules:LigerDeepseekV4RMSNorm"),
        ClassSwap("swiglu", ("DeepseekV4MLP",), "liger_dspine.modules.swiglu:LigerSwiGLUMLP"),
        ClassSwap("fp8_swiglu", ("DeepseekV4MLP",), "liger_dspine.modules.swiglu:LigerFP8SwiGLUMLP"),
        ClassSwap(
            "grouped_experts", ("DeepseekV4Experts",), "liger_dspine.modules.grouped_experts:LigerGroupedExperts"
        ),
        ClassSwap(
            "fp8_grouped_experts",
            ("DeepseekV4Experts",),
            "liger_dspine.modules.grouped_experts:LigerFP8GroupedExperts",
        ),
        ClassSwap("moe_router", ("DeepseekV4TopKRouter",), f"{ROUTERS}:LigerDeepseekV4TopKRouter"),
        ClassSwap("moe_router", ("DeepseekV4HashRouter",), f"{ROUTERS}:LigerDeepseekV4HashRouter"),
        ClassSwap(
            "rope", ("DeepseekV4Attention",), "liger_dspine.models.deepseek_v4.attention:LigerDeepseekV4Attention"
        ),
        ClassSwap(
            "hyper_connections",
            ("DeepseekV4DecoderLayer",),
            "liger_dspine.models.deepseek_v4.hyper_connections:LigerDeepseekV4DecoderLayer",
        ),
        ClassSwap(
            "hyper_connections",
            ("DeepseekV4HyperHead",),
            "liger_dspine.models.deepseek_v4.hyper_connections:LigerDeepseekV4HyperHead",
        ),
        ClassSwap(
            "indexer",
            ("DeepseekV4IndexerScorer",),
            "liger_dspine.models.deepseek_v4.indexer:LigerDeepseekV4IndexerScorer",
        ),
        *(
            MethodSwap(option, "DeepseekV4ForCausalLM", "forward", f"{FORWARDS}:{forward}")
            for option, forward in LOSS_FORWARDS
        ),
    ),
    checks=(
        ModuleCheck(
            ("DeepseekV4Experts",),
            shapes=(
                ("gate_up_proj", lambda c: (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)),
                ("down_proj", lambda c: (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)),
            ),
        ),
    ),
)
