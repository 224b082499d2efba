"""liger-kernel's kernels this package calls, as torch custom ops (``liger_dspine::``) with fake implementations.

liger-kernel 0.8.5 registers none of its kernels with ``torch.library``: under ``torch.compile``, dynamo traces its
autograd Functions down to the Triton launches (into Triton's interpreter on a CPU, where it fails) and fakeifies
their outputs, which are views of 2-D buffers. Here each launch is one opaque op whose outputs are new tensors:

- RMSNorm: :class:`LigerRMSNormFunction` over ``rms_norm_forward`` / ``rms_norm_backward`` (a new gradient buffer,
  never the incoming one), the same kernels and numbers as liger-kernel's ``LigerRMSNormFunction``;
- SiLU-and-multiply: :func:`silu_mul` and :func:`silu_mul_backward_` (the backward writes the gradients of gate
  and up over its two inputs, as liger-kernel's ``swiglu_backward`` does);
- fused linear cross entropy: :class:`LigerFusedLinearCrossEntropyOpFunction`, liger-kernel's forward (which reads
  a count on the host: inside an opaque op that is no graph break) with the gradients formed in the forward and
  scaled by the incoming gradient in a new tensor, so a retained graph gives the same gradient on every backward.
  The causal-LM forwards use it under ``torch.compile``. Eager runs use
  :class:`LigerFusedLinearCrossEntropyFunction`: the same forward, and a backward that scales the kept gradients in
  place (no second [V, H] buffer) on the device. liger-kernel's own backward first compares the incoming gradient
  with 1 on the host, a synchronisation that leaves the GPU idle at the start of every backward until the host has
  queued the next kernels.
"""

import torch
import triton
from liger_kernel.ops.fused_linear_cross_entropy import MAX_FUSED_SIZE
from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward
from liger_kernel.ops.rms_norm import _str_to_casting_mode
from liger_kernel.ops.rms_norm import rms_norm_backward
from liger_kernel.ops.rms_norm import rms_norm_forward
from liger_kernel.ops.swiglu import swiglu_backward
from liger_kernel.ops.swiglu import swiglu_forward
from liger_kernel.ops.utils import amp_custom_bwd
from liger_kernel.ops.utils import amp_custom_fwd
from liger_kernel.ops.utils import calculate_settings
from liger_kernel.ops.utils import element_mul_kernel

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.second_pass import ScaledOnce

_FP32_STATS_MODES = ("llama", "gemma")


# ---------------------------------------------------------------------------------------------------------- RMSNorm
@liger_custom_op("liger_dspine::rms_norm", mutates_args=())
def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] contiguous -> (y [..., H], rstd [T])."""
    y, _, rstd, *_ = rms_norm_forward(x, weight, eps, offset, casting_mode, None)
    return y.detach(), rstd  # detach: y is a view of liger-kernel's [T, H] buffer


@_rms_norm.register_fake
def _(x, weight, eps, offset, casting_mode):
    rstd_dtype = torch.float32 if casting_mode in _FP32_STATS_MODES else x.dtype
    return torch.empty_like(x), torch.empty(x.shape[:-1].numel(), dtype=rstd_dtype, device=x.device)


@liger_custom_op("liger_dspine::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [..., H] in a new buffer, grad_weight [H], or an empty [0] tensor when not needed)."""
    block_size, num_warps = calculate_settings(x.shape[-1])
    mode = _str_to_casting_mode[casting_mode]
    mode = getattr(mode, "value", mode)
    grad_x, grad_weight = rms_norm_backward(
        grad_y,
        x.view(-1, x.shape[-1]),
        weight,
        rstd,
        offset,
        mode,
        block_size,
        num_warps,
        False,
        None,
        needs_dw=need_weight,
    )
    return grad_x.detach(), grad_weight if grad_weight is not None else x.new_empty(0)


@_rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd, offset, casting_mode, need_weight):
    grad_weight = torch.empty_like(weight) if need_weight and weight is not None else x.new_empty(0)
    return torch.empty_like(grad_y), grad_weight


