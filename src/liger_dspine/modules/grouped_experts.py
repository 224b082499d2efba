import types

import torch
from torch import nn

from liger_dspine.modules.config_reading import check_experts_implementation
from liger_dspine.modules.config_reading import check_silu
from liger_dspine.modules.config_reading import expert_sizes
from liger_dspine.modules.config_reading import swiglu_limit
from liger_dspine.modules.config_reading import unfused_activation_reason
from liger_dspine.modules.native_fallback import native_instead
from liger_dspine.modules.parallel_state import expert_parallel_dispatch
from liger_dspine.modules.parallel_state import full_shape
from liger_dspine.modules.parallel_state import is_dtensor
from liger_dspine.modules.parallel_state import local_tensor
from liger_dspine.modules.parallel_state import rebind_expert_forward
from liger_dspine.ops.fp8_linear import check_multiple_of_16
from liger_dspine.ops.grouped_experts import liger_grouped_experts


def _activation_of(module: nn.Module) -> str | None:
    """The experts' activation name: ``config.hidden_act``, else read from the ``act_fn`` module."""
    config = getattr(module, "config", None)
    if getattr(config, "hidden_act", None) is not None:
        return config.hidden_act
    act_fn = getattr(module, "act_fn", None)
    if isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation":
        return "silu"
    return type(act_fn).__name__


# attribute -> value transformers' experts decorator must have set for the layout this op computes
_NATIVE_LAYOUT = {
    "has_gate": True,  # a gate/up projection (not up only)
    "is_concatenated": True,  # gate rows, then up rows (not interleaved)
    "is_transposed": False,  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    "has_post_expert_norm": False,
}


def _local_routes(index: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor):
    """Routes of this rank's experts under expert parallelism: transformers' dispatch hands local expert ids, and,
    where every rank sees the whole batch (its all-reduce implementation), the id ``num_local_experts`` with weight 0
    for a route to another rank's expert. Such a route is sent to expert 0 with weight 0 (it adds nothing and its
    gradients are zero), as transformers' batched experts do; the GEMM rows it costs are the price of a fixed
    shape."""
    if not isinstance(gate_up_proj, torch.Tensor) or is_dtensor(gate_up_proj):
        raise ValueError(
            "liger-dspine: LigerGroupedExperts under expert parallelism runs inside transformers' dispatch, on this "
            "rank's experts; its weights are still sharded DTensors here"
        )
    off_rank = index >= gate_up_proj.shape[0]
    return index.masked_fill(off_rank, 0), weights.masked_fill(off_rank, 0.0)


