"""The one place the DSpine drafter gets its RMSNorm, SwiGLU MLP, attention and injection modules from.

Native modules are transformers' ``Qwen3RMSNorm`` / ``Qwen3MLP`` and this package's ``DSpineAttention`` (or
``DSpineMLAAttention`` for an MLA drafter) and ``AdjacentInjection``, looked up through this module's globals at build
time, so a class-level patch of these names redirects every model built afterwards. ``use_liger=True`` builds this
package's ``LigerRMSNorm`` (liger-kernel's kernel, casting mode "llama": the same fp32 statistics as
``Qwen3RMSNorm``), ``LigerSwiGLUMLP``, ``LigerDSpineAttention`` / ``LigerDSpineMLAAttention`` and
``LigerAdjacentInjection``; liger-kernel is imported only then. Both kinds own the same
parameter names, so state dicts do not depend on the choice.
"""

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.injection import AdjacentInjection
from liger_dspine.models.dspine.mla_attention import DSpineMLAAttention


def make_rms_norm(hidden_size: int, eps: float, use_liger: bool = False) -> nn.Module:
    """RMSNorm over the last dim of width ``hidden_size``: ``weight * (x * rsqrt(mean(x^2) + eps))``."""
    if use_liger:
        from liger_dspine.modules.rms_norm import LigerRMSNorm

        return LigerRMSNorm(hidden_size, eps=eps)
    return Qwen3RMSNorm(hidden_size, eps=eps)


def make_attention(config, use_liger: bool = False) -> nn.Module:
    """The draft block's attention over [context ; draft]: grouped-query (:class:`DSpineAttention`), or MLA
    (:class:`DSpineMLAAttention`) when ``config.uses_mla``."""
    if getattr(config, "uses_mla", False):
        if use_liger:
            from liger_dspine.models.dspine.liger_mla_attention import LigerDSpineMLAAttention

            return LigerDSpineMLAAttention(config, use_liger)
        return DSpineMLAAttention(config, use_liger)
    if use_liger:
        from liger_dspine.models.dspine.liger_attention import LigerDSpineAttention

        return LigerDSpineAttention(config, use_liger)
    return DSpineAttention(config, use_liger)


def make_mlp(config, use_liger: bool = False) -> nn.Module:
    """SwiGLU MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` of ``config.hidden_size`` / ``intermediate_size``."""
    if use_liger:
        from liger_dspine.modules.swiglu import LigerSwiGLUMLP

        return LigerSwiGLUMLP(config)
    return Qwen3MLP(config)


def make_injection(
    hidden_size: int, num_layers: int, transfer_rank: int, message_size: int, replacement_layers: int, use_liger=False
) -> nn.Module:
    """The spine's adjacent injection (see :class:`AdjacentInjection`)."""
    if use_liger:
        from liger_dspine.models.dspine.liger_injection import LigerAdjacentInjection

        return LigerAdjacentInjection(hidden_size, num_layers, transfer_rank, message_size, replacement_layers)
    return AdjacentInjection(hidden_size, num_layers, transfer_rank, message_size, replacement_layers)
