"""Dynamic rowwise FP8 (float8_e4m3fn) quantisation, the operands of the FP8 GEMMs, in Triton.

Every quantised vector v (a row, a column, or a column within one group of rows) gets one fp32 scale::

    scale = max(amax(|v|), eps) / 448          448: e4m3's largest finite value; eps = 1e-12
    q     = e4m3(clamp(v * inverse, -448, 448))  inverse = 448 / max(amax(|v|), eps), both quotients correctly
                                                rounded fp32; v * inverse in fp32, rounded to nearest-even onto e4m3

so that ``q * scale`` approximates v with a relative error of at most 2^-4 (3 mantissa bits; plus 3 fp32 roundings,
as scale * inverse is 1 within 2^-23), or an absolute error of at most 2^-10 * scale below e4m3's normal range
(|v| < 2^-6 * scale). A product with the inverse, not a division by the scale: the kernels read and write a few
bytes an element, and a correctly rounded division costs about eight instructions an element on a GPU.

Three layouts, each writing the fp8 values and the scales once:

- rows:          x [(B,) M, C] -> q [(B,) M, C], scale [(B,) M]; one read of x (rows in registers, for C <= 8192;
                 a program takes 8192 // C rows, C rounded up to a power of 2). It can also return each column's
                 amax over the M rows ([(B,) C]), which spares the column quantiser of the same x its amax pass.
- columns:       x [..., M, C] -> q [..., C, Mp], scale [..., C]: scaled along M, written transposed (the K-major
                 operand of a backward GEMM), with zero columns from M up to Mp = M rounded up to 16.
- group columns: x [S, C] with group ends offs [E] -> q [C, Sp], scale [E, C]: per group of rows, scaled along
                 its rows and written transposed, each group's block starting at a multiple of 16 (zero-padded; an
                 empty group gets 16 zero columns, and zeros up to Sp after the last); the padded ends come back
                 as int32 offsets [E] (``offs`` of a 2-D x 2-D grouped GEMM along K, whose TMA loads need 16-byte
                 aligned group starts).

The column quantiser is two launches and reads its input twice: the amax (per block of 256 rows x 64 columns,
merged with integer atomic maxima on the fp32 bits, which order like the values as they are non-negative; so it is
deterministic), then the values. The group-column kernel runs one program per (64 columns, group) over the group's
rows, reading them twice likewise.

On a GPU the fp32 -> e4m3 conversion is the hardware's, rounding to nearest-even. Under the interpreter rounding is
done in the kernel, on fp32 bits, before the (then exact) cast to e4m3: Triton's CPU interpreter rounds fp32 -> e4m3
wrongly (ties away from zero, and a lost carry into the exponent near powers of two). The results are
bit-identical to :func:`quantize_rowwise_reference` (torch's own cast) under the interpreter, and on GPUs (the CUDA
test of test_fp8_quantize.py checks it at DeepSeek-V3 widths). On a CPU without the interpreter, and for bf16 on a
CPU (which the interpreter cannot compute), the ops run the torch reference.
"""

import math

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import is_interpreted
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12
ALIGN = 16  # rows per padded block: 16 bytes of fp8
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROW_BLOCK = 8192  # one register-resident pass per row up to this width
_ROW_PROGRAM_ELEMENTS = 8192  # rows kernel: narrower rows share a program, up to this many elements
_FUSED_AMAX_PROGRAMS = 512  # rows kernel with the column amax: programs kept at least (about 4 per SM)
_MAX_AMAX_STEPS = 32  # and at most this many row blocks a program
_COLUMN_BLOCK = 64
_ROW_STEP = 64
_ROWS_PER_PROGRAM = 256  # column kernels: rows of one program (a [256, 64] block), in steps of _ROW_STEP


@triton.jit
def _interpreter_probe():
    pass


if is_interpreted(_interpreter_probe):

    @triton.jit
    def _to_e4m3(y):
        """fp32 y clamped to [-448, 448], rounded to nearest-even onto e4m3's grid and cast (exactly) to e4m3."""
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        # normal range: keep 3 of the 23 mantissa bits, ties to even (a carry moves into the exponent)
        normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
        subnormal = (a + 16384.0) - 16384.0  # multiples of 2^-9: the ulp of fp32 at 2^14
        r = tl.where(a < 0.015625, subnormal, normal)
        return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r).to(tl.float8e4nv)

