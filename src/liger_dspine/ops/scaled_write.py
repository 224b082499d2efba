"""The spine's write, ``x + rms(x) * (m @ W^T)``, and its feature, ``c * normalize(x @ R^T)``, kept lean.

DSpine's adjacent injection adds to each slot's state x [N, H] a message m [N, M] written through W [H, M], scaled
by the state's RMS (no eps): rms(x) = ||x||_2 / sqrt(H), computed in fp32. Written with torch ops, autograd keeps an
fp32 copy of x for the norm and the written delta [N, H] for the scale's gradient: three [N, H] bf16 buffers per
layer besides x itself. ``LigerScaledWriteFunction`` keeps x, m, W and rms(x) and recomputes the delta (an [N, M] x
[M, H] GEMM, M = 512 in SpecForge's configs) in the backward:

    d delta = g * rms                  dm = d delta @ W,  dW = d delta^T @ m
    d rms   = sum_h g_h delta_h        dx = g + d rms * x / (rms * H)   (0 where rms = 0)

``LigerUnitFeatureFunction`` is ``c * normalize(p)`` of a projection p [N, r], returned in p's dtype: it keeps p as
it is (not an fp32 copy) and the inverse norm, and its backward is (c / ||p||) (g - u (u . g)) with u = p / ||p||.
Both compute in fp32 (fp64 for fp64 inputs) and return the input dtype, as the torch expressions do.
"""

import math

import torch
import torch.nn.functional as F

from liger_dspine.ops.first_order import first_order_only


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's own dtype when it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


class LigerScaledWriteFunction(torch.autograd.Function):
    """``(x [N, H], m [N, M], W [H, M])`` -> ``x + rms(x) * (m @ W^T)`` in x's dtype."""

    kernel_ops = ()  # torch ops only

    @staticmethod
    def forward(ctx, states, message, weight):
        wide = _wide(states.dtype)
        rms = torch.linalg.vector_norm(states.to(wide), dim=-1, keepdim=True) / math.sqrt(states.shape[-1])
        delta = F.linear(message, weight)  # in autocast's dtype when it is on
        ctx.save_for_backward(states, message, weight, rms)
        ctx.delta_dtype = delta.dtype
        return states + rms.to(states.dtype) * delta

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        states, message, weight, rms = ctx.saved_tensors
        dtype = ctx.delta_dtype  # the forward's GEMM dtype (autocast is off in the backward)
        low_message, low_weight = message.to(dtype), weight.to(dtype)
        delta = F.linear(low_message, low_weight)
        grad_delta = (grad * rms.to(grad.dtype)).to(dtype)
        grad_message = (grad_delta @ low_weight).to(message.dtype) if ctx.needs_input_grad[1] else None
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = (grad_delta.flatten(0, -2).T @ low_message.flatten(0, -2)).to(weight.dtype)
        grad_states = None
        if ctx.needs_input_grad[0]:
            wide = rms.dtype
            grad_rms = (grad.to(wide) * delta.to(wide)).sum(dim=-1, keepdim=True)
            per_unit = torch.where(rms > 0, grad_rms / (rms * states.shape[-1]), torch.zeros_like(rms))
            grad_states = grad + (per_unit * states.to(wide)).to(grad.dtype)
        return grad_states, grad_message, grad_weight


class LigerUnitFeatureFunction(torch.autograd.Function):
    """``(p [N, r], c, eps)`` -> ``c * p / max(||p||, eps)`` in p's dtype (computed in fp32)."""

    kernel_ops = ()  # torch ops only

    @staticmethod
    def forward(ctx, projected, scale, eps):
        wide = _wide(projected.dtype)
        inverse = 1.0 / torch.linalg.vector_norm(projected.to(wide), dim=-1, keepdim=True).clamp_min(eps)
        ctx.save_for_backward(projected, inverse)
        ctx.scale = scale
        ctx.eps = eps
        return (scale * projected.to(wide) * inverse).to(projected.dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        projected, inverse = ctx.saved_tensors
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
