"""DeepSeek-V4's RMSNorm on liger-kernel's RMSNorm kernels, in the casting of the installed transformers.

transformers 5.24 multiplies the normalised fp32 values by the (fp32) weight and casts once at the end: liger-kernel's
"gemma" casting with offset 0, ``(x_normed * weight.float()).to(input dtype)``. Earlier versions (5.8.1, 5.17) cast
first, ``weight * x_normed.to(input dtype)``: the "llama" casting of ``LigerRMSNorm``. Which one the native class
computes is read from it once, at import: with an fp32 weight and a bf16 input, casting last returns bf16.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from liger_dspine.modules.rms_norm import LigerRMSNorm


def _native_casts_last(native: type) -> bool:
    if issubclass(native, LigerRMSNorm):
        raise RuntimeError("liger-dspine: DeepseekV4RMSNorm is already patched; revert before importing this module")
    with torch.no_grad():
        return native(2).float()(torch.ones(1, 2, dtype=torch.bfloat16)).dtype == torch.bfloat16


CASTING_MODE = "gemma" if _native_casts_last(DeepseekV4RMSNorm) else "llama"


class LigerDeepseekV4RMSNorm(LigerRMSNorm):
    """``DeepseekV4RMSNorm`` with liger-kernel's kernels in the installed transformers' casting (``CASTING_MODE``).
    Built as ``LigerDeepseekV4RMSNorm(hidden_size, eps)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)
        self.casting_mode = CASTING_MODE

    @classmethod
    def convert(cls, module: torch.nn.Module) -> None:
        super().convert(module)
        module.casting_mode = CASTING_MODE
