"""The one place the DSpine drafter gets its RMSNorm and SwiGLU MLP modules from.

Native modules are transformers' ``Qwen3RMSNorm`` / ``Qwen3MLP``, looked up through this module's globals
``Qwen3RMSNorm`` and ``Qwen3MLP`` at build time, so a class-level patch of these two names redirects every model
built afterwards. ``use_liger=True`` builds this package's ``LigerRMSNorm`` (liger-kernel's kernel, casting mode
"llama": the same fp32 statistics as ``Qwen3RMSNorm``) and ``LigerSwiGLUMLP``; liger-kernel is imported only then.
Both kinds own the same parameter names (``weight``; ``gate_proj``/``up_proj``/``down_proj``), so state dicts do not
depend on the choice.
"""

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm


def make_rms_norm(hidden_size: int, eps: float, use_liger: bool = False) -> nn.Module:
    """RMSNorm over the last dim of width ``hidden_size``: ``weight * (x * rsqrt(mean(x^2) + eps))``."""
    if use_liger:
        from liger_dspine.modules.rms_norm import LigerRMSNorm

        return LigerRMSNorm(hidden_size, eps=eps)
    return Qwen3RMSNorm(hidden_size, eps=eps)


def make_mlp(config, use_liger: bool = False) -> nn.Module:
    """SwiGLU MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` of ``config.hidden_size`` / ``intermediate_size``."""
    if use_liger:
        from liger_dspine.modules.swiglu import LigerSwiGLUMLP

        return LigerSwiGLUMLP(config)
    return Qwen3MLP(config)
