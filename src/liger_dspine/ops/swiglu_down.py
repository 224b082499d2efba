"""SwiGLU fused with the down projection: ``y = (silu(a) * b) @ W^T`` without keeping the product for backward.

``down_proj(LigerSiLUMulFunction.apply(a, b))`` keeps three ``[..., I]`` activations alive until the backward: the
gate ``a`` and up ``b`` (saved by the SiLU-mul) and the product ``c = silu(a) * b`` (saved by the Linear for the
weight gradient). This op saves only ``a``, ``b`` and ``W``; the backward recomputes ``c`` with liger-kernel's
SiLU-mul forward kernel:

    dW = dy^T @ c        (c recomputed, then freed before dc is allocated; one op, see below)
    dc = dy @ W
    da, db               liger-kernel's SiLU-mul backward kernel

The GEMMs run in the dtype ``F.linear`` would use (autocast's when it is on, else the inputs', which must match
the weight); the SiLU-mul kernels run in the dtype of ``a`` and ``b``; dW is returned in the weight's dtype.

With ``fp8=True`` the three GEMMs run on e4m3 operands with dynamic rowwise scales (:mod:`liger_dspine.ops.fp8_linear`:
c and W per row over I in forward, dy per token and W per in-feature over H for dc, dy and c per feature over the
tokens for dW); what is saved is unchanged.

The weight gradient is one custom op of dy, a and b (``liger_dspine::swiglu_down_weight_grad``): under torch.compile
a recompute that read only saved tensors would be moved to the forward by the partitioner, which would then keep c.

liger-kernel's backward kernel writes da and db over its a and b buffers. By default they are copies, so the
caller's tensors are untouched; with ``in_place=True`` the saved ``a`` and ``b`` themselves are overwritten (two
fewer ``[..., I]`` buffers at the backward's peak), which is only right when nothing else reads them afterwards.
"""

import torch
import torch.nn.functional as F

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.fp8_linear import check_fp8_linear
from liger_dspine.ops.fp8_linear import fp8_mm
from liger_dspine.ops.fp8_linear import fp8_mm_grad_input
from liger_dspine.ops.fp8_linear import fp8_mm_grad_weight
from liger_dspine.ops.gemm_dtype import gemm_dtype
from liger_dspine.ops.liger_kernel_ops import silu_mul
from liger_dspine.ops.liger_kernel_ops import silu_mul_backward_
from liger_dspine.ops.second_pass import RunsOnce

_WHAT = "SwiGLU down projection"


@liger_custom_op("liger_dspine::swiglu_down_weight_grad", mutates_args=())
def _down_weight_grad(grad_rows: torch.Tensor, gate_rows: torch.Tensor, up_rows: torch.Tensor) -> torch.Tensor:
    """``grad_rows [N, H]^T @ (silu(gate) * up) [N, I]`` -> [H, I] in grad_rows' dtype, the product recomputed here."""
    product = silu_mul(gate_rows, up_rows).to(grad_rows.dtype)
    return grad_rows.t() @ product


@_down_weight_grad.register_fake
def _(grad_rows, gate_rows, up_rows):
    return grad_rows.new_empty(grad_rows.shape[1], gate_rows.shape[1])


_RUNS_ONCE = (
    "liger-dspine: the fused SwiGLU MLP (LigerSwiGLUMLP) can run its backward only once: its first backward wrote "
    "the gradients of gate and up over the saved activations, to save memory. For backward(retain_graph=True) twice "
    "or autograd.grad(..., retain_graph=True) then backward(), run the forward again, or patch with swiglu=False."
)


def _overwritable(x: torch.Tensor) -> bool:
    """An intermediate result of the graph (not a leaf the caller owns, not a view into another tensor)."""
    return x.grad_fn is not None and x._base is None


