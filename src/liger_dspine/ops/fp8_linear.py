"""``x @ weight.T`` on FP8 (e4m3) operands with dynamic rowwise scales, forward and backward.

Each GEMM quantises its two operands on the fly (:mod:`liger_dspine.ops.fp8_quantize`: fp32 scales = amax / 448
per vector along the contraction dimension) and multiplies the fp8 values with fp32 accumulation, then scales and
rounds once to the output dtype::

    forward   y  = x @ W.T        x [T, K] scaled per token (over K), W [N, K] per out-feature (over K)
    backward  dx = dy @ W         dy per token (over N), W per in-feature (over N)
              dW = dy.T @ x       dy per out-feature (over T), x per in-feature (over T)

The backward operands scaled along their first dimension are written transposed by the column quantiser, so no
``.t().contiguous()`` copy of a bf16 tensor is made; their T dimension is zero-padded to a multiple of 16.

Memory: the Function saves ``x`` and ``weight`` as given (what a bf16 linear saves) and quantises them again in
backward; the forward's rowwise fp8 copies are of no use there, as the weight gradient scales x along tokens.

On CUDA the GEMMs are ``torch._scaled_mm`` (compute capability 8.9+; rowwise scales: scale_a [M, 1] and scale_b
[1, N] fp32, contiguous; mat_a row-major, mat_b column-major; K and N multiples of 16; ``use_fast_accum=False``)
in bf16. Elsewhere (CPU) the same Function runs a reference GEMM: the fp8 values as fp32, an fp32 matmul, times the
two scales, rounded to the output dtype: what ``_scaled_mm`` computes, up to fp32 summation order.
"""

import torch

from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.fp8_quantize import quantize_columns
from liger_dspine.ops.fp8_quantize import quantize_rowwise_keeping_amax
from liger_dspine.ops.gemm_dtype import gemm_dtype

