import torch
from liger_kernel.ops import LigerSiLUMulFunction
from torch import nn

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.modules.config_reading import runs_plain_linear
from liger_dspine.modules.config_reading import swiglu_limit
from liger_dspine.modules.config_reading import unfused_activation_reason
from liger_dspine.modules.fp8_projection import call_as_fp8_projection
from liger_dspine.modules.fp8_projection import check_fp8_linears
from liger_dspine.modules.fp8_projection import fp8_projection
from liger_dspine.modules.native_fallback import native_instead
from liger_dspine.modules.parallel_state import call_through_hooks
from liger_dspine.modules.parallel_state import gathered_by_hooks
from liger_dspine.modules.parallel_state import rowwise_shard
from liger_dspine.modules.parallel_state import sum_partial_over
from liger_dspine.ops.clamped_silu_mul import liger_clamped_silu_mul
from liger_dspine.ops.first_order import first_order_boundary
from liger_dspine.ops.swiglu_down import liger_swiglu_down


class LigerSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with Liger's fused SiLU-and-multiply kernel.

    Built as ``LigerSwiGLUMLP(config, intermediate_size=None)``, like ``DeepseekV3MLP`` (dense layers and
    shared experts) and ``Qwen3MLP``. x: [..., hidden_size] -> [..., hidden_size].

    The SiLU-mul and ``down_proj`` run as one autograd op that keeps only the gate and up projections for the
    backward, not their product (one ``[..., intermediate_size]`` activation less per MLP). A ``down_proj`` with
    a forward of its own (LoRA, quantised, hooked) runs as it is, and the product is kept as before.

    DeepSeek-V4's clamped MLP (``DeepseekV4MLP``, ``config.swiglu_limit``) is taken too: ``limit`` (the module's own,
    else the config's) clamps gate and up in the SiLU-mul kernel, ``silu(gate.clamp(max=limit)) *
    up.clamp(-limit, limit)``, and ``down_proj`` runs on the product. Any other clamp is refused.

    An MLP with another activation (``config.hidden_act`` or its ``act_fn``) stays native: an instance patch leaves
    it, and under a class-level patch the modeling module's code builds the native MLP
    (``modules/native_fallback.py``), with a warning.

    ``fp8`` (class attribute, True in :class:`LigerFP8SwiGLUMLP`) runs the three projections' GEMMs on e4m3 operands
    with dynamic rowwise scales (``ops/fp8_linear.py``), forward and backward; the weights stay in their dtype.
    """

    fp8 = False

    def __new__(cls, *args, **kwargs):
        return native_instead(cls, args, kwargs) or super().__new__(cls)

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        self.limit = swiglu_limit("LigerSwiGLUMLP", config)
        if getattr(config, "mlp_bias", False):
            raise ValueError(
                "liger-dspine: LigerSwiGLUMLP has no projection biases; config has mlp_bias=True (DeepSeek-V2's and "
                "MiniCPM3's MLPs would keep them): pass swiglu=False"
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    @staticmethod
    def kept_native_reason(module: nn.Module) -> str | None:
        return unfused_activation_reason(getattr(module, "config", None), module)

    @classmethod
    def check_convertible(cls, module: nn.Module) -> None:
        swiglu_limit("LigerSwiGLUMLP", getattr(module, "config", None), module, "forward")
        biased = [name for name in ("gate_proj", "up_proj", "down_proj") if getattr(module, name).bias is not None]
        if biased:
            raise ValueError(
                f"liger-dspine: LigerSwiGLUMLP has no projection biases; this MLP's {', '.join(biased)} have them: "
                "pass swiglu=False"
            )

    @classmethod
    def convert(cls, module: nn.Module) -> None:
        cls.check_convertible(module)
        module.__class__ = cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_kernel_device(x, "LigerSwiGLUMLP")
        if self.fp8:
            return self._fp8_forward(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        limit = getattr(self, "limit", None)  # a converted unclamped MLP has none
        if limit is not None:
            return self.down_proj(liger_clamped_silu_mul(gate, up, limit))
        in_place = not (self.gate_proj._forward_hooks or self.up_proj._forward_hooks)
        shard = rowwise_shard(self.down_proj)
        if shard is not None:  # tensor parallelism: this rank's columns of down_proj, its partial sum all-reduced
            local_weight, mesh = shard
            return sum_partial_over(liger_swiglu_down(gate, up, local_weight, in_place=in_place), mesh)
        if gathered_by_hooks(self.down_proj):  # FSDP2 / ZeRO-3 gather down_proj's weight around its own call
            return call_through_hooks(self.down_proj, self._fused_down(in_place), gate, up)
        if not runs_plain_linear(self.down_proj) or "forward" in vars(self.down_proj):
            act = first_order_boundary(LigerSiLUMulFunction.apply(gate, up), "liger-kernel's LigerSiLUMulFunction")
            return self.down_proj(act)
        if self.down_proj.bias is not None:
            raise ValueError("liger-dspine: LigerSwiGLUMLP fuses a down_proj without bias; this one has a bias")
        # gate and up are this forward's own intermediates: the backward may write their gradients over them,
        # unless a forward hook of gate_proj / up_proj may have kept them (in_place above)
        return self._fused_down(in_place)(gate, up)

    def _fused_down(self, in_place: bool, fp8: bool = False):
        return lambda gate, up: liger_swiglu_down(gate, up, self.down_proj.weight, in_place=in_place, fp8=fp8)

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fp8_projection(self.gate_proj, x, "gate_proj"), fp8_projection(self.up_proj, x, "up_proj")
        limit = getattr(self, "limit", None)
        if limit is not None:
            return fp8_projection(self.down_proj, liger_clamped_silu_mul(gate, up, limit), "down_proj")
        # gate and up are this forward's own: the backward may write their gradients over them
        fused_down = self._fused_down(in_place=True, fp8=True)
        return call_as_fp8_projection(self.down_proj, "down_proj", fused_down, gate, up)


class LigerFP8SwiGLUMLP(LigerSwiGLUMLP):
    """:class:`LigerSwiGLUMLP` with its projections' GEMMs in FP8 (``fp8=True`` of the apply functions)."""

    fp8 = True

    @classmethod
    def check_convertible(cls, module: nn.Module) -> None:
        super().check_convertible(module)
        check_fp8_linears("MLP", module, ("gate_proj", "up_proj", "down_proj"))