class LigerRMSNormFunction(torch.autograd.Function):
    """``(x [..., H], weight [H] | None, eps, offset, casting_mode)`` -> y [..., H] in x's dtype (liger-kernel's
    RMSNorm kernels; the backward writes a new gradient buffer)."""

    kernel_ops = ("liger_dspine::rms_norm", "liger_dspine::rms_norm_backward")

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode):
        x = x.contiguous()
        y, rstd = _rms_norm(x, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting_mode = offset, casting_mode
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        need_weight = weight is not None and ctx.needs_input_grad[1]
        grad_x, grad_weight = _rms_norm_backward(
            grad_y.contiguous(), x, weight, rstd, ctx.offset, ctx.casting_mode, need_weight
        )
        return grad_x, grad_weight if need_weight else None, None, None, None


def liger_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, casting_mode: str = "llama"
) -> torch.Tensor:
    """liger-kernel's RMSNorm of ``x [..., H]`` with ``weight [H]`` (or None): ``x / rms(x) * (weight + offset)``,
    cast as ``casting_mode`` says ("llama", "gemma" or "none")."""
    if casting_mode not in _str_to_casting_mode:
        raise ValueError(f"liger-dspine: RMSNorm casting_mode must be one of {list(_str_to_casting_mode)}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"liger-dspine: RMSNorm weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    check_kernel_device(x, "RMSNorm")
    return LigerRMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode)


