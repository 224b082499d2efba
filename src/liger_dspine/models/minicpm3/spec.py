"""What the minicpm3 patch (MiniCPM3) replaces: RMSNorm, the dense SwiGLU MLP, MLA with half-split RoPE, and the
causal LM's forward (its own, which scales the hidden states before ``lm_head``). The scaled embeddings and the scaled
residuals stay native: they are the decoder's own arithmetic around the replaced modules."""

from liger_dspine.models.deepseek_v2.spec import mla_model_spec

MODELING = "transformers.models.minicpm3.modeling_minicpm3"

MINICPM3_SPEC = mla_model_spec(
    "minicpm3",
    MODELING,
    "MiniCPM3",
    modules="liger_dspine.models.minicpm3.modules",
    moe_block=None,
    forwards="liger_dspine.models.minicpm3.forward",
)