class LigerGroupedExperts(nn.Module):
    """Routed SwiGLU experts on grouped GEMMs that keep only the gate/up output [T*K, 2I] for backward
    (``liger_dspine.ops.grouped_experts``): torch's grouped GEMM on CUDA, a per-expert loop on CPU.

    Weights as transformers' batched experts: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I].
    forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H].

    DeepSeek-V4's clamped experts (``DeepseekV4Experts._apply_gate``, ``config.swiglu_limit``) are taken too:
    ``limit`` (the module's own, else the config's) clamps gate and up inside the SiLU-mul kernels. Any other clamp,
    or a subclass with a gate function of its own, is refused.

    Experts with another activation (``config.hidden_act`` or their ``act_fn``) stay native: an instance patch leaves
    them, and under a class-level patch the modeling module's code builds the native experts
    (``modules/native_fallback.py``), with a warning.

    ``fp8`` (constructor option, or class attribute: True in :class:`LigerFP8GroupedExperts`) runs every grouped GEMM
    on e4m3 operands with dynamic rowwise scales, the weights staying in their own dtype and quantised at each call
    (``ops/fp8_expert_groups.py``).
    """

    fp8 = False

    def __new__(cls, *args, **kwargs):
        return native_instead(cls, args, kwargs) or super().__new__(cls)

    def __init__(self, config, fp8: bool = False):
        super().__init__()
        if fp8:
            self.fp8 = True
        self.limit = swiglu_limit("LigerGroupedExperts", config)
        self.config = config
        self.num_experts, self.hidden_dim, self.intermediate_dim = expert_sizes(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))

    @staticmethod
    def kept_native_reason(module: nn.Module) -> str | None:
        if expert_parallel_dispatch(module) == "opaque":
            return "its expert-parallel dispatch keeps the native forward where this package cannot reach it"
        return unfused_activation_reason(getattr(module, "config", None), module)

    @classmethod
    def check_convertible(cls, module: nn.Module) -> None:
        """A ValueError when the module has biases, another or a clamped activation, or another weight layout."""
        if getattr(module, "has_bias", False) or any(
            getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")
        ):
            raise ValueError("liger-dspine: LigerGroupedExperts has no expert biases; this experts module has them")
        check_silu(_activation_of(module), "LigerGroupedExperts")
        swiglu_limit("LigerGroupedExperts", getattr(module, "config", None), module, "_apply_gate")
        for name, expected in _NATIVE_LAYOUT.items():
            value = getattr(module, name, expected)
            if value != expected:
                raise ValueError(f"liger-dspine: LigerGroupedExperts needs {name}={expected}; this module has {value}")
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise ValueError("liger-dspine: LigerGroupedExperts needs gate_up_proj and down_proj weight tensors")
        # expert parallelism: this rank's experts; DeepSpeed ZeRO-3: the whole shapes of the partitions
        gate_up_shape, down_shape = full_shape(local_tensor(gate_up)), full_shape(local_tensor(down))
        num_experts, two_intermediate, hidden = gate_up_shape
        if two_intermediate % 2 or down_shape != (num_experts, hidden, two_intermediate // 2):
            raise ValueError(
                f"liger-dspine: LigerGroupedExperts needs gate_up_proj [E, 2I, H] and down_proj [E, H, I]; got "
                f"{gate_up_shape} and {down_shape}"
            )

    @classmethod
    def convert(cls, module: nn.Module) -> None:
        """Turn a transformers experts module (``DeepseekV3Experts``) into this class in place, keeping its weights;
        a ValueError, and the module unchanged, when ``check_convertible`` refuses it."""
        cls.check_convertible(module)
        num_experts, two_intermediate, hidden = full_shape(local_tensor(module.gate_up_proj))
        module.num_experts, module.hidden_dim, module.intermediate_dim = num_experts, hidden, two_intermediate // 2
        module.__class__ = cls
        if expert_parallel_dispatch(module) == "rebindable":  # the dispatch captured the native forward: ours now
            rebind_expert_forward(module, types.MethodType(cls.forward, module))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        check_experts_implementation(self, type(self).__name__)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_dim)
        index = top_k_index.reshape(-1, top_k_index.shape[-1])
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        if getattr(self, "_is_expert_parallel", False):
            index, weights = _local_routes(index, weights, self.gate_up_proj)
        limit = getattr(self, "limit", None)  # a converted unclamped experts module has none
        out = liger_grouped_experts(x, index, weights, self.gate_up_proj, self.down_proj, limit, self.fp8)
        return out.view(shape)


class LigerFP8GroupedExperts(LigerGroupedExperts):
    """:class:`LigerGroupedExperts` with every grouped GEMM in FP8 (``fp8=True`` of the apply functions)."""

    fp8 = True

    @classmethod
    def check_convertible(cls, module: nn.Module) -> None:
        """Also a ValueError when the hidden or the expert width is not a multiple of 16 (the FP8 grouped GEMMs)."""
        super().check_convertible(module)
        _, two_intermediate, hidden = full_shape(local_tensor(module.gate_up_proj))
        dims = {"hidden": hidden, "expert width": two_intermediate // 2}
        check_multiple_of_16("fp8=True on these experts", "pass fp8=False", **dims)
