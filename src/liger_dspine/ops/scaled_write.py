"""The spine's write, ``x + rms(x) * (m @ W^T)``, and its feature, ``c * normalize(x @ R^T)``, kept lean.

DSpine's adjacent injection adds to each slot's state x [N, H] a message m [N, M] written through W [H, M], scaled
by the state's RMS (no eps): rms(x) = ||x||_2 / sqrt(H), computed in fp32. Written with torch ops, autograd keeps an
fp32 copy of x for the norm and the written delta [N, H] for the scale's gradient: three [N, H] bf16 buffers per
layer besides x itself. ``LigerScaledWriteFunction`` keeps x, m, W and rms(x) and recomputes the delta (an [N, M] x
[M, H] GEMM, M = 512 in SpecForge's configs) in the backward:

    d delta = g * rms                  dm = d delta @ W,  dW = d delta^T @ m
    d rms   = sum_h g_h delta_h        dx = g + d rms * x / (rms * H)   (0 where rms = 0)

Around the GEMMs, one Triton kernel a row each way (the RMS and the scaled sum; both input gradients) replaces the
torch expressions' five and ten [N, H] passes, rounding as they do; the feature likewise takes one kernel each way.
``LigerUnitFeatureFunction`` is ``c * normalize(p)`` of a projection p [N, r], returned in p's dtype: it keeps p as
it is (not an fp32 copy) and the inverse norm, and its backward is (c / ||p||) (g - u (u . g)) with u = p / ||p||.
Both compute in fp32 (fp64 for fp64 inputs) and return the input dtype, as the torch expressions do.
"""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_MAX_FUSED_HIDDEN = 16384  # widest row the kernels hold in registers
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's own dtype when it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


