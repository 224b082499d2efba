import torch
from liger_kernel.ops import LigerSiLUMulFunction
from torch import nn

from liger_dspine._interpreter import check_kernel_device

SUPPORTED_ACTIVATIONS = ("silu", "swish")


def check_activation(config, what: str) -> None:
    act = getattr(config, "hidden_act", None)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"liger-dspine: {what} fuses SiLU only; config.hidden_act is {act!r}")


class LigerSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with Liger's fused SiLU-and-multiply kernel.

    Built as ``LigerSwiGLUMLP(config, intermediate_size=None)``, like ``DeepseekV3MLP`` (dense layers and
    shared experts) and ``Qwen3MLP``. x: [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        check_activation(config, "LigerSwiGLUMLP")
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    @classmethod
    def convert(cls, module: nn.Module) -> None:
        check_activation(module.config, "LigerSwiGLUMLP")
        module.__class__ = cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_kernel_device(x, "LigerSwiGLUMLP")
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))