else:

    @triton.jit
    def _to_e4m3(y):
        """fp32 y rounded to nearest-even onto e4m3 by the hardware's conversion, which saturates to +-448
        (cvt.rn.satfinite: what a clamp to [-448, 448] first gives, without its two instructions an element)."""
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _scale_of(amax):
    return tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def _inverse_of(amax):
    return tl.math.div_rn(448.0, tl.maximum(amax, 1e-12))


@triton.jit
def _quantized(x, inverse):
    """e4m3(clamp(x * inverse, -448, 448)): one product an element (a division would cost a reciprocal, its
    refinement and a slow-path check, which made these kernels instruction-bound)."""
    return _to_e4m3(x * inverse)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, column_amax_ptr, rows, cols, x_batch_stride, x_stride, q_stride, ROWS: tl.constexpr,
    STEPS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, COLUMN_AMAX: tl.constexpr,
):  # fmt: skip
    """x [B, rows, cols] (grid axis 1: the batch); STEPS blocks of ROWS rows a program. With COLUMN_AMAX (ONE_PASS
    only) the program also keeps the largest |x| of each column over its rows and merges it into its batch's
    column_amax_ptr row ([B, cols] int32, fp32 bits) atomically."""
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * x_batch_stride
    q_ptr += batch * rows * q_stride
    scale_ptr += batch * rows
    offsets = tl.arange(0, BLOCK)[None, :]
    column_amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for step in range(STEPS):
        row = (tl.program_id(0).to(tl.int64) * STEPS + step) * ROWS + tl.arange(0, ROWS)
        row_mask = row < rows
        x_rows = x_ptr + row[:, None] * x_stride
        q_rows = q_ptr + row[:, None] * q_stride
        if ONE_PASS:
            mask = row_mask[:, None] & (offsets < cols)
            x = tl.load(x_rows + offsets, mask=mask, other=0.0).to(tl.float32)
            if COLUMN_AMAX:
                column_amax = tl.maximum(column_amax, tl.abs(x))
            amax = tl.max(tl.abs(x), axis=1)
            scale = _scale_of(amax)
            tl.store(q_rows + offsets, _quantized(x, _inverse_of(amax)[:, None]), mask=mask)
        else:
            amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
            for start in range(0, cols, BLOCK):
                mask = row_mask[:, None] & (start + offsets < cols)
                x = tl.load(x_rows + start + offsets, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            row_amax = tl.max(amax, axis=1)
            scale, inverse = _scale_of(row_amax), _inverse_of(row_amax)
            for start in range(0, cols, BLOCK):
                mask = row_mask[:, None] & (start + offsets < cols)
                x = tl.load(x_rows + start + offsets, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_rows + start + offsets, _quantized(x, inverse[:, None]), mask=mask)
        tl.store(scale_ptr + row, scale, mask=row_mask)
    if COLUMN_AMAX:
        merged = tl.max(column_amax, axis=0).to(tl.int32, bitcast=True)
        column = tl.arange(0, BLOCK)
        tl.atomic_max(column_amax_ptr + batch * cols + column, merged, mask=column < cols, sem="relaxed")


@triton.jit
def _column_amax_kernel(
    x_ptr,  # [B, M, C]
    amax_ptr,  # [B, C] int32 (fp32 bits of non-negative values, ordered as integers), zeros in
    rows,
    cols,
    x_batch_stride,
    x_stride,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < cols
    x_base = x_ptr + batch * x_batch_stride
    first = tl.program_id(1).to(tl.int64) * ROWS_PER_PROGRAM
    m = tl.arange(0, BLOCK_M)
    amax = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)  # elementwise over the steps, reduced across rows once
    for step in range(0, ROWS_PER_PROGRAM, BLOCK_M):
        r = first + step + m
        mask = (r < rows)[:, None] & c_mask[None, :]
        x = tl.load(x_base + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    column_amax = tl.max(amax, axis=0)
    tl.atomic_max(amax_ptr + batch * cols + c, column_amax.to(tl.int32, bitcast=True), mask=c_mask)


@triton.jit
def _quantize_columns_kernel(
    x_ptr,  # [B, M, C]
    amax_ptr,  # [B, C] int32 fp32 bits, from _column_amax_kernel
    q_ptr,  # [B, C, Mp] out
    scale_ptr,  # [B, C] out
    rows,
    padded_rows,
    cols,
    x_batch_stride,
    x_stride,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < cols
    amax = tl.load(amax_ptr + batch * cols + c, mask=c_mask, other=0).to(tl.float32, bitcast=True)
    scale, inverse = _scale_of(amax), _inverse_of(amax)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + batch * cols + c, scale, mask=c_mask)
    x_base = x_ptr + batch * x_batch_stride
    q_base = q_ptr + batch * cols * padded_rows
    first = tl.program_id(1).to(tl.int64) * ROWS_PER_PROGRAM
    m = tl.arange(0, BLOCK_M)
    for step in range(0, ROWS_PER_PROGRAM, BLOCK_M):
        r = first + step + m
        mask = (r < rows)[:, None] & c_mask[None, :]
        x = tl.load(x_base + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        out_mask = (r < padded_rows)[:, None] & c_mask[None, :]
        q = _quantized(x, inverse[None, :])
        tl.store(q_base + c[None, :].to(tl.int64) * padded_rows + r[:, None], q, mask=out_mask)


@triton.jit
def _quantize_group_columns_kernel(
    x_ptr,  # [S, C]
    offs_ptr,  # [E] int32 group ends
    padded_offs_ptr,  # [E] int32 padded group ends
    q_ptr,  # [C, Sp] out
    scale_ptr,  # [E, C] out
    groups,
    padded_rows,
    cols,
    x_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    group = tl.program_id(1)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < cols
    start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offs_ptr + group)
    # padded group bounds are multiples of 16: said so, the fp8 stores along rows are 16-byte vectors
    padded_start = tl.multiple_of(tl.load(padded_offs_ptr + group - 1, mask=group > 0, other=0), 16)
    padded_count = tl.multiple_of(tl.load(padded_offs_ptr + group) - padded_start, 16)
    # the last group also zeroes the columns up to Sp (never read by a GEMM, but defined)
    written = tl.where(group == groups - 1, padded_rows - padded_start, padded_count)
    m = tl.arange(0, BLOCK_M)
    amax = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)  # elementwise over the steps, reduced across rows once
    for step in range(0, end - start, BLOCK_M):
        r = (start + step + m).to(tl.int64)
        mask = (r < end)[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    column_amax = tl.max(amax, axis=0)
    scale, inverse = _scale_of(column_amax), _inverse_of(column_amax)
    tl.store(scale_ptr + group.to(tl.int64) * cols + c, scale, mask=c_mask)
    for step in range(0, written, BLOCK_M):
        r = (start + step + m).to(tl.int64)
        mask = (r < end)[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        out = (padded_start + step + m).to(tl.int64)
        out_mask = (step + m < written)[:, None] & c_mask[None, :]
        tl.store(
            q_ptr + c[None, :].to(tl.int64) * padded_rows + out[:, None], _quantized(x, inverse[None, :]), mask=out_mask
        )


_INTERPRETED = is_interpreted(_quantize_rows_kernel)  # the kernels above, decorated under Triton's CPU interpreter


def _use_kernel(x: torch.Tensor) -> bool:
    """The Triton kernels on CUDA, and on a CPU under the interpreter for fp16 / fp32; else the torch reference."""
    return kernel_runs_on(x, _quantize_rows_kernel) and (x.is_cuda or x.dtype != torch.bfloat16)


def _check(x: torch.Tensor, dims: tuple[int, ...], what: str) -> None:
    if x.dtype not in _DTYPES or x.dim() not in dims:
        raise ValueError(
            f"liger-dspine: {what} needs a {' or '.join(f'{d}-D' for d in dims)} fp16/bf16/fp32 tensor, got "
            f"{x.dtype} {tuple(x.shape)}"
        )


def _padded(rows: int) -> int:
    return -(-rows // ALIGN) * ALIGN


# ---- torch references (bit-identical to the kernels) ----


def quantize_rowwise_reference(
    x: torch.Tensor, eps: float = EPS, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (q [..., C] float8_e4m3fn, scale [...] fp32), each row scaled by its amax / 448 (``amax`` [...]
    fp32 when given, else each row's largest |x|)."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1) if x.shape[-1] else xf.new_zeros(x.shape[:-1])
    # a tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal, which can round 1 ulp off
    amax = amax.clamp(min=eps)
    scale = amax / torch.full_like(amax, FP8_MAX)
    inverse = torch.full_like(amax, FP8_MAX) / amax
    q = (xf * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_columns_reference(
    x: torch.Tensor, column_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., M, C] -> (q [..., C, Mp] float8_e4m3fn, scale [..., C] fp32), as :func:`quantize_columns`."""
    amax = None if column_amax is None else column_amax.view(torch.float32).reshape(*x.shape[:-2], x.shape[-1])
    q, scale = quantize_rowwise_reference(x.transpose(-2, -1), amax=amax)
    rows = x.shape[-2]
    out = torch.zeros(*q.shape[:-1], _padded(rows), dtype=FP8_DTYPE, device=x.device)
    out[..., :rows] = q
    return out, scale


def padded_group_offsets(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """(padded group ends [E] int32, Sp) for groups ending at ``offs`` [E] among ``rows`` rows: each group's count
    rounded up to a multiple of 16 (16 for an empty group); Sp = rows rounded up to 16, plus 16 per group, bounds
    the padded total without a host read."""
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    padded = ((counts + ALIGN - 1) // ALIGN).clamp(min=1) * ALIGN
    total = _padded(rows) + ALIGN * offs.shape[0]
    return torch.cumsum(padded, 0).to(torch.int32), total


def quantize_group_columns_reference(
    x: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [S, C], group ends offs [E] -> (q [C, Sp], scale [E, C], padded ends [E] int32), as
    :func:`quantize_group_columns` (a per-group loop; reads the offsets on the host)."""
    padded_ends, total = padded_group_offsets(offs, x.shape[0])
    q = torch.zeros(x.shape[1], total, dtype=FP8_DTYPE, device=x.device)
    scales = []
    ends, padded = offs.tolist(), padded_ends.tolist()
    for group, (end, padded_end) in enumerate(zip(ends, padded)):
        start = ends[group - 1] if group else 0
        padded_start = padded[group - 1] if group else 0
        q_group, scale = quantize_rowwise_reference(x[start:end].t())
        q[:, padded_start : padded_start + end - start] = q_group
        scales.append(scale)
    scale = torch.stack(scales) if scales else x.new_zeros(0, x.shape[1], dtype=torch.float32)
    return q, scale, padded_ends


# ---- custom ops ----


@liger_custom_op("liger_dspine::fp8_quantize_rows", mutates_args=())
def _quantize_rows(x: torch.Tensor, with_column_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, C] or [B, M, C] -> (q, scale, column amax): the last [(B,) C] int32 (fp32 bits of each column's
    largest |x| over its M rows) with_column_amax, else empty."""
    if not _use_kernel(x):
        q, scale = quantize_rowwise_reference(x)
        return q, scale, column_amax_reference(x) if with_column_amax else _no_amax(x)
    *batch_shape, rows, cols = x.shape
    x3 = x if x.dim() == 3 else x.unsqueeze(0)  # any row stride: the last dim is contiguous
    batches = x3.shape[0]
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    column_amax = (
        torch.zeros(*batch_shape, cols, dtype=torch.int32, device=x.device) if with_column_amax else _no_amax(x)
    )
    block = min(triton.next_power_of_2(max(cols, 1)), _MAX_ROW_BLOCK)
    one_pass = cols <= block
    if rows and batches:
        rows_per_block = max(1, _ROW_PROGRAM_ELEMENTS // block)
        blocks = triton.cdiv(rows, rows_per_block)
        # with the column amax, a program takes several blocks: fewer atomic merges, yet enough programs to fill
        # the GPU (at least _FUSED_AMAX_PROGRAMS over all batches)
        steps = 1
        if with_column_amax and one_pass:
            steps = max(1, min(_MAX_AMAX_STEPS, blocks, blocks * batches // _FUSED_AMAX_PROGRAMS))
        _quantize_rows_kernel[(triton.cdiv(blocks, steps), batches)](
            x3, q, scale, column_amax, rows, cols, x3.stride(0), x3.stride(1), q.stride(-2), ROWS=rows_per_block,
            STEPS=steps, BLOCK=block, ONE_PASS=one_pass, COLUMN_AMAX=with_column_amax and one_pass,
            num_warps=8 if rows_per_block * block >= 2048 else 4,
        )  # fmt: skip
    if with_column_amax and not one_pass:  # rows wider than one block: the column kernel's amax pass
        _launch_column_amax(x3, column_amax.view(batches, cols))
    return q, scale, column_amax


@_quantize_rows.register_fake
def _(x, with_column_amax=False):
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    amax_shape = (*x.shape[:-2], x.shape[-1]) if with_column_amax else (0,)
    amax = x.new_empty(amax_shape, dtype=torch.int32)
    return q, x.new_empty(x.shape[:-1], dtype=torch.float32), amax


def _no_amax(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=x.device)


def column_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., M, C] -> [..., C] int32: the fp32 bits of each column's largest |x| (0 for no rows)."""
    if x.shape[-2] == 0:
        return torch.zeros(*x.shape[:-2], x.shape[-1], dtype=torch.int32, device=x.device)
    return x.float().abs().amax(dim=-2).view(torch.int32)


def _launch_column_amax(x3: torch.Tensor, amax: torch.Tensor) -> None:
    """amax [B, C] int32 (zeros in) <- the fp32 bits of each column's largest |x3[b]| ([B, M, C])."""
    batches, rows, cols = x3.shape
    blocks = (triton.cdiv(cols, _COLUMN_BLOCK), triton.cdiv(max(_padded(rows), 1), _ROWS_PER_PROGRAM), batches)
    if batches and cols:
        _column_amax_kernel[blocks](
            x3, amax, rows, cols, x3.stride(0), x3.stride(1), ROWS_PER_PROGRAM=_ROWS_PER_PROGRAM, BLOCK_M=_ROW_STEP,
            BLOCK_C=_COLUMN_BLOCK, num_warps=8,
        )  # fmt: skip


@liger_custom_op("liger_dspine::fp8_quantize_columns", mutates_args=())
def _quantize_columns(x: torch.Tensor, column_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``column_amax`` ([..., C] int32 fp32 bits, from the rows op's pass over the same x) skips the amax pass."""
    if not _use_kernel(x):
        return quantize_columns_reference(x, column_amax)
    batch_shape, (rows, cols) = x.shape[:-2], x.shape[-2:]
    batches = math.prod(batch_shape)
    x3 = x.reshape(batches, rows, cols)
    padded_rows = _padded(rows)
    q = torch.empty(batches, cols, padded_rows, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(batches, cols, dtype=torch.float32, device=x.device)
    if column_amax is None:  # zeros: the amax of no rows is 0 (scale eps / 448)
        amax = torch.zeros(batches, cols, dtype=torch.int32, device=x.device)
        _launch_column_amax(x3, amax)
    else:
        amax = column_amax.reshape(batches, cols)
    if batches and cols:
        blocks = (triton.cdiv(cols, _COLUMN_BLOCK), triton.cdiv(max(padded_rows, 1), _ROWS_PER_PROGRAM), batches)
        _quantize_columns_kernel[blocks](
            x3, amax, q, scale, rows, padded_rows, cols, x3.stride(0), x3.stride(1),
            ROWS_PER_PROGRAM=_ROWS_PER_PROGRAM, BLOCK_M=_ROW_STEP, BLOCK_C=_COLUMN_BLOCK, num_warps=8,
        )  # fmt: skip
    return q.view(*batch_shape, cols, q.shape[-1]), scale.view(*batch_shape, cols)


@_quantize_columns.register_fake
def _(x, column_amax=None):
    *batch, rows, cols = x.shape
    q = torch.empty(*batch, cols, _padded(rows), dtype=FP8_DTYPE, device=x.device)
    return q, x.new_empty(*batch, cols, dtype=torch.float32)


@liger_custom_op("liger_dspine::fp8_quantize_group_columns", mutates_args=())
def _quantize_group_columns(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _use_kernel(x):
        return quantize_group_columns_reference(x, offs)
    rows, cols = x.shape
    groups = offs.shape[0]
    padded_ends, total = padded_group_offsets(offs, rows)
    q = torch.empty(cols, total, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(groups, cols, dtype=torch.float32, device=x.device)
    if groups and cols:
        grid = (triton.cdiv(cols, _COLUMN_BLOCK), groups)
        _quantize_group_columns_kernel[grid](
            x, offs, padded_ends, q, scale, groups, total, cols, x.stride(0), BLOCK_M=_ROW_STEP,
            BLOCK_C=_COLUMN_BLOCK, num_warps=8,
        )  # fmt: skip
    return q, scale, padded_ends


@_quantize_group_columns.register_fake
def _(x, offs):
    total = _padded(x.shape[0]) + ALIGN * offs.shape[0]
    q = torch.empty(x.shape[1], total, dtype=FP8_DTYPE, device=x.device)
    scale = x.new_empty(offs.shape[0], x.shape[1], dtype=torch.float32)
    return q, scale, offs.new_empty(offs.shape[0], dtype=torch.int32)


# ---- checked entry points ----


def quantize_rowwise(x: torch.Tensor, with_column_amax: bool = False):
    """x [M, C] or [B, M, C] fp16/bf16/fp32 -> (q float8_e4m3fn of x's shape, scale [(B,) M] fp32), scaled along the
    last dim; with ``with_column_amax`` also each column's largest |x| over the M rows ([(B,) C] int32, its fp32
    bits) for :func:`quantize_columns` of the same x, found in the same pass."""
    _check(x, (2, 3), "FP8 rowwise quantisation")
    q, scale, column_amax = _quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), with_column_amax)
    return (q, scale, column_amax) if with_column_amax else (q, scale)


def quantize_rowwise_keeping_amax(x: torch.Tensor, with_column_amax: bool):
    """(q, scale, column amax or None): :func:`quantize_rowwise` with one return shape for either flag."""
    q, scale, *column_amax = quantize_rowwise(x, with_column_amax=with_column_amax)
    return q, scale, column_amax[0] if column_amax else None


def quantize_columns(x: torch.Tensor, column_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] or [B, M, C] -> (q [(B,) C, Mp] float8_e4m3fn, scale [(B,) C] fp32): scaled along M, written
    transposed (row c of q holds column c of x), zero from M to Mp = M rounded up to 16. ``column_amax``: what
    :func:`quantize_rowwise` found for this x (the same values), which saves a pass over x."""
    _check(x, (2, 3), "FP8 column quantisation")
    columns = x.shape[-1] * (x.shape[0] if x.dim() == 3 else 1)
    if column_amax is not None and (column_amax.dtype != torch.int32 or column_amax.numel() != columns):
        raise ValueError(
            f"liger-dspine: a column amax for x {tuple(x.shape)} is int32 with one value per column, got "
            f"{column_amax.dtype} {tuple(column_amax.shape)}"
        )
    contiguous = x if x.stride(-1) == 1 and x.stride(-2) >= x.shape[-1] else x.contiguous()
    return _quantize_columns(contiguous, column_amax)


def quantize_group_columns(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [S, C], offs [E] int32 cumulative group ends -> (q [C, Sp] float8_e4m3fn, scale [E, C] fp32, padded ends
    [E] int32): each group's rows scaled along the rows, written transposed at 16-aligned padded offsets."""
    _check(x, (2,), "FP8 group column quantisation")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(
            f"liger-dspine: group offsets must be a 1-D int32 tensor, got {offs.dtype} {tuple(offs.shape)}"
        )
    return _quantize_group_columns(x if x.stride(-1) == 1 else x.contiguous(), offs.contiguous())


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32, scale broadcast along q's last dim (rowwise)."""
    return q.float() * scale[..., None]
