import torch
from liger_kernel.transformers.rms_norm import LigerRMSNorm as _LigerKernelRMSNorm

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.liger_kernel_ops import LigerRMSNormFunction
from liger_dspine.transformers_compat import norm_epsilon

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LigerRMSNorm(_LigerKernelRMSNorm):
    """RMSNorm with fp32 statistics and ``weight * x_normed.to(input_dtype)`` ("llama" casting), as
    ``DeepseekV3RMSNorm`` and ``Qwen3RMSNorm`` compute it. Built as ``LigerRMSNorm(hidden_size, eps)``.

    The backward writes into a fresh gradient buffer (``in_place=False``): the incoming gradient may be shared
    with another branch of the graph, and overwriting it would corrupt that branch. liger-kernel's kernels run as
    custom ops (:mod:`liger_dspine.ops.liger_kernel_ops`), so torch.compile keeps the norm inside its graph.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, casting_mode="llama", in_place=False)

    @classmethod
    def convert(cls, module: torch.nn.Module) -> None:
        module.variance_epsilon = norm_epsilon(module)
        module.offset, module.casting_mode, module.in_place, module.row_mode = 0.0, "llama", False, None
        module.elementwise_affine = module.weight is not None
        module.__class__ = cls

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_kernel_device(hidden_states, "LigerRMSNorm")
        if hidden_states.dtype not in KERNEL_DTYPES:
            raise TypeError(
                f"liger-dspine: LigerRMSNorm (liger-kernel's kernel) runs in fp32, fp16 or bf16, got "
                f"{hidden_states.dtype}; apply the patch with rms_norm=False for this dtype"
            )
        return LigerRMSNormFunction.apply(
            hidden_states, self.weight, float(self.variance_epsilon), float(self.offset), self.casting_mode
        )
