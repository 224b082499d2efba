"""The routed experts' grouped GEMM on FP8 (e4m3) operands with dynamic rowwise scales, forward and backward.

``x`` [S, K] holds the expert-sorted rows, group e being rows offs[e-1]:offs[e] (``offs`` [E] int32 cumulative
ends, as :mod:`liger_dspine.ops.grouped_experts` builds them), and ``weight`` [E, N, K] one matrix per expert::

    forward   y[rows of e]  = x[rows of e] @ weight[e].T       x per row (over K), weight[e] per out-feature (over K)
    backward  dx[rows of e] = dy[rows of e] @ weight[e]        dy per row (over N), weight[e] per in-feature (over N)
              dW[e]         = dy[rows of e].T @ x[rows of e]   dy and x per feature over the group's rows

The weight gradient's operands are quantised per group and written transposed at 16-aligned padded offsets
(:func:`~liger_dspine.ops.fp8_quantize.quantize_group_columns`), zero-filled between groups; an empty group gets 16
zero columns, so its gradient is exactly zero.

On CUDA (compute capability 9.0 or 10.0, where torch's rowwise FP8 grouped GEMM runs) each GEMM is one
``torch._scaled_grouped_mm`` in bf16 with fp32 accumulation (``use_fast_accum=False``); its layouts, from torch's
checks (``_meta_grouped_mm_common``, ``_scaled_grouped_mm_cuda``, ``prepare_grouped_gemm_data``):

- forward and dx, 2-D x 3-D with ``offs`` along M: mat_a [S, K] fp8 row-major with scale_a [S]; mat_b [E, K, N]
  column-major in its last two dims (``q_w.transpose(-2, -1)`` of a row-major [E, N, K]) with scale_b [E, N]
  (stride 1 in the last dim); K and N multiples of 16; any group sizes.
- dW, 2-D x 2-D with ``offs`` along K: mat_a [N, Sp] row-major, mat_b [Sp, K] column-major (the transpose of a
  row-major [K, Sp]); scale_a [E * N] and scale_b [E * K], 1-D, group-major (group e's scales at e * N, e * K);
  Sp and every group's extent along K multiples of 16 (TMA alignment of the group starts): hence the padding.
  Output [E, N, K].

Elsewhere (CPU) the same Function runs the reference: per group, the fp8 values as fp32, an fp32 matmul, times the
two scales, rounded to the output dtype (the group bounds read on the host, inside the op). Rows past offs[-1] are
zero there, and left unwritten by torch on CUDA: offs[-1] should be S. The Function saves x, weight and offs (no fp8
copies) and quantises again in backward.
"""

import torch

from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.fp8_linear import check_fp8_linear
from liger_dspine.ops.fp8_quantize import quantize_columns
from liger_dspine.ops.fp8_quantize import quantize_group_columns
from liger_dspine.ops.fp8_quantize import quantize_rowwise
from liger_dspine.ops.gemm_dtype import gemm_dtype

GROUPED_FP8_CAPABILITIES = ((9, 0), (10, 0))  # torch's _scaled_grouped_mm_cuda: sm90 and sm100 only


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def cuda_grouped_rows_mm(a, scale_a, b, scale_b, offs):
    """a [S, K'] fp8 row-major, b [E, N', K'] fp8 row-major -> [S, N'] bf16: rows of group e times b[e].T."""
    return torch._scaled_grouped_mm(
        a, b.transpose(-2, -1), scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False
    )


def cuda_grouped_weight_grad(a, scale_a, b, scale_b, padded_offs):
    """a [M, Sp] fp8, scale_a [E, M], b [K', Sp] fp8, scale_b [E, K'] -> [E, M, K'] bf16: per padded group along
    Sp, a_e @ b_e.T."""
    return torch._scaled_grouped_mm(
        a, b.t(), scale_a.reshape(-1), scale_b.reshape(-1), offs=padded_offs, out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )  # fmt: skip


