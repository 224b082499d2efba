"""The sum over a token's K expert slots, in Triton: ``out[t] = sum_k scale[t, k] * rows[row_of_slot[t, k]]``.

The routed experts leave one row per (token, slot) pair in expert order; each token's K rows are gathered back and
summed, weighted by the routing weights in the forward and unweighted for the input gradient in the backward.
One program per (token, column block) reads its K rows once and writes the sum once, accumulating in fp32 in
slot order k = 0, 1, ... (no atomics: deterministic), where torch takes a gather, a cast and a multiply-add pass
over [T, H] per slot.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _slot_sum_kernel(
    rows_ptr,  # [S, H], last stride 1
    slot_rows_ptr,  # [T, K] int: the row of each (token, slot), contiguous
    scale_ptr,  # [T, K] fp32, contiguous (unused without SCALED)
    out_ptr,  # [T, H], contiguous
    width,
    rows_stride,
    K: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(slot_rows_ptr + token * K + k).to(tl.int64)
        values = tl.load(rows_ptr + row * rows_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            values = values * tl.load(scale_ptr + token * K + k)
        acc += values
    tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def slot_sum_supported(rows: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether :func:`slot_sum` runs here: CUDA or Triton's CPU interpreter, fp16 / bf16 / fp32 rows with unit
    column stride, fp32 weights."""
    return (
        kernel_runs_on(rows, _slot_sum_kernel)
        and rows.dtype in _DTYPES
        and rows.dim() == 2
        and rows.stride(-1) == 1
        and (scale is None or scale.dtype == torch.float32)
    )


def slot_sum(
    rows: torch.Tensor, row_of_slot: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """rows [S, H], row_of_slot [T, K] (ids in [0, S)), scale [T, K] fp32 or None -> [T, H] in ``out_dtype``."""
    check_kernel_device(rows, "slot sum")
    return _slot_sum(rows, row_of_slot.contiguous(), scale.contiguous() if scale is not None else None, out_dtype)


@liger_custom_op("liger_dspine::slot_sum", mutates_args=())
def _slot_sum(
    rows: torch.Tensor, row_of_slot: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    num_tokens, top_k = row_of_slot.shape
    width = rows.shape[1]
    out = torch.empty(num_tokens, width, dtype=out_dtype, device=rows.device)
    if num_tokens == 0 or width == 0:
        return out
    scaled = scale is not None
    _slot_sum_kernel[(num_tokens, triton.cdiv(width, _BLOCK))](
        rows,
        row_of_slot,
        scale if scaled else row_of_slot,
        out,
        width,
        rows.stride(0),
        K=top_k,
        SCALED=scaled,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return out


@_slot_sum.register_fake
def _(rows, row_of_slot, scale, out_dtype):
    return torch.empty(row_of_slot.shape[0], rows.shape[1], dtype=out_dtype, device=rows.device)
