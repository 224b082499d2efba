"""The DSpine alignment term, 1 - cos(feature, code), in one kernel launch forward and one backward.

Features [M, L, P, r] (one readout per layer and proposal) against codes [M, P, r] (the label's transfer code,
shared by the L layers): align[m, l, p] = 1 - x . y / (max(|x|, eps) max(|y|, eps)) in fp32, as
``1 - F.cosine_similarity(x.float(), y.float(), dim=-1, eps)`` computes it (which clamps each norm without a
gradient through the clamp). In torch that is about 13 kernels forward and 15 backward for a few MB of data; a
chunked, checkpointed objective runs the forward twice per chunk, and at the objective's widths the GPU waits for
the host to launch them. The backward recomputes the three sums and writes, for an upstream gradient g,
dx = -g (y / (|x| |y|) - cos x / |x|^2) in the features' dtype. The codes get no gradient (they are fixed).
Without a Triton device (CPU without the interpreter, or fp64) the torch expression runs.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_BLOCK_R = 1024


@triton.jit
def _row_sums(features_ptr, codes_ptr, row, code_row, rank, BLOCK_R: tl.constexpr):
    cols = tl.arange(0, BLOCK_R)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    xx = tl.zeros([BLOCK_R], dtype=tl.float32)
    yy = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        inside = start + cols < rank
        x = tl.load(features_ptr + row * rank + start + cols, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(codes_ptr + code_row * rank + start + cols, mask=inside, other=0.0).to(tl.float32)
        dot += x * y
        xx += x * x
        yy += y * y
    return tl.sum(dot, axis=0), tl.sum(xx, axis=0), tl.sum(yy, axis=0)


@triton.jit
def _alignment_forward_kernel(
    features_ptr, codes_ptr, out_ptr, rank, layers, proposals, eps, BLOCK_R: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (m, l, p) of the contiguous features
    code_row = (row // (layers * proposals)) * proposals + row % proposals
    dot, xx, yy = _row_sums(features_ptr, codes_ptr, row, code_row, rank, BLOCK_R)
    x_norm = tl.maximum(tl.sqrt(xx), eps)
    y_norm = tl.maximum(tl.sqrt(yy), eps)
    tl.store(out_ptr + row, 1.0 - dot / (x_norm * y_norm))


@triton.jit
def _alignment_backward_kernel(
    features_ptr, codes_ptr, grad_out_ptr, grad_features_ptr, rank, layers, proposals, eps, BLOCK_R: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    code_row = (row // (layers * proposals)) * proposals + row % proposals
    dot, xx, yy = _row_sums(features_ptr, codes_ptr, row, code_row, rank, BLOCK_R)
    x_norm = tl.maximum(tl.sqrt(xx), eps)
    y_norm = tl.maximum(tl.sqrt(yy), eps)
    cosine = dot / (x_norm * y_norm)
    g = -tl.load(grad_out_ptr + row)
    cols = tl.arange(0, BLOCK_R)
    for start in range(0, rank, BLOCK_R):
        inside = start + cols < rank
        x = tl.load(features_ptr + row * rank + start + cols, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(codes_ptr + code_row * rank + start + cols, mask=inside, other=0.0).to(tl.float32)
        grad = g * (y / (x_norm * y_norm) - cosine * x / (x_norm * x_norm))
        tl.store(
            grad_features_ptr + row * rank + start + cols, grad.to(grad_features_ptr.dtype.element_ty), mask=inside
        )


def _alignment_torch(features: torch.Tensor, codes: torch.Tensor, eps: float) -> torch.Tensor:
    return 1.0 - F.cosine_similarity(features.float(), codes.float()[:, None], dim=-1, eps=eps)


@liger_custom_op("liger_dspine::alignment_cosine", mutates_args=())
def _alignment_forward(features: torch.Tensor, codes: torch.Tensor, eps: float) -> torch.Tensor:
    """features [M, L, P, r], codes [M, P, r] (contiguous) -> [M, L, P] fp32."""
    rows, layers, proposals, rank = features.shape
    out = torch.empty(rows, layers, proposals, dtype=torch.float32, device=features.device)
    if out.numel():
        _alignment_forward_kernel[(out.numel(),)](
            features, codes, out, rank, layers, proposals, float(eps),
            BLOCK_R=min(_BLOCK_R, triton.next_power_of_2(rank)),
        )  # fmt: skip
    return out


@_alignment_forward.register_fake
def _(features, codes, eps):
    return torch.empty(features.shape[:-1], dtype=torch.float32, device=features.device)


@liger_custom_op("liger_dspine::alignment_cosine_backward", mutates_args=())
def _alignment_backward(
    grad_out: torch.Tensor, features: torch.Tensor, codes: torch.Tensor, eps: float
) -> torch.Tensor:
    """The features' gradient [M, L, P, r] in their dtype, from grad_out [M, L, P] fp32 (all contiguous)."""
    rows, layers, proposals, rank = features.shape
    grad = torch.empty_like(features)
    if grad_out.numel():
        _alignment_backward_kernel[(grad_out.numel(),)](
            features, codes, grad_out, grad, rank, layers, proposals, float(eps),
            BLOCK_R=min(_BLOCK_R, triton.next_power_of_2(rank)),
        )  # fmt: skip
    return grad


@_alignment_backward.register_fake
def _(grad_out, features, codes, eps):
    return torch.empty_like(features)


class LigerAlignmentCosineFunction(torch.autograd.Function):
    """``(features [M, L, P, r], codes [M, P, r], eps)`` -> 1 - cos [M, L, P] fp32; differentiable in the features."""

    kernel_ops = ("liger_dspine::alignment_cosine", "liger_dspine::alignment_cosine_backward")

    @staticmethod
    def forward(ctx, features, codes, eps):
        ctx.save_for_backward(features, codes)
        ctx.eps = eps
        return _alignment_forward(features, codes, eps)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        features, codes = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return _alignment_backward(grad_out.float().contiguous(), features, codes, ctx.eps), None, None


def liger_alignment_cosine(features: torch.Tensor, codes: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """1 - cos(features[m, l, p], codes[m, p]) over the last dimension: features [M, L, P, r], codes [M, P, r]
    -> [M, L, P] fp32, as ``1 - F.cosine_similarity(features.float(), codes.float()[:, None], dim=-1, eps=eps)``.
    Codes that require a gradient, fp64 or a device without Triton take that torch expression."""
    if features.dim() != 4 or codes.shape != (features.shape[0], *features.shape[2:]):
        raise ValueError(
            f"liger-dspine: the alignment term expects features [M, L, P, r] and codes [M, P, r], got "
            f"{tuple(features.shape)} and {tuple(codes.shape)}"
        )
    if (
        codes.requires_grad
        or torch.float64 in (features.dtype, codes.dtype)
        or not kernel_runs_on(features, _alignment_forward_kernel)
    ):
        return _alignment_torch(features, codes, eps)
    return LigerAlignmentCosineFunction.apply(features.contiguous(), codes.float().contiguous(), float(eps))
