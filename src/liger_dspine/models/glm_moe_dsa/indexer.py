"""GLM-5's DSA indexer (interleaved RoPE) with its scores in one fused kernel (``modules/dsa_indexer.py``)."""

from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

from liger_dspine.modules.dsa_indexer import LigerDsaIndexer


class LigerGlmMoeDsaIndexer(LigerDsaIndexer, modeling_glm_moe_dsa.GlmMoeDsaIndexer):
    """``GlmMoeDsaIndexer`` whose scores run in the fused indexer kernel; parameters as the native class."""

    modeling = modeling_glm_moe_dsa
    rope_function = "apply_rotary_pos_emb_interleave"