@liger_custom_op("liger_dspine::fp8_grouped_mm", mutates_args=())
def _grouped_rows_mm(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a [S, K'] fp8 with scale_a [S], b [E, N', K'] fp8 with scale_b [E, N'] -> [S, N']."""
    if a.is_cuda:
        return cuda_grouped_rows_mm(a, scale_a, b, scale_b, offs)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for group, (start, end) in enumerate(_bounds(offs)):
        if start < end:
            product = a[start:end].float() @ b[group].float().t()
            out[start:end] = product.mul_(scale_a[start:end, None]).mul_(scale_b[group][None, :])
    return out


@_grouped_rows_mm.register_fake
def _(a, scale_a, b, scale_b, offs, out_dtype):
    return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)


@liger_custom_op("liger_dspine::fp8_grouped_mm_weight_grad", mutates_args=())
def _grouped_weight_grad(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    padded_offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a [M, Sp] fp8 with scale_a [E, M], b [K', Sp] fp8 with scale_b [E, K'] -> [E, M, K']."""
    if a.is_cuda:
        return cuda_grouped_weight_grad(a, scale_a, b, scale_b, padded_offs)
    out = torch.empty(padded_offs.shape[0], a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    for group, (start, end) in enumerate(_bounds(padded_offs)):
        product = a[:, start:end].float() @ b[:, start:end].float().t()
        out[group] = product.mul_(scale_a[group][:, None]).mul_(scale_b[group][None, :])
    return out


@_grouped_weight_grad.register_fake
def _(a, scale_a, b, scale_b, padded_offs, out_dtype):
    return torch.empty(padded_offs.shape[0], a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)


class LigerFP8GroupedMMFunction(torch.autograd.Function):
    """(x [S, K], weight [E, N, K], offs [E] int32) -> [S, N] in the GEMM dtype, every GEMM on FP8 operands."""

    kernel_ops = (
        "liger_dspine::fp8_quantize_rows",
        "liger_dspine::fp8_quantize_columns",
        "liger_dspine::fp8_quantize_group_columns",
        "liger_dspine::fp8_grouped_mm",
        "liger_dspine::fp8_grouped_mm_weight_grad",
    )

    @staticmethod
    def forward(ctx, x, weight, offs):
        dtype = gemm_dtype(x, weight, "FP8 grouped GEMM")
        experts, out_features, in_features = weight.shape
        q_x, scale_x = quantize_rowwise(x)
        q_w, scale_w = quantize_rowwise(weight.reshape(experts * out_features, in_features))
        q_w, scale_w = q_w.view(experts, out_features, in_features), scale_w.view(experts, out_features)
        ctx.save_for_backward(x, weight, offs)
        ctx.gemm_dtype = dtype
        return _grouped_rows_mm(q_x, scale_x, q_w, scale_w, offs, dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[:2]
        grad_x = grad_weight = None
        if need_x:
            q_g, scale_g = quantize_rowwise(grad_out)
            q_wt, scale_wt = quantize_columns(weight)  # [E, K, N]: weight[e] per in-feature
            grad_x = _grouped_rows_mm(q_g, scale_g, q_wt, scale_wt, offs, ctx.gemm_dtype).to(x.dtype)
        if need_weight:
            q_gt, scale_gt, padded_offs = quantize_group_columns(grad_out, offs)  # [N, Sp], [E, N]
            q_xt, scale_xt, _ = quantize_group_columns(x, offs)  # [K, Sp], [E, K]
            grad_weight = _grouped_weight_grad(q_gt, scale_gt, q_xt, scale_xt, padded_offs, ctx.gemm_dtype)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K], weight [E, N, K], offs [E] int32 cumulative row ends -> [S, N]: rows of group e times weight[e].T,
    on FP8 operands (module docstring). K and N must be multiples of 16; on CUDA the GEMM dtype must be bf16 and
    the GPU of compute capability 9.0 or 10.0."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"liger-dspine: FP8 grouped GEMM needs x [S, K] and weight [E, N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != weight.shape[0]:
        raise ValueError(
            f"liger-dspine: FP8 grouped GEMM needs offs as [E = {weight.shape[0]}] int32 cumulative row ends, got "
            f"{offs.dtype} {tuple(offs.shape)}"
        )
    dtype = gemm_dtype(x, weight, "FP8 grouped GEMM")
    check_fp8_linear(
        x.device, dtype, "FP8 grouped GEMM", GROUPED_FP8_CAPABILITIES, K=weight.shape[2], N=weight.shape[1]
    )
    return LigerFP8GroupedMMFunction.apply(x, weight, offs)