@triton.jit
def _scaled_write_kernel(states_ptr, delta_ptr, out_ptr, rms_ptr, hidden, root_hidden, BLOCK_H: tl.constexpr):
    """One row: rms = ||x|| / sqrt(H) in fp32, out = x + (rms in x's dtype) * delta, each product and sum rounded
    to out's dtype as torch's elementwise ops round them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    x = tl.load(states_ptr + row * hidden + cols, mask=inside, other=0.0)
    delta = tl.load(delta_ptr + row * hidden + cols, mask=inside, other=0.0)
    wide = x.to(tl.float32)
    rms = tl.sqrt(tl.sum(wide * wide, axis=0)) / root_hidden
    out_type = out_ptr.dtype.element_ty
    scaled = (rms.to(x.dtype).to(tl.float32) * delta.to(tl.float32)).to(out_type)
    tl.store(out_ptr + row * hidden + cols, (wide + scaled.to(tl.float32)).to(out_type), mask=inside)
    tl.store(rms_ptr + row, rms)


@triton.jit
def _scaled_write_backward_kernel(
    grad_ptr, delta_ptr, states_ptr, rms_ptr, grad_states_ptr, grad_delta_ptr, hidden, BLOCK_H: tl.constexpr
):
    """One row: d delta = g * rms (in g's dtype, then delta's); dx = g + (sum(g * delta) / (rms * H)) * x (0 where
    rms = 0), the product rounded to g's dtype before the sum, as the torch expressions round them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    grad = tl.load(grad_ptr + row * hidden + cols, mask=inside, other=0.0)
    delta = tl.load(delta_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
    x = tl.load(states_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
    rms = tl.load(rms_ptr + row)
    wide_grad = grad.to(tl.float32)
    grad_delta = (wide_grad * rms.to(grad.dtype).to(tl.float32)).to(grad.dtype)
    tl.store(grad_delta_ptr + row * hidden + cols, grad_delta.to(grad_delta_ptr.dtype.element_ty), mask=inside)
    grad_rms = tl.sum(wide_grad * delta, axis=0)
    per_unit = tl.where(rms > 0, grad_rms / tl.where(rms > 0, rms * hidden, 1.0), 0.0)
    radial = (per_unit * x).to(grad.dtype).to(tl.float32)
    tl.store(grad_states_ptr + row * hidden + cols, (wide_grad + radial).to(grad.dtype), mask=inside)


def _block_h(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, warps) of a row of ``hidden``."""
    block = triton.next_power_of_2(hidden)
    return block, max(1, min(16, block // 512))


@liger_custom_op("liger_dspine::scaled_write", mutates_args=())
def _scaled_write(states: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states, delta [..., H] contiguous -> (out [..., H] in their promoted dtype, rms [..., 1] fp32)."""
    out, rms = _write_outputs(states, delta)
    hidden = states.shape[-1]
    rows = states.numel() // max(hidden, 1)
    if rows:
        block, warps = _block_h(hidden)
        _scaled_write_kernel[(rows,)](
            states, delta, out, rms, hidden, math.sqrt(hidden), BLOCK_H=block, num_warps=warps
        )
    return out, rms


def _write_outputs(states: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = states.new_empty(states.shape, dtype=torch.promote_types(states.dtype, delta.dtype))
    return out, states.new_empty(states.shape[:-1] + (1,), dtype=torch.float32)


@_scaled_write.register_fake
def _(states, delta):
    return _write_outputs(states, delta)


@liger_custom_op("liger_dspine::scaled_write_backward", mutates_args=())
def _scaled_write_backward(
    grad: torch.Tensor, delta: torch.Tensor, states: torch.Tensor, rms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad, delta, states [..., H] contiguous, rms [..., 1] fp32 -> (d states in grad's dtype, d delta in delta's)."""
    hidden = states.shape[-1]
    rows = states.numel() // max(hidden, 1)
    grad_states, grad_delta = torch.empty_like(grad), torch.empty_like(delta)
    if rows:
        block, warps = _block_h(hidden)
        _scaled_write_backward_kernel[(rows,)](
            grad, delta, states, rms, grad_states, grad_delta, hidden, BLOCK_H=block, num_warps=warps
        )
    return grad_states, grad_delta


@_scaled_write_backward.register_fake
def _(grad, delta, states, rms):
    return torch.empty_like(grad), torch.empty_like(delta)


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: one shape, fp32 / bf16 / fp16, rows of at most ``_MAX_FUSED_HIDDEN``,
    on a device Triton runs on (bf16 only on a GPU: the CPU interpreter has none). Others (fp64, broadcasting shapes,
    a CPU without the interpreter) take the torch expressions, which compute the same numbers."""
    first = tensors[0]
    return (
        all(t.shape == first.shape and t.dtype in _FUSED_DTYPES for t in tensors)
        and first.shape[-1] <= _MAX_FUSED_HIDDEN
        and kernel_runs_on(first, _scaled_write_kernel)
        and (first.is_cuda or all(t.dtype != torch.bfloat16 for t in tensors))
    )


class LigerScaledWriteFunction(torch.autograd.Function):
    """``(x [N, H], m [N, M], W [H, M])`` -> ``x + rms(x) * (m @ W^T)`` in x's dtype."""

    kernel_ops = ("liger_dspine::scaled_write", "liger_dspine::scaled_write_backward")

    @staticmethod
    def forward(ctx, states, message, weight):
        delta = F.linear(message, weight)  # in autocast's dtype when it is on
        ctx.fused = _kernel_takes(states, delta)
        if ctx.fused:
            out, rms = _scaled_write(states.contiguous(), delta.contiguous())
        else:
            wide = _wide(states.dtype)
            rms = torch.linalg.vector_norm(states.to(wide), dim=-1, keepdim=True) / math.sqrt(states.shape[-1])
            out = states + rms.to(states.dtype) * delta
        ctx.save_for_backward(states, message, weight, rms)
        ctx.delta_dtype = delta.dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        states, message, weight, rms = ctx.saved_tensors
        dtype = ctx.delta_dtype  # the forward's GEMM dtype (autocast is off in the backward)
        low_message, low_weight = message.to(dtype), weight.to(dtype)
        delta = F.linear(low_message, low_weight)
        if ctx.fused:
            grad_states, grad_delta = _scaled_write_backward(
                grad.contiguous(), delta.contiguous(), states.contiguous(), rms.contiguous()
            )
        else:
            grad_delta = (grad * rms.to(grad.dtype)).to(dtype)
            grad_states = None
            if ctx.needs_input_grad[0]:
                wide = rms.dtype
                grad_rms = (grad.to(wide) * delta.to(wide)).sum(dim=-1, keepdim=True)
                per_unit = torch.where(rms > 0, grad_rms / (rms * states.shape[-1]), torch.zeros_like(rms))
                grad_states = grad + (per_unit * states.to(wide)).to(grad.dtype)
        grad_message = (grad_delta @ low_weight).to(message.dtype) if ctx.needs_input_grad[1] else None
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = (grad_delta.flatten(0, -2).T @ low_message.flatten(0, -2)).to(weight.dtype)
        return grad_states if ctx.needs_input_grad[0] else None, grad_message, grad_weight


@triton.jit
def _unit_feature_kernel(projected_ptr, out_ptr, inverse_ptr, rank, scale, eps, BLOCK_R: tl.constexpr):
    """One row: inverse = 1 / max(||p||, eps) in fp32, out = (c * p) * inverse in p's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    inside = cols < rank
    p = tl.load(projected_ptr + row * rank + cols, mask=inside, other=0.0)
    wide = p.to(tl.float32)
    inverse = 1.0 / tl.maximum(tl.sqrt(tl.sum(wide * wide, axis=0)), eps)
    tl.store(out_ptr + row * rank + cols, (scale * wide * inverse).to(p.dtype), mask=inside)
    tl.store(inverse_ptr + row, inverse)


@triton.jit
def _unit_feature_backward_kernel(
    grad_ptr, projected_ptr, inverse_ptr, grad_projected_ptr, rank, scale, limit, BLOCK_R: tl.constexpr
):
    """One row: u = p * inverse, (c * inverse) * (g - u (u . g)), without the projection where the norm was below
    eps (inverse >= limit = 1 / eps)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    inside = cols < rank
    p = tl.load(projected_ptr + row * rank + cols, mask=inside, other=0.0)
    grad = tl.load(grad_ptr + row * rank + cols, mask=inside, other=0.0).to(tl.float32)
    inverse = tl.load(inverse_ptr + row)
    unit = p.to(tl.float32) * inverse
    radial = tl.where(inverse >= limit, 0.0, tl.sum(unit * grad, axis=0))
    tl.store(
        grad_projected_ptr + row * rank + cols, ((scale * inverse) * (grad - unit * radial)).to(p.dtype), mask=inside
    )


@liger_custom_op("liger_dspine::unit_feature", mutates_args=())
def _unit_feature(projected: torch.Tensor, scale: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p [..., r] contiguous -> (c * normalize(p) in p's dtype, the inverse norm [..., 1] fp32)."""
    out, inverse = _feature_outputs(projected)
    rank = projected.shape[-1]
    rows = projected.numel() // max(rank, 1)
    if rows:
        block, warps = _block_h(rank)
        _unit_feature_kernel[(rows,)](projected, out, inverse, rank, scale, eps, BLOCK_R=block, num_warps=warps)
    return out, inverse


def _feature_outputs(projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(projected), projected.new_empty(projected.shape[:-1] + (1,), dtype=torch.float32)


@_unit_feature.register_fake
def _(projected, scale, eps):
    return _feature_outputs(projected)


@liger_custom_op("liger_dspine::unit_feature_backward", mutates_args=())
def _unit_feature_backward(
    grad: torch.Tensor, projected: torch.Tensor, inverse: torch.Tensor, scale: float, eps: float
) -> torch.Tensor:
    """grad, p [..., r] contiguous, inverse [..., 1] fp32 -> d p in p's dtype."""
    grad_projected = torch.empty_like(projected)
    rank = projected.shape[-1]
    rows = projected.numel() // max(rank, 1)
    if rows:
        block, warps = _block_h(rank)
        _unit_feature_backward_kernel[(rows,)](
            grad, projected, inverse, grad_projected, rank, scale, 1.0 / eps, BLOCK_R=block, num_warps=warps
        )
    return grad_projected


@_unit_feature_backward.register_fake
def _(grad, projected, inverse, scale, eps):
    return torch.empty_like(projected)


class LigerUnitFeatureFunction(torch.autograd.Function):
    """``(p [N, r], c, eps)`` -> ``c * p / max(||p||, eps)`` in p's dtype (computed in fp32)."""

    kernel_ops = ("liger_dspine::unit_feature", "liger_dspine::unit_feature_backward")

    @staticmethod
    def forward(ctx, projected, scale, eps):
        ctx.fused = _kernel_takes(projected)
        if ctx.fused:
            out, inverse = _unit_feature(projected.contiguous(), scale, eps)
        else:
            wide = _wide(projected.dtype)
            inverse = 1.0 / torch.linalg.vector_norm(projected.to(wide), dim=-1, keepdim=True).clamp_min(eps)
            out = (scale * projected.to(wide) * inverse).to(projected.dtype)
        ctx.save_for_backward(projected, inverse)
        ctx.scale = scale
        ctx.eps = eps
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        projected, inverse = ctx.saved_tensors
        if ctx.fused:
            grad_projected = _unit_feature_backward(
                grad.contiguous(), projected.contiguous(), inverse.contiguous(), ctx.scale, ctx.eps
            )
            return grad_projected, None, None
        unit = projected.to(inverse.dtype) * inverse
        grad = grad.to(inverse.dtype)
        clamped = inverse >= 1.0 / ctx.eps  # norm below eps: a plain scaling by c / eps, no projection
        radial = torch.where(clamped, torch.zeros_like(inverse), (unit * grad).sum(dim=-1, keepdim=True))
        return (ctx.scale * inverse * (grad - unit * radial)).to(projected.dtype), None, None


def liger_scaled_write(states: torch.Tensor, message: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """states [..., H] + rms(states) * (message [..., M] @ weight[H, M]^T), keeping no fp32 copy nor the delta."""
    return LigerScaledWriteFunction.apply(states, message, weight)


def liger_unit_feature(projected: torch.Tensor, scale: float, eps: float = 1e-12) -> torch.Tensor:
    """scale * normalize(projected, dim=-1, eps), computed in fp32, returned in projected's dtype."""
    return LigerUnitFeatureFunction.apply(projected, float(scale), float(eps))
