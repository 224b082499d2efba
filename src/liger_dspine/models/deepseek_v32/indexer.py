"""DeepSeek-V3.2's DSA indexer (half-split RoPE) with its scores in one fused kernel (``modules/dsa_indexer.py``)."""

from transformers.models.deepseek_v32 import modeling_deepseek_v32

from liger_dspine.modules.dsa_indexer import LigerDsaIndexer


class LigerDeepseekV32Indexer(LigerDsaIndexer, modeling_deepseek_v32.DeepseekV32Indexer):
    """``DeepseekV32Indexer`` whose scores run in the fused indexer kernel; parameters as the native class."""

    modeling = modeling_deepseek_v32