class LigerSwiGLUDownFunction(torch.autograd.Function):
    """``(a [..., I], b [..., I], W [H, I], in_place)`` -> ``y [..., H] = (silu(a) * b) @ W^T``.

    The SiLU-mul kernels are custom ops (:mod:`liger_dspine.ops.liger_kernel_ops`); the GEMMs are torch's. Under
    torch.compile ``in_place`` is ignored: the identity checks it needs do not trace, so gate and up are copied.
    """

    kernel_ops = (
        "liger_dspine::silu_mul",
        "liger_dspine::silu_mul_backward_",
        "liger_dspine::swiglu_down_weight_grad",
        "liger_dspine::fp8_quantize_rows",
        "liger_dspine::fp8_quantize_columns",
        "liger_dspine::fp8_scaled_mm",
    )

    @staticmethod
    def forward(ctx, gate, up, down_weight, in_place, fp8=False):
        device_type = gate.device.type
        dtype = gemm_dtype(gate, down_weight, _WHAT)
        width = gate.shape[-1]
        # the kernels read rows of a contiguous buffer; a copy made here is ours to overwrite
        gate_saved, up_saved = gate.contiguous(), up.contiguous()
        with torch.autocast(device_type, enabled=False):
            product = silu_mul(gate_saved.view(-1, width), up_saved.view(-1, width))
            amax_product = amax_weight = None
            if fp8:
                # the column amaxes for the backward's column quantisers; the backward recomputes the product bit for
                # bit but casts it to the GEMM dtype, so its amax from here holds only in that dtype
                needs_input_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
                amax_x = ctx.needs_input_grad[2] and product.dtype == dtype
                out, amax_product, amax_weight = fp8_mm(
                    product, down_weight, dtype, amax_x=amax_x, amax_w=needs_input_grad
                )
                out = out.view(*gate.shape[:-1], down_weight.shape[0])
            else:
                # [..., I] in, so the output is a tensor of its own and not a view of an intermediate
                out = F.linear(product.view(gate.shape).to(dtype), down_weight.to(dtype))
        del product

        if torch.compiler.is_compiling():
            ctx.overwrite_gate = ctx.overwrite_up = False
        else:
            shares_storage = torch._C._is_alias_of(gate_saved, up_saved)  # no data pointer: fake tensors have none
            ctx.overwrite_gate = in_place and (gate_saved is not gate or _overwritable(gate))
            ctx.overwrite_up = in_place and (up_saved is not up or _overwritable(up)) and not shares_storage
        ctx.second_pass = RunsOnce(_RUNS_ONCE)  # spent once the backward overwrote gate and up
        ctx.compute_dtype, ctx.fp8 = dtype, fp8
        ctx.save_for_backward(gate_saved, up_saved, down_weight, amax_product, amax_weight)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        ctx.second_pass.refuse()
        gate, up, down_weight, amax_product, amax_weight = ctx.saved_tensors
        gate_needs_grad, up_needs_grad, weight_needs_grad = ctx.needs_input_grad[:3]
        width, hidden = gate.shape[-1], down_weight.shape[0]
        gate_rows, up_rows = gate.view(-1, width), up.view(-1, width)
        dtype = ctx.compute_dtype
        grad_gate = grad_up = grad_weight = None
        with torch.autocast(gate.device.type, enabled=False):
            # grad_out belongs to autograd: only read (reshape / cast make new tensors or views)
            grad_rows = grad_out.reshape(-1, hidden).to(dtype)
            if weight_needs_grad:
                # before the SiLU-mul backward, which may overwrite gate and up
                if ctx.fp8:
                    product = silu_mul(gate_rows, up_rows).to(dtype)
                    grad_weight = fp8_mm_grad_weight(grad_rows, product, dtype, None, amax_product)
                    grad_weight = grad_weight.to(down_weight.dtype)
                    del product
                else:
                    grad_weight = _down_weight_grad(grad_rows, gate_rows, up_rows).to(down_weight.dtype)
            if gate_needs_grad or up_needs_grad:
                if ctx.fp8:
                    grad_product = fp8_mm_grad_input(grad_rows, down_weight, dtype, amax_weight)[0].to(gate.dtype)
                else:
                    grad_product = (grad_rows @ down_weight.to(dtype)).to(gate.dtype).contiguous()
                grad_gate_rows = gate_rows if ctx.overwrite_gate else gate_rows.clone()
                grad_up_rows = up_rows if ctx.overwrite_up else up_rows.clone()
                if ctx.overwrite_gate or ctx.overwrite_up:
                    ctx.second_pass.spend()
                silu_mul_backward_(grad_gate_rows, grad_up_rows, grad_product)
                del grad_product
                grad_gate = grad_gate_rows.view(gate.shape) if gate_needs_grad else None
                grad_up = grad_up_rows.view(up.shape) if up_needs_grad else None
        return grad_gate, grad_up, grad_weight, None, None


def _check_inputs(gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor) -> None:
    if gate.dim() < 1 or gate.shape != up.shape:
        raise ValueError(
            f"liger-dspine: {_WHAT}: gate and up must have one shape [..., I], "
            f"got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise ValueError(f"liger-dspine: {_WHAT}: gate is {gate.dtype} and up is {up.dtype}; they must match")
    if down_weight.dim() != 2 or down_weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"liger-dspine: {_WHAT}: the weight must be [H, {gate.shape[-1]}] (nn.Linear(I, H).weight), got "
            f"{tuple(down_weight.shape)}"
        )


def liger_swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor, in_place: bool = False, fp8: bool = False
) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, down_weight)``, saving gate, up and the weight but not their product.

    Args:
        gate: [..., I] the gate projection's output ``a``.
        up: [..., I] the up projection's output ``b``, same dtype as ``gate``.
        down_weight: [H, I] the down projection's weight (no bias); the same dtype as gate and up outside autocast.
        in_place: let the backward write the gradients of gate and up over the saved gate and up (two fewer
            ``[..., I]`` buffers at its peak). Only when nothing reads ``gate`` and ``up`` after the backward and
            the backward runs once (no ``retain_graph``). Leaves and views are never overwritten.
        fp8: the three GEMMs on e4m3 operands (module docstring); I and H multiples of 16, and on CUDA a GPU with
            FP8 GEMMs and bf16 as the GEMM dtype.

    Returns:
        [..., H] in the GEMM dtype (autocast's, else the inputs').
    """
    _check_inputs(gate, up, down_weight)
    check_kernel_device(gate, _WHAT)
    if fp8:
        hidden, width = down_weight.shape
        check_fp8_linear(gate.device, gemm_dtype(gate, down_weight, _WHAT), f"FP8 {_WHAT}", I=width, H=hidden)
    return LigerSwiGLUDownFunction.apply(gate, up, down_weight, in_place, bool(fp8))