_FP8_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device, what: str, capabilities=None) -> None:
    """Refuse a CUDA device without FP8 tensor cores (compute capability below 8.9, or outside ``capabilities``)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    allowed = capability >= _FP8_CAPABILITY if capabilities is None else capability in capabilities
    if not allowed:
        wanted = "8.9 or higher" if capabilities is None else " or ".join(f"{a}.{b}" for a, b in capabilities)
        raise RuntimeError(
            f"liger-dspine: {what} needs a GPU with FP8 GEMMs (compute capability {wanted}), got "
            f"{capability[0]}.{capability[1]} on {device}"
        )


def check_multiple_of_16(what: str, hint: str = "", **dims: int) -> None:
    """A ValueError naming the ``dims`` (name: size) that are not multiples of 16, then ``hint`` (what to do)."""
    bad = {name: size for name, size in dims.items() if size % 16}
    if bad:
        raise ValueError(
            f"liger-dspine: {what} needs these dims to be multiples of 16 (FP8 GEMMs), got {bad}"
            + (hint and f": {hint}")
        )


def reference_scaled_mm(a, scale_a, b, scale_b, out_dtype):
    """a [M, K'] fp8 with scale_a [M], b [N', K'] fp8 with scale_b [N'] -> (a @ b.T) * scale_a * scale_b [M, N'],
    the fp8 values multiplied and summed in fp32, scaled, then rounded to ``out_dtype``."""
    out = a.float() @ b.float().t()
    return out.mul_(scale_a[:, None]).mul_(scale_b[None, :]).to(out_dtype)


def cuda_scaled_mm(a, scale_a, b, scale_b, out_dtype):
    """a [M, K'] fp8 row-major, b [N', K'] fp8 row-major (its transpose is the column-major mat_b) -> a @ b.T."""
    return torch._scaled_mm(
        a, b.t(), scale_a=scale_a.unsqueeze(1), scale_b=scale_b.unsqueeze(0), out_dtype=out_dtype, use_fast_accum=False
    )


@liger_custom_op("liger_dspine::fp8_scaled_mm", mutates_args=())
def _scaled_mm(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a [M, K'] fp8 with scale_a [M], b [N', K'] fp8 with scale_b [N'] -> a @ b.T [M, N']."""
    if a.is_cuda:
        return cuda_scaled_mm(a, scale_a, b, scale_b, out_dtype)
    return reference_scaled_mm(a, scale_a, b, scale_b, out_dtype)


@_scaled_mm.register_fake
def _(a, scale_a, b, scale_b, out_dtype):
    return torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, amax_x: bool = False, amax_w: bool = False):
    """x [T, K] @ weight [N, K].T -> [T, N] in ``dtype``: x per token, weight per out-feature, both over K. With
    ``amax_x`` / ``amax_w`` also the column amax of x / weight ([K] int32 fp32 bits, else None), found in the same
    passes, for the backward's column quantisers: (out, amax of x, amax of weight)."""
    q_x, scale_x, column_amax_x = quantize_rowwise_keeping_amax(x, amax_x)
    q_w, scale_w, column_amax_w = quantize_rowwise_keeping_amax(weight, amax_w)
    return _scaled_mm(q_x, scale_x, q_w, scale_w, dtype), column_amax_x, column_amax_w


def fp8_mm_grad_input(grad_out, weight, dtype, amax_w=None, amax_g: bool = False):
    """grad_out [T, N] @ weight [N, K] -> [T, K] in ``dtype``: grad_out per token, weight per in-feature, over N.
    ``amax_w``: the weight's column amax from the forward. With ``amax_g`` also grad_out's column amax (for
    :func:`fp8_mm_grad_weight`): (grad_input, amax of grad_out or None)."""
    q_g, scale_g, column_amax_g = quantize_rowwise_keeping_amax(grad_out, amax_g)
    q_wt, scale_wt = quantize_columns(weight, amax_w)  # [K, N]
    return _scaled_mm(q_g, scale_g, q_wt, scale_wt, dtype), column_amax_g


def fp8_mm_grad_weight(grad_out, x, dtype, amax_g=None, amax_x=None):
    """grad_out [T, N].T @ x [T, K] -> [N, K] in ``dtype``: both per feature, over the T tokens (their column
    amaxes from the rows passes when given)."""
    q_gt, scale_gt = quantize_columns(grad_out, amax_g)  # [N, Tp]
    q_xt, scale_xt = quantize_columns(x, amax_x)  # [K, Tp]
    return _scaled_mm(q_gt, scale_gt, q_xt, scale_xt, dtype)


class LigerFP8LinearFunction(torch.autograd.Function):
    """(x [T, K], weight [N, K]) -> x @ weight.T [T, N] in the GEMM dtype, every GEMM on FP8 operands. The forward's
    rows passes over x and the weight also find their column amaxes, which the backward's column quantisers take
    instead of a pass of their own."""

    kernel_ops = (
        "liger_dspine::fp8_quantize_rows",
        "liger_dspine::fp8_quantize_columns",
        "liger_dspine::fp8_scaled_mm",
    )

    @staticmethod
    def forward(ctx, x, weight):
        dtype = gemm_dtype(x, weight, "FP8 linear")
        need_x, need_weight = ctx.needs_input_grad[:2]
        # the weight's columns feed the input gradient, x's the weight gradient
        out, amax_x, amax_w = fp8_mm(x, weight, dtype, amax_x=need_weight, amax_w=need_x)
        ctx.save_for_backward(x, weight, amax_x, amax_w)
        ctx.gemm_dtype = dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        x, weight, amax_x, amax_w = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[:2]
        grad_x = grad_weight = amax_g = None
        if need_x:
            grad_x, amax_g = fp8_mm_grad_input(grad_out, weight, ctx.gemm_dtype, amax_w, amax_g=need_weight)
            grad_x = grad_x.to(x.dtype)
        if need_weight:
            grad_weight = fp8_mm_grad_weight(grad_out, x, ctx.gemm_dtype, amax_g, amax_x).to(weight.dtype)
        return grad_x, grad_weight


def check_fp8_linear(device: torch.device, dtype: torch.dtype, what: str, capabilities=None, **dims: int) -> None:
    """Refuse what the FP8 GEMMs cannot run: ``dims`` not multiples of 16, a GPU without FP8 (or outside
    ``capabilities``), bf16 not the GEMM dtype on CUDA."""
    check_multiple_of_16(what, **dims)
    check_fp8_device(device, what, capabilities)
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"liger-dspine: {what} on CUDA computes in bf16, got {dtype}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] with FP8 operands (module docstring). K and N must be multiples of
    16; on CUDA the GEMM dtype must be bf16 and the GPU of compute capability 8.9+."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"liger-dspine: FP8 linear needs x [..., K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    check_fp8_linear(x.device, gemm_dtype(x, weight, "FP8 linear"), "FP8 linear", K=in_features, N=out_features)
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    out = LigerFP8LinearFunction.apply(rows, weight)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
