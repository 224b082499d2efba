import torch
from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
from torch import nn

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.modules.config_reading import check_experts_implementation
from liger_dspine.modules.config_reading import check_plain_swiglu
from liger_dspine.modules.config_reading import expert_sizes
from liger_dspine.modules.config_reading import unfused_activation_reason
from liger_dspine.modules.native_fallback import native_instead
from liger_dspine.ops.first_order import first_order_boundary


class LigerFusedExperts(nn.Module):
    """Routed SwiGLU experts through liger-kernel's fused MoE Triton kernels.

    Weights as transformers' batched experts: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I].
    forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H].

    Experts with another activation stay native, as for ``LigerGroupedExperts``.
    """

    def __new__(cls, *args, **kwargs):
        return native_instead(cls, args, kwargs) or super().__new__(cls)

    def __init__(self, config):
        super().__init__()
        check_plain_swiglu("LigerFusedExperts", config)
        self.num_experts, self.hidden_dim, self.intermediate_dim = expert_sizes(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))

    @staticmethod
    def kept_native_reason(module: nn.Module) -> str | None:
        return unfused_activation_reason(getattr(module, "config", None), module)

    @classmethod
    def check_convertible(cls, module: nn.Module) -> None:
        if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
            raise ValueError("liger-dspine: LigerFusedExperts has no expert biases; this experts module has them")
        check_plain_swiglu("LigerFusedExperts", getattr(module, "config", None), module)

    @classmethod
    def convert(cls, module: nn.Module) -> None:
        cls.check_convertible(module)
        module.num_experts, module.hidden_dim, module.intermediate_dim = (
            module.gate_up_proj.shape[0],
            module.gate_up_proj.shape[2],
            module.down_proj.shape[2],
        )
        module.__class__ = cls

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        check_kernel_device(hidden_states, "LigerFusedExperts")
        check_experts_implementation(self, "LigerFusedExperts")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_dim)
        index = top_k_index.reshape(-1, top_k_index.shape[-1]).to(torch.int32)
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        out = LigerFusedMoEFunction.apply(x, self.gate_up_proj, self.down_proj, index, weights)
        out = first_order_boundary(out, "liger-kernel's LigerFusedMoEFunction")
        return out.view(shape)
