"""DeepSeek-V4's clamped SiLU-and-multiply of two [..., I] projections, as one autograd op:

    act = silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

Gate and up are joined into [N, 2I] rows (one copy) for the row kernels of :mod:`liger_dspine.ops.silu_mul_rows`
(the torch path of :mod:`liger_dspine.ops.grouped_experts` where they do not run), which clamp, and in the
backward pass the gradient only where a value was not clamped. The math runs in fp32, rounded once to the dtype.
Saved for backward: the joined rows, as the native MLP saves gate and up.
"""

import torch

from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.grouped_experts import silu_mul
from liger_dspine.ops.grouped_experts import silu_mul_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_supported


class LigerClampedSiLUMulFunction(torch.autograd.Function):
    """``(gate [..., I], up [..., I], limit)`` -> ``act [..., I]`` in gate's dtype."""

    kernel_ops = ("liger_dspine::silu_mul_rows", "liger_dspine::silu_mul_rows_backward")

    @staticmethod
    def forward(ctx, gate, up, limit):
        width = gate.shape[-1]
        gate_up = torch.cat([gate.reshape(-1, width), up.reshape(-1, width)], dim=1)
        act = silu_mul_rows(gate_up, limit) if silu_mul_rows_supported(gate_up) else silu_mul(gate_up, limit)
        ctx.save_for_backward(gate_up)
        ctx.limit = limit
        return act.view(gate.shape)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_act):
        (gate_up,) = ctx.saved_tensors
        width = gate_up.shape[1] // 2
        g = grad_act.reshape(-1, width)
        ones = torch.ones(gate_up.shape[0], dtype=torch.float32, device=gate_up.device)
        if silu_mul_rows_supported(gate_up):
            d_gate_up, _, _ = silu_mul_rows_backward(
                gate_up, g, ones, row_dot=False, scaled_act=False, in_place=False, limit=ctx.limit
            )
        else:
            d_gate_up = silu_mul_backward(gate_up, g, ones[:, None], ctx.limit)
        return d_gate_up[:, :width].view(grad_act.shape), d_gate_up[:, width:].view(grad_act.shape), None


def liger_clamped_silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)`` for gate and up of one shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"liger-dspine: clamped SiLU-mul needs gate and up of one shape and dtype, got {gate.dtype} "
            f"{tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}"
        )
    return LigerClampedSiLUMulFunction.apply(gate, up, float(limit))