# ------------------------------------------------------------------------------------------------ SiLU-and-multiply
@liger_custom_op("liger_dspine::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[N, I] contiguous gate and up -> a new [N, I] ``silu(gate) * up`` (liger-kernel's SwiGLU forward kernel)."""
    if gate.shape[0] == 0:
        return torch.empty_like(gate)
    return swiglu_forward(gate, up)[2].detach()


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@liger_custom_op("liger_dspine::silu_mul_backward_", mutates_args=("gate", "up"))
def silu_mul_backward_(gate: torch.Tensor, up: torch.Tensor, grad_product: torch.Tensor) -> None:
    """Write the gradients of gate and up ([N, I], contiguous) over gate and up (liger-kernel's SwiGLU backward)."""
    if gate.shape[0]:
        swiglu_backward(gate, up, grad_product)


@silu_mul_backward_.register_fake
def _(gate, up, grad_product):
    return None


# -------------------------------------------------------------------------------------- fused linear cross entropy
@liger_custom_op("liger_dspine::fused_linear_cross_entropy", mutates_args=())
def _fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_mem_const: int,
    need_hidden: bool,
    need_weight: bool,
    accum_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss [] fp32, token accuracy [] fp32, d loss / d hidden [T, H], d loss / d weight [V, H] or [0]);
    ``accum_dtype`` is liger-kernel's: the dtype d weight is summed in over the row chunks (None: the weight's)."""
    loss, _, accuracy, _, grad_hidden, grad_weight, _ = fused_linear_cross_entropy_forward(
        hidden,
        weight,
        targets,
        ignore_index=ignore_index,
        reduction="sum",
        return_token_accuracy=True,
        compute_gradients=need_hidden or need_weight,
        weight_requires_grad=need_weight,
        chunk_mem_const=chunk_mem_const,
        accum_dtype=accum_dtype,
    )
    grad_weight = grad_weight if grad_weight is not None else hidden.new_empty(0)
    return loss, accuracy, grad_hidden, grad_weight


@_fused_linear_cross_entropy.register_fake
def _(hidden, weight, targets, ignore_index, chunk_mem_const, need_hidden, need_weight, accum_dtype=None):
    scalar = hidden.new_empty((), dtype=torch.float32)
    grad_weight = torch.empty_like(weight) if need_weight else hidden.new_empty(0)
    return scalar, torch.empty_like(scalar), torch.empty_like(hidden), grad_weight


class LigerFusedLinearCrossEntropyOpFunction(torch.autograd.Function):
    """``(hidden [T, H], weight [V, H], targets [T], ignore_index, chunk_mem_const, accum_dtype)`` -> ``(loss []
    fp32 summed over the rows not ignored, token_accuracy [] fp32 without gradient)``."""

    kernel_ops = ("liger_dspine::fused_linear_cross_entropy",)

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_mem_const, accum_dtype=None):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        loss, accuracy, grad_hidden, grad_weight = _fused_linear_cross_entropy(
            hidden, weight, targets, ignore_index, chunk_mem_const, need_hidden, need_weight, accum_dtype
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.need_weight = need_weight
        ctx.mark_non_differentiable(accuracy)
        return loss, accuracy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_accuracy):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden * grad_loss
        grad_weight = grad_weight * grad_loss if ctx.need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Eager: ``(hidden [T, H], weight [V, H], targets [T], ignore_index, chunk_mem_const, accum_dtype)`` -> ``(loss
    [] fp32 summed over the rows not ignored, token_accuracy [] fp32 without gradient)``, by liger-kernel's forward
    (the gradients formed chunk by chunk there); the backward multiplies the kept gradients in place by the incoming
    gradient (liger-kernel's element-wise kernel, fp32 products), with no host synchronisation.

    A kept gradient can be scaled once: a later backward through the same graph raises, before any gradient is
    returned, unless every earlier pass had an upstream gradient of exactly 1 (then nothing was scaled). That test
    reads a device flag on the host, on later passes only."""

    kernel_ops = ("liger_dspine::fused_linear_cross_entropy",)  # eager only: torch.compile takes the Op Function

    @staticmethod
    @amp_custom_fwd
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_mem_const, accum_dtype=None):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        loss, accuracy, grad_hidden, grad_weight = _fused_linear_cross_entropy(
            hidden, weight, targets, ignore_index, chunk_mem_const, need_hidden, need_weight, accum_dtype
        )
        ctx.save_for_backward(grad_hidden, grad_weight if need_weight else None)
        ctx.second_pass = ScaledOnce("liger-kernel's fused linear cross entropy")
        ctx.mark_non_differentiable(accuracy)
        return loss, accuracy

    @staticmethod
    @amp_custom_bwd
    @first_order_only
    def backward(ctx, grad_loss, _grad_accuracy):
        ctx.second_pass.refuse_if_scaled()
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.detach().to(torch.float32).reshape(1)
        ctx.second_pass.note(scale)
        for kept in (grad_hidden, grad_weight):
            if kept is not None:
                _scale_rows_in_place(kept, scale)
        return grad_hidden, grad_weight, None, None, None, None


def _scale_rows_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x [R, C] *= scale`` (fp32 [1] on x's device), products in fp32, by liger-kernel's element-wise kernel."""
    block_size = min(MAX_FUSED_SIZE, triton.next_power_of_2(x.shape[1]))
    element_mul_kernel[(x.shape[0],)](
        x, x.stride(0), scale, x.shape[1], BLOCK_SIZE=block_size, X_col_stride=x.stride(1), num_warps=32
    )


def liger_fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_mem_const: int,
    accum_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """liger-kernel's fused linear cross entropy (sum reduction, token accuracy) of ``hidden [T, H]``,
    ``weight [V, H]`` and ``targets [T]``: :class:`LigerFusedLinearCrossEntropyFunction` in eager code (the kept
    gradients scaled in place), :class:`LigerFusedLinearCrossEntropyOpFunction` under torch.compile (one opaque op,
    scaled into new tensors)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"liger-dspine: fused linear cross entropy expects hidden [T, H] and weight [V, H], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    check_kernel_device(hidden, "fused linear cross entropy")
    compiling = torch.compiler.is_compiling()
    function = LigerFusedLinearCrossEntropyOpFunction if compiling else LigerFusedLinearCrossEntropyFunction
    return function.apply(hidden, weight, targets.contiguous(), int(ignore_index), int(chunk_mem_const), accum_dtype)
